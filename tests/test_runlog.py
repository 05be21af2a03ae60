"""The run's metrics log across a resume: the redone steps appear once, time goes on."""

from __future__ import annotations

import importlib.util
import json
import math
import time

import pytest

from m2flow.core.config import ConfigError
from m2flow.run.loggers import LOGGERS
from m2flow.run.runlog import RunLog


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


def _step_lines(out: str) -> list[int]:
    return [
        int(line.split()[1].rstrip(":")) for line in out.splitlines() if line.startswith("step ")
    ]


def test_metrics_print_every_log_every_steps_and_at_the_last(tmp_path, capsys):
    with RunLog(tmp_path, 7, log_every=3) as log:
        for step in range(8):
            log.log(step, {"loss": 0.5, "phase": "x" * 200})
        log.log(8, {"heldout_accuracy": 0.5}, echo=True)  # an evaluation: always shown
    out = capsys.readouterr().out
    assert _step_lines(out) == [0, 3, 6, 7, 8]
    assert all(len(line) > 200 for line in out.splitlines()[:4])  # one line each, unwrapped


def test_the_console_line_leaves_out_metrics_without_a_value(tmp_path, capsys):
    """A first run's step-0 line without ``loss=nan val_accuracy=None`` (a skipped warm
    start's); ``metrics.jsonl`` keeps the record as it is."""
    metrics = {"phase": "start", "steps": 0, "loss": float("nan"), "val_accuracy": None,
               "heldout_accuracy": 0.25}  # fmt: skip
    with RunLog(tmp_path, 1) as log:
        log.log(0, metrics)
    assert capsys.readouterr().out == "step 0: phase=start steps=0 heldout_accuracy=0.25\n"
    (record,) = _records(tmp_path / "metrics.jsonl")
    assert math.isnan(record["loss"]) and record["val_accuracy"] is None
    assert {k: v for k, v in record.items() if k not in ("time", "loss")} == {
        "step": 0,
        **{k: v for k, v in metrics.items() if k != "loss"},
    }


def test_the_logger_list_picks_the_sinks(tmp_path, capsys):
    with RunLog(tmp_path / "a", 1, ["jsonl"]) as log:
        log.log(1, {"x": 1.0})
    assert capsys.readouterr().out == ""  # no console
    assert _records(tmp_path / "a" / "metrics.jsonl")[0]["x"] == 1.0
    with RunLog(tmp_path / "b", 1, ["console"]) as log:
        log.log(1, {"x": 1.0})
    assert capsys.readouterr().out == "step 1: x=1\n"
    assert not (tmp_path / "b" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="unknown logger 'csv'"):
        RunLog(tmp_path / "c", 1, ["console", "csv"])


@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow"])
def test_an_optional_logger_writes_offline_or_names_its_extra(tmp_path, name):
    """Installed: it writes under the run directory, offline. Missing: one line naming the
    extra that installs it."""
    module = LOGGERS[name][0]
    if importlib.util.find_spec(module) is None:
        with pytest.raises(ConfigError, match=rf'pip install .*"\.\[{name}\]"'):
            RunLog(tmp_path, 1, ["jsonl", name])
        return
    with RunLog(tmp_path, 2, ["jsonl", name], config={"trainer": {"steps": 2}}) as log:
        log.log(1, {"loss": 0.25, "phase": "warm_start"})
        log.log(2, {"loss": 0.125})
    written = {"tensorboard": "tb", "wandb": "wandb", "mlflow": "mlruns"}[name]
    assert any((tmp_path / written).rglob("*")), f"{name} wrote nothing in {written}/"


class _Later:
    """What RunLog.wait needs of a group call (``wait``), returning after ``seconds``; records
    the bars shown while it runs."""

    def __init__(self, log: RunLog, seconds: float) -> None:
        self.log, self.seconds, self.seen = log, seconds, []

    def wait(self) -> list:
        self.seen = [(t.description, t.total) for t in self.log.progress.tasks]
        time.sleep(self.seconds)
        return ["result"]


def test_a_phase_shows_a_named_bar_whose_eta_is_its_last_duration(tmp_path):
    with RunLog(tmp_path, 3) as log:
        first = _Later(log, 0.3)
        assert log.wait("warm start", first, expected_s=20.0) == ["result"]
        assert first.seen == [("warm start", 20.0)]  # the budget bounds the first ETA
        ev = _Later(log, 0.3)
        log.wait("evaluation", ev)
        assert ev.seen == [("evaluation", None)]  # unknown the first time
        t0 = time.time()
        log.wait("evaluation", ev)  # a second one: its total is this one's duration
        took = time.time() - t0
        again = _Later(log, 0.1)
        log.wait("evaluation", again)
        ((name, total),) = again.seen
        assert name == "evaluation" and ev.seconds <= total <= took  # the last one's seconds
        assert log.progress.tasks == []  # a finished phase leaves no bar
