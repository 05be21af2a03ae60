"""Per-process buffer of timed runtime events: what the measured step timeline is made of.

Every process of a run (the driver and each worker rank) records what its runtime did and
when: a group call's run on a rank, a device-lock wait, an offload or onload, a hand-off of
the devices while a call waits for data, a channel get or put that waited, a weight sync. An
event is one tuple appended to a bounded in-memory buffer -- no Ray call, no I/O -- timed on
the monotonic clock (``time.perf_counter_ns``); the buffer carries the process's wall-clock
anchor (one ``time.time_ns`` / ``perf_counter_ns`` pair taken together), so the driver puts
every process's events on one wall-clock axis. A worker's buffer travels with its group
calls' results (:class:`~m2flow.worker.CallStats`), the driver's is read at each logged step;
:mod:`m2flow.tracefile` writes them as a Chrome trace.

Recording is off until :func:`enable` (the run session turns it on; library use records
nothing, and :func:`span` then costs one attribute test).

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
from collections import deque

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

        with m2flow.events.span("reward_service", "score", requests=len(batch)):
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
