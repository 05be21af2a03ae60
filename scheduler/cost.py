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

    def lower(j, n=n, inv=inv, c_u=c_u, c_d=c_d):  # L_k(j) (module docstring), inf-safe
        a, b = hu[j], hd[n - j]
        return np.maximum(a + b * inv + c_u, b + a * inv + c_d)

    def lift(pos, limit, keep_going):
        """Largest p in [pos, limit] reachable while ``keep_going`` holds (binary lifting; the
        predicate is monotone true -> false on the range)."""
        step = 1 << max(int((limit - pos).max()), 1).bit_length()
        while step:
            cand = pos + step
            pos = pos + step * ((cand <= limit) & keep_going(np.minimum(cand, limit)))
            step >>= 1
        return pos

    # j*: the smallest minimiser of the convex L = first j with L(j+1) >= L(j). A few k at a
    # time: the temporaries then stay in cache (measured 1.3-1.7x faster at N = 1024).
    j_star = np.empty(shape, np.int64)
    for s in range(0, kk.size, _K_BLOCK):
        b = slice(s, s + _K_BLOCK)
        lo = np.broadcast_to(lo_j, j_star[b].shape)
        hi = np.broadcast_to(hi_j, j_star[b].shape)
        args = {"inv": inv[b], "c_u": c_u[b], "c_d": c_d[b]}
        j_star[b] = lift(lo - 1, hi - 1, lambda j, a=args: lower(j + 1, **a) < lower(j, **a)) + 1
    v_star = finite_pipelined(pu[j_star], pd[n - j_star], o_u, o_d, kk)
    k_all = np.broadcast_to(np.arange(kk.size)[:, None], shape)
    cand = [(np.broadcast_to(rows, shape), j_star, k_all, v_star)]
    if not (ex_u and ex_d):
        ub = v_star.min(axis=0)
        thr = np.where(np.isfinite(ub), ub * (1 + 1e-9) + 1e-12, np.finfo(float).max)
        live = np.flatnonzero(lower(j_star) <= thr[None, :])  # (k, row) that may do better
        if live.size:
            ki, ri = np.divmod(live, rows.size)
            js, t = j_star.ravel()[live], thr[ri]
            args = {"n": rows[ri], "inv": inv[ki, 0], "c_u": c_u[ki, 0], "c_d": c_d[ki, 0]}
            # {j : L(j) <= thr} is an interval around j*: bisect both ends.
            left = lift(lo_j[ri] - 1, js - 1, lambda j: lower(j, **args) > t) + 1
            right = lift(js, hi_j[ri], lambda j: lower(j, **args) <= t)
            lens = right - left + 1
            total = int(lens.sum())
            e = np.repeat(np.arange(live.size), lens)
            j_all = np.arange(total) - np.repeat(np.cumsum(lens) - lens - left, lens)
            for s in range(0, total, _BLOCK):
                f, j = e[s : s + _BLOCK], j_all[s : s + _BLOCK]
                r = rows[ri[f]]
                v = finite_pipelined(pu[j], pd[r - j], o_u, o_d, kk[ki[f], 0])
                keep = np.flatnonzero(v <= t[f])
                cand.append((r[keep], j[keep], ki[f][keep], v[keep]))
    r, j, ki, v = (np.concatenate([np.ravel(c[i]) for c in cand]) for i in range(4))
    return _select(n_max, r, j, ki, v)


def _select(n_max: int, r, j, ki, v):
    """Per row n: the candidate (n_U = j, k index ki, cost v) of least cost, then smallest
    n_U, then smallest k; as ``(cost, n_u, k_index)`` arrays of length N+1."""
    cost = np.full(n_max + 1, INF)
    n_u = np.full(n_max + 1, -1, dtype=np.int64)
    k_idx = np.full(n_max + 1, -1, dtype=np.int64)
    fin = np.isfinite(v)
    r, j, ki, v = r[fin], j[fin], ki[fin], v[fin]
    if r.size == 0:
        return cost, n_u, k_idx
    order = np.lexsort((ki, j, v, r))  # by row, then cost, then n_U, then k
    r, j, ki, v = r[order], j[order], ki[order], v[order]
    first = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    cost[r[first]] = v[first]
    n_u[r[first]] = j[first]
    k_idx[r[first]] = ki[first]
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
