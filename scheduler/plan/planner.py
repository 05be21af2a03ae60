"""M2Flow planner: RLinf Algorithm 1 (profiling-guided scheduling, RLinf paper section 3.4).

Pure (numpy/networkx). Given per-component time and memory estimates, a workflow graph and a
cluster (N devices, per-device memory capacity), find the composition of temporal (same
devices, one after the other) and spatial (disjoint devices, pipelined) splits that minimises the
predicted step time.

Algorithm:

1. Cycles collapse (``networkx.condensation``, RLinf's ``ConvertCircleToNode``): a strongly
   connected component becomes one node. Time-shared, its members run interleaved on the same
   devices: ``time(n) = sum`` of member times (plus ``R * g_sh``, the hand-offs of its ``R``
   round trips, when the workflow gives the cycle's :class:`~.cycle.CycleCost`),
   ``memory(n) = sum`` of member memories by default (interleaved members stay resident
   together; ``cycle_memory="max"`` assumes they swap), ``min_devices = max``, ``switch_cost``
   and ``chunk_overhead = sum``. A two-member cycle with a :class:`~.cycle.CycleCost` may
   instead *split*: each member on its own devices (memory and ``min_devices`` per member),
   pipelined over ``k`` sub-batches of the leader's share (:mod:`.cycle` states the cost; the
   best split and ``k`` are searched exactly for every device count). This goes beyond RLinf's
   Algorithm 1, which always time-shares a collapsed cycle, and follows its embodied
   experiment (section 5.1.2). A split counts as a spatial composition for the modes:
   ``temporal`` keeps cycles time-shared, ``hybrid`` accepts a split cycle as its spatial part.
2. ``P(S, n)`` for a node subset S on n devices (memoised per (S, time-shared flag, family) as
   an array over n = 0..N, one DP pass per subset):

   * one node given n devices uses k of them; it is feasible at k iff ``k >= min_devices`` and
     ``memory(k) <= capacity``. With ``allow_idle`` (the default) k is any feasible ``k <= n``
     and the node's time on n is the monotone envelope ``min_{feasible k <= n} time(k)``
     (smallest such k on ties); the other ``n - k`` devices stay idle. A small model measured
     on few devices often gets *slower* with more (threads, communication): without the
     envelope the planner would push spare devices onto it. With ``slack = s > 0`` the node
     uses the *fewest* devices whose time is within ``s`` of that minimum: the smallest k <= n
     with ``time(k) <= (1 + s) * min_{k' <= n} time(k')``. A nearly flat fit (two profiled
     points, an Amdahl curve ``a + b/k`` with b << a) then stops at a few devices instead of
     taking every spare one for a fraction of a percent. The table stays nonincreasing in n
     (the threshold only falls as n grows, so k only moves up, to a faster time). ``s = 0``
     is the exact envelope. With ``allow_idle=False``
     (Algorithm 1 as RLinf states it) k = n: ``time(n)`` if feasible at n, else ``inf``. A
     component with ``max_devices`` uses ``min(k, max_devices)`` of its k devices:
     ``time(k) = time(max_devices)`` and ``memory(k) = memory(max_devices)`` beyond it.
   * otherwise the best over EVERY s-t cut (U, D = S \\ U), U a nonempty proper subset of S
     closed under predecessors within S (no edge D -> U), of
     - temporal: ``P(U, n) + P(D, n)`` on the same devices, where every component under a
       temporal node is *time-shared* and pays its ``switch_cost`` (offload + onload, seconds)
       once per step: a time-shared leaf costs ``time(n) + switch_cost``. At one temporal node
       of two leaves this is exactly "sum of times + sum of the members' switch costs"; nested
       temporal nodes do not pay a component's switch twice. Each child may use its own
       k <= n of the shared range (its first k devices, whose locks they share).
     - spatial: U and D on disjoint devices (``n_U + n_D = n``, each >= 1), pipelined. A
       chain of spatial compositions is ONE pipeline (RLinf section 3.4's ``T_critical +
       (M/m - 1) * T_bottleneck`` over the whole chain, however the tree nests it): its
       *stages* (the leaves, temporal nodes and split cycles joined by spatial nodes) share
       one granularity ``m | M`` and, in ``k = M/m`` chunks, it costs ``sum_i t_i + (k - 1)
       max_i t_i`` (:func:`~.cost.flow_shop_time`) with a stage's chunk ``t_i = (T_i - o_i) /
       k + o_i``: its whole-batch time ``T_i = P(stage, n_i)`` and per-chunk overhead ``o_i``
       = sum of its members' ``chunk_overhead`` (paid per extra chunk: one chunk costs
       ``sum_i T_i``). A chain's cost is not a function of its halves' costs, so the search
       takes U as the chain's first stage and carries the bottleneck into the rest
       (:mod:`.tables` states how, exactly). With the envelope every ``P(S, n)`` is
       nonincreasing in n (both compositions are nondecreasing in their parts' times), so a
       sub-plan given n_U devices may use fewer.
   * ties: temporal (or a leaf) before spatial, then cuts in increasing bitmask order over a
     fixed topological order, the smaller n_U, the largest m. Only strictly better replaces.
     A chain's plan nests to the right: ``S(a | S(b | c))``.
3. Modes restrict the compositions (exactly, by DP over *families* of tables): ``auto``
   (unrestricted), ``temporal`` (temporal only: every component given all N devices), ``spatial``
   (spatial only: disjoint devices everywhere) and ``hybrid`` (at least one temporal AND one
   spatial composition). Hybrid needs the helper families "contains a spatial node" and
   "contains a temporal node": a temporal node is hybrid iff a child contains a spatial node,
   a spatial node iff a child contains a temporal node.
4. The result is a :class:`~m2flow.scheduler.plan.tree.Plan` tree with concrete device ranges,
   each node's range being the devices its leaves use: a leaf using k devices from ``start``
   gets ``[start, start + k)``, a spatial node's downstream starts right after the devices its
   upstream uses. Idle devices are thus packed at the top: the root uses ``[0, u)`` and
   ``[u, N)`` is idle (:meth:`~m2flow.scheduler.plan.tree.PlanResult.idle`). With every device
   used, spatial upstream gets ``[start, start + n_U)`` and downstream the rest.
5. Scale: the tables (:mod:`.tables`) are arrays over n = 0..N, so memory grows linearly in
   N; the split search streams its candidates (:func:`~.search.split_query`). Clusters above
   :data:`MAX_DEVICES` are refused.

Units: times in seconds (per step, whole batch of M items), memory in bytes per device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

import networkx as nx
import numpy as np

from .cost import INF, flow_shop_time
from .cycle import CycleCost
from .tables import FAMILY, Planner
from .tree import CycleSplit, Leaf, Plan, PlanError, PlanResult, Spatial, Temporal

# A component uses the fewest devices within 1 % of its fastest time (module docstring, point 2).
DEFAULT_SLACK = 0.01
# Largest cluster planned. Tables hold every device count 0..N, so memory grows linearly in N
# (the 5-component PPO graph with runner-ups: 0.5 GB peak here) and time faster (2 minutes on
# this 2-core machine); benchmarks/planner.py measures both (docs/results/planning.md).
MAX_DEVICES = 65_536

__all__ = [
    "MAX_DEVICES",
    "MODES",
    "Component",
    "CycleCost",
    "CycleSplit",
    "Leaf",
    "Plan",
    "PlanError",
    "PlanResult",
    "Spatial",
    "Temporal",
    "Workflow",
    "condense",
    "plan_workflow",
    "predicted_time",
]

MODES = ("auto", "temporal", "spatial", "hybrid")


@dataclass(frozen=True)
class Component:
    """One worker group. ``time(n)``: seconds for its whole per-step batch on n devices;
    ``memory(n)``: peak bytes per device on n devices; ``switch_cost``: seconds to offload and
    onload it when its devices change hands; ``chunk_overhead``: fixed seconds per pipelined
    chunk; ``max_devices``: it uses at most this many of the devices it is given (``None`` = no
    limit), so ``time(n) = time(max_devices)`` for larger n (the rest idle).

    ``time``/``memory`` are called with one int at a time; a callable with a true attribute
    ``vectorized`` (the fits of :mod:`m2flow.scheduler.plan.fit`) is called once with an int array.
    """

    name: str
    time: Callable[[int], float]
    memory: Callable[[int], float]
    min_devices: int = 1
    switch_cost: float = 0.0
    chunk_overhead: float = 0.0
    max_devices: int | None = None


@dataclass(frozen=True)
class Workflow:
    """Components, data edges ``(src, dst)`` by name (cycles allowed), items per step ``M``,
    and the measured costs of two-member cycles that may split across devices (module
    docstring, point 1; a cycle without one stays time-shared)."""

    components: Sequence[Component]
    edges: Sequence[tuple[str, str]]
    batch_size: int
    cycles: Sequence[CycleCost] = ()


@dataclass
class _Node:
    """A condensed node: a component or a collapsed cycle of components."""

    name: str
    members: list[Component]
    cycle_memory: str = "sum"
    cycle: CycleCost | None = None  # members in (leader, follower) order when set
    times: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    memory: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    raw: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    use: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]
    split: tuple | None = field(default=None, repr=False)  # (cost, leader devices, k) per n

    @property
    def min_devices(self):
        return max(max(1, c.min_devices) for c in self.members)

    @property
    def switch_cost(self):
        return sum(c.switch_cost for c in self.members)

    @property
    def chunk_overhead(self):
        return sum(c.chunk_overhead for c in self.members)


def condense(
    workflow: Workflow, cycle_memory: str = "sum"
) -> tuple[list[_Node], list[tuple[int, int]]]:
    """Collapse cycles: returns condensed nodes in a deterministic topological order and the
    edges between them as index pairs.

    Raises:
        PlanError: duplicate component names, an edge naming an unknown component, a
            ``max_devices`` below ``min_devices``, or a cycle cost whose members are not
            exactly one strongly connected component of the graph.
    """
    comps = {c.name: c for c in workflow.components}
    if len(comps) != len(workflow.components):
        raise PlanError("duplicate component names")
    for c in workflow.components:
        if c.max_devices is not None and c.max_devices < max(1, c.min_devices):
            raise PlanError(
                f"component {c.name!r}: max_devices={c.max_devices} is below min_devices="
                f"{c.min_devices}; raise max_devices or set it to None"
            )
    g = nx.DiGraph()
    g.add_nodes_from(comps)
    for s, d in workflow.edges:
        for x in (s, d):
            if x not in comps:
                raise PlanError(f"edge ({s!r}, {d!r}) names unknown component {x!r}")
        if s != d:
            g.add_edge(s, d)
    order = {name: i for i, name in enumerate(comps)}
    cg = nx.condensation(g)
    label = {v: "+".join(sorted(cg.nodes[v]["members"], key=order.get)) for v in cg}
    topo = list(nx.lexicographical_topological_sort(cg, key=lambda v: label[v]))
    index = {v: i for i, v in enumerate(topo)}
    nodes = [
        _Node(
            label[v],
            [comps[x] for x in sorted(cg.nodes[v]["members"], key=order.get)],
            cycle_memory,
        )
        for v in topo
    ]
    edges = sorted((index[u], index[v]) for u, v in cg.edges)
    by_members = {frozenset(c.name for c in nd.members): nd for nd in nodes}
    for cyc in workflow.cycles:
        nd = by_members.get(frozenset(cyc.members))
        if nd is None or nd.cycle is not None:
            raise PlanError(
                f"cycle cost {tuple(cyc.members)}: its members are not "
                + ("one cycle of the graph" if nd is None else "given once")
                + f" (cycles: {[n.name for n in nodes if len(n.members) > 1]}); drop the "
                "cycle cost or re-profile"
            )
        nd.cycle = cyc
        nd.members = [comps[x] for x in cyc.members]  # leader first
    return nodes, edges


def _explain_infeasible(nodes, n_devices, capacity, mode, allow_idle) -> None:
    for node in nodes:
        if np.isfinite(node.raw).any():
            continue
        if node.min_devices > n_devices:
            raise PlanError(
                f"component {node.name!r} needs at least {node.min_devices} devices, "
                f"the cluster has {n_devices}"
            )
        lo = node.min_devices
        need = float(np.min(node.memory[lo:]))
        raise PlanError(
            f"component {node.name!r} does not fit in memory at any device count "
            f"{lo}..{n_devices}: needs at least {need:.4g} bytes per device, "
            f"capacity {capacity:.4g}; add devices or memory, or lower its footprint"
        )
    if mode == "temporal":
        for node in nodes:
            if not np.isfinite(node.times[n_devices]):
                raise PlanError(
                    f"no feasible temporal plan: temporal mode runs every component on all "
                    f"{n_devices} devices and component {node.name!r} cannot run on "
                    f"{n_devices} (memory {node.memory[n_devices]:.4g} bytes per device, "
                    f"capacity {capacity:.4g}); try mode='auto' or allow idle devices "
                    "(allow_idle=True)"
                )
    feas = {}
    for nd in nodes:
        ks = np.flatnonzero(np.isfinite(nd.raw))
        feas[nd.name] = f"{ks[0]}..{ks[-1]}"
    hint = "add devices" + (" or try mode='auto'" if mode != "auto" else "")
    hint += "" if allow_idle else ", or allow idle devices (allow_idle=True)"
    raise PlanError(
        f"no feasible {mode} plan on {n_devices} devices (capacity {capacity:.4g} bytes); "
        f"feasible device counts per component: {feas}; {hint}"
    )


def _check_mode(mode, nodes, n_devices) -> None:
    if mode not in MODES:
        raise PlanError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "spatial" and n_devices < len(nodes):
        raise PlanError(
            f"spatial mode gives every component its own devices: {len(nodes)} components "
            f"({', '.join(nd.name for nd in nodes)}) need at least {len(nodes)} devices, "
            f"got {n_devices}; add devices or use mode='auto'"
        )
    splits = any(nd.cycle is not None for nd in nodes)  # a split cycle is spatial
    if mode == "hybrid" and (len(nodes) < (2 if splits else 3) or n_devices < 2):
        raise PlanError(
            f"hybrid mode needs a temporal and a spatial composition: at least 3 components "
            f"(after collapsing cycles: {len(nodes)}; 2 with a cycle that may split) and 2 "
            f"devices (got {n_devices}); use mode='auto'"
        )


def _alternatives(pl: Planner, full: int, best: Plan) -> tuple[Plan, ...]:
    """Best plan of every mode and of every top-level (cut, composition), deduplicated."""
    found: list[Plan] = []
    for fam in ("T", "S", "H"):
        choice = pl.root(full, fam)
        if np.isfinite(choice.cost):
            found.append(pl.build(full, False, fam, 0, pl.n, choice))
    for opt in pl.options(full, "A"):
        if np.isfinite(opt.cost) and opt.variant >= 0:
            found.append(pl.build(full, False, "A", 0, pl.n, opt))
    seen = {best.signature()}
    out = []
    for p in sorted(found, key=lambda p: (p.time, p.shape())):
        key = p.signature()
        if key not in seen:
            seen.add(key)
            out.append(p)
    return tuple(out)


@overload
def plan_workflow(
    workflow: Workflow,
    num_devices: int,
    capacity: float = ...,
    cycle_memory: str = ...,
    mode: str = ...,
    runner_ups: Literal[False] = ...,
    allow_idle: bool = ...,
    slack: float = ...,
) -> Plan: ...


@overload
def plan_workflow(
    workflow: Workflow,
    num_devices: int,
    capacity: float = ...,
    cycle_memory: str = ...,
    mode: str = ...,
    runner_ups: Literal[True] = ...,
    allow_idle: bool = ...,
    slack: float = ...,
) -> PlanResult: ...


def plan_workflow(
    workflow: Workflow,
    num_devices: int,
    capacity: float = INF,
    cycle_memory: str = "sum",
    mode: str = "auto",
    runner_ups: bool = False,
    allow_idle: bool = True,
    slack: float = DEFAULT_SLACK,
) -> Plan | PlanResult:
    """Optimal plan of ``workflow`` on ``num_devices`` devices with ``capacity`` bytes each.

    Args:
        mode: ``"auto"`` (unrestricted optimum), ``"temporal"``, ``"spatial"`` or ``"hybrid"``
            (see the module docstring, point 3).
        runner_ups: return a :class:`PlanResult` holding the best plan, the best plan of each
            other mode and of each other top-level (cut, composition), and the edge
            granularities, instead of the bare tree.
        allow_idle: a component given n devices may use any feasible k <= n of them, leaving
            the rest idle, when fewer are faster (module docstring, point 2). ``False``: every
            component uses every device it is given (RLinf's Algorithm 1; ``max_devices``
            aside), so the plan uses all ``num_devices``.
        slack: with ``allow_idle``, a component uses the fewest devices whose predicted time
            is within this fraction (0 <= s < 1) of its fastest on the devices it is given
            (module docstring, point 2). The default, 1 %, keeps a nearly flat profile from
            taking every spare device; ``0`` plans the exact minimum. Ignored with
            ``allow_idle=False``.

    Raises:
        PlanError: bad arguments (``num_devices`` outside 1..:data:`MAX_DEVICES`, ...), or
            nothing feasible (the message names the component, the memory shortfall or the
            mode's requirement).
    """
    if num_devices < 1:
        raise PlanError(f"num_devices must be >= 1, got {num_devices}")
    if num_devices > MAX_DEVICES:
        raise PlanError(
            f"num_devices={num_devices} is above MAX_DEVICES={MAX_DEVICES}: the planner keeps a "
            "table over every device count 0..N, so its memory and time grow with N"
        )
    if not workflow.components:
        raise PlanError("workflow has no components")
    if workflow.batch_size < 1:
        raise PlanError(f"batch_size must be >= 1, got {workflow.batch_size}")
    if cycle_memory not in ("sum", "max"):
        raise PlanError(f"cycle_memory must be 'sum' or 'max', got {cycle_memory!r}")
    if not 0.0 <= slack < 1.0:
        raise PlanError(f"slack must be in [0, 1), a fraction of the fastest time; got {slack!r}")
    nodes, edges = condense(workflow, cycle_memory)
    _check_mode(mode, nodes, num_devices)
    slack = slack if allow_idle else 0.0
    pl = Planner(nodes, edges, num_devices, capacity, workflow.batch_size, allow_idle, slack)
    full = (1 << len(nodes)) - 1
    fam = FAMILY[mode]
    choice = pl.root(full, fam)
    if not np.isfinite(choice.cost):
        _explain_infeasible(nodes, num_devices, capacity, mode, allow_idle)
    best = pl.build(full, False, fam, 0, num_devices, choice)
    if not runner_ups:
        return best
    return PlanResult(
        plan=best,
        mode=mode,
        num_devices=num_devices,
        batch_size=workflow.batch_size,
        edges=tuple((str(s), str(d)) for s, d in workflow.edges),
        capacity=float(capacity),
        runner_ups=_alternatives(pl, full, best),
        allow_idle=allow_idle,
        slack=slack,
    )


def predicted_time(plan: Plan, workflow: Workflow) -> float:
    """Predicted step time (seconds) of ``plan``, nested in any way, under the planner's cost
    model (module docstring, point 2): a leaf or split cycle takes its ``time``, a temporal node
    the sum of its children's, and a chain of spatial nodes (with its stages: the nodes below
    it that are not spatial) ``sum_i t_i + (k - 1) max_i t_i`` (RLinf section 3.4;
    :func:`~.cost.flow_shop_time`), each stage's per-chunk overhead the sum of its components'
    ``chunk_overhead`` in ``workflow``. For a plan of :func:`plan_workflow` this is
    ``plan.time`` (up to rounding); it costs hand-written plans the same way.

    Raises:
        PlanError: a component of the plan is not in ``workflow``, or one chain's spatial
            nodes have different chunk counts (one pipeline has one granularity).
    """
    over = {c.name: c.chunk_overhead for c in workflow.components}

    def overhead(node: Plan) -> float:
        names = [c for lf in node.leaves() for c in lf.components]
        missing = [c for c in names if c not in over]
        if missing:
            raise PlanError(f"component {missing[0]!r} of the plan is not in the workflow")
        return sum(over[c] for c in names)

    def stages(node: Plan, k: int) -> list[Plan]:
        if not isinstance(node, Spatial) or isinstance(node, CycleSplit):
            return [node]
        if node.chunks != k:
            raise PlanError(
                f"spatial node {node.shape()} has {node.chunks} chunks inside a pipeline of "
                f"{k}: one chain of spatial nodes is one pipeline with one granularity"
            )
        return stages(node.upstream, k) + stages(node.downstream, k)

    def cost(node: Plan) -> float:
        if isinstance(node, Temporal):
            return sum(cost(c) for c in node.children)
        if isinstance(node, Spatial) and not isinstance(node, CycleSplit):
            parts = stages(node, node.chunks)
            times = [cost(p) for p in parts]
            return float(flow_shop_time(times, [overhead(p) for p in parts], node.chunks))
        overhead(node)  # every component known
        return float(node.time)

    return cost(plan)
