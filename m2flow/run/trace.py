"""Workflow graph traced from channel traffic (RLinf section 3.4, profiling input).

Each channel records, for every item handed to a consumer, the edge
``producer group -> consumer group``. :func:`workflow_graph` merges them over the channels this
process created: the graph the planner plans.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.channel import DRIVER, created_channels


@dataclass(frozen=True)
class Edge:
    """``items`` went from group ``src`` to group ``dst`` through ``channel``."""

    src: str
    dst: str
    channel: str
    items: int


def workflow_graph(include_driver: bool = False) -> list[Edge]:
    """Edges seen so far on every channel this process created, sorted.

    Args:
        include_driver: keep edges from/to the driver (inputs put by the runner loop).
    """
    edges = []
    for name, ch in created_channels().items():
        for src, dst, n in ch.graph_edges():
            if include_driver or DRIVER not in (src, dst):
                edges.append(Edge(src, dst, name, n))
    return sorted(edges, key=lambda e: (e.src, e.dst, e.channel))
