"""Reward-service scaling policy of DistRS (section 5): Algorithm 1 and the decision.

The reward service is request-in, batch-out: a trainer only needs the whole batch's rewards, so
a request may wait as long as the batch still completes within ``D`` seconds of its earliest
completion ``T`` (Eq. 1-2, :func:`~m2flow.scheduler.reward.jobs.earliest_completion`). The policy
picks per-stage worker counts ``N_j`` that minimise ``sum_j N_j * C_j`` subject to the extra
delay ``d = completion - T`` staying below ``D`` (Eq. 5):

- Algorithm 2 (section 5.2, :mod:`~m2flow.scheduler.reward.estimate`, re-exported here): the
  outstanding requests of each active batch, from its previous batch.
- :func:`search_workers` -- Algorithm 1 (section 5.1): stages sorted by worker cost ``C_j``
  descending (line 7); for each, a search between ``N_low = 1`` and ``N_high = B`` (line 9) for
  the fewest workers whose ``SIMULATE`` (:mod:`~m2flow.scheduler.reward.sim`) succeeds, the
  other stages at their current value (``B`` until searched, line 6). ``SIMULATE`` succeeds
  when every batch has ``d < D`` and, with the timeout-aware check (section 5.1, Figure 9), no
  request that waited at stage ``k`` and started at ``ts`` has ``LT = ts + sum_{j>=k} T_j >
  T + D``. (The extracted text reads "LT = ts + sum_{j=k}^M T_j" and "if LT > T + D ... SIMULATE
  immediately returns False"; ``ts`` is read as the last simulated time the request is still
  queued, its start.)
- :class:`DistRSPolicy` -- the decision made at each batch arrival and completion (section 5.2),
  with the variants the paper compares: EBF or FCFS, with or without the timeout-aware check
  ("history-based", section 6.3), and Ideal (the batches' true requests instead of history;
  :mod:`~m2flow.scheduler.reward.baselines`).

Deviations from the paper (each with the case that needs it):

- ``B`` with several batches is the number of simulated requests (all active batches), the
  paper's batch size generalised; the live service's ``max_workers`` caps ``N_high``.
- A batch that is already late (its zero-queue completion from now is at or past ``T + D``)
  fails ``d < D`` at every count, so Algorithm 1 as written returns ``N = B`` for every stage
  (e.g. one request that ran to its timeout makes the service start a worker per request). It
  is held to its zero-queue completion instead: it finishes as early as it still can.
- The search of each stage first probes ``N_j = 1, 2, 4, ...`` up to the first feasible count
  ``g`` and then binary-searches ``(g / 2, g]`` (``search="gallop"``; ``"binary"`` is lines 9-17
  as written). The paper assumes ``d`` decreases monotonically in ``N_j`` (section 5.1); then
  both find the same, smallest feasible count. With EBF and a tight stage already fixed it need
  not: fewer workers upstream can pace the requests into the tight stage better (a small case
  in tests/test_reward_paper.py: feasible at 1 and 3 workers, not at 2; the binary search
  returns 3). On the old benchmark's trace the binary search left the Ideal baseline at 726
  check workers where 50 were feasible. Galloping costs no more simulations: small counts fail
  within a few simulated requests.
- If the top probe (every stage at ``N_high``) already fails (caps), the search is skipped: the
  binary search would end at ``N_high`` anyway.
- Algorithm 2's own deviations (overdue requests, the cases the paper leaves open) are in
  :mod:`~m2flow.scheduler.reward.estimate`.
- A batch without history (a task's first batch) cannot be estimated: it gets
  ``cold_workers`` on top of the others' decision.
- With ``max_jobs``, when more requests are outstanding than that, every category is sampled
  down by one fraction ``f`` (at least one request of each non-empty category), the search
  runs on the sample with caps scaled by ``f``, and the counts are scaled back up by ``1 / f``
  (a fluid approximation: ``f`` of the requests on ``f`` of the workers see the same
  queueing). Counts then match the full simulation to within about ``1 / f`` workers per stage.

Pure Python + numpy: no Ray, no HTTP, no torch. Times are seconds; worker counts are integers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .estimate import (
    BatchView,
    batch_deadline,
    estimate,
    estimate_jobs,
    outstanding_counts,
    reference_records,
)
from .jobs import JobSet, RequestRecord, SimJob, earliest_completion
from .sim import Workload

__all__ = [
    "BatchView",
    "Decision",
    "DistRSPolicy",
    "batch_deadline",
    "estimate",
    "estimate_jobs",
    "outstanding_counts",
    "search_workers",
    "single_task_workers",
]


@dataclass
class Decision:
    """Result of a scaling decision.

    Attributes:
        workers: worker count per stage, ``N_j``.
        feasible: the constraint holds at these counts (False: capped, best effort).
        probes: ``SIMULATE`` calls of Algorithm 1.
        seconds: wall time of the decision.
        cost: ``sum_j N_j * C_j`` (Eq. 5's objective, in the units of ``C_j``).
        stage_seconds: per stage, the wall time of its binary search (Figure 15's split).
        simulated: per stage, the stage simulations actually run (the rest were cached or
            had nobody waiting).
    """

    workers: list[int]
    feasible: bool
    probes: int
    seconds: float = 0.0
    cost: float = 0.0
    stage_seconds: list[float] = field(default_factory=list)
    simulated: list[int] = field(default_factory=list)


def _limits(js: JobSet, bounds: dict, now_s: float) -> tuple[dict, dict]:
    """Per batch: the completion limit (``d < D``, or the zero-queue completion of a late
    batch) and the ``LT`` bound of the timeout-aware check."""
    zq = np.maximum(js.arrival, now_s)
    for k in range(js.times.shape[1]):  # the simulator's own sums (adding 0 changes nothing)
        zq = zq + js.times[:, k]
    zqb = np.full(len(js.keys), -np.inf)
    order = np.argsort(js.batch, kind="stable")
    cut = np.flatnonzero(np.diff(js.batch[order])) + 1
    zqb[js.batch[order[np.r_[0, cut]]]] = np.maximum.reduceat(zq[order], np.r_[0, cut])
    comp, lt = {}, {}
    for i, key in enumerate(js.keys):
        t, d = bounds[key]
        if zqb[i] < t + d:  # d < D (strict, as in the paper)
            comp[key], lt[key] = float(np.nextafter(t + d, -np.inf)), t + d
        else:  # late: as early as it still can
            comp[key] = lt[key] = float(zqb[i])
    return comp, lt


def search_workers(
    jobs: JobSet | Sequence[SimJob],
    bounds: dict,
    timeouts_s: Sequence[float],
    priority: dict | None,
    timeout_check: bool = True,
    caps: Sequence[int] | None = None,
    now_s: float = -math.inf,
    costs: Sequence[float] | None = None,
    search: str = "gallop",
) -> Decision:
    """Algorithm 1 (section 5.1): sequential binary search over per-stage worker counts.

    Args:
        jobs: the workload (:func:`estimate`, or a previous batch replayed).
        bounds: batch key -> ``(T, D)``: earliest completion (absolute seconds, Eq. 1-2) and
            the maximum tolerable extra delay (seconds).
        timeouts_s: per-stage timeouts ``T_j`` (seconds).
        priority: batch key -> EBF key, or ``None`` for FCFS.
        timeout_check: apply the timeout-aware check (``False``: the history-based variant).
        caps: most workers per stage (default: unbounded; ``N_high = min(B, cap)``).
        now_s: ``cur_ts`` (no simulated worker starts earlier).
        costs: ``C_j`` per stage (default: all 1); stages are searched by ``C_j`` descending,
            ties in pipeline order.
        search: ``"binary"`` -- lines 9-17 as written; ``"gallop"`` -- first probe 1, 2, 4,
            ... up to the first feasible count ``g``, then the binary search in ``(g / 2, g]``
            (module docstring: the same count whenever feasibility is monotone in ``N_j``).

    Returns:
        :class:`Decision`. With no job at all, zero workers everywhere (nothing to serve).

    Raises:
        ValueError: costs or caps not one per stage, or an unknown ``search``.
    """
    t0 = time.perf_counter()
    m = len(timeouts_s)
    if search not in ("binary", "gallop"):
        raise ValueError(f"search must be 'binary' or 'gallop', got {search!r}")
    costs = [1.0] * m if costs is None else [float(c) for c in costs]
    if len(costs) != m or (caps is not None and len(caps) != m):
        raise ValueError(f"give one cost and one cap per stage ({m} stages)")
    js = jobs if isinstance(jobs, JobSet) else JobSet.from_jobs(jobs, m)
    if not len(js):
        return Decision([0] * m, True, 0, time.perf_counter() - t0, 0.0, [0.0] * m, [0] * m)
    comp, lt = _limits(js, bounds, now_s)
    wl = Workload(js, timeouts_s, priority, now_s, comp, lt if timeout_check else None)
    n_b = len(js)  # B: every simulated request could be served at once
    hi = [max(1, min(n_b, c)) for c in caps] if caps is not None else [n_b] * m
    counts = list(hi)  # line 6
    probes = 1
    ok = wl.feasible(counts)
    stage_s = [0.0] * m
    for k in sorted(range(m), key=lambda j: -costs[j]):  # lines 7-8
        if not ok:
            break
        ts = time.perf_counter()
        lo, top = 1, hi[k]  # line 9
        g = 1
        while search == "gallop" and g < top:  # 1, 2, 4, ... up to the first feasible
            counts[k] = g
            probes += 1
            if wl.feasible(counts):
                top = g
                break
            lo, g = g + 1, 2 * g
        while lo < top:  # line 10
            counts[k] = (lo + top) // 2  # line 11
            probes += 1
            if wl.feasible(counts):  # lines 12-14
                top = counts[k]
            else:  # line 16
                lo = counts[k] + 1
        counts[k] = lo  # line 17
        stage_s[k] = time.perf_counter() - ts
    ok = wl.feasible(counts)
    cost = sum(n * c for n, c in zip(counts, costs))
    return Decision(
        counts, ok, probes, time.perf_counter() - t0, cost, stage_s, list(wl.stage_sims)
    )


class DistRSPolicy:
    """The DistRS scaling decision (Algorithm 2 + Algorithm 1), made at batch arrival and
    completion (section 5.2).

    Args:
        timeouts_s: per-stage timeouts ``T_j`` (seconds).
        ebf: Earliest-Batch-First (True) or FCFS (False), in the simulation as in the service.
        timeout_check: the timeout-aware check (False: history-based).
        caps: most workers per stage.
        cold_workers: per stage, the count used while an active batch has no history yet
            (its first batch): the policy cannot estimate it, so it provisions this much on
            top of the estimate of the others (default: the caps).
        max_jobs: most requests a decision simulates (``None``: all); beyond, a sample
            scaled up (module docstring), so one huge batch cannot make decisions slow.
        costs: ``C_j``, the cost of a worker of each stage (default: all 1).
        sampling: ``"random"`` (the paper's, seeded) or ``"quantile"`` (evenly spaced).
        seed: seed of the random sampling (decisions draw from one stream).
        search: Algorithm 1's per-stage search, ``"gallop"`` or ``"binary"``
            (:func:`search_workers`).

    Raises:
        ValueError: a timeout <= 0, ``max_jobs < 1``, an unknown sampling, or costs/caps not
            one per stage.
    """

    def __init__(
        self,
        timeouts_s: Sequence[float],
        ebf: bool = True,
        timeout_check: bool = True,
        caps: Sequence[int] | None = None,
        cold_workers: Sequence[int] | None = None,
        max_jobs: int | None = None,
        costs: Sequence[float] | None = None,
        sampling: str = "random",
        seed: int = 0,
        search: str = "gallop",
    ) -> None:
        m = len(timeouts_s)
        if any(t <= 0 for t in timeouts_s):
            raise ValueError(f"stage timeouts must be > 0 seconds, got {list(timeouts_s)}")
        if max_jobs is not None and max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1 (or None), got {max_jobs}")
        if sampling not in ("random", "quantile"):
            raise ValueError(f"sampling must be 'random' or 'quantile', got {sampling!r}")
        if search not in ("binary", "gallop"):
            raise ValueError(f"search must be 'binary' or 'gallop', got {search!r}")
        for name, v in (("costs", costs), ("caps", caps), ("cold_workers", cold_workers)):
            if v is not None and len(v) != m:
                raise ValueError(f"{name} has {len(v)} entries for {m} stages: give one each")
        self.max_jobs = max_jobs
        self.timeouts_s = list(timeouts_s)
        self.ebf = ebf
        self.timeout_check = timeout_check
        self.caps = list(caps) if caps is not None else None
        self.cold_workers = list(cold_workers) if cold_workers is not None else self.caps
        self.costs = list(costs) if costs is not None else [1.0] * m
        self.sampling = sampling
        self.search = search
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def priorities(views: Sequence[BatchView]) -> dict:
        """EBF key per batch (Eq. 1-2): its ``T``; batches without history go last."""
        return {v.key: batch_deadline(v) if reference_records(v) else math.inf for v in views}

    def estimate(self, views: Sequence[BatchView], now_s: float) -> tuple[JobSet, float]:
        """Algorithm 2 over the active batches with history: the jobs and the sampled fraction
        ``f`` of the outstanding requests they stand for (1: all of them)."""
        m = len(self.timeouts_s)
        known = [v for v in views if reference_records(v)]
        total = sum(sum(outstanding_counts(v, now_s, m)) for v in known)
        keep = 1.0
        if self.max_jobs is not None and total > self.max_jobs:
            keep = self.max_jobs / total
        rng = self.rng if self.sampling == "random" else None
        js = JobSet.concat([estimate(v, now_s, self.timeouts_s, keep, rng) for v in known], m)
        return js, (len(js) / total if keep < 1.0 else 1.0)

    def decide(self, views: Sequence[BatchView], now_s: float) -> Decision:
        """Worker counts per stage for the active batches ``views`` at ``cur_ts = now_s``."""
        t0 = time.perf_counter()
        m = len(self.timeouts_s)
        known = [v for v in views if reference_records(v)]
        cold = [v for v in views if not reference_records(v)]
        js, f = self.estimate(known, now_s)
        bounds = {v.key: (batch_deadline(v), v.delay_bound_s) for v in known}
        prio = self.priorities(known) if self.ebf else None
        caps = self.caps
        if f < 1.0 and caps is not None:
            caps = [max(1, math.ceil(c * f)) for c in caps]
        dec = search_workers(
            js,
            bounds,
            self.timeouts_s,
            prio,
            self.timeout_check,
            caps,
            now_s,
            self.costs,
            self.search,
        )
        if f < 1.0:
            dec.workers = [math.ceil(w / f) for w in dec.workers]
        if cold:
            extra = self.cold_workers or [max(v.size for v in cold)] * m
            dec.workers = [w + e for w, e in zip(dec.workers, extra)]
        if self.caps is not None:
            dec.workers = [min(w, c) for w, c in zip(dec.workers, self.caps)]
        dec.cost = sum(n * c for n, c in zip(dec.workers, self.costs))
        dec.seconds = time.perf_counter() - t0
        return dec


def single_task_workers(
    history: Sequence[RequestRecord],
    timeouts_s: Sequence[float],
    delay_bound_s: float,
    timeout_check: bool = True,
    caps: Sequence[int] | None = None,
    costs: Sequence[float] | None = None,
    search: str = "gallop",
) -> Decision:
    """Algorithm 1 for one task (section 5.1): worker counts for its next batch, simulated as
    a replay of its previous batch ``history`` from the batch start (FCFS; one batch).

    Returns:
        :class:`Decision` (counts per stage).
    """
    m = len(timeouts_s)
    jobs = [SimJob("batch", r.offset_s, 0, r.stage_s) for r in history]
    bounds = {"batch": (earliest_completion(0.0, history), delay_bound_s)} if history else {}
    return search_workers(
        JobSet.from_jobs(jobs, m), bounds, timeouts_s, None, timeout_check, caps, 0.0, costs, search
    )
