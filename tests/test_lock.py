"""Device locks on a real (embedded) Ray session: exclusion, context switches, collocated
producer/consumer without deadlock, data-dependency priority, and concurrency across devices."""

from __future__ import annotations

import time

import pytest
import ray

from m2flow import Channel, Worker, WorkerError, no_device_lock


class Recorder(Worker):
    def __init__(self) -> None:
        self.events: list[str] = []

    def work(self, seconds: float):
        start = time.time()
        loaded = not self.is_offloaded
        time.sleep(seconds)
        return {"key": self.worker_key, "start": start, "end": time.time(), "loaded": loaded}

    def onload(self) -> None:
        self.events.append("onload")

    def offload(self) -> None:
        self.events.append("offload")

    @no_device_lock
    def events_so_far(self):
        return list(self.events)


class FailingInit(Worker):
    def __init__(self) -> None:
        raise RuntimeError("init-failed-here")


class Prod(Worker):
    def produce(self, ch: Channel, n: int):
        for i in range(n):
            ch.put(i)
        return n


class Cons(Worker):
    def consume(self, ch: Channel, n: int):
        return [ch.get(timeout=60) for _ in range(n)]


class Stage(Worker):
    """A pipeline stage that records when it held the device."""

    def produce(self, ch: Channel, n: int):
        start = time.time()
        for i in range(n):
            ch.put(i)
        return {"start": start, "end": time.time()}

    def consume(self, ch: Channel, n: int):
        start = time.time()
        items = [ch.get(timeout=60) for _ in range(n)]
        return {"start": start, "end": time.time(), "items": items}

    def hold(self, seconds: float):
        time.sleep(seconds)


@pytest.fixture(scope="module")
def svc(cluster):
    return cluster.lock_service


def _assert_disjoint(intervals):
    intervals = sorted(intervals, key=lambda r: r["start"])
    for a, b in zip(intervals, intervals[1:]):
        assert a["end"] <= b["start"] + 1e-3, f"{a['key']} and {b['key']} overlapped: {a} {b}"


def test_same_device_calls_are_mutually_exclusive(cluster, svc):
    a = Recorder.launch(cluster, placement=[0], name="mx_a")
    b = Recorder.launch(cluster, placement=[0], name="mx_b")
    # a two-device rank overlapping device 0 must exclude them too
    ab = Recorder.launch(cluster, placement=[[0, 1]], name="mx_ab")
    calls = []
    for _ in range(3):
        calls += [a.work(0.2), b.work(0.2), ab.work(0.1)]
    runs = [c.wait(timeout=60)[0] for c in calls]
    assert {r["key"] for r in runs} == {"mx_a:0", "mx_b:0", "mx_ab:0"}
    assert all(r["loaded"] for r in runs)  # onloaded before the method ran
    _assert_disjoint(runs)
    span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    assert span >= 3 * (0.2 + 0.2 + 0.1) - 0.05


def test_onload_offload_only_on_holder_change(cluster, svc):
    x = Recorder.launch(cluster, placement=[1], name="sw_x")
    y = Recorder.launch(cluster, placement=[1], name="sw_y")

    keys = ("loaded", "onloads", "offloads")

    def stats():
        return tuple({k: g.load_stats()[0][k] for k in keys} for g in (x, y))

    sx, sy = stats()
    assert sx == {"loaded": True, "onloads": 0, "offloads": 0} == sy  # both start resident

    x.work(0).wait(timeout=60)  # x takes device 1: y leaves
    sx, sy = stats()
    assert (sx["onloads"], sx["offloads"], sx["loaded"]) == (0, 0, True)
    assert (sy["onloads"], sy["offloads"], sy["loaded"]) == (0, 1, False)

    x.work(0).wait(timeout=60)  # same holder again: nothing moves
    assert stats() == (sx, sy)

    assert y.events_so_far().wait(timeout=60) == [["offload"]]  # no_device_lock: no switch
    assert stats() == (sx, sy)

    r = y.work(0).wait(timeout=60)[0]  # y comes back: x leaves, y onloads
    assert r["loaded"]
    sx, sy = stats()
    assert (sx["onloads"], sx["offloads"], sx["loaded"]) == (0, 1, False)
    assert (sy["onloads"], sy["offloads"], sy["loaded"]) == (1, 1, True)

    y.work(0).wait(timeout=60)
    y.work(0).wait(timeout=60)
    assert stats() == (sx, sy)

    x.work(0).wait(timeout=60)
    sx, sy = stats()
    assert (sx["onloads"], sx["offloads"], sx["loaded"]) == (1, 1, True)
    assert (sy["onloads"], sy["offloads"], sy["loaded"]) == (1, 2, False)
    assert x.events_so_far().wait(timeout=60) == [["offload", "onload"]]
    assert y.events_so_far().wait(timeout=60) == [["offload", "onload", "offload"]]

    state = ray.get(svc.state.remote(), timeout=60)
    assert state["resident"][1] == ["sw_x:0"] and 1 not in state["holder"]


def test_keep_resident_devices_switch_without_offload(cluster, svc):
    """offload="never"/"auto" on virtual devices: a switch still serialises the workers but
    evicts no one (both stay resident, no offload/onload runs)."""
    from m2flow import Cluster

    x = Recorder.launch(cluster, placement=[1], name="kr_x")
    y = Recorder.launch(cluster, placement=[1], name="kr_y")
    try:
        # A second Cluster on the same Ray session reconfigures the run's lock service.
        Cluster(virtual_devices_per_node=2, offload="auto")  # virtual devices: keep resident
        runs = [g.work(0.1).wait(timeout=60)[0] for g in (x, y, x, y)]
        _assert_disjoint(runs)  # still mutually exclusive
        stats = [g.load_stats()[0] for g in (x, y)]
        assert all(s["offloads"] == 0 and s["onloads"] == 0 and s["loaded"] for s in stats)
        state = ray.get(svc.state.remote(), timeout=60)
        assert {"kr_x:0", "kr_y:0"} <= set(state["resident"][1])
        with pytest.raises(ValueError, match="offload='sometimes'"):
            Cluster(offload="sometimes")
    finally:
        Cluster(virtual_devices_per_node=2, offload="always")  # the module's setting again
        x.shutdown()
        y.shutdown()
    # Switching offloads again: the next holder evicts the other.
    a = Recorder.launch(cluster, placement=[1], name="kr_a")
    b = Recorder.launch(cluster, placement=[1], name="kr_b")
    a.work(0).wait(timeout=60)
    b.work(0).wait(timeout=60)
    assert a.load_stats()[0]["offloads"] == 1
    a.shutdown()
    b.shutdown()


def test_collocated_consumer_first_no_deadlock(cluster, svc):
    prod = Prod.launch(cluster, placement=[0], name="pc_prod")
    cons = Cons.launch(cluster, placement=[0], name="pc_cons")
    ch = Channel.create("pc")
    got = cons.consume(ch, 10)  # takes device 0 first and blocks in get
    time.sleep(1.0)
    state = ray.get(svc.state.remote(), timeout=60)
    assert state["holder"].get(0) is None  # the blocked consumer yielded the device
    put = prod.produce(ch, 10)
    assert put.wait(timeout=60) == [10]
    assert got.wait(timeout=60) == [list(range(10))]
    log = [k for k, _ in ray.get(svc.state.remote(), timeout=60)["grant_log"]]
    first_cons = log.index("pc_cons:0")
    assert "pc_prod:0" in log[first_cons + 1 :]  # the producer ran while the consumer waited
    ch.close()


def test_priority_producer_before_consumer(cluster, svc):
    # launch order (the default priority) and arrival order both favour the consumer:
    # only the data-dependency priority puts the producer first.
    cons = Recorder.launch(cluster, placement=[0], name="pr_consumer")
    prod = Recorder.launch(cluster, placement=[0], name="pr_producer")
    hold = Recorder.launch(cluster, placement=[0], name="pr_holder")
    ray.get(svc.set_priorities.remote({"pr_producer": 0, "pr_consumer": 1}), timeout=60)

    h = hold.work(2.5)
    time.sleep(0.7)
    c = cons.work(0.1)
    time.sleep(0.5)
    p = prod.work(0.1)
    time.sleep(0.5)
    state = ray.get(svc.state.remote(), timeout=60)
    assert state["holder"].get(0) == "pr_holder:0"
    assert set(state["waiting"]) >= {"pr_consumer:0", "pr_producer:0"}  # both wait

    rh, rc, rp = (x.wait(timeout=60)[0] for x in (h, c, p))
    assert rp["start"] < rc["start"], "the consumer got the device before its producer"
    assert rh["end"] <= rp["start"] + 1e-3
    log = [k for k, _ in ray.get(svc.state.remote(), timeout=60)["grant_log"]]
    i = log.index("pr_holder:0")
    assert log[i + 1 : i + 3] == ["pr_producer:0", "pr_consumer:0"]


def test_priority_learned_from_channel_traffic(cluster, svc):
    """No explicit priorities: the channel's producer -> consumer edge alone orders the grants,
    although the consumer launched first and asks for the device first."""
    cons = Stage.launch(cluster, placement=[0], name="dep_consumer")
    prod = Stage.launch(cluster, placement=[0], name="dep_producer")
    hold = Stage.launch(cluster, placement=[0], name="dep_holder")
    ch = Channel.create("dep")
    got = cons.consume(ch, 2)
    prod.produce(ch, 2).wait(timeout=60)
    got.wait(timeout=60)  # the edge dep_producer -> dep_consumer is now traced

    h = hold.hold(2.0)
    time.sleep(0.5)
    c = cons.consume(ch, 3)  # waits for the device first
    time.sleep(0.5)
    p = prod.produce(ch, 3)
    time.sleep(0.3)
    assert set(ray.get(svc.state.remote(), timeout=60)["waiting"]) >= {
        "dep_consumer:0",
        "dep_producer:0",
    }
    h.wait(timeout=60)
    p.wait(timeout=60)
    rc = c.wait(timeout=60)[0]
    assert rc["items"] == [0, 1, 2]
    log = [k for k, _ in ray.get(svc.state.remote(), timeout=60)["grant_log"]]
    after_hold = log[len(log) - 1 - log[::-1].index("dep_holder:0") + 1 :]
    assert after_hold[:2] == ["dep_producer:0", "dep_consumer:0"], after_hold
    ch.close()


def test_different_devices_run_concurrently(cluster, svc):
    g0 = Recorder.launch(cluster, placement=[0], name="cc_0")
    g1 = Recorder.launch(cluster, placement=[1], name="cc_1")
    c0, c1 = g0.work(1.0), g1.work(1.0)
    r0, r1 = c0.wait(timeout=60)[0], c1.wait(timeout=60)[0]
    overlap = min(r0["end"], r1["end"]) - max(r0["start"], r1["start"])
    assert overlap > 0.5, f"calls on devices 0 and 1 overlapped only {overlap:.2f} s"
    # one group over both devices: its ranks run concurrently too
    both = Recorder.launch(cluster, placement=[0, 1], name="cc_both")
    ra, rb = both.work(1.0).wait(timeout=60)
    assert min(ra["end"], rb["end"]) - max(ra["start"], rb["start"]) > 0.5


def test_device_usable_after_group_shutdown(cluster, svc):
    dead = Recorder.launch(cluster, placement=[1], name="gone")
    dead.work(0).wait(timeout=60)
    dead.shutdown()
    state = ray.get(svc.state.remote(), timeout=60)
    assert "gone:0" not in state["resident"].get(1, [])  # unregistered from the lock service
    after = Recorder.launch(cluster, placement=[1], name="after_gone")
    assert after.work(0).wait(timeout=60)[0]["loaded"]
    again = Recorder.launch(cluster, placement=[1], name="gone")  # the name is free again
    assert again.work(0).wait(timeout=60)[0]["key"] == "gone:0"


def test_device_usable_after_worker_killed_or_failed_init(cluster, svc):
    # a worker that dies without group.shutdown() (crash) stays registered: the next holder
    # must cope with a dead resident
    crashed = Recorder.launch(cluster, placement=[0], name="crashed")
    crashed.work(0).wait(timeout=60)
    ray.kill(crashed.actors[0], no_restart=True)
    time.sleep(0.5)
    after = Recorder.launch(cluster, placement=[0], name="after_crash")
    assert after.work(0).wait(timeout=60)[0]["loaded"]
    # a rank whose __init__ fails registers with the lock service before it dies
    with pytest.raises(WorkerError, match="init-failed-here"):
        FailingInit.launch(cluster, placement=[0], name="failing_init")
    assert after.work(0).wait(timeout=60)[0]["loaded"]
    other = Recorder.launch(cluster, placement=[0], name="after_failed_init")
    assert other.work(0).wait(timeout=60)[0]["loaded"]


def test_dead_holder_frees_its_device(cluster, svc):
    hog = Recorder.launch(cluster, placement=[1], name="hog")
    stuck = hog.work(120)  # holds device 1 for two minutes
    time.sleep(1.0)
    assert ray.get(svc.state.remote(), timeout=60)["holder"].get(1) == "hog:0"
    ray.kill(hog.actors[0], no_restart=True)  # dies while holding the lock (no unregister)
    nxt = Recorder.launch(cluster, placement=[1], name="after_hog")
    t0 = time.monotonic()
    assert nxt.work(0).wait(timeout=60)[0]["loaded"]
    assert time.monotonic() - t0 < 30  # freed by the waiter's liveness ping (every ~5 s)
    with pytest.raises(WorkerError):
        stuck.wait(timeout=30)
