"""RLBoost's spot rollout pool policies (Wu et al., NSDI 2026), in one namespace.

- :mod:`.seeding` -- section 4.1, Algorithm 1: :class:`StepStats`, :class:`SeedingPolicy`
  (the seeding window ``T_seed`` and the remote-instance cap ``N_prem``).
- :mod:`.balance` -- section 4.2.1, Algorithm 2: :func:`select_instance`,
  :func:`rebalance` / :class:`Move`, :class:`ThroughputProfile`, :func:`batching_plateau`.
- :mod:`.trace` -- Appendix C: availability traces (:func:`load_trace`,
  :func:`generate_segment` with Table 5's statistics, :func:`time_scale`, ...).

Readings of the paper and deviations are in each module's docstring and in docs/results/spot.md.
Pure Python + numpy/scipy: no Ray, no torch; the same code runs live and in trace replay.
"""

from .balance import Move, ThroughputProfile, batching_plateau, rebalance, select_instance
from .seeding import SeedingPolicy, StepStats, seconds_outside, seeding_share
from .trace import (
    SEGMENTS,
    SegmentStats,
    Trace,
    TraceError,
    events,
    generate_segment,
    instances_at,
    load_trace,
    save_trace,
    time_scale,
    trace_stats,
)

__all__ = [
    "SEGMENTS",
    "Move",
    "SeedingPolicy",
    "SegmentStats",
    "StepStats",
    "ThroughputProfile",
    "Trace",
    "TraceError",
    "batching_plateau",
    "events",
    "generate_segment",
    "instances_at",
    "load_trace",
    "rebalance",
    "save_trace",
    "seconds_outside",
    "seeding_share",
    "select_instance",
    "time_scale",
    "trace_stats",
]
