"""One predicted step of a plan as busy intervals per leaf (what a Gantt chart draws).

The intervals follow the cost model exactly (RLinf section 5; :mod:`.cost`), so the last one
ends at the plan's predicted time:

- a leaf runs its members one after the other; a time-shared member first pays its switch
  (offload + onload) and then computes; a time-shared cycle then waits its hand-offs
  (``R * g_sh``, :mod:`.cycle`), drawn as one ``handoff`` interval;
- a cycle split across devices (:class:`~.plan.CycleSplit`) draws each member's busy time
  from the cycle's start (the round trips interleave too finely to draw) and ends at the
  cycle's predicted time;
- a temporal node runs its children one after the other on the same devices;
- a spatial node with ``k`` chunks runs chunk ``i`` of the upstream sub-plan at
  ``i * t_U`` (``t_U = T_U / k + o_U``: the sub-plan's own schedule scaled by ``1/k``, then
  the per-chunk overhead) and chunk ``i`` of the downstream sub-plan as soon as both that
  chunk and the downstream's previous chunk are done (two-stage flow shop).

When chunking would draw more than ``max_bars`` intervals, a chunked sub-plan is drawn as one
"busy" interval per leaf and chunk instead of its inner structure (times unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .plan import CycleSplit, Leaf, Plan, Spatial, Temporal


@dataclass(frozen=True)
class Bar:
    """A busy interval: ``row`` (index into :attr:`Timeline.rows`), ``start``/``end`` (seconds
    from the step's start), ``kind`` (``compute``, ``switch``, ``overhead``, ``handoff`` or
    ``busy``),
    ``component`` (original name, or the leaf name for overhead/busy) and ``chunk`` (index of
    the outermost chunk, -1 when not chunked)."""

    row: int
    start: float
    end: float
    kind: str
    component: str
    chunk: int = -1


@dataclass(frozen=True)
class Timeline:
    """``rows``: ``(leaf name, device range)`` top to bottom; ``bars``; ``end``: seconds."""

    rows: tuple[tuple[str, range], ...]
    bars: tuple[Bar, ...]
    end: float


def _count(node: Plan) -> int:
    if isinstance(node, Leaf):
        return 2 * len(node.components)
    if isinstance(node, Temporal):
        return sum(_count(c) for c in node.children)
    if isinstance(node, CycleSplit):
        return _count(node.upstream) + _count(node.downstream)
    assert isinstance(node, Spatial)
    return node.chunks * (_count(node.upstream) + _count(node.downstream) + 2)


def step_timeline(
    plan: Plan,
    switch: Mapping[str, float] | None = None,
    overhead: Mapping[str, float] | None = None,
    max_bars: int = 20000,
) -> Timeline:
    """The intervals of one predicted step of ``plan``.

    Args:
        switch: seconds per time-shared step by component (``switch_cost``; default 0).
        overhead: seconds per pipelined chunk by component (``chunk_overhead``; default 0).
        max_bars: above this many intervals, chunked sub-plans are drawn coarsely.

    With the same switch and overhead values the planner used, ``end`` equals ``plan.time``
    (up to rounding).
    """
    switch, overhead = dict(switch or {}), dict(overhead or {})
    leaves = plan.leaves()
    row_of = {id(lf): i for i, lf in enumerate(leaves)}
    bars: list[Bar] = []
    coarse = _count(plan) > max_bars

    def o(node: Plan) -> float:
        return sum(overhead.get(c, 0.0) for lf in node.leaves() for c in lf.components)

    def run(node: Plan, t0: float, s: float, chunk: int, flat: bool) -> float:
        """Schedule ``node`` from ``t0`` with its times scaled by ``s``; returns its end."""
        if flat:
            for lf in node.leaves():
                bars.append(Bar(row_of[id(lf)], t0, t0 + s * node.time, "busy", lf.name, chunk))
            return t0 + s * node.time
        if isinstance(node, Leaf):
            t = t0
            for c, busy in zip(node.components, node.component_times, strict=True):
                sw = switch.get(c, 0.0) if node.shared else 0.0
                if sw > 0:
                    bars.append(Bar(row_of[id(node)], t, t + s * sw, "switch", c, chunk))
                    t += s * sw
                bars.append(Bar(row_of[id(node)], t, t + s * (busy - sw), "compute", c, chunk))
                t += s * (busy - sw)
            gap = node.time - sum(node.component_times)
            if len(node.components) > 1 and gap > 1e-12 * node.time:  # a cycle's hand-offs
                bars.append(Bar(row_of[id(node)], t, t + s * gap, "handoff", node.name, chunk))
                t += s * gap
            return t
        if isinstance(node, Temporal):
            t = t0
            for child in node.children:
                t = run(child, t, s, chunk, flat)
            return t
        if isinstance(node, CycleSplit):
            for member in (node.upstream, node.downstream):
                run(member, t0, s, chunk, False)
            return t0 + s * node.time
        assert isinstance(node, Spatial)
        k = node.chunks
        up, down = node.upstream, node.downstream
        o_u, o_d = o(up), o(down)
        # The whole-batch times hold one chunk's overhead (cost.spatial_time): k chunks add
        # (k - 1) more, spread over the chunks.
        o_u, o_d = o_u * (k - 1) / k, o_d * (k - 1) / k
        cu, cd = up.time / k + o_u, down.time / k + o_d
        inner_flat = coarse and k > 1
        end_d = t0
        for i in range(k):
            tag = i if chunk < 0 else chunk
            su = t0 + i * s * cu
            mid = run(up, su, s / k, tag, inner_flat)
            _overheads(up, mid, s * o_u, tag)
            sd = max(su + s * cu, end_d)
            mid = run(down, sd, s / k, tag, inner_flat)
            _overheads(down, mid, s * o_d, tag)
            end_d = sd + s * cd
        return end_d

    def _overheads(node: Plan, t: float, dur: float, chunk: int) -> None:
        if dur > 0:
            for lf in node.leaves():
                bars.append(Bar(row_of[id(lf)], t, t + dur, "overhead", lf.name, chunk))

    end = run(plan, 0.0, 1.0, -1, False)
    rows = tuple((lf.name, lf.devices) for lf in leaves)
    return Timeline(rows, tuple(bars), end)
