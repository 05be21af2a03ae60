"""Channel on a real (embedded) Ray session: order, keys, weights, balancing, tensors, trace."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import wait_until
from m2flow.scheduler.runtime.balance import QueuedItem, largest_first

from m2flow import Channel, Worker, WorkerError, group_method
from m2flow.core.channel import _needs_object_store
from m2flow.run.trace import Edge, workflow_graph

pytestmark = pytest.mark.e2e


def only_heavy(items, target_weight):
    """Custom policy: every queued item of weight >= 10, whatever the target."""
    return [i for i, it in enumerate(items) if it.weight >= 10]


def newest_first(items, target_weight):
    """Custom policy (LIFO): the newest items until the target is reached."""
    assert all(isinstance(it, QueuedItem) for it in items)
    taken, total = [], 0.0
    for i in reversed(range(len(items))):
        taken.append(i)
        total += items[i].weight
        if target_weight is None or total >= target_weight:
            return sorted(taken)
    return []


class Producer(Worker):
    @group_method
    def put_seq(self, ch: Channel, n: int, key=None, start: int = 0):
        for i in range(start, start + n):
            ch.put(i, weight=1, key=key)
        return n

    @group_method
    def put_tensor(self, ch: Channel, numel: int, seed: int):
        import torch

        t = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        ch.put(t, weight=t.numel())
        return float(t.sum())


class Consumer(Worker):
    @group_method
    def get_seq(self, ch: Channel, n: int, key=None, timeout: float = 60):
        return [ch.get(key=key, timeout=timeout) for _ in range(n)]

    @group_method
    def take_one(self, ch: Channel, timeout: float = 60, signal=None):
        """One item. With ``signal``, puts this rank's key under the key ``signal`` once its
        get is registered (the channel applies one client's operations in program order), so
        the test can wait until this consumer is waiting."""
        if signal is None:
            return ch.get(timeout=timeout)
        got = ch.get(timeout=timeout, async_op=True)
        ch.put(self.worker_key, key=signal)
        return got.wait()

    @group_method
    def get_async(self, ch: Channel, n: int):
        works = [ch.get(async_op=True) for _ in range(n)]
        return [w.wait() for w in works]


def test_fifo_from_driver(cluster):
    ch = Channel.create("fifo-driver")
    for i in range(100):
        ch.put(i)
    assert ch.qsize() == 100
    assert [ch.get(timeout=30) for _ in range(100)] == list(range(100))
    assert ch.qsize() == 0
    ch.close()


@pytest.fixture(scope="module")
def workers(cluster):
    prod = Producer.launch(cluster, placement=[0], name="prod")
    cons = Consumer.launch(cluster, placement=[1], name="cons")
    return prod, cons


def test_fifo_between_workers(workers):
    prod, cons = workers
    ch = Channel.create("fifo-workers")
    got = cons.get_seq(ch, 60)  # consumer first: it waits for the producer
    assert prod.put_seq(ch, 60).wait(timeout=60) == [60]
    assert got.wait(timeout=60)[0] == list(range(60))
    # driver -> worker as well
    for i in range(10):
        ch.put(("d", i))
    assert cons.get_seq(ch, 10).wait(timeout=60)[0] == [("d", i) for i in range(10)]
    # worker -> driver
    prod.put_seq(ch, 10, start=100).wait(timeout=60)
    assert [ch.get(timeout=30) for _ in range(10)] == list(range(100, 110))


def test_keyed_get(cluster):
    ch = Channel.create("keyed")
    for i in range(6):
        ch.put(("a", i), key="a")
        ch.put(("b", i), key="b")
    ch.put(("none", 0))
    assert ch.qsize("a") == 6 and ch.qsize("b") == 6 and ch.qsize() == 1
    assert ch.qsize("never-used") == 0
    assert [ch.get(key="b", timeout=10) for _ in range(6)] == [("b", i) for i in range(6)]
    assert ch.qsize("a") == 6  # untouched by gets on "b"
    assert ch.get_batch(3, key="a", timeout=10) == [("a", 0), ("a", 1), ("a", 2)]
    with pytest.raises(TimeoutError):
        ch.get(key="b", timeout=0.3)  # "b" is empty even though "a" and None are not
    assert ch.get(timeout=10) == ("none", 0)
    ch.close()


def test_get_batch_reaches_target_weight(cluster):
    ch = Channel.create("batch")
    weights = [1, 2, 3, 4, 5]
    for i, w in enumerate(weights):
        ch.put(f"item{i}", weight=w)
    got = ch.get_batch(5, timeout=10)  # FIFO: 1 + 2 + 3 = 6 >= 5
    assert got == ["item0", "item1", "item2"]
    got = ch.get_batch(4, timeout=10)  # exactly the target: item3 (4)
    assert got == ["item3"]
    # not enough weight queued (5 < 6): the batch waits, then times out
    with pytest.raises(TimeoutError):
        ch.get_batch(6, timeout=0.5)
    assert ch.qsize() == 1  # nothing was taken by the failed batch
    ch.put("item5", weight=1)
    assert ch.get_batch(6, timeout=10) == ["item4", "item5"]
    # max_items caps how many of the policy's items a batch takes
    for i in range(4):
        ch.put(i, weight=1)
    assert ch.get_batch(3, max_items=1, timeout=10) == [0]
    assert ch.get_batch(3, max_items=5, timeout=10) == [1, 2, 3]
    ch.close()


def test_put_many_keeps_order_and_weights(cluster):
    ch = Channel.create("put-many")
    ch.put("first", weight=1)
    ch.put_many(["a", "b", "c"], weights=[2, 2, 5])
    ch.put("last", weight=1)
    assert ch.qsize() == 5
    assert ch.get_batch(5, timeout=10) == ["first", "a", "b"]  # 1 + 2 + 2 >= 5
    assert ch.get_batch(6, timeout=10) == ["c", "last"]  # weights arrived with the items
    with pytest.raises(ValueError, match="one weight per item"):
        ch.put_many([1, 2], weights=[1])
    with pytest.raises(ValueError, match="weight"):
        ch.put_many([1, 2], weights=[1, -1])
    assert ch.qsize() == 0  # a refused call queued nothing
    ch.close()


def test_put_many_bounded_says_what_was_queued(cluster):
    ch = Channel.create("put-many-bounded", maxsize=2)
    with pytest.raises(TimeoutError, match="first 2 of these 3 items are queued"):
        ch.put_many([1, 2, 3], timeout=0.5)
    assert [ch.get(timeout=10), ch.get(timeout=10)] == [1, 2]
    ch.close()


def test_negative_weight_rejected(cluster):
    ch = Channel.create("negw")
    with pytest.raises(ValueError, match="weight"):
        ch.put(1, weight=-1)
    ch.close()


def test_least_loaded_consumer_served_first(cluster):
    """Two consumers wait; the one with less weight taken so far gets the next item, even
    though the other started waiting earlier."""
    ch = Channel.create("balance")
    cons = Consumer.launch(cluster, placement=[0, 1], name="bcons")
    # rank 0 takes a heavy item: load(rank 0) = 100, load(rank 1) = 0
    first = cons.on(0).take_one(ch)
    ch.put("heavy", weight=100)
    assert first.wait(timeout=60) == ["heavy"]
    # rank 0 waits first, rank 1 second
    wait0 = cons.on(0).take_one(ch, signal="waiting")
    wait_until(lambda: ch.qsize("waiting") == 1, what="rank 0 waiting in get")
    wait1 = cons.on(1).take_one(ch, signal="waiting")
    wait_until(lambda: ch.qsize("waiting") == 2, what="rank 1 waiting in get")
    assert [ch.get(key="waiting", timeout=10) for _ in range(2)] == ["bcons:0", "bcons:1"]
    assert not wait0.done() and not wait1.done()
    ch.put("light-1", weight=1)
    assert wait1.wait(timeout=30) == ["light-1"]  # least loaded first, not first come
    assert ch.qsize() == 0 and not wait0.done()  # the one item went to rank 1 alone
    ch.put("light-2", weight=1)
    assert wait0.wait(timeout=30) == ["light-2"]
    ch.close()


def test_weights_balance_many_items(cluster):
    """Items of very different weights, fed one at a time to two always-waiting consumers:
    the total weight each consumer takes stays within one item's weight of the other."""
    ch = Channel.create("balance-many")
    cons = Consumer.launch(cluster, placement=[0, 1], name="mcons")
    weights = [50, 1, 1, 1, 30, 2, 2, 40, 1, 1, 1, 1, 20, 3]
    calls = [cons.on(r).take_one(ch, signal="waiting") for r in (0, 1)]
    waiting = 2  # gets registered so far (each signals once)
    wait_until(lambda: ch.qsize("waiting") == waiting, what="both consumers waiting")
    load = {0: 0, 1: 0}
    for i, w in enumerate(weights):
        ch.put(("w", w), weight=w)
        # whoever got it reports it; the other consumer keeps waiting
        done = wait_until(
            lambda: [r for r in (0, 1) if calls[r].done()], what=f"a consumer taking item {i}"
        )
        assert len(done) == 1, f"item {i}: {len(done)} consumers finished"
        r = done[0]
        assert calls[r].wait(timeout=5) == [("w", w)]
        assert ch.qsize() == 0 and not calls[1 - r].done()
        # the item went to the consumer that had taken less weight (ties: either)
        assert load[r] <= load[1 - r], f"item {i} (w={w}) went to the busier consumer {r}"
        load[r] += w
        calls[r] = cons.on(r).take_one(ch, signal="waiting")
        waiting += 1
        wait_until(lambda n=waiting: ch.qsize("waiting") == n, what=f"rank {r} waiting again")
    assert abs(load[0] - load[1]) <= max(weights)
    ch.put("stop-0")
    ch.put("stop-1")
    assert sorted(c.wait(timeout=30)[0] for c in calls) == ["stop-0", "stop-1"]
    ch.close()


def test_custom_balance_policy(cluster):
    ch = Channel.create("policy")
    for i, w in enumerate([1, 20, 2, 30, 3]):
        ch.put(f"i{i}", weight=w)
    # fifo would give ["i0"]; the custom policy takes the heavy ones
    assert ch.get_batch(1, balance=only_heavy, timeout=10) == ["i1", "i3"]
    # LIFO policy: newest first until the target (3 + 2 = 5 >= 4)
    assert ch.get_batch(4, balance=newest_first, timeout=10) == ["i2", "i4"]
    assert ch.get_batch(1, timeout=10) == ["i0"]
    # a policy that finds nothing keeps the consumer waiting (then it times out)
    ch.put("light", weight=1)
    with pytest.raises(TimeoutError):
        ch.get_batch(1, balance=only_heavy, timeout=0.5)
    ch.put("heavy", weight=11)
    assert ch.get_batch(1, balance=only_heavy, timeout=10) == ["heavy"]
    # the built-in largest_first policy
    for i, w in enumerate([1, 9, 5]):
        ch.put(f"l{i}", weight=w)
    assert ch.get_batch(10, balance=largest_first, timeout=10) == ["l1", "l2"]  # 9 + 5
    assert ch.get_batch(2, timeout=10) == ["light", "l0"]
    ch.close()


def test_get_timeout_names_channel(cluster):
    ch = Channel.create("empty-channel-xyz")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="empty-channel-xyz"):
        ch.get(timeout=0.5)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TimeoutError, match="empty-channel-xyz"):
        ch.get_batch(3, timeout=0.3)
    ch.close()


def test_get_timeout_in_worker(workers):
    _, cons = workers
    ch = Channel.create("empty-in-worker")
    with pytest.raises(WorkerError) as ei:
        cons.get_seq(ch, 1, timeout=0.5).wait(timeout=60)
    assert "TimeoutError" in str(ei.value) and "empty-in-worker" in str(ei.value)
    ch.close()


def test_bounded_channel_put_times_out(cluster):
    ch = Channel.create("bounded", maxsize=2)
    ch.put(1)
    ch.put(2)
    with pytest.raises(TimeoutError, match="bounded"):
        ch.put(3, timeout=0.5)
    assert ch.get(timeout=10) == 1
    ch.put(3, timeout=10)  # room again
    assert [ch.get(timeout=10), ch.get(timeout=10)] == [2, 3]
    ch.close()


def test_large_tensor_round_trip(cluster):
    import torch

    ch = Channel.create("tensor")
    t = torch.randn(4 * 1024 * 1024)  # 16 MiB of float32
    assert t.numel() * t.element_size() == 16 * 1024 * 1024
    assert _needs_object_store(t) and _needs_object_store({"x": t, "meta": 1})
    assert not _needs_object_store({"a": 1, "b": [1, 2]})
    ch.put(t, weight=1)
    ch.put({"x": t[:10], "meta": "m"}, weight=1)
    out = ch.get(timeout=30)
    assert torch.equal(out, t)
    d = ch.get(timeout=30)
    assert d["meta"] == "m" and torch.equal(d["x"], t[:10])
    ch.close()


def test_large_tensor_from_worker(workers):
    import torch

    prod, _ = workers
    ch = Channel.create("tensor-worker")
    numel = 4 * 1024 * 1024
    [s] = prod.put_tensor(ch, numel, 3).wait(timeout=60)
    out = ch.get(timeout=30)
    expected = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out, expected) and float(out.sum()) == pytest.approx(s)
    ch.close()


def test_async_ops(workers):
    _, cons = workers
    ch = Channel.create("async")
    works = [ch.put(i, async_op=True) for i in range(5)]
    for w in works:
        w.wait()
    assert ch.qsize() == 5
    # (the order of concurrent async puts is checked in test_async_ops_keep_fifo)
    got = [ch.get(async_op=True).wait()]
    got += ch.get_batch(2, async_op=True).wait()

    async def main():
        return await ch.get(async_op=True), await ch.get_batch(1, async_op=True)

    one, batch = asyncio.run(main())
    assert len(batch) == 1
    assert sorted(got + [one] + batch) == [0, 1, 2, 3, 4]
    assert ch.qsize() == 0
    # an async get issued before the put receives it (the channel applies this client's
    # operations in program order: the get is registered, and waiting, when the put comes)
    pending = ch.get(async_op=True, timeout=30)
    ch.put("late")
    assert pending.wait() == "late"
    # async gets inside a worker
    call = cons.get_async(ch, 3)
    for i in range(3):
        ch.put(("x", i))
    assert sorted(call.wait(timeout=60)[0]) == [("x", 0), ("x", 1), ("x", 2)]
    ch.close()


def test_async_ops_keep_fifo(cluster):
    ch = Channel.create("async-order")
    for w in [ch.put(i, async_op=True) for i in range(100)]:
        w.wait()
    assert [ch.get(timeout=10) for _ in range(100)] == list(range(100))
    pending = [ch.get(async_op=True, timeout=30) for _ in range(30)]
    for i in range(30):
        ch.put(i)
    assert [w.wait() for w in pending] == list(range(30))
    ch.close()


def test_traced_graph(workers):
    prod, cons = workers
    ch = Channel.create("traced")
    got = cons.get_seq(ch, 7)
    prod.put_seq(ch, 5).wait(timeout=60)
    ch.put("a")
    ch.put("b")
    assert got.wait(timeout=60)[0] == [0, 1, 2, 3, 4, "a", "b"]
    ch.put("c")
    ch.get(timeout=10)
    edges = sorted(ch.graph_edges())
    assert edges == [("driver", "cons", 2), ("driver", "driver", 1), ("prod", "cons", 5)]
    graph = workflow_graph()
    assert Edge("prod", "cons", "traced", 5) in graph
    assert all("driver" not in (e.src, e.dst) for e in graph)
    full = workflow_graph(include_driver=True)
    assert Edge("driver", "cons", "traced", 2) in full
    assert Edge("driver", "driver", "traced", 1) in full
