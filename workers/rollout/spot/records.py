"""What the rollout manager records: each instance as it sees it, and one step's clock, from
which Algorithm 1's inputs come (RLBoost 4.1, lines 6-8; definitions in docs/results/spot.md).

Times: the manager's clock (:func:`now`, ``time.monotonic()`` seconds on a standard event
loop), except the wall-clock (:func:`wall`, ``time.time()``) intervals that are compared with
the trainer's reported waits.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from m2flow.scheduler.spot import StepStats, seconds_outside


def now() -> float:
    """The manager's clock in seconds: its event loop's ``time()`` (``time.monotonic()`` on a
    standard loop; the virtual clock of ``benchmarks/spot_cluster_emu.py``'s loop, which is
    how the cluster experiments run this manager in emulated time)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # outside the loop (records built by a test)
        return time.monotonic()


def wall() -> float:
    """Wall-clock seconds on the manager's clock: ``time.time()``, or the running loop's
    ``wall()`` where it has one (a virtual clock: wall and loop time advance together)."""
    try:
        w = getattr(asyncio.get_running_loop(), "wall", None)
    except RuntimeError:
        w = None
    return w() if w is not None else time.time()


@dataclass
class InstanceRecord:
    """An instance as the manager holds it: a spot instance or a seeding reserved rank."""

    id: str
    kind: str  # "spot" or "reserved"
    handle: object = None  # the SpotInstance actor (spot only)
    node: str = ""  # Ray node id (hex)
    member: object = None  # its m2flow.core.elastic.Member (spot only)
    version: int = -1
    pending: deque = field(default_factory=deque)  # request ids assigned, not leased yet
    executing: set = field(default_factory=set)  # request ids leased
    revoke: dict = field(default_factory=dict)  # executing id -> instance it moves to
    accepting: bool = True  # False: leaving (a reserved rank after seeding)
    busy_s: float = 0.0  # engine seconds this step
    context: float | None = None  # mean request length (tokens) at its last report
    last_done: float | None = None  # when it last finished a response this step
    since: float = field(default_factory=now)


@dataclass
class StepRecord:
    """One step's clock and waits (the manager's current step; ``step`` -1 between steps)."""

    step: int = -1
    start: float = 0.0
    seed_end: float | None = None
    owners: dict[int, int] = field(default_factory=dict)  # rank -> prompts it will collect
    # waits of a trainer that collects itself (collect's caller trains between calls)
    train_wait: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    # the trainer's reported waits for micro-batches: rank -> [(t0, t1)] wall-clock seconds
    trainer_waits: dict[int, list] = field(default_factory=dict)
    seed_end_wall: float | None = None  # wall() when the seeding window ended
    reserved_spans: list = field(default_factory=list)  # [id, t0, t1]: reserved generation (wall)
    n_integral: float = 0.0  # spot instance-seconds, for n_bar
    n_since: float = 0.0
    requests: int = 0  # requests submitted this step (the seeding share, N_prem's cap)
    t_seed: float = 0.0  # the seeding window this step runs with (seconds)
    # reserved rank -> when it first registered this step (its window runs from there: a rank
    # back for the colocated fallback has no second window)
    seed_from: dict[str, float] = field(default_factory=dict)
    # busy engine seconds of spot instances gone during the step (preempted, crashed or
    # released): t_remote counts them, as n_bar counts the time they were held
    gone_busy_s: float = 0.0

    def integrate(self, held: int) -> float:
        """Advance the spot instance-seconds (``n_bar``'s integral) to now at the count
        ``held`` since the last call: called before every change of the count and at the
        step's end, so a count held constant integrates exactly. Returns now (monotonic)."""
        t = now()
        self.n_integral += held * max(t - self.n_since, 0.0)
        self.n_since = t
        return t

    def t_train_wait(self, end: float) -> float:
        """``t_train^wait`` of the step ending at ``end`` (wall clock): the mean over trainer
        ranks of their reported waits after the seeding window, less the reserved ranks'
        generation (the devices roll out then, they are not idle); without reports, the mean
        collect wait of a trainer that collects itself."""
        if not self.trainer_waits:
            return sum(self.train_wait.values()) / max(len(self.train_wait), 1)
        lo = self.seed_end_wall if self.seed_end_wall is not None else end
        busy = [(a, b if b is not None else end) for _, a, b in self.reserved_spans]
        total = 0.0
        for spans in self.trainer_waits.values():
            total += sum(seconds_outside(a, b, lo, end, busy) for a, b in spans)
        return total / len(self.trainer_waits)

    def remote_busy(self, spot: list[InstanceRecord]) -> float:
        """Busy engine instance-seconds of the spot pool this step: the instances ``spot``
        held now and those gone during the step (``gone_busy_s``)."""
        return sum(i.busy_s for i in spot) + self.gone_busy_s

    def stats(self, now: float, spot: list[InstanceRecord]) -> StepStats:
        """Algorithm 1's inputs for the step ending at ``now`` (monotonic, after
        :meth:`integrate`), with ``spot`` the spot instances held at its end."""
        elapsed = max(now - self.start, 1e-9)
        seed_end = self.seed_end if self.seed_end is not None else now
        train_wait = self.t_train_wait(wall())
        worked = [i for i in spot if i.last_done is not None]
        n_bar = self.n_integral / elapsed
        return StepStats(
            n_bar=n_bar,
            n_hat=len(spot),
            t_train_wait=train_wait,
            t_remote_wait=sum(now - i.last_done for i in worked) / max(len(worked), 1),
            t_train=max(now - seed_end - train_wait, 1e-6),
            # per instance: the pool's busy instance-seconds over n_bar (scheduler.spot), the
            # instances gone during the step included
            t_remote=self.remote_busy(spot) / n_bar if n_bar > 0 else 0.0,
        )
