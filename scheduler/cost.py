"""Cost model of spatial (pipelined) composition and its device-split search.

Source: RLinf (Yu et al., 2025, "RLinf: Flexible and Efficient Large-scale Reinforcement
Learning via Macro-to-Micro Flow Transformation"), section 5 (profiling-guided scheduling) and
Algorithm 1. Two sub-plans U (upstream) and D (downstream) on disjoint devices process the
step's batch of ``M`` items in ``k = M / m`` chunks of ``m`` items (elastic pipelining). With
whole-batch times ``T_U``, ``T_D`` (seconds, on their own devices) and fixed per-chunk
overheads ``o_U``, ``o_D`` (seconds), the per-chunk stage times are

    t_U = (T_U - o_U) / k + o_U,        t_D = (T_D - o_D) / k + o_D.

A whole-batch time is measured as one chunk, so it already holds one chunk's fixed cost: ``k``
chunks cost ``T_U + (k - 1) * o_U`` in all, and ``k = 1`` costs exactly ``T_U`` (the profiler
measures ``o`` as the cost of each *extra* chunk, :mod:`m2flow.profiler`). This is
:func:`spatial_time`; the search functions below take the shifted tables ``T - o`` and apply
:func:`pipelined_time`, the same formula with ``t_U = T_U / k + o_U``.

and the predicted step time is the two-stage pipeline formula

    T = T_critical + (M/m - 1) * T_bottleneck,
    T_critical = t_U + t_D,  T_bottleneck = max(t_U, t_D).

(The first chunk traverses both stages; every further chunk adds one bottleneck stage time.)
Expanded, ``T = max(T_U + T_D/k + o_D + k*o_U, T_D + T_U/k + o_U + k*o_D)``, which is
nondecreasing in both ``T_U`` and ``T_D`` and, for fixed ``k``, convex in the pair (a maximum of
sums of convex terms); the split search below builds on both facts (see
:func:`best_split_all`).

Arrays in this module are indexed by device count: ``P[n]`` is a sub-plan's time (seconds) on
``n`` devices, ``P[0]`` unused (``inf``), ``inf`` meaning infeasible.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

INF = float("inf")
_HULL_PASSES = 64  # vectorised pruning passes of convex_minorant before its exact loop


def divisors(m: int) -> list[int]:
    """Positive divisors of ``m`` in increasing order (the candidate granularities)."""
    if m < 1:
        raise ValueError(f"batch size must be >= 1, got {m}")
    small = [d for d in range(1, int(m**0.5) + 1) if m % d == 0]
    return sorted(set(small + [m // d for d in small]))


def pipelined_time(t_u, t_d, o_u, o_d, chunks):
    """Predicted step time (seconds) of U -> D pipelined in ``chunks = M/m`` chunks.

    ``t_u``/``t_d``: whole-batch times (seconds, finite; scalars or broadcastable arrays);
    ``o_u``/``o_d``: per-chunk overheads (seconds). See the module docstring for the formula.
    """
    cu = t_u / chunks + o_u
    cd = t_d / chunks + o_d
    return cu + cd + (chunks - 1) * np.maximum(cu, cd)


def spatial_time(t_u, t_d, o_u, o_d, chunks):
    """Predicted step time (seconds) of U -> D pipelined in ``chunks`` chunks, where the
    whole-batch times ``t_u``/``t_d`` were measured unchunked (one chunk's overhead included):
    :func:`pipelined_time` of the shifted times ``t - o``. ``chunks = 1`` gives ``t_u + t_d``.
    """
    return pipelined_time(t_u - o_u, t_d - o_d, o_u, o_d, chunks)


def finite_pipelined(t_u, t_d, o_u, o_d, chunks):
    """:func:`pipelined_time` that is ``inf`` wherever ``t_u`` or ``t_d`` is (never NaN)."""
    with np.errstate(invalid="ignore"):
        v = pipelined_time(t_u, t_d, o_u, o_d, chunks)
    return np.where(np.isfinite(t_u) & np.isfinite(t_d), v, INF)


def convex_minorant(p: np.ndarray) -> tuple[np.ndarray, bool]:
    """Greatest convex minorant of a table ``p`` (length N+1, ``p[0]`` unused).

    Returns ``(h, exact)``: ``h[n] <= p[n]`` for every n, convex and finite on ``[first, last]``
    (the first and last n >= 1 with finite ``p[n]``), ``inf`` outside; ``exact`` is True when
    ``h`` is ``p`` itself (``p`` finite on a contiguous range and convex there, which holds for
    Amdahl-type leaves ``a + b/n + c*n`` and sums of them).
    """
    fin = np.flatnonzero(np.isfinite(p[1:])) + 1
    h = np.full(p.shape, INF)
    if fin.size == 0:
        return h, False
    lo, hi = int(fin[0]), int(fin[-1])
    seg = p[lo : hi + 1]
    if fin.size == hi - lo + 1 and (seg.size < 3 or bool(np.all(np.diff(seg, 2) >= 0))):
        return p, True
    # Vectorised passes first: a point on or above the chord of its neighbours is no hull
    # vertex, so dropping every such point keeps the hull (3-10x faster than the loop alone).
    for _ in range(_HULL_PASSES):
        a, b, c = fin[:-2], fin[1:-1], fin[2:]
        above = np.flatnonzero((p[b] - p[a]) * (c - b) >= (p[c] - p[b]) * (b - a))
        if not above.size:
            break
        fin = np.delete(fin, above + 1)
    hx: list[int] = []
    hy: list[float] = []
    for x, y in zip(fin.tolist(), p[fin].tolist()):  # Andrew's monotone chain, lower hull
        while len(hx) >= 2 and (hy[-1] - hy[-2]) * (x - hx[-1]) >= (y - hy[-1]) * (hx[-1] - hx[-2]):
            hx.pop()
            hy.pop()
        hx.append(x)
        hy.append(y)
    h[lo : hi + 1] = np.interp(np.arange(lo, hi + 1), hx, hy)
    return h, False


def _span(p: np.ndarray) -> tuple[int, int]:
    fin = np.flatnonzero(np.isfinite(p[1:]))
    return (int(fin[0]) + 1, int(fin[-1]) + 1) if fin.size else (1, 0)


EXHAUSTIVE_SPLITS = 18_336  # up to this many splits (N <= 192), the pruned quadratic search
_BLOCK = 1 << 17  # window candidates evaluated at once (bounds temporary memory)
_K_BLOCK = 4  # chunk counts bisected at once
_CELLS = 1 << 15  # (k, row) cells bisected at once


def best_split_all(
    pu: np.ndarray,
    pd: np.ndarray,
    o_u: float,
    o_d: float,
    chunks: np.ndarray,
    hulls: tuple | Callable | None = None,
    exhaustive_splits: int | None = None,
):
    """Best spatial composition of U -> D for every total device count n = 0..N.

    Args:
        pu, pd: tables of length N+1 (seconds per device count, ``inf`` = infeasible).
        o_u, o_d: per-chunk overheads (seconds).
        chunks: candidate chunk counts k = M/m, increasing (ties prefer fewer chunks).
        hulls: ``(convex_minorant(pu), convex_minorant(pd))`` if already known, or a callable
            returning them (called only when needed).
        exhaustive_splits: search every split (pruned by a lower bound: cheaper below a few
            hundred devices) when ``N(N-1)/2`` is at most this (default
            :data:`EXHAUSTIVE_SPLITS`; 0 forces the bisection search, for tests).

    Returns:
        ``(cost, n_u, k_index)``, each of length N+1; ``cost[n] = inf`` (``n_u = k_index = -1``)
        where no split is feasible. Ties: smallest n_U, then smallest k (rounding aside).

    Exact, in O(K N log N) for convex tables instead of the O(K N^2) of trying every split. For
    a fixed k and row n, ``L_k(j) = T_k(H_U[j], H_D[n-j])`` with the convex minorants ``H <= P``
    is convex in j (``T_k`` is a maximum of sums of convex functions of j) and a lower bound of
    the split's cost ``T_k(P_U[j], P_D[n-j])`` (``T_k`` is nondecreasing). Bisection on its
    slope finds its minimiser j*; where ``H = P`` (convex tables) that is the row's exact best
    for this k. Otherwise ``ub(n)`` = the best exact cost at the j* of every k, and only the j in
    the interval ``{j : L_k(j) <= ub(n)}`` (two more bisections) can do better: those are
    evaluated exactly. Non-convex tables thus cost more time, never exactness. Small problems
    (``N(N-1)/2 <= exhaustive_splits``) search every split, pruned by a cheaper lower bound.

    Memory: O(K N) plus blocks of at most :data:`_BLOCK` window candidates (:func:`_windows`),
    however long the windows: step-shaped tables (slack) make their total grow as N^2.
    """
    n_max = len(pu) - 1
    empty = _select(n_max, *(np.empty(0, np.int64),) * 3, np.empty(0))
    if n_max < 2:
        return empty
    limit = EXHAUSTIVE_SPLITS if exhaustive_splits is None else exhaustive_splits
    if n_max * (n_max - 1) // 2 <= limit:
        return _pruned(pu, pd, o_u, o_d, chunks)
    if callable(hulls):
        hulls = hulls()
    (hu, ex_u), (hd, ex_d) = hulls or (convex_minorant(pu), convex_minorant(pd))
    (fa, la), (fb, lb) = _span(hu), _span(hd)
    if fa > la or fb > lb:
        return empty
    rows = np.arange(2, n_max + 1)
    lo_j = np.maximum(np.maximum(fa, rows - lb), 1)  # j range with both minorants finite
    hi_j = np.minimum(np.minimum(la, rows - fb), rows - 1)
    ok = lo_j <= hi_j
    if not ok.any():
        return empty
    rows, lo_j, hi_j = rows[ok], lo_j[ok], hi_j[ok]
    kk = chunks.astype(float)[:, None]
    inv, c_u, c_d = 1.0 / kk, kk * o_u + o_d, kk * o_d + o_u
    n = rows[None, :]
    shape = (kk.size, rows.size)

    def lower(j, n, inv, c_u, c_d):  # L_k(j) (module docstring), inf-safe
        a, b = hu[j], hd[n - j]
        return np.maximum(a + b * inv + c_u, b + a * inv + c_d)

    # j*: the smallest minimiser of the convex L = first j with L(j+1) >= L(j). A few thousand
    # (k, row) cells at a time: the temporaries then stay in cache (measured 1.3-1.7x faster at
    # N = 1024, 3x at N = 32,768).
    j_star = np.empty(shape, np.int64)
    step = _top_step(lo_j, hi_j)
    width = _CELLS // _K_BLOCK
    for s in range(0, kk.size, _K_BLOCK):
        m = (inv[s : s + _K_BLOCK], c_u[s : s + _K_BLOCK], c_d[s : s + _K_BLOCK])
        for c in range(0, rows.size, width):
            nc, cells = n[:, c : c + width], (m[0].shape[0], min(width, rows.size - c))
            lo = np.broadcast_to(lo_j[c : c + width] - 1, cells)
            hi = np.broadcast_to(hi_j[c : c + width] - 1, cells)
            j_star[s : s + _K_BLOCK, c : c + width] = 1 + _lift(
                lo, hi, lambda j, nc=nc, m=m: lower(j + 1, nc, *m) < lower(j, nc, *m), step
            )
    v_star = finite_pipelined(pu[j_star], pd[n - j_star], o_u, o_d, kk)
    best = _column_best(n_max, rows, j_star, v_star)
    if not (ex_u and ex_d):
        ub = v_star.min(axis=0)
        thr = np.where(np.isfinite(ub), ub * (1 + 1e-9) + 1e-12, np.finfo(float).max)
        live = np.flatnonzero(lower(j_star, n, inv, c_u, c_d) <= thr[None, :])  # may do better
        if live.size:
            ki, ri = np.divmod(live, rows.size)
            js, t = j_star.ravel()[live], thr[ri]
            left, right = np.empty_like(js), np.empty_like(js)
            steps = _top_step(lo_j[ri], js), _top_step(js, hi_j[ri])
            for c in range(0, live.size, _CELLS):  # {j : L(j) <= thr}: an interval around j*
                w, x = slice(c, c + _CELLS), (ri[c : c + _CELLS], ki[c : c + _CELLS])
                m = (rows[x[0]], inv[x[1], 0], c_u[x[1], 0], c_d[x[1], 0])
                tw = t[w]
                left[w] = 1 + _lift(
                    lo_j[x[0]] - 1, js[w] - 1, lambda j, m=m, tw=tw: lower(j, *m) > tw, steps[0]
                )
                right[w] = _lift(
                    js[w], hi_j[x[0]], lambda j, m=m, tw=tw: lower(j, *m) <= tw, steps[1]
                )
            _windows(best, pu, pd, (o_u, o_d, kk[:, 0]), (rows[ri], ki, left, right, t))
    return best


def _top_step(lo: np.ndarray, hi: np.ndarray) -> int:
    """First step of :func:`_lift` over the ranges ``[lo, hi]`` (a power of two above every
    width; one step for all, so blocks of them lift exactly as the whole)."""
    return 1 << max(int((hi - lo).max()), 1).bit_length()


def _lift(pos, limit, keep_going, step: int):
    """Largest p in [pos, limit] reachable while ``keep_going`` holds (binary lifting; the
    predicate is monotone true -> false on the range)."""
    while step:
        cand = pos + step
        pos = pos + step * ((cand <= limit) & keep_going(np.minimum(cand, limit)))
        step >>= 1
    return pos


def _windows(best, pu, pd, model, windows) -> None:
    """Fold the splits of every window into ``best`` (``(cost, n_u, k_index)``, updated in
    place to the per-row least (cost, n_U, k)), evaluated exactly in blocks of about
    :data:`_BLOCK` splits: memory O(N K + _BLOCK), whatever the windows' total length (which
    grows as N^2 for flat tables: 9 M splits at N = 16,384 on the chain profile).

    ``model = (o_u, o_d, chunk counts)``; ``windows = (row n, k index, first j, last j,
    threshold)`` arrays: splits costlier than the threshold cannot be a row's best.

    When ``pd`` is nonincreasing (every table is, with idle devices allowed), only the first j
    of each run of equal ``pu[j]`` inside a window can win: along the run ``pd[n - j]`` only
    grows, and the cost is nondecreasing in it (rounding is monotone, so in floating point
    too), so the run's first j costs least and has the smallest n_U. Those js are the window's
    first and every j inside it where ``pu`` changes; the result is the same as evaluating
    every split, in O(number of distinct ``pu`` values) per window instead of its length.
    """
    o_u, o_d, chunks = model
    rows, ki, left, right, thr = windows
    if np.all(pd[1:-1] >= pd[2:]):
        steps = np.flatnonzero(pu[2:] != pu[1:-1]) + 2  # j with pu[j] != pu[j - 1]
        first = np.searchsorted(steps, left, side="right")
        counts = np.searchsorted(steps, right, side="right") - first + 1
    else:
        steps, first, counts = None, left, right - left + 1
    ends = np.cumsum(counts)
    cut = np.searchsorted(ends, np.arange(_BLOCK, int(ends[-1]), _BLOCK), side="right")
    bounds = np.unique(np.r_[0, cut, counts.size])
    cost, n_u, k_idx = best
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        c = counts[a:b]
        w = np.repeat(np.arange(a, b), c)
        start = np.cumsum(c) - c
        pos = np.arange(w.size) - np.repeat(start, c)  # index within the window
        j = left[w] + pos if steps is None else left[w]
        if steps is not None:
            inner = np.flatnonzero(pos)
            j[inner] = steps[first[w[inner]] + pos[inner] - 1]
        v = finite_pipelined(pu[j], pd[rows[w] - j], o_u, o_d, chunks[ki[w]])
        # Per window (j increasing): its least cost, at its smallest j.
        v_w = np.minimum.reduceat(v, start)
        at = np.flatnonzero(v == np.repeat(v_w, c))
        j_w = j[at[np.searchsorted(at, start)]]
        # Windows run k-major, so a row appears once per k: fold one k at a time.
        k_w = ki[a:b]
        for lo, hi in _runs(k_w):
            ok = lo + np.flatnonzero(v_w[lo:hi] <= thr[a + lo : a + hi])
            r, v, j, k = rows[a + ok], v_w[ok], j_w[ok], k_w[ok]
            cv, cj, ck = cost[r], n_u[r], k_idx[r]
            win = (v < cv) | ((v == cv) & ((j < cj) | ((j == cj) & (k < ck))))
            cost[r[win]], n_u[r[win]], k_idx[r[win]] = v[win], j[win], k[win]


def _runs(x: np.ndarray) -> list[tuple[int, int]]:
    """``[lo, hi)`` of every run of equal values in ``x``."""
    edges = np.flatnonzero(x[1:] != x[:-1]) + 1
    return list(zip(np.r_[0, edges].tolist(), np.r_[edges, x.size].tolist()))


def _column_best(n_max: int, rows, j, v):
    """:func:`_select` of the candidates ``(rows[c], j[k, c], k, v[k, c])``, one per (k, c):
    per column, least v, then smallest j, then smallest k, without sorting."""
    cost = np.full(n_max + 1, INF)
    n_u = np.full(n_max + 1, -1, dtype=np.int64)
    k_idx = np.full(n_max + 1, -1, dtype=np.int64)
    vmin = v.min(axis=0)
    at = v == vmin[None, :]
    jmin = np.where(at, j, np.iinfo(np.int64).max).min(axis=0)
    kmin = np.argmax(at & (j == jmin[None, :]), axis=0)
    fin = np.isfinite(vmin)
    cost[rows[fin]], n_u[rows[fin]], k_idx[rows[fin]] = vmin[fin], jmin[fin], kmin[fin]
    return cost, n_u, k_idx


def _row_best(r, j, ki, v):
    """Per distinct row r, its candidate of least cost v, then smallest n_U = j, then
    smallest k index ki (finite v only): four arrays, rows increasing."""
    r, j, ki, v = (np.ravel(x) for x in (r, j, ki, v))
    fin = np.isfinite(v)
    r, j, ki, v = r[fin], j[fin], ki[fin], v[fin]
    order = np.lexsort((ki, j, v, r))  # by row, then cost, then n_U, then k
    r, j, ki, v = r[order], j[order], ki[order], v[order]
    first = np.flatnonzero(np.r_[True, r[1:] != r[:-1]]) if r.size else r
    return r[first], j[first], ki[first], v[first]


def _select(n_max: int, r, j, ki, v):
    """Per row n: the candidate (n_U = j, k index ki, cost v) of least cost, then smallest
    n_U, then smallest k; as ``(cost, n_u, k_index)`` arrays of length N+1."""
    cost = np.full(n_max + 1, INF)
    n_u = np.full(n_max + 1, -1, dtype=np.int64)
    k_idx = np.full(n_max + 1, -1, dtype=np.int64)
    r, j, ki, v = _row_best(r, j, ki, v)
    cost[r], n_u[r], k_idx[r] = v, j, ki
    return cost, n_u, k_idx


@lru_cache(maxsize=8)
def _triangle(n_max: int):
    """All (n, n_U) with 2 <= n <= n_max, 1 <= n_U <= n-1, row-major by n then n_U: returns
    (n, n_U, row starts, row lengths)."""
    ns = np.arange(2, n_max + 1)
    lens = ns - 1
    n_idx = np.repeat(ns, lens)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    j_idx = np.arange(n_idx.size) - np.repeat(starts, lens) + 1
    return n_idx, j_idx, starts, lens


def _pruned(pu, pd, o_u, o_d, chunks):
    """:func:`best_split_all` over every split, pruned by a lower bound (small N).

    Each split's cost is at least ``max(A, B)`` with ``A = P_U + o_D + min_k (P_D/k + k o_U)``
    and ``B`` alike (k relaxed to a real interval); a row's upper bound is the exact cost of
    its split with the least bound; only splits whose bound reaches it are evaluated."""
    n_max = len(pu) - 1
    n_idx, j_idx, starts, lens = _triangle(n_max)
    a, b = pu[j_idx], pd[n_idx - j_idx]
    k = chunks.astype(float)[:, None]
    k_lo, k_hi = float(chunks.min()), float(chunks.max())
    with np.errstate(invalid="ignore"):
        lower = np.maximum(
            a + o_d + _relaxed(b, o_u, k_lo, k_hi), b + o_u + _relaxed(a, o_d, k_lo, k_hi)
        )
    lower[~np.isfinite(lower)] = INF
    rmin = np.minimum.reduceat(lower, starts)
    at = np.flatnonzero(lower == np.repeat(rmin, lens))
    _, first_at = np.unique(n_idx[at], return_index=True)
    probe = at[first_at]
    fin = np.isfinite(a[probe]) & np.isfinite(b[probe])
    ub = np.full(n_max - 1, INF)
    ub[n_idx[probe][fin] - 2] = np.min(
        pipelined_time(a[probe][fin], b[probe][fin], o_u, o_d, k), axis=0
    )
    ub = ub * (1 + 1e-9) + 1e-12
    cand = np.flatnonzero((lower <= np.repeat(ub, lens)) & np.isfinite(lower))
    vals = pipelined_time(a[cand][None, :], b[cand][None, :], o_u, o_d, k)  # (K, C)
    kb = np.argmin(vals, axis=0)
    return _select(n_max, n_idx[cand], j_idx[cand], kb, vals[kb, np.arange(cand.size)])


def _relaxed(s: np.ndarray, o: float, k_lo: float, k_hi: float) -> np.ndarray:
    """min over real k in [k_lo, k_hi] of s/k + k*o (convex in k): a lower bound of the
    minimum over the integer chunk counts in that interval."""
    if o <= 0:
        return np.where(s >= 0, s / k_hi, s / k_lo)
    # s < 0 (a shifted table, overhead above the whole-batch time): increasing in k.
    k = np.clip(np.sqrt(np.maximum(s, 0.0) / o), k_lo, k_hi)
    return s / k + k * o


def best_split_at(
    pu: np.ndarray, pd: np.ndarray, o_u: float, o_d: float, chunks: np.ndarray, n: int
) -> tuple[float, int, int]:
    """Best spatial composition of U -> D on exactly ``n`` devices: ``(cost, n_U, k_index)``.

    Same model and tie-break as :func:`best_split_all`, evaluated directly (O(n K)); ``(inf, -1,
    -1)`` when no split is feasible.
    """
    if n < 2:
        return INF, -1, -1
    j = np.arange(1, n)
    a, b = pu[j], pd[n - j]
    ok = np.isfinite(a) & np.isfinite(b)
    if not ok.any():
        return INF, -1, -1
    jj = j[ok]
    vals = pipelined_time(a[ok][:, None], b[ok][:, None], o_u, o_d, chunks.astype(float)[None, :])
    flat = int(np.argmin(vals))  # row-major: smallest n_U first, then smallest k
    r, c = divmod(flat, vals.shape[1])
    return float(vals[r, c]), int(jj[r]), int(c)
