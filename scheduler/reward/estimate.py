"""Algorithm 2 of DistRS (section 5.2): the outstanding requests of the active batches.

When a batch arrives or completes, the scaling policy (:mod:`~m2flow.scheduler.reward.scaling`)
collects, for each active batch, the requests still to serve, from its previous batch (history
``r_i``, ``s_ij``) or, for the Ideal baseline, from its true requests:

- *Future* (lines 8-10): the history requests with ``AT + r_i > cur_ts``, at ``AT + r_i``;
- *Queuing_k* (lines 13-15): each request waiting at stage ``k`` arrives at ``cur_ts`` with the
  stage-``k``-on times of a sampled history request (one that reached stage ``k``: a sample
  that skipped stage ``k`` would say nothing of a request waiting there);
- *Running_k* (lines 17-19): each request in service at stage ``k`` for ``e_ik`` seconds
  arrives at ``cur_ts`` with ``s_i'k - e_ik`` left there, then the later stages of a history
  request sampled with ``s_i'k > e_ik``.

Two cases the paper leaves open: a running request that ran longer than every history request
at its stage (no ``s_i'k > e_ik``) is assumed to finish now and keeps the later stages of the
history request that ran longest there; a queued request at a stage no history request
reached is assumed to run to that stage's timeout. One deviation: *overdue* requests --
announced, not arrived, and not in Future because the history had them before ``cur_ts`` (the
batch is slower than its history) -- arrive at ``cur_ts`` as the latest such history requests;
as written, Algorithm 2 drops them and the batch is planned without its last requests.

Sampling is random with a seed, as the paper's ("Sample a request i' from historical data");
without a generator, evenly spaced quantiles instead (deterministic). Pure Python + numpy;
seconds.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .jobs import JobSet, RequestRecord, SimJob, earliest_completion


@dataclass
class BatchView:
    """What the policy sees of one active batch.

    Attributes:
        key: the batch's identity (e.g. ``(task, batch_id)``).
        start_s: when the batch was announced, ``AT`` (absolute seconds).
        size: announced number of requests (the trainer's hint; Algorithm 2 does not use it).
        history: the task's previous batch (``r_i``, ``s_ij``); empty if none yet.
        delay_bound_s: the task's ``D`` (seconds).
        arrived: requests received so far.
        queued: ``(stage, request index, since)`` of requests waiting at ``stage`` since
            ``since`` (absolute seconds; only their order is used: they enter at ``cur_ts``).
        running: ``(stage, elapsed seconds e_ik, request index)`` of requests in service.
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


def reference_records(view: BatchView) -> Sequence[RequestRecord]:
    """The records a batch is planned from: its true requests (Ideal) or its history."""
    return view.truth if view.truth is not None else view.history


def batch_deadline(view: BatchView) -> float:
    """``T`` of the batch (Eq. 1-2) from its reference records (truth or history), seconds.

    Raises:
        ValueError: no reference records.
    """
    ref = reference_records(view)
    got = _T_OFFSET.get(id(ref))
    if got is None or got[0] is not ref:
        if len(_T_OFFSET) >= 256:
            _T_OFFSET.pop(next(iter(_T_OFFSET)))
        got = _T_OFFSET[id(ref)] = (ref, earliest_completion(0.0, ref))  # raises if empty
    return view.start_s + got[1]


_T_OFFSET: dict[int, tuple] = {}  # id(records) -> (records, max_i t_i): T less the start


class _Records:
    """A record list as arrays: offsets, ``(n, M)`` stage times and entered-stage mask."""

    def __init__(self, records: Sequence[RequestRecord], n_stages: int) -> None:
        n = len(records)
        self.records = records  # keeps the list alive while cached (its id is the key)
        self.offset = np.array([r.offset_s for r in records], float)
        self.times = np.zeros((n, n_stages))
        self.enters = np.zeros((n, n_stages), bool)
        for i, r in enumerate(records):
            m = len(r.stage_s)
            if m > n_stages:
                raise ValueError(f"a record has {m} stage times for a {n_stages}-stage pipeline")
            self.times[i, :m] = r.stage_s
            self.enters[i, :m] = True


_ARRAYS: dict[int, _Records] = {}


def _arrays(records: Sequence[RequestRecord], n_stages: int) -> _Records:
    got = _ARRAYS.get(id(records))
    if got is None or got.records is not records or got.times.shape[1] != n_stages:
        if len(_ARRAYS) >= 256:
            _ARRAYS.pop(next(iter(_ARRAYS)))
        got = _ARRAYS[id(records)] = _Records(records, n_stages)
    return got


def _keep(n: int, keep: float) -> int:
    return n if keep >= 1.0 else min(n, math.ceil(n * keep))


def _subsample(n: int, m: int, rng: np.random.Generator | None) -> np.ndarray:
    """``m`` of ``range(n)`` (sorted): random without replacement, or evenly spaced."""
    if m >= n:
        return np.arange(n)
    if rng is not None:
        return np.sort(rng.choice(n, m, replace=False))
    return np.minimum(((np.arange(m) + 0.5) * n / m).astype(np.int64), n - 1)


def _draw(pool: np.ndarray, m: int, rng: np.random.Generator | None) -> np.ndarray:
    """``m`` picks from ``pool`` (with replacement): random, or evenly spaced quantiles of
    ``pool`` (the caller sorts it by the quantity of interest)."""
    if rng is not None:
        return pool[rng.integers(0, len(pool), m)]
    return pool[np.minimum(((np.arange(m) + 0.5) * len(pool) / m).astype(np.int64), len(pool) - 1)]


def outstanding_counts(view: BatchView, now_s: float, n_stages: int) -> tuple[int, int, int]:
    """How many Future, Queuing and Running requests Algorithm 2 gives the batch at ``now_s``."""
    if view.truth is not None:
        n_future = max(len(view.truth) - view.arrived, 0)
    elif view.history:
        n_future = int((view.start_s + _arrays(view.history, n_stages).offset > now_s).sum())
        n_future += _n_overdue(view, n_future)
    else:
        n_future = 0
    return n_future, len(view.queued), len(view.running)


def _n_overdue(view: BatchView, n_future: int) -> int:
    """Announced requests neither arrived nor in Future: the batch is slower than its history."""
    return max(view.size - view.arrived - n_future, 0)


def estimate(
    view: BatchView,
    now_s: float,
    timeouts_s: Sequence[float],
    keep: float = 1.0,
    rng: np.random.Generator | None = None,
) -> JobSet:
    """Algorithm 2 (section 5.2): the outstanding requests of one batch, as simulator jobs.

    Args:
        view: the batch (its history, or with ``truth`` its real requests: Ideal).
        now_s: ``cur_ts`` (absolute seconds).
        timeouts_s: per-stage timeouts ``T_j`` (a queued request at a stage no history request
            reached is assumed to run to that stage's timeout).
        keep: with ``keep < 1``, only ``ceil(keep * n)`` requests of each category (``n`` of
            them) are returned: the cost is that of the sample, not of the batch size.
        rng: random sampling (the paper's); ``None`` draws evenly spaced quantiles instead.

    Returns:
        :class:`~m2flow.scheduler.reward.sim.JobSet` (Future first, then Queuing_k in the order
        they queued, then Running_k).

    Raises:
        ValueError: the batch has neither history nor truth (no estimate possible).
    """
    m = len(timeouts_s)
    ref = reference_records(view)
    if not ref:
        raise ValueError(f"batch {view.key!r} has no history to estimate from")
    h = _arrays(ref, m)
    exact = view.truth is not None
    arrival, first, times, enters, running = [], [], [], [], []

    def add(arr, k, t, e, run) -> None:
        arrival.append(np.broadcast_to(np.asarray(arr, float), (len(t),)))
        first.append(np.full(len(t), k, np.int64))
        times.append(t)
        enters.append(e)
        running.append(np.full(len(t), run))

    # Future (lines 8-10): exact -> the requests not arrived yet; else AT + r_i > cur_ts
    if exact:
        fut = np.arange(min(view.arrived, len(ref)), len(ref))
    else:
        fut = np.nonzero(view.start_s + h.offset > now_s)[0]
    n_due = 0 if exact else _n_overdue(view, len(fut))
    fut = fut[_subsample(len(fut), _keep(len(fut), keep), rng)]
    if len(fut):
        add(np.maximum(view.start_s + h.offset[fut], now_s), 0, h.times[fut], h.enters[fut], False)
    # Overdue (a deviation): announced requests that history had before cur_ts but that have
    # not arrived arrive at cur_ts, as the history requests they stand for (the latest ones)
    n_due = _keep(n_due, keep)
    if n_due:
        past = np.nonzero(view.start_s + h.offset <= now_s)[0]
        past = past[np.argsort(h.offset[past], kind="stable")][-n_due:]
        if len(past) < n_due:  # more announced than history holds: draw from all of it
            past = np.concatenate([past, _draw(np.arange(len(ref)), n_due - len(past), rng)])
        add(now_s, 0, h.times[past], h.enters[past], False)
    # Queuing_k (lines 13-15): arrive at cur_ts, stage-k-on times of a sampled request
    queued = sorted(view.queued, key=lambda q: q[2])
    for k in range(m):
        items = [q for q in queued if q[0] == k]
        items = [items[i] for i in _subsample(len(items), _keep(len(items), keep), rng)]
        if not items:
            continue
        if exact:
            pick = np.array([i for _, i, _ in items], np.int64)
        else:
            pool = np.nonzero(h.enters[:, k])[0]
            if not len(pool):  # nothing known of stage k: assume it runs to its timeout
                t = np.zeros((len(items), m))
                t[:, k] = timeouts_s[k]
                e = np.zeros((len(items), m), bool)
                e[:, k] = True
                add(now_s, k, t, e, False)
                continue
            pool = pool[np.argsort(h.times[pool, k], kind="stable")]
            pick = _draw(pool, len(items), rng)
        t, e = h.times[pick].copy(), h.enters[pick].copy()
        t[:, :k], e[:, :k] = 0.0, False
        e[:, k] = True
        add(now_s, k, t, e, False)
    # Running_k (lines 17-19): s_i'k > e_ik; s_i'k - e_ik left, later stages kept
    run = view.running
    run = [run[i] for i in _subsample(len(run), _keep(len(run), keep), rng)]
    for k in range(m):
        items = sorted((el, i) for st, el, i in run if st == k)
        if not items:
            continue
        t = np.zeros((len(items), m))
        e = np.zeros((len(items), m), bool)
        reached = np.nonzero(h.enters[:, k])[0]
        for j, (el, idx) in enumerate(items):
            if exact:
                src = idx
            else:
                longer = reached[h.times[reached, k] > el]
                if len(longer):
                    longer = longer[np.argsort(h.times[longer, k], kind="stable")]
                    if rng is not None:
                        src = longer[rng.integers(len(longer))]
                    else:  # the request's evenly spaced quantile among those running
                        q = int((j + 0.5) * len(longer) / len(items))
                        src = longer[min(q, len(longer) - 1)]
                elif len(reached):  # past every history time: finishes now, keeps the rest
                    src = reached[np.argmax(h.times[reached, k])]
                else:
                    src = None
            if src is not None:
                t[j], e[j] = h.times[src], h.enters[src]
            t[j, :k], e[j, :k] = 0.0, False
            t[j, k] = max(t[j, k] - el, 0.0)
            e[j, k] = True
        add(now_s, k, t, e, True)
    if not arrival:
        return JobSet.empty(m)
    n = sum(len(a) for a in arrival)
    return JobSet(
        [view.key],
        np.zeros(n, np.int64),
        np.concatenate(arrival),
        np.concatenate(first),
        np.concatenate(times),
        np.concatenate(enters),
        np.concatenate(running),
    )


def estimate_jobs(
    view: BatchView,
    now_s: float,
    timeouts_s: Sequence[float],
    keep: float = 1.0,
    rng: np.random.Generator | None = None,
) -> list[SimJob]:
    """:func:`estimate` as a list of :class:`~m2flow.scheduler.reward.sim.SimJob`."""
    return estimate(view, now_s, timeouts_s, keep, rng).to_jobs()
