"""Test instruments: wait for an observable state (never sleep to order things), a gate that
holds a worker in its call until the test opens it, and a log of what workers did, in order.

``EventLog`` and ``Gate`` are plain Ray actors (no m2flow code): handles are passed to worker
methods as arguments. A worker appends to the log *after* taking its device lock and *before*
releasing it (inside its group method, with a synchronous call), so the log's order is the
order in which workers held their devices, without comparing clocks of different processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import ray


def wait_until(
    predicate: Callable[[], Any], timeout: float = 30.0, what: str = "", interval: float = 0.05
) -> Any:
    """Poll ``predicate`` until it returns a truthy value, and return that value.

    Raises:
        AssertionError: still falsy after ``timeout`` seconds; says ``what`` was awaited and
            the last value seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what or predicate!r} "
                f"(last value: {value!r})"
            )
        time.sleep(interval)


@ray.remote(num_cpus=0)
class EventLog:
    """An ordered list of events (strings), appended by workers and read by the test."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def add(self, event: str) -> None:
        self.events.append(event)

    def read(self) -> list[str]:
        return list(self.events)


@ray.remote(num_cpus=0)
class Gate:
    """Closed until :meth:`open`; :meth:`wait` blocks the caller until then (or ``timeout``)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def open(self) -> None:
        self.event.set()

    async def wait(self, timeout: float) -> bool:
        """True once open; False after ``timeout`` seconds closed."""
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
        except TimeoutError:
            return False
        return True


def log_event(log, event: str) -> None:
    """Append ``event`` to ``log`` (an :class:`EventLog` handle, or ``None``) and wait."""
    if log is not None:
        ray.get(log.add.remote(event), timeout=60)


def events(log) -> list[str]:
    return ray.get(log.read.remote(), timeout=60)


def pass_gate(gate, timeout: float = 120.0) -> None:
    """Block until ``gate`` opens.

    Raises:
        TimeoutError: it stayed closed ``timeout`` seconds (a test that failed before opening
            it: the worker's call ends instead of holding its device forever).
    """
    if not ray.get(gate.wait.remote(timeout), timeout=timeout + 30):
        raise TimeoutError(f"the test's gate stayed closed for {timeout:g} s")
