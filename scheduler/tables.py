"""DP tables of the planner (RLinf Algorithm 1, section 5): ``P(S, n)`` of every node subset S
for every device count n = 0..N, per family of compositions, and the plan they encode.

:mod:`.planner` holds the model (components, workflow, condensation) and the entry point;
the search itself is described in its module docstring (points 2-4). Split out of it to keep
each module short; nothing here is public API.

Memory: each table is one float64 array over n = 0..N plus the winning choice per n in small
integer arrays (int8 variant, int32 cut and n_U, int16 granularity index: 19 bytes per device
count instead of 40), each memoised split 14 bytes, each non-convex table's minorant 8 bytes:
about 5 KB per device for the 5-component PPO graph with every family (runner-ups), so
memory grows linearly in N (:func:`~.cost.best_split_all` keeps its temporaries bounded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .cost import INF, best_split_all, best_split_at, convex_minorant, divisors
from .cycle import split_table
from .plan import CycleSplit, Leaf, Plan, PlanError, Spatial, Temporal


def _used(c, n):
    """Devices component ``c`` (a :class:`~.planner.Component`) uses when given ``n`` (int or
    int array)."""
    return n if c.max_devices is None else np.minimum(n, c.max_devices)


def _evaluate(fn: Callable, ns: np.ndarray) -> np.ndarray:
    """``fn`` at every device count in ``ns`` (floats; one call per distinct count)."""
    if getattr(fn, "vectorized", False):
        out = np.asarray(fn(ns), dtype=float)
        if out.shape == ns.shape:
            return out
    uniq, inv = np.unique(ns, return_inverse=True)
    return np.array([float(fn(int(x))) for x in uniq])[inv]


# Families of DP tables: for each, the (composition, upstream family, downstream family)
# variants tried at every cut, in tie-break order (temporal first). "A": any plan, "T"/"S":
# temporal/spatial compositions only, "CS"/"CT": contains a spatial/temporal node, "H": both.
_TEMPORAL, _SPATIAL = 1, 2
_VARIANTS: dict[str, tuple[tuple[int, str, str], ...]] = {
    "A": ((_TEMPORAL, "A", "A"), (_SPATIAL, "A", "A")),
    "T": ((_TEMPORAL, "T", "T"),),
    "S": ((_SPATIAL, "S", "S"),),
    "CS": ((_TEMPORAL, "CS", "A"), (_TEMPORAL, "A", "CS"), (_SPATIAL, "A", "A")),
    "CT": ((_TEMPORAL, "A", "A"), (_SPATIAL, "CT", "A"), (_SPATIAL, "A", "CT")),
    "H": (
        (_TEMPORAL, "CS", "A"),
        (_TEMPORAL, "A", "CS"),
        (_SPATIAL, "CT", "A"),
        (_SPATIAL, "A", "CT"),
    ),
}
FAMILY = {"auto": "A", "temporal": "T", "spatial": "S", "hybrid": "H"}


def _leaf_kind(fam: str, node) -> str | None:
    """Which runs of a single node family ``fam`` allows: ``"shared"`` (its members on the
    same devices; a plain component), ``"split"`` (a cycle split across devices: a spatial
    composition), ``"any"`` (the faster), or None (a leaf has no temporal composition: CT and
    H are infeasible, and so is CS without a split)."""
    splits = node.cycle is not None
    if fam == "T" or (fam in ("A", "S") and not splits):
        return "shared"
    if fam in ("A", "S"):
        return "any"
    return "split" if fam == "CS" and splits else None


class Choice(NamedTuple):
    """How a subgraph is planned on ``n`` devices: its ``cost`` (seconds), and -- unless it is
    a leaf (``variant < 0``) -- the composition ``variant`` of its family, the s-t ``cut``
    (index into the subgraph's cuts), the upstream side's device count ``n_up`` and the
    granularity index ``k`` (spatial only; -1 for temporal)."""

    cost: float
    variant: int = -1
    cut: int = -1
    n_up: int = -1
    k: int = -1


@dataclass(eq=False)
class _Table:
    """P(S, n) for n = 0..N and, per n, the winning variant, cut index, n_U and k index."""

    cost: np.ndarray
    var: np.ndarray | None = None
    cut: np.ndarray | None = None
    nu: np.ndarray | None = None
    ki: np.ndarray | None = None
    hull: tuple | None = None

    @property
    def feasible(self) -> bool:
        return bool(np.isfinite(self.cost).any())


class Planner:
    """DP over node subsets (bitmasks) with arrays over device counts 0..N."""

    def __init__(self, nodes, edges, n_devices, capacity, batch_size, allow_idle=True, slack=0.0):
        self.nodes, self.n, self.cap, self.M = nodes, n_devices, capacity, batch_size
        self.allow_idle, self.slack = allow_idle, slack
        self.m_list = divisors(batch_size)[::-1]  # largest m first: ties prefer fewer chunks
        self.chunks = np.array([batch_size // m for m in self.m_list])
        self.pred = [0] * len(nodes)
        for u, v in edges:
            self.pred[v] |= 1 << u
        self.switch_mask = sum(1 << i for i, nd in enumerate(nodes) if nd.switch_cost > 0)
        self.memo: dict[tuple, _Table] = {}
        self.splits: dict[tuple[int, int], tuple] = {}
        self._cuts: dict[int, list[int]] = {}
        self.inf = _Table(np.full(n_devices + 1, INF))
        for node in nodes:
            self._leaf_arrays(node)

    def _raw(self, name, members, cycle_memory, min_devices, extra=0.0):
        """Seconds of ``members`` time-shared on exactly k = 0..N devices (``inf``: below
        ``min_devices`` or over capacity; ``extra`` added where feasible) and their memory."""
        ns = np.arange(1, self.n + 1)
        mems = [_evaluate(c.memory, _used(c, ns)) for c in members]
        mem = np.max(mems, axis=0) if cycle_memory == "max" else np.sum(mems, axis=0)
        if np.isnan(mem).any():
            k = int(ns[np.isnan(mem)][0])
            raise PlanError(f"component {name!r}: memory({k}) is NaN")
        ok = (ns >= min_devices) & (mem <= self.cap)
        t = np.full(self.n + 1, INF)
        if ok.any():
            times = np.sum([_evaluate(c.time, _used(c, ns[ok])) for c in members], axis=0)
            bad = ~(times >= 0)  # also catches NaN
            if bad.any():
                k, v = int(ns[ok][bad][0]), float(times[bad][0])
                raise PlanError(f"component {name!r}: time({k}) = {v!r} is not >= 0")
            t[1:][ok] = times + extra
        return t, mem

    def _envelope(self, t):
        """``(time on n, devices used of n)`` for n = 0..N from the time on exactly k devices
        (module docstring of :mod:`.planner`, point 2)."""
        if not self.allow_idle:
            return t, np.where(np.isfinite(t), np.arange(self.n + 1), 0)
        # Monotone envelope: time on n = min over feasible k <= n, and the smallest such k.
        env = np.minimum.accumulate(t)
        if self.slack == 0.0:
            drops = t < np.concatenate(([INF], env[:-1]))  # a new strict minimum at k
            return env, np.maximum.accumulate(np.where(drops, np.arange(self.n + 1), 0))
        # The fewest devices within the slack: the first k whose envelope (nonincreasing) is
        # under the threshold; the envelope first drops there, so t[k] is that value.
        ok = np.isfinite(env)
        k = np.searchsorted(-env[1:], -(1.0 + self.slack) * env, side="left") + 1
        return np.where(ok, t[np.where(ok, k, 0)], INF), np.where(ok, k, 0)

    def _leaf_arrays(self, node):
        cyc = node.cycle
        extra = cyc.round_trips * cyc.shared_gap_s if cyc is not None else 0.0
        t, mem = self._raw(node.name, node.members, node.cycle_memory, node.min_devices, extra)
        node.raw = t  # time on exactly k devices (inf: infeasible at k)
        node.memory = np.concatenate(([INF], mem))
        node.times, node.use = self._envelope(t)
        if cyc is None:
            return
        # Split: each member on its own devices (its own memory and min_devices).
        parts = []
        for c in node.members:
            tc, _ = self._raw(c.name, [c], "sum", max(1, c.min_devices))
            parts.append(self._envelope(tc))
        cost, n_a, k = split_table(cyc, parts[0][0], parts[1][0])
        node.split = (cost, n_a, k, parts)

    def _members(self, mask):
        return [i for i in range(len(self.nodes)) if mask >> i & 1]

    def overhead(self, mask):
        return sum(self.nodes[i].chunk_overhead for i in self._members(mask))

    def cuts(self, mask):
        """Down-sets U of ``mask`` (closed under predecessors within it), increasing order."""
        if mask in self._cuts:
            return self._cuts[mask]
        out, sub = [], (mask - 1) & mask
        while sub:
            if all(not (self.pred[i] & mask & ~sub) for i in self._members(sub)):
                out.append(sub)
            sub = (sub - 1) & mask
        self._cuts[mask] = out[::-1]
        return self._cuts[mask]

    @staticmethod
    def _leaf_cost(node, kind: str) -> np.ndarray:
        """A single node's seconds on n = 0..N devices, run as ``kind`` (:func:`_leaf_kind`);
        ties go to time-sharing."""
        if kind == "shared":
            return node.times
        split = node.split[0]
        return split if kind == "split" else np.where(split < node.times, split, node.times)

    def table(self, mask: int, shared: bool, fam: str) -> _Table:
        """P(mask, n) for all n within family ``fam``; ``shared``: under a temporal node."""
        shared = shared and bool(mask & self.switch_mask)  # no switch cost: same table
        leaf = mask & (mask - 1) == 0
        if leaf:
            node = self.nodes[mask.bit_length() - 1]
            kind = _leaf_kind(fam, node)
            if kind is None:
                return self.inf
            key: tuple = (mask, shared, kind)
        else:
            key = (mask, shared, fam)
        if key in self.memo:
            return self.memo[key]
        if leaf:
            self.memo[key] = _Table(self._leaf_cost(node, kind) + (node.switch_cost * shared))
            return self.memo[key]
        size = self.n + 1
        cost = np.full(size, INF)
        var, cut, nu, ki = (np.full(size, -1, d) for d in (np.int8, np.int32, np.int32, np.int16))
        for c_i, u in enumerate(self.cuts(mask)):
            d = mask & ~u
            for v_i, (kind, fu, fd) in enumerate(_VARIANTS[fam]):
                sub = True if kind == _TEMPORAL else shared
                tu, td = self.table(u, sub, fu), self.table(d, sub, fd)
                if not (tu.feasible and td.feasible):
                    continue
                if kind == _TEMPORAL:
                    val, snu, ski = tu.cost + td.cost, None, None
                else:
                    val, snu, ski = self.split(tu, td, u, d)
                better = val < cost
                if not better.any():
                    continue
                cost = np.where(better, val, cost)
                var[better], cut[better] = v_i, c_i
                if snu is not None:
                    nu[better], ki[better] = snu[better], ski[better]
        self.memo[key] = _Table(cost, var, cut, nu, ki)
        return self.memo[key]

    def _hull(self, t: _Table):
        if t.hull is None:
            t.hull = convex_minorant(t.cost)
        return t.hull

    def split(self, tu: _Table, td: _Table, u: int, d: int):
        """Best spatial split of (u, d) for every n (memoised on the two tables)."""
        key = (id(tu), id(td))  # tables live in self.memo, so ids are stable
        if key not in self.splits:
            o_u, o_d = self.overhead(u), self.overhead(d)

            def hulls():  # the minorant of a shifted table is the shifted minorant
                (hu, eu), (hd, ed) = self._hull(tu), self._hull(td)
                return (hu - o_u, eu), (hd - o_d, ed)

            # Shifted tables: spatial_time(T_U, T_D) = pipelined_time(T_U - o_U, T_D - o_D).
            pu, pd = tu.cost - o_u, td.cost - o_d
            cost, nu, ki = best_split_all(pu, pd, o_u, o_d, self.chunks, hulls)
            self.splits[key] = cost, nu.astype(np.int32), ki.astype(np.int16)  # 14 bytes per n
        return self.splits[key]

    def options(self, mask: int, fam: str) -> list[Choice]:
        """Every :class:`Choice` at the root (n = N only, skipping the all-n table of the root
        itself), in tie-break order."""
        if mask & (mask - 1) == 0:
            t = self.table(mask, False, fam)
            return [Choice(float(t.cost[self.n]))]
        out = []
        for c_i, u in enumerate(self.cuts(mask)):
            d = mask & ~u
            for v_i, (kind, fu, fd) in enumerate(_VARIANTS[fam]):
                sub = kind == _TEMPORAL
                tu, td = self.table(u, sub, fu), self.table(d, sub, fd)
                if kind == _TEMPORAL:
                    out.append(Choice(float(tu.cost[self.n] + td.cost[self.n]), v_i, c_i))
                    continue
                o_u, o_d = self.overhead(u), self.overhead(d)
                sv, snu, ski = best_split_at(
                    tu.cost - o_u, td.cost - o_d, o_u, o_d, self.chunks, self.n
                )
                out.append(Choice(sv, v_i, c_i, snu, ski))
        return out

    def root(self, mask: int, fam: str) -> Choice:
        """The cheapest option for ``mask`` on all devices (cost ``inf``: none feasible)."""
        best = Choice(INF)
        for opt in self.options(mask, fam):
            if opt.cost < best.cost:
                best = opt
        return best

    def build(self, mask, shared, fam, start, n, choice: Choice | None = None) -> Plan:
        """The Plan subtree of ``mask`` in family ``fam`` on devices [start, start + n)."""
        if choice is None:
            t = self.table(mask, shared, fam)
            choice = (
                Choice(t.cost[n])
                if t.var is None
                else Choice(t.cost[n], t.var[n], t.cut[n], t.nu[n], t.ki[n])
            )
        cost, v_i, c_i, n_u, k_i = choice
        if v_i < 0:
            node = self.nodes[mask.bit_length() - 1]
            kind = _leaf_kind(fam, node)
            if kind == "split" or (kind == "any" and node.split[0][n] < node.times[n]):
                return self._build_split(node, shared, start, n, float(cost))
            k = int(node.use[n])  # devices it uses of the n it is given
            devices = range(start, start + k)
            used = [int(_used(c, k)) for c in node.members]
            times = tuple(
                float(c.time(k)) + (c.switch_cost if shared else 0.0)
                for c, k in zip(node.members, used, strict=True)
            )
            mem = tuple(float(c.memory(k)) for c, k in zip(node.members, used, strict=True))
            names = tuple(c.name for c in node.members)
            return Leaf(devices, float(cost), node.name, names, times, shared, mem, tuple(used))
        kind, fu, fd = _VARIANTS[fam][int(v_i)]
        u = self.cuts(mask)[int(c_i)]
        d = mask & ~u
        if kind == _TEMPORAL:
            kids: list[Plan] = []
            for part in (self.build(u, True, fu, start, n), self.build(d, True, fd, start, n)):
                kids.extend(part.children if isinstance(part, Temporal) else [part])
            stop = max(kid.devices.stop for kid in kids)
            return Temporal(range(start, stop), float(cost), tuple(kids))
        n_u, m = int(n_u), self.m_list[int(k_i)]
        up = self.build(u, shared, fu, start, n_u)
        # Downstream right after what upstream uses: its cost depends on its count, not start.
        down = self.build(d, shared, fd, up.devices.stop, n - n_u)
        return Spatial(range(start, down.devices.stop), float(cost), up, down, m, self.M // m)

    def _build_split(self, node, shared: bool, start: int, n: int, cost: float) -> CycleSplit:
        """The :class:`~.plan.CycleSplit` of cycle ``node`` given n devices from ``start``:
        the leader on the first devices it uses, the follower right after."""
        cyc = node.cycle
        _, n_a, k, parts = node.split
        j, sub = int(n_a[n]), int(k[n])
        leaves, pos = [], start
        for c, (_, use), given in zip(node.members, parts, (j, n - j), strict=True):
            kd = int(use[given])
            used = int(_used(c, kd))
            busy = float(cyc.member_busy(float(c.time(used)), sub))
            busy += c.switch_cost if shared else 0.0
            mem = float(c.memory(used))
            leaves.append(
                Leaf(range(pos, pos + kd), busy, c.name, (c.name,), (busy,), shared, (mem,),
                     (used,))
            )  # fmt: skip
            pos += kd
        return CycleSplit(
            range(start, pos), cost, leaves[0], leaves[1], cyc.batch // sub, sub, node.name,
            float(cyc.round_trips),
        )  # fmt: skip
