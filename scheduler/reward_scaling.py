"""Reward-service scaling policies (DistRS, section 5): Algorithm 1, Algorithm 2, baselines.

The reward service is request-in, batch-out: a trainer only needs the whole batch's rewards, so
a request may wait as long as the batch still completes within ``D`` seconds of its earliest
completion ``T`` (Eq. 1, :func:`~m2flow.scheduler.reward_sim.earliest_completion`). The policies
pick the fewest workers per stage that keep that batch-level constraint ``d <= D``:

- :func:`search_workers` -- Algorithm 1: a sequential binary search over per-stage worker counts,
  stages by total cost descending; each probe simulates the workload (FCFS or EBF) and is
  feasible when every batch meets ``completion <= T + D`` and, with the timeout-aware check
  (section 5.2, Figure 9), no request that waited in a stage-``k`` queue and started at ``ts``
  has ``LT = ts + sum_{j>=k} T_j > T + D``.
- :func:`estimate_jobs` -- Algorithm 2: the outstanding work of every active batch from its
  previous batch's history: *Future* requests (not arrived yet; history requests with ``r_i``
  after the elapsed time), *Queuing_k* (waiting at stage ``k``) and *Running_k* (in service at
  stage ``k``, remaining time sampled from history stage times longer than the elapsed time).
- :class:`DistRSPolicy` -- the decision made at each batch arrival and completion, with the
  variants the paper compares: EBF or FCFS, with or without the timeout-aware check
  ("history-only"), and Ideal (the batch's true requests instead of history).
- :func:`zq_dedicated_workers` -- ZQ-Dedicated: each task's own pool, sized for zero queueing.

Sampling is deterministic (evenly spaced quantiles) so the same state gives the same decision.
A decision's cost is bounded: with ``max_jobs``, when the active batches hold more outstanding
requests than that, every category is sampled down by the same fraction ``f`` (at least one
request of each non-empty category), the search runs on the sample with caps scaled by ``f``,
and the counts are scaled back up by ``1 / f`` (a fluid approximation: ``f`` of the requests on
``f`` of the workers see the same queueing). Counts then match the full simulation to within
about ``1 / f`` workers per stage (tests/test_reward_policy.py measures it).
Pure Python: no Ray, no HTTP, no torch. Times are seconds; worker counts are integers.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .reward_sim import (
    RequestRecord,
    SimJob,
    earliest_completion,
    ebf_priority,
    peak_concurrency,
    simulate,
    zero_queue_completion,
)


@dataclass
class BatchView:
    """What the policy sees of one active batch.

    Attributes:
        key: the batch's identity (e.g. ``(task, batch_id)``).
        start_s: when the batch was announced (absolute seconds).
        size: announced number of requests (the trainer's hint).
        history: the task's previous batch (``r_i``, ``s_ij``); empty if none yet.
        delay_bound_s: the task's ``D`` (seconds).
        arrived: requests received so far.
        queued: ``(stage, request index, since)`` of requests waiting at ``stage`` since
            ``since`` (absolute seconds; keeps their FCFS order in the simulation).
        running: ``(stage, elapsed seconds, request index)`` of requests in service.
        truth: the batch's real requests by request index (Ideal only; ``None`` otherwise).
            Requests arrive in index order.
    """

    key: Hashable
    start_s: float
    size: int
    history: Sequence[RequestRecord]
    delay_bound_s: float
    arrived: int = 0
    queued: list[tuple[int, int, float]] = field(default_factory=list)
    running: list[tuple[int, float, int]] = field(default_factory=list)
    truth: Sequence[RequestRecord] | None = None


def _spread(pool: Sequence, n: int) -> list:
    """``n`` evenly spaced picks from ``pool`` (deterministic quantile sampling)."""
    if n <= 0 or not pool:
        return []
    m = len(pool)
    return [pool[min(m - 1, int((i + 0.5) * m / n))] for i in range(n)]


def _reference(view: BatchView) -> Sequence[RequestRecord]:
    return view.truth if view.truth is not None else view.history


def batch_deadline(view: BatchView) -> float:
    """``T`` of the batch (Eq. 1) from its reference records (truth or history), seconds."""
    return earliest_completion(view.start_s, _reference(view))


def outstanding(view: BatchView) -> int:
    """Requests of the batch still to finish: not arrived yet, queued, running."""
    return max(view.size - view.arrived, 0) + len(view.queued) + len(view.running)


def _keep(n: int, keep: float) -> int:
    return n if keep >= 1.0 else min(n, math.ceil(n * keep))


def estimate_jobs(view: BatchView, now_s: float, n_stages: int, keep: float = 1.0) -> list[SimJob]:
    """Algorithm 2 (DistRS section 5.2): the outstanding requests of one batch as sim jobs.

    - Future: ``size - arrived`` requests drawn from the history requests after the first
      ``arrived`` (by offset) whose offset is at least the elapsed time ``now - start`` (the
      elapsed-time condition), arriving at ``start + r_i`` (never before ``now``); if history
      holds fewer such requests, they are reused (evenly spaced picks).
    - Queuing_k: each waiting request takes the stage times from stage ``k`` on of a history
      request that reached stage ``k``.
    - Running_k: remaining time ``s_ik - elapsed`` from a history request with ``s_ik >
      elapsed``; if none ran that long, the request is assumed to run to its stage timeout
      (the caller passes that as history with the timeout recorded).

    With ``view.truth`` (Ideal), the real requests replace the samples. With ``keep < 1``,
    only ``ceil(keep * n)`` evenly spaced requests of each category (``n`` of them) are
    returned: the cost is that of the sample, not of the batch size.

    Raises:
        ValueError: the batch has neither history nor truth (no estimate possible).
    """
    ref = _reference(view)
    if not ref:
        raise ValueError(f"batch {view.key!r} has no history to estimate from")
    jobs: list[SimJob] = []
    elapsed = now_s - view.start_s
    exact = view.truth is not None
    # Future
    n_future = max(view.size - view.arrived, 0)
    n_keep = _keep(n_future, keep)
    if exact:
        future = list(ref[view.arrived : view.arrived + n_future])
        future = future if n_keep == len(future) else _spread(future, n_keep)
    else:
        by_offset = sorted(ref, key=lambda r: r.offset_s)
        # history requests not matched by an arrival yet, then the elapsed-time condition
        pool = by_offset[view.arrived :] or by_offset[-1:]
        late = [r for r in pool if r.offset_s >= elapsed] or pool[-1:]
        future = late if len(late) == n_keep else _spread(late, n_keep)
    for r in future:
        jobs.append(SimJob(view.key, max(view.start_s + r.offset_s, now_s), 0, r.stage_s))
    # Queuing_k
    reached = [[r for r in ref if len(r.stage_s) > k] for k in range(n_stages)]
    by_stage: dict[int, list[tuple[int, float]]] = {}
    for k, idx, since in view.queued:
        by_stage.setdefault(k, []).append((idx, since))
    for k, items in by_stage.items():
        items.sort(key=lambda x: x[1])
        items = _spread(items, _keep(len(items), keep)) if keep < 1.0 else items
        if exact:
            picks = [ref[i] for i, _ in items]
        else:
            picks = _spread(reached[k] or ref, len(items))
        for r, (_, since) in zip(picks, items):
            times = r.stage_s[k:] or (r.stage_s[-1],)
            jobs.append(SimJob(view.key, min(since, now_s), k, times))
    # Running_k
    running = view.running if keep >= 1.0 else _spread(view.running, _keep(len(view.running), keep))
    for k, el, idx in running:
        if exact:
            r = ref[idx]
            times = r.stage_s[k:] or (el,)
            rem = max(times[0] - el, 0.0)
        else:
            longer = sorted(
                (r for r in reached[k] if r.stage_s[k] > el), key=lambda r: r.stage_s[k]
            )
            if longer:
                r = longer[len(longer) // 2]  # the conditional median
                times = r.stage_s[k:]
                rem = times[0] - el
            else:
                times, rem = (el,), 0.0
        jobs.append(SimJob(view.key, now_s, k, (rem, *times[1:]), running=True))
    return jobs


@dataclass
class Decision:
    """Result of a scaling decision.

    Attributes:
        workers: worker count per stage.
        feasible: the constraint holds at these counts (False: capped, best effort).
        probes: simulations run.
        seconds: wall time of the decision.
    """

    workers: list[int]
    feasible: bool
    probes: int
    seconds: float = 0.0


def search_workers(
    jobs: Sequence[SimJob],
    bounds: dict,
    timeouts_s: Sequence[float],
    priority: dict | None,
    timeout_check: bool = True,
    caps: Sequence[int] | None = None,
    now_s: float = float("-inf"),
) -> Decision:
    """Algorithm 1 (DistRS section 5.2): sequential binary search over per-stage counts.

    Stages are searched by total work ``sum_i s_ij`` descending. While a stage is searched,
    the stages not decided yet keep their upper bound (zero queueing: the peak concurrency,
    capped by ``caps``). The smallest count whose simulation is feasible is kept.

    Args:
        jobs: the workload (:func:`estimate_jobs` or a history replayed from now).
        bounds: batch key -> ``(T, D)``: earliest completion (absolute seconds, Eq. 1) and
            delay bound (seconds). A batch whose zero-queue completion in ``jobs`` is already
            past ``T + D`` (it runs late) is held to that zero-queue completion instead: it
            finishes as early as it still can, without demanding more than that.
        timeouts_s: per-stage timeouts ``T_j`` (seconds).
        priority: batch key -> EBF key, or ``None`` for FCFS.
        timeout_check: apply the timeout-aware check (``False``: the history-only variant).
        caps: most workers per stage (default: unbounded).
        now_s: the decision time (no simulated worker starts earlier).

    Returns:
        :class:`Decision`; stages no job enters get 0 workers.
    """
    import time

    t0 = time.perf_counter()
    n_stages = len(timeouts_s)
    peaks = peak_concurrency(jobs, n_stages, now_s)
    work = [0.0] * n_stages
    for job in jobs:
        for pos, s in enumerate(job.times_s):
            work[job.first_stage + pos] += s
    used = [0] * n_stages
    for job in jobs:
        for pos in range(len(job.times_s)):
            used[job.first_stage + pos] = 1
    hi = [max(p, u) for p, u in zip(peaks, used)]
    if caps is not None:
        hi = [min(h, max(c, u)) for h, c, u in zip(hi, caps, used)]
    zq = zero_queue_completion(jobs, now_s)
    limit = {b: max(t + d, zq.get(b, t)) for b, (t, d) in bounds.items()}
    probes = 0

    def feasible(counts: list[int]) -> bool:
        nonlocal probes
        probes += 1
        res = simulate(jobs, counts, timeouts_s, priority, now_s)
        for b, c in res.completion_s.items():
            if c > limit[b] + 1e-9:
                return False
            if timeout_check and res.latest_s[b] > limit[b] + 1e-9:
                return False
        return True

    counts = list(hi)
    order = sorted(range(n_stages), key=lambda k: -work[k])
    ok = feasible(counts) if jobs else True
    for k in order:
        if not used[k] or not ok:
            continue
        lo, top = 1, counts[k]
        while lo < top:
            mid = (lo + top) // 2
            counts[k] = mid
            if feasible(counts):
                top = mid
            else:
                lo = mid + 1
        counts[k] = top
    return Decision(counts, ok, probes, time.perf_counter() - t0)


class DistRSPolicy:
    """The DistRS scaling decision (Algorithm 2 + Algorithm 1), made at batch arrival and
    completion (section 5.2).

    Args:
        timeouts_s: per-stage timeouts ``T_j`` (seconds).
        ebf: Earliest-Batch-First (True) or FCFS (False), in the simulation as in the service.
        timeout_check: the timeout-aware check (False: history-only).
        caps: most workers per stage.
        cold_workers: per stage, the count used while an active batch has no history yet
            (its first batch): the policy cannot estimate it, so it provisions this much on
            top of the estimate of the others (default: the caps).
        max_jobs: most requests a decision simulates (``None``: all); beyond, a sample
            scaled up (module docstring), so one huge batch cannot make decisions slow.
    """

    def __init__(
        self,
        timeouts_s: Sequence[float],
        ebf: bool = True,
        timeout_check: bool = True,
        caps: Sequence[int] | None = None,
        cold_workers: Sequence[int] | None = None,
        max_jobs: int | None = None,
    ) -> None:
        if any(t <= 0 for t in timeouts_s):
            raise ValueError(f"stage timeouts must be > 0 seconds, got {list(timeouts_s)}")
        if max_jobs is not None and max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1 (or None), got {max_jobs}")
        self.max_jobs = max_jobs
        self.timeouts_s = list(timeouts_s)
        self.ebf = ebf
        self.timeout_check = timeout_check
        self.caps = list(caps) if caps is not None else None
        self.cold_workers = list(cold_workers) if cold_workers is not None else self.caps

    @staticmethod
    def priorities(views: Sequence[BatchView]) -> dict:
        """EBF key per batch (Eq. 2): its ``T``; batches without history go last."""
        return {
            v.key: ebf_priority(v.start_s, _reference(v)) if _reference(v) else math.inf
            for v in views
        }

    def decide(self, views: Sequence[BatchView], now_s: float) -> Decision:
        """Worker counts per stage for the active batches ``views`` at time ``now_s``."""
        n = len(self.timeouts_s)
        known = [v for v in views if _reference(v)]
        cold = [v for v in views if not _reference(v)]
        jobs: list[SimJob] = []
        bounds: dict = {}
        total = sum(outstanding(v) for v in known)
        keep = 1.0
        if self.max_jobs is not None and total > self.max_jobs:
            keep = self.max_jobs / total
        for v in known:
            jobs += estimate_jobs(v, now_s, n, keep)
            bounds[v.key] = (batch_deadline(v), v.delay_bound_s)
        prio = self.priorities(known) if self.ebf else None
        caps = self.caps
        f = len(jobs) / total if keep < 1.0 else 1.0  # the sample's real fraction
        if f < 1.0 and caps is not None:
            caps = [max(1, math.ceil(c * f)) for c in caps]
        dec = search_workers(jobs, bounds, self.timeouts_s, prio, self.timeout_check, caps, now_s)
        if f < 1.0:
            dec.workers = [math.ceil(w / f) for w in dec.workers]
            if self.caps is not None:
                dec.workers = [min(w, c) for w, c in zip(dec.workers, self.caps)]
        if cold:
            extra = self.cold_workers or [max(v.size for v in cold)] * n
            dec.workers = [w + e for w, e in zip(dec.workers, extra)]
            if self.caps is not None:
                dec.workers = [min(w, c) for w, c in zip(dec.workers, self.caps)]
        return dec


def single_task_workers(
    history: Sequence[RequestRecord],
    timeouts_s: Sequence[float],
    delay_bound_s: float,
    timeout_check: bool = True,
    caps: Sequence[int] | None = None,
    now_s: float = float("-inf"),
) -> Decision:
    """Algorithm 1 for one task: worker counts for its next batch, simulated as a replay of
    its previous batch ``history`` (FCFS; one batch, so EBF is the same).

    Returns:
        :class:`Decision` (counts per stage).
    """
    view = BatchView("batch", 0.0, len(history), history, delay_bound_s)
    return DistRSPolicy(timeouts_s, ebf=False, timeout_check=timeout_check, caps=caps).decide(
        [view], 0.0
    )


def zq_dedicated_workers(batches: Sequence[Sequence[RequestRecord]], n_stages: int) -> list[int]:
    """ZQ-Dedicated baseline: a task's own pool, sized so no request of any of its batches ever
    queues (the per-stage peak concurrency under zero queueing, max over batches)."""
    best = [0] * n_stages
    for records in batches:
        jobs = [SimJob(0, r.offset_s, 0, r.stage_s) for r in records]
        best = [max(a, b) for a, b in zip(best, peak_concurrency(jobs, n_stages))]
    return best
