"""Planner (RLinf Algorithm 1): brute-force agreement in every mode (with and without idle
devices, bisecting or not), a chain of spatial stages costed as one flow shop however it nests,
the split search, cycles, memory, every cut, device ranges, idle devices, max_devices, edge
granularity, plan documents, timelines."""

from __future__ import annotations

import itertools
import json
import math
import random
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from m2flow.scheduler.plan import planner as planner_module
from m2flow.scheduler.plan import search as search_module
from m2flow.scheduler.plan import tables as tables_module
from m2flow.scheduler.plan.cost import (
    convex_minorant,
    divisors,
    flow_shop_time,
    pipelined_time,
    spatial_time,
)
from m2flow.scheduler.plan.cycle import CycleCost
from m2flow.scheduler.plan.planner import (
    DEFAULT_SLACK,
    Component,
    CycleSplit,
    Leaf,
    Plan,
    PlanError,
    PlanResult,
    Spatial,
    Temporal,
    Workflow,
    plan_workflow,
    predicted_time,
)
from m2flow.scheduler.plan.profile import load_profile, to_workflow
from m2flow.scheduler.plan.search import split_query
from m2flow.scheduler.plan.timeline import step_timeline

PROFILES = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles"


def _brute(names, preds, comp, n, M, cap, shared, idle=True, slack=0.0):
    """Independent exhaustive search of the same plan space (no memo, scalar arithmetic).

    A plan is a stage (:func:`_brute_stages`: a leaf or a temporal node) or a chain of two or
    more stages on disjoint devices (every spatial node of a plan flattened), costed as one
    pipeline: ``sum t_i + (k - 1) max t_i`` over its stages' chunk times in ``k`` chunks.
    ``idle``: a leaf given n devices may use any k <= n of them (feasible at k): the fewest
    whose time is within ``slack`` of the fastest such k; otherwise k = n. Returns {set of
    compositions used: best cost}, e.g. {frozenset({"T", "S"}): 3.5}."""
    best = dict(_brute_stages(names, preds, comp, n, M, cap, shared, idle, slack))
    for m in divisors(M):
        k = M // m
        for kinds, total, slowest in _brute_chains(
            names, preds, comp, n, M, cap, shared, idle, slack, k
        ):
            value = total + (k - 1) * slowest
            if value < best.get(kinds | {"S"}, math.inf):
                best[kinds | {"S"}] = value
    return best


def _cuts(names, preds):
    """Every s-t cut (U, D) of ``names``: U nonempty, no edge D -> U."""
    for r in range(1, len(names)):
        for up in itertools.combinations(names, r):
            down = [x for x in names if x not in up]
            if not any(p in down for u in up for p in preds[u]):
                yield list(up), down


def _brute_stages(names, preds, comp, n, M, cap, shared, idle, slack):
    """{kinds: best cost} of the plans of ``names`` whose top is not spatial: a leaf (a
    component, or a cycle time-shared or split) or a temporal node of any two plans."""
    if len(names) == 1:
        c = comp[names[0]]
        if isinstance(c, _Cycle):
            return _brute_cycle(c, n, cap, shared, idle, slack)
        best_t = _leaf_best([c], n, cap, idle, slack)
        if math.isinf(best_t):
            return {}
        return {frozenset(): best_t + (c.switch_cost if shared else 0.0)}
    best: dict[frozenset, float] = {}
    for up, down in _cuts(names, preds):
        bu = _brute(up, preds, comp, n, M, cap, True, idle, slack)
        bd = _brute(down, preds, comp, n, M, cap, True, idle, slack)
        for (ku, vu), (kd, vd) in itertools.product(bu.items(), bd.items()):
            kinds = ku | kd | {"T"}
            if vu + vd < best.get(kinds, math.inf):
                best[kinds] = vu + vd
    return best


def _brute_chains(names, preds, comp, n, M, cap, shared, idle, slack, k):
    """``(kinds, sum of chunk times, slowest chunk)`` of every chain of two or more stages of
    ``names`` on n devices in k chunks: a first stage (a cut's upstream) on n_U devices, then
    one stage or a chain on the rest. A stage's chunk takes ``(T - o) / k + o`` (T measured as
    one chunk, o its members' overhead per chunk)."""
    out = []
    for up, down in _cuts(names, preds):
        ou = sum(comp[x].chunk_overhead for x in up)
        od = sum(comp[x].chunk_overhead for x in down)
        for nu in range(1, n):
            first = _brute_stages(up, preds, comp, nu, M, cap, shared, idle, slack)
            rest = [
                (kd, (td - od) / k + od, (td - od) / k + od)
                for kd, td in _brute_stages(
                    down, preds, comp, n - nu, M, cap, shared, idle, slack
                ).items()
            ]
            if len(down) > 1:
                rest += _brute_chains(down, preds, comp, n - nu, M, cap, shared, idle, slack, k)
            for ku, tu in first.items():
                cu = (tu - ou) / k + ou
                out += [(ku | kd, cu + s, max(cu, mu)) for kd, s, mu in rest]
    return out


def _leaf_best(members, n, cap, idle, slack, extra=0.0):
    """Seconds of ``members`` time-shared on at most ``n`` devices (exactly n without
    ``idle``): the fewest devices within ``slack`` of the fastest; ``extra`` seconds added."""
    times = []  # the time of every feasible k, increasing k
    for k in range(1, n + 1) if idle else [n]:
        us = [k if c.max_devices is None else min(k, c.max_devices) for c in members]
        need = max(max(1, c.min_devices) for c in members)
        if k >= need and sum(c.memory(u) for c, u in zip(members, us)) <= cap:
            times.append(sum(c.time(u) for c, u in zip(members, us)) + extra)
    fastest = min(times, default=math.inf)
    return next((t for t in times if t <= (1 + slack) * fastest), math.inf)


@dataclass(frozen=True)
class _Cycle:
    """A collapsed two-member cycle for :func:`_brute`: its members (leader first) and cost."""

    members: tuple
    cost: CycleCost

    @property
    def chunk_overhead(self):
        return sum(c.chunk_overhead for c in self.members)

    @property
    def switch_cost(self):
        return sum(c.switch_cost for c in self.members)


def _brute_cycle(cyc, n, cap, shared, idle, slack):
    """A cycle node on n devices: time-shared (no composition, hand-offs ``R * g_sh`` added)
    or split (a spatial composition): every leader/follower device split and every sub-batch
    count, scalar arithmetic of the formula in :mod:`m2flow.scheduler.plan.cycle`."""
    cc, sw = cyc.cost, (cyc.switch_cost if shared else 0.0)
    out = {}
    t = _leaf_best(list(cyc.members), n, cap, idle, slack, cc.round_trips * cc.shared_gap_s)
    if not math.isinf(t):
        out[frozenset()] = t + sw
    r, o, g, s = cc.round_trips, cc.sub_batch_overhead_s, cc.split_gap_s, cc.split_scale
    best = math.inf
    for j in range(1, n):
        ta = _leaf_best([cyc.members[0]], j, cap, idle, slack)
        tb = _leaf_best([cyc.members[1]], n - j, cap, idle, slack)
        if math.isinf(ta) or math.isinf(tb):
            continue
        for k in divisors(cc.batch):
            a, b = (s * ta / r - o) / k + o, (s * tb / r - o) / k + o
            period = max(k * a, k * b, a + b + g)
            best = min(best, (r - 1) * period + a + b + g + (k - 1) * max(a, b) + sw)
    if not math.isinf(best):
        out[frozenset({"S"})] = best
    return out


def _mode_best(by_kinds, mode):
    allowed = {
        "auto": lambda k: True,
        "temporal": lambda k: k <= {"T"},
        "spatial": lambda k: k <= {"S"},
        "hybrid": lambda k: k == {"T", "S"},
    }[mode]
    return min((v for k, v in by_kinds.items() if allowed(k)), default=math.inf)


def _random_case(rng: random.Random):
    k = rng.randint(2, 4)
    names = [f"c{i}" for i in range(k)]
    comps = []
    for name in names:
        a, b, c = rng.uniform(1, 20), rng.uniform(0, 3), rng.choice([0.0, rng.uniform(0, 0.5)])
        mem = rng.uniform(1, 12)
        grows = rng.random() < 0.25  # a per-device cache: fits on few devices only
        comps.append(
            Component(
                name,
                lambda n, a=a, b=b, c=c: a / n + b + c * n,
                (lambda n, mem=mem: mem * n / 8) if grows else (lambda n, mem=mem: mem / n),
                min_devices=rng.choice([1, 1, 1, 2]),
                switch_cost=rng.choice([0.0, rng.uniform(0, 2)]),
                chunk_overhead=rng.choice([0.0, rng.uniform(0, 0.3)]),
                max_devices=rng.choice([None, None, None, 3]),
            )
        )
    edges = [(names[i], names[j]) for i in range(k) for j in range(i + 1, k) if rng.random() < 0.5]
    return Workflow(comps, edges, rng.choice([1, 2, 4, 6])), rng.uniform(2, 8)


def _cases(seed, count, idle=True, slack=0.0):
    rng = random.Random(seed)
    for _ in range(count):
        wf, cap = _random_case(rng)
        comp = {c.name: c for c in wf.components}
        preds = {c.name: [s for s, d in wf.edges if d == c.name] for c in wf.components}
        for n in range(1, 9 if len(comp) < 4 else 6):
            by_kinds = _brute(list(comp), preds, comp, n, wf.batch_size, cap, False, idle, slack)
            yield wf, cap, n, by_kinds


def _check_leaves(plan, wf, n, cap, idle):
    """Every leaf: its range lies in [0, n), its k devices are feasible (min_devices, memory
    at the k it uses), its members' times and memory are taken at that k."""
    comp = {c.name: c for c in wf.components}
    for lf in plan.leaves():
        k = len(lf.devices)
        assert 0 <= lf.devices.start and lf.devices.stop <= n
        for name, t, mem, u in zip(
            lf.components, lf.component_times, lf.component_memory, lf.component_devices
        ):
            c = comp[name]
            assert k >= c.min_devices and u == (
                k if c.max_devices is None else min(k, c.max_devices)
            )
            assert mem == c.memory(u) and mem <= cap
            assert math.isclose(t, c.time(u) + (c.switch_cost if lf.shared else 0.0))
    if not idle:
        assert plan.idle(n) == [] and plan.devices == range(0, n)


def _agrees(wf, cap, n, by_kinds, kw):
    """The planner's plan for ``kw["mode"]``, checked against the brute force's best time and
    kinds; ``None`` where the brute force finds no plan (the planner must refuse too)."""
    mode = kw["mode"]
    want = _mode_best(by_kinds, mode)
    if math.isinf(want):
        with pytest.raises(PlanError):
            plan_workflow(wf, n, cap, **kw)
        return None
    got = plan_workflow(wf, n, cap, **kw)
    assert math.isclose(got.time, want, rel_tol=1e-9), (wf.edges, n, mode, got.time, want)
    used = {{"temporal": "T", "spatial": "S"}[k] for k in got.kinds()}
    assert _mode_best({frozenset(used): 0.0}, mode) == 0.0, (mode, got.kinds())
    return got


@pytest.mark.parametrize(
    "idle, slack", [(True, 0.0), (True, 0.2), (False, 0.0)], ids=["idle", "idle-slack", "no-idle"]
)
@pytest.mark.parametrize("mode", ["auto", "temporal", "spatial", "hybrid"])
def test_brute_force_agreement(mode, idle, slack):
    checked = idles = 0
    kw = {"mode": mode, "allow_idle": idle, "slack": slack}
    for wf, cap, n, by_kinds in _cases(0, 60, idle, slack):
        got = _agrees(wf, cap, n, by_kinds, kw)
        if got is None:
            continue
        _check_leaves(got, wf, n, cap, idle)
        _check_ranges(got)
        idles += bool(got.idle(n))
        checked += 1
    assert checked > {"auto": 150, "temporal": 150, "spatial": 100, "hybrid": 30}[mode]
    least = {"auto": 10, "temporal": 20, "spatial": 5, "hybrid": 1}[mode]
    assert (idles > least) if idle else idles == 0  # the enlarged space is exercised


@pytest.mark.parametrize("mode", ["auto", "spatial"])
def test_brute_force_agreement_by_bisection(mode, monkeypatch):
    """The same agreement with the chain search bisecting at every size (its windows, lower
    bounds and nested floor searches), not bounding every split as it does below 192 devices."""
    for mod in (tables_module, search_module):
        monkeypatch.setattr(mod, "EXHAUSTIVE_SPLITS", 0)
    checked = 0
    kw = {"mode": mode, "allow_idle": True, "slack": 0.0}
    for wf, cap, n, by_kinds in _cases(5, 30):
        checked += _agrees(wf, cap, n, by_kinds, kw) is not None
    assert checked > 50


def _cycle_cases(seed, count, idle=True, slack=0.0):
    """Random workflows whose first two components form a cycle with a :class:`CycleCost`
    (leader either one), with up to two more components around it."""
    rng = random.Random(seed)
    for _ in range(count):
        wf, cap = _random_case(rng)
        comps = list(wf.components)
        a, b = comps[0].name, comps[1].name
        lead = rng.choice([(a, b), (b, a)])
        r = rng.choice([1.0, 3.0, 8.0])
        gaps = [rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in range(3)]
        scale = rng.choice([1.0, rng.uniform(0.3, 1.0)])
        cc = CycleCost(lead, r, rng.choice([1, 2, 4, 6]), *gaps, scale)
        edges = sorted({*wf.edges, (a, b), (b, a)})
        wf = Workflow(comps, edges, wf.batch_size, (cc,))
        unit = {c.name: (f"{a}+{b}" if c.name in (a, b) else c.name) for c in comps}
        by_name = {c.name: c for c in comps}
        comp = {c.name: c for c in comps[2:]}
        comp[f"{a}+{b}"] = _Cycle((by_name[lead[0]], by_name[lead[1]]), cc)
        preds = {
            u: sorted({unit[s] for s, d in edges if unit[d] == u and unit[s] != u}) for u in comp
        }
        for n in range(1, 8):
            by_kinds = _brute(list(comp), preds, comp, n, wf.batch_size, cap, False, idle, slack)
            yield wf, cap, n, by_kinds


@pytest.mark.parametrize(
    "idle, slack", [(True, 0.0), (True, 0.2), (False, 0.0)], ids=["idle", "idle-slack", "no-idle"]
)
@pytest.mark.parametrize("mode", ["auto", "temporal", "spatial", "hybrid"])
def test_brute_force_agreement_with_a_splittable_cycle(mode, idle, slack):
    """The same agreement when a cycle may split across devices (:mod:`.cycle`): the brute
    force tries time-sharing and every leader/follower split and sub-batch count."""
    checked = splits = 0
    kw = {"mode": mode, "allow_idle": idle, "slack": slack}
    for wf, cap, n, by_kinds in _cycle_cases(1, 40, idle, slack):
        got = _agrees(wf, cap, n, by_kinds, kw)
        if got is None:
            continue
        _check_ranges(got)
        splits += _has_split(got)
        checked += 1
    assert checked > {"auto": 100, "temporal": 100, "spatial": 60, "hybrid": 20}[mode]
    assert (splits > 5) if mode != "temporal" else splits == 0


def _has_split(plan) -> bool:
    if isinstance(plan, CycleSplit):
        return True
    return any(_has_split(c) for c in plan._children()) if not isinstance(plan, Leaf) else False


def test_runner_ups_are_mode_bests():
    """Runner-ups hold each mode's optimum; the best is the auto optimum; all distinct (with
    the default slack)."""
    seen_kinds = set()
    for wf, cap, n, by_kinds in _cases(2, 25, slack=DEFAULT_SLACK):
        if math.isinf(_mode_best(by_kinds, "auto")):
            continue
        res = plan_workflow(wf, n, cap, runner_ups=True)
        assert isinstance(res, PlanResult)
        assert math.isclose(res.time, _mode_best(by_kinds, "auto"), rel_tol=1e-9)
        times = [p.time for p in res.runner_ups]
        assert times == sorted(times) and all(t >= res.time * (1 - 1e-12) for t in times)
        shapes = [(p.shape(), str(p)) for p in (res.plan, *res.runner_ups)]
        assert len(set(shapes)) == len(shapes)
        for mode in ("temporal", "spatial", "hybrid"):
            want = _mode_best(by_kinds, mode)
            if math.isinf(want):
                continue
            got = min(p.time for p in (res.plan, *res.runner_ups) if _in_mode(p, mode))
            assert math.isclose(got, want, rel_tol=1e-9), (mode, got, want)
            seen_kinds.add(mode)
    assert seen_kinds == {"temporal", "spatial", "hybrid"}


def _in_mode(plan, mode):
    k = plan.kind()
    return {"temporal": ("temporal", "single"), "spatial": ("spatial", "single")}.get(
        mode, ("hybrid",)
    ).__contains__(k)


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
    """A node's range is the devices its leaves use: temporal children start with it and the
    widest ends with it; spatial children are adjacent and disjoint."""
    if isinstance(node, Leaf):
        assert len(node.devices) >= 1
        return
    if isinstance(node, Temporal):
        for ch in node.children:
            assert ch.devices.start == node.devices.start and ch.devices.stop <= node.devices.stop
            _check_ranges(ch)
        assert max(ch.devices.stop for ch in node.children) == node.devices.stop
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
        for idle in (True, False):
            try:
                plan = plan_workflow(wf, 8, cap, allow_idle=idle)
            except PlanError:
                continue
            assert plan.devices.start == 0 and plan.devices.stop <= 8
            assert plan.idle(8) == ([range(plan.devices.stop, 8)] if plan.devices.stop < 8 else [])
            if not idle:
                assert plan.devices == range(0, 8)
            _check_ranges(plan)
            kinds.add(type(plan).__name__)
            assert "Temporal" in str(plan) or "Spatial" in str(plan) or isinstance(plan, Leaf)
    assert {"Temporal", "Spatial"} <= kinds


def test_slower_on_more_devices_leaves_them_idle():
    """Hand-checked: a and b take n seconds on n devices (slower on more), M = 2."""
    slow = [Component(x, lambda n: float(n), lambda n: 0.0) for x in ("a", "b")]
    wf = Workflow(slow, [("a", "b")], 2)
    # Idle allowed: a on 1 device, b on 1, pipelined in 2 chunks of 1 item:
    # t_U = t_D = 1/2, T = 1/2 + 1/2 + (2 - 1) * 1/2 = 1.5; devices 2 and 3 idle.
    res = plan_workflow(wf, 4, runner_ups=True)
    assert res.time == 1.5 and isinstance(res.plan, Spatial) and res.plan.granularity == 1
    assert res.plan.placement() == {"a": range(0, 1), "b": range(1, 2)}
    assert res.idle() == [range(2, 4)] and res.to_dict()["idle_devices"] == [[2, 4]]
    assert "split 1+1" in str(res.plan)
    # All devices used (RLinf): the best is the 2+2 split, 1 + 1 + 1 = 3 s.
    full = plan_workflow(wf, 4, allow_idle=False, runner_ups=True)
    assert full.time == 3.0 and full.plan.placement() == {"a": range(0, 2), "b": range(2, 4)}
    assert full.idle() == [] and full.to_dict()["idle_devices"] == [] and not full.allow_idle
    # One component: 1 s on 1 device beats 4 s on 4; temporal mode may idle devices too.
    one = plan_workflow(Workflow(slow[:1], [], 2), 4)
    assert one.time == 1.0 and one.devices == range(0, 1) and one.idle(4) == [range(1, 4)]
    temporal = plan_workflow(wf, 4, mode="temporal")
    assert temporal.time == 2.0 and temporal.placement() == {"a": range(0, 1), "b": range(0, 1)}


def test_memory_is_checked_at_the_devices_used():
    # Faster on fewer devices, but needs >= 4 to fit (4/n bytes, capacity 1): uses exactly 4.
    a = Component("a", lambda n: float(n), lambda n: 4.0 / n)
    plan = plan_workflow(Workflow([a], [], 1), 6, capacity=1.0)
    assert plan.devices == range(0, 4) and plan.time == 4.0
    assert plan.leaves()[0].component_memory == (1.0,)
    # Faster on more devices, but a per-device cache (n bytes) fits on <= 2 of 6: uses 2.
    b = Component("b", lambda n: 4.0 / n, lambda n: float(n))
    plan = plan_workflow(Workflow([b], [], 1), 6, capacity=2.0)
    assert plan.devices == range(0, 2) and plan.time == 2.0 and plan.memory() == {"b": 2.0}
    with pytest.raises(PlanError, match=r"feasible device counts.*'b': '1\.\.2'.*allow_idle"):
        plan_workflow(Workflow([b], [], 1), 6, capacity=2.0, allow_idle=False)
    # Feasible at 1-2 and 5-6 only, fastest at 6 > 5 > 2 > 1: the envelope skips the hole.
    c = Component("c", lambda n: 10.0 - n, lambda n: 0.0 if n in (1, 2, 5, 6) else 9.0)
    for n, k in [(2, 2), (3, 2), (4, 2), (5, 5), (6, 6)]:
        plan = plan_workflow(Workflow([c], [], 1), n, capacity=1.0)
        assert plan.devices == range(0, k) and plan.time == 10.0 - k, (n, plan)


def _pipelined_queries(pu, pd, o_u, o_d, chunks):
    """split_query arguments for U -> D pipelined (the two-stage chain) for every (k, n):
    queries ``k``-major, the bound on the tables' convex minorants."""
    n_max = len(pu) - 1
    ns = np.arange(2, n_max + 1)
    kk, nn = np.repeat(chunks.astype(float), ns.size), np.tile(ns, chunks.size)
    hu, hd = convex_minorant(pu)[0], convex_minorant(pd)[0]
    (fa, la), (fb, lb) = (_finite_span(h) for h in (hu, hd))  # the bound finite on the range

    def bound(q):
        return lambda j: pipelined_time(hu[j], hd[nn[q] - j], o_u, o_d, kk[q])

    def exact(q, j, cap):
        with np.errstate(invalid="ignore"):
            v = pipelined_time(pu[j], pd[nn[q] - j], o_u, o_d, kk[q])
        return np.where(np.isfinite(pu[j]) & np.isfinite(pd[nn[q] - j]), v, math.inf), pu[j]

    lo = np.maximum(np.maximum(fa, nn - lb), 1)
    return lo, np.minimum(np.minimum(la, nn - fb), nn - 1), bound, exact, nn


def _finite_span(p):
    fin = np.flatnonzero(np.isfinite(p[1:])) + 1
    return (int(fin[0]), int(fin[-1])) if fin.size else (1, 0)


def test_split_search_matches_exhaustive():
    """search.split_query (bisection on a convex bound + windows) against its exhaustive mode
    and against every split, on the two-stage pipelined cost over convex, non-convex,
    non-monotone tables and tables with infeasible holes; with ``group`` (per n, only the best
    k exact) the best of every group is exact and every lower bound holds."""
    rng = np.random.default_rng(0)

    def table(n_max):
        n = np.arange(n_max + 1, dtype=float)
        n[0] = 1
        kind = rng.integers(0, 6)
        if kind == 0:
            t = rng.uniform(0, 5) + rng.uniform(0, 50) / n + rng.choice([0, 0.2]) * n
        elif kind == 1:
            t = rng.uniform(0, 10, n_max + 1)
        elif kind == 2:
            t = np.maximum.accumulate(rng.uniform(0, 3, n_max + 1)[::-1])[::-1]
        elif kind == 3:
            t = rng.uniform(0, 5) + rng.uniform(0, 50) / np.minimum(n, rng.integers(1, n_max + 1))
        elif kind == 4:  # planner envelope of a + b/n + c*n: convex, flat after its minimum
            t = rng.uniform(0, 5) + rng.uniform(0, 20) / n + rng.uniform(0, 2) * n
            t = np.minimum.accumulate(np.r_[math.inf, t[1:]])
        else:  # envelope of a rising power law: constant
            t = np.minimum.accumulate(np.r_[math.inf, rng.uniform(0.1, 1) * n[1:] ** 0.3])
        t[0] = math.inf
        if rng.random() < 0.3:
            t[1 : rng.integers(1, n_max)] = math.inf
        if rng.random() < 0.2:
            t[rng.integers(1, n_max + 1, size=3)] = math.inf
        return t

    for _ in range(400):
        n_max, batch = int(rng.integers(2, 30)), int(rng.choice([1, 4, 6, 12, 32]))
        chunks = np.array([batch // m for m in divisors(batch)[::-1]])
        pu, pd = table(n_max), table(n_max)
        o_u, o_d = (float(rng.choice([0.0, rng.uniform(0, 0.5)])) for _ in range(2))
        lo, hi, bound, exact, nn = _pipelined_queries(pu, pd, o_u, o_d, chunks)
        fast = split_query(lo, hi, bound, exact)
        slow = split_query(lo, hi, bound, exact, exhaustive=True)
        for got, want in zip(fast, slow):  # same costs, and the same tie-breaks
            assert np.allclose(got, want, rtol=1e-9, equal_nan=True)
        value, j, payload, lower = fast
        assert np.array_equal(value, lower)  # every query exact
        want = np.full(value.size, math.inf)
        for q, (n, k) in enumerate(zip(nn, np.repeat(chunks, n_max - 1))):
            js = np.arange(1, n)
            ok = np.isfinite(pu[js]) & np.isfinite(pd[n - js])
            if ok.any():
                want[q] = float(pipelined_time(pu[js][ok], pd[n - js][ok], o_u, o_d, k).min())
        assert np.allclose(value, want, rtol=1e-9)
        fin = np.isfinite(value)
        assert np.all(j[~fin] == -1) and np.array_equal(payload[fin], pu[j[fin]])
        got = exact(np.flatnonzero(fin), j[fin], None)[0]
        assert np.allclose(got, value[fin], rtol=1e-12)
        # group = n: per n, the least value over k is exact; every lower bound holds
        v_g, _, _, low_g = split_query(lo, hi, bound, exact, group=nn)
        assert np.all(low_g <= want * (1 + 1e-9) + 1e-12) and np.all(low_g <= v_g)
        for n in range(2, n_max + 1):
            at = nn == n
            assert math.isclose(v_g[at].min(), want[at].min(), rel_tol=1e-9) or (
                math.isinf(v_g[at].min()) and math.isinf(want[at].min())
            )


def test_planner_search_equals_exhaustive_at_scale(monkeypatch):
    """Whole plans at 200 devices: the bisection split search and trying every split agree,
    with and without idle devices (every component is fastest well below 200 devices)."""
    names = ["r", "a", "c", "t", "u"]
    comps = [
        Component(
            n,
            lambda k, w=w, f=f, g=g: w / k + f + g * k,
            lambda k, w=w: 50.0 + 400.0 * w / 100 / k,
            switch_cost=s,
            chunk_overhead=0.03,
            max_devices=mx,
        )
        for n, w, f, s, mx, g in zip(
            names, [400, 100, 90, 120, 100], [1, 0.5, 0.4, 1, 0.8], [2, 1, 0, 3, 3],
            [None, 64, None, None, 150], [0.1, 0.05, 0.5, 0.1, 0.3],
        )
    ]  # fmt: skip
    edges = [("r", "a"), ("r", "c"), ("r", "t"), ("a", "t"), ("c", "t"), ("c", "u")]
    wf = Workflow(comps, edges, 48)
    times = {}
    for mode, idle in itertools.product(("auto", "hybrid"), (True, False)):
        kw = {"capacity": 80.0, "mode": mode, "runner_ups": True, "allow_idle": idle, "slack": 0.0}
        for mod in (tables_module, search_module):  # bisection everywhere
            monkeypatch.setattr(mod, "EXHAUSTIVE_SPLITS", 0)
        fast = plan_workflow(wf, 200, **kw)
        for mod in (tables_module, search_module):  # every split
            monkeypatch.setattr(mod, "EXHAUSTIVE_SPLITS", 10**12)
        slow = plan_workflow(wf, 200, **kw)
        monkeypatch.undo()
        for p, q in zip((fast.plan, *fast.runner_ups), (slow.plan, *slow.runner_ups)):
            assert math.isclose(p.time, q.time, rel_tol=1e-9), (p.shape(), q.shape())
        assert len(fast.runner_ups) == len(slow.runner_ups)
        times[mode, idle] = fast.time
        assert bool(fast.idle()) == idle
    assert all(times[m, True] < times[m, False] for m in ("auto", "hybrid"))  # idling pays


def test_max_devices_uses_only_that_many():
    calls = []

    def t(n):
        calls.append(n)
        return 8.0 / n

    wf = Workflow([Component("a", t, lambda n: 0.0, max_devices=2)], [], 4)
    plan = plan_workflow(wf, 8, allow_idle=False)
    assert plan.time == 4.0 and max(calls) == 2  # time(8) is time(2): never asked beyond 2
    assert plan.leaves()[0].component_devices == (2,) and plan.devices == range(0, 8)
    plan = plan_workflow(wf, 8)  # idle allowed: the leaf holds only the 2 it uses
    assert plan.time == 4.0 and plan.devices == range(0, 2) and plan.idle(8) == [range(2, 8)]
    with pytest.raises(PlanError, match="max_devices=1 is below min_devices=2"):
        plan_workflow(Workflow([Component("a", t, t, min_devices=2, max_devices=1)], [], 4), 4)


def test_slack_keeps_a_flat_component_lean():
    """t(k) = 1 + 0.1/k on 1024 devices: the exact optimum takes all 1024 for a 1 % gain over
    10; with slack = 1 % the component uses the fewest devices within 1 % of its fastest:
    0.1/k <= 1.01 * (1 + 0.1/1024) - 1 holds from k = 10."""
    wf = Workflow([Component("rollout", lambda n: 1.0 + 0.1 / n, lambda n: 0.0)], [], 8)
    exact = plan_workflow(wf, 1024, slack=0.0)
    assert exact.devices == range(0, 1024) and math.isclose(exact.time, 1.0 + 0.1 / 1024)
    lean = plan_workflow(wf, 1024, runner_ups=True)  # the default, 1 %
    assert lean.slack == 0.01 and lean.to_dict()["slack"] == 0.01
    assert lean.plan.devices == range(0, 10) and lean.idle() == [range(10, 1024)]
    assert math.isclose(lean.time, 1.01) and lean.time <= 1.01 * exact.time
    assert plan_workflow(wf, 9).devices == range(0, 5)  # t(5) = 1.02 <= 1.01 * t(9) = 1.0212
    # Without idle devices the component takes what it is given: the slack has no say.
    assert plan_workflow(wf, 1024, allow_idle=False, slack=0.5).devices == range(0, 1024)
    with pytest.raises(PlanError, match=r"slack must be in \[0, 1\)"):
        plan_workflow(wf, 8, slack=1.0)


def test_modes_explain_infeasibility():
    wf = Workflow([_c("a", 4), _c("b", 4), _c("c", 4)], [("a", "b"), ("b", "c")], 4)
    with pytest.raises(PlanError, match=r"spatial mode.*3 components \(a, b, c\).*got 2"):
        plan_workflow(wf, 2, mode="spatial")
    with pytest.raises(PlanError, match="hybrid mode needs.*3 components"):
        plan_workflow(Workflow(wf.components[:2], [("a", "b")], 4), 4, mode="hybrid")
    with pytest.raises(PlanError, match="mode must be one of"):
        plan_workflow(wf, 4, mode="fastest")
    # a's footprint grows with its devices (say, a per-device cache): fits on <= 2 of 4
    grow = Component("a", lambda n: 4.0 / n, lambda n: float(n))
    wf2 = Workflow([grow, _c("b", 4)], [("a", "b")], 4)
    assert len(plan_workflow(wf2, 4, capacity=2.0).placement()["a"]) <= 2
    with pytest.raises(PlanError, match="temporal mode runs every component on all 4 devices"):
        plan_workflow(wf2, 4, capacity=2.0, mode="temporal", allow_idle=False)
    # idle allowed: temporal, a on the 2 devices it fits on, b on all 4
    plan = plan_workflow(wf2, 4, capacity=2.0, mode="temporal")
    assert plan.placement() == {"a": range(0, 2), "b": range(0, 4)} and plan.kind() == "temporal"
    big = Workflow([_c("a", 4, mem=8.0), _c("b", 4)], [("a", "b")], 4)
    with pytest.raises(PlanError, match=r"'a' does not fit in memory.*1\.\.2.*capacity 3"):
        plan_workflow(big, 2, capacity=3.0)


def test_edge_granularity_and_memory():
    # a -> b spatial, b <-> c cycle (one leaf), c -> d temporal with the cycle
    wf = Workflow(
        [_c("a", 40, mem=1.0), _c("b", 4), _c("c", 4), _c("d", 4), _c("e", 40)],
        [("a", "b"), ("b", "c"), ("c", "b"), ("c", "d"), ("d", "d"), ("a", "e")],
        8,
    )
    plan = plan_workflow(wf, 6)
    gran = plan.edge_granularity(wf.edges, wf.batch_size)
    assert set(gran) == set(wf.edges)
    assert gran[("b", "c")] == gran[("c", "b")] == gran[("d", "d")] == 8  # one leaf: coalesced
    leaves = {c: lf for lf in plan.leaves() for c in lf.components}
    assert leaves["b"] is leaves["c"]
    for (s, d), m in gran.items():
        assert wf.batch_size % m == 0
        if leaves[s] is not leaves[d] and leaves[s].devices == leaves[d].devices:
            assert m == 8  # same devices: they share a temporal node
    mem = plan.memory()
    assert mem["a"] == pytest.approx(1.0 / len(plan.placement()["a"]))
    with pytest.raises(PlanError, match="'zz' is not in the plan"):
        plan.edge_granularity([("a", "zz")], 8)


def test_plan_document_round_trip():
    rng = random.Random(3)
    seen = set()
    for _ in range(12):
        wf, cap = _random_case(rng)
        try:
            res = plan_workflow(wf, 6, cap, runner_ups=True)
        except PlanError:
            continue
        doc = json.loads(json.dumps(res.to_dict()))
        back = PlanResult.from_dict(yaml.safe_load(yaml.safe_dump(doc)))
        assert back == res
        assert Plan.from_dict(res.plan.to_dict()) == res.plan
        assert doc["time_s"] == res.time and doc["kind"] == res.plan.kind()
        assert {(e["src"], e["dst"]) for e in doc["edges"]} == set(wf.edges)
        seen.add(type(res.plan).__name__)
    assert {"Temporal", "Spatial"} <= seen
    with pytest.raises(PlanError, match=r"plan\.upstream: missing key 'time_s'"):
        Plan.from_dict(
            {
                "type": "spatial",
                "devices": [0, 2],
                "time_s": 1.0,
                "upstream": {"type": "leaf", "devices": [0, 1]},
            }
        )
    with pytest.raises(PlanError, match="'pipeline' is not one of"):
        Plan.from_dict({"type": "pipeline", "devices": [0, 2], "time_s": 1.0})


def test_timeline_ends_at_the_predicted_time():
    rng = random.Random(4)
    for _ in range(30):
        wf, cap = _random_case(rng)
        try:
            res = plan_workflow(wf, 7, cap, runner_ups=True)
        except PlanError:
            continue
        sw = {c.name: c.switch_cost for c in wf.components}
        ov = {c.name: c.chunk_overhead for c in wf.components}
        for plan in (res.plan, *res.runner_ups):
            for max_bars in (20000, 1):  # detailed and coarse drawings
                tl = step_timeline(plan, sw, ov, max_bars=max_bars)
                assert math.isclose(tl.end, plan.time, rel_tol=1e-9), plan.shape()
                assert len(tl.rows) == len(plan.leaves())
                for row in range(len(tl.rows)):  # a row never does two things at once
                    spans = sorted((b.start, b.end) for b in tl.bars if b.row == row)
                    assert all(e <= s2 + 1e-9 for (_, e), (s2, _) in zip(spans, spans[1:]))


def test_ppo_shape_at_1024_devices():
    """Smoke check of the benchmark case (RLinf 4:1:1:1:1): plans, every component placed."""
    names = ["rollout", "actor_inference", "critic_inference", "actor_train", "critic_train"]
    work = dict(zip(names, [400, 100, 100, 100, 100]))
    comps = [_c(n, work[n], 1.0, mem=400.0, switch_cost=2.0, chunk_overhead=0.05) for n in names]
    edges = [("rollout", n) for n in names[1:]]
    edges += [("actor_inference", "actor_train"), ("critic_inference", "actor_train")]
    edges += [("critic_inference", "critic_train")]
    res = plan_workflow(Workflow(comps, edges, 256), 1024, capacity=80.0, runner_ups=True)
    assert set(res.plan.placement()) == set(names)
    assert all(len(r) >= 5 for r in res.plan.placement().values())  # 400/n <= 80
    kinds = {p.kind() for p in res.runner_ups} | {res.plan.kind()}
    assert kinds == {"temporal", "spatial", "hybrid"}


def test_spatial_time_pays_overhead_per_extra_chunk():
    """The profile's whole-batch times were measured as one chunk: one chunk costs exactly
    T_U + T_D; k chunks add (k - 1) overheads per stage (here: a stage-by-stage check)."""
    assert spatial_time(2.0, 1.0, 0.5, 0.25, 1) == pytest.approx(3.0)
    # k = 4: t_U = (2 - .5)/4 + .5 = .875, t_D = (1 - .25)/4 + .25 = .4375;
    # first chunk through both stages, then 3 more bottleneck stages.
    assert spatial_time(2.0, 1.0, 0.5, 0.25, 4) == pytest.approx(0.875 + 0.4375 + 3 * 0.875)
    # Overhead above the whole-batch time (a noisy profile) still gives a positive cost.
    assert spatial_time(0.02, 0.15, 0.05, 0.1, 4) > 0.02 + 0.15


def test_flow_shop_time_by_hand():
    """Three stages in 4 chunks: per chunk (T - o)/4 + o = 0.5875, 0.54, 0.575; the first
    chunk passes all three, each of the 3 others adds the slowest."""
    got = flow_shop_time([2.2, 2.1, 2.0], [0.05, 0.02, 0.1], 4)
    assert got == pytest.approx(0.5875 + 0.54 + 0.575 + 3 * 0.5875)
    assert flow_shop_time([2.2, 2.1, 2.0], [0.05, 0.02, 0.1], 1) == pytest.approx(6.3)
    assert flow_shop_time([2.0, 1.0], [0.5, 0.25], 4) == spatial_time(2.0, 1.0, 0.5, 0.25, 4)
    with pytest.raises(ValueError, match="one overhead per stage"):
        flow_shop_time([1.0, 2.0], [0.1], 2)


def test_nested_chain_is_one_flow_shop():
    """A chain of spatial stages is one pipeline (RLinf section 3.4): a -> b -> c on 4 + 2 + 6
    devices in 4 chunks costs the flow-shop time however the tree nests it. (Costing the
    nested sub-pipeline as one stage taking T/k per chunk gave 3.675 s for S(S(a | b) | c) and
    3.7875 s for S(a | S(b | c)).) The planner's plans cost the same way."""
    comps = [
        _c("a", 8.0, 0.2, chunk_overhead=0.05),
        _c("b", 4.0, 0.1, chunk_overhead=0.02),
        _c("c", 6.0, 1.0, chunk_overhead=0.1),
    ]
    wf = Workflow(comps, [("a", "b"), ("b", "c")], 8)
    # By hand: T = 8/4 + 0.2 = 2.2, 4/2 + 0.1 = 2.1, 6/6 + 1 = 2.0 seconds; per chunk
    # (T - o)/4 + o = 0.5875, 0.54, 0.575; the first chunk passes all three stages, each of
    # the 3 others adds the slowest chunk (a's).
    want = 0.5875 + 0.54 + 0.575 + 3 * 0.5875  # 3.465 s
    t = {"a": 2.2, "b": 2.1, "c": 2.0}
    span = {"a": range(0, 4), "b": range(4, 6), "c": range(6, 12)}
    leaf = {x: Leaf(span[x], t[x], x, (x,), (t[x],)) for x in "abc"}
    left = Spatial(range(0, 12), 0.0, Spatial(range(0, 6), 0.0, leaf["a"], leaf["b"], 2, 4),
                   leaf["c"], 2, 4)  # fmt: skip
    right = Spatial(range(0, 12), 0.0, leaf["a"],
                    Spatial(range(4, 12), 0.0, leaf["b"], leaf["c"], 2, 4), 2, 4)  # fmt: skip
    assert predicted_time(left, wf) == pytest.approx(want, rel=1e-12)
    assert predicted_time(right, wf) == pytest.approx(want, rel=1e-12)
    # The planner: each plan's time is the hand formula for its own devices and chunk count.
    o = {c.name: c.chunk_overhead for c in comps}
    for n in (6, 12, 24):
        plan = plan_workflow(wf, n, mode="spatial")
        k, used = plan.chunks, plan.placement()
        per = [(c.time(len(used[c.name])) - o[c.name]) / k + o[c.name] for c in comps]
        assert math.isclose(plan.time, sum(per) + (k - 1) * max(per), rel_tol=1e-12), n
        assert math.isclose(predicted_time(plan, wf), plan.time, rel_tol=1e-12)
    # One pipeline has one granularity.
    mixed = Spatial(range(0, 12), 0.0, leaf["a"],
                    Spatial(range(4, 12), 0.0, leaf["b"], leaf["c"], 4, 2), 2, 4)  # fmt: skip
    with pytest.raises(PlanError, match="2 chunks inside a pipeline of 4"):
        predicted_time(mixed, wf)


def _staircase(rng, n_max):
    """A planner leaf table with slack (module docstring, point 2): nonincreasing, with steps."""
    n = np.arange(n_max + 1, dtype=float)
    n[0] = 1
    raw = rng.uniform(0.1, 5) + rng.uniform(1, 500) / n + rng.choice([0.0, 0.01]) * n
    raw[0] = math.inf
    env = np.minimum.accumulate(raw)
    slack = rng.choice([0.001, 0.01, 0.05])
    k = np.searchsorted(-env[1:], -(1.0 + slack) * env, side="left") + 1
    return np.r_[math.inf, raw[np.minimum(k, n_max)][1:]]


def _split_table(rng, n_max):
    """A staircase, a flat-run, a jagged nonincreasing or a non-monotone table."""
    n = np.arange(n_max + 1, dtype=float)
    n[0] = 1
    kind = rng.integers(0, 4)
    if kind == 0:
        return _staircase(rng, n_max)
    if kind == 1:  # rounded (long flat runs), then the envelope
        t = np.round(rng.uniform(0.5, 5) + rng.uniform(1, 100) / n, 1)
        return np.minimum.accumulate(np.r_[math.inf, t[1:]])
    if kind == 2:
        return np.r_[math.inf, np.sort(rng.uniform(0, 3, n_max))[::-1]]
    return np.r_[math.inf, rng.uniform(0, 10, n_max)]


def test_split_search_streams_exactly(monkeypatch):
    """The window search evaluates its candidates in blocks (here of 50, so many per call) and,
    where the downstream table is nonincreasing, only where the upstream table changes: the
    same (cost, n_U) for every (k, n), bit for bit, as bounding every split."""
    monkeypatch.setattr(search_module, "BLOCK", 50)
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(40):
        n_max = int(rng.integers(60, 300))
        batch = int(rng.choice([4, 12, 64]))
        chunks = np.array([batch // m for m in divisors(batch)[::-1]])
        pu, pd = _split_table(rng, n_max), _split_table(rng, n_max)
        o_u, o_d = (float(rng.choice([0.0, rng.uniform(0, 0.3)])) for _ in range(2))
        lo, hi, bound, exact, _ = _pipelined_queries(pu, pd, o_u, o_d, chunks)
        runs = pu if np.all(pd[1:-1] >= pd[2:]) else None
        search = split_query(lo, hi, bound, exact, runs=runs)
        direct = split_query(lo, hi, bound, exact, exhaustive=True)
        for got, want in zip(search[:2], direct[:2]):
            np.testing.assert_array_equal(got, want)
        checked += bool(np.isfinite(search[0]).any())
    assert checked > 30


def test_large_plan_memory_is_bounded():
    """``m2flow plan --devices 16384`` on the chain profile (runner-ups included) allocates a
    few tables' worth: the split search streams its candidates instead of holding them all
    (606 MiB at this size before; tracemalloc sees numpy's allocations). More devices never
    make the plan slower (idle devices allowed)."""
    prof = load_profile(PROFILES / "synthetic_chain3.yaml")
    wf = to_workflow(prof)
    smaller = plan_workflow(wf, 8192, prof.device_memory_bytes)
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        res = plan_workflow(wf, 16_384, prof.device_memory_bytes, runner_ups=True)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not tracing:
            tracemalloc.stop()
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB"  # 4 KiB per device
    assert set(res.plan.placement()) == {"rollout", "inference", "train"}
    assert res.plan.time <= smaller.time and res.runner_ups


def test_above_max_devices_is_refused():
    """Past MAX_DEVICES the planner refuses at once (its tables grow with N), naming it."""
    top = planner_module.MAX_DEVICES
    assert top >= 65_536
    wf = Workflow([_c("a", 10.0, 1.0)], [], 4)
    with pytest.raises(PlanError, match=f"above MAX_DEVICES={top}"):
        plan_workflow(wf, top + 1)
