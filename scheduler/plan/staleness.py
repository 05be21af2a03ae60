"""Bounded staleness: the planner's cost model of the asynchronous pipeline, and the choice of K.

Pure (numpy). K counts model versions: no token trained at version ``v`` was sampled with
weights older than ``v - K``; ``K = 0`` is today's synchronous on-policy step.

**A placement as a pipeline.** A plan of :mod:`.planner` is a chain of *stages* (the leaves,
temporal nodes and split cycles its spatial nodes join; a temporal or one-leaf plan is one
stage). Each stage has its whole-batch busy time ``T_i`` on its devices and the part of it that
is rollout, ``R_i``. The plan's own predicted time ``L`` (RLinf section 3.4's flow shop over
chunks, :func:`~.planner.predicted_time`) is one batch's *latency* through the pipeline. A weight
update costs ``S`` seconds (the transport the placement implies: in place when rollout shares
the trainer's devices, ``colocated_sync_s``, 0 by default as today's planner assumes; across
devices ``sync_s``; to a spot pool its ``weight_sync_s``); ``o`` is the profile's unattributed
``step_overhead_s``.

**The steady-state period** (step time) with bound K. Let batch j be ready to train at ``a_j``
and its update be published ``d = L + S - R`` later. Batch j may start sampling only once
version ``j - K`` is out, i.e. when batch ``j - K - 1``'s update lands: in steady state with
period P, at ``a_j - (K + 1) P + d``; it needs ``R`` to reach ``a_j``. So
``(K + 1) P >= L + S`` (the *latency bound*). Each stage is also a resource busy
``T_i - u_K R_i + S`` per step (the *throughput bound*; ``S``: both sides of the update wait
for it, counted on every stage, which overstates it for stages that take no part). Hence

    P_K = o + min( L + S,  max( (L + S) / (K + 1),  max_i (T_i - u_K R_i + S) ) ).

The ``min``: a bound K permits every schedule a smaller one does, so the synchronous step caps
the period (it binds only for a spot pool, whose seeded synchronous step can beat the pool
rolling out alone; a plan's stages each take at most its latency).
``K = 0``: ``P_0 = o + L + S``, today's prediction (plus the sync, 0 by default). With
``K >= 1`` on disjoint devices rollout of steps s+1..s+K overlaps training of step s and the
period falls to ``max(rollout, train + sync)`` once ``K`` covers the latency (veRL's one-step
off-policy and fully asynchronous trainers, AReaL: the figures issue 32 quotes). On a
collocated (temporal) placement there is one stage, ``T = L``, and asynchrony saves only
``u_K R``: rollout and training cannot overlap on the same devices.

**The long tail** ``u``: the share of the rollout's device time left idle while the longest
responses finish. With the whole batch decoded at once and a decode step costing the same
whatever the batch (memory-bound), the rollout lasts ``max(L_i)`` steps while the average slot
works ``mean(L_i)``: ``u = 1 - mean/max`` (:func:`tail_share` of a length sample). Partial
rollouts (on by default when ``K >= 1``, issue 32 item 2) refill freed slots with later
steps' prompts, but a response can only span K + 1 rollouts' worth of decode, so the rollout
phase cannot fall below ``R / (K + 1)``: ``u_K = min(u, K / (K + 1))`` (0 at K = 0). This is why
K = 1 buys the overlap and K >= 2 the tail (veRL: streaming ~1.6x, partial rollouts the rest,
2.35-2.67x in all; a SkyRL run at K = 0..4 gained 34 %, 9 %, 4 %, 12 %; as issue 32 quotes
them). A profile without
a length distribution (every shipped one) has ``u = 0``: the rollout time is what was measured
and there is no tail to fill.

**Mean staleness** (versions, over trained tokens): a token sampled at ``a_j - tau`` lags by
the updates published in between, ``ceil((tau + d) / P) - 1`` (at most K). Rollout on its own
devices (or on a stage of a pipeline of several) spreads batch j's tokens uniformly over
``R``: right before ``a_j`` when it is the
bottleneck (lag ~1 whenever the other stages take a comparable time), right after admission
when it has slack (it runs ahead to the bound: lag ~K, why an unbounded trainer drifts).
One stage (collocated): a batch's tokens spread over the ``1 / (1 - u_K)`` rollout phases its
longest response spans, mean lag ``u_K / (2 (1 - u_K))``.

**The choice** (:func:`choose`): the smallest K whose best placement is within ``slack`` (5 %)
of the best throughput over every (K, placement); K = 0 where asynchrony does not pay.

**Placements searched** (:func:`plan_staleness`): the planner's best plan of every kind
(temporal, spatial, hybrid: its runner-ups) and, since asynchrony rewards a *balanced* split
rather than the least latency, the disaggregated split ``rollout | rest`` over every device
count of rollout (the rest planned by the planner on the others, any mode, costed as one
stage), and a spot pool's rollout when given (:class:`SpotPipeline`).

Not modelled: step-to-step variance (a larger K also absorbs it), KV-cache recompute on a
weight update, and the memory of responses in flight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from .cost import INF, divisors
from .planner import DEFAULT_SLACK, Workflow, condense, plan_workflow
from .tables import Planner
from .tree import CycleSplit, Plan, PlanError, Spatial

DEFAULT_MAX_STALENESS = 4
DEFAULT_STALENESS_SLACK = 0.05
KINDS = ("temporal", "spatial", "hybrid", "single")


@dataclass(frozen=True)
class Stage:
    """One stage of a pipeline: ``busy_s`` seconds per step on its devices, ``rollout_s`` of
    them rollout (what partial rollouts can shrink)."""

    name: str
    busy_s: float
    rollout_s: float = 0.0


@dataclass(frozen=True)
class Pipeline:
    """A placement as the async cost model sees it (module docstring).

    Attributes:
        placement: label (``temporal``, ``spatial``, ``split 24+40``, ``spot``).
        latency_s: one batch's time through the pipeline, sync included (``L + S``).
        stages: the stages in order.
        sync_s: seconds per weight update (``S``).
        overhead_s: unattributed seconds per step (``o``), outside the max.
        rollout_s: the rollout's whole-batch span ``R`` (its longest response).
        dedicated: rollout has devices of its own (no other component on them).
        plan: the planner's tree, where there is one.
    """

    placement: str
    latency_s: float
    stages: tuple[Stage, ...]
    sync_s: float = 0.0
    overhead_s: float = 0.0
    rollout_s: float = 0.0
    dedicated: bool = False
    plan: Plan | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Row:
    """One (K, placement): predicted period ``step_s`` (s), ``items_per_s``, ``mean_staleness``
    (versions over trained tokens)."""

    k: int
    placement: str
    step_s: float
    items_per_s: float
    mean_staleness: float


@dataclass(frozen=True)
class StalenessPlan:
    """Every row (K ascending, placements in search order), the chosen one, the tail ``u`` used
    and a note on where it came from; ``pipelines`` by (K, placement)."""

    rows: tuple[Row, ...]
    chosen: Row
    tail: float
    note: str
    pipelines: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        """JSON-ready: rows, chosen, tail, note."""

        def row(r: Row) -> dict:
            return {"k": r.k, "placement": r.placement, "step_s": r.step_s,
                    "items_per_s": r.items_per_s, "mean_staleness": r.mean_staleness}  # fmt: skip

        return {"rows": [row(r) for r in self.rows], "chosen": row(self.chosen),
                "tail_share": self.tail, "note": self.note}  # fmt: skip


@dataclass(frozen=True)
class SpotPipeline:
    """Rollout on a spot pool (:mod:`m2flow.scheduler.spot.plan`): ``step_s`` its K = 0 step
    (the spot model's best, sync included), ``rollout_s`` the pool's batch time ``B / (n r)``,
    ``train_s`` the reserved devices' plan of the rest, ``sync_s`` the pool's weight push,
    ``reserved_rollout_s`` rollout's batch time on all reserved devices (``R``; 0: no seeding).

    With K >= 1 the reserved devices seed ``T`` of every step's rollout and train; the pool
    rolls out the rest. Both are stages: reserved busy ``T + t_train``, pool
    ``B (1 - T / R) / (n r)``, their rollout parts shrinking by ``u_K``; ``T`` balances them
    (the spot model's crossing, without the sync both pay), clamped to ``[0, R]``."""

    step_s: float
    rollout_s: float
    train_s: float
    sync_s: float
    reserved_rollout_s: float = 0.0

    def stages(self, u: float = 0.0) -> tuple[Stage, Stage]:
        """(pool, reserved) stages at the seeding window that balances them when the tail
        share ``u`` of rollout is filled: ``T (1 - u) + t_train = B (1 - T / R)(1 - u) / (n r)``."""
        r, pool = self.reserved_rollout_s, self.rollout_s
        t = 0.0
        if r > 0:
            t = (pool * (1.0 - u) - self.train_s) / ((1.0 - u) * (1.0 + pool / r))
            t = min(max(t, 0.0), r)
        left = pool * (1.0 - t / r) if r > 0 else pool
        return Stage("spot pool", left, left), Stage("reserved", t + self.train_s, t)


def tail_share(lengths: Sequence[float]) -> float:
    """``u = 1 - mean / max`` of response lengths (tokens; module docstring); 0 for none.

    Raises:
        ValueError: a negative length.
    """
    a = np.asarray(list(lengths), dtype=float)
    if a.size == 0 or a.max() <= 0:
        return 0.0
    if (a < 0).any():
        raise ValueError("response lengths must be >= 0 tokens")
    return float(1.0 - a.mean() / a.max())


def capped_lognormal(median: float, sigma: float, cap: float, n: int = 1024) -> np.ndarray:
    """``n`` deterministic quantiles (midpoints) of a lognormal of ``median`` tokens and
    log-space ``sigma``, capped at ``cap`` tokens (RLBoost's response-length model)."""
    if not (median > 0 and sigma >= 0 and cap > 0 and n >= 1):
        raise ValueError("lognormal lengths need median > 0, sigma >= 0, cap > 0, n >= 1")
    z = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    return np.minimum(median * np.exp(sigma * z), cap)


def _u(tail: float, k: int) -> float:
    return 0.0 if k == 0 else min(tail, k / (k + 1))


def stage_busy(pipe: Pipeline, k: int, tail: float = 0.0) -> list[float]:
    """Each stage's compute seconds per step at bound ``k``, ``T_i - u_K R_i`` (sync
    excluded)."""
    u = _u(tail, k)
    return [st.busy_s - u * st.rollout_s for st in pipe.stages]


def _bounds(pipe: Pipeline, k: int, tail: float) -> tuple[float, float, float]:
    """(latency bound, rollout stage's busy, slowest other stage's busy), overhead excluded."""
    lat = pipe.latency_s / (k + 1)
    busy = [b + pipe.sync_s for b in stage_busy(pipe, k, tail)]
    roll = max((b for b, st in zip(busy, pipe.stages) if st.rollout_s > 0), default=0.0)
    rest = max((b for b, st in zip(busy, pipe.stages) if st.rollout_s <= 0), default=0.0)
    return lat, roll, rest


def period(pipe: Pipeline, k: int, tail: float = 0.0) -> float:
    """Steady-state step time (s) of ``pipe`` at bound ``k`` with tail share ``tail``:
    ``o + min(L + S, max((L + S) / (K + 1), max_i (T_i - u_K R_i + S)))`` (module docstring).
    Nonincreasing in ``k``; ``period(pipe, 0) = o + L + S``.

    Raises:
        ValueError: ``k < 0`` or ``tail`` outside [0, 1).
    """
    if k < 0 or not 0.0 <= tail < 1.0:
        raise ValueError(f"need k >= 0 and tail in [0, 1); got k={k}, tail={tail}")
    return pipe.overhead_s + min(pipe.latency_s, max(_bounds(pipe, k, tail)))


def mean_staleness(pipe: Pipeline, k: int, tail: float = 0.0, samples: int = 256) -> float:
    """Mean lag (versions) of the trained tokens of ``pipe`` at bound ``k`` (module docstring):
    0 at ``k = 0``, at most ``k``."""
    if k == 0:
        return 0.0
    u = _u(tail, k)
    if len(pipe.stages) == 1:  # collocated: only the tail carries over
        return min(float(k), u / (2.0 * (1.0 - u)))
    lat, roll, rest = _bounds(pipe, k, tail)
    p = max(lat, roll, rest)
    if p >= pipe.latency_s:  # the synchronous schedule is as fast: run it (no lag)
        return 0.0
    r = pipe.rollout_s
    if not p > 0 or not r > 0:
        return 0.0
    d = pipe.latency_s - r
    admit = (k + 1) * p - d  # tau at admission (before a_j)
    # Rollout-bound: it ends right at a_j; with slack it starts as soon as admitted.
    hi = r if roll >= max(lat, rest) * (1 - 1e-9) else admit
    hi = min(hi, admit)
    lo = max(hi - r, 0.0)
    tau = lo + (np.arange(samples) + 0.5) * (hi - lo) / samples
    lag = np.clip(np.ceil((tau + d) / p - 1e-9) - 1, 0, k)
    return float(lag.mean())


def _stages(node: Plan) -> list[Plan]:
    if isinstance(node, Spatial) and not isinstance(node, CycleSplit):
        return _stages(node.upstream) + _stages(node.downstream)
    return [node]


def _rollout_time(node: Plan, rollout: set[str]) -> float:
    if isinstance(node, CycleSplit):
        names = {c for lf in node.leaves() for c in lf.components}
        return node.time if names <= rollout else 0.0
    return sum(
        t for lf in node.leaves() for c, t in zip(lf.components, lf.component_times) if c in rollout
    )


def pipeline_of(
    plan: Plan, rollout: set[str], sync_s: float = 0.0, colocated_sync_s: float = 0.0,
    overhead_s: float = 0.0, label: str | None = None,
) -> Pipeline:  # fmt: skip
    """``plan`` (any tree of :mod:`.planner`) as a :class:`Pipeline`: its stages, their rollout
    time (the ``rollout`` components'), latency ``plan.time + S`` with ``S = sync_s`` when
    rollout has devices of its own, else ``colocated_sync_s``."""
    stages, rs, dedicated = [], 0.0, False
    for st in _stages(plan):
        names = {c for lf in st.leaves() for c in lf.components}
        r = _rollout_time(st, rollout)
        if r > 0 or names & rollout:
            rs = max(rs, r)
            dedicated = dedicated or names <= rollout
        stages.append(Stage(st.shape(), float(st.time), r))
    s = sync_s if dedicated else colocated_sync_s
    return Pipeline(label or plan.kind(), float(plan.time) + s, tuple(stages), s, overhead_s,
                    rs, dedicated, plan)  # fmt: skip


def rollout_node(workflow: Workflow, rollout: Sequence[str] | None = None) -> set[str]:
    """The rollout's components: ``rollout`` if given, else the members of the workflow's one
    source node after collapsing cycles (the generator: ``rollout``, or ``env+policy``).

    Raises:
        PlanError: an unknown name, or no single source (name the rollout components).
    """
    names = {c.name for c in workflow.components}
    if rollout:
        bad = set(rollout) - names
        if bad:
            raise PlanError(
                f"rollout components {sorted(bad)} are not in the workflow {sorted(names)}"
            )
        return set(rollout)
    nodes, edges = condense(workflow)
    sources = [i for i in range(len(nodes)) if not any(v == i for _, v in edges)]
    if len(sources) != 1:
        raise PlanError(
            f"cannot tell the rollout: {len(sources)} source nodes "
            f"({[nodes[i].name for i in sources]}); name the rollout components"
        )
    return {c.name for c in nodes[sources[0]].members}


def _plans(workflow: Workflow, n: int, capacity: float, allow_idle: bool, slack: float):
    """The planner's best plan of every kind (its families: any, temporal, spatial, hybrid),
    its tables and condensed nodes. As :func:`~.planner.plan_workflow` does, without the
    top-level runner-ups; an infeasible workflow raises its explained error."""
    nodes, edges = condense(workflow)
    slack = slack if allow_idle else 0.0
    pl = Planner(nodes, edges, n, capacity, workflow.batch_size, allow_idle, slack)
    full = (1 << len(nodes)) - 1
    found = []
    for fam in ("A", "T", "S", "H"):
        choice = pl.root(full, fam)
        if np.isfinite(choice.cost):
            found.append(pl.build(full, False, fam, 0, n, choice))
    if not found:
        plan_workflow(workflow, n, capacity, allow_idle=allow_idle, slack=slack)  # raises
    plans: dict[str, Plan] = {}
    for p in sorted(found, key=lambda p: p.time):
        plans.setdefault(p.kind(), p)
    return plans, pl, nodes


def split_latency(r: np.ndarray, t: np.ndarray, o_r: float, o_t: float, batch: int) -> np.ndarray:
    """Least flow-shop time of ``rollout | rest`` over chunk counts ``k | batch``, elementwise
    (:func:`~.cost.flow_shop_time` for two stages)."""
    best = np.full(np.shape(r), INF)
    with np.errstate(invalid="ignore"):
        for k in divisors(batch):
            tr, tt = (r - o_r) / k + o_r, (t - o_t) / k + o_t
            best = np.fmin(best, tr + tt + (k - 1) * np.maximum(tr, tt))
    return best


def choose(rows: Sequence[Row], slack: float = DEFAULT_STALENESS_SLACK) -> Row:
    """The smallest K whose best row is within ``slack`` of the best items/s over all rows
    (then the faster row, then the earlier one).

    Raises:
        ValueError: no row, or ``slack`` outside [0, 1).
    """
    if not rows:
        raise ValueError("no (K, placement) row to choose from")
    if not 0.0 <= slack < 1.0:
        raise ValueError(f"staleness slack must be in [0, 1); got {slack!r}")
    best = max(r.items_per_s for r in rows)
    ok = [r for r in rows if r.items_per_s >= (1.0 - slack) * best]
    k = min(r.k for r in ok)
    return max((r for r in ok if r.k == k), key=lambda r: r.items_per_s)


def plan_staleness(
    workflow: Workflow,
    num_devices: int,
    capacity: float = INF,
    *,
    max_staleness: int = DEFAULT_MAX_STALENESS,
    slack: float = DEFAULT_STALENESS_SLACK,
    tail: float = 0.0,
    sync_s: float = 0.0,
    colocated_sync_s: float = 0.0,
    overhead_s: float = 0.0,
    rollout: Sequence[str] | None = None,
    spot: SpotPipeline | None = None,
    allow_idle: bool = True,
    plan_slack: float = DEFAULT_SLACK,
    mode: str = "auto",
    note: str = "",
) -> StalenessPlan:
    """Rows for every K in ``0..max_staleness`` and placement (module docstring), and the
    choice. Times in seconds; items/s in the workflow's items (``batch_size`` per step).

    Args:
        tail: the rollout's idle share ``u`` in [0, 1) (:func:`tail_share`; 0: no length
            distribution, the rollout time as measured).
        sync_s / colocated_sync_s: weight update across devices / in place, seconds.
        overhead_s: the profile's ``step_overhead_s``.
        allow_idle, plan_slack: the planner's ``allow_idle`` and ``slack``.
        mode: ``auto`` (every placement) or one kind (``temporal``, ``spatial`` -- the split
            family included -- or ``hybrid``); a spot pool's row is kept either way.

    Raises:
        PlanError: nothing feasible, or bad arguments (``max_staleness < 0``, ``slack`` or
            ``tail`` outside [0, 1)).
    """
    if not (isinstance(max_staleness, int) and max_staleness >= 0):
        raise PlanError(f"max_staleness must be a whole number >= 0, got {max_staleness!r}")
    if not 0.0 <= tail < 1.0 or not 0.0 <= slack < 1.0:
        raise PlanError(f"tail and slack must be in [0, 1); got tail={tail}, slack={slack}")
    if mode not in ("auto", "temporal", "spatial", "hybrid"):
        raise PlanError(f"mode must be auto, temporal, spatial or hybrid; got {mode!r}")
    roll = rollout_node(workflow, rollout)
    plans, pl, nodes = _plans(workflow, num_devices, capacity, allow_idle, plan_slack)
    pipes = [pipeline_of(plans[k], roll, sync_s, colocated_sync_s, overhead_s, k)
             for k in KINDS if k in plans and mode in ("auto", k)]  # fmt: skip
    batch = workflow.batch_size
    split = None
    r_mask = sum(1 << i for i, nd in enumerate(nodes) if {c.name for c in nd.members} <= roll)
    rest_mask = (1 << len(nodes)) - 1 - r_mask
    if rest_mask and num_devices >= 2 and mode in ("auto", "spatial"):
        # The planner's own tables: the chain search already filled both (rollout is the
        # source, so "rollout | rest" is one of its cuts).
        r, t = pl.table(r_mask, False, "A").cost, pl.table(rest_mask, False, "A").cost
        n_r = np.arange(1, num_devices)
        rr, tt = r[n_r], t[num_devices - n_r]
        lat = split_latency(rr, tt, pl.overhead(r_mask), pl.overhead(rest_mask), batch)
        split = (n_r, rr, tt, lat)
    rows, by = [], {}
    for k in range(max_staleness + 1):
        cands = list(pipes)
        if split is not None:
            n_r, rr, tt, lat = split
            u = _u(tail, k)
            with np.errstate(invalid="ignore"):
                per = np.fmax(np.fmax((lat + sync_s) / (k + 1), rr * (1 - u) + sync_s),
                              tt + sync_s)  # fmt: skip
            per = np.where(np.isfinite(lat), per, INF)
            i = int(np.argmin(per))
            if np.isfinite(per[i]):
                cands.append(Pipeline(
                    f"split {n_r[i]}+{num_devices - n_r[i]}", float(lat[i]) + sync_s,
                    (Stage("rollout", float(rr[i]), float(rr[i])), Stage("rest", float(tt[i]))),
                    sync_s, overhead_s, float(rr[i]), True,
                ))  # fmt: skip
        if spot is not None:
            pool, res = spot.stages(_u(tail, k))
            cands.append(Pipeline("spot", spot.step_s, (pool, res), spot.sync_s, 0.0,
                                  max(pool.busy_s, res.rollout_s), True))  # fmt: skip
        for pipe in cands:
            step = period(pipe, k, tail)
            x = batch / step if step > 0 else math.inf
            rows.append(Row(k, pipe.placement, step, x, mean_staleness(pipe, k, tail)))
            by[(k, pipe.placement)] = pipe
    if not rows:
        raise PlanError("no feasible placement to cost")
    return StalenessPlan(tuple(rows), choose(rows, slack), tail, note, by)


def pipeline_for(choice: StalenessPlan) -> Pipeline | None:
    """The chosen row's :class:`Pipeline` (its planner tree, if any), or ``None``."""
    return choice.pipelines.get((choice.chosen.k, choice.chosen.placement))
