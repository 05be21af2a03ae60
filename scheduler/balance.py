"""Channel balance policies: which queued items a consumer takes (RLinf section 4.2).

A policy is a pure function ``policy(items, target_weight) -> indices``. ``items`` are the
queued items of one channel key, oldest first, as :class:`QueuedItem`; ``target_weight`` is the
weight the consumer asked for (``None``: one item). It returns the indices to hand over, or an
empty list to keep the consumer waiting. The channel calls it whenever its queue changes, so a
policy must be cheap and must not mutate its input. Across concurrent consumers, the channel
serves the consumer with the least weight taken so far first; the policy decides *which* items.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedItem:
    """What a policy sees of a queued item: its weight, arrival number and producer."""

    weight: float
    seq: int
    producer: str


BalancePolicy = Callable[[Sequence[QueuedItem], "float | None"], list[int]]


def fifo(items: Sequence[QueuedItem], target_weight: float | None) -> list[int]:
    """Oldest items first until their weight reaches ``target_weight`` (default policy).

    Waits (returns ``[]``) while the queue holds less than the target.
    """
    if not items:
        return []
    if target_weight is None:
        return [0]
    total = 0.0
    for i, item in enumerate(items):
        total += item.weight
        if total >= target_weight:
            return list(range(i + 1))
    return []


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
