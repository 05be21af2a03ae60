"""Per-process buffer of timed runtime events: what the measured step timeline is made of.

Every process of a run (the driver and each worker rank) records what its runtime did and
when: a group call's run on a rank, a device-lock wait, an offload or onload, a hand-off of
the devices while a call waits for data, a channel get or put that waited, a weight sync. An
event is one tuple appended to a bounded in-memory buffer -- no Ray call, no I/O -- timed on
the monotonic clock (``time.perf_counter_ns``); the buffer carries the process's wall-clock
anchor (one ``time.time_ns`` / ``perf_counter_ns`` pair taken together), so the driver puts
every process's events on one wall-clock axis. A worker's buffer travels with its group
calls' results (:class:`~m2flow.core.worker.CallStats`), the driver's is read at each logged step;
:mod:`m2flow.core.tracefile` writes them as a Chrome trace.

Recording is off until :func:`enable` (the run session turns it on; library use records
nothing, and :func:`span` then costs one attribute test).

Run events (:func:`publish`, :func:`open_bus`) are the other half: values one process of a run
publishes under a topic and another reads, without the runner in between -- e.g. the trainer's
waits for input (topic :data:`TRAINER_WAITS`), which the spot pool's rollout manager reads for
its Algorithm 1, or a preemptible worker's death (topic :data:`WORKER_LOST`), which the pool
reads to migrate that instance's requests. They go through one small named actor, the run's
event bus, which exists once a reader opened it; a publish with no bus is a no-op (a run
without readers pays a name lookup).

Event kinds (``cat`` of the trace): ``call`` (a group method on one rank), ``lock_wait``
(acquiring the rank's device locks, including offloading the previous holders and onloading
itself), ``offload``, ``onload``, ``handoff`` (devices released while the call waits for data,
until taken back), ``channel_get``, ``channel_put``, ``recv`` (a wait for data or room),
``weight_sync``, ``reward_service``, ``spot`` (waits a role marks with :func:`span`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict, deque
from typing import Any

from .._context import NAMESPACE, here

KINDS = (
    "call", "lock_wait", "offload", "onload", "handoff", "channel_get", "channel_put", "recv",
    "weight_sync", "reward_service", "spot",
)  # fmt: skip
#: Events a process keeps between two shipments (a call's return, a step's mark); older
#: ones are dropped and counted (a call that waits on a channel 10^5 times).
MAX_BUFFERED = 50_000

_now = time.perf_counter_ns


class Recorder:
    """The events of this process since the last :meth:`drain`.

    An event is ``(kind, name, start_ns, end_ns, track, args)``: monotonic nanoseconds,
    ``track`` ``"main"`` (the thread running group calls) or ``"io"`` (runtime requests served
    while a call runs, e.g. an offload another worker asked for), ``args`` a small dict or
    ``None``.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.anchor = (time.time_ns(), _now())  # (wall, monotonic) read together
        self.events: deque = deque(maxlen=MAX_BUFFERED)
        self.dropped = 0

    def add(self, kind: str, name: str, start_ns: int, end_ns: int, track="main", args=None):
        if len(self.events) == MAX_BUFFERED:
            self.dropped += 1
        self.events.append((kind, name, start_ns, end_ns, track, args))

    def drain(self) -> tuple | None:
        """``(wall_anchor_ns, mono_anchor_ns, pid, events, dropped)`` since the last drain, or
        ``None`` when nothing was recorded (so an untraced call ships nothing)."""
        if not self.events and not self.dropped:
            return None
        events = []
        while self.events:  # popleft is atomic: an io-thread append is never lost
            events.append(self.events.popleft())
        dropped, self.dropped = self.dropped, 0
        return (*self.anchor, os.getpid(), events, dropped)


recorder = Recorder()


def enable(on: bool = True) -> None:
    """Record this process's events from now on (``False``: stop, and forget the buffer)."""
    recorder.enabled = on
    if not on:
        recorder.events.clear()
        recorder.dropped = 0


def enabled() -> bool:
    return recorder.enabled


def now() -> int:
    """The recording clock: monotonic nanoseconds."""
    return _now()


def record(kind: str, name: str, start_ns: int, end_ns: int | None = None, track="main", **args):
    """Record one event that ran from ``start_ns`` (:func:`now`) to ``end_ns`` (default now)."""
    if recorder.enabled:
        end_ns = _now() if end_ns is None else end_ns
        recorder.add(kind, name, start_ns, end_ns, track, args or None)


@contextlib.contextmanager
def span(kind: str, name: str, track: str = "main", **args):
    """Record the block as one event of ``kind`` (one of :data:`KINDS`), e.g. a role's wait
    for its reward service::

        with m2flow.core.events.span("reward_service", "score", requests=len(batch)):
            scores = client.score(batch)
    """
    if not recorder.enabled:
        yield
        return
    t0 = _now()
    try:
        yield
    finally:
        recorder.add(kind, name, t0, _now(), track, args or None)


# -- run events: published by one process, read by another -------------------------------------

BUS_NAME = "m2flow:run_events"  # the run's event bus, a named actor in m2flow's namespace
#: topic of a trainer rank's waits for input in one update: ``{"group", "rank", "waits"}``,
#: ``waits`` a list of ``[t0, t1]`` wall-clock (``time.time()``) seconds
TRAINER_WAITS = "trainer_waits"
#: topic of a preemptible worker's death (:mod:`m2flow.core.liveness`, published by the lock
#: service): :meth:`m2flow.core.liveness.Loss.event`'s dict, ``preempted`` or crashed, the cause
WORKER_LOST = "worker_lost"
BUS_KEEP = 10_000  # values a topic keeps (the oldest go first)


class EventBus:
    """The run's published values by topic, each numbered in publication order (one sequence
    for the bus, so a reader's cursor is one integer). A Ray actor (:func:`open_bus`)."""

    def __init__(self) -> None:
        self.topics: dict[str, deque] = defaultdict(lambda: deque(maxlen=BUS_KEEP))
        self.seq = 0

    def publish(self, topic: str, value: Any) -> int:
        """Append ``value`` to ``topic``; returns its number."""
        self.seq += 1
        self.topics[topic].append((self.seq, value))
        return self.seq

    def last(self) -> int:
        """The number of the last value published (0: none yet): a new reader's cursor."""
        return self.seq

    def read(self, topic: str, after: int = 0) -> list[tuple[int, Any]]:
        """``topic``'s ``(number, value)`` pairs numbered above ``after``, oldest first."""
        return [(n, v) for n, v in self.topics.get(topic, ()) if n > after]


_bus: tuple[str, Any] | None = None  # (Ray session, handle): this process keeps the bus alive


def open_bus():
    """The run's event bus (created by the first caller, on this process's node; later callers
    get the same actor). Its reader calls this; publishers find it by name. The opening
    process holds a handle for the rest of its Ray session, which keeps the actor alive."""
    global _bus
    import ray

    context = ray.get_runtime_context()
    session = f"{context.get_job_id()}@{context.gcs_address}"
    if _bus is None or _bus[0] != session:
        actor = ray.remote(num_cpus=0)(EventBus)
        handle = actor.options(
            name=BUS_NAME, namespace=NAMESPACE, get_if_exists=True, scheduling_strategy=here()
        ).remote()
        _bus = (session, handle)
    return _bus[1]


def publish(topic: str, value: Any, timeout: float = 60.0) -> bool:
    """Publish ``value`` (picklable) under ``topic`` on the run's event bus and wait until the
    bus has it, so that whatever this process does next (its call returning, say) happens after
    the value is readable. Returns False, publishing nothing, when no reader opened a bus.

    Raises:
        ray.exceptions.GetTimeoutError: the bus did not answer within ``timeout`` seconds.
    """
    import ray

    if not ray.is_initialized():
        return False
    try:
        bus = ray.get_actor(BUS_NAME, namespace=NAMESPACE)
    except ValueError:  # no reader in this run
        return False
    ray.get(bus.publish.remote(topic, value), timeout=timeout)
    return True


async def publish_async(topic: str, value: Any) -> bool:
    """:func:`publish` from a coroutine (an async actor's event loop): awaits the bus instead
    of blocking on it. Returns False, publishing nothing, when no reader opened a bus."""
    import ray

    try:
        bus = ray.get_actor(BUS_NAME, namespace=NAMESPACE)
    except ValueError:  # no reader in this run
        return False
    await bus.publish.remote(topic, value)
    return True
