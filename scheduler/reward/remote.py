"""The reward service as a plan node: a component that runs off the reserved devices.

A profile's ``reward_service:`` section names the component a remote DistRS service scores for
(the workflow's reward). The reserved plan then leaves it out: its devices go to the other
components, and its edges are *bridged* (``rollout -> reward -> actor`` becomes
``rollout -> actor``), since the service scores each response as it arrives (request-in) and the
consumer still pipelines behind the producer. The step pays what the service adds:

- ``extra_delay_s``: the batch's *extra delay*, the seconds its last reward comes later than
  with zero queuing (DistRS section 6.1's metric; ``benchmarks/reward_service.py`` reports it
  for DistRS's scaling, e.g. 0.62 s colocated, 0.85 s disaggregated in the paper);
- ``tail_s``: the scoring time of the batch's last request, which no pipelining hides (the
  profiled service latency of one request).

So ``step = reserved plan without the component + tail_s + extra_delay_s``. Not modelled: the
service's cost (another tenant pays for shared workers; DistRS's own GPU/CPU-time results are
in ``benchmarks/reward_service.py``), and a service so slow that it, not the reserved plan,
paces the stream. Pure; seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class RewardServiceError(ValueError):
    """A bad ``reward_service`` section (the message names the value and the fix)."""


@dataclass(frozen=True)
class RewardService:
    """A profile's ``reward_service:`` section (module docstring: the model).

    Attributes:
        component: the profiled component the service replaces (the reward).
        extra_delay_s: the service's predicted extra delay per batch, seconds >= 0.
        tail_s: scoring seconds of the last request, >= 0.
    """

    component: str = "reward"
    extra_delay_s: float = 0.0
    tail_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("extra_delay_s", "tail_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise RewardServiceError(f"reward_service.{name}={v!r}: give seconds >= 0")

    @property
    def added_s(self) -> float:
        """Seconds the service adds to the reserved plan's step."""
        return self.tail_s + self.extra_delay_s


def bridge(edges: Sequence[tuple[str, str]], name: str) -> list[tuple[str, str]]:
    """``edges`` without ``name``: each predecessor of ``name`` gets an edge to each of its
    successors (no self-loops, no duplicates), so the order ``name`` imposed stays.

    Args:
        edges: ``(src, dst)`` group edges.
    """
    preds = [s for s, d in edges if d == name and s != name]
    succs = [d for s, d in edges if s == name and d != name]
    out = [(s, d) for s, d in edges if name not in (s, d)]
    for s in preds:
        for d in succs:
            if s != d and (s, d) not in out:
                out.append((s, d))
    return out
