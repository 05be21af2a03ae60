"""Reward-service queueing simulator (DistRS, section 5): Algorithm 1's ``SIMULATE``.

DistRS (NSDI '26) scores RLVR responses in a multi-stage reward pipeline shared by several
training tasks; the request model (``r_i``, ``s_ij``, Eq. 1-2) is in
:mod:`~m2flow.scheduler.reward.jobs` (re-exported here). The batch is done when its last
request is.

This module is the ``SIMULATE`` function of Algorithm 1 (section 5.1, line 12): given per-stage
worker counts and a queue discipline -- first-come-first-served (FCFS) or Earliest-Batch-First
(EBF, section 5.2, "Scheduling policy") -- it computes every request's start and finish per
stage, each batch's completion, and the timeout-aware latest completion ``LT`` of requests that
waited (section 5.1). Pure Python + numpy: no Ray, no HTTP, no torch. All times are seconds.

Stages form a tandem line with no feedback, so each stage is simulated in turn over all
requests: a stage's arrivals are the previous stage's finishes. That is exact for both FCFS and
non-preemptive priority queues with ``n`` identical workers. :class:`Workload` keeps the jobs as
arrays and caches each stage's outcome by the worker counts of the stages up to it, so the
binary search's probes re-simulate only the stages whose input changed; a stage with at least as
many workers as its zero-queue peak concurrency is not simulated at all (nobody waits).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .jobs import JobSet, RequestRecord, SimJob, earliest_completion, ebf_priority

__all__ = [
    "JobSet",
    "RequestRecord",
    "SimJob",
    "SimResult",
    "Workload",
    "earliest_completion",
    "ebf_priority",
    "peak_concurrency",
    "simulate",
    "zero_queue_completion",
]


@dataclass
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes:
        completion_s: per batch, the last finish time (seconds).
        latest_s: per batch, the largest timeout-aware latest completion ``LT = ts +
            sum_{j>=k} T_j`` over requests that waited in a queue (``-inf`` if none waited);
            ``ts`` is the last simulated time at which the request is still queued, its start.
        finish_s: per job (input order), its finish time.
        busy_s: per stage, total service time (worker-seconds actually used).
    """

    completion_s: dict = field(default_factory=dict)
    latest_s: dict = field(default_factory=dict)
    finish_s: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)


def _serve(arr, svc, groups, free, p0, qthr, lim, tail, fthr):
    """One stage's queue from position ``p0`` on; returns the start times, or ``None``.

    Args:
        arr, svc: arrival and service seconds per position (lists; positions sorted by
            arrival, then queue key). Positions before ``p0`` start on arrival (the caller
            found that nobody waits before ``p0``); ``free`` holds the workers' free times
            then (a heap of the worker count).
        groups: EBF -- per priority group (best first) its positions in order; ``None`` for
            FCFS (jobs start in position order).
        qthr, lim, tail, fthr: a job that waits and starts at ``ts`` with ``ts + tail >
            lim[p]`` (the timeout-aware check) or finishes after ``fthr[p]`` (its batch
            cannot finish in time) makes the stage infeasible: ``None`` at once (section 5.1:
            "SIMULATE immediately returns False"). ``qthr[p]`` is a start time below which
            neither can happen (a cheap pre-test).
    """
    n = len(arr)
    start = list(arr)
    replace = heapq.heapreplace
    if groups is None:  # FCFS with identical workers: jobs start in arrival order
        for p in range(p0, n):
            t = free[0]
            a = arr[p]
            if a >= t:
                replace(free, a + svc[p])
                continue
            if t > qthr[p] and (t + tail > lim[p] or t + svc[p] > fthr[p]):
                return None
            start[p] = t
            replace(free, t + svc[p])
        return start
    # EBF: a group's waiting requests form a FIFO, its head the next it serves. ``ready``:
    # groups whose head has arrived (best first); ``pending``: (head arrival, group) of others
    push, pop = heapq.heappush, heapq.heappop
    heads = [bisect.bisect_left(g, p0) for g in groups]
    ends = [len(g) for g in groups]
    pending = [(arr[g[h]], i) for i, (g, h) in enumerate(zip(groups, heads)) if h < len(g)]
    heapq.heapify(pending)
    inf = math.inf
    pnext = pending[0][0] if pending else inf  # the next head arrival of a pending group
    ready: list[int] = []
    while ready or pending:
        t = free[0]
        while pnext <= t:
            push(ready, pop(pending)[1])
            pnext = pending[0][0] if pending else inf
        if not ready:  # nobody waits: the earliest arrival (best group on ties) starts
            a, g = pending[0]
            h = heads[g]
            replace(free, a + svc[groups[g][h]])
            heads[g] = h = h + 1
            if h < ends[g]:
                heapq.heapreplace(pending, (arr[groups[g][h]], g))
            else:
                pop(pending)
            pnext = pending[0][0] if pending else inf
            continue
        g = ready[0]
        order, h, end = groups[g], heads[g], ends[g]
        q = order[h]
        while True:  # serve the best ready group until it empties or another group arrives
            if t > qthr[q] and t > arr[q] and (t + tail > lim[q] or t + svc[q] > fthr[q]):
                return None
            start[q] = t
            replace(free, t + svc[q])
            h += 1
            if h == end:
                pop(ready)
                break
            t = free[0]
            q = order[h]
            if arr[q] > t:  # its next has not arrived when a worker frees
                pop(ready)
                push(pending, (arr[q], g))
                pnext = pending[0][0]
                break
            if pnext <= t:
                break
        heads[g] = h
    return start


class Workload:
    """A set of jobs simulated under many worker counts (Algorithm 1's probes).

    Args:
        jobs: the jobs (:class:`JobSet`, or :class:`SimJob` list).
        timeouts_s: per-stage timeout ``T_j`` (seconds).
        priority: batch key -> EBF key (smaller first); ``None`` serves FCFS (order of
            arrival at the stage). Within a batch, EBF is FCFS too; ties by input order.
        now_s: no worker starts before this time.
        limits: batch key -> the latest allowed completion (absolute seconds) for
            :meth:`feasible`: a probe fails when a batch finishes after its limit.
        lt_limits: batch key -> the bound on ``LT`` of the timeout-aware check (``None``: no
            check, the history-only variant).

    Raises:
        ValueError: timeouts not one per stage.
    """

    def __init__(
        self,
        jobs: JobSet | Sequence[SimJob],
        timeouts_s: Sequence[float],
        priority: dict | None = None,
        now_s: float = -math.inf,
        limits: dict | None = None,
        lt_limits: dict | None = None,
    ) -> None:
        m = len(timeouts_s)
        js = jobs if isinstance(jobs, JobSet) else JobSet.from_jobs(jobs, m)
        if js.times.shape[1] != m:
            raise ValueError(f"{len(timeouts_s)} timeouts for {js.times.shape[1]} stages")
        self.js, self.m, self.now = js, m, now_s
        # tail[k] = sum_{j>=k} T_j: the latest a request entering stage k can take
        self.tail = [float(sum(timeouts_s[k:])) for k in range(m)]
        nb = len(js.keys)
        self.grade = None  # per job, the rank of its batch's EBF key (equal keys share one)
        if priority is not None:
            prio = np.array([priority[k] for k in js.keys], float).reshape(nb)
            self.grade = np.unique(prio, return_inverse=True)[1].reshape(nb)[js.batch]
        inf = np.full(nb, np.inf)
        lim = np.array([limits[k] for k in js.keys], float) if limits else inf
        lt = np.array([lt_limits[k] for k in js.keys], float) if lt_limits else inf
        self.lim_job = lim[js.batch] if nb else np.zeros(0)
        self.lt_job = lt[js.batch] if nb else np.zeros(0)
        # completion lower bound after stage k: + the service of the later stages
        later = np.cumsum(js.times[:, ::-1], axis=1)[:, ::-1]
        self.rest = np.concatenate([later[:, 1:], np.zeros((len(js), 1))], axis=1)
        self.last = m - 1 - np.argmax(js.enters[:, ::-1], axis=1) if len(js) else js.first
        self.idx = [np.nonzero(js.enters[:, k])[0] for k in range(m)]
        # the first stage's arrivals never depend on a probe
        self.arr0 = np.maximum(js.arrival, now_s) if len(js) else js.arrival
        self._inputs: dict = {}
        self._outputs: dict = {(): (self.arr0.copy(), None, None)}
        self._final: dict = {}
        self.stage_sims = [0] * m  # real simulations run per stage (the rest were cached)

    # ---- one stage ---------------------------------------------------------------------------
    def _stage_input(self, k: int, prefix: tuple, fin: np.ndarray) -> dict:
        """What stage ``k`` sees after the stages in ``prefix``: its requests in queue order,
        the zero-queue prefix bound and the check thresholds (cached per prefix)."""
        key = (k, prefix)
        got = self._inputs.get(key)
        if got is not None:
            return got
        js = self.js
        idx = self.idx[k]
        run = js.running[idx] & (js.first[idx] == k)
        ridx = idx[run]
        arr_all = np.where(js.first[idx] == k, self.arr0[idx], fin[idx])
        svc_all = js.times[idx, k]
        # a 0 s stage needs no worker (the paper records skipped stages as 0 s)
        work = ~run & (svc_all > 0)
        zidx, zarr = idx[~run & ~work], arr_all[~run & ~work]
        qidx, arr, svc = idx[work], arr_all[work], svc_all[work]
        order = np.lexsort((qidx, arr) if self.grade is None else (qidx, self.grade[qidx], arr))
        pos, arr, svc = qidx[order], arr[order], svc[order]
        groups = None
        if self.grade is not None:  # EBF: positions of each priority level, best first
            g = self.grade[pos]
            by = np.argsort(g, kind="stable")
            groups = np.split(by, np.flatnonzero(np.diff(g[by])) + 1) if len(by) else []
        ends = np.sort(self.now + js.times[ridx, k])
        # busy[p]: requests in service when position p arrives under zero queueing (ends at
        # that instant free their worker); the first p with busy >= c is the first to wait
        job_ends = np.sort(arr + svc)
        busy = (
            np.arange(len(arr))
            - np.searchsorted(job_ends, arr, "right")
            + len(ends)
            - np.searchsorted(ends, arr, "right")
        )
        reach = np.maximum.accumulate(busy) if len(arr) else busy
        lim = self.lim_job[pos]
        fthr = np.where(self.last[pos] == k, lim, lim + 1e-9) - self.rest[pos, k]
        got = {
            "pos": pos,
            "arr": arr,
            "svc": svc,
            "ridx": ridx,
            "zidx": zidx,
            "zarr": zarr,
            "ends": ends,
            "reach": reach,
            # with this many workers nobody waits
            "peak": max(int(reach[-1]) + 1 if len(arr) else 0, len(ends), 1),
            "groups": None if groups is None else [g.tolist() for g in groups],
            "lists": None,
            "lt": self.lt_job[pos],
            "fthr": fthr,
        }
        self._inputs[key] = got
        return got

    def _run_stage(self, k: int, c: int, inp: dict, fin: np.ndarray, check: bool):
        """Finish times after stage ``k`` with ``c`` workers (a copy of ``fin``) and the start
        times in queue order (``None`` if nobody waited); ``None`` when infeasible."""
        pos, arr, svc = inp["pos"], inp["arr"], inp["svc"]
        n = len(pos)
        if c < 1 and n:
            raise ValueError(f"stage {k} has requests but {c} workers: give it >= 1")
        out = fin.copy()
        ridx = inp["ridx"]
        out[ridx] = self.now + self.js.times[ridx, k]
        out[inp["zidx"]] = inp["zarr"]
        p0 = int(np.searchsorted(inp["reach"], c)) if n else 0
        if p0 >= n:  # nobody waits: vectorised
            out[pos] = arr + svc
            return out, None
        self.stage_sims[k] += 1
        # the workers' free times when p0 arrives: the c latest ends so far (running
        # requests keep their workers; if the pool shrank below them, the first to finish
        # retire their workers, as live); idle workers are free since now
        seen = np.concatenate([inp["ends"], arr[:p0] + svc[:p0]])
        if len(seen) > c:
            seen = np.partition(seen, len(seen) - c)[len(seen) - c :]
        free = seen.tolist() + [self.now] * (c - len(seen))
        heapq.heapify(free)
        if inp["lists"] is None:
            lt, fthr, tail = inp["lt"], inp["fthr"], self.tail[k]
            # a start time below which neither check can fail (1 us under, for rounding)
            qthr = np.minimum(lt - tail, fthr - svc) - 1e-6
            inp["lists"] = [x.tolist() for x in (arr, svc, qthr, lt, fthr)]
        arr_l, svc_l, qthr, lim, fthr = inp["lists"]
        if not check:
            qthr = lim = fthr = [math.inf] * n
        start = _serve(arr_l, svc_l, inp["groups"], free, p0, qthr, lim, self.tail[k], fthr)
        if start is None:
            return None
        start = np.array(start)
        out[pos] = start + svc
        return out, start

    def _stage(self, k: int, prefix: tuple, c: int):
        """Stage ``k`` after the stages in ``prefix`` (their canonical counts), checked and
        cached: ``(key, (finish times, starts, input))``, or ``(key, None)`` if infeasible."""
        fin = self._outputs[prefix][0]
        if not len(self.idx[k]):
            key = (*prefix, 0)  # no job enters: the count does not matter
            self._outputs.setdefault(key, (fin, None, None))
            return key, self._outputs[key]
        inp = self._stage_input(k, prefix, fin)
        c = min(c, inp["peak"])  # every count >= the peak gives the same schedule
        key = (*prefix, c)
        if key not in self._outputs:
            got = self._run_stage(k, c, inp, fin, True)
            self._outputs[key] = None if got is None else (got[0], got[1], inp)
        return key, self._outputs[key]

    def zero_queue_peaks(self) -> list[int]:
        """Per stage, the zero-queue peak concurrency: the fewest workers with which no
        request waits (0 for a stage no job enters). The ZQ baselines' pool size."""
        prefix: tuple = ()
        out = []
        for k in range(self.m):
            fin = self._outputs[prefix][0]
            peak = self._stage_input(k, prefix, fin)["peak"] if len(self.idx[k]) else 0
            out.append(peak)
            prefix, _ = self._stage(k, prefix, peak)
        return out

    # ---- probes ------------------------------------------------------------------------------
    def feasible(self, counts: Sequence[int]) -> bool:
        """Algorithm 1's ``SIMULATE(Num, R, S, D)``: every batch within its limit and, with
        ``lt_limits``, no waiting request with ``LT`` over it. Cached by counts."""
        prefix: tuple = ()
        got = self._outputs[prefix]
        for k in range(self.m):
            prefix, got = self._stage(k, prefix, counts[k])
            if got is None:
                return False
        ok = self._final.get(prefix)
        if ok is None:  # exact completion test (the per-stage test has a 1e-9 s margin)
            ok = self._final[prefix] = not bool((got[0] > self.lim_job).any())
        return ok

    def run(self, counts: Sequence[int]) -> SimResult:
        """The full schedule with ``counts`` workers per stage (no early exit).

        Raises:
            ValueError: counts not one per stage, or a stage with requests and no worker.
        """
        if len(counts) != self.m:
            raise ValueError(f"{len(counts)} worker counts for {self.m} stages")
        js = self.js
        nb = len(js.keys)
        lt = np.full(nb, -np.inf)
        fin = self.arr0.copy()
        for k in range(self.m):
            if not len(self.idx[k]):
                continue
            inp = self._stage_input(k, ("run", *counts[:k]), fin)
            got = self._run_stage(k, max(0, counts[k]), inp, fin, False)
            fin, start = got
            if start is not None:
                waited = start > inp["arr"]
                b = js.batch[inp["pos"][waited]]
                np.maximum.at(lt, b, start[waited] + self.tail[k])
        res = SimResult(busy_s=[float(js.times[:, k].sum()) for k in range(self.m)])
        comp = np.full(nb, -np.inf)
        np.maximum.at(comp, js.batch, fin)
        res.completion_s = {key: float(comp[i]) for i, key in enumerate(js.keys)}
        res.latest_s = {key: float(lt[i]) for i, key in enumerate(js.keys)}
        res.finish_s = fin.tolist()
        return res


def simulate(
    jobs: Sequence[SimJob] | JobSet,
    workers: Sequence[int],
    timeouts_s: Sequence[float],
    priority: dict | None = None,
    now_s: float = -math.inf,
) -> SimResult:
    """Simulate ``jobs`` through the stages with fixed worker counts.

    Args:
        jobs: the requests (any order).
        workers: worker count per stage (>= 1 for every stage some waiting job enters).
        timeouts_s: per-stage timeout ``T_j`` (seconds), for the timeout-aware ``LT``.
        priority: batch key -> EBF key (:func:`ebf_priority`); ``None`` serves FCFS (order of
            arrival at the stage). Within a batch, EBF is FCFS too; ties go by input order.
        now_s: no worker starts before this time; a job that arrived earlier enters at
            ``now_s`` (Algorithm 2: requests already in the service arrive at ``cur_ts``).

    Returns:
        :class:`SimResult`.

    Raises:
        ValueError: timeouts or counts not one per stage, a stage with jobs and no worker, or a
            job with more stage times than the pipeline has stages.
    """
    if len(timeouts_s) != len(workers):
        raise ValueError(
            f"{len(timeouts_s)} timeouts for {len(workers)} stages: give one per stage"
        )
    return Workload(jobs, timeouts_s, priority, now_s).run(list(workers))


def zero_queue_completion(jobs: Sequence[SimJob], now_s: float = -math.inf) -> dict:
    """Per batch, its completion with a free worker for every request from ``now_s`` on
    (Eq. 1-2 evaluated from the current state; seconds)."""
    out: dict = {}
    for job in jobs:
        f = max(job.arrival_s, now_s)
        for s in job.times_s:
            f += s
        if f > out.get(job.batch, -math.inf):
            out[job.batch] = f
    return out


def peak_concurrency(jobs: Sequence[SimJob], n_stages: int, now_s: float = -math.inf) -> list[int]:
    """Per stage, the most requests in service at once under zero queueing: the worker count
    that makes queueing impossible (ZQ's pool size). No request starts before ``now_s``."""
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
