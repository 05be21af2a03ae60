"""Channel balance policies: which queued items a consumer takes (RLinf section 3.5).

A policy is a pure function ``policy(items, target_weight) -> indices``. ``items`` are the
queued items of one channel key, oldest first, as :class:`QueuedItem`; ``target_weight`` is the
weight the consumer asked for (``None``: one item). It returns the indices to hand over, or an
empty list to keep the consumer waiting. The channel calls it whenever its queue changes, so a
policy must be cheap and must not mutate its input. Across concurrent consumers, the channel
serves the consumer with the least weight taken so far first; the policy decides *which* items.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedItem:
    """What a policy sees of a queued item: its weight, arrival number and producer."""

    weight: float
    seq: int
    producer: str


BalancePolicy = Callable[[Sequence[QueuedItem], "float | None"], list[int]]


def serve_order(waiters: Sequence[tuple[float, int]]) -> list[int]:
    """Which waiting consumer is served first: ``waiters`` are ``(weight taken so far, arrival
    number)``; returns their indices, least-loaded first, then by arrival (the channel's
    load balancing across consumers, RLinf section 3.5)."""
    return sorted(range(len(waiters)), key=lambda i: waiters[i])


def fifo_count(weights: Iterable[float], target_weight: float | None) -> int:
    """How many of the oldest items :func:`fifo` takes, from their weights alone (the
    channel's fast path: no :class:`QueuedItem` views). 0 = keep waiting."""
    if target_weight is None:
        return 1 if next(iter(weights), None) is not None else 0
    total = 0.0
    for i, w in enumerate(weights):
        total += w
        if total >= target_weight:
            return i + 1
    return 0


def fifo(items: Sequence[QueuedItem], target_weight: float | None) -> list[int]:
    """Oldest items first until their weight reaches ``target_weight`` (default policy).

    Waits (returns ``[]``) while the queue holds less than the target.
    """
    return list(range(fifo_count((it.weight for it in items), target_weight)))


def largest_first(items: Sequence[QueuedItem], target_weight: float | None) -> list[int]:
    """Heaviest queued items first until ``target_weight`` is reached (LPT-style packing).

    With several consumers taking equal targets in turn, this evens out their total weight
    better than FIFO when weights are skewed (e.g. long-tail response lengths).
    """
    if not items:
        return []
    order = sorted(range(len(items)), key=lambda i: (-items[i].weight, items[i].seq))
    if target_weight is None:
        return [order[0]]
    if sum(item.weight for item in items) < target_weight:
        return []
    taken, total = [], 0.0
    for i in order:
        if total >= target_weight:
            break
        taken.append(i)
        total += items[i].weight
    return sorted(taken)


def all_queued(items: Sequence[QueuedItem], target_weight: float | None) -> list[int]:
    """Every queued item, whatever the target (waits only on an empty queue).

    For a consumer that batches whatever has arrived (with ``max_items`` as the cap): chunks
    already queued are processed together, paying one chunk's fixed cost instead of several,
    while a consumer that keeps up still starts on the first chunk (adaptive granularity).
    """
    return list(range(len(items)))
