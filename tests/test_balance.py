"""Channel balance policies (scheduler/runtime/balance.py), pure: which consumer is served first
(serve_order), how many items FIFO takes (fifo_count), and the item-choosing policies."""

from __future__ import annotations

import itertools

from m2flow.scheduler.runtime.balance import (
    QueuedItem,
    all_queued,
    fifo,
    fifo_count,
    largest_first,
    serve_order,
)


def items(*weights: float) -> list[QueuedItem]:
    return [QueuedItem(float(w), seq, "p") for seq, w in enumerate(weights)]


def test_serve_order_least_loaded_first_then_arrival():
    # (weight taken so far, arrival number)
    assert serve_order([(100.0, 0), (0.0, 1)]) == [1, 0]  # the idle one, though it came later
    assert serve_order([(5.0, 0), (0.0, 2), (0.0, 1), (3.0, 3)]) == [2, 1, 3, 0]
    assert serve_order([(1.0, 3), (1.0, 0), (1.0, 7)]) == [1, 0, 2]  # ties: first come
    assert serve_order([]) == []


def test_fifo_count_without_target_takes_one():
    assert fifo_count([], None) == 0
    assert fifo_count([7.0, 1.0], None) == 1
    assert fifo_count([0.0], None) == 1  # a zero-weight item is still an item


def test_fifo_count_reaches_the_target():
    assert fifo_count([1, 2, 3, 4, 5], 5) == 3  # 1 + 2 + 3 = 6 >= 5
    assert fifo_count([1, 2, 3, 4, 5], 6) == 3  # exactly the target
    assert fifo_count([4, 1], 4) == 1
    assert fifo_count([1, 1], 3) == 0  # not enough queued: keep waiting
    assert fifo_count([], 1) == 0
    assert fifo_count([10], 0.5) == 1  # one heavy item meets a small target


def test_fifo_count_reads_only_what_it_takes():
    # the channel passes a generator over its whole queue: reading stops at the target
    seen: list[float] = []

    def weights(n: int = 1000):
        for w in itertools.repeat(1.0, n):
            seen.append(w)
            yield w

    assert fifo_count(weights(), 3) == 3 and len(seen) == 3
    seen.clear()
    assert fifo_count(weights(), None) == 1 and len(seen) == 1


def test_fifo_agrees_with_fifo_count():
    for ws, target in [((1, 2, 3), 4), ((1, 2, 3), None), ((1,), 5), ((), None)]:
        assert fifo(items(*ws), target) == list(range(fifo_count(ws, target)))
    assert fifo(items(1, 2, 3), 3) == [0, 1]


def test_largest_first():
    assert largest_first(items(1, 9, 5), 10) == [1, 2]  # 9 + 5, returned in queue order
    assert largest_first(items(1, 9, 5), None) == [1]
    assert largest_first(items(3, 3, 1), 3) == [0]  # equal weights: the older one
    assert largest_first(items(1, 2), 4) == []  # not enough queued
    assert largest_first([], None) == [] and largest_first([], 1) == []


def test_all_queued():
    assert all_queued(items(1, 2, 3), 100) == [0, 1, 2]
    assert all_queued([], None) == []
