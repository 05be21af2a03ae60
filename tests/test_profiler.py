"""Profiler and planned runs: the unchanged GRPO runner measured, planned and run on the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from m2flow.scheduler.plan.profile import save_profile
from test_workflow import TINY_RUN

from m2flow.core.config import ConfigError
from m2flow.run.planning import load_profile, plan_from_profile, report
from m2flow.run.profiler import _chunked_placement, profile

pytestmark = pytest.mark.e2e

GRPO = str(Path(__file__).resolve().parent.parent / "workflows" / "grpo.py")
VIRTUAL_DEVICES = 2


@pytest.fixture(scope="module")
def grpo_profile(cluster, tmp_path_factory):
    """The tiny GRPO runner profiled on 1 and 2 devices (one Ray session, three short runs)."""
    out = tmp_path_factory.mktemp("prof")
    lines, saves = [], []
    prof = profile(
        GRPO,
        TINY_RUN
        + [
            f"trainer.run_dir={out / 'run'}",
            "trainer.steps=50",
            "cluster.offload=always",  # switches offload on virtual devices too: measurable
            "trainer.save_every=1000",
            "trainer.eval_every=1000",
        ],
        steps=1,  # one measured step per run: the tests check what is measured, not its noise
        warmup=0,  # (resumed runs still skip their restoring first step)
        chunks=2,
        log=lines.append,
        save=saves.append,
    )
    path = out / "profile.yaml"
    save_profile(prof, path)
    return prof, path, lines, saves


def test_profile_warm_starts_once_and_saves_after_every_run(grpo_profile):
    """Later runs resume the first run's checkpoint (no second warm start), and the profile
    measured so far is handed to ``save`` after each run: the first has the 1-device point
    only, the last is the whole profile."""
    prof, _, lines, saves = grpo_profile
    started = [line for line in lines if line.startswith("profiling ")]
    assert len(started) == 3 and "checkpoint" not in started[0], started
    assert all("(from the first run's checkpoint)" in line for line in started[1:]), started
    assert len(saves) == 3
    assert [p.devices for p in saves[0].components["actor"].points] == [1]
    assert saves[-1] == prof


def test_profile_measures_the_traced_graph(grpo_profile):
    prof, path, _, _ = grpo_profile
    assert prof.batch_size == 4  # prompts the runner puts per step (trainer.prompts_per_step)
    assert {(e.src, e.dst) for e in prof.edges} == {("rollout", "reward"), ("reward", "actor")}
    comps = prof.components
    assert set(comps) == {"rollout", "reward", "actor"}
    for name, c in comps.items():
        assert [p.devices for p in c.points] == [1, 2], name
        assert all(p.seconds > 0 and p.memory_bytes > 0 for p in c.points), name
    # Time-sharing one device, the actor (weights and AdamW state) is really offloaded.
    assert comps["actor"].switch_s > 0
    assert load_profile(path) == prof  # the file round-trips through the planner's schema


@pytest.mark.parametrize("mode", ["temporal", "hybrid"])
def test_planned_run_reports_predicted_and_measured(cluster, grpo_profile, tmp_path, mode):
    """Plan the profile on the cluster's 2 devices, run the runner on that plan, and get the
    predicted-vs-measured report; groups land where the plan put them."""
    from m2flow.run.workflow import run_workflow

    _, path, _, _ = grpo_profile
    run_dir = tmp_path / mode
    session = run_workflow(
        GRPO, TINY_RUN + ["trainer.steps=2", f"trainer.run_dir={run_dir}"], plan=mode,
        profile=path, log=lambda *a: None,
    )  # fmt: skip
    placed = session.placement
    assert placed.mode == mode
    for group, ranks in session.groups.items():
        assert sorted(d for r in ranks for d in r) == placed.groups[group]
    rep = report(session, log=lambda *a: None, skip=1)  # step 2 measured
    assert rep["predicted_step_s"] > 0 and rep["measured_step_s"] > 0
    assert set(rep["measured_busy_s"]) == {"rollout", "reward", "actor"}
    assert (run_dir / "plan_report.json").is_file()


def test_spatial_needs_a_device_per_group(grpo_profile):
    _, path, _, _ = grpo_profile
    with pytest.raises(ConfigError, match="spatial"):
        plan_from_profile(load_profile(path), 2, None, "spatial")


def test_chunk_run_pipelines_sources_against_the_rest():
    """The chunk-overhead run feeds consumers one chunk at a time: sources (fed by the driver
    only) on device 0, the rest time-shared on device 1; temporal on one device when there is
    no second device or no source to split off (a cycle)."""
    chain = {
        "busy": {"rollout": 1.0, "reward": 0.1, "actor": 1.0},
        "edges": [("driver", "rollout", 4), ("rollout", "reward", 4), ("reward", "actor", 4)],
    }
    pl = _chunked_placement(chain, 2, 2)
    assert pl.groups == {"rollout": [0]} and pl.default_devices == [1]
    assert pl.default_granularity == 2
    one = _chunked_placement(chain, 1, 2)
    assert one.groups == {} and one.default_devices == [0] and one.default_granularity == 2
    cycle = {
        "busy": {"env": 1.0, "policy": 1.0},
        "edges": [("driver", "env", 1), ("env", "policy", 4), ("policy", "env", 4)],
    }
    assert _chunked_placement(cycle, 2, 2).default_devices == [0]
