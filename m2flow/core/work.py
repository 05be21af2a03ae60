"""Work: the handle of an asynchronous runtime operation (a channel get or put, a ``recv``)."""

from __future__ import annotations

import sys

from .._context import current_worker
from .._env import wait_timeout
from . import events, liveness

_YIELD_GRACE_S = 0.005


def flush_puts() -> None:
    """Send the channel puts this process gathered (:mod:`m2flow.core.channel`): it is about to
    block, maybe on what they feed."""
    channel = sys.modules.get("m2flow.core.channel")
    if channel is not None:
        channel.flush_all()


class Work:
    """Handle of an asynchronous operation; ``wait()`` (or ``await``) returns its result.

    Built from a Ray ``ref`` (optionally post-processed by ``then``) or from a deferred
    callable ``run``. With ``yields=True`` (waits for data), waiting inside a worker yields
    the worker's devices while the result is not ready. Waits check the run's liveness
    (:mod:`m2flow.core.liveness`). ``label`` ``(kind, name)``: the wait is recorded as that event
    (:mod:`m2flow.core.events`, e.g. ``("channel_get", "rollout_out")``).
    """

    def __init__(self, ref=None, then=None, run=None, yields: bool = False, label=None) -> None:
        self._ref, self._then, self._run, self._yields = ref, then, run, yields
        self._label = label

    def wait(self, timeout: float | None = None):
        """The result.

        Raises:
            TimeoutError: not ready within ``timeout`` seconds (default
                ``M2FLOW_WAIT_TIMEOUT``).
            WorkerDied: a worker of the run died meanwhile.
        """
        if self._run is not None:
            return self._run()
        if self._label is not None and events.enabled():
            with events.span(*self._label):
                return self._wait(timeout)
        return self._wait(timeout)

    def _wait(self, timeout: float | None):
        import ray

        flush_puts()
        timeout = wait_timeout() if timeout is None else timeout
        worker = current_worker()
        waiter = worker.worker_key if worker is not None else "the driver"
        ready, _ = ray.wait([self._ref], timeout=_YIELD_GRACE_S)
        if not ready:
            # Data not there at once: give the devices away while waiting (a producer on the
            # same devices can run), unless this wait is not for data.
            if self._yields and worker is not None and worker._m2flow_holding:
                with worker._m2flow_yield_devices():
                    ready = liveness.wait_ready([self._ref], timeout, waiter)
            else:
                ready = liveness.wait_ready([self._ref], timeout, waiter)
            if not ready:
                raise ray.exceptions.GetTimeoutError(
                    f"{waiter}: the operation did not complete in {timeout:.0f} s"
                )
        value = ray.get(self._ref)
        return self._then(value) if self._then is not None else value

    def __await__(self):
        import asyncio

        return asyncio.get_running_loop().run_in_executor(None, self.wait).__await__()
