"""The run session: what the runtime applies to a runner and measures around it.

A runner (``workflows/grpo.py``) holds no placement logic. ``m2flow run ... plan=...`` opens a
:class:`Session` around ``main(cfg)``; the runtime pieces the runner uses read it:

- :class:`~m2flow.core.cluster.Cluster` resolves the session's
  :class:`~m2flow.core.placement.Placement` once it knows its devices (a plan needs the device
  count and capacity);
- ``Worker.launch`` without an explicit placement puts the group where the placement says;
- a group call carries the plan's granularity for its group (``Worker.chunk_size``);
- every waited group call and every logged step is recorded, which is what the profiler
  (:mod:`m2flow.run.profiler`) and the predicted-vs-measured report read.

Without a session (library use, tests) everything behaves as before: groups go where the caller
says, or on every device; edges are coalesced.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._context import close_session, current_session, open_session  # noqa: F401 (public)

if TYPE_CHECKING:
    from ..core.cluster import Cluster
    from ..core.placement import Placement
    from ..core.tracefile import TraceWriter


class StopRun(Exception):
    """Raised by the run log once a profiling session has recorded the steps it asked for."""


@dataclass
class CallRecord:
    """One waited group call: ``busy`` and ``duration`` are seconds, max over ranks."""

    group: str
    method: str
    step: int  # index of the step mark this call precedes (0 before the first mark)
    busy: float
    duration: float


@dataclass
class Session:
    """Run-scoped runtime state (see the module docstring).

    Args:
        placement: a :class:`Placement`, or a callable ``(cluster) -> Placement`` evaluated when
            the cluster is built (plans need its device count); ``None``: runner defaults.
        max_steps: stop the run (``StopRun`` from the run log) after this many steps with
            ``step >= 1`` have been logged; ``None``: run to the end.
    """

    placement: Placement | Callable[[Cluster], Placement] | None = None
    max_steps: int | None = None
    calls: list[CallRecord] = field(default_factory=list)
    marks: list[tuple[int, float]] = field(default_factory=list)  # (step, wall time)
    groups: dict[str, list[list[int]]] = field(default_factory=dict)  # launched: device ids/rank
    weight_versions: dict[str, int] = field(default_factory=dict)  # group -> last synced version
    cluster: Cluster | None = None
    result: Any = None  # what the runner's main(cfg) returned
    trace: TraceWriter | None = None  # the measured timeline (<run_dir>/trace.json)

    def __enter__(self) -> Session:
        open_session(self)
        return self

    def __exit__(self, *exc) -> None:
        close_session()

    # -- hooks the runtime calls --------------------------------------------------------------

    def resolve(self, cluster: Cluster) -> Placement | None:
        """The placement for ``cluster`` (evaluated once, then kept)."""
        self.cluster = cluster
        if callable(self.placement):
            self.placement = self.placement(cluster)
        if self.placement is not None:
            self.placement.check(cluster)
        return self.placement

    def start_trace(self, run_dir) -> None:
        """Record the run's timeline into ``run_dir/trace.json`` (:mod:`m2flow.core.tracefile`):
        not without a run directory, not while profiling (``max_steps``), not with
        ``M2FLOW_TRACE=0``."""
        if self.trace is not None or run_dir is None or self.max_steps is not None:
            return
        if os.environ.get("M2FLOW_TRACE", "1") == "0":
            return
        from pathlib import Path

        from ..core.tracefile import TraceWriter, max_bytes_from_env

        self.trace = TraceWriter(Path(run_dir) / "trace.json", max_bytes_from_env())

    def close_trace(self, groups=()) -> None:
        """Collect the events ``groups`` recorded after their last call and close the trace."""
        if self.trace is None:
            return
        from ..core.tracefile import drain_groups

        drain_groups(self.trace, groups)
        self.trace.close()

    def record_call(self, group: str, method: str, busy: float, duration: float) -> None:
        self.calls.append(CallRecord(group, method, len(self.marks), busy, duration))

    def mark_step(self, step: int, wall: float) -> None:
        """A step was logged; raises :class:`StopRun` when ``max_steps`` are done."""
        self.marks.append((step, wall))
        if self.trace is not None:
            self.trace.mark(step, wall)
        done = sum(1 for s, _ in self.marks if s >= 1)
        if self.max_steps is not None and done >= self.max_steps:
            raise StopRun(f"profiled {done} steps")

    # -- measurements -------------------------------------------------------------------------

    def step_times(self) -> list[float]:
        """Wall seconds of each logged step ``>= 1`` (time since the previous mark)."""
        out = []
        for (_, prev), (step, now) in zip(self.marks, self.marks[1:]):
            if step >= 1:
                out.append(now - prev)
        return out

    def busy_per_step(self) -> list[dict[str, float]]:
        """Per logged step ``>= 1``: each group's busy seconds (its calls' max-over-ranks busy
        time, summed over the calls waited during that step)."""
        per: list[dict[str, float]] = [defaultdict(float) for _ in self.marks]
        for c in self.calls:
            if c.step < len(self.marks):
                per[c.step][c.group] += c.busy
        return [dict(p) for (step, _), p in zip(self.marks, per) if step >= 1]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
