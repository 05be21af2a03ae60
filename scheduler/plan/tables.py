"""DP tables of the planner (RLinf Algorithm 1, section 3.4): the best time of every node
subset S on every device count n = 0..N, per family of compositions, and the plan they encode.

:mod:`.planner` holds the model (components, workflow, condensation) and the entry point;
the search itself is described in its module docstring (points 2-4). Split out of it to keep
each module short, and split further: the chain tables' search in :mod:`.chain_search`, the
plan tree in :mod:`.plan_build`, the records they share in :mod:`.table_types`. Nothing here
is public API.

Spatial compositions are costed as one pipeline per chain (RLinf section 3.4, the pipelined
cost ``T_critical + (M/m - 1) * T_bottleneck`` applied to the whole chain): nested spatial
nodes flatten into a chain of *stages* (each a leaf, a temporal node or a split cycle), and a
chain in ``k`` chunks costs

    T = sum_i t_i + (k - 1) * max_i t_i,        t_i = (T_i - o_i) / k + o_i

(:func:`~.cost.flow_shop_time`; ``T_i``, ``o_i``: a stage's whole-batch seconds and per-chunk
overhead). The first chunk passes every stage; each further chunk adds the slowest stage's
chunk. So a chain has one ``k``, its nodes all carry it, and the cost does not depend on how
the tree nests the stages. A stage's per-chunk time is its whole-batch time over ``k`` (its
inner structure, a temporal node's children say, is not pipelined).

Three kinds of table per (subset, time-shared flag, family):

- *stage* ``P_st(S, n)``: the best plan whose top is not spatial (a leaf or a temporal node);
- *chain*: the best pipeline of two or more stages. Per chunk count k it keeps ``C_k(S, n)``,
  the least cost over its chains, and a lower bound of the slowest chunk of the chain reaching
  it; and ``A(S, n)``, the least sum of stage times (k-free: ``sum t_i = (sum T_i - o_S) / k +
  o_S``; it is ``C_1``), with the slowest stage of that chain;
- *any*: the better of the two (``P(S, n)``, what a temporal parent and the root use).

A chain's cost is not a function of its parts' costs (it needs their sums and bottlenecks), so
the chain table is not a plain DP over subsets: a chain on S is its first stage U (a down-set
of S, stage table) and the rest D = S \\ U (any table) on the other devices, and with the
first stage's chunk time ``t = t_U(j)`` as a *floor* under D's bottleneck the cost is
``t + Phi_D(n - j, t)`` with

    Phi_D(m, B) = min over D's plans on m devices of  sum_i t_i + (k - 1) * max(B, max_i t_i).

``Phi_D`` is exact without a search where the floor does not bind (``B`` at most the bottleneck
of D's best chain: ``C_k(D, m)``) or where D's least-sum chain fits under it (``A(D, m)`` plus
``(k - 1) B``); otherwise (the floor between the two) D's chains are searched again with the
floor (:meth:`Planner._chain_query`). Every split search bisects on the lower bound
``t + max(C_k(D, m), A_k(D, m) + (k - 1) max(B, t))``, convex in the split with the tables'
convex minorants, and evaluates exactly only the splits whose bound reaches the best exact
cost (:func:`~.search.split_query`). Only each n's best k must be exact in a table: a k that
cannot beat it keeps a lower bound of ``C_k`` and is solved when a query needs it. Exact
throughout: ``tests/test_planner.py`` checks every mode against a brute force over every
chain, split and chunk count, bisecting and not.

Memory: per table a float64 array over n = 0..N plus the winning choice per n in small integer
arrays; a chain table adds two ``(K, N+1)`` float64 arrays (K chunk counts: ``C_k`` and its
bottleneck) and three over n, an any table with a chain the ``(K, N+1)`` convex minorants of
its per-k lower bound. The chain search works in
blocks of :data:`_CELLS` queries. The 3-stage chain at 16,384 devices with every family
(runner-ups) peaks at 30 MiB of allocations (23 MiB before chains were costed as one
pipeline; ``tests/test_planner.py::test_large_plan_memory_is_bounded``).
"""

from __future__ import annotations

import numpy as np

from .build import PlanBuilder
from .chain_search import ChainSearch
from .cost import INF, divisors
from .cycle import split_table
from .table_types import (  # noqa: F401 (FAMILY, Choice: re-exported)
    _SPATIAL,
    _TEMPORAL,
    _VARIANTS,
    FAMILY,
    Choice,
    _Any,
    _Branch,
    _Chain,
    _evaluate,
    _leaf_kind,
    _of_kind,
    _span,
    _Stage,
    _used,
)
from .tree import PlanError

# Up to this many splits (N <= 192) every split of a chain search is bounded (no bisection).
EXHAUSTIVE_SPLITS = 18_336


class Planner(ChainSearch, PlanBuilder):
    """DP over node subsets (bitmasks) with arrays over device counts 0..N."""

    def __init__(self, nodes, edges, n_devices, capacity, batch_size, allow_idle=True, slack=0.0):
        self.nodes, self.n, self.cap, self.M = nodes, n_devices, capacity, batch_size
        self.allow_idle, self.slack = allow_idle, slack
        self.m_list = divisors(batch_size)[::-1]  # largest m first: ties prefer fewer chunks
        self.chunks = np.array([batch_size // m for m in self.m_list])
        self.kf = self.chunks.astype(float)
        self.exhaustive = n_devices * (n_devices - 1) // 2 <= EXHAUSTIVE_SPLITS
        self.pred = [0] * len(nodes)
        for u, v in edges:
            self.pred[v] |= 1 << u
        self.switch_mask = sum(1 << i for i, nd in enumerate(nodes) if nd.switch_cost > 0)
        self.memo: dict[tuple, object] = {}
        self._cuts: dict[int, list[int]] = {}
        self._piece_cache: dict[tuple, np.ndarray] = {}  # chain_search._pieces, per table
        self.inf = _Stage(np.full(n_devices + 1, INF), 0.0)
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

    def _shared(self, mask: int, shared: bool) -> bool:
        return shared and bool(mask & self.switch_mask)  # no switch cost: the same tables

    # ----------------------------------------------------------------------- the tables

    def stage(self, mask: int, shared: bool, fam: str) -> _Stage:
        """``P_st(mask, n)`` for all n within family ``fam``: a leaf, or the best temporal
        composition (``shared``: under a temporal node)."""
        shared = self._shared(mask, shared)
        if mask & (mask - 1) == 0:
            node = self.nodes[mask.bit_length() - 1]
            kind = _leaf_kind(fam, node)
            if kind is None:
                return self.inf
            key: tuple = ("leaf", mask, shared, kind)
            if key not in self.memo:
                cost = self._leaf_cost(node, kind) + node.switch_cost * shared
                self.memo[key] = _Stage(cost, node.chunk_overhead)
            return self.memo[key]
        variants = _of_kind(fam, _TEMPORAL)
        key = ("stage", mask, shared, variants)
        if key in self.memo:
            return self.memo[key]
        size = self.n + 1
        cost = np.full(size, INF)
        var, cut = np.full(size, -1, np.int8), np.full(size, -1, np.int32)
        for c_i, u in enumerate(self.cuts(mask)):
            d = mask & ~u
            for v_i, (fu, fd) in enumerate(variants):
                tu, td = self.table(u, True, fu), self.table(d, True, fd)
                if not (tu.feasible and td.feasible):
                    continue
                val = tu.cost + td.cost
                better = val < cost
                cost = np.where(better, val, cost)
                var[better], cut[better] = v_i, c_i
        self.memo[key] = _Stage(cost, self.overhead(mask), var, cut)
        return self.memo[key]

    def table(self, mask: int, shared: bool, fam: str) -> _Any:
        """``P(mask, n)`` for all n within family ``fam``: the better of its stage and chain
        tables (ties: the stage, i.e. temporal before spatial)."""
        shared = self._shared(mask, shared)
        key = ("any", mask, shared, fam)
        if key in self.memo:
            return self.memo[key]
        st = self.stage(mask, shared, fam)
        ch = None if mask & (mask - 1) == 0 else self.chain(mask, shared, fam)
        parts = ("any of", id(st), id(ch))  # families with the same parts share the table
        if parts in self.memo:
            self.memo[key] = self.memo[parts]
            return self.memo[key]
        o = self.overhead(mask)
        a_st, b_st = st.cost - o, np.full(self.n + 1, o)
        if ch is None:
            cost, is_chain = st.cost, np.zeros(self.n + 1, bool)
            asum, aa, ab = st.cost, a_st, b_st
        else:
            is_chain = ch.cost < st.cost
            cost = np.where(is_chain, ch.cost, st.cost)
            sum_chain = ch.asum < st.cost
            asum = np.where(sum_chain, ch.asum, st.cost)
            aa, ab = np.where(sum_chain, ch.aa, a_st), np.where(sum_chain, ch.ab, b_st)
        self.memo[key] = self.memo[parts] = _Any(
            st, ch, cost, is_chain, asum, aa, ab, o, _span(cost)
        )
        return self.memo[key]

    def chain(self, mask: int, shared: bool, fam: str) -> _Chain | None:
        """The chain table of ``mask`` within family ``fam`` (None: no spatial variant, or no
        feasible first stage and rest)."""
        shared = self._shared(mask, shared)
        variants = _of_kind(fam, _SPATIAL)
        key = ("chain", mask, shared, variants)
        if key in self.memo:
            return self.memo[key]
        branches = []
        for c_i, u in enumerate(self.cuts(mask)):
            for fu, fd in variants:
                b = self._branch(c_i, u, mask & ~u, shared, fu, fd)
                if b is not None:
                    branches.append(b)
        # Families whose branches are the same tables share the chain (the tables live in
        # self.memo, so their ids are stable).
        parts = ("chain of", *((b.cut, id(b.stage), id(b.rest)) for b in branches))
        if parts not in self.memo:
            self.memo[parts] = self._chain_table(branches) if branches else None
        self.memo[key] = self.memo[parts]
        return self.memo[key]

    def _branch(self, c_i, u, d, shared, fu, fd) -> _Branch | None:
        st, rest = self.stage(u, shared, fu), self.table(d, shared, fd)
        return _Branch(c_i, u, d, fu, fd, st, rest) if st.feasible and rest.feasible else None

    # ------------------------------------------------------------------ chain search

    # ------------------------------------------------------------------- the root

    def options(self, mask: int, fam: str) -> list[Choice]:
        """Every :class:`Choice` at the root (n = N only, skipping the all-n table of the root
        itself), in tie-break order."""
        if mask & (mask - 1) == 0:
            t = self.table(mask, False, fam)
            return [Choice(float(t.cost[self.n]))]
        out = []
        cuts = list(enumerate(self.cuts(mask)))
        order = [(c_i, u, v_i) for c_i, u in cuts for v_i in range(len(_VARIANTS[fam]))]
        order.sort(key=lambda x: _VARIANTS[fam][x[2]][0])  # temporal first, as in table()
        nk = self.chunks.size
        for c_i, u, v_i in order:
            d = mask & ~u
            kind, fu, fd = _VARIANTS[fam][v_i]
            if kind == _TEMPORAL:
                tu, td = self.table(u, True, fu), self.table(d, True, fd)
                out.append(Choice(float(tu.cost[self.n] + td.cost[self.n]), v_i, c_i))
                continue
            b = self._branch(c_i, u, d, False, fu, fd)
            if b is None:
                out.append(Choice(INF, v_i, c_i))
                continue
            ki, at_n, no_floor = np.arange(nk), np.full(nk, self.n), np.zeros(nk)
            val, _, _, j, _ = self._chain_query([b], ki, at_n, no_floor, group=np.zeros(nk, int))
            k = int(np.argmin(val))  # the fewest chunks among the least
            out.append(Choice(float(val[k]), v_i, c_i, int(j[k]), k))
        return out

    def root(self, mask: int, fam: str) -> Choice:
        """The cheapest option for ``mask`` on all devices (cost ``inf``: none feasible)."""
        best = Choice(INF)
        for opt in self.options(mask, fam):
            if opt.cost < best.cost:
                best = opt
        return best
