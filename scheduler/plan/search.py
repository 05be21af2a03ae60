"""Exact search of a two-way device split under a convex, nondecreasing cost.

For two parts U and D with tables over device counts (``T[j]``: seconds on ``j`` devices,
``inf``: infeasible) and a cost ``f_v(U[j], D[n - j])`` per *variant* ``v`` (a chunk count, a
sub-batch count...), :func:`split_min` finds, for every total ``n = 0..N`` and every variant,
the least cost over ``1 <= j <= n - 1`` and the smallest ``j`` attaining it. A part may hold
several tables, each of shape ``(N+1,)`` or ``(V, N+1)`` (one row per variant).

Requirement on the cost: nondecreasing and convex in every table value. Then, with the
greatest convex minorants ``H <= T`` (:func:`~.cost.convex_minorant`), ``L_v(j) = f_v(H_U(j),
H_D(n - j))`` is convex in ``j`` and a lower bound of the true cost. The search bisects ``L``'s
slope for its minimiser ``j*``, takes the exact cost there as an upper bound ``ub`` and
evaluates exactly every ``j`` with ``L(j) <= ub`` (an interval around ``j*``, two more
bisections). Where every table is convex and finite on its range (``H = T``) the bound is the
cost and ``j*`` is the answer. The cycle split (:mod:`.cycle`) uses it. Small problems (up to
``exhaustive_splits`` splits) are searched exhaustively.

:func:`split_query` is the same method for a cost that is not a function of two tables: per
query a range of splits, a convex lower bound and an exact cost given as callables. The
planner's chain search (:mod:`.tables`: a pipeline's first stage and the rest, whose exact cost
is itself a search) uses it.

Memory: O(V N) (O(Q) queries) plus blocks of at most :data:`BLOCK` evaluated splits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .cost import INF, convex_minorant

BLOCK = 1 << 17  # splits evaluated at once
EXHAUSTIVE_SPLITS = 4096  # up to this many (n, j) pairs (N <= 91): try every split

Cost = Callable[[tuple, tuple, np.ndarray], np.ndarray]


def _rows(tables: Sequence[np.ndarray], nv: int) -> list[np.ndarray]:
    """Every table as ``(V, N+1)`` (a shared row broadcast, not copied)."""
    out = []
    for t in tables:
        t = np.asarray(t, dtype=float)
        out.append(np.broadcast_to(t, (nv, t.shape[-1])) if t.ndim == 1 else t)
    return out


def _gather(tables, v, j) -> tuple:
    return tuple(t[v, j] for t in tables)


def _exact(cost: Cost, up, down, v, j, n) -> np.ndarray:
    """The cost at (variant v, split j of n), ``inf`` where a table is (never NaN)."""
    u, d = _gather(up, v, j), _gather(down, v, n - j)
    fin = np.ones(np.shape(j), dtype=bool)
    for x in u + d:
        fin &= np.isfinite(x)
    with np.errstate(invalid="ignore", over="ignore"):
        val = cost(u, d, v)
    return np.where(fin, val, INF)


def split_min(
    up: Sequence[np.ndarray],
    down: Sequence[np.ndarray],
    cost: Cost,
    variants: int,
    exhaustive_splits: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Least cost of every (variant, n) over the splits ``j + (n - j) = n``, both parts >= 1.

    Args:
        up, down: the parts' tables, each of length N+1 (index = devices, ``[0]`` unused) or
            shape ``(variants, N+1)``.
        cost: ``cost(u_values, d_values, v)`` -> seconds, elementwise (``u_values`` a tuple of
            arrays, one per table of ``up``; ``v`` the variant index per element);
            nondecreasing and convex in every table value.
        variants: number of variants V.
        exhaustive_splits: try every split when ``N(N-1)/2`` is at most this (default
            :data:`EXHAUSTIVE_SPLITS`; 0 forces the bisection, for tests).

    Returns:
        ``(value, j)``, both ``(V, N+1)``: ``inf`` and ``-1`` where no split is feasible.
        Ties: the smallest ``j``.
    """
    nv = variants
    up, down = _rows(up, nv), _rows(down, nv)
    n_max = up[0].shape[1] - 1
    value = np.full((nv, n_max + 1), INF)
    best_j = np.full((nv, n_max + 1), -1, dtype=np.int64)
    if n_max < 2:
        return value, best_j
    limit = EXHAUSTIVE_SPLITS if exhaustive_splits is None else exhaustive_splits
    if n_max * (n_max - 1) // 2 <= limit:
        lens = np.arange(1, n_max)
        ns = np.repeat(np.arange(2, n_max + 1), lens)
        js = np.arange(ns.size) - np.repeat(np.cumsum(lens) - lens, lens) + 1
        vv = np.repeat(np.arange(nv), ns.size)
        nn, jj = np.tile(ns, nv), np.tile(js, nv)
        _fold(value, best_j, vv, nn, jj, _exact(cost, up, down, vv, jj, nn))
        return value, best_j
    hu = [_minorants(t) for t in up]
    hd = [_minorants(t) for t in down]
    exact_tables = all(ex for _, ex in hu + hd)
    hu_t = [h for h, _ in hu]
    hd_t = [h for h, _ in hd]
    # Finite span of each part per variant: every table of the part finite there.
    fa, la = _span(hu_t)
    fb, lb = _span(hd_t)
    rows = np.arange(2, n_max + 1)
    v = np.repeat(np.arange(nv), rows.size)
    n = np.tile(rows, nv)
    lo = np.maximum(np.maximum(fa[v], n - lb[v]), 1)
    hi = np.minimum(np.minimum(la[v], n - fb[v]), n - 1)
    ok = lo <= hi
    v, n, lo, hi = v[ok], n[ok], lo[ok], hi[ok]
    if not v.size:
        return value, best_j

    def bound(j, v=v, n=n):  # L_v(j): convex in j, below the exact cost
        with np.errstate(invalid="ignore", over="ignore"):
            return cost(_gather(hu_t, v, j), _gather(hd_t, v, n - j), v)

    # j*: the first j in [lo, hi] with L(j + 1) >= L(j) (L convex: its smallest minimiser).
    j_star = _lift(lo - 1, hi - 1, lambda j: bound(j + 1) < bound(j)) + 1
    ub = _exact(cost, up, down, v, j_star, n)
    _fold(value, best_j, v, n, j_star, ub)
    if exact_tables:  # the bound is the cost: j* is the answer
        return value, best_j
    thr = _threshold(ub)
    live = bound(j_star) <= thr  # cells whose bound leaves room below the upper bound
    v, n, lo, hi, j_star, thr = (x[live] for x in (v, n, lo, hi, j_star, thr))

    def bound_at(j, v=v, n=n):
        with np.errstate(invalid="ignore", over="ignore"):
            return cost(_gather(hu_t, v, j), _gather(hd_t, v, n - j), v)

    # {j : L(j) <= thr} is an interval around j* (L convex): its two ends by bisection.
    left = _lift(lo - 1, j_star - 1, lambda j: bound_at(j) > thr) + 1
    right = _lift(j_star, hi, lambda j: bound_at(j) <= thr)
    _windows(value, best_j, cost, up, down, v, n, left, right)
    return value, best_j


def _minorants(t: np.ndarray) -> tuple[np.ndarray, bool]:
    """Per-row convex minorant of a ``(V, N+1)`` table (rows that are the same array once)."""
    if t.strides[0] == 0:  # a broadcast row
        h, ex = convex_minorant(np.ascontiguousarray(t[0]))
        return np.broadcast_to(h, t.shape), ex
    hs = [convex_minorant(np.ascontiguousarray(r)) for r in t]
    return np.stack([h for h, _ in hs]), all(ex for _, ex in hs)


def _span(tables: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per variant, the first and last device count where every table is finite (the
    minorants are finite on a contiguous range)."""
    first = last = None
    for t in tables:
        fin = np.isfinite(t)
        fin[:, 0] = False
        any_ = fin.any(axis=1)
        f = np.where(any_, np.argmax(fin, axis=1), t.shape[1])
        lst = np.where(any_, t.shape[1] - 1 - np.argmax(fin[:, ::-1], axis=1), 0)
        first = f if first is None else np.maximum(first, f)
        last = lst if last is None else np.minimum(last, lst)
    return first, last


def _lift(pos: np.ndarray, limit: np.ndarray, keep_going: Callable) -> np.ndarray:
    """Largest p in [pos, limit] reachable while ``keep_going(p)`` holds, the predicate true
    then false on the range (binary lifting); ``pos`` itself is not tested."""
    width = int(np.max(limit - pos, initial=0))
    step = 1 << max(width, 1).bit_length()
    while step:
        cand = pos + step
        ok = cand <= limit
        test = np.where(ok, cand, pos)
        pos = np.where(ok & keep_going(test), cand, pos)
        step >>= 1
    return pos


def _fold(value, best_j, v, n, j, val) -> None:
    """Fold candidates into the per-(v, n) least value, then smallest j."""
    fin = np.isfinite(val)
    if not fin.any():
        return
    v, n, j, val = v[fin], n[fin], j[fin], val[fin]
    order = np.lexsort((j, val, n, v))
    v, n, j, val = v[order], n[order], j[order], val[order]
    first = np.concatenate(([True], (v[1:] != v[:-1]) | (n[1:] != n[:-1])))
    v, n, j, val = v[first], n[first], j[first], val[first]
    cur, cj = value[v, n], best_j[v, n]
    win = (val < cur) | ((val == cur) & ((j < cj) | (cj < 0)))
    value[v[win], n[win]] = val[win]
    best_j[v[win], n[win]] = j[win]


def _windows(value, best_j, cost, up, down, v, n, left, right) -> None:
    """Evaluate every split of every window ``[left, right]`` exactly, in blocks of about
    :data:`BLOCK` splits, folding each (v, n)'s best into ``value``/``best_j``."""
    for w, j in _blocks(left, right - left + 1):
        _fold(value, best_j, v[w], n[w], j, _exact(cost, up, down, v[w], j, n[w]))


Exact = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def split_query(
    lo: np.ndarray,
    hi: np.ndarray,
    bound: Callable[[np.ndarray], Callable[[np.ndarray], np.ndarray]],
    exact: Exact,
    ub: np.ndarray | None = None,
    runs: np.ndarray | None = None,
    exhaustive: bool = False,
    group: np.ndarray | None = None,
    bracket: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Least exact cost of every query ``q`` over the splits ``lo[q] <= j <= hi[q]``.

    :func:`split_min` for a cost that is not a function of two tables: each query has its own
    range, and the exact cost of a split comes from a callable (the planner's chain search,
    :mod:`.tables`, evaluates it by a nested search). Where :func:`split_min` bounds its cost
    with the tables' convex minorants, the caller passes the bound.

    Args:
        lo, hi: int arrays ``(Q,)``: the range of ``j`` per query (none where ``lo > hi``).
        bound: ``bound(q)(j)`` -> seconds, elementwise over index arrays (``bound(q)`` takes
            what the queries ``q`` share, then is called with many ``j``): a lower bound of
            the exact cost, finite and convex in ``j`` on each query's range (so that ``{j :
            bound <= t}`` is an interval). Exhaustive mode needs only the lower bound.
        exact: ``exact(q, j, cap)`` -> ``(seconds, payload)``: the exact cost where it is at
            most ``cap`` (else any value above ``cap``, which lets the callee skip work; ``inf``
            where infeasible, never NaN) and one float of the caller's per split (returned at
            the winner).
        ub: seconds ``(Q,)``: splits whose bound is above ``ub`` (within 1e-9) are skipped, so a
            query no split of which beats it gets ``inf`` (the caller holds a better one).
        runs: table over ``j`` (length above every ``hi``) such that the exact cost is
            nondecreasing in ``j`` along every run of equal ``runs[j]`` (a nonincreasing
            downstream); then only the first ``j`` of each run in a window is evaluated.
        exhaustive: evaluate the bound at every split (no convexity needed; O(range) per
            query) instead of bisecting on it.
        group: int array ``(Q,)``: only the least cost of each group is wanted exactly (the
            planner's chunk counts of one device count), so splits whose bound is above the
            group's best so far are skipped; a query that loses this way gets a lower bound.
        bracket: int arrays ``(L, R)``, ``(Q,)``: per query a sub-range of ``[lo, hi]``
            holding the bound's smallest minimiser (the planner's chain search derives one
            from the bound's convex pieces); the bisection for ``j*`` then searches only it.
            Ignored in exhaustive mode.

    Returns:
        ``(value, j, payload, lower)``, each ``(Q,)``: ``inf``, ``-1``, ``nan`` where no split
        is feasible (or none beats ``ub``); ``lower <= value`` bounds the query's least cost
        from below, equal to ``value`` where that is exact (always without ``group``; at
        least the least ``value`` of each group). Ties: the smallest ``j``.

    Bisection as in :func:`split_min`: ``j*`` minimises the bound, ``exact(j*)`` is an upper
    bound, and only the interval ``{j : bound(j) <= min(exact(j*), ub)}`` around ``j*`` is
    evaluated exactly, in blocks of about :data:`BLOCK` splits.
    """
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    nq = lo.size
    value, best_j, payload = np.full(nq, INF), np.full(nq, -1, np.int64), np.full(nq, np.nan)
    lower = np.full(nq, INF)
    ub = np.full(nq, INF) if ub is None else np.asarray(ub, dtype=float)
    q = (lo <= hi).nonzero()[0]
    if not q.size:
        return value, best_j, payload, lower
    with np.errstate(invalid="ignore", over="ignore"):
        if exhaustive:
            j_star = lo[q].copy()
            b_star = np.full(q.size, INF)
            for w, j in _blocks(lo[q], hi[q] - lo[q] + 1):
                _fold_runs(b_star, j_star, None, np.arange(q.size), w, j, bound(q[w])(j), None)
        else:
            bq = bound(q)
            a, b = (lo[q], hi[q]) if bracket is None else (bracket[0][q], bracket[1][q])
            j_star = _lift(a - 1, b - 1, lambda j: np.subtract(*bq(j + _PAIR)) < 0) + 1
            b_star = np.where(np.isnan(b := bq(j_star)), INF, b)
        lower[q] = b_star
        keep = b_star <= _threshold(ub[q])
        q, j_star, b_star = q[keep], j_star[keep], b_star[keep]
        if not q.size:
            return value, best_j, payload, lower
        v, x = exact(q, j_star, _threshold(ub[q]))
        _fold_q(value, best_j, payload, q, j_star, v, x)
        cap = np.minimum(value[q], ub[q])
        if group is not None and q.size:
            best = np.full(int(group.max()) + 1, INF)
            np.minimum.at(best, group, np.minimum(value, ub))
            cap = np.minimum(cap, best[group[q]])
        thr = _threshold(cap)
        if exhaustive:
            for w, j in _blocks(lo[q], hi[q] - lo[q] + 1):
                sel = ((bound(q[w])(j) <= thr[w]) & (j != j_star[w])).nonzero()[0]
                if sel.size:
                    v, x = exact(q[w[sel]], j[sel], thr[w[sel]])
                    _fold_runs(value, best_j, payload, q, w[sel], j[sel], v, x)
        else:
            # {j : bound(j) <= thr}: an interval around j* (the bound is convex); most are
            # j* alone, seen from its neighbours.
            bq = bound(q)
            wide = (bq(np.maximum(j_star - 1, lo[q])) <= thr) & (j_star > lo[q])
            wide |= (bq(np.minimum(j_star + 1, hi[q])) <= thr) & (j_star < hi[q])
            wide &= b_star <= thr
            qw, jw, tw = q[wide], j_star[wide], thr[wide]
            bq = bound(qw)
            left = _lift(lo[qw] - 1, jw - 1, lambda j: bq(j) > tw) + 1
            right = _lift(jw, hi[qw], lambda j: bq(j) <= tw)
            for w, j in _blocks(left, right - left + 1, runs):
                v, x = exact(qw[w], j, tw[w])
                _fold_runs(value, best_j, payload, qw, w, j, v, x)
        # Splits left out have bounds above the threshold: exact where the best is below it.
        done = value[q] <= thr
        lower[q] = np.where(done, value[q], np.maximum(b_star, np.minimum(value[q], cap)))
    return value, best_j, payload, lower


_PAIR = np.array([[1], [0]])  # j + _PAIR: the splits j + 1 and j in one evaluation


def _threshold(ub: np.ndarray) -> np.ndarray:
    """Bounds up to this may still reach ``ub`` (rounding slack; no limit where ``ub = inf``)."""
    return np.where(np.isfinite(ub), ub * (1 + 1e-9) + 1e-12, np.finfo(float).max)


def _blocks(start: np.ndarray, counts: np.ndarray, runs: np.ndarray | None = None):
    """``(w, j)`` blocks of about :data:`BLOCK` splits: every ``j`` in ``[start[w], start[w] +
    counts[w])`` for each window ``w``; with ``runs``, only a window's first ``j`` and those
    where ``runs[j] != runs[j - 1]`` (the first of each run of equal values)."""
    counts = np.maximum(counts, 0)
    steps = first = None
    if runs is not None:
        steps = (runs[2:] != runs[1:-1]).nonzero()[0] + 2  # j with runs[j] != runs[j - 1]
        first = steps.searchsorted(start, side="right")
        last = start + counts - 1
        counts = np.where(counts > 0, steps.searchsorted(last, side="right") - first + 1, 0)
    if not counts.any():
        return
    ends = np.cumsum(counts)
    cut = ends.searchsorted(np.arange(BLOCK, int(ends[-1]), BLOCK), side="right")
    edges = np.unique(np.r_[0, cut, counts.size])
    for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
        c = counts[a:b]
        w = np.repeat(np.arange(a, b), c)
        pos = np.arange(w.size) - np.repeat(np.cumsum(c) - c, c)  # index within the window
        if steps is None:
            yield w, start[w] + pos
            continue
        j = start[w].copy()
        inner = pos.nonzero()[0]
        j[inner] = steps[first[w[inner]] + pos[inner] - 1]
        yield w, j


def _fold_q(value, best_j, payload, q, j, v, x) -> None:
    """Fold candidates ``(q, j, v, x)``, one per query ``q`` (distinct), into the per-query
    least finite ``v``, then smallest ``j`` (``payload`` follows the winner; ``None`` skips
    it)."""
    cur, cj = value[q], best_j[q]
    win = (np.isfinite(v) & ((v < cur) | ((v == cur) & ((j < cj) | (cj < 0))))).nonzero()[0]
    value[q[win]], best_j[q[win]] = v[win], j[win]
    if payload is not None:
        payload[q[win]] = x[win]


def _fold_runs(value, best_j, payload, q, w, j, v, x) -> None:
    """:func:`_fold_q` of a block of :func:`_blocks`: ``w`` (window per candidate) is
    nondecreasing, ``j`` increasing within a window, ``q[w]`` the window's query (distinct)."""
    v = np.where(np.isnan(v), INF, v)
    starts = np.concatenate(([True], w[1:] != w[:-1])).nonzero()[0]
    v_w = np.minimum.reduceat(v, starts)
    at = (v == np.repeat(v_w, np.diff(np.concatenate((starts, [w.size]))))).nonzero()[0]
    first = at[at.searchsorted(starts)][np.isfinite(v_w)]  # each window's least, first j
    _fold_q(value, best_j, payload, q[w[first]], j[first], v[first],
            None if x is None else x[first])  # fmt: skip
