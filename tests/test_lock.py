"""Device locks on a real (embedded) Ray session: exclusion, context switches, collocated
producer/consumer without deadlock, data-dependency priority, concurrency across devices, and
worker deaths (fail-fast waits, devices freed).

Orders are observed by the workers themselves: they append to an :class:`~helpers.EventLog`
while they hold their device, and tests hold a worker in its call with a
:class:`~helpers.Gate` and wait for observable lock-service states (``wait_until``), never
for a sleep.
"""

from __future__ import annotations

import time

import pytest
import ray
from helpers import EventLog, Gate, events, log_event, pass_gate, wait_until

from m2flow import Channel, Worker, WorkerDied, WorkerError, group_method, no_device_lock

pytestmark = pytest.mark.e2e


class Recorder(Worker):
    def __init__(self) -> None:
        self.events: list[str] = []

    @group_method
    def work(self, seconds: float, log=None):
        log_event(log, f"{self.worker_key} start")
        start = time.time()
        loaded = not self.is_offloaded
        time.sleep(seconds)  # the work
        end = time.time()
        log_event(log, f"{self.worker_key} end")
        return {"key": self.worker_key, "start": start, "end": end, "loaded": loaded}

    @group_method
    def hold(self, gate, log=None):
        """Hold the device until the test opens ``gate``."""
        log_event(log, f"{self.worker_key} start")
        loaded = not self.is_offloaded
        pass_gate(gate)
        log_event(log, f"{self.worker_key} end")
        return {"key": self.worker_key, "loaded": loaded}

    @group_method
    def take(self, ch: Channel, timeout: float, log=None):
        """Wait for an item (a worker-side wait); report a death seen meanwhile, and when."""
        log_event(log, f"{self.worker_key} start")
        try:
            return {"item": ch.get(timeout=timeout)}
        except WorkerDied as e:
            return {"died": e.death.group, "at": time.time()}

    def onload(self) -> None:
        self.events.append("onload")

    def offload(self) -> None:
        self.events.append("offload")

    @group_method
    @no_device_lock
    def events_so_far(self):
        return list(self.events)


class FailingInit(Worker):
    def __init__(self) -> None:
        raise RuntimeError("init-failed-here")


class Stage(Worker):
    """A pipeline stage that logs when it held the device."""

    @group_method
    def produce(self, ch: Channel, n: int, log=None):
        log_event(log, f"{self.worker_key} start")
        for i in range(n):
            ch.put(i)
        log_event(log, f"{self.worker_key} end")
        return n

    @group_method
    def consume(self, ch: Channel, n: int, log=None):
        log_event(log, f"{self.worker_key} start")
        items = [ch.get(timeout=60) for _ in range(n)]
        log_event(log, f"{self.worker_key} end")
        return items

    @group_method
    def hold(self, gate, log=None):
        log_event(log, f"{self.worker_key} start")
        pass_gate(gate)
        log_event(log, f"{self.worker_key} end")


@pytest.fixture(scope="module")
def svc(cluster):
    return cluster.lock_service


def _state(svc) -> dict:
    return ray.get(svc.state.remote(), timeout=60)


def _deaths(svc) -> list:
    """Deaths of the run whose group is not shut down yet (later waits fail on them)."""
    return [d for d, retired in ray.get(svc.deaths.remote(), timeout=60) if retired is None]


def _assert_exclusive(log: list[str]) -> None:
    """Every start is followed by the end of the same worker: no two held at once."""
    assert len(log) % 2 == 0, log
    for i in range(0, len(log), 2):
        key = log[i].removesuffix(" start")
        assert log[i].endswith(" start") and log[i + 1] == f"{key} end", (
            f"{log[i + 1]!r} while {key} held the device: {log}"
        )


def _after(log: list[str], event: str) -> list[str]:
    return log[log.index(event) + 1 :]


def test_same_device_calls_are_mutually_exclusive(cluster, svc):
    a = Recorder.launch(cluster, placement=[0], name="mx_a")
    b = Recorder.launch(cluster, placement=[0], name="mx_b")
    # a two-device rank overlapping device 0 must exclude them too
    ab = Recorder.launch(cluster, placement=[[0, 1]], name="mx_ab")
    log = EventLog.remote()
    calls = []
    for _ in range(3):
        calls += [a.work(0.2, log), b.work(0.2, log), ab.work(0.1, log)]
    runs = [c.wait(timeout=60)[0] for c in calls]
    assert {r["key"] for r in runs} == {"mx_a:0", "mx_b:0", "mx_ab:0"}
    assert all(r["loaded"] for r in runs)  # onloaded before the method ran
    got = events(log)
    assert len(got) == 2 * len(calls)
    _assert_exclusive(got)
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

    state = _state(svc)
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
        log = EventLog.remote()
        calls = [g.work(0.1, log) for g in (x, y, x, y)]  # dispatched together
        for c in calls:
            c.wait(timeout=60)
        _assert_exclusive(events(log))  # still mutually exclusive
        stats = [g.load_stats()[0] for g in (x, y)]
        assert all(s["offloads"] == 0 and s["onloads"] == 0 and s["loaded"] for s in stats)
        state = _state(svc)
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
    prod = Stage.launch(cluster, placement=[0], name="pc_prod")
    cons = Stage.launch(cluster, placement=[0], name="pc_cons")
    ch = Channel.create("pc")
    log = EventLog.remote()
    got = cons.consume(ch, 10, log)  # takes device 0 first and blocks in get
    wait_until(
        lambda: events(log) == ["pc_cons:0 start"] and _state(svc)["holder"].get(0) is None,
        what="the consumer to start, block in get and yield device 0",
    )
    put = prod.produce(ch, 10, log)
    assert put.wait(timeout=60) == [10]
    assert got.wait(timeout=60) == [list(range(10))]
    # the producer held the device inside the consumer's call (while it waited for data)
    assert events(log) == ["pc_cons:0 start", "pc_prod:0 start", "pc_prod:0 end", "pc_cons:0 end"]
    ch.close()


def test_priority_producer_before_consumer(cluster, svc):
    # Launch order (the priority) and arrival order both favour the consumer: only the data
    # dependency, as a channel reports it to the lock service, puts the producer first.
    cons = Recorder.launch(cluster, placement=[0], name="pr_consumer")
    prod = Recorder.launch(cluster, placement=[0], name="pr_producer")
    hold = Recorder.launch(cluster, placement=[0], name="pr_holder")
    ray.get(svc.add_dependency.remote("pr_producer", "pr_consumer"), timeout=60)
    log, gate = EventLog.remote(), Gate.remote()
    try:
        h = hold.hold(gate, log)
        wait_until(lambda: _state(svc)["holder"].get(0) == "pr_holder:0", what="pr_holder")
        c = cons.work(0.1, log)
        wait_until(lambda: _state(svc)["waiting"] == ["pr_consumer:0"], what="consumer waits")
        p = prod.work(0.1, log)
        wait_until(lambda: len(_state(svc)["waiting"]) == 2, what="producer waits")
        state = _state(svc)
        assert state["holder"].get(0) == "pr_holder:0"
        assert state["waiting"] == ["pr_consumer:0", "pr_producer:0"]  # the consumer came first
    finally:
        ray.get(gate.open.remote(), timeout=60)
    rh, rc, rp = (x.wait(timeout=60)[0] for x in (h, c, p))
    assert rh["loaded"] and rc["loaded"] and rp["loaded"]
    assert events(log) == [
        "pr_holder:0 start",
        "pr_holder:0 end",
        "pr_producer:0 start",
        "pr_producer:0 end",
        "pr_consumer:0 start",
        "pr_consumer:0 end",
    ], "the consumer got the device before its producer"


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
    assert ("dep_producer", "dep_consumer", 2) in ch.graph_edges()

    log, gate = EventLog.remote(), Gate.remote()
    try:
        h = hold.hold(gate, log)
        wait_until(lambda: _state(svc)["holder"].get(0) == "dep_holder:0", what="dep_holder")
        c = cons.consume(ch, 3, log)  # waits for the device first
        wait_until(lambda: _state(svc)["waiting"] == ["dep_consumer:0"], what="consumer waits")
        p = prod.produce(ch, 3, log)
        wait_until(lambda: len(_state(svc)["waiting"]) == 2, what="producer waits")
        assert _state(svc)["waiting"] == ["dep_consumer:0", "dep_producer:0"]
    finally:
        ray.get(gate.open.remote(), timeout=60)
    h.wait(timeout=60)
    p.wait(timeout=60)
    assert c.wait(timeout=60)[0] == [0, 1, 2]
    assert _after(events(log), "dep_holder:0 end") == [
        "dep_producer:0 start",
        "dep_producer:0 end",
        "dep_consumer:0 start",
        "dep_consumer:0 end",
    ]
    ch.close()


def test_different_devices_run_concurrently(cluster, svc):
    """Calls on different devices hold their devices at the same time: each waits, inside its
    call, until the other has started too (serialised calls would never both start)."""
    g0 = Recorder.launch(cluster, placement=[0], name="cc_0")
    g1 = Recorder.launch(cluster, placement=[1], name="cc_1")
    # one group over both devices: its ranks run concurrently too
    both = Recorder.launch(cluster, placement=[0, 1], name="cc_both")
    for groups, keys in (((g0, g1), ["cc_0:0", "cc_1:0"]), ((both,), ["cc_both:0", "cc_both:1"])):
        log, gate = EventLog.remote(), Gate.remote()
        try:
            calls = [g.hold(gate, log) for g in groups]
            started = {f"{k} start" for k in keys}
            wait_until(
                lambda log=log, started=started: set(events(log)) == started,
                what=f"{keys} both holding",
            )
            assert _state(svc)["holder"] == {0: keys[0], 1: keys[1]}
        finally:
            ray.get(gate.open.remote(), timeout=60)
        assert [r["key"] for c in calls for r in c.wait(timeout=60)] == keys


def test_device_usable_after_group_shutdown(cluster, svc):
    dead = Recorder.launch(cluster, placement=[1], name="gone")
    dead.work(0).wait(timeout=60)
    dead.shutdown()
    state = _state(svc)
    assert "gone:0" not in state["resident"].get(1, [])  # unregistered from the lock service
    assert _deaths(svc) == []  # a shutdown is not a death
    after = Recorder.launch(cluster, placement=[1], name="after_gone")
    assert after.work(0).wait(timeout=60)[0]["loaded"]
    again = Recorder.launch(cluster, placement=[1], name="gone")  # the name is free again
    assert again.work(0).wait(timeout=60)[0]["key"] == "gone:0"


def test_device_usable_after_worker_killed_or_failed_init(cluster, svc):
    # A worker that dies without group.shutdown() (a crash) is a death of the run: pending
    # waits fail fast naming it, until its group is shut down.
    crashed = Recorder.launch(cluster, placement=[0], name="crashed")
    crashed.work(0).wait(timeout=60)  # resident (loaded) on device 0
    ray.kill(crashed.actors[0], no_restart=True)
    [death] = wait_until(lambda: _deaths(svc), what="the death of crashed:0")
    assert (death.group, death.rank) == ("crashed", 0) and death.cause
    assert "crashed:0" not in _state(svc)["resident"].get(0, [])  # its memory is gone
    after = Recorder.launch(cluster, placement=[0], name="after_crash")
    gate = Gate.remote()
    try:
        pending = after.hold(gate)  # takes device 0, whose resident died
        t0 = time.monotonic()
        with pytest.raises(WorkerError) as ei:
            pending.wait(timeout=60)
        assert time.monotonic() - t0 < 10, "the wait did not fail fast"
        assert ei.value.died and (ei.value.group, ei.value.rank) == ("crashed", 0)
        assert "'crashed'" in str(ei.value)
        crashed.shutdown()  # forgets the death
        assert _deaths(svc) == []
    finally:
        ray.get(gate.open.remote(), timeout=60)
    assert pending.wait(timeout=60)[0]["loaded"]  # its call went on, and can be waited now
    assert after.work(0).wait(timeout=60)[0]["loaded"]
    # a rank whose __init__ fails registers with the lock service before it dies; launch
    # shuts its group down, so that is no death of the run
    with pytest.raises(WorkerError, match="init-failed-here"):
        FailingInit.launch(cluster, placement=[0], name="failing_init")
    assert _deaths(svc) == []
    assert after.work(0).wait(timeout=60)[0]["loaded"]
    other = Recorder.launch(cluster, placement=[0], name="after_failed_init")
    assert other.work(0).wait(timeout=60)[0]["loaded"]


def test_dead_holder_frees_its_device(cluster, svc):
    hog = Recorder.launch(cluster, placement=[1], name="hog")
    waiter = Recorder.launch(cluster, placement=[0], name="hog_waiter")
    ch = Channel.create("hog-feed")
    gate = Gate.remote()
    try:
        stuck = hog.hold(gate)  # holds device 1 until the gate opens (it never will)
        wait_until(lambda: _state(svc)["holder"].get(1) == "hog:0", what="hog holding device 1")
        log = EventLog.remote()
        took = waiter.take(ch, 60, log)  # a worker-side wait (channel get) of another group
        wait_until(
            lambda: events(log) == ["hog_waiter:0 start"] and 0 not in _state(svc)["holder"],
            what="hog_waiter blocked in get (device 0 yielded)",
        )
        t0, killed_at = time.monotonic(), time.time()
        ray.kill(hog.actors[0], no_restart=True)  # dies holding the lock (no unregister)
        with pytest.raises(WorkerError) as ei:
            stuck.wait(timeout=60)
        assert time.monotonic() - t0 < 10, "the wait did not fail fast"
        err = ei.value
        assert err.died and (err.group, err.rank, err.method) == ("hog", 0, "hold")
        assert "'hog'" in str(err) and "died" in str(err)
        wait_until(lambda: _deaths(svc), what="the death of hog:0")
        assert 1 not in _state(svc)["holder"]  # the lock service freed the dead holder's device
        # the worker blocked in get sees the death (before the shutdown below forgets it)
        wait_until(took.done, what="hog_waiter's get to fail on the death")
        hog.shutdown()
        assert _deaths(svc) == []
    finally:
        ray.get(gate.open.remote(), timeout=60)
    seen = took.wait(timeout=60)[0]
    assert seen.get("died") == "hog", seen
    # within seconds of the death, not at its 60 s timeout
    assert seen["at"] - killed_at < 10, f"seen {seen['at'] - killed_at:.1f} s after the kill"
    nxt = Recorder.launch(cluster, placement=[1], name="after_hog")
    assert nxt.work(0).wait(timeout=60)[0]["loaded"]
    ch.close()
