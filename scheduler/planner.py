"""M2Flow planner: RLinf Algorithm 1 (profiling-guided scheduling, RLinf paper section 5).

Pure (numpy/scipy/networkx). Given per-component time and memory estimates, a workflow graph and
a cluster (N devices, per-device memory capacity), find the composition of temporal (same
devices, one after the other) and spatial (disjoint devices, pipelined) splits that minimises the
predicted step time.

Algorithm:

1. Cycles collapse (``networkx.condensation``): a strongly connected component becomes one node
   whose members run interleaved on the same devices: ``time(n) = sum`` of member times,
   ``memory(n) = sum`` of member memories by default (interleaved members stay resident together;
   ``cycle_memory="max"`` assumes they swap), ``min_devices = max``, ``switch_cost`` and
   ``chunk_overhead = sum``.
2. ``P(S, n)`` for a node subset S on n devices (memoised per (S, time-shared flag) as an array
   over n = 0..N, one DP pass per subset):

   * one node: ``time(n)`` if ``n >= min_devices`` and ``memory(n) <= capacity``, else ``inf``.
   * otherwise the best over EVERY s-t cut (U, D = S \\ U), U a nonempty proper subset of S
     closed under predecessors within S (no edge D -> U), of
     - temporal: ``P(U, n) + P(D, n)`` on the same devices, where every component under a
       temporal node is *time-shared* and pays its ``switch_cost`` (offload + onload, seconds)
       once per step: a time-shared leaf costs ``time(n) + switch_cost``. At one temporal node
       of two leaves this is exactly "sum of times + sum of the members' switch costs"; nested
       temporal nodes do not pay a component's switch twice.
     - spatial: for every split ``n_U + n_D = n`` (each >= 1) and granularity ``m | M``, the
       pipelined cost of :mod:`m2flow.scheduler.cost` with ``T_U = P(U, n_U)``, ``T_D = P(D,
       n_D)`` and per-chunk overhead of a part = sum of its members' ``chunk_overhead``.
   * ties: cuts in increasing bitmask order over a fixed topological order, temporal before
     spatial, then smallest n_U, then largest m. Only strictly better candidates replace.
3. The result is a :class:`Plan` tree (:class:`Leaf`, :class:`Temporal`, :class:`Spatial`) with
   concrete device ranges: spatial upstream gets ``[start, start + n_U)``, downstream the rest.

Units: times in seconds (per step, whole batch of M items), memory in bytes per device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from .cost import INF, best_split_all, best_split_at, divisors


class PlanError(ValueError):
    """The workflow cannot be planned on the given cluster (the message names the problem)."""


@dataclass(frozen=True)
class Component:
    """One worker group. ``time(n)``: seconds for its whole per-step batch on n devices;
    ``memory(n)``: peak bytes per device on n devices; ``switch_cost``: seconds to offload and
    onload it when its devices change hands; ``chunk_overhead``: fixed seconds per pipelined chunk.
    """

    name: str
    time: Callable[[int], float]
    memory: Callable[[int], float]
    min_devices: int = 1
    switch_cost: float = 0.0
    chunk_overhead: float = 0.0


@dataclass(frozen=True)
class Workflow:
    """Components, data edges ``(src, dst)`` by name (cycles allowed), items per step ``M``."""

    components: Sequence[Component]
    edges: Sequence[tuple[str, str]]
    batch_size: int


@dataclass(frozen=True)
class Plan:
    """A node of the plan tree: ``devices`` (concrete range) and predicted ``time`` (seconds)."""

    devices: range
    time: float

    def leaves(self) -> list[Leaf]:
        """Leaves left to right."""
        raise NotImplementedError

    def breakdown(self) -> dict[str, float]:
        """Per original component: its predicted busy time per step (seconds) on its devices,
        ``time(n)`` plus ``switch_cost`` when time-shared (not the critical path)."""
        out: dict[str, float] = {}
        for leaf in self.leaves():
            out.update(zip(leaf.components, leaf.component_times, strict=True))
        return out

    def placement(self) -> dict[str, range]:
        """Device range of every original component."""
        return {c: leaf.devices for leaf in self.leaves() for c in leaf.components}

    def _lines(self, indent: str) -> list[str]:
        raise NotImplementedError

    def __str__(self) -> str:
        return "\n".join(self._lines(""))


def _fmt(devices: range) -> str:
    return f"devices [{devices.start}, {devices.stop})"


@dataclass(frozen=True)
class Leaf(Plan):
    """One (collapsed) node on ``devices``; ``components``: original names (several = a cycle)."""

    name: str = ""
    components: tuple[str, ...] = ()
    component_times: tuple[float, ...] = ()
    shared: bool = False

    def leaves(self) -> list[Leaf]:
        return [self]

    def _lines(self, indent):
        tag = ", time-shared" if self.shared else ""
        return [f"{indent}{self.name}: {self.time:.6g} s on {_fmt(self.devices)}{tag}"]


@dataclass(frozen=True)
class Temporal(Plan):
    """Children run one after the other on the same ``devices`` (nested temporal flattened)."""

    children: tuple[Plan, ...] = ()

    def leaves(self):
        return [lf for c in self.children for lf in c.leaves()]

    def _lines(self, indent):
        head = f"{indent}Temporal {self.time:.6g} s on {_fmt(self.devices)}"
        return [head] + [ln for c in self.children for ln in c._lines(indent + "  ")]


@dataclass(frozen=True)
class Spatial(Plan):
    """``upstream`` and ``downstream`` on disjoint devices, pipelined in chunks of
    ``granularity`` items (``chunks = M / granularity``)."""

    upstream: Plan = None  # type: ignore[assignment]
    downstream: Plan = None  # type: ignore[assignment]
    granularity: int = 0
    chunks: int = 0

    def leaves(self):
        return self.upstream.leaves() + self.downstream.leaves()

    def _lines(self, indent):
        head = (
            f"{indent}Spatial {self.time:.6g} s on {_fmt(self.devices)}, m={self.granularity}"
            f" ({self.chunks} chunks), split {len(self.upstream.devices)}+"
            f"{len(self.downstream.devices)}"
        )
        return [head] + self.upstream._lines(indent + "  ") + self.downstream._lines(indent + "  ")


@dataclass
class _Node:
    """A condensed node: a component or a collapsed cycle of components."""

    name: str
    members: list[Component]
    cycle_memory: str = "sum"
    times: np.ndarray = field(default=None, repr=False)  # type: ignore[assignment]

    def time(self, n):
        return sum(float(c.time(n)) for c in self.members)

    def memory(self, n):
        mems = [float(c.memory(n)) for c in self.members]
        return max(mems) if self.cycle_memory == "max" else sum(mems)

    @property
    def min_devices(self):
        return max(c.min_devices for c in self.members)

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
    edges between them as index pairs."""
    comps = {c.name: c for c in workflow.components}
    if len(comps) != len(workflow.components):
        raise PlanError("duplicate component names")
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
    return nodes, edges


class _Planner:
    """DP over node subsets (bitmasks) with arrays over device counts 0..N."""

    def __init__(self, nodes, edges, n_devices, capacity, batch_size):
        self.nodes, self.n, self.cap, self.M = nodes, n_devices, capacity, batch_size
        self.m_list = divisors(batch_size)[::-1]  # largest m first: ties prefer fewer chunks
        self.chunks = np.array([batch_size // m for m in self.m_list])
        self.pred = [0] * len(nodes)
        for u, v in edges:
            self.pred[v] |= 1 << u
        self.memo: dict[tuple[int, bool], tuple] = {}
        for node in nodes:
            node.times = self._leaf_times(node)

    def _leaf_times(self, node):
        t = np.full(self.n + 1, INF)
        for k in range(max(1, node.min_devices), self.n + 1):
            if node.memory(k) <= self.cap:
                v = node.time(k)
                if not v >= 0:  # also catches NaN
                    raise PlanError(f"component {node.name!r}: time({k}) = {v!r} is not >= 0")
                t[k] = v
        return t

    def _members(self, mask):
        return [i for i in range(len(self.nodes)) if mask >> i & 1]

    def overhead(self, mask):
        return sum(self.nodes[i].chunk_overhead for i in self._members(mask))

    def cuts(self, mask):
        """Down-sets U of ``mask`` (closed under predecessors within it), increasing order."""
        out, sub = [], (mask - 1) & mask
        while sub:
            if all(not (self.pred[i] & mask & ~sub) for i in self._members(sub)):
                out.append(sub)
            sub = (sub - 1) & mask
        return out[::-1]

    def table(self, mask, shared):
        """(cost[n], kind[n], cut[n], n_u[n], k_index[n]) for all n; kind 0 leaf, 1 temporal,
        2 spatial."""
        key = (mask, shared)
        if key in self.memo:
            return self.memo[key]
        size = self.n + 1
        kind, cut = np.zeros(size, np.int64), np.full(size, -1, np.int64)
        nu, ki = np.full(size, -1, np.int64), np.full(size, -1, np.int64)
        if mask & (mask - 1) == 0:
            node = self.nodes[mask.bit_length() - 1]
            cost = node.times + (node.switch_cost if shared else 0.0)
        else:
            cost = np.full(size, INF)
            for c_i, u in enumerate(self.cuts(mask)):
                d = mask & ~u
                cand = [(1, self.table(u, True)[0] + self.table(d, True)[0], None, None)]
                sc, snu, ski = best_split_all(
                    self.table(u, shared)[0],
                    self.table(d, shared)[0],
                    self.overhead(u),
                    self.overhead(d),
                    self.chunks,
                )
                cand.append((2, sc, snu, ski))
                for kd, val, cnu, cki in cand:
                    better = val < cost
                    cost = np.where(better, val, cost)
                    kind[better], cut[better] = kd, c_i
                    if kd == 2:
                        nu[better], ki[better] = cnu[better], cki[better]
        self.memo[key] = (cost, kind, cut, nu, ki)
        return self.memo[key]

    def root(self, mask):
        """Best (cost, kind, cut, n_u, k_index) at n = N only (skips the all-n table)."""
        if mask & (mask - 1) == 0:
            t = self.table(mask, False)
            return float(t[0][self.n]), 0, -1, -1, -1
        best = (INF, 0, -1, -1, -1)
        for c_i, u in enumerate(self.cuts(mask)):
            d = mask & ~u
            tv = float(self.table(u, True)[0][self.n] + self.table(d, True)[0][self.n])
            if tv < best[0]:
                best = (tv, 1, c_i, -1, -1)
            sv, snu, ski = best_split_at(
                self.table(u, False)[0],
                self.table(d, False)[0],
                self.overhead(u),
                self.overhead(d),
                self.chunks,
                self.n,
            )
            if sv < best[0]:
                best = (sv, 2, c_i, snu, ski)
        return best

    def build(self, mask, shared, start, n, choice=None):
        """The Plan subtree of ``mask`` on devices [start, start + n)."""
        if choice is None:
            t = self.table(mask, shared)
            choice = tuple(x[n] for x in t)
        cost, kind, c_i, n_u, k_i = choice
        devices = range(start, start + n)
        if kind == 0:
            node = self.nodes[mask.bit_length() - 1]
            extra = [c.switch_cost if shared else 0.0 for c in node.members]
            times = tuple(float(c.time(n)) + e for c, e in zip(node.members, extra, strict=True))
            return Leaf(
                devices, float(cost), node.name, tuple(c.name for c in node.members), times, shared
            )
        u = self.cuts(mask)[c_i]
        d = mask & ~u
        if kind == 1:
            kids = []
            for part in (self.build(u, True, start, n), self.build(d, True, start, n)):
                kids.extend(part.children if isinstance(part, Temporal) else [part])
            return Temporal(devices, float(cost), tuple(kids))
        n_u, m = int(n_u), self.m_list[int(k_i)]
        up = self.build(u, shared, start, n_u)
        down = self.build(d, shared, start + n_u, n - n_u)
        return Spatial(devices, float(cost), up, down, m, self.M // m)


def _explain_infeasible(nodes, n_devices, capacity) -> None:
    for node in nodes:
        if np.isfinite(node.times).any():
            continue
        if node.min_devices > n_devices:
            raise PlanError(
                f"component {node.name!r} needs at least {node.min_devices} devices, "
                f"the cluster has {n_devices}"
            )
        lo = max(1, node.min_devices)
        need = min(node.memory(k) for k in range(lo, n_devices + 1))
        raise PlanError(
            f"component {node.name!r} does not fit in memory at any device count "
            f"{lo}..{n_devices}: needs at least {need:.4g} bytes per device, "
            f"capacity {capacity:.4g}"
        )
    feas = {
        nd.name: [k for k in range(1, n_devices + 1) if np.isfinite(nd.times[k])] for nd in nodes
    }
    raise PlanError(
        f"no feasible plan on {n_devices} devices; feasible device counts per "
        f"component: { {k: (v[0], v[-1]) for k, v in feas.items()} }"
    )


def plan_workflow(
    workflow: Workflow, num_devices: int, capacity: float = INF, cycle_memory: str = "sum"
) -> Plan:
    """Optimal plan of ``workflow`` on ``num_devices`` devices with ``capacity`` bytes each.

    Raises :class:`PlanError` naming the problem when nothing is feasible.
    """
    if num_devices < 1:
        raise PlanError(f"num_devices must be >= 1, got {num_devices}")
    if not workflow.components:
        raise PlanError("workflow has no components")
    if workflow.batch_size < 1:
        raise PlanError(f"batch_size must be >= 1, got {workflow.batch_size}")
    if cycle_memory not in ("sum", "max"):
        raise PlanError(f"cycle_memory must be 'sum' or 'max', got {cycle_memory!r}")
    nodes, edges = condense(workflow, cycle_memory)
    pl = _Planner(nodes, edges, num_devices, capacity, workflow.batch_size)
    full = (1 << len(nodes)) - 1
    choice = pl.root(full)
    if not np.isfinite(choice[0]):
        _explain_infeasible(nodes, num_devices, capacity)
    return pl.build(full, False, 0, num_devices, choice)
