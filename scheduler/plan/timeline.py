"""One predicted step of a plan as busy intervals per leaf (what a Gantt chart draws).

The intervals follow the cost model exactly (RLinf section 3.4; :mod:`.cost`), so the last one
ends at the plan's predicted time:

- a leaf runs its members one after the other; a time-shared member first pays its switch
  (offload + onload) and then computes; a time-shared cycle then waits its hand-offs
  (``R * g_sh``, :mod:`.cycle`), drawn as one ``handoff`` interval;
- a cycle split across devices (:class:`~.plan.CycleSplit`) draws each member's busy time
  from the cycle's start (the round trips interleave too finely to draw) and ends at the
  cycle's predicted time;
- a temporal node runs its children one after the other on the same devices;
- a spatial node with ``k`` chunks is one pipeline with its spatial descendants (a chain of
  *stages*: the leaves, temporal nodes and split cycles below it through spatial nodes;
  :func:`~.cost.flow_shop_time`): chunk ``i`` of a stage (``t = T / k + o (k - 1) / k``: the
  stage's own schedule scaled by ``1/k``, then the per-chunk overhead) starts as soon as both
  that chunk of the previous stage and the stage's previous chunk are done (flow shop).

When chunking would draw more than ``max_bars`` intervals, a chunked sub-plan is drawn as one
"busy" interval per leaf and chunk instead of its inner structure (times unchanged).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .tree import CycleSplit, Leaf, Plan, Spatial, Temporal


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
    return node.chunks * sum(_count(st) + 2 for st in _stages(node))


def _stages(node: Plan) -> list[Plan]:
    """The stages of the pipeline at ``node``: its spatial descendants flattened (a split
    cycle is one stage)."""
    if isinstance(node, Spatial) and not isinstance(node, CycleSplit):
        return _stages(node.upstream) + _stages(node.downstream)
    return [node]


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
        stages = _stages(node)
        # The whole-batch times hold one chunk's overhead (cost.chunk_time): k chunks add
        # (k - 1) more, spread over the chunks.
        extra = [o(st) * (k - 1) / k for st in stages]
        per = [st.time / k + x for st, x in zip(stages, extra, strict=True)]
        inner_flat = coarse and k > 1
        ends = [t0] * len(stages)  # when each stage finished its previous chunk
        for i in range(k):
            tag = i if chunk < 0 else chunk
            ready = t0  # chunk i is at the pipeline's input from its start
            for x, (st, dur, ov) in enumerate(zip(stages, per, extra, strict=True)):
                begin = max(ready, ends[x])
                mid = run(st, begin, s / k, tag, inner_flat)
                _overheads(st, mid, s * ov, tag)
                ends[x] = ready = begin + s * dur
        return ends[-1]

    def _overheads(node: Plan, t: float, dur: float, chunk: int) -> None:
        if dur > 0:
            for lf in node.leaves():
                bars.append(Bar(row_of[id(lf)], t, t + dur, "overhead", lf.name, chunk))

    end = run(plan, 0.0, 1.0, -1, False)
    rows = tuple((lf.name, lf.devices) for lf in leaves)
    return Timeline(rows, tuple(bars), end)
