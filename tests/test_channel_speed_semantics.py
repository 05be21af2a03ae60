"""What the channel's fast paths keep: puts without a reply per put (ordered, visible to the
producer's own gets, applied by the end of its group call, errors raised later), read-ahead
(only for a key's only reader, handed back whenever someone else may need the items), bounded
channels that still block their producer, tensors that cross without copies yet arrive intact
and private, and device reservations that never break mutual exclusion."""

from __future__ import annotations

import os
import time

import pytest
import ray
from helpers import EventLog, wait_until

from m2flow import Channel, Worker, WorkerError, group_method
from m2flow.core.channel_codec import pack, unpack

pytestmark = pytest.mark.e2e


class Producer(Worker):
    @group_method
    def put_range(self, ch: Channel, n: int, key=None):
        for i in range(n):
            ch.put(i, key=key)
        return n

    @group_method
    def put_then_wait(self, ch: Channel, release: str, timeout: float = 120.0):
        """Put one item, then no other channel operation until the file ``release`` exists
        (a channel get would flush the gathered put itself). False: never released."""
        ch.put("early")
        deadline = time.monotonic() + timeout
        while not os.path.exists(release):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    @group_method
    def put_bounded(self, ch: Channel, n: int):
        for i in range(n):
            ch.put(i, timeout=60)
        return n

    @group_method
    def put_tensor(self, ch: Channel, numel: int):
        import torch

        t = torch.arange(numel, dtype=torch.float32)
        ch.put(t)
        t.zero_()  # after the put: the channel holds its own copy
        return True


class Consumer(Worker):
    @group_method
    def take(self, ch: Channel, n: int):
        return [ch.get(timeout=60) for _ in range(n)]

    @group_method
    def stream_all(self, ch: Channel):
        return [item for batch in ch.stream(timeout=60) for item in batch]


class Locker(Worker):
    @group_method
    def work(self, seconds: float, log):
        ray.get(log.add.remote(f"{self.worker_key} start"))
        time.sleep(seconds)
        ray.get(log.add.remote(f"{self.worker_key} end"))
        return self.worker_key


@pytest.fixture(scope="module")
def workers(cluster):
    prod = Producer.launch(cluster, placement=[0], name="sp_prod")
    cons = Consumer.launch(cluster, placement=[1], name="sp_cons")
    return prod, cons


# -- puts without a reply per put ------------------------------------------------------------


def test_put_returns_at_once_and_own_get_sees_it(cluster):
    ch = Channel.create("sp-own")
    for i in range(50):
        assert ch.put(i) is None  # nothing to wait for on an unbounded channel
    assert ch.get(timeout=10) == 0  # carried by the get, queued before it
    assert ch.qsize() == 49  # the read-ahead items went back first
    assert [ch.get(timeout=10) for _ in range(49)] == list(range(1, 50))
    ch.close()


def test_producer_call_returns_with_its_puts_applied_and_stream_ends_after_them(workers):
    prod, cons = workers
    ch = Channel.create("sp-step")
    got = cons.stream_all(ch)
    assert prod.put_range(ch, 200).wait(timeout=60) == [200]
    assert got.wait(timeout=60) == [list(range(200))]  # all of them, in order, then the end
    ch.close()


def test_gathered_put_goes_out_while_the_producer_computes(workers, tmp_path):
    """The put arrives while the producer's call still runs: the call cannot end before the
    test releases it, after the get (a put held until the call's end times the get out)."""
    prod, _ = workers
    ch = Channel.create("sp-linger")
    release = tmp_path / "release"
    call = prod.put_then_wait(ch, str(release))
    try:
        assert ch.get(timeout=60) == "early"
        assert not call.done()
    finally:
        release.write_text("go")
    assert call.wait(timeout=60) == [True]
    ch.close()


def test_put_error_surfaces_at_the_next_operation(cluster):
    ch = Channel.create("sp-error")
    ch.close()  # the handle now points at a dead actor
    ch.put("lost")  # returns: no reply awaited
    with pytest.raises(ray.exceptions.RayActorError):
        ch.qsize()  # the next blocking operation carries it and fails


def test_put_error_fails_the_producers_call(workers):
    prod, _ = workers
    ch = Channel.create("sp-error-call")
    ch.close()
    with pytest.raises(WorkerError):
        prod.put_range(ch, 3).wait(timeout=60)  # its end waits for the puts: they failed


# -- read-ahead -------------------------------------------------------------------------------


def test_read_ahead_goes_back_for_other_operations(cluster):
    ch = Channel.create("sp-ahead")
    for i in range(6):
        ch.put(i)
    assert ch.get(timeout=10) == 0  # took 1..5 ahead
    assert ch.get_batch(2, timeout=10) == [1, 2]  # handed back first, in order
    assert ch.qsize() == 3
    w = ch.get(async_op=True)  # an async get takes exactly one item
    assert w.wait() == 3 and ch.qsize() == 2
    ch.close()


def test_drivers_read_ahead_goes_back_when_it_hands_the_channel_to_a_call(workers):
    _, cons = workers
    ch = Channel.create("sp-handoff")
    for i in range(5):
        ch.put(i)
    assert ch.get(timeout=10) == 0  # the driver read 1..4 ahead
    assert cons.take(ch, 4).wait(timeout=60) == [[1, 2, 3, 4]]
    ch.close()


def test_workers_read_ahead_goes_back_at_the_end_of_its_call(workers):
    _, cons = workers
    ch = Channel.create("sp-worker-ahead")
    for i in range(5):
        ch.put(i)
    assert cons.take(ch, 1).wait(timeout=60) == [[0]]
    assert ch.qsize() == 4
    assert [ch.get(timeout=10) for _ in range(4)] == [1, 2, 3, 4]
    ch.close()


def test_no_read_ahead_on_a_bounded_channel(cluster):
    ch = Channel.create("sp-bounded-ahead", maxsize=3)
    for i in range(3):
        ch.put(i)
    assert ch.get(timeout=10) == 0
    assert ch.qsize() == 2  # the bound still counts them: nothing was taken ahead
    ch.close()


def test_bounded_channel_still_blocks_its_producer(workers):
    prod, _ = workers
    ch = Channel.create("sp-bounded", maxsize=1)
    call = prod.put_bounded(ch, 3)
    wait_until(lambda: ch.qsize() == 1, what="the first item")
    time.sleep(1.0)
    assert not call.done()  # full: the second put waits for room
    assert [ch.get(timeout=30) for _ in range(3)] == [0, 1, 2]
    assert call.wait(timeout=60) == [3]
    ch.close()


# -- tensors ----------------------------------------------------------------------------------


def test_tensor_frames_keep_what_torch_pickling_keeps(cluster):
    import torch

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    items = {
        "transposed": base.t(),  # strides kept
        "bf16": base.to(torch.bfloat16),
        "bool": base > 5,
        "empty": torch.empty(0, 3),
        "grad": torch.ones(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    out = unpack(ray.get(ray.put(pack(items))))
    for name, t in items.items():
        o = out[name]
        assert type(o) is type(t) and o.dtype == t.dtype and o.shape == t.shape, name
        assert o.stride() == t.stride() and o.requires_grad == t.requires_grad, name
        assert torch.equal(o.detach(), t.detach()), name


def test_tensor_arrives_intact_private_and_writable(workers):
    import torch

    prod, _ = workers
    a, b = Channel.create("sp-t-a"), Channel.create("sp-t-b")
    assert prod.put_tensor(a, 1 << 20).wait(timeout=60) == [True]
    got = a.get(timeout=30)
    assert torch.equal(got, torch.arange(1 << 20, dtype=torch.float32))  # the put's copy
    t = torch.ones(1000)
    Channel.fanout(a, b).put(t)
    x, y = a.get(timeout=30), b.get(timeout=30)
    x.add_(1)  # in place: this reader's own copy
    assert torch.equal(y, torch.ones(1000)) and torch.equal(t, torch.ones(1000))
    a.close()
    b.close()


# -- device reservations ----------------------------------------------------------------------


def test_reservation_is_taken_back_and_exclusion_holds(cluster):
    svc = cluster.lock_service
    x = Locker.launch(cluster, placement=[1], name="sp_x")
    y = Locker.launch(cluster, placement=[1], name="sp_y")
    log = EventLog.remote()
    try:
        x.work(0, log).wait(timeout=60)
        # the release is sent without waiting for its reply: the lock service gets it shortly
        state = wait_until(
            lambda: (s := ray.get(svc.state.remote()))["reserved"].get(1) == "sp_x:0" and s,
            what="x's release to leave device 1 reserved for it",
        )
        assert 1 not in state["holder"]
        # x takes its reservation back without asking; y's request revokes it and waits
        calls = [x.work(0.5, log), y.work(0.1, log), x.work(0.1, log), y.work(0.1, log)]
        assert [c.wait(timeout=60)[0] for c in calls] == ["sp_x:0", "sp_y:0", "sp_x:0", "sp_y:0"]
        events = ray.get(log.read.remote())[2:]
        for i in range(0, len(events), 2):  # never two holders at once
            key = events[i].removesuffix(" start")
            assert events[i + 1] == f"{key} end", events
    finally:
        x.shutdown()
        y.shutdown()
    assert 1 not in ray.get(svc.state.remote())["reserved"]  # forgotten with the group
