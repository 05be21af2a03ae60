"""The measured step timeline: the Chrome trace a run writes, its size bound, the step report's
warnings and ``m2flow timeline``.

Real runs of a tiny two-group workflow (tests/workflows/handoff.py) on real Ray; the trace
writer and the report's checks also on their own, on hand-made events."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from m2flow.core import events
from m2flow.core.tracefile import TraceWriter, read_trace
from m2flow.run.cli import app
from m2flow.run.measured import machine, provenance_warnings

VIRTUAL_DEVICES = 1  # both groups on one device: they hand it over
HANDOFF = str(Path(__file__).resolve().parent / "workflows" / "handoff.py")


def _profile(path: Path, measured_on: dict | None) -> Path:
    """A profile of the handoff workflow's two groups (times of the right order)."""
    comp = {"switch_s": 0.004, "points": [{"devices": 1, "seconds": 0.03, "memory_bytes": 1e6}]}
    doc = {
        "workflow": "handoff",
        "batch_size": 4,
        "components": {"gen": comp, "train": {**comp, "points": [
            {"devices": 1, "seconds": 0.02, "memory_bytes": 1e6}]}},
        "edges": [{"src": "gen", "dst": "train", "items_per_step": 4}],
    }  # fmt: skip
    if measured_on is not None:
        doc["measured_on"] = measured_on
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def planned_run(cluster, tmp_path_factory):
    """A 4-step run planned (temporal) from a profile measured on another machine."""
    from m2flow.run.planning import report
    from m2flow.run.workflow import run_workflow

    tmp = tmp_path_factory.mktemp("timeline")
    foreign = {**machine(), "host": "elsewhere", "cpu": "a faster CPU"}
    prof = _profile(tmp / "profile.yaml", foreign)
    run_dir = tmp / "run"
    lines: list[str] = []
    session = run_workflow(
        HANDOFF,
        ["trainer.steps=4", f"trainer.run_dir={run_dir}", "cluster.offload=always"],
        plan="temporal",
        profile=prof,
        log=lines.append,
    )
    rep = report(session, lines.append, skip=1)
    return run_dir, rep, lines


def test_run_writes_a_chrome_trace_with_every_runtime_event(planned_run):
    run_dir, _, _ = planned_run
    trace = json.loads((run_dir / "trace.json").read_text())  # valid JSON, closed
    assert isinstance(trace, list)
    for e in trace:
        assert e["ph"] in ("X", "M", "i") and isinstance(e["pid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float | int) and "step" in e["args"]
    names = {e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert {"driver", "gen", "train"} <= names
    kinds = {e["cat"] for e in trace if e["ph"] == "X"}
    assert {"step", "call", "lock_wait", "offload", "onload", "channel_get", "weight_sync"} <= kinds
    steps = sorted(e["args"]["step"] for e in trace if e["ph"] == "X" and e["cat"] == "step")
    assert steps == [1, 2, 3, 4]
    # each step holds both groups' calls, inside its window
    slices = [e for e in trace if e.get("cat") == "step"]
    win = {e["args"]["step"]: (e["ts"], e["ts"] + e["dur"]) for e in slices}
    for s in (2, 3):
        calls = [e for e in trace if e.get("cat") == "call" and e["args"]["step"] == s]
        assert {e["name"] for e in calls} == {"generate", "train"}
        assert all(win[s][0] <= e["ts"] <= win[s][1] for e in calls)
    summary = [e for e in trace if e.get("name") == "trace summary"][0]["args"]
    assert summary["steps_left_out"] == 0 and summary["events_dropped"] == 0


def test_report_warns_of_a_foreign_profile_and_names_what_it_did_not_price(planned_run):
    run_dir, rep, lines = planned_run
    assert any("measured on another machine" in ln and "elsewhere" in ln for ln in lines)
    assert any(ln.startswith("not priced by the profile") for ln in lines)
    saved = json.loads((run_dir / "plan_report.json").read_text())
    assert saved["warnings"] == rep["warnings"] and saved["plan"]["tree"]
    u = saved["unpriced"]
    assert u["lock_wait_s"] > 0 and u["switch_s"] > 0 and u["switch_priced_s"] == 0.008


def test_timeline_command_prints_the_per_group_difference_and_draws(planned_run):
    run_dir, _, _ = planned_run
    png = run_dir / "t.png"
    res = CliRunner().invoke(app, ["timeline", str(run_dir), "--step", "3", "-o", str(png)])
    assert res.exit_code == 0, res.output
    assert "step 3" in res.output and "gen" in res.output and "train" in res.output
    assert "measured on another machine" in res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    res = CliRunner().invoke(app, ["timeline", str(run_dir), "--json"])
    doc = json.loads(res.output)
    assert doc["step"] == 4
    rows = {r["group"]: r for r in doc["groups"]}
    for g in ("gen", "train"):
        r = rows[g]
        assert r["measured_busy_s"] > 0 and r["predicted_busy_s"] > 0
        assert r["diff_busy_s"] == pytest.approx(r["measured_busy_s"] - r["predicted_busy_s"])
    res = CliRunner().invoke(app, ["timeline", str(run_dir), "--step", "99"])
    assert res.exit_code == 2 and "step 99 is not in the trace" in res.output
    res = CliRunner().invoke(app, ["timeline", str(run_dir.parent)])  # no trace there
    assert res.exit_code == 2 and "trace.json does not exist" in res.output


def test_no_trace_when_off_or_profiling(tmp_path, monkeypatch):
    from m2flow.run.session import Session

    monkeypatch.setenv("M2FLOW_TRACE", "0")
    off = Session()
    off.start_trace(tmp_path)
    monkeypatch.delenv("M2FLOW_TRACE")
    profiling = Session(max_steps=3)
    profiling.start_trace(tmp_path)
    no_dir = Session()
    no_dir.start_trace(None)
    assert off.trace is None and profiling.trace is None and no_dir.trace is None
    assert not (tmp_path / "trace.json").exists() and not events.enabled()


def test_a_second_run_in_the_directory_keeps_the_first_trace(tmp_path):
    for _ in range(2):
        w = TraceWriter(tmp_path / "trace.json", max_bytes=10**6)
        w.mark(1, time.time())
        w.close()
    assert read_trace(tmp_path / "trace.json") and read_trace(tmp_path / "trace.1.json")


def _shipped(wall_s: float, n: int) -> tuple:
    """What a rank ships: ``n`` call events from wall time ``wall_s``, 1 ms apart."""
    evs = [("call", "work", i * 10**6, i * 10**6 + 5 * 10**5, "main", None) for i in range(n)]
    return (int(wall_s * 1e9), 0, 1, evs, 0)


def test_trace_size_is_bounded_and_samples_later_steps(tmp_path):
    path = tmp_path / "trace.json"
    w = TraceWriter(path, max_bytes=60_000)
    try:
        base = time.time()
        for step in range(1, 201):
            w.add("actor", 0, _shipped(base + step, 5))
            w.mark(step, base + step + 0.5)
    finally:
        w.close()
    assert path.stat().st_size <= 60_000
    trace = read_trace(path)
    kept = sorted({e["args"]["step"] for e in trace if e.get("cat") == "call"})
    summary = [e for e in trace if e.get("name") == "trace summary"][0]["args"]
    assert kept[:10] == list(range(1, 11))  # early steps in full
    assert summary["steps_left_out"] > 0 and len(kept) + summary["steps_left_out"] == 200
    late = [s for s in kept if s > 100]
    assert late and all(s % 2 == 0 for s in late)  # then at a falling rate


def test_a_killed_runs_trace_still_reads(tmp_path):
    path = tmp_path / "trace.json"
    w = TraceWriter(path, max_bytes=10**6)
    w.add("actor", 0, _shipped(time.time(), 3))
    w.mark(1, time.time() + 1.0)
    w._file.write('{"name": "torn')  # killed mid-line, never closed
    w._file.flush()
    events.enable(False)
    assert len([e for e in read_trace(path) if e.get("cat") == "call"]) == 3


def test_provenance_warnings():
    here = machine()
    plan = {"measured_on": dict(here), "profiled_devices": {"actor": [1, 2]}}
    assert provenance_warnings(plan, 2, here) == []
    assert provenance_warnings({}, 2, here) == []  # not planned: nothing to compare
    (w,) = provenance_warnings({"profiled_devices": {"actor": [1]}}, 1, here)
    assert "does not say where it was measured" in w
    loaded = {**here, "load_1m": here["load_1m"] * 3 + 5}
    (w,) = provenance_warnings(plan, 2, loaded)
    assert "measured at load" in w
    (w,) = provenance_warnings(plan, 64, here)
    assert "planned for 64 devices" in w and "1, 2 devices" in w


def test_profile_keeps_where_it_was_measured(tmp_path):
    from m2flow.scheduler.plan.profile import ProfileError, load_profile, save_profile

    prof = load_profile(_profile(tmp_path / "p.yaml", machine()))
    assert prof.measured_on == machine(prof.measured_on["load_1m"])
    save_profile(prof, tmp_path / "again.yaml")
    assert load_profile(tmp_path / "again.yaml").measured_on == prof.measured_on
    assert load_profile(_profile(tmp_path / "old.yaml", None)).measured_on is None
    doc = yaml.safe_load((tmp_path / "p.yaml").read_text())
    doc["measured_on"] = "my laptop"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(ProfileError, match="measured_on: give a mapping"):
        load_profile(tmp_path / "bad.yaml")


def _run_dir(tmp_path: Path, name: str = "run") -> Path:
    """A run directory with a trace of one step: an ``actor`` rank's three calls."""
    run_dir = tmp_path / name
    w = TraceWriter(run_dir / "trace.json", max_bytes=10**6)
    try:
        t = time.time()
        w.add("actor", 0, _shipped(t, 3))
        w.mark(1, t + 1.0)
    finally:
        w.close()
        events.enable(False)
    return run_dir


def _events_set(key: str, value, cat: str = "call"):
    def edit(evs: list) -> None:
        for e in evs:
            if e.get("ph") == "X" and e.get("cat") == cat:
                e[key] = value

    return edit


def _drop(key: str):
    def edit(evs: list) -> None:
        for e in evs:
            if e.get("ph") == "X":
                e.pop(key, None)

    return edit


# case -> (edit of the trace's events, or a whole file's text; what the one line names)
BAD_TRACES = {
    "truncated": ("CUT", "no step with events"),
    "not json": ("this is not JSON", "not a Chrome trace"),
    "a list of numbers": ("[1, 2, 3]", "event 1 is int 1, not an object"),
    "a list of lists": ("[[1], [2]]", "event 1 is list [1], not an object"),
    "no ts": (_drop("ts"), "has no 'ts'"),
    "no dur": (_drop("dur"), "has no 'dur'"),
    "no args": (_drop("args"), "has no 'args'"),
    "no pid": (_drop("pid"), "has no 'pid'"),
    "negative duration": (_events_set("dur", -5.0), "has dur -5.0: a duration is >= 0"),
    "NaN duration": (_events_set("dur", math.nan), "has dur nan: not a finite number"),
    "infinite duration": (_events_set("dur", math.inf), "has dur inf: not a finite number"),
    "negative step": (_events_set("dur", -5e6, "step"), "has dur -5000000.0"),
    "NaN step": (_events_set("dur", math.nan, "step"), "has dur nan"),
    "text ts": (_events_set("ts", "x"), "has ts 'x'"),
    "text step number": (
        lambda evs: [e["args"].update(step="1") for e in evs if e.get("cat") == "call"],
        'args.step "1"',
    ),  # fmt: skip
}
BAD_REPORTS = {
    "truncated": ('{"plan": {', "plan_report.json is not valid JSON"),
    "a list": ("[1]", "plan_report.json is an array, not an object"),
    "plan a list": ('{"plan": [1]}', "has plan that is an array"),
    "plan tree of the wrong shape": ('{"plan": {"tree": {"x": 1}}}', "its plan is not one"),
    "prediction as text": ('{"predicted_step_s": "fast"}', "has predicted_step_s 'fast'"),
    "negative prediction": ('{"predicted_step_s": -1.0}', "has predicted_step_s -1.0"),
    "NaN prediction": ('{"predicted_step_s": NaN}', "has predicted_step_s nan"),
    "NaN busy": ('{"predicted_busy_s": {"actor": NaN}}', "has predicted_busy_s.actor nan"),
    "warnings of numbers": ('{"warnings": [1, 2]}', "warnings that are not a list of text"),
}


def _timeline(*args: str):
    return CliRunner().invoke(app, ["timeline", *args])


def _one_line_exit_2(res, named: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception


@pytest.mark.parametrize("case", sorted(BAD_TRACES))
def test_a_malformed_trace_is_one_line_and_exit_2(tmp_path, case):
    """What a damaged or edited trace holds is refused by name: never a traceback, never a
    negative or NaN duration printed as a number."""
    edit, named = BAD_TRACES[case]
    run_dir = _run_dir(tmp_path)
    path = run_dir / "trace.json"
    text = path.read_text()
    if edit == "CUT":
        path.write_text(text[: len(text) // 3])
    elif isinstance(edit, str):
        path.write_text(edit)
    else:
        evs = json.loads(text)
        edit(evs)
        path.write_text(json.dumps(evs))
    _one_line_exit_2(_timeline(str(run_dir)), named)


@pytest.mark.parametrize("case", sorted(BAD_REPORTS))
def test_a_malformed_plan_report_is_one_line_and_exit_2(tmp_path, case):
    text, named = BAD_REPORTS[case]
    run_dir = _run_dir(tmp_path)
    (run_dir / "plan_report.json").write_text(text)
    _one_line_exit_2(_timeline(str(run_dir)), named)


def test_output_into_a_directory_writes_into_it(tmp_path):
    """``-o DIR`` (an existing directory) draws into it, never ``DIR.png`` beside it; a path
    without a suffix is the PNG it says it wrote."""
    run_dir = _run_dir(tmp_path)
    charts = tmp_path / "charts"
    charts.mkdir()
    res = _timeline(str(run_dir), "-o", str(charts))
    assert res.exit_code == 0, res.output
    png = charts / "timeline_step1.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and f"timeline: {png}" in res.output
    assert not (tmp_path / "charts.png").exists()
    res = _timeline(str(run_dir), "-o", str(tmp_path / "plain"))
    assert res.exit_code == 0 and f"timeline: {tmp_path / 'plain.png'}" in res.output
    assert (tmp_path / "plain.png").is_file()
