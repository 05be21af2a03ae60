"""A collapsed cycle split across devices: the cost model of
:mod:`m2flow.scheduler.plan.cycle` on hand-computed cases, its validation, the exact split search,
the planner's choice between time-sharing and splitting, plan documents and timelines, the
profile's ``cycles:`` and the placement's ``sub_batches``. (Brute-force agreement with a
splittable cycle: ``tests/test_planner.py``.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from m2flow.scheduler.plan.cost import INF
from m2flow.scheduler.plan.cycle import CycleCost, CycleError, split_table
from m2flow.scheduler.plan.planner import (
    Component,
    CycleSplit,
    Leaf,
    PlanError,
    Workflow,
    plan_workflow,
)
from m2flow.scheduler.plan.profile import ProfileError, profile_from_dict, to_workflow
from m2flow.scheduler.plan.search import split_min
from m2flow.scheduler.plan.timeline import step_timeline
from m2flow.scheduler.plan.tree import Plan

from m2flow.core.placement import Placement, from_plan


def test_shared_time_adds_the_hand_offs():
    c = CycleCost(("env", "policy"), 2, 2, shared_gap_s=0.3)
    assert c.shared_time(4.0, 2.0) == pytest.approx(4 + 2 + 2 * 0.3)


def test_split_time_hand_computed():
    # One round trip, one sub-batch: the members one after the other, plus the latency.
    c = CycleCost(("env", "policy"), 1, 1, split_gap_s=0.25)
    assert c.split_time(4.0, 2.0, 1) == pytest.approx(6.25)
    # R = 2, k = 2, no overheads: a = 4/2/2 = 1, b = 2/2/2 = 0.5, period max(2, 1, 1.5) = 2;
    # P + a + b + (k-1) max(a, b) = 2 + 1.5 + 1 = 4.5 (time-shared: 6).
    c = CycleCost(("env", "policy"), 2, 2)
    assert c.split_time(4.0, 2.0, 2) == pytest.approx(4.5)
    # With o = 0.1 and g = 0.2: a = (2 - 0.1)/2 + 0.1 = 1.05, b = (1 - 0.1)/2 + 0.1 = 0.55,
    # P = max(2.1, 1.1, 1.8) = 2.1; 2.1 + 1.05 + 0.55 + 0.2 + 1.05 = 4.95.
    c = CycleCost(("env", "policy"), 2, 2, 0.3, 0.2, 0.1)
    assert c.split_time(4.0, 2.0, 2) == pytest.approx(4.95)
    # Latency-bound: a sub-batch's way round (a + b + g) is the period.
    c = CycleCost(("env", "policy"), 3, 2, split_gap_s=2.0)
    a, b = 3 / 3 / 2, 3 / 3 / 2
    assert c.split_time(3.0, 3.0, 2) == pytest.approx(2 * (a + b + 2) + a + b + 2 + a)
    # k = 1 is disjoint devices without overlap: T_A + T_B + R g_sp, whatever o is.
    c = CycleCost(("env", "policy"), 5, 4, 0.0, 0.01, 0.07)
    assert c.split_time(4.0, 2.0, 1) == pytest.approx(6.05)
    # Busy time per member: one extra o per round trip and extra sub-batch.
    assert c.member_busy(4.0, 4) == pytest.approx(4 + 3 * 5 * 0.07)
    # Split scale s = 0.5: the members take half their time-shared busy time when split.
    c = CycleCost(("env", "policy"), 2, 2, 0.3, 0.2, 0.1, split_scale=0.5)
    assert c.split_time(4.0, 2.0, 1) == pytest.approx(0.5 * 6 + 2 * 0.2)
    # a = (1 - 0.1)/2 + 0.1 = 0.55, b = (0.5 - 0.1)/2 + 0.1 = 0.3, P = max(1.1, 0.6, 1.05);
    # 1.1 + 0.55 + 0.3 + 0.2 + 0.55 = 2.7.
    assert c.split_time(4.0, 2.0, 2) == pytest.approx(2.7)
    assert c.member_busy(4.0, 2) == pytest.approx(0.5 * 4 + 2 * 0.1)


def test_split_time_vectorised_and_monotone():
    c = CycleCost(("env", "policy"), 4, 8, 0.1, 0.02, 0.01)
    ta = np.linspace(0.5, 5, 30)
    for k in (1, 2, 4, 8):
        v = c.split_time(ta, 2.0, k)
        assert np.all(np.diff(v) >= -1e-12)  # nondecreasing in T_A
        assert np.all(np.diff(v, 2) >= -1e-9)  # convex (evenly spaced T_A)
        assert v == pytest.approx([c.split_time(float(x), 2.0, k) for x in ta])
    # Pipelining wins when both members are heavy; latency-bound tiny members do not split.
    assert c.split_time(4.0, 4.0, 8) < c.split_time(4.0, 4.0, 1) < c.shared_time(4.0, 4.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"members": ("env",)}, "two distinct members"),
        ({"members": ("env", "env")}, "two distinct members"),
        ({"round_trips": 0.5}, "round_trips"),
        ({"round_trips": math.nan}, "round_trips"),
        ({"batch": 0}, "batch"),
        ({"batch": 2.5}, "batch"),
        ({"shared_gap_s": -1.0}, "shared_gap_s"),
        ({"split_gap_s": math.nan}, "split_gap_s"),
        ({"sub_batch_overhead_s": -0.1}, "sub_batch_overhead_s"),
        ({"split_scale": 0.0}, "split_scale"),
        ({"split_scale": 1.5}, "split_scale"),
    ],
)
def test_cycle_cost_validation(kwargs, match):
    args = {"members": ("env", "policy"), "round_trips": 2.0, **kwargs}
    with pytest.raises(CycleError, match=match):
        CycleCost(**args)


def _table(rng, n_max):
    n = np.arange(n_max + 1, dtype=float)
    n[0] = 1
    if rng.random() < 0.5:
        t = rng.uniform(0, 3) + rng.uniform(0, 30) / n + rng.choice([0, 0.3]) * n
    else:
        t = rng.uniform(0, 10, n_max + 1)  # neither convex nor monotone
    t[0] = INF
    if rng.random() < 0.3:
        t[1 : rng.integers(1, n_max)] = INF
    return t


def test_split_search_matches_every_split():
    """split_table/split_min: bisection on convex minorants equals trying every split (same
    cost and tie-breaks), and the cost is the formula at the chosen split."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n_max = int(rng.integers(2, 40))
        gaps = (float(rng.choice([0.0, rng.uniform(0, 0.3)])) for _ in range(3))
        c = CycleCost(("a", "b"), float(rng.choice([1, 3, 17])), int(rng.choice([1, 4, 12])), *gaps,
                      float(rng.choice([1.0, rng.uniform(0.2, 1)])))  # fmt: skip
        ta, tb = _table(rng, n_max), _table(rng, n_max)
        ks = c.sub_batches

        def f(u, d, v, c=c, ks=ks):
            return c.split_time(u[0], d[0], ks[v].astype(float))

        fast = split_min([ta], [tb], f, ks.size, exhaustive_splits=0)
        slow = split_min([ta], [tb], f, ks.size, exhaustive_splits=10**9)
        for got, want in zip(fast, slow):
            assert np.allclose(got, want, rtol=1e-9), (got, want)
        cost, n_a, k = split_table(c, ta, tb)
        for n in range(n_max + 1):
            vals = [
                c.split_time(ta[j], tb[n - j], kk)
                for j in range(1, n)
                for kk in ks
                if np.isfinite(ta[j]) and np.isfinite(tb[n - j])
            ]
            want = min(vals, default=INF)
            if math.isinf(want):
                assert math.isinf(cost[n]) and n_a[n] == -1 and k[n] == -1
                continue
            assert cost[n] == pytest.approx(want, rel=1e-9)
            assert c.split_time(ta[n_a[n]], tb[n - n_a[n]], k[n]) == pytest.approx(cost[n])


def _lin(name, work, fixed=0.0, **kw):
    return Component(name, lambda n: work / n + fixed, lambda n: 0.0, **kw)


def _embodied(cost: CycleCost, env=2.0, policy=2.0, actor=0.5):
    """env <-> policy (constant times: no faster on more devices), then the actor."""
    comps = [_lin("env", 0.0, env), _lin("policy", 0.0, policy), _lin("actor", actor)]
    edges = [("env", "policy"), ("policy", "env"), ("env", "actor")]
    return Workflow(comps, edges, 4, (cost,))


def test_planner_splits_a_cycle_when_it_is_faster():
    cc = CycleCost(("env", "policy"), 32, 8, 0.01, 0.001, 0.0005)
    plan = plan_workflow(_embodied(cc), 3, slack=0.0)
    splits = [n for n in _walk(plan) if isinstance(n, CycleSplit)]
    assert len(splits) == 1
    cyc = splits[0]
    assert cyc.name == "env+policy" and cyc.round_trips == 32
    assert cyc.upstream.components == ("env",) and cyc.downstream.components == ("policy",)
    # k = 4: a = b = (2/32 - 0.0005)/4 + 0.0005 = 0.016, period 4a = 0.064, so
    # 31 * 0.064 + 2 * 0.016 + 0.001 + 3 * 0.016 = 2.065; k = 8 pays more overhead (2.12125),
    # k = 2 overlaps less (2.0795), time-shared 2 + 2 + 32 * 0.01 = 4.32.
    assert cyc.chunks == 4 and cyc.granularity == 2
    assert cyc.time == pytest.approx(2.065)
    assert [cc.split_time(2.0, 2.0, k) for k in (2, 8)] == pytest.approx([2.0795, 2.12125])
    assert cc.shared_time(2.0, 2.0) == pytest.approx(4.32)
    # The leaves report each member's busy time with the sub-batch overheads.
    assert cyc.upstream.component_times[0] == pytest.approx(cc.member_busy(2.0, 4))
    assert set(plan.placement()) == {"env", "policy", "actor"}
    # Time-sharing is forced by mode=temporal; the cycle then pays its hand-offs.
    t = plan_workflow(_embodied(cc), 3, slack=0.0, mode="temporal")
    assert not any(isinstance(n, CycleSplit) for n in _walk(t))
    lf = next(lf for lf in t.leaves() if len(lf.components) == 2)
    assert lf.time == pytest.approx(cc.shared_time(2.0, 2.0))


def test_planner_time_shares_when_splitting_does_not_pay():
    # Tiny members, a large split latency: every round trip waits on the channel.
    cc = CycleCost(("env", "policy"), 32, 8, 0.0001, 0.05, 0.01)
    plan = plan_workflow(_embodied(cc, 0.1, 0.1), 3, slack=0.0)
    assert not any(isinstance(n, CycleSplit) for n in _walk(plan))
    # ... and with one device nothing can split.
    cc = CycleCost(("env", "policy"), 32, 8, 0.01, 0.0, 0.0)
    plan = plan_workflow(_embodied(cc), 1)
    assert not any(isinstance(n, CycleSplit) for n in _walk(plan))


def test_no_cycle_cost_keeps_the_cycle_collapsed():
    wf = _embodied(CycleCost(("env", "policy"), 2))
    plain = Workflow(wf.components, wf.edges, wf.batch_size)
    plan = plan_workflow(plain, 3)
    assert not any(isinstance(n, CycleSplit) for n in _walk(plan))


def test_cycle_cost_must_name_a_cycle():
    comps = [_lin("a", 1.0), _lin("b", 1.0), _lin("c", 1.0)]
    wf = Workflow(comps, [("a", "b"), ("b", "c")], 2, (CycleCost(("a", "b"), 2),))
    with pytest.raises(PlanError, match="not one cycle of the graph"):
        plan_workflow(wf, 2)


def test_hybrid_accepts_a_split_cycle_as_its_spatial_part():
    cc = CycleCost(("env", "policy"), 8, 4)
    wf = _embodied(cc)
    two = Workflow(wf.components[:2], wf.edges[:2], 4, (cc,))
    plan = plan_workflow(two, 3, mode="spatial")
    assert isinstance(plan, CycleSplit)
    plan = plan_workflow(wf, 3, mode="hybrid")
    assert plan.kind() == "hybrid"


def _walk(node: Plan):
    yield node
    for c in node._children():
        yield from _walk(c)


def test_plan_document_timeline_and_placement(tmp_path):
    cc = CycleCost(("env", "policy"), 32, 8, 0.01, 0.001, 0.0005)
    wf = _embodied(cc)
    res = plan_workflow(wf, 3, slack=0.0, runner_ups=True)
    plan = res.plan
    doc = plan.to_dict()
    back = Plan.from_dict(yaml.safe_load(yaml.safe_dump(doc)))
    assert back.signature() == plan.signature() and back.to_dict() == doc
    assert "Cycle env+policy" in str(plan) and "C(env | policy)" in plan.shape()
    tl = step_timeline(plan)
    assert max(b.end for b in tl.bars) == pytest.approx(plan.time)
    # Placement: each member on its own devices; both get the sub-batch size as their
    # granularity, not that of the edge leaving the cycle.
    pl = from_plan(plan, list(wf.edges), wf.batch_size, 3)
    assert pl.sub_batches == {"env": 2, "policy": 2}
    assert set(pl.groups["env"]).isdisjoint(pl.groups["policy"])
    assert pl.granularity_for("env", None, default=8) == 2
    pl.save(tmp_path / "plan.yaml")
    assert Placement.load(tmp_path / "plan.yaml").sub_batches == pl.sub_batches
    # Time-shared: the members are listed with None (their whole share).
    shared = plan_workflow(wf, 3, mode="temporal")
    pl = from_plan(shared, list(wf.edges), wf.batch_size, 3)
    assert pl.sub_batches == {"env": None, "policy": None}
    assert pl.granularity_for("env", None, default=8) == 8


def test_placement_cycle_member_without_sub_batches_keeps_its_share():
    """A hand-written plan (no sub_batches): a cycle member's call granularity is its whole
    share, never the granularity of an edge leaving the cycle."""
    pl = Placement(
        mode="hybrid",
        granularity={"env->policy": 4, "policy->env": 4, "env->actor": 2},
    )
    assert pl.granularity_for("env", None, default=64) == 64
    assert pl.granularity_for("env", "actor", default=64) == 2
    pl = Placement(mode="hybrid", granularity={"rollout->actor": 2})
    assert pl.granularity_for("rollout", None, default=64) == 2  # not on a cycle: as before
    pl = Placement(mode="hybrid", sub_batches={"env": 16, "policy": 16})
    assert pl.granularity_for("env", None, default=64) == 16


PROFILE = {
    "batch_size": 4,
    "edges": [
        {"src": "env", "dst": "policy", "items_per_step": 33},
        {"src": "policy", "dst": "env", "items_per_step": 33},
        {"src": "env", "dst": "actor", "items_per_step": 1},
    ],
    "components": {
        n: {"points": [{"devices": 1, "seconds": s, "memory_bytes": 1e6}]}
        for n, s in (("env", 1.5), ("policy", 1.0), ("actor", 0.4))
    },
    "cycles": [
        {
            "members": ["env", "policy"],
            "round_trips": 33,
            "batch": 64,
            "shared_gap_s": 0.003,
            "split_gap_s": 0.001,
            "sub_batch_overhead_s": 0.0002,
            "split_scale": 0.9,
        }
    ],
}


def test_profile_cycles_round_trip():
    prof = profile_from_dict(PROFILE)
    assert prof.cycles == [CycleCost(("env", "policy"), 33.0, 64, 0.003, 0.001, 0.0002, 0.9)]
    doc = yaml.safe_load(yaml.safe_dump(prof.to_dict()))
    assert doc["cycles"] == PROFILE["cycles"]
    assert profile_from_dict(doc) == prof
    wf = to_workflow(prof)
    assert tuple(wf.cycles) == tuple(prof.cycles)
    plan = plan_workflow(wf, 3)
    assert any(isinstance(n, CycleSplit) for n in _walk(plan))
    # Without `cycles:` (an older profile) the cycle stays time-shared.
    old = {k: v for k, v in PROFILE.items() if k != "cycles"}
    assert "cycles" not in profile_from_dict(old).to_dict()
    plan = plan_workflow(to_workflow(profile_from_dict(old)), 3)
    assert not any(isinstance(n, CycleSplit) for n in _walk(plan))
    assert any(isinstance(lf, Leaf) and len(lf.components) == 2 for lf in plan.leaves())


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"members": ["env"]}, r"cycles\[0\]\.members"),
        ({"members": ["env", "critic"]}, r"cycles\[0\]\.members"),
        ({"round_trips": 0}, r"cycles\[0\]\.round_trips"),
        ({"batch": 0}, r"cycles\[0\]\.batch"),
        ({"split_gap_s": -1}, r"cycles\[0\]\.split_gap_s"),
        ({"split_scale": 2}, "split_scale must be in"),
        ({"members": ["env", "env"]}, "two distinct members"),
        ({"speed": 1}, "speed"),
    ],
)
def test_profile_cycles_validation(edit, match):
    doc = {**PROFILE, "cycles": [{**PROFILE["cycles"][0], **edit}]}
    with pytest.raises(ProfileError, match=match):
        profile_from_dict(doc)


def test_measured_embodied_profile_splits_the_cycle():
    """The profile `m2flow profile workflows/embodied.py cluster.devices_per_node=3` measured
    (benchmarks/profiles/embodied_3dev.yaml): on 3 devices the planner splits env <-> policy
    (one sub-batch: the measured extra-sub-batch cost outweighs the overlap) and predicts it
    faster than time-sharing; on 1 device it cannot split."""
    from pathlib import Path

    from m2flow.scheduler.plan.profile import load_profile

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles" / "embodied_3dev.yaml"
    prof = load_profile(path)
    (cc,) = prof.cycles
    res = plan_workflow(to_workflow(prof), 3, prof.device_memory_bytes, runner_ups=True)
    (cyc,) = [n for n in _walk(res.plan) if isinstance(n, CycleSplit)]
    assert cyc.chunks == 1 and cyc.granularity == cc.batch
    assert set(res.plan.placement()["env"]).isdisjoint(res.plan.placement()["policy"])
    temporal = min(p.time for p in res.runner_ups if p.kind() in ("temporal", "single"))
    assert res.plan.time < temporal
    one = plan_workflow(to_workflow(prof), 1, prof.device_memory_bytes)
    assert not any(isinstance(n, CycleSplit) for n in _walk(one))
