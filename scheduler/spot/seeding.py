"""Adaptive partial response seeding: RLBoost (Wu et al., NSDI 2026) section 4.1, Algorithm 1.

Line numbers ``paper:N`` refer to ``shared/papers/000_8942f305fc039a41.txt`` (Algorithm 1 is at
paper:154-174, its explanation at paper:186-192).

At the start of every step the reserved training cluster rolls out for a window of ``T_seed``
seconds, then switches to training; the responses it has not finished are "seeds" that remote
(preemptible) rollout instances continue. After each step, :meth:`SeedingPolicy.update` reads
the step's idle and compute times (:class:`StepStats`) and returns the next step's ``T_seed``
and ``N_prem``, the most remote instances the rollout manager may hold:

- line 9: ``T_seed += (t_train_wait - t_remote_wait) / eta`` -- seed longer when the trainer
  waited for responses, shorter when the remote instances waited for the trainer.
- line 10: ``N_prem = (t_remote * n_bar + T_seed * N_resv) / t_train`` -- the instances needed
  for the step's whole rollout work (instance-seconds) to take no longer than training.
- lines 11-14: memory ``M[n_hat] = T_seed`` when the instance count did not change during the
  step (``n_bar == n_hat``), and ``T_seed = M[n_hat]`` when the coming step's count was seen.

Readings of the extracted text (also in docs/results/spot.md):

- ``t_remote_wait`` is a per-instance mean (seconds), not a sum over instances: line 9 weighs
  it against the training cluster's single wall-clock idle time, so a sum would make the step
  size grow with the number of instances. Line 7 writes ``T_remote^wait`` and paper:186 defines
  ``t_remote^wait`` twice (the first is the trainer's wait); read as typos.
- ``t_remote`` is per-instance remote compute time: remote busy instance-seconds divided by
  ``n_bar``, so ``t_remote * n_bar`` is the remote rollout work (paper:190, "the total rollout
  workload" is ``t_remote n_bar + T_seed n_resv``). The busy seconds of every instance held
  during the step count, those preempted or released before its end included (``n_bar``
  counts their held time too).
- Line 10 uses ``T_seed`` as line 9 has just updated it (the pseudocode's order); the text's
  "total rollout workload" suggests the window the step actually ran with instead. Both are
  available: ``seed_work="updated"`` (default, the pseudocode) or ``"executed"``.
- Line 10 gives a real number; ``N_prem`` is a count of instances "required for the rollout
  stage to take less time than t_train" (paper:190), so it is rounded UP (``ceil``, with a
  relative slack of 1e-9 so that 3.0000000001 from float noise stays 3), then clamped to
  ``[n_prem_min, n_prem_max]``.
- ``T_seed`` is clamped to ``[t_seed_min, t_seed_max]`` right after line 9 (not in the paper:
  line 9 alone can drive the window negative); lines 10-14 see the clamped value.
- "``n_bar = n_hat``" (line 11) with a float time-average: equal when
  ``abs(n_bar - n_hat) <= equal_tol`` (default 1e-6 instances), which absorbs float error in a
  time-weighted mean; any real change of the count during a step moves ``n_bar`` by far more.
- ``n_bar`` and ``n_hat`` count the remote instances the rollout manager holds (serving,
  at most ``N_prem``), not the instances a trace says could be allocated: line 10 multiplies
  ``n_bar`` by per-instance work.
- Not in the paper: ``N_prem`` is also capped at the step's request count
  (``update(n_requests=...)``): an instance beyond one per request has nothing to generate.
- The "w/o seeding" ablation (section 6.4.1) keeps line 10 with ``T_seed`` = 0
  (``update(seeding=False)``): the pool is still bounded by the remote work over ``t_train``.
- How many requests a seeding reserved rank holds: :func:`seeding_share` (the paper gives no
  count; an even split over the reserved ranks and the expected spot instances).

Pure Python; no Ray, no torch. Times in seconds, instance counts integers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

SeedWork = Literal["updated", "executed"]


def _check_time(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True)
class StepStats:
    """What Algorithm 1 reads after a step (section 4.1, lines 6-8). Seconds; instance counts.

    Attributes:
        n_bar: remote instances held, time-weighted over the step (line 6, ``n_bar_prem``).
        n_hat: remote instances held at the end of the step, before the next one starts
            (line 6, ``n_hat_prem``); the key of the memory.
        t_train_wait: seconds the training cluster sat idle waiting for responses to fill a
            micro-batch (line 7).
        t_remote_wait: seconds remote instances sat idle between their last response and the
            end of the step, MEAN over the instances held at the end (line 7; not summed, see
            the module docstring). 0 when there were none.
        t_train: effective training compute seconds of the step, idle excluded (line 8).
        t_remote: remote rollout compute seconds PER INSTANCE: busy instance-seconds of the
            remote pool divided by ``n_bar`` (line 8, as line 10 uses it). 0 when ``n_bar`` is 0.

    Raises:
        ValueError: a negative or non-finite value, or a non-integer ``n_hat``.
    """

    n_bar: float
    n_hat: int
    t_train_wait: float
    t_remote_wait: float
    t_train: float
    t_remote: float

    def __post_init__(self) -> None:
        if not (isinstance(self.n_bar, int | float) and math.isfinite(self.n_bar)):
            raise ValueError(f"n_bar must be a finite number of instances, got {self.n_bar!r}")
        if self.n_bar < 0:
            raise ValueError(f"n_bar must be >= 0 instances, got {self.n_bar}")
        if isinstance(self.n_hat, bool) or not isinstance(self.n_hat, int) or self.n_hat < 0:
            raise ValueError(f"n_hat must be an integer >= 0 instances, got {self.n_hat!r}")
        for name in ("t_train_wait", "t_remote_wait", "t_train", "t_remote"):
            _check_time(name, getattr(self, name))


@dataclass
class SeedingPolicy:
    """Algorithm 1 (section 4.1): the seeding window ``T_seed`` and the remote cap ``N_prem``.

    Args:
        n_resv: local rollout engines the training cluster is split into while seeding
            (``N_resv``); line 3 starts ``N_prem`` at this value.
        eta: adaptation rate (``eta`` > 0): line 9 moves ``T_seed`` by the wait difference / eta.
        t_init: initial ``T_seed`` in seconds (line 2), within ``[t_seed_min, t_seed_max]``.
        use_memory: lines 11-14 on (the paper's full solution) or off (the "w/o memory"
            ablation of section 6.4.1, Figure 12).
        t_seed_min, t_seed_max: clamp for ``T_seed`` after line 9 (seconds; ``None``: no
            upper bound). Not in the paper; keeps the window a real duration.
        n_prem_max: upper clamp for ``N_prem`` (e.g. a budget; ``None``: none).
        n_prem_min: lower clamp for ``N_prem`` (default 0).
        equal_tol: line 11's "equal": ``abs(n_bar - n_hat) <= equal_tol`` instances.
        seed_work: which ``T_seed`` line 10 counts as local work: ``"updated"`` (line 9's
            result, the pseudocode order) or ``"executed"`` (the window the step ran with).

    Attributes:
        t_seed: current seeding window, seconds (the next step's ``T_seed``).
        n_prem: current cap on remote instances (the next step's ``N_prem``).
        n_prem_raw: line 10's unrounded value from the last update (``None`` before one).
        memory: ``M``, instance count -> the latest ``T_seed`` tuned under it.

    Raises:
        ValueError: invalid arguments (non-positive ``eta``, negative counts or times,
            ``t_init`` outside the clamp, an unknown ``seed_work``).
    """

    n_resv: int
    eta: float
    t_init: float
    use_memory: bool = True
    t_seed_min: float = 0.0
    t_seed_max: float | None = None
    n_prem_max: int | None = None
    n_prem_min: int = 0
    equal_tol: float = 1e-6
    seed_work: SeedWork = "updated"
    t_seed: float = field(init=False)
    n_prem: int = field(init=False)
    n_prem_raw: float | None = field(init=False, default=None)
    memory: dict[int, float] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.n_resv, bool) or not isinstance(self.n_resv, int) or self.n_resv < 0:
            raise ValueError(f"n_resv must be an integer >= 0, got {self.n_resv!r}")
        if not (math.isfinite(self.eta) and self.eta > 0):
            raise ValueError(f"eta must be a finite number > 0, got {self.eta!r}")
        _check_time("t_seed_min", self.t_seed_min)
        if self.t_seed_max is not None and not self.t_seed_max >= self.t_seed_min:
            raise ValueError(f"t_seed_max {self.t_seed_max} is below t_seed_min {self.t_seed_min}")
        _check_time("t_init", self.t_init)
        if self.t_init < self.t_seed_min or (
            self.t_seed_max is not None and self.t_init > self.t_seed_max
        ):
            raise ValueError(
                f"t_init {self.t_init} s is outside [t_seed_min, t_seed_max] = "
                f"[{self.t_seed_min}, {self.t_seed_max}]"
            )
        n_max = self.n_prem_max
        if self.n_prem_min < 0 or (n_max is not None and n_max < self.n_prem_min):
            raise ValueError(
                f"need 0 <= n_prem_min <= n_prem_max, got {self.n_prem_min}, {self.n_prem_max}"
            )
        if not (math.isfinite(self.equal_tol) and self.equal_tol >= 0):
            raise ValueError(f"equal_tol must be a finite number >= 0, got {self.equal_tol!r}")
        if self.seed_work not in ("updated", "executed"):
            raise ValueError(f"seed_work must be 'updated' or 'executed', got {self.seed_work!r}")
        self.t_seed = float(self.t_init)  # line 2
        self.n_prem = self._clamp_n(self.n_resv)  # line 3

    def _clamp_t(self, t: float) -> float:
        t = max(t, self.t_seed_min)
        return t if self.t_seed_max is None else min(t, self.t_seed_max)

    def _clamp_n(self, n: int) -> int:
        n = max(n, self.n_prem_min)
        return n if self.n_prem_max is None else min(n, self.n_prem_max)

    def update(
        self, stats: StepStats, *, seeding: bool = True, n_requests: int | None = None
    ) -> tuple[float, int]:
        """Lines 6-14 after a step: the next step's ``(t_seed, n_prem)``; also stored.

        Args:
            stats: the step's measurements (lines 6-8).
            seeding: ``False`` is the "w/o seeding" ablation (section 6.4.1, Figure 12):
                ``T_seed`` stays 0 (lines 9 and 11-14 off) and line 10 still bounds the pool,
                with no local work (``T_seed N_resv`` = 0).
            n_requests: the step's request count, a cap on ``N_prem`` (not in the paper: an
                instance beyond one per request has nothing to generate; line 10 alone gives
                140 instances for a 16-request step when ``t_train`` is short). Applied before
                ``[n_prem_min, n_prem_max]``, so ``n_prem_min`` still wins. ``None``: no cap.

        Returns:
            ``(t_seed, n_prem)``: seconds of seeding and the cap on remote instances.

        Raises:
            ValueError: ``stats.t_train`` is 0 (line 10 divides by it; a step always trains),
                or a negative ``n_requests``.
        """
        if stats.t_train <= 0:
            raise ValueError("stats.t_train must be > 0 s: Algorithm 1 line 10 divides by it")
        if n_requests is not None and n_requests < 0:
            raise ValueError(f"n_requests must be >= 0, got {n_requests!r}")
        executed = self.t_seed
        if seeding:  # line 9, then the clamp (a negative window means nothing)
            self.t_seed = self._clamp_t(
                self.t_seed + (stats.t_train_wait - stats.t_remote_wait) / self.eta
            )
            local = self.t_seed if self.seed_work == "updated" else executed
        else:
            self.t_seed, local = 0.0, 0.0
        # line 10: instances needed for all rollout work (instance-seconds) to fit in t_train
        raw = (stats.t_remote * stats.n_bar + local * self.n_resv) / stats.t_train
        self.n_prem_raw = raw
        # ceil with a relative slack: float noise must not add an instance
        n = max(0, math.ceil(raw - 1e-9 * max(1.0, abs(raw))))
        self.n_prem = self._clamp_n(n if n_requests is None else min(n, n_requests))
        if self.use_memory and seeding:
            if abs(stats.n_bar - stats.n_hat) <= self.equal_tol:  # line 11
                self.memory[stats.n_hat] = self.t_seed  # line 12
            if stats.n_hat in self.memory:  # line 13
                self.t_seed = self.memory[stats.n_hat]  # line 14
        return self.t_seed, self.n_prem


def seeding_share(
    requests: int, n_resv: int, expected: int, *, ready: int, window_over: bool
) -> int | None:
    """How many of the step's requests one seeding reserved rank may hold at once (pending
    plus executing), or ``None`` for no bound (section 4.1 seeding; the rank is an instance of
    Algorithm 2's SELECTINSTANCE).

    Rule (a reading; the paper gives no count): ``ceil(requests / (n_resv + expected))``, an
    even split of the step's requests over the reserved ranks and the spot instances the step
    expects. The paper has the manager send "a part of the rollout requests to rollout
    instances on behalf of the training cluster" (paper:137) while "the rollout instances are
    receiving weights and generating the first stream of responses, the training cluster would
    handle rollout requests within a specific time window" (paper:139): the reserved ranks seed
    a part, the rest waits for the instances as they become current. Taking up to a whole batch
    of ``max_batch`` each (the ablation ``seed_share="all"``) leaves nothing queued when
    ``max_batch * n_resv >= requests``.

    ``None`` (the reserved ranks finish the rollout: colocated fallback, "without stalling
    progress", paper:197) when no spot instance is expected (none held or starting: no free
    node, or ``N_prem`` none), or when the rank's seeding window is over and no instance is
    ready.

    Args:
        requests: the step's requests (>= 0).
        n_resv: reserved ranks (``N_resv`` >= 1; 0 is read as 1).
        expected: spot instances the step expects, ``min(N_prem, held or starting)`` (>= 0).
        ready: spot instances on the current weights (>= 0).
        window_over: the rank's ``T_seed`` window has passed.

    Raises:
        ValueError: a negative count.
    """
    if min(requests, n_resv, expected, ready) < 0:
        raise ValueError(
            f"counts must be >= 0, got requests={requests}, n_resv={n_resv}, "
            f"expected={expected}, ready={ready}"
        )
    if expected == 0 or (window_over and ready == 0):
        return None
    return max(1, -(-requests // (max(n_resv, 1) + expected)))


def seconds_outside(
    a: float, b: float, lo: float, hi: float, minus: list[tuple[float, float]]
) -> float:
    """Seconds of the interval ``[a, b]`` that lie inside ``[lo, hi]`` and outside every
    interval of ``minus`` (which may overlap one another). Used for ``t_train_wait``: a
    trainer's wait counts after the seeding window (``lo``) and outside the reserved ranks'
    generation (``minus``), when the training cluster's devices roll out instead."""
    a, b = max(a, lo), min(b, hi)
    if b <= a:
        return 0.0
    cut, t = 0.0, a
    for x, y in sorted(minus):
        x, y = max(x, t), min(y, b)
        if y > x:
            cut += y - x
            t = y
    return b - a - cut
