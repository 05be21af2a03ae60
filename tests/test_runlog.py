"""The run's metrics log across a resume: the redone steps appear once, time goes on."""

from __future__ import annotations

import json

from m2flow.runlog import RunLog


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_drops_the_redone_steps_and_time_continues(tmp_path):
    with RunLog(tmp_path, 6) as log:  # a run checkpointed at step 3, killed after step 5
        for step in range(6):
            log.log(step, {"loss": float(step)}, echo=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "ti')  # torn by the kill
    before = {r["step"]: r["time"] for r in _records_lenient(tmp_path / "metrics.jsonl")}
    with RunLog(tmp_path, 6, resume_step=3) as log:
        for step in (4, 5, 6):
            log.log(step, {"loss": -float(step)}, echo=False)
    records = _records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]  # each step once
    assert [r["loss"] for r in records[4:]] == [-4.0, -5.0, -6.0]  # the redone ones
    times = [r["time"] for r in records]
    assert times == sorted(times) and times[4] >= before[3]  # no restart at 0


def test_a_fresh_log_appends(tmp_path):
    with RunLog(tmp_path, 2) as log:
        log.log(0, {}, echo=False)
    with RunLog(tmp_path, 2) as log:  # no resume step: nothing is dropped
        log.log(1, {}, echo=False)
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl")] == [0, 1]


def _records_lenient(path):
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out
