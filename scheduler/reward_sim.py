"""Reward-service queueing simulator and Earliest-Batch-First priority (DistRS, section 5).

DistRS (NSDI '26) scores RLVR responses in a multi-stage reward pipeline shared by several
training tasks. A request ``i`` of a batch arrives ``r_i`` seconds after the batch started and
spends ``s_ij`` seconds in stage ``j`` (one worker, one request at a time); a request that fails
or times out in stage ``j`` skips the later stages. The batch is done when its last request is.

This module is the simulator both scaling policies run (section 5.2, Algorithm 1 line "simulate
the schedule"): given per-stage worker counts and a queue discipline -- first-come-first-served
(FCFS) or Earliest-Batch-First (EBF, section 5.3) -- it computes every request's start and finish
per stage, each batch's completion, and the timeout-aware latest completion of queued requests.
Pure Python + heapq: no Ray, no HTTP, no torch. All times are seconds.

Stages form a tandem line with no feedback, so each stage is simulated in turn over all
requests: a stage's arrivals are the previous stage's finishes. That is exact for both FCFS and
non-preemptive priority queues with ``n`` identical workers.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestRecord:
    """One request of a finished batch, as the service recorded it (the history).

    Attributes:
        offset_s: arrival offset ``r_i`` after the batch start (seconds, >= 0).
        stage_s: time spent in each stage it entered, ``s_ij`` (seconds); shorter than the
            number of stages when the request failed or timed out in its last entry (a
            timed-out stage counts its timeout, the time the worker was held).
        failed: the request stopped (failure or timeout) in its last recorded stage.
    """

    offset_s: float
    stage_s: tuple[float, ...]
    failed: bool = False

    def __post_init__(self) -> None:
        if self.offset_s < 0 or any(s < 0 for s in self.stage_s):
            raise ValueError(f"negative time in {self}: offsets and stage times must be >= 0")
        if not self.stage_s:
            raise ValueError("a request record needs the time of at least one stage")

    @property
    def zq_finish_s(self) -> float:
        """Finish offset under zero queueing: ``r_i + sum_j s_ij`` (seconds)."""
        return self.offset_s + sum(self.stage_s)


def earliest_completion(start_s: float, records: Sequence[RequestRecord]) -> float:
    """Eq. 1 of DistRS: the batch's earliest completion ``T = t_b + max_i (r_i + sum_j s_ij)``.

    The zero-queueing completion of a batch that started at ``start_s`` and behaves like
    ``records`` (its previous batch, or the truth for the Ideal baseline). Seconds.

    Raises:
        ValueError: no records (a batch without history has no estimate; see the policies).
    """
    if not records:
        raise ValueError("earliest_completion needs at least one request record")
    return start_s + max(r.zq_finish_s for r in records)


def ebf_priority(start_s: float, records: Sequence[RequestRecord]) -> float:
    """Eq. 2 of DistRS as used here: the EBF key of a batch (smaller is served first).

    The batch's estimated earliest completion ``T`` (:func:`earliest_completion`), fixed
    when the batch is announced; requests of one batch are served FCFS. The same key orders
    the live queues and the policy's simulation, so the simulation predicts the service.
    """
    return earliest_completion(start_s, records)


@dataclass
class SimJob:
    """One request as the simulator sees it.

    Attributes:
        batch: key of its batch (any hashable).
        arrival_s: when it enters ``first_stage`` (absolute seconds).
        first_stage: the stage it waits for (or runs in, when ``running``).
        times_s: service time of ``first_stage`` and each later stage it will enter.
        running: it already holds a worker of ``first_stage`` since ``arrival_s`` (=
            now) and keeps it until done: ``times_s[0]`` is its remaining time there.
    """

    batch: object
    arrival_s: float
    first_stage: int
    times_s: tuple[float, ...]
    running: bool = False


@dataclass
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes:
        completion_s: per batch, the last finish time (seconds).
        latest_s: per batch, the largest timeout-aware latest completion ``LT = ts +
            sum_{j>=k} T_j`` over requests that waited in a queue (``-inf`` if none waited).
        finish_s: per job (input order), its finish time.
        busy_s: per stage, total service time (worker-seconds actually used).
    """

    completion_s: dict = field(default_factory=dict)
    latest_s: dict = field(default_factory=dict)
    finish_s: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)


def simulate(
    jobs: Sequence[SimJob],
    workers: Sequence[int],
    timeouts_s: Sequence[float],
    priority: dict | None = None,
    now_s: float = float("-inf"),
) -> SimResult:
    """Simulate ``jobs`` through the stages with fixed worker counts.

    Args:
        jobs: the requests (any order).
        workers: worker count per stage (>= 1 for every stage some job enters).
        timeouts_s: per-stage timeout ``T_j`` (seconds), for the timeout-aware check.
        priority: batch key -> EBF key (:func:`ebf_priority`); ``None`` serves FCFS (order of
            arrival at the stage). Within a batch, EBF is FCFS too.
        now_s: no worker starts before this time (jobs that queued before ``now_s`` keep
            their arrival time for FCFS order).

    Returns:
        :class:`SimResult`. Raises ValueError for a stage with jobs and no worker.
    """
    n_stages = len(workers)
    if len(timeouts_s) != n_stages:
        raise ValueError(f"{len(timeouts_s)} timeouts for {n_stages} stages: give one per stage")
    # tail[k] = sum_{j>=k} T_j
    tail = [0.0] * (n_stages + 1)
    for k in range(n_stages - 1, -1, -1):
        tail[k] = tail[k + 1] + timeouts_s[k]
    finish = [0.0] * len(jobs)
    # per stage: list of (arrival, job index, position in times_s)
    at_stage: list[list[tuple[float, int, int]]] = [[] for _ in range(n_stages)]
    for idx, job in enumerate(jobs):
        if job.first_stage + len(job.times_s) > n_stages:
            raise ValueError(f"job {idx} has more stage times than the pipeline has stages")
        at_stage[job.first_stage].append((job.arrival_s, idx, 0))
        finish[idx] = job.arrival_s
    res = SimResult(busy_s=[0.0] * n_stages)
    for k in range(n_stages):
        items = at_stage[k]
        if not items:
            continue
        if workers[k] < 1 and any(not (jobs[i].running and p == 0) for _, i, p in items):
            raise ValueError(f"stage {k} has requests but {workers[k]} workers: give it >= 1")
        # Running requests keep their workers (the service never preempts); if the pool
        # shrank below them, the first ones to finish retire their workers, as live.
        ends = []
        queued_items = []
        for arr, idx, pos in items:
            job = jobs[idx]
            if job.running and pos == 0:
                end = arr + job.times_s[0]
                ends.append(end)
                res.busy_s[k] += job.times_s[0]
                finish[idx] = end
                if len(job.times_s) > 1:
                    at_stage[k + 1].append((end, idx, 1))
            else:
                queued_items.append((arr, idx, pos))
        items = queued_items
        items.sort()
        ends.sort()
        free = ends[max(len(ends) - workers[k], 0) :]
        free += [now_s] * (workers[k] - len(free))
        heapq.heapify(free)
        waiting: list = []
        i, n = 0, len(items)
        for _ in range(n):
            t = heapq.heappop(free)
            if not waiting and items[i][0] > t:
                t = items[i][0]
            while i < n and items[i][0] <= t:
                arr, idx, pos = items[i]
                job = jobs[idx]
                if priority is None:
                    key = (arr, idx)
                else:
                    key = (priority[job.batch], arr, idx)
                heapq.heappush(waiting, (key, arr, idx, pos))
                i += 1
            _, arr, idx, pos = heapq.heappop(waiting)
            job = jobs[idx]
            start = max(t, arr)
            end = start + job.times_s[pos]
            heapq.heappush(free, end)
            res.busy_s[k] += job.times_s[pos]
            if start > arr:
                lt = start + tail[k]
                if lt > res.latest_s.get(job.batch, float("-inf")):
                    res.latest_s[job.batch] = lt
            if pos + 1 < len(job.times_s):
                at_stage[k + 1].append((end, idx, pos + 1))
            finish[idx] = end
    for idx, job in enumerate(jobs):
        b = job.batch
        if finish[idx] > res.completion_s.get(b, float("-inf")):
            res.completion_s[b] = finish[idx]
        res.latest_s.setdefault(b, float("-inf"))
    res.finish_s = finish
    return res


def zero_queue_completion(jobs: Sequence[SimJob], now_s: float = float("-inf")) -> dict:
    """Per batch, the completion with a free worker for every request from ``now_s`` on
    (seconds)."""
    out: dict = {}
    for job in jobs:
        f = max(job.arrival_s, now_s) + sum(job.times_s)
        if f > out.get(job.batch, float("-inf")):
            out[job.batch] = f
    return out


def peak_concurrency(
    jobs: Sequence[SimJob], n_stages: int, now_s: float = float("-inf")
) -> list[int]:
    """Per stage, the most requests in service at once under zero queueing: the worker count
    that makes queueing impossible (the upper end of the binary search, and ZQ-Dedicated's
    pool size). No request starts before ``now_s``."""
    events: list[list[tuple[float, int]]] = [[] for _ in range(n_stages)]
    for job in jobs:
        t = max(job.arrival_s, now_s)
        for pos, s in enumerate(job.times_s):
            k = job.first_stage + pos
            events[k].append((t, 1))
            events[k].append((t + s, -1))  # ends sort before starts at the same time
            t += s
    peaks = []
    for ev in events:
        ev.sort()
        cur = best = 0
        for _, d in ev:
            cur += d
            best = max(best, cur)
        peaks.append(best)
    return peaks
