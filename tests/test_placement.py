"""Placement from a plan (m2flow/core/placement.py): each group gets only the devices its leaf uses,
idle devices stay out of every group, and plan files keep that."""

from __future__ import annotations

from pathlib import Path

from m2flow.scheduler.plan.planner import Component, Workflow, plan_workflow
from m2flow.scheduler.plan.profile import load_profile

from m2flow.core.placement import Placement, from_plan
from m2flow.run.planning import plan_from_profile


def _slow_chain():
    """a -> b -> c, M = 4: a and c take n seconds on n devices (slower on more), b takes
    8/n + n/2 (fastest on 4)."""
    comps = [
        Component("a", lambda n: float(n), lambda n: 0.0),
        Component("b", lambda n: 8.0 / n + 0.5 * n, lambda n: 0.0),
        Component("c", lambda n: float(n), lambda n: 0.0),
    ]
    return Workflow(comps, [("a", "b"), ("b", "c")], 4)


def test_groups_get_only_the_devices_they_use(tmp_path):
    wf = _slow_chain()
    plan = plan_workflow(wf, 16)
    used = plan.placement()
    assert len(used["a"]) == 1 and len(used["c"]) == 1  # a and c are fastest on one device
    pl = from_plan(plan, list(wf.edges), wf.batch_size, 16)
    assert pl.groups == {name: list(r) for name, r in used.items()}
    taken = {d for ids in pl.groups.values() for d in ids}
    idle = [d for r in plan.idle(16) for d in r]
    assert idle and taken.isdisjoint(idle) and taken | set(idle) == set(range(16))
    assert "idle: [" in pl.tree
    pl.save(tmp_path / "plan.yaml")  # what `m2flow run plan=FILE` launches from
    assert Placement.load(tmp_path / "plan.yaml").groups == pl.groups
    # Every device used (RLinf's planner): the groups cover all 16.
    full = plan_workflow(wf, 16, allow_idle=False)
    pl_full = from_plan(full, list(wf.edges), wf.batch_size, 16)
    assert sorted(d for ids in pl_full.groups.values() for d in ids) == list(range(16))
    assert "idle" not in pl_full.tree and full.time > plan.time


def test_measured_grpo_profile_uses_one_device_per_group():
    """A GRPO profile measured on a 2-core machine: every group is slower on 2 devices than on
    1, so planning 8 devices gives each group one device and leaves the other 5 idle."""
    prof = load_profile(Path(__file__).resolve().parent / "profiles" / "grpo_slower_on_two.yaml")
    plan, pl = plan_from_profile(prof, 8, None)
    assert set(pl.groups) == {"rollout", "reward", "actor"}
    assert all(len(ids) == 1 for ids in pl.groups.values())
    assert sorted(d for ids in pl.groups.values() for d in ids) == [0, 1, 2]
    assert plan.idle(8) == [range(3, 8)]
    three, _ = plan_from_profile(prof, 3, None)
    assert plan.time == three.time  # 8 devices predict no worse (and no better) than 3
