"""Where rollout runs: reserved only, spot only, or seeded (RLBoost section 4.1), and at what
cost per step. A pure policy; :mod:`m2flow.run.plan_cli` and :mod:`m2flow.run.planning` call it.

The reserved cluster's plan comes from the M2Flow planner (:mod:`.planner`); this module adds
the rollout component's remote option and prices both. Its model of one step (seconds):

- ``R``: the rollout component's time for the whole batch on all ``N`` reserved devices (its
  profile fit at ``N``); the reserved cluster rolls out at ``B / R`` items per second.
- ``t_train``: the best reserved plan of every *other* component on the ``N`` devices (the
  planner, run on the workflow without rollout).
- A spot instance (``devices_per_instance`` devices, TP) rolls out ``r`` items per second
  (``instance_items_per_s``, profiled); ``n`` instances are held on average (the expected
  availability, capped by ``N_prem``).
- Seeding window ``T`` (RLBoost Algorithm 1): the reserved cluster rolls out for ``T``, then
  trains; the spot instances start once the step's weights reach them (``sync``,
  ``weight_sync_s``) and finish the ``B (1 - T / R)`` items the reserved cluster left. Training
  streams the responses (micro-batches), so the step is
  ``max(T + t_train, sync + B (1 - T / R) / (n r))``: the trainer's end, or the last
  response's. Seeding pays where the reserved devices would otherwise wait (the weight push,
  a spot pool slower than training).
- Long responses (optional; ``tail_s``, ``tail_train_fraction``): no number of instances
  decodes one response faster, so the step cannot end before the longest responses do
  (``tail_s`` after the step's start, at the pool's batch sizes) plus the training of the GRPO
  groups that wait for them (a group trains once all its samples are in): a third term
  ``tail_s + f t_train``. :func:`tail_term` derives both from the times each group's last
  sample ends. The throughput lines alone put the step 32-40 % under the emulated cluster's
  (docs/results/spot_cluster.md), as most of its step is this tail.

The step is the max of a rising and a falling line in ``T``, so the best window is their
crossing ``T* = (sync + B / (n r) - t_train) / (1 + B / (R n r))`` (in this model both
sides end together there; RLBoost's Algorithm 1 line 9 has no closed form: it moves
``T_seed`` until the trainer's and the instances' measured waits are equal) clamped to
``[0, R)``; ``T = 0`` is spot rollout
without seeding. ``T >= R`` would leave the pool idle, which the reserved plan beats, so it is
not a spot choice. The tail term does not depend on ``T``: where it is above the crossing
the step is flat around ``T*``, and the plan keeps ``T*``. ``N_prem`` is searched over
``1..ceil(n_bar)`` (more instances than are available change nothing). RLBoost's line 10
gives the cap an adaptive run starts from; this planner instead picks the cap that optimises
the objective under the expected availability, and the run's Algorithm 1 adapts both from
there.

Not modelled: preemptions' lost work (the expected availability stands for it), migration's
re-prefill, and rollout and training contending for the reserved devices' memory. The tail
term takes the group end times of one rollout on the pool from the step's start; seeding and
migration move responses between engines, which shifts them a little.

Cost per step ($): ``step * (N p_res + n d p_spot) / 3600`` with ``p`` in $ per device-hour:
the reserved devices are paid for the whole step, spot instances for the time they are held
(the expected ``n``). Objectives: ``time`` (then cost on ties), ``cost`` (then time), and
``tokens_per_dollar``, which for a fixed batch per step ranks exactly like ``cost`` (items per
$ = ``B / cost``); it is accepted for the CLI's vocabulary and reported as items per $.

Deviation from RLBoost: the paper has no planner; it starts from ``T_init`` and lets Algorithm
1 converge. Starting at the model's ``T*`` shortens that convergence; the run still adapts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

OBJECTIVES = ("time", "cost", "tokens_per_dollar")
Objective = Literal["time", "cost", "tokens_per_dollar"]


class SpotPlanError(ValueError):
    """Bad spot-planning input (the message names the value and the fix)."""


@dataclass(frozen=True)
class SpotPool:
    """A profile's ``spot:`` section: the remote rollout pool the plan may use.

    Attributes:
        component: the profiled component that may run on the pool (rollout).
        instance_items_per_s: one instance's rollout throughput, items (prompts with all their
            samples) per second, > 0.
        devices_per_instance: devices per instance (its TP size; RLBoost: 2xH100).
        expected_instances: ``n_bar``, the instances available on average (a trace's
            time-weighted mean), >= 0.
        max_instances: most instances the plan may hold (``None``: ``ceil(n_bar)``).
        weight_sync_s: seconds per step to push the new weights to the instances.
        tail_s: seconds from the step's start until the last response ends (the longest
            responses' decode; 0: not modelled).
        tail_train_fraction: share of ``t_train`` that can only run after that, in [0, 1]
            (the groups that wait for the longest responses; :func:`tail_term`).
    """

    component: str = "rollout"
    instance_items_per_s: float = 1.0
    devices_per_instance: int = 1
    expected_instances: float = 0.0
    max_instances: int | None = None
    weight_sync_s: float = 0.0
    tail_s: float = 0.0
    tail_train_fraction: float = 0.0

    def __post_init__(self) -> None:
        _positive("spot.instance_items_per_s", self.instance_items_per_s)
        _nonneg("spot.expected_instances", self.expected_instances)
        _nonneg("spot.weight_sync_s", self.weight_sync_s)
        _nonneg("spot.tail_s", self.tail_s)
        _nonneg("spot.tail_train_fraction", self.tail_train_fraction)
        if self.tail_train_fraction > 1:
            raise SpotPlanError(
                f"spot.tail_train_fraction={self.tail_train_fraction!r}: a share of the "
                "training time, give a number in [0, 1]"
            )
        if not (isinstance(self.devices_per_instance, int) and self.devices_per_instance >= 1):
            raise SpotPlanError(
                f"spot.devices_per_instance={self.devices_per_instance!r}: give a whole number "
                ">= 1 (an instance's TP size)"
            )
        if self.max_instances is not None and not (
            isinstance(self.max_instances, int) and self.max_instances >= 0
        ):
            raise SpotPlanError(
                f"spot.max_instances={self.max_instances!r}: give a whole number >= 0 or null"
            )


@dataclass(frozen=True)
class Prices:
    """Dollars per device-hour of reserved and of spot devices (RLBoost section 6.1: reserved
    8xH100 at $83.79/h = 10.47 per device-hour, spot 2xH100 at $5.32/h = 2.66)."""

    reserved: float = 0.0
    spot: float = 0.0

    def __post_init__(self) -> None:
        _nonneg("price reserved", self.reserved)
        _nonneg("price spot", self.spot)


@dataclass(frozen=True)
class RolloutChoice:
    """One way to run rollout, with its predicted step time and cost.

    Attributes:
        mode: ``reserved`` (the reserved plan alone), ``spot`` (no seeding: ``T_seed = 0``)
            or ``seeded`` (reserved for ``t_seed``, then spot).
        step_s: predicted seconds per step.
        cost_per_step: predicted $ per step.
        t_seed: the seeding window, seconds (``None`` for ``reserved``).
        n_prem: the cap on spot instances (0 for ``reserved``).
        instances: expected instances held, ``min(n_prem, n_bar)``.
        items_per_dollar: items per $ (``inf`` when nothing is priced).
    """

    mode: str
    step_s: float
    cost_per_step: float
    t_seed: float | None = None
    n_prem: int = 0
    instances: float = 0.0
    items_per_dollar: float = math.inf

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SpotPlan:
    """The chosen rollout choice and the runner-ups (reserved-only and spot-without-seeding,
    each the best of its mode), ``objective`` as ranked."""

    best: RolloutChoice
    runner_ups: tuple[RolloutChoice, ...]
    objective: str

    def to_dict(self) -> dict:
        return {
            "objective": self.objective,
            "best": self.best.to_dict(),
            "runner_ups": [c.to_dict() for c in self.runner_ups],
        }


def expected_instances(trace: Sequence[tuple[float, int]]) -> float:
    """A trace's time-weighted mean instance count over ``[t_0, t_last]`` (a one-row trace:
    its count). Rows ``(t_s, instances)``, times increasing (:mod:`.spot_trace`)."""
    if not trace:
        raise SpotPlanError("the spot trace has no rows; write t_s,instances rows")
    t0, t_last = trace[0][0], trace[-1][0]
    if t_last <= t0:
        return float(trace[-1][1])
    area = sum(n * (trace[i + 1][0] - t) for i, (t, n) in enumerate(trace[:-1]))
    return area / (t_last - t0)


def tail_term(group_end_s: Sequence[float], train_s: float) -> tuple[float, float]:
    """``(tail_s, tail_train_fraction)`` of :class:`SpotPool` from when each GRPO group of a
    step is complete (the end of its last sample, seconds from the step's start).

    A trainer that takes complete groups as they come, each costing ``t_train / B``, ends at
    ``max_k (g_k + (B - k) t_train / B)`` over the end times sorted ascending (``k`` from 0):
    some group, and every group after it, trains after that group ends. ``tail_s`` is the last
    end ``g_{B-1}``, and the fraction is what the trainer still has to do then,
    ``(end - tail_s) / t_train`` (at least ``1 / B``: the last group itself).

    Raises:
        SpotPlanError: no groups, or a time that is negative or not finite.
    """
    if not group_end_s:
        raise SpotPlanError("tail_term needs the end time of at least one group")
    for v in (*group_end_s, train_s):
        _nonneg("group end / training time", v)
    g = sorted(float(x) for x in group_end_s)
    b, tail = len(g), g[-1]
    if train_s == 0:
        return tail, 0.0
    end = max(gk + (b - k) * train_s / b for k, gk in enumerate(g))
    return tail, min(1.0, (end - tail) / train_s)


def plan_rollout(
    batch_size: int,
    reserved_step_s: float,
    rollout_s: float,
    train_s: float,
    num_devices: int,
    pool: SpotPool,
    prices: Prices,
    objective: Objective = "time",
    extra_s: float = 0.0,
) -> SpotPlan:
    """Choose reserved-only, spot or seeded rollout (module docstring: the model).

    Args:
        batch_size: items per step ``B``.
        reserved_step_s: the planner's best step on the ``num_devices`` reserved devices with
            every component, rollout included (seconds).
        rollout_s: ``R``, rollout's time for the whole batch on all reserved devices (s).
        train_s: ``t_train``, the best reserved plan of the other components (s).
        num_devices: reserved devices ``N``.
        pool: the spot pool; prices: $ per device-hour.
        objective: ``time``, ``cost`` or ``tokens_per_dollar``.
        extra_s: seconds every non-reserved choice's step also pays (the remote reward
            service's, :mod:`.reward_remote`; ``reserved_step_s`` already holds them).

    Returns:
        The best :class:`RolloutChoice` and the runner-ups (the best reserved-only one, and
        the best with no seeding when spot instances are expected).

    Raises:
        SpotPlanError: an unknown objective, or a time that is negative or not finite.
    """
    if objective not in OBJECTIVES:
        raise SpotPlanError(f"objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    for name, v in (("reserved step", reserved_step_s), ("rollout", rollout_s),
                    ("training", train_s), ("extra", extra_s)):  # fmt: skip
        _nonneg(f"{name} time", v)
    if batch_size < 1 or num_devices < 1:
        raise SpotPlanError(f"batch_size {batch_size} and devices {num_devices} must be >= 1")

    def priced(mode, step, t_seed=None, n_prem=0, n=0.0) -> RolloutChoice:
        per_hour = num_devices * prices.reserved + n * pool.devices_per_instance * prices.spot
        cost = step * per_hour / 3600.0
        ipd = batch_size / cost if cost > 0 else math.inf
        return RolloutChoice(mode, step, cost, t_seed, n_prem, n, ipd)

    reserved = priced("reserved", reserved_step_s)
    cap = pool.max_instances
    top = math.ceil(pool.expected_instances - 1e-9) if cap is None else cap
    top = min(top, math.ceil(pool.expected_instances - 1e-9))
    spot, seeded = [], []
    floor = pool.tail_s + pool.tail_train_fraction * train_s  # the long responses' term
    for n_prem in range(1, top + 1):
        n = min(float(n_prem), pool.expected_instances)
        rate = n * pool.instance_items_per_s  # items per second of the held pool

        def step(t: float, rate=rate) -> float:
            left = batch_size * (1.0 - t / rollout_s) if rollout_s > 0 else 0.0
            return extra_s + max(t + train_s, pool.weight_sync_s + left / rate, floor)

        spot.append(priced("spot", step(0.0), 0.0, n_prem, n))
        if rollout_s > 0:
            per_s = batch_size / (rollout_s * rate)  # spot seconds one seeding second saves
            t = (pool.weight_sync_s + batch_size / rate - train_s) / (1.0 + per_s)
            if 0.0 < t < rollout_s:
                seeded.append(priced("seeded", step(t), t, n_prem, n))

    key = _key(objective)
    best_spot = min(spot, key=key, default=None)
    best = min([reserved, *spot, *seeded], key=key)
    runner_ups = tuple(
        c for c in (reserved, best_spot) if c is not None and c is not best and c != best
    )
    return SpotPlan(best, runner_ups, objective)


def _key(objective: str):
    if objective == "time":
        return lambda c: (_round(c.step_s), c.cost_per_step, c.n_prem)
    return lambda c: (_round(c.cost_per_step), c.step_s, c.n_prem)


def _round(x: float) -> float:
    """Ties within float noise (1e-9 relative) go to the next key."""
    return float(f"{x:.9e}")


def _positive(name: str, v) -> None:
    if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
        raise SpotPlanError(f"{name}={v!r}: give a finite number > 0")


def _nonneg(name: str, v) -> None:
    if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
        raise SpotPlanError(f"{name}={v!r}: give a finite number >= 0")
