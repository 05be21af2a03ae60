"""Profile documents (scheduler/plan/profile.py): the schema, round trip, validation errors, and
the workflow the planner gets from one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from m2flow.scheduler.plan.planner import plan_workflow
from m2flow.scheduler.plan.profile import (
    ProfileError,
    load_profile,
    profile_from_dict,
    save_profile,
    to_workflow,
)

PROFILES = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles"

DOC = """
workflow: grpo
batch_size: 32
item: prompt
device_memory_bytes: 17179869184
edges:
  - {src: rollout, dst: reward, items_per_step: 32}
  - {src: reward, dst: actor, items_per_step: 32}
components:
  rollout:
    min_devices: 1
    max_devices: null
    switch_s: 0.05
    chunk_overhead_s: 0.01
    points:
      - {devices: 1, seconds: 0.40, memory_bytes: 1.2e8}
      - {devices: 2, seconds: 0.22, memory_bytes: 1.2e8}
  reward:
    points:
      - {devices: 1, seconds: 0.05, memory_bytes: 1.0e6}
  actor:
    max_devices: 4
    points:
      - {devices: 1, seconds: 0.9, memory_bytes: 4.0e9}
      - {devices: 2, seconds: 0.5, memory_bytes: 2.5e9}
      - {devices: 4, seconds: 0.3, memory_bytes: 1.75e9}
"""


def _doc():
    return yaml.safe_load(DOC)


def _pt(doc, **values):
    """Edit the rollout's first point (1 device)."""
    doc["components"]["rollout"]["points"][0].update(values)


def test_schema_loads_and_round_trips(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(DOC)
    prof = load_profile(path)
    assert prof.workflow == "grpo" and prof.batch_size == 32 and prof.item == "prompt"
    assert prof.components["rollout"].points[0].memory_bytes == 1.2e8  # "1.2e8" is a number
    assert prof.components["actor"].max_devices == 4
    assert prof.components["reward"].switch_s == 0.0  # defaults
    assert [(e.src, e.dst) for e in prof.edges] == [("rollout", "reward"), ("reward", "actor")]
    save_profile(prof, tmp_path / "q.yaml")
    assert load_profile(tmp_path / "q.yaml") == prof


def test_to_workflow_fits_and_plans():
    prof = profile_from_dict(_doc())
    wf = to_workflow(prof)
    comps = {c.name: c for c in wf.components}
    assert wf.batch_size == 32 and list(wf.edges) == [("rollout", "reward"), ("reward", "actor")]
    assert math.isclose(comps["actor"].time(4), 0.3, rel_tol=0.05)
    assert comps["actor"].memory(2) == pytest.approx(2.5e9, rel=1e-6)  # amdahl: 1e9 + 3e9/n
    assert comps["rollout"].switch_cost == 0.05 and comps["actor"].max_devices == 4
    plan = plan_workflow(wf, 8, prof.device_memory_bytes)
    assert set(plan.placement()) == {"rollout", "reward", "actor"}
    assert len(plan.placement()["actor"]) >= 1


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda d: d["edges"].append({"src": "rollout", "dst": "critic"}),
            "'critic'.*drop the edge",
        ),
        (lambda d: d["components"]["reward"].update(points=[]), "no measured points"),
        (lambda d: d["components"]["reward"].pop("points"), r"missing \['points'\]"),
        (lambda d: d["components"]["rollout"]["points"][0].update(seconds=-1), "seconds.*>= 0"),
        (lambda d: d["components"]["rollout"].update(switch_s=-0.1), "switch_s.*>= 0"),
        (lambda d: d["components"]["rollout"].update(gpus=2), r"unknown keys \['gpus'\]"),
        (lambda d: d.update(batchsize=3), r"unknown keys \['batchsize'\]"),
        (lambda d: d["edges"][0].update(bytes=1), r"edges\[0\]: unknown keys"),
        (lambda d: d["components"]["rollout"]["points"][0].update(cpu=1), "unknown keys"),
        (lambda d: d.pop("batch_size"), r"missing \['batch_size'\]"),
        (lambda d: d.update(batch_size=0), "batch_size = 0 must be >= 1"),
        (lambda d: d.update(batch_size=2.5), "whole number"),
        (lambda d: d["components"]["actor"].update(max_devices=0), "max_devices"),
        (lambda d: d["components"]["actor"].update(min_devices=8), "max_devices=4 < min"),
        (lambda d: d["components"]["rollout"]["points"][1].update(devices=1), "measured twice"),
        (lambda d: d["components"]["rollout"]["points"][0].update(seconds="fast"), "not a num"),
        (lambda d: d["components"]["rollout"]["points"][0].update(seconds=True), "not a finite"),
        (lambda d: d.update(components={}), "at least one component"),
        (lambda d: _pt(d, seconds=math.nan), r"seconds = nan is not a finite"),
        (lambda d: _pt(d, seconds=math.inf), r"seconds = inf is not a finite"),
        (lambda d: _pt(d, devices=0), r"points\[0\]\.devices = 0 must be >= 1"),
        (lambda d: _pt(d, devices=1.5), "whole number"),
        (lambda d: _pt(d, memory_bytes=-1), r"memory_bytes = -1 must be >= 0"),
        (lambda d: _pt(d, memory_bytes=math.nan), r"memory_bytes = nan is not a finite"),
        (lambda d: _pt(d, seconds=0), r"rollout\.points: seconds = 0 at devices \[1\] but > 0"),
        (lambda d: _pt(d, memory_bytes=0), r"memory_bytes = 0 at devices \[1\].*drop them"),
        (lambda d: d["components"]["rollout"].update(min_devices=0), "min_devices = 0"),
        (lambda d: d["components"]["rollout"].update(chunk_overhead_s=-1), "chunk_overhead_s"),
        (lambda d: d.update(step_overhead_s=-0.1), "step_overhead_s = -0.1 must be >= 0"),
        (lambda d: d.update(device_memory_bytes=0), "device_memory_bytes = 0 must be >= 1"),
    ],
)
def test_validation_errors_name_problem_and_fix(edit, match):
    doc = _doc()
    edit(doc)
    with pytest.raises(ProfileError, match=match):
        profile_from_dict(doc)


def test_file_errors(tmp_path):
    with pytest.raises(ProfileError, match="does not exist.*m2flow profile"):
        load_profile(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: [1,\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(bad)
    assert issubclass(ProfileError, ValueError)


@pytest.mark.parametrize("name", ["ppo_4_1_1_1_1.yaml", "synthetic_chain3.yaml"])
def test_example_profiles(name):
    prof = load_profile(PROFILES / name)
    wf = to_workflow(prof)
    assert len(wf.components) == (5 if name.startswith("ppo") else 3)
    if name.startswith("ppo"):
        comps = {c.name: c for c in wf.components}
        # the 4:1:1:1:1 time ratio at 8 devices
        ratio = [comps[n].time(8) / comps["actor_train"].time(8) for n in comps]
        assert ratio == pytest.approx([4, 1, 1, 1, 1], rel=0.05)
        # trainers do not fit on a few devices: memory infeasibility bites
        for n in ("actor_train", "critic_train"):
            assert comps[n].memory(4) > prof.device_memory_bytes >= comps[n].memory(8)
    plan = plan_workflow(wf, 64, prof.device_memory_bytes)
    assert set(plan.placement()) == set(prof.components)


def test_zero_everywhere_is_a_free_component():
    """``seconds: 0`` and ``memory_bytes: 0`` at every point: a component that costs nothing
    (the profiler rounds below 1 us to 0); its fits are 0 and it plans at no cost."""
    doc = _doc()
    for pt in doc["components"]["rollout"]["points"]:
        pt.update(seconds=0, memory_bytes=0)
    prof = profile_from_dict(doc)
    comps = {c.name: c for c in to_workflow(prof).components}
    assert comps["rollout"].time(1) == comps["rollout"].time(64) == 0.0
    assert comps["rollout"].memory(3) == 0.0
    plan = plan_workflow(to_workflow(prof), 8, prof.device_memory_bytes, slack=0.0)
    rollout = next(lf for lf in plan.leaves() if "rollout" in lf.components)
    assert rollout.time == (0.05 if rollout.shared else 0.0)  # its switch, if time-shared
