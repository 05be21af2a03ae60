"""Planner (RLinf Algorithm 1): brute-force agreement, cycles, memory, every cut, device ranges."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from m2flow.scheduler.planner import (
    Component,
    Leaf,
    PlanError,
    Spatial,
    Temporal,
    Workflow,
    plan_workflow,
)


def _brute(names, preds, comp, n, M, cap, shared):
    """Independent exhaustive search of the same plan space (no memo, scalar arithmetic)."""
    if len(names) == 1:
        c = comp[names[0]]
        if n < c.min_devices or c.memory(n) > cap:
            return math.inf
        return c.time(n) + (c.switch_cost if shared else 0.0)
    best = math.inf
    for r in range(1, len(names)):
        for up in itertools.combinations(names, r):
            down = [x for x in names if x not in up]
            if any(p in down for u in up for p in preds[u]):
                continue  # an edge goes D -> U: not an s-t cut
            up = list(up)
            best = min(
                best,
                _brute(up, preds, comp, n, M, cap, True)
                + _brute(down, preds, comp, n, M, cap, True),
            )
            ou = sum(comp[x].chunk_overhead for x in up)
            od = sum(comp[x].chunk_overhead for x in down)
            for nu in range(1, n):
                tu = _brute(up, preds, comp, nu, M, cap, shared)
                td = _brute(down, preds, comp, n - nu, M, cap, shared)
                if math.isinf(tu) or math.isinf(td):
                    continue
                for m in range(1, M + 1):
                    if M % m:
                        continue
                    cu, cd = tu * m / M + ou, td * m / M + od
                    best = min(best, cu + cd + (M / m - 1) * max(cu, cd))
    return best


def _random_case(rng: random.Random):
    k = rng.randint(2, 4)
    names = [f"c{i}" for i in range(k)]
    comps = []
    for name in names:
        a, b, c = rng.uniform(1, 20), rng.uniform(0, 3), rng.choice([0.0, rng.uniform(0, 0.5)])
        mem = rng.uniform(1, 12)
        comps.append(
            Component(
                name,
                lambda n, a=a, b=b, c=c: a / n + b + c * n,
                lambda n, mem=mem: mem / n,
                min_devices=rng.choice([1, 1, 1, 2]),
                switch_cost=rng.choice([0.0, rng.uniform(0, 2)]),
                chunk_overhead=rng.choice([0.0, rng.uniform(0, 0.3)]),
            )
        )
    edges = [(names[i], names[j]) for i in range(k) for j in range(i + 1, k) if rng.random() < 0.5]
    return Workflow(comps, edges, rng.choice([1, 2, 4, 6])), rng.uniform(2, 8)


def test_brute_force_agreement():
    rng = random.Random(0)
    checked = 0
    for _ in range(60):
        wf, cap = _random_case(rng)
        comp = {c.name: c for c in wf.components}
        preds = {c.name: [s for s, d in wf.edges if d == c.name] for c in wf.components}
        for n in range(1, 9 if len(comp) < 4 else 6):
            want = _brute(list(comp), preds, comp, n, wf.batch_size, cap, False)
            if math.isinf(want):
                with pytest.raises(PlanError):
                    plan_workflow(wf, n, cap)
                continue
            got = plan_workflow(wf, n, cap)
            assert math.isclose(got.time, want, rel_tol=1e-9), (wf.edges, n, got.time, want)
            checked += 1
    assert checked > 150


def _c(name, work, fixed=0.0, mem=0.0, **kw):
    return Component(name, lambda n: work / n + fixed, lambda n: mem / n, **kw)


def test_cycle_collapsed():
    wf = Workflow(
        [_c("env", 4), _c("policy", 8), _c("actor", 6)],
        [("env", "policy"), ("policy", "env"), ("policy", "actor")],
        4,
    )
    plan = plan_workflow(wf, 4)
    leaves = plan.leaves()
    assert len(leaves) == 2
    assert {lf.components for lf in leaves} == {("env", "policy"), ("actor",)}
    assert set(plan.breakdown()) == {"env", "policy", "actor"}
    assert set(plan.placement()) == {"env", "policy", "actor"}


def test_memory_forces_devices():
    wf = Workflow([_c("big", 10, mem=4.0), _c("small", 10, mem=0.5)], [("big", "small")], 4)
    plan = plan_workflow(wf, 6, capacity=1.0)
    assert len(plan.placement()["big"]) >= 4
    with pytest.raises(PlanError, match="big"):
        plan_workflow(wf, 3, capacity=1.0)
    with pytest.raises(PlanError, match="big"):
        plan_workflow(Workflow([_c("big", 10, min_devices=8)], [], 1), 4)


def test_non_prefix_cut_wins():
    # Diamond a->b, a->c, b->d, c->d, topological order a, b, c, d. With a fixed per-component
    # cost, the balanced split {a, c} | {b, d} (10 | 10 work) beats every prefix cut.
    wf = Workflow(
        [_c("a", 7, 3), _c("b", 4, 3), _c("c", 3, 3), _c("d", 6, 3)],
        [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")],
        4,
    )
    plan = plan_workflow(wf, 2)
    assert isinstance(plan, Spatial)
    assert {c for lf in plan.upstream.leaves() for c in lf.components} == {"a", "c"}
    assert {c for lf in plan.downstream.leaves() for c in lf.components} == {"b", "d"}


def _check_ranges(node):
    if isinstance(node, Leaf):
        return
    if isinstance(node, Temporal):
        for ch in node.children:
            assert ch.devices == node.devices
            _check_ranges(ch)
    else:
        up, down = node.upstream.devices, node.downstream.devices
        assert up.start == node.devices.start and up.stop == down.start
        assert down.stop == node.devices.stop and len(up) >= 1 and len(down) >= 1
        _check_ranges(node.upstream)
        _check_ranges(node.downstream)


def test_device_ranges():
    rng = random.Random(1)
    kinds = set()
    for _ in range(40):
        wf, cap = _random_case(rng)
        try:
            plan = plan_workflow(wf, 8, cap)
        except PlanError:
            continue
        assert plan.devices == range(0, 8)
        _check_ranges(plan)
        kinds.add(type(plan).__name__)
        assert "Temporal" in str(plan) or "Spatial" in str(plan) or isinstance(plan, Leaf)
    assert {"Temporal", "Spatial"} <= kinds
