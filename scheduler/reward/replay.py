"""Trace replay of a shared, elastic reward service (DistRS evaluation, section 6).

Where :mod:`~m2flow.scheduler.reward.sim` simulates a *fixed* allocation to score one candidate,
this replays a whole multi-tenant run with the allocation *changing*: tenants announce batches,
requests arrive at ``start + r_i``, stage queues serve EBF or FCFS, and at every batch arrival and
completion a policy (e.g. :class:`~m2flow.scheduler.reward.scaling.DistRSPolicy`) resets the
per-stage worker counts. Batches follow each other as in the paper's two training architectures
(section 6.1, "Workload"):

- *colocated*: the next batch starts ``train_s`` after the previous batch's last reward (the
  trainer waits for the batch), so extra delay pushes the tenant's whole run, and the service
  sees idle gaps between batches;
- *disaggregated* with one-step staleness: rollout is continuous on resources of its own, so
  batch ``i + 1`` starts when batch ``i``'s rollout ends (its last request arrives), but not
  before the trainer has finished training on batch ``i - 1`` (the weights batch ``i + 1`` is
  generated with); training on batch ``i`` starts when its last reward is in and the previous
  training step is done, and takes ``train_s``.

A stage time of 0 s (the paper records stages a request skips as 0 s, section 3.1) needs no
worker, in the replay as in the simulation. Scaling mechanics match the live service: a
scale-up starts workers that serve after ``cold_start_s``; a scale-down retires idle (or still
starting) workers at once and busy ones when their request finishes (running requests are never
killed by scaling). Worker-time is the integral of allocated workers (starting, idle or busy)
per stage. Pure Python; seconds.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .scaling import BatchView, Decision
from .sim import RequestRecord, ebf_priority


@dataclass
class TenantTrace:
    """One training task's workload.

    Attributes:
        name: tenant name.
        start_s: when its first batch is announced (seconds).
        batches: the real requests of each batch (any order; replay sorts by offset).
        warmup: the history the first batch is planned from (e.g. a profiling batch).
        train_s: trainer time of one training step (seconds).
        delay_bound_s: the tenant's ``D`` (seconds).
        mode: ``"colocated"`` or ``"disaggregated"`` (one-step staleness; module doc).
    """

    name: str
    start_s: float
    batches: list[list[RequestRecord]]
    warmup: list[RequestRecord]
    train_s: float
    delay_bound_s: float
    mode: str = "colocated"

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"mode must be 'colocated' or 'disaggregated', got {self.mode!r}")


@dataclass
class BatchOutcome:
    """Per-batch result: start, zero-queue earliest completion ``T``, completion (seconds)."""

    tenant: str
    index: int
    start_s: float
    earliest_s: float
    completion_s: float

    @property
    def extra_delay_s(self) -> float:
        """``d = completion - T`` (seconds, >= 0)."""
        return self.completion_s - self.earliest_s


@dataclass
class ReplayResult:
    """Outcome of :func:`replay`: per-batch outcomes, worker-seconds per stage, decisions,
    and the allocation over time (``timeline``: ``(time, workers per stage)`` after each
    decision)."""

    batches: list[BatchOutcome] = field(default_factory=list)
    worker_s: list[float] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    decisions: int = 0
    decision_s: list[float] = field(default_factory=list)
    peak_workers: list[int] = field(default_factory=list)
    requests_done: int = 0
    end_s: float = 0.0
    timeline: list[tuple[float, list[int]]] = field(default_factory=list)

    def merge(self, other: ReplayResult) -> None:
        """Add ``other`` (another pool) to this result: worker time and peaks add up."""
        self.batches += other.batches
        self.worker_s = [a + b for a, b in zip(self.worker_s, other.worker_s)] or other.worker_s
        self.busy_s = [a + b for a, b in zip(self.busy_s, other.busy_s)] or other.busy_s
        self.peak_workers = [
            a + b for a, b in zip(self.peak_workers, other.peak_workers)
        ] or other.peak_workers
        self.decisions += other.decisions
        self.decision_s += other.decision_s
        self.requests_done += other.requests_done
        self.end_s = max(self.end_s, other.end_s)


class _Batch:
    def __init__(self, tenant: int, index: int, start: float, records, history, bound, prio):
        self.tenant, self.index, self.start = tenant, index, start
        self.records = sorted(records, key=lambda r: r.offset_s)
        self.history, self.bound, self.prio = history, bound, prio
        self.arrived = self.done = 0
        self.state: dict[int, tuple] = {}  # idx -> ("q"|"r", stage, since)


def replay(
    tenants: Sequence[TenantTrace],
    timeouts_s: Sequence[float],
    decide: Callable[[list[BatchView], float], Decision],
    ebf: bool = True,
    oracle: bool = False,
    cold_start_s: float = 0.0,
) -> ReplayResult:
    """Replay ``tenants`` through a shared elastic service.

    Args:
        tenants: the workloads.
        timeouts_s: per-stage timeouts (a record's timed-out stage carries its timeout).
        decide: the policy: ``decide(views, now) -> Decision`` at every batch arrival and
            completion (``DistRSPolicy(...).decide``).
        ebf: Earliest-Batch-First queues (False: FCFS by arrival at the stage).
        oracle: pass the batches' true requests to the policy (the Ideal baseline).
        cold_start_s: delay before a started worker serves (seconds).

    Returns:
        :class:`ReplayResult`.
    """
    n = len(timeouts_s)
    seq = itertools.count()
    events: list = []  # (time, seq, kind, payload)
    res = ReplayResult(worker_s=[0.0] * n, busy_s=[0.0] * n, peak_workers=[0] * n)
    idle, busy, starting = [0] * n, [0] * n, [0] * n
    retire_busy = [0] * n  # busy workers to retire when their request ends
    target = [0] * n
    queues: list[list] = [[] for _ in range(n)]
    active: dict[tuple[int, int], _Batch] = {}
    history = {i: list(t.warmup) for i, t in enumerate(tenants)}
    now = 0.0
    last = 0.0

    def push(t: float, kind: str, payload) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    def alloc(k: int) -> int:
        return idle[k] + busy[k] + starting[k] - retire_busy[k]

    def apply(counts: Sequence[int]) -> None:
        for k in range(n):
            target[k] = counts[k]
            diff = target[k] - alloc(k)
            if diff > 0:
                undo = min(diff, retire_busy[k])  # keep busy workers instead of new ones
                retire_busy[k] -= undo
                for _ in range(diff - undo):
                    starting[k] += 1
                    push(now + cold_start_s, "ready", k)
            elif diff < 0:
                drop = -diff
                take = min(drop, idle[k])
                idle[k] -= take
                drop -= take
                take = min(drop, starting[k])
                starting[k] -= take  # their "ready" events find nothing to start
                drop -= take
                retire_busy[k] += min(drop, busy[k] - retire_busy[k])
            res.peak_workers[k] = max(res.peak_workers[k], alloc(k))

    def views() -> list[BatchView]:
        out = []
        for key, b in active.items():
            queued = [(s[1], i, s[2]) for i, s in b.state.items() if s[0] == "q"]
            running = [(s[1], now - s[2], i) for i, s in b.state.items() if s[0] == "r"]
            out.append(
                BatchView(
                    key,
                    b.start,
                    len(b.records),
                    b.history,
                    b.bound,
                    b.arrived,
                    queued,
                    running,
                    b.records if oracle else None,
                )
            )
        return out

    def decision() -> None:
        t0 = time.perf_counter()
        dec = decide(views(), now)
        res.decision_s.append(time.perf_counter() - t0)
        res.decisions += 1
        apply(dec.workers)
        res.timeline.append((now, list(dec.workers)))

    def enqueue(b: _Batch, idx: int, k: int) -> None:
        b.state[idx] = ("q", k, now)
        key = (b.prio, now) if ebf else (now,)
        heapq.heappush(queues[k], (key, next(seq), b, idx))

    def enter(b: _Batch, idx: int, k: int) -> None:
        """Request ``idx`` goes on to stage ``k``, or is done after its last stage."""
        rec = b.records[idx]
        while k < len(rec.stage_s) and rec.stage_s[k] == 0.0:
            k += 1  # a 0 s stage needs no worker (as in the simulation)
        if k < len(rec.stage_s):
            enqueue(b, idx, k)
            dispatch(k)
            return
        b.state.pop(idx, None)
        b.done += 1
        res.requests_done += 1
        if b.done == len(b.records):
            complete(b)

    def dispatch(k: int) -> None:
        while idle[k] and queues[k]:
            _, _, b, idx = heapq.heappop(queues[k])
            idle[k] -= 1
            busy[k] += 1
            b.state[idx] = ("r", k, now)
            push(now + b.records[idx].stage_s[k], "finish", (b, idx, k))

    # disaggregated tenants: last batch whose rollout ended, end of each training step
    rolled = [-1] * len(tenants)
    trained: list[dict[int, float]] = [{} for _ in tenants]
    announced = [-1] * len(tenants)

    def maybe_next(ti: int) -> None:
        """One-step staleness: batch i + 1 once rollout i ended and training i - 1 is done."""
        t, i = tenants[ti], announced[ti]
        if i + 1 >= len(t.batches) or rolled[ti] < i:
            return
        if i >= 1 and trained[ti].get(i - 1, float("inf")) > now:
            return
        announced[ti] = i + 1
        push(now, "announce", (ti, i + 1))

    def complete(b: _Batch) -> None:
        t = tenants[b.tenant]
        earliest = b.start + max((r.zq_finish_s for r in b.records), default=0.0)
        res.batches.append(BatchOutcome(t.name, b.index, b.start, earliest, now))
        history[b.tenant] = b.records
        del active[(t.name, b.index)]
        if t.mode == "colocated":
            if b.index + 1 < len(t.batches):
                push(now + t.train_s, "announce", (b.tenant, b.index + 1))
        else:
            prev = trained[b.tenant].get(b.index - 1, float("-inf"))
            trained[b.tenant][b.index] = max(now, prev) + t.train_s
            push(trained[b.tenant][b.index], "trained", b.tenant)
        decision()

    def announce(ti: int, bi: int) -> _Batch:
        t = tenants[ti]
        recs = t.batches[bi]
        hist = history[ti]
        ref = recs if oracle else hist  # Ideal knows the batch's true T
        prio = ebf_priority(now, ref) if ref else float("inf")
        b = _Batch(ti, bi, now, recs, hist, t.delay_bound_s, prio)
        active[(t.name, bi)] = b
        announced[ti] = max(announced[ti], bi)
        for idx, r in enumerate(b.records):
            push(now + r.offset_s, "arrive", (b, idx))
        if t.mode == "disaggregated":
            push(now + (b.records[-1].offset_s if b.records else 0.0), "rolled", (ti, bi))
        return b

    for ti, t in enumerate(tenants):
        if t.batches:
            push(t.start_s, "announce", (ti, 0))
    while events:
        t, _, kind, payload = heapq.heappop(events)
        for k in range(n):
            res.worker_s[k] += alloc(k) * (t - last)
        now = last = t
        if kind == "announce":
            b = announce(*payload)
            if b.records:
                decision()
            else:
                complete(b)
        elif kind == "rolled":
            ti, bi = payload
            rolled[ti] = max(rolled[ti], bi)
            maybe_next(ti)
        elif kind == "trained":
            maybe_next(payload)
        elif kind == "ready":
            k = payload
            if starting[k] > 0:
                starting[k] -= 1
                idle[k] += 1
                dispatch(k)
        elif kind == "arrive":
            b, idx = payload
            b.arrived += 1
            enter(b, idx, 0)
        elif kind == "finish":
            b, idx, k = payload
            busy[k] -= 1
            res.busy_s[k] += b.records[idx].stage_s[k]
            if retire_busy[k] > 0:
                retire_busy[k] -= 1
            else:
                idle[k] += 1
            enter(b, idx, k + 1)
            dispatch(k)
    res.end_s = now
    return res


def replay_dedicated(
    tenants: Sequence[TenantTrace],
    timeouts_s: Sequence[float],
    make_decide: Callable[[], Callable[[list[BatchView], float], Decision]],
    ebf: bool = True,
    cold_start_s: float = 0.0,
) -> ReplayResult:
    """Each tenant on a pool of its own (ZQ-Dedicated, section 6.1): one :func:`replay` per
    tenant with a fresh policy from ``make_decide()``; worker time, peaks and outcomes add up.
    """
    out = ReplayResult(worker_s=[0.0] * len(timeouts_s), busy_s=[0.0] * len(timeouts_s))
    out.peak_workers = [0] * len(timeouts_s)
    for t in tenants:
        out.merge(replay([t], timeouts_s, make_decide(), ebf, False, cold_start_s))
    return out
