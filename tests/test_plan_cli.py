"""``m2flow plan PROFILE.yaml`` (m2flow/run/plan_cli.py) on a Typer app of its own: the printed
tree/table/runner-ups, --json, --gantt, --nodes, and exit code 2 with one line on bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from m2flow.core.placement import Placement
from m2flow.run.plan_cli import register

PROFILES = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles"
PPO = str(PROFILES / "ppo_4_1_1_1_1.yaml")
CHAIN = str(PROFILES / "synthetic_chain3.yaml")
# Measured on a 2-core machine (an early runtime): every group slower on 2 devices than on 1.
GRPO = str(Path(__file__).resolve().parent / "profiles" / "grpo_slower_on_two.yaml")
# Measured later: the rollout's fit is nearly flat (0.204 s on 1 device, 0.195 s on 2).
FLAT = str(Path(__file__).resolve().parent / "profiles" / "grpo_flat_rollout.yaml")
NAMES = ["rollout", "actor_inference", "critic_inference", "actor_train", "critic_train"]


@pytest.fixture(scope="module")
def app():
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)

    @app.command()
    def other() -> None:  # a second command keeps `plan` a subcommand, as in m2flow's app
        pass

    return app


def run(app, *args):
    return CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "220"})


def test_prints_tree_components_prediction_and_runner_ups(app):
    res = run(app, PPO, "--devices", "64", "--nodes", "8")
    assert res.exit_code == 0, res.stderr
    text = res.stdout
    assert "64 devices on 8 nodes (8 per node)" in text
    assert "plan (spatial): S(" in text and "split" in text and "chunks" in text  # the tree
    assert "components" in text and "granularity (out)" in text and "memory GiB" in text
    for name in NAMES:
        assert name in text
    assert "predicted step:" in text and "prompts/s" in text
    assert "runner-ups" in text and "temporal" in text and "hybrid" in text
    assert "profile fits" in text and "amdahl" in text


def test_json_is_one_document(app):
    res = run(app, PPO, "--devices", "1024", "--nodes", "128", "--json")
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["num_devices"] == 1024 and doc["nodes"] == 128 and doc["devices_per_node"] == 8
    assert doc["mode"] == "auto" and doc["time_s"] > 0
    assert doc["throughput_items_per_s"] == pytest.approx(256 / doc["predicted_step_s"])
    comps = doc["components"]
    assert set(comps) == set(NAMES)
    spans = sorted(tuple(c["devices"]) for c in comps.values())
    idle = doc["idle_devices"]  # the default 1 % slack may leave the last few idle
    assert spans[0][0] == 0 and spans[-1][1] == (idle[0][0] if idle else 1024)
    for c in comps.values():
        a, b = c["devices"]
        assert c["nodes"].split("-")[0] == str(a // 8) and c["memory_bytes"] <= 80 * 2**30
    assert all(ed["granularity"] >= 1 and 256 % ed["granularity"] == 0 for ed in doc["edges"])
    assert len(doc["edges"]) == 7 and doc["runner_ups"]
    assert all(r["time_s"] >= doc["time_s"] for r in doc["runner_ups"])
    assert doc["fits"]["rollout"]["time"]["model"] == "amdahl"


def test_idle_devices_shown_and_no_idle(app):
    res = run(app, GRPO, "--devices", "8")
    assert res.exit_code == 0, res.stderr
    assert "idle: [3, 8) (5 of 8 devices)" in res.stdout and "devices used" in res.stdout
    doc = json.loads(run(app, GRPO, "--devices", "8", "--json").stdout)
    assert doc["allow_idle"] is True and doc["idle_devices"] == [[3, 8]]
    assert max(c["devices"][1] for c in doc["components"].values()) == 3
    full = run(app, GRPO, "--devices", "8", "--no-idle")
    assert full.exit_code == 0, full.stderr
    assert "idle:" not in full.stdout
    full_doc = json.loads(run(app, GRPO, "--devices", "8", "--no-idle", "--json").stdout)
    assert full_doc["allow_idle"] is False and full_doc["idle_devices"] == []
    spans = sorted(tuple(c["devices"]) for c in full_doc["components"].values())
    assert spans[0][0] == 0 and spans[-1][1] == 8
    assert full_doc["time_s"] > doc["time_s"]  # idle devices make this plan faster


def test_slack_leaves_spare_devices_to_a_flat_fit(app):
    """The exact optimum gives the nearly flat rollout 1022 of 1024 devices (reward and actor
    one each, a three-stage pipeline); the default 1 % slack stops it at a handful, for a step
    time within 1 %."""
    exact = json.loads(run(app, FLAT, "-n", "1024", "--slack", "0", "--json").stdout)
    assert exact["slack"] == 0 and exact["idle_devices"] == []
    assert exact["components"]["rollout"]["devices"] == [0, 1022]
    lean = run(app, FLAT, "-n", "1024")
    assert lean.exit_code == 0, lean.stderr
    assert "no component is more than 1% faster on more of them" in lean.stdout
    doc = json.loads(run(app, FLAT, "-n", "1024", "--json").stdout)
    assert doc["slack"] == 0.01
    start, stop = doc["components"]["rollout"]["devices"]
    assert stop - start < 16 and doc["idle_devices"][0][1] == 1024
    assert exact["time_s"] <= doc["time_s"] < 1.01 * exact["time_s"]
    bad = run(app, FLAT, "-n", "8", "--slack", "1.5")
    assert bad.exit_code == 2 and "--slack 1.5" in bad.stderr


@pytest.mark.parametrize("mode", ["temporal", "spatial", "hybrid"])
def test_modes(app, mode):
    res = run(app, CHAIN, "--devices", "8", "--mode", mode, "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["kind"] == mode


def test_gantt_writes_a_png(app, tmp_path):
    out = tmp_path / "step.png"
    res = run(app, CHAIN, "-n", "6", "--mode", "hybrid", "--gantt", str(out))
    assert res.exit_code == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert f"Gantt chart: {out}" in res.stdout


def test_memory_override(app):
    ok = run(app, PPO, "--devices", "16", "--memory-gb", "1000", "--json")
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["capacity_bytes"] == 1000 * 2**30
    tight = run(app, PPO, "--devices", "1024", "--memory-gb", "10")
    assert tight.exit_code == 2 and "does not fit in memory" in tight.stderr


def _point(tmp_path, **values):
    """The chain profile with its inference component's first point (1 device) edited."""
    return _profile(tmp_path, lambda d: d["components"]["inference"]["points"][0].update(values))


def _profile(tmp_path, edit):
    doc = yaml.safe_load(Path(CHAIN).read_text())
    edit(doc)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (lambda tp: ["missing.yaml", "-n", "8"], "does not exist"),
        (lambda tp: [_profile(tp, lambda d: d.update(gpus=1)), "-n", "8"], "unknown keys"),
        (
            lambda tp: [
                _profile(tp, lambda d: d["edges"].append({"src": "train", "dst": "ref"})),
                "-n",
                "8",
            ],
            "'ref'",
        ),
        (lambda tp: [PPO, "-n", "4"], "'actor_train' does not fit in memory"),
        (
            lambda tp: [
                _profile(tp, lambda d: d["components"]["train"].update(min_devices=16)),
                "-n",
                "8",
            ],
            "needs at least 16 devices",
        ),
        (lambda tp: [CHAIN, "-n", "8", "--nodes", "3"], "split evenly over --nodes 3"),
        # a directory, or a name that is neither: what plan expected, not "profiling ... first"
        (lambda tp: [str(tp), "-n", "8"], "is a directory: m2flow plan takes a workflow"),
        (lambda tp: ["no_such_flow", "-n", "8"], "is not a file: m2flow plan takes a workflow"),
        (lambda tp: [CHAIN, "-n", "2", "--mode", "spatial"], "at least 3 devices"),
        (lambda tp: [CHAIN, "-n", "8", "--mode", "fast"], "choose one of"),
        (lambda tp: [CHAIN, "-n", "0"], "at least 1 device"),
        (lambda tp: [CHAIN, "-n", "65537"], "at most 65536 (MAX_DEVICES"),
        # Degenerate profile values: caught when the profile is loaded, named with the fix.
        (lambda tp: [_point(tp, seconds=math.nan), "-n", "8"], "seconds = nan is not a finite"),
        (lambda tp: [_point(tp, seconds=math.inf), "-n", "8"], "seconds = inf is not a finite"),
        (lambda tp: [_point(tp, seconds=-0.5), "-n", "8"], "seconds = -0.5 must be >= 0"),
        (lambda tp: [_point(tp, devices=0), "-n", "8"], "devices = 0 must be >= 1"),
        (lambda tp: [_point(tp, memory_bytes=-1), "-n", "8"], "memory_bytes = -1 must be >= 0"),
        (lambda tp: [_point(tp, seconds=0), "-n", "8"], "seconds = 0 at devices [1] but > 0"),
        (lambda tp: [_point(tp, memory_bytes=0), "-n", "8"], "memory_bytes = 0 at devices [1]"),
        (lambda tp: [_profile(tp, lambda d: d.update(batch_size=0)), "-n", "8"], "batch_size = 0"),
        (
            lambda tp: [
                _profile(tp, lambda d: d["components"]["inference"].update(points=[])),
                "-n",
                "8",
            ],
            "'inference' on at least one device count",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(app, tmp_path, args, match):
    res = run(app, *args(tmp_path))
    assert res.exit_code == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], lines
    assert res.stdout == ""


def test_save_and_gantt_write_into_existing_directories(app, tmp_path):
    """``--save``/``--gantt`` write where they are told; a missing directory is refused with
    one line and nothing is created (a typo must not make a tree)."""
    plan_file, png = tmp_path / "plan.yaml", tmp_path / "step.png"
    res = run(app, CHAIN, "-n", "8", "--save", str(plan_file), "--gantt", str(png))
    assert res.exit_code == 0, res.stderr
    placement = Placement.load(plan_file)
    assert set(placement.groups) == {"rollout", "inference", "train"}
    assert placement.predicted_step_s > 0 and png.stat().st_size > 5000
    assert f"plan file: {plan_file}" in res.stdout
    missing = tmp_path / "no" / "such" / "plan.yaml"
    res = run(app, CHAIN, "-n", "8", "--save", str(missing))
    assert res.exit_code == 2 and "create it first" in res.stderr, res.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("flag", ["--save", "--gantt"])
def test_unwritable_output_exits_2_with_one_line(app, tmp_path, flag):
    (tmp_path / "file").write_text("not a directory")
    target = tmp_path / "file" / "out.png"
    res = run(app, CHAIN, "-n", "8", flag, str(target))
    assert res.exit_code == 2, (res.stdout, res.stderr, res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write {target}"), lines


def test_zero_second_profile_plans(app, tmp_path):
    """Every point at ``seconds: 0`` (the profiler's rounding of a group with nothing
    measurable to do) is a component that costs nothing: it plans; a predicted 0 s step has
    no throughput to print (no division by zero), in text, JSON and the Gantt chart."""

    def free(doc):
        for comp in doc["components"].values():
            for pt in comp["points"]:
                pt["seconds"] = 0

    path = _profile(tmp_path, free)
    png = tmp_path / "zero.png"
    res = run(app, path, "-n", "8", "--gantt", str(png))
    assert res.exit_code == 0, (res.stderr, res.exception)
    assert "predicted step: 0.0000 s" in res.stdout and "throughput unbounded" in res.stdout
    assert png.stat().st_size > 5000
    doc = json.loads(run(app, path, "-n", "8", "--json").stdout)
    assert doc["time_s"] == 0 and doc["throughput_items_per_s"] is None
    zero = {"devices": 1, "seconds": 0, "memory_bytes": 0}
    one = _profile(tmp_path, lambda d: d["components"]["inference"].update(points=[zero]))
    doc = json.loads(run(app, one, "-n", "8", "--json").stdout)
    inference = doc["components"]["inference"]  # costs its switch (0.2 s) when time-shared
    assert inference["time_s"] in (0.0, 0.2) and doc["time_s"] > 0


def test_planning_beyond_the_profiled_devices_warns_and_fit_quality_is_honest(app):
    """A profile measured on 1 and 2 devices planned for 64: one warning line on stderr (the
    fits extrapolate, unchecked), and the fits report no error for an exact 2-point fit
    (not its ~1e-15 residual); a profile with 4+ device counts reports held-out errors."""
    res = run(app, FLAT, "-n", "64", "--json")
    assert res.exit_code == 0, res.stderr
    assert "warning: planning 64 devices from a profile measured on at most 2" in res.stderr
    doc = json.loads(res.stdout)
    assert doc["warnings"] and doc["fits"]["rollout"]["device_counts"] == [1, 2]
    assert doc["fits"]["rollout"]["held_out_error"] is None
    assert "none: exact fit" in run(app, FLAT, "-n", "64").stdout
    assert "warning" not in run(app, FLAT, "-n", "2").stderr  # within the measured counts
    ppo = json.loads(run(app, PPO, "-n", "64", "--json").stdout)
    assert ppo["warnings"] == []
    held_out = ppo["fits"]["rollout"]["held_out_error"]
    assert held_out is not None and 0 < held_out < 0.05
