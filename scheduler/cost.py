"""Cost model of spatial (pipelined) composition and its device-split search.

Source: RLinf (Yu et al., 2025, "RLinf: Flexible and Efficient Large-scale Reinforcement
Learning via Macro-to-Micro Flow Transformation"), section 5 (profiling-guided scheduling) and
Algorithm 1. Two sub-plans U (upstream) and D (downstream) on disjoint devices process the
step's batch of ``M`` items in ``k = M / m`` chunks of ``m`` items (elastic pipelining). With
whole-batch times ``T_U``, ``T_D`` (seconds, on their own devices) and fixed per-chunk
overheads ``o_U``, ``o_D`` (seconds), the per-chunk stage times are

    t_U = T_U * m / M + o_U = T_U / k + o_U,        t_D = T_D / k + o_D,

and the predicted step time is the two-stage pipeline formula

    T = T_critical + (M/m - 1) * T_bottleneck,
    T_critical = t_U + t_D,  T_bottleneck = max(t_U, t_D).

(The first chunk traverses both stages; every further chunk adds one bottleneck stage time.)
Expanded, ``T = max(T_U + T_D/k + o_D + k*o_U, T_D + T_U/k + o_U + k*o_D)``, which is
>= ``max(T_U, T_D)`` and increasing in both ``T_U`` and ``T_D``; the split search below uses this
lower bound to prune device splits without changing the optimum.

Arrays in this module are indexed by device count: ``P[n]`` is a sub-plan's time (seconds) on
``n`` devices, ``P[0]`` unused (``inf``), ``inf`` meaning infeasible.
"""

from __future__ import annotations

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


def _relaxed(s: np.ndarray, o: float, k_lo: float, k_hi: float) -> np.ndarray:
    """min over real k in [k_lo, k_hi] of s/k + k*o (convex in k): a lower bound of the
    minimum over the integer chunk counts in that interval."""
    if o <= 0:
        return s / k_hi
    k = np.clip(np.sqrt(s / o), k_lo, k_hi)
    return s / k + k * o


@lru_cache(maxsize=8)
def _triangle(n_max: int):
    """All (n, n_U) with 2 <= n <= n_max, 1 <= n_U <= n-1, row-major by n then n_U.

    Returns (n_idx, j_idx, d_idx = n - j, row starts, row lengths) for rows n = 2..n_max.
    """
    ns = np.arange(2, n_max + 1)
    lens = ns - 1
    n_idx = np.repeat(ns, lens)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    j_idx = np.arange(n_idx.size) - np.repeat(starts, lens) + 1
    return n_idx, j_idx, n_idx - j_idx, starts, lens


def best_split_all(pu: np.ndarray, pd: np.ndarray, o_u: float, o_d: float, chunks: np.ndarray):
    """Best spatial composition of U -> D for every total device count n = 0..N.

    ``pu``, ``pd``: arrays of length N+1 (seconds per device count, ``inf`` = infeasible).
    ``chunks``: candidate chunk counts k = M/m, increasing (so ties prefer the larger m).
    Returns ``(cost, n_u, k_index)``, each of length N+1; ``cost[n] = inf`` (``n_u = k_index =
    -1``) where no split is feasible. Ties: smallest n_U, then smallest k. Exact: a split is
    pruned only when its lower bound ``max(P_U, P_D)`` exceeds a cost some split achieves.
    """
    n_max = len(pu) - 1
    cost = np.full(n_max + 1, INF)
    n_u = np.full(n_max + 1, -1, dtype=np.int64)
    k_idx = np.full(n_max + 1, -1, dtype=np.int64)
    if n_max < 2:
        return cost, n_u, k_idx
    n_idx, j_idx, d_idx, starts, lens = _triangle(n_max)
    a = pu[j_idx]
    b = pd[d_idx]
    k = chunks.astype(float)[:, None]
    # Lower bound on each pair's optimum: min_k max(A_k, B_k) >= max(min_k A_k, min_k B_k) with
    # A_k = a + o_d + (b/k + k o_u), B_k = b + o_u + (a/k + k o_d), k relaxed to a real interval.
    k_lo, k_hi = float(chunks.min()), float(chunks.max())
    with np.errstate(invalid="ignore"):
        lower = np.maximum(
            a + o_d + _relaxed(b, o_u, k_lo, k_hi), b + o_u + _relaxed(a, o_d, k_lo, k_hi)
        )
    lower[~np.isfinite(lower)] = INF
    # Upper bound per row: the exact cost of the row's best-lower-bound pair.
    rmin = np.minimum.reduceat(lower, starts)
    at = np.flatnonzero(lower == np.repeat(rmin, lens))
    _, first_at = np.unique(n_idx[at], return_index=True)
    probe = at[first_at]
    pa, pb = a[probe], b[probe]
    finite = np.isfinite(pa) & np.isfinite(pb)
    ub = np.full(n_max - 1, INF)
    rows_p = n_idx[probe] - 2
    ub[rows_p[finite]] = np.min(pipelined_time(pa[finite], pb[finite], o_u, o_d, k), axis=0)
    ub = ub * (1 + 1e-9) + 1e-12
    keep = (lower <= np.repeat(ub, lens)) & np.isfinite(lower)
    cand = np.flatnonzero(keep)
    if cand.size == 0:
        return cost, n_u, k_idx
    vals = pipelined_time(a[cand][None, :], b[cand][None, :], o_u, o_d, k)  # (K, C)
    kbest = np.argmin(vals, axis=0)
    vbest = vals[kbest, np.arange(cand.size)]
    rows = n_idx[cand]
    uniq, first = np.unique(rows, return_index=True)
    gmin = np.minimum.reduceat(vbest, first)
    at_min = vbest == np.repeat(gmin, np.diff(np.append(first, cand.size)))
    win_rows, win_first = np.unique(rows[at_min], return_index=True)
    win = np.flatnonzero(at_min)[win_first]
    cost[win_rows] = vbest[win]
    n_u[win_rows] = j_idx[cand[win]]
    k_idx[win_rows] = kbest[win]
    return cost, n_u, k_idx


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
