"""Decode-step boundaries: where a rollout engine pauses, resumes and takes new weights.

A :class:`DecodeGate` sits between one decoding thread (an engine's ``generate`` or ``step``)
and the threads that control it (a role's ``pause`` / ``resume`` / ``update_weights``, the
weight sync). The decoding thread runs each decode step inside :meth:`DecodeGate.step`; a
controller's :meth:`~DecodeGate.pause` returns once the step in flight has ended and no other
starts, :meth:`~DecodeGate.update` applies new weights at such a boundary (waiting for one if a
step is in flight), :meth:`~DecodeGate.resume` lets the steps go on. The sequences stay where
they are, in the engine's call: the step after an update computes with the new weights and
tells the decoder so (a new :attr:`~DecodeGate.version`), which then recomputes what it cached
under the old ones (each engine's docstring says what it keeps).

This is what asynchronous partial rollouts (AReaL's interruptible rollout workers; veRL's fully
asynchronous trainer) and the spot pool's pull-based weights (RLBoost section 4.3) need of an
engine: the same sequences continue across a weight update, every token labelled with the
version that sampled it.

Every wait has a limit: a decoder paused for ``timeout_s`` seconds without a resume raises
:class:`TimeoutError` (a controller that died must not hang the rollout); ``pause`` and
``update`` wait at most ``timeout_s`` for the step in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

#: seconds a paused decoder waits for ``resume()`` (and a controller for a step to end)
PAUSE_TIMEOUT_S = 1800.0


class DecodeGate:
    """See the module docstring.

    Args:
        version: the weight version the engine starts with (-1: none loaded yet).
        timeout_s: longest wait, in seconds, of a paused decoder for :meth:`resume`, and of
            :meth:`pause` / :meth:`update` for the step in flight.

    Attributes:
        version: the weight version the next decode step computes with.
        boundaries: decode steps ended so far (what a controller may wait on).
    """

    def __init__(self, version: int = -1, timeout_s: float = PAUSE_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.version = version
        self.timeout_s = timeout_s
        self.boundaries = 0
        self._cond = threading.Condition()
        self._paused = False  # asked to stop at the next boundary
        self._busy = False  # a decode step (or a weight update) is in flight
        self._updating = 0  # controllers waiting to apply weights: steps wait for them

    @property
    def paused(self) -> bool:
        """Whether a pause was asked (and not resumed): no decode step starts meanwhile."""
        return self._paused

    @property
    def busy(self) -> bool:
        """Whether a decode step (or a weight update) is in flight."""
        return self._busy

    @property
    def updating(self) -> bool:
        """Whether a weight update waits for its boundary or is being applied."""
        return self._updating > 0

    def pause(self) -> None:
        """Stop the decoder at its next decode-step boundary: returns once the step in flight
        (if any) has ended; no step starts until :meth:`resume`. Idempotent.

        Raises:
            TimeoutError: the step in flight did not end within ``timeout_s``.
        """
        with self._cond:
            self._paused = True
            self._cond.notify_all()  # an interruptible wait (:meth:`sleep`) ends now
            self._wait_for(lambda: not self._busy, "the decode step in flight to end")

    def resume(self) -> None:
        """Let decode steps start again (with the weights loaded meanwhile). Idempotent."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def update(self, version: int, apply: Callable[[], object] | None = None) -> None:
        """Apply new weights between decode steps: wait for the step in flight (if any) to end,
        run ``apply()`` (the load; ``None``: nothing to load) while no step runs, then record
        ``version``. Works paused or not (unpaused, the decoder goes on after it). Call it
        from another thread, or from the decoding thread between steps (inside one it would
        wait for itself until ``timeout_s``).

        Raises:
            TimeoutError: the step in flight did not end within ``timeout_s``.
        """
        with self._cond:
            self._updating += 1
            try:
                self._wait_for(lambda: not self._busy, "the decode step in flight to end")
            except BaseException:
                self._updating -= 1
                self._cond.notify_all()
                raise
            self._busy = True
        applied = False
        try:
            if apply is not None:
                apply()
            applied = True
        finally:
            with self._cond:
                if applied:  # a failed load leaves the version it had
                    self.version = version
                self._busy = False
                self._updating -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """One decode step of the decoder: waits while paused or while weights are being
        applied, then holds the weights steady until the block ends. Yields the version the
        step computes with.

        Raises:
            TimeoutError: paused for ``timeout_s`` seconds without :meth:`resume`.
        """
        with self._cond:
            self._wait_for(lambda: not (self._paused or self._updating or self._busy), "resume()")
            self._busy = True
            version = self.version
        try:
            yield version
        finally:
            with self._cond:
                self._busy = False
                self.boundaries += 1
                self._cond.notify_all()

    def sleep(self, seconds: float) -> float:
        """Inside :meth:`step`: wait up to ``seconds``, less when a pause is asked meanwhile
        (an emulated engine's modelled decode time, cut at the pause). Returns the seconds
        waited."""
        t0 = time.monotonic()
        with self._cond:
            self._cond.wait_for(lambda: self._paused, timeout=max(seconds, 0.0))
        return time.monotonic() - t0

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        if not self._cond.wait_for(ready, timeout=self.timeout_s):
            raise TimeoutError(
                f"rollout engine: waited {self.timeout_s:g} s for {what} (DecodeGate.timeout_s)"
            )
