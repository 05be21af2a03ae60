"""Cost model of spatial (pipelined) composition.

Source: RLinf (Yu et al., 2025, "RLinf: Flexible and Efficient Large-scale Reinforcement
Learning via Macro-to-Micro Flow Transformation"), section 3.4 (scheduling policy) and
Algorithm 1. Stages on disjoint devices process the step's batch of ``M`` items in ``k = M /
m`` chunks of ``m`` items (elastic pipelining, section 3.3). A stage whose whole batch takes
``T`` seconds on its devices, with a fixed cost ``o`` seconds per chunk, takes per chunk

    t = (T - o) / k + o                                             (chunk_time)

A whole-batch time is measured as one chunk, so it already holds one chunk's fixed cost: ``k``
chunks cost ``T + (k - 1) * o`` in all, and ``k = 1`` costs exactly ``T`` (the profiler
measures ``o`` as the cost of each *extra* chunk, :mod:`m2flow.run.profiler`).

RLinf prices a pipeline as ``T_critical + (M/m - 1) * T_bottleneck``: ``T_critical`` the
pipeline's warm-up and cool-down (the first chunk passes every stage) and ``T_bottleneck`` the
slowest stage's chunk (each further chunk adds one). A chain of stages ``1..S`` joined by
spatial compositions is one pipeline, however a plan tree nests them, so

    T = sum_i t_i + (k - 1) * max_i t_i                             (flow_shop_time)

the makespan of ``k`` identical jobs in a permutation flow shop. Two stages give
:func:`spatial_time`. The cost is nondecreasing and convex in every ``t_i`` (a sum plus a
maximum of them), so in the stages' whole-batch times too: the planner's exact device-split
search (:mod:`.search`, :mod:`.tables`) builds on both facts.

Arrays of the planner are indexed by device count: ``P[n]`` is a sub-plan's time (seconds) on
``n`` devices, ``P[0]`` unused (``inf``), ``inf`` meaning infeasible.
"""

from __future__ import annotations

import numpy as np

INF = float("inf")
_HULL_PASSES = 64  # vectorised pruning passes of convex_minorant before its exact loop


def divisors(m: int) -> list[int]:
    """Positive divisors of ``m`` in increasing order (the candidate granularities)."""
    if m < 1:
        raise ValueError(f"batch size must be >= 1, got {m}")
    small = [d for d in range(1, int(m**0.5) + 1) if m % d == 0]
    return sorted(set(small + [m // d for d in small]))


def chunk_time(t, o, chunks):
    """Seconds per chunk of a stage whose whole batch takes ``t`` seconds measured as one chunk,
    with ``o`` seconds of fixed cost per chunk, in ``chunks`` chunks: ``(t - o) / chunks + o``
    (``k`` chunks then cost ``t + (k - 1) o`` in all; scalars or broadcastable arrays)."""
    return (t - o) / chunks + o


def flow_shop_time(times, overheads, chunks):
    """Predicted step time (seconds) of a chain of stages pipelined in ``chunks`` chunks.

    RLinf section 3.4, ``T_critical + (M/m - 1) * T_bottleneck`` over the whole chain: the
    first chunk passes every stage (``T_critical = sum_i t_i``), then each further chunk adds
    the slowest stage's chunk (``T_bottleneck = max_i t_i``), with ``t_i = chunk_time(T_i,
    o_i, k)``. ``times``/``overheads``: per stage, whole-batch seconds measured unchunked and
    seconds per chunk (sequences of equal length >= 1, scalars or broadcastable arrays). Two
    stages give :func:`spatial_time`; one chunk gives ``sum_i T_i``.

    Raises:
        ValueError: no stage, or ``times`` and ``overheads`` of different lengths.
    """
    if len(times) == 0 or len(times) != len(overheads):
        raise ValueError(
            f"need one overhead per stage, got {len(times)} times and {len(overheads)} overheads"
        )
    per = [chunk_time(t, o, chunks) for t, o in zip(times, overheads, strict=True)]
    slowest = per[0]
    for t in per[1:]:
        slowest = np.maximum(slowest, t)
    return sum(per[1:], per[0]) + (chunks - 1) * slowest


def pipelined_time(t_u, t_d, o_u, o_d, chunks):
    """Predicted step time (seconds) of U -> D pipelined in ``chunks = M/m`` chunks of
    ``t / chunks + o`` seconds each: ``t_u``/``t_d`` whole-batch seconds *less* one chunk's
    overhead (finite; scalars or broadcastable arrays), ``o_u``/``o_d`` seconds per chunk.
    :func:`flow_shop_time` of two stages with ``T = t + o``."""
    cu = t_u / chunks + o_u
    cd = t_d / chunks + o_d
    return cu + cd + (chunks - 1) * np.maximum(cu, cd)


def spatial_time(t_u, t_d, o_u, o_d, chunks):
    """Predicted step time (seconds) of U -> D pipelined in ``chunks`` chunks, where the
    whole-batch times ``t_u``/``t_d`` were measured unchunked (one chunk's overhead included):
    :func:`pipelined_time` of the shifted times ``t - o``. ``chunks = 1`` gives ``t_u + t_d``.
    """
    return pipelined_time(t_u - o_u, t_d - o_d, o_u, o_d, chunks)


def convex_minorant(p: np.ndarray) -> tuple[np.ndarray, bool]:
    """Greatest convex minorant of a table ``p`` (length N+1, ``p[0]`` unused).

    Returns ``(h, exact)``: ``h[n] <= p[n]`` for every n, convex and finite on ``[first, last]``
    (the first and last n >= 1 with finite ``p[n]``), ``inf`` outside; ``exact`` is True when
    ``h`` is ``p`` itself (``p`` finite on a contiguous range and convex there, which holds for
    Amdahl-type leaves ``a + b/n + c*n`` and sums of them).
    """
    fin = np.isfinite(p[1:]).nonzero()[0] + 1
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
        above = ((p[b] - p[a]) * (c - b) >= (p[c] - p[b]) * (b - a)).nonzero()[0]
        if not above.size:  # every point below its neighbours' chord: the hull itself
            h[lo : hi + 1] = np.interp(np.arange(lo, hi + 1), fin, p[fin])
            return h, False
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
