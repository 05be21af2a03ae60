"""WorkerGroup on a real (embedded) Ray session: dispatch, timings, errors, send/recv, placement."""

from __future__ import annotations

import os
import time

import pytest
import ray
from helpers import wait_until

import m2flow
from m2flow import Worker, WorkerError, group_method

pytestmark = pytest.mark.e2e


class Echo(Worker):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag

    @group_method
    def info(self):
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "group": self.group_name,
            "devices": self.device_ids,
            "tag": self.tag,
            "pid": os.getpid(),
        }

    @group_method
    def nap(self, base: float, per_rank: float = 0.0):
        time.sleep(base + per_rank * self.rank)
        return self.rank

    @group_method
    def timed(self, seconds: float):
        with self.timer("phase_a"):
            time.sleep(seconds)
        with self.timer("phase_a"):
            time.sleep(seconds)
        return self.rank

    @group_method
    def fail_on(self, bad_rank: int, others_sleep: float):
        if self.rank == bad_rank:
            raise ValueError(f"boom-from-rank-{self.rank}")
        time.sleep(others_sleep)
        return self.rank

    @group_method(collect="rank0")
    def leader(self):
        return {"rank": self.rank}

    @group_method(collect="sum")
    def count(self, per_rank: int):
        return per_rank * (self.rank + 1)

    def helper(self):  # public, not declared: the rank's own, not a group method
        return self.rank


class Waiter(Worker):
    @group_method
    def take(self, ch, signal: str):
        """One item; puts a marker under the key ``signal`` once the get is registered (the
        channel applies one client's operations in program order)."""
        got = ch.get(timeout=60, async_op=True)
        ch.put(self.worker_key, key=signal)
        return got.wait()


class BadInit(Worker):
    def __init__(self) -> None:
        raise RuntimeError("constructor-exploded-xyz")


class SlowInit(Worker):
    def __init__(self) -> None:
        time.sleep(60)


class Sender(Worker):
    @group_method
    def send_seq(self, dst: str, n: int, async_op: bool = False):
        items = [(self.rank, i) for i in range(n)]
        if async_op:
            works = [self.send(x, dst, 0, async_op=True) for x in items]
            for w in works:
                w.wait()
        else:
            for x in items:
                self.send(x, dst, 0)
        return n

    @group_method
    def send_tensors(self, dst: str, seed: int):
        import torch

        g = torch.Generator().manual_seed(seed)
        payload = {"x": torch.randn(256, 1024, generator=g), "ids": torch.arange(1000)}
        self.send(payload, dst, 0)
        return float(payload["x"].sum())


class Broadcaster(Worker):
    @group_method
    def broadcast_tensor(self, dst: str, world: int, seed: int):
        import torch

        t = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))
        self.broadcast({"w": t, "version": seed}, dst, world)
        return float(t.sum())


class Receiver(Worker):
    @group_method
    def recv_seq(self, src: str, src_ranks: list[int], n: int, async_op: bool = False):
        out = {}
        for r in src_ranks:
            if async_op:
                works = [self.recv(src, r, async_op=True, timeout=60) for _ in range(n)]
                out[r] = [w.wait() for w in works]
            else:
                out[r] = [self.recv(src, r, timeout=60) for _ in range(n)]
        return out

    @group_method
    def recv_one(self, src: str, timeout: float = 60):
        return self.recv(src, 0, timeout=timeout)


@pytest.fixture(scope="module")
def echo(cluster):
    return Echo.launch(cluster, placement=[0, 1], name="echo", tag="t1")


def test_dispatch_all_ranks(echo):
    infos = echo.info().wait(timeout=60)
    assert [i["rank"] for i in infos] == [0, 1]
    assert all(i["world_size"] == 2 for i in infos)
    assert all(i["group"] == "echo" and i["tag"] == "t1" for i in infos)
    assert [i["devices"] for i in infos] == [[0], [1]]
    assert infos[0]["pid"] != infos[1]["pid"]  # one process per rank
    assert echo.world_size == 2 and echo.device_ids == [0, 1]


def test_dispatch_subset(echo):
    infos = echo.on([1]).info().wait(timeout=60)
    assert len(infos) == 1 and infos[0]["rank"] == 1 and infos[0]["world_size"] == 2
    assert [i["rank"] for i in echo.on(0).info().wait(timeout=60)] == [0]
    with pytest.raises(ValueError, match="ranks 0..1"):
        echo.on([2])


def test_unknown_method_is_attribute_error(echo):
    with pytest.raises(AttributeError, match="no_such_method"):
        echo.no_such_method()


def test_results_collected_as_declared(echo):
    assert echo.leader().wait(timeout=60) == {"rank": 0}  # rank0
    assert echo.on(1).leader().wait(timeout=60) == {"rank": 1}  # the first called rank
    assert echo.count(5).wait(timeout=60) == 5 + 10  # sum over ranks
    call = echo.leader()
    assert [r["rank"] for r in call.wait_result(timeout=60).results] == [0, 1]  # every rank's
    assert Echo.group_methods()["leader"] == ("rank0", True)
    assert Echo.group_methods()["pop_timings"] == ("all", False)  # the base class's


def test_undeclared_public_method_is_refused(echo):
    assert "helper" not in Echo.group_methods()
    for dispatch in (lambda: echo.helper, lambda: echo.call("helper")):
        with pytest.raises(AttributeError, match=r"Echo.helper is not a group method: declare "
                           r"it with @m2flow.group_method\(collect="):  # fmt: skip
            dispatch()
    with pytest.raises(AttributeError, match="no group method '_m2flow_send_weights'"):
        echo.call("_m2flow_send_weights", "x", 1, "object_store")
    with pytest.raises(ValueError, match="'info' is not a runtime call"):
        echo.runtime_call("info")


def test_group_method_refuses_an_unknown_collection():
    with pytest.raises(ValueError, match="collect='first'.*all, rank0, sum"):
        group_method(collect="first")


def test_durations_reduced(echo):
    res = echo.nap(0.3, per_rank=0.3).wait_result(timeout=60)
    assert res.results == [0, 1]
    d = res.durations
    assert len(d) == 2
    assert d[0] >= 0.3 and d[1] >= 0.6
    assert res.time("max") >= res.time("mean") >= res.time("min")
    assert res.time("max") == pytest.approx(max(d)) and res.time("min") == pytest.approx(min(d))
    assert res.time("mean") == pytest.approx(sum(d) / 2)
    assert res.time("max") - res.time("min") >= 0.2
    call = echo.nap(0.2)
    assert call.time() >= 0.2  # GroupCall.time waits, then reduces (default max)


def test_named_timers_and_method_timings(echo):
    echo.pop_timings().wait(timeout=60)  # start clean
    echo.timed(0.1).wait(timeout=60)
    per_rank = echo.pop_timings().wait(timeout=60)
    for timings in per_rank:
        assert timings["phase_a"] >= 0.2  # both blocks summed
        assert timings["timed"] >= timings["phase_a"]  # every group call is timed too
    assert echo.pop_timings().wait(timeout=60)[0].get("phase_a") is None  # reset


def test_busy_time_excludes_waiting_for_data(cluster):
    from m2flow import Channel

    waiter = Waiter.launch(cluster, [0], name="busy_waiter")
    ch = Channel.create("busy")
    call = waiter.take(ch, "waiting")
    wait_until(lambda: ch.qsize("waiting") == 1, what="the waiter blocked in get")
    time.sleep(1.0)  # the wait being measured: the call waits this long for data
    ch.put(1)
    res = call.wait_result(timeout=60)
    assert res.results == [1]
    assert res.durations[0] >= 1.0 and res.time(busy=True) < 0.3
    ch.close()
    waiter.shutdown()


def test_failing_rank_raises_promptly(cluster):
    # lock=False: the long call left behind on rank 0 must not hold a device lock for the
    # tests after this one; the group is killed at the end.
    g = Echo.launch(cluster, placement=[0, 1], name="failing", lock=False)
    try:
        call = g.fail_on(1, 60.0)  # rank 0 sleeps 60 s, rank 1 raises at once
        with pytest.raises(WorkerError) as ei:
            call.wait(timeout=90)
        err = ei.value
        assert (err.group, err.rank, err.method) == ("failing", 1, "fail_on")
        msg = str(err)
        assert "'failing'" in msg and "rank 1" in msg and "fail_on" in msg
        assert "boom-from-rank-1" in msg and "ValueError" in msg
        assert not call.done()  # rank 0 is still in its long call: the driver did not wait
    finally:
        g.shutdown()


def test_shut_down_group_does_not_fail_later_waits(cluster, echo):
    """A failure reported once (and its group shut down) does not fail later unrelated
    waits: a failed call leaves the run's in-flight calls when its wait raises."""
    g = Echo.launch(cluster, placement=[0, 1], name="failing_shut", lock=False)
    call = g.fail_on(1, 60.0)
    try:
        with pytest.raises(WorkerError, match="boom-from-rank-1"):
            call.wait(timeout=90)
        g.shutdown()  # the failure was handled and the group is gone
        assert echo.nap(1.5).wait(timeout=60) == [0, 1]  # an unrelated call, over 1 s
    finally:
        g.shutdown()


def test_constructor_failure_raises_at_launch(cluster, echo):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as ei:
        BadInit.launch(cluster, placement=[0, 1], name="badinit")
    assert time.monotonic() - t0 < 30
    err = ei.value
    assert err.group == "badinit" and err.rank in (0, 1) and err.method == "__init__"
    assert "constructor-exploded-xyz" in str(err) and "RuntimeError" in str(err)
    # nothing of the failed group is left running, and its devices still work
    for name in ("badinit:0", "badinit:1"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="m2flow")
    # launch() shut the group down at the first failed rank; a rank still starting then is
    # refused when it registers, so no death of the failed launch is left to fail later waits
    deaths = ray.get(cluster.lock_service.deaths.remote(), timeout=60)
    assert [d for d, retired in deaths if retired is None] == []
    assert [i["rank"] for i in echo.info().wait(timeout=60)] == [0, 1]


def test_slow_constructor_is_a_timeout_not_a_death(cluster, monkeypatch):
    """A rank alive but still in ``__init__`` at the wait limit is reported as slow, with the
    setting that waits longer, not as a death ("Get timed out" read as one)."""
    monkeypatch.setenv("M2FLOW_WAIT_TIMEOUT", "3")
    with pytest.raises(WorkerError) as ei:
        SlowInit.launch(cluster, placement=[1], name="slowinit")
    err = ei.value
    assert not err.died and err.method == "__init__"
    assert "did not finish within 3 s" in str(err) and "M2FLOW_WAIT_TIMEOUT" in str(err)
    with pytest.raises(ValueError):  # shut down, not left sleeping
        ray.get_actor("slowinit:0", namespace="m2flow")


def test_relaunch_after_shutdown(cluster):
    g = Echo.launch(cluster, placement=[1], name="reborn", tag="first")
    assert g.info().wait(timeout=60)[0]["tag"] == "first"
    g.shutdown()
    g2 = Echo.launch(cluster, placement=[1], name="reborn", tag="second")
    assert g2.info().wait(timeout=60)[0]["tag"] == "second"
    g2.shutdown()


def test_invalid_placement(cluster):
    with pytest.raises(ValueError) as ei:
        Echo.launch(cluster, placement=[0, 7], name="badplace")
    msg = str(ei.value)
    assert "7" in msg and "out of range" in msg and "2 devices" in msg
    with pytest.raises(ValueError, match="empty"):
        Echo.launch(cluster, placement=[], name="emptyplace")
    with pytest.raises(ValueError, match="out of range"):
        Echo.launch(cluster, placement=[-1], name="negplace")
    # nothing was started under those names
    for name in ("badplace:0", "badplace:1", "emptyplace:0", "negplace:0"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="m2flow")


def test_not_a_worker_class(cluster):
    with pytest.raises(TypeError):
        m2flow.core.group.launch(dict, cluster, [0])


def test_duplicate_group_name(cluster, echo):
    with pytest.raises(ValueError, match="already running"):
        Echo.launch(cluster, placement=[1], name="echo")
    # the original group is untouched
    assert [i["tag"] for i in echo.info().wait(timeout=60)] == ["t1", "t1"]


@pytest.fixture(scope="module")
def p2p(cluster):
    snd = Sender.launch(cluster, placement=[0, 1], name="snd")
    rcv = Receiver.launch(cluster, placement=[1], name="rcv")
    return snd, rcv


@pytest.mark.parametrize("recv_async", [False, True], ids=["recv-sync", "recv-async"])
def test_send_recv_fifo_per_sender(p2p, recv_async):
    snd, rcv = p2p
    n = 20
    # the receiver is dispatched first and blocks in recv (yielding its device to rank 1 of snd)
    r_call = rcv.recv_seq("snd", [0, 1], n, async_op=recv_async)
    s_call = snd.send_seq("rcv", n)
    assert s_call.wait(timeout=90) == [n, n]
    got = r_call.wait(timeout=90)[0]
    assert got[0] == [(0, i) for i in range(n)]
    assert got[1] == [(1, i) for i in range(n)]


def test_async_send_delivers_everything(p2p):
    snd, rcv = p2p
    n = 50
    assert snd.send_seq("rcv", n, async_op=True).wait(timeout=90) == [n, n]
    got = rcv.recv_seq("snd", [0, 1], n).wait(timeout=90)[0]
    for r in (0, 1):
        assert sorted(got[r]) == [(r, i) for i in range(n)]


def test_async_send_fifo_per_sender(p2p):
    snd, rcv = p2p
    n = 100
    assert snd.send_seq("rcv", n, async_op=True).wait(timeout=90) == [n, n]
    got = rcv.recv_seq("snd", [0, 1], n).wait(timeout=90)[0]
    assert got[0] == [(0, i) for i in range(n)]
    assert got[1] == [(1, i) for i in range(n)]


def test_send_recv_tensors_intact(p2p):
    import torch

    snd, rcv = p2p
    sums = snd.on(0).send_tensors("rcv", 7).wait(timeout=60)
    payload = rcv.recv_one("snd").wait(timeout=60)[0]
    g = torch.Generator().manual_seed(7)
    expected = torch.randn(256, 1024, generator=g)
    assert torch.equal(payload["x"], expected)
    assert torch.equal(payload["ids"], torch.arange(1000))
    assert float(payload["x"].sum()) == pytest.approx(sums[0])


def test_recv_timeout(p2p):
    _, rcv = p2p
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as ei:
        rcv.recv_one("snd", timeout=0.5).wait(timeout=60)
    assert time.monotonic() - t0 < 10
    assert "TimeoutError" in str(ei.value) and "snd:0" in str(ei.value)


def test_send_to_unknown_group(p2p):
    snd, _ = p2p
    with pytest.raises(WorkerError) as ei:
        snd.on(0).send_seq("nobody", 1).wait(timeout=60)
    assert "nobody:0" in str(ei.value)


def test_broadcast_reaches_every_rank_in_order(cluster):
    """``broadcast`` (one object-store copy) delivers the object to each rank of the group,
    FIFO with the sender's other sends."""
    src = Broadcaster.launch(cluster, placement=[0], name="bcast")
    dst = Receiver.launch(cluster, placement=[0, 1], name="bcast_rcv")
    try:
        sums = [src.broadcast_tensor("bcast_rcv", 2, seed).wait(timeout=60)[0] for seed in (3, 4)]
        got = dst.recv_seq("bcast", [0], 2).wait(timeout=60)  # per rank: {0: [first, second]}
        for rank_got in got:
            assert [g["version"] for g in rank_got[0]] == [3, 4]
            assert [float(g["w"].sum()) for g in rank_got[0]] == pytest.approx(sums)
        with pytest.raises(WorkerError, match="no worker 'nobody:0'"):
            src.broadcast_tensor("nobody", 1, 0).wait(timeout=60)
    finally:
        src.shutdown()
        dst.shutdown()
