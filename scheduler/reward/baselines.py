"""The baselines DistRS is evaluated against (section 6.1 and 6.3), as replay policies.

Each is a ``decide(views, now) -> Decision`` callable for
:func:`~m2flow.scheduler.reward.replay.replay`, like
:class:`~m2flow.scheduler.reward.scaling.DistRSPolicy`:

- :class:`ZeroQueuePolicy` -- *ZQ* (section 6.3) and, replayed per task on a pool of its own
  (:func:`~m2flow.scheduler.reward.replay.replay_dedicated`), *ZQ-Dedicated* (section 6.1):
  "based on historical information", "targets zero request queuing and allocates resources
  independently for each training task". At each batch arrival and completion, each stage gets
  the zero-queue peak concurrency of the Algorithm 2 estimate (the previous batch), so it
  scales per batch and knows nothing of the batch to come.
- :func:`ideal_policy` -- *Ideal* (section 6.1): all tasks share one service, which "makes
  scaling decisions with perfect knowledge of the arrival times for all requests in the current
  batch and the execution time of each stage, while scheduling requests using EBF". It is
  Algorithm 1 run on the batches' true requests (the replay's ``oracle=True`` passes them),
  with EBF and without the timeout-aware check (a hedge against unknown stage times, which it
  knows).
- :class:`FixedPolicy` -- fixed worker counts (the scheduling experiment of section 6.3:
  CPUs fixed, GPUs swept).

Pure Python + numpy; seconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from .scaling import BatchView, Decision, DistRSPolicy
from .sim import Workload


class ZeroQueuePolicy:
    """ZQ: per stage, the zero-queue peak of the history-based estimate (see module doc).

    Args:
        timeouts_s: per-stage timeouts ``T_j`` (seconds; Algorithm 2 needs them).
        costs: ``C_j`` per stage (for :attr:`Decision.cost`; default all 1).
        seed: seed of Algorithm 2's random sampling of queued and running requests.
    """

    def __init__(
        self, timeouts_s: Sequence[float], costs: Sequence[float] | None = None, seed: int = 0
    ) -> None:
        self._est = DistRSPolicy(timeouts_s, costs=costs, seed=seed)

    def decide(self, views: Sequence[BatchView], now_s: float) -> Decision:
        t0 = time.perf_counter()
        est = self._est
        js, _ = est.estimate(views, now_s)
        m = len(est.timeouts_s)
        peaks = Workload(js, est.timeouts_s, None, now_s).zero_queue_peaks() if len(js) else []
        # Algorithm 1's N_low = 1: every stage keeps a worker while a batch is active
        workers = [max(p, 1) for p in peaks] if len(js) else [0] * m
        cost = float(np.dot(workers, est.costs))
        return Decision(workers, True, 0, time.perf_counter() - t0, cost)


class FixedPolicy:
    """The same worker counts at every decision (a static pool)."""

    def __init__(self, workers: Sequence[int]) -> None:
        self.workers = list(workers)

    def decide(self, views: Sequence[BatchView], now_s: float) -> Decision:
        return Decision(list(self.workers), True, 0)


def ideal_policy(
    timeouts_s: Sequence[float], costs: Sequence[float] | None = None, search: str = "gallop"
) -> DistRSPolicy:
    """Ideal's decision (module doc): replay it with ``oracle=True`` so that it sees the truth."""
    return DistRSPolicy(timeouts_s, ebf=True, timeout_check=False, costs=costs, search=search)
