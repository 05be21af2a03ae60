"""Cost model of a collapsed cycle (env <-> policy): time-shared, or split across devices.

RLinf (section 3.4, Algorithm 1) collapses every cycle of the workflow graph into one node before
cutting the graph (``ConvertCircleToNode``), so the cycle's members always share devices. Its
embodied experiment (section 5.1.2, ManiSkill) runs the simulator and the policy on separate
devices instead, pipelined over sub-batches of the environments: while the policy computes
actions for one sub-batch the simulator steps another. This module costs both ways to run a
two-member cycle ``A <-> B`` (``A``, the *leader*, starts each round trip and splits its share
into sub-batches: the env worker; ``B`` answers: the policy).

Measured quantities (:mod:`m2flow.run.profiler`, profile key ``cycles``):

- ``T_A(n)``, ``T_B(n)``: each member's busy seconds per step on ``n`` devices, alone (the
  profile's points, as for every component);
- ``R``: round trips per step (items the leader puts on the cycle per step, per rank);
- ``g_sh``: seconds per round trip in neither member's busy time when they time-share devices
  (device-lock hand-offs and channel latency);
- ``g_sp``: the same when the members run on disjoint devices (channel latency only);
- ``s``: the fraction of its time-shared busy time a member takes on disjoint devices (``s <
  1`` where the time-shared busy times hold waits that a split overlaps: a member keeps its
  device through the lock's grace period while its answer is on the way);
- ``o``: seconds each member pays per extra sub-batch per round trip (one more put, get and
  call on a smaller batch).

Time-shared on ``n`` devices (today's collapsed node, plus the hand-offs that used to land in
the profile's unattributed step overhead)::

    T_shared(n) = T_A(n) + T_B(n) + R * g_sh

Split, ``A`` on ``n_A`` devices, ``B`` on ``n_B``, ``k`` sub-batches of the leader's ``batch``
items (``k`` divides ``batch``). Per round trip and sub-batch each member takes

    a = (s T_A(n_A) / R - o) / k + o,        b = (s T_B(n_B) / R - o) / k + o

(a whole-step time, measured with one sub-batch, already holds one ``o`` per round trip, as in
:func:`~.cost.spatial_time`). The ``k`` sub-batches circulate A -> B -> A; in steady state a
round trip takes the period ``P = max(k a, k b, a + b + g_sp)`` (each member is busy ``k a``
resp. ``k b`` per round trip, and one sub-batch needs ``a + b + g_sp`` to come back). The last
round trip is RLinf's pipeline formula ``T_critical + (k - 1) * T_bottleneck`` over the two
members::

    T_split = (R - 1) * P + a + b + g_sp + (k - 1) * max(a, b)

With ``k = 1`` this is ``s (T_A + T_B) + R * g_sp``: disjoint devices without overlap, which
saves the hand-offs. The profiler measures that run and sets ``g_sp`` (``s = 1``) when it is
slower than ``T_A + T_B``, else ``s`` (``g_sp = 0``), so the model reproduces it exactly; a
second split run in ``k > 1`` sub-batches gives ``o``. ``T_split`` is nondecreasing and convex
in ``(T_A, T_B)`` (sums and maxima of increasing affine terms), so :func:`~.search.split_min`
finds the best device split exactly. Units: seconds, devices, items; ``s`` is a ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cost import divisors
from .search import split_min


class CycleError(ValueError):
    """Invalid cycle cost constants (the message names the field)."""


@dataclass(frozen=True)
class CycleCost:
    """Measured constants of a two-member cycle (module docstring).

    ``members``: ``(leader, follower)`` component names; ``round_trips``: R per step (>= 1);
    ``batch``: items of the leader's share that sub-batches split (>= 1; 1 = no sub-batching);
    ``shared_gap_s``, ``split_gap_s``, ``sub_batch_overhead_s``: seconds (>= 0);
    ``split_scale``: ``s``, in (0, 1].
    """

    members: tuple[str, str]
    round_trips: float
    batch: int = 1
    shared_gap_s: float = 0.0
    split_gap_s: float = 0.0
    sub_batch_overhead_s: float = 0.0
    split_scale: float = 1.0

    def __post_init__(self) -> None:
        if len(self.members) != 2 or self.members[0] == self.members[1]:
            raise CycleError(f"a cycle has two distinct members, got {self.members!r}")
        if not self.round_trips >= 1:
            raise CycleError(f"cycle {self.members}: round_trips must be >= 1")
        if int(self.batch) != self.batch or self.batch < 1:
            raise CycleError(f"cycle {self.members}: batch must be a whole number >= 1")
        for name in ("shared_gap_s", "split_gap_s", "sub_batch_overhead_s"):
            if not getattr(self, name) >= 0:
                raise CycleError(f"cycle {self.members}: {name} must be >= 0")
        if not 0 < self.split_scale <= 1:
            raise CycleError(f"cycle {self.members}: split_scale must be in (0, 1]")

    @property
    def sub_batches(self) -> np.ndarray:
        """Candidate sub-batch counts k (divisors of ``batch``), increasing."""
        return np.array(divisors(int(self.batch)), dtype=np.int64)

    def shared_time(self, t_a, t_b):
        """Seconds per step time-shared: ``T_A + T_B + R * g_sh``."""
        return t_a + t_b + self.round_trips * self.shared_gap_s

    def split_time(self, t_a, t_b, k):
        """Seconds per step on disjoint devices in ``k`` sub-batches (module docstring);
        ``t_a``, ``t_b``: the members' whole-step seconds on their devices."""
        r, o, g, s = self.round_trips, self.sub_batch_overhead_s, self.split_gap_s, self.split_scale
        a = (s * t_a / r - o) / k + o
        b = (s * t_b / r - o) / k + o
        period = np.maximum(np.maximum(k * a, k * b), a + b + g)
        return (r - 1) * period + a + b + g + (k - 1) * np.maximum(a, b)

    def member_busy(self, t, k):
        """A member's busy seconds per step split in ``k`` sub-batches: ``s T + (k-1) R o``."""
        return self.split_scale * t + (k - 1) * self.round_trips * self.sub_batch_overhead_s


def split_table(cycle: CycleCost, ta: np.ndarray, tb: np.ndarray):
    """Best split of the cycle for every device count n = 0..N.

    Args:
        ta, tb: the leader's and the follower's seconds per step on 0..N devices (``inf``:
            infeasible; the planner's envelopes).

    Returns:
        ``(cost, n_a, k)``: arrays of length N+1 (``inf``, -1, -1 where no split fits).
        Ties: the fewest sub-batches, then the fewest leader devices.
    """
    ks = cycle.sub_batches
    value, j = split_min(
        [ta], [tb], lambda u, d, v: cycle.split_time(u[0], d[0], ks[v].astype(float)), ks.size
    )
    k_idx = np.argmin(value, axis=0)  # first (fewest sub-batches) among the least
    cols = np.arange(value.shape[1])
    cost = value[k_idx, cols]
    n_a = np.where(np.isfinite(cost), j[k_idx, cols], -1)
    k = np.where(np.isfinite(cost), ks[k_idx], -1)
    return cost, n_a, k
