"""Step order: what pipelined training steps issue reaches each group and channel in step order.

With bounded staleness (``trainer.max_staleness=K``, :mod:`m2flow.run.pipeline`) up to ``K + 1``
training steps run at once, each on a driver thread running the runner's unchanged ``step``.
Their group calls must still reach each :class:`~m2flow.core.group.WorkerGroup` in step order:
a group runs its calls one at a time in arrival order, and a channel epoch is "the n-th call of
this group given the channel" (:mod:`m2flow.core.calls`), so an epoch is a step only if step
``s``'s calls to a group arrive after step ``s - 1``'s. Likewise the driver's puts on a channel
(a step's prompts) and any runtime turn named here (the prompt sampler's draws).

:class:`StepOrder` enforces it. A *target* is a group's or channel's name. A thread of step ``s``
may issue to a target once every earlier step has *released* it; a step releases a target when
it has issued as many operations to it as the first pipelined step did (the runner's step is
profiled once, as M2Flow profiles a runner), or when it ends. So step ``s + 1``'s rollout call
goes out while step ``s``'s actor still trains, and the actor's next call waits for step ``s``'s
weight send. A step that issues more operations to a target than the first step did raises
:class:`StepOrderError` (the order would no longer hold).

Exempt (:func:`unordered`): the receiving side of a weight sync, which the pipeline places
itself (it may overtake later steps' calls: that is what a weight update during rollout is).
Without an active :class:`StepOrder` (every run with ``K = 0``) nothing waits.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator

from .._env import wait_timeout

_local = threading.local()  # .order, .step (the pipelined step this thread runs), .exempt
_active: StepOrder | None = None  # the run's order while a pipeline runs


class StepOrderError(RuntimeError):
    """A pipelined step issued to a group or channel more often than the first step did."""


class StepOrder:
    """The per-target turn of pipelined steps (see the module docstring).

    Args:
        first: the first step the pipeline runs; it profiles the calls per target (it runs
            alone: the pipeline starts no other step before it ends).
        partial: weight syncs inside a step load into the receivers beside the group call
            they run (partial rollouts, :func:`live_weights`).
    """

    def __init__(self, first: int, partial: bool = False) -> None:
        self.first, self.partial = first, partial
        self._cond = threading.Condition()
        self._learned: dict[str, int] | None = None  # target -> operations per step
        self._issued: dict[tuple[int, str], int] = defaultdict(int)
        self._released: dict[str, set[int]] = defaultdict(set)
        self._through: dict[str, int] = defaultdict(lambda: first - 1)  # contiguous releases
        self._ended: set[int] = set()
        self._failed: BaseException | None = None

    # -- the step threads -------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Run the body as pipelined step ``number`` (this thread's turns are its); on exit the
        step releases every target (and the first step's counts become the profile)."""
        _local.order, _local.step = self, number
        try:
            yield
        finally:
            _local.order = _local.step = None
            self.end(number)

    def end(self, number: int) -> None:
        with self._cond:
            if number == self.first and self._learned is None:
                self._learned = {t: n for (s, t), n in self._issued.items() if s == number}
            self._ended.add(number)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Wake every waiting thread with ``error`` (a step failed: the run stops)."""
        with self._cond:
            self._failed = error
            self._cond.notify_all()

    @contextlib.contextmanager
    def turn(self, target: str) -> Iterator[None]:
        """Issue one operation to ``target`` in step order (the body issues it)."""
        number = _local.step
        with self._cond:
            timeout = wait_timeout()
            ok = self._cond.wait_for(
                lambda: self._failed is not None or self._advance(target) >= number - 1,
                timeout=timeout,
            )
            if self._failed is not None:
                raise StepOrderError(f"step {number}: stopped, another step failed") from None
            if not ok:
                raise TimeoutError(
                    f"step {number} waited {timeout:.0f} s for step {number - 1} to issue its "
                    f"operations to '{target}' (M2FLOW_WAIT_TIMEOUT)"
                )
            self._issued[number, target] += 1
            count = self._issued[number, target]
            learned = None if self._learned is None else self._learned.get(target, 0)
            if learned is not None and count > learned:
                raise StepOrderError(
                    f"step {number} issued {count} operations to '{target}', its first "
                    f"pipelined step {learned}: with trainer.max_staleness >= 1 a step must call "
                    "each group (and put on each channel) the same number of times every step; "
                    "make the step regular or run with trainer.max_staleness=0"
                )
        try:
            yield
        finally:
            if learned is not None and count == learned:
                with self._cond:
                    self._release(number, target)
                    self._cond.notify_all()

    def _release(self, number: int, target: str) -> None:
        self._released[target].add(number)

    def _advance(self, target: str) -> int:
        """The last step through which every step has released ``target`` (an ended step
        released all)."""
        done = self._released[target]
        while self._through[target] + 1 in done or self._through[target] + 1 in self._ended:
            self._through[target] += 1
            done.discard(self._through[target])
        return self._through[target]


def activate(order: StepOrder | None) -> None:
    """Make ``order`` the run's step order (``None``: none; calls are issued as they come)."""
    global _active
    _active = order


@contextlib.contextmanager
def turn(target: str) -> Iterator[None]:
    """Issue one operation to ``target`` (a group's or channel's name) in step order when the
    calling thread runs a pipelined step; at once otherwise."""
    order = getattr(_local, "order", None)
    if order is None or order is not _active or getattr(_local, "exempt", False):
        yield
        return
    with order.turn(target):
        yield


@contextlib.contextmanager
def unordered() -> Iterator[None]:
    """Issue the body's operations at once, outside the step order (a weight sync's receive)."""
    before = getattr(_local, "exempt", False)
    _local.exempt = True
    try:
        yield
    finally:
        _local.exempt = before


def live_weights() -> bool:
    """Whether a weight sync issued by this thread loads beside the receivers' running calls:
    a pipelined step of a run with partial rollouts."""
    order = getattr(_local, "order", None)
    return order is not None and order is _active and order.partial
