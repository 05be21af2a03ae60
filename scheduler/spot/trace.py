"""Spot (preemptible) instance availability traces: load, query, generate, rescale.

A trace is a list of ``(t_s, instances)`` rows, times strictly increasing: from ``t_s`` seconds
on, ``instances`` spot instances are available (0 before the first row). On disk it is a CSV
with the header ``t_s,instances``.

RLBoost (Wu et al., NSDI 2026) replays a real 12-hour trace of 2xH100 spot instances (from
Bamboo [38], 50% of instances sampled) and evaluates on three 2-hour segments (section 6.1,
Figure 7; Appendix C, Table 5 at paper:516-523 of ``shared/papers/000_8942f305fc039a41.txt``):

=========  ==============  ============  ============  =============
segment    availability    #Avg. inst.   #Allocations  #Preemptions
=========  ==============  ============  ============  =============
A          high, frequent  6.53          13            8
B          low, frequent   4.58          8             9
C          high, rare      6.06          6             2
=========  ==============  ============  ============  =============

The trace itself is not in the paper, so :func:`generate_segment` draws seeded synthetic
segments with exactly these statistics: the time-weighted average over ``[0, duration_s)``,
allocations = instance joins, preemptions = leaves. The instances present at ``t = 0`` are not
allocations (segment C, 6 allocations with an average of 6.06, needs that reading).

A count trace cannot show a preemption and an allocation at the same instant (the "spikes" of
segment A, paper:324): write them as two rows a moment apart; :func:`events` counts the net
change between consecutive rows.
"""

from __future__ import annotations

import bisect
import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np

Trace = list[tuple[float, int]]
HEADER = ("t_s", "instances")


class TraceError(ValueError):
    """A trace file that cannot be used; the message is one line: file, line, problem, fix."""


class SegmentStats(NamedTuple):
    """Table 5's columns for one trace: time-weighted mean instances, joins, leaves."""

    avg_instances: float
    allocations: int
    preemptions: int


#: Appendix C, Table 5 (paper:516-523): (average instances, allocations, preemptions) over 2 h.
SEGMENTS: dict[str, SegmentStats] = {
    "A": SegmentStats(6.53, 13, 8),
    "B": SegmentStats(4.58, 8, 9),
    "C": SegmentStats(6.06, 6, 2),
}


def _fail(path: str | Path, line: int, problem: str, fix: str) -> TraceError:
    return TraceError(f"{path}, line {line}: {problem}; {fix}")


#: most spot instances a trace may name (1e30 is a typo, not a cluster)
MAX_INSTANCES = 100_000


def load_trace(path: str | Path) -> Trace:
    """Read a ``t_s,instances`` CSV (UTF-8, optional BOM; blank lines and ``#`` comment lines
    are skipped; spaces around fields are allowed).

    ``t_s``: seconds >= 0, strictly increasing (no duplicates). ``instances``: an integer >= 0
    (``3`` or ``3.0``; ``2.5`` is an error).

    Returns:
        ``[(t_s, instances)]``.

    Raises:
        TraceError: one line naming the file, the line number and the fix, for an unreadable or
            empty file, a wrong header, missing/extra columns, non-numeric values, negative or
            non-finite times, unsorted or duplicate times, negative or non-integer counts.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace ({e}); give a readable UTF-8 CSV") from e
    lines = [
        (n, line)
        for n, line in enumerate(text.splitlines(), start=1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    want = ",".join(HEADER)
    if not lines:
        raise _fail(path, 1, "the file is empty", f"write the header '{want}' and one row a line")
    n, header = lines[0]
    if tuple(f.strip() for f in next(csv.reader([header]))) != HEADER:
        raise _fail(path, n, f"header is '{header.strip()}'", f"the first line must be '{want}'")
    if len(lines) == 1:
        raise _fail(path, n, "no rows after the header", "add rows such as '0,4'")
    trace: Trace = []
    prev_line = 0
    for n, line in lines[1:]:
        fields = [f.strip() for f in next(csv.reader([line]))]
        if len(fields) != 2:
            problem = f"{len(fields)} columns in '{line.strip()}'"
            raise _fail(path, n, problem, "write exactly two columns, 't_s,instances'")
        try:
            t, count = float(fields[0]), float(fields[1])
        except ValueError:
            raise _fail(
                path, n, f"non-numeric value in '{line.strip()}'", "write numbers like '120.5,3'"
            ) from None
        if not math.isfinite(t) or t < 0:
            raise _fail(path, n, f"time {fields[0]} is negative or not finite", "use seconds >= 0")
        if not math.isfinite(count) or count < 0 or not count.is_integer():
            raise _fail(
                path, n, f"instances {fields[1]} is not an integer >= 0", "write a whole count"
            )
        if count > MAX_INSTANCES:
            raise _fail(
                path, n, f"instances {fields[1]} is more than {MAX_INSTANCES}",
                "a trace counts spot instances of one pool: write a count a cluster has",
            )  # fmt: skip
        if trace and t <= trace[-1][0]:
            what = "repeats" if t == trace[-1][0] else "is before"
            raise _fail(
                path,
                n,
                f"time {fields[0]} {what} the time on line {prev_line}",
                "sort the rows by t_s, one row per time",
            )
        trace.append((t, int(count)))
        prev_line = n
    return trace


def save_trace(path: str | Path, trace: Sequence[tuple[float, int]]) -> None:
    """Write ``trace`` as a ``t_s,instances`` CSV that :func:`load_trace` reads back."""
    _check(trace)
    body = "".join(f"{t:g},{n}\n" if float(t).is_integer() else f"{t!r},{n}\n" for t, n in trace)
    Path(path).write_text(",".join(HEADER) + "\n" + body, encoding="utf-8")


def _check(trace: Sequence[tuple[float, int]]) -> None:
    for i, (t, n) in enumerate(trace):
        if not (math.isfinite(t) and t >= 0) or n < 0 or (i and t <= trace[i - 1][0]):
            raise ValueError(f"trace row {i} ({t}, {n}): need increasing times >= 0, counts >= 0")


def instances_at(trace: Sequence[tuple[float, int]], t: float) -> int:
    """Instances available at time ``t`` seconds: the count of the last row with ``t_s <= t``;
    0 before the first row."""
    i = bisect.bisect_right([row[0] for row in trace], t)
    return trace[i - 1][1] if i else 0


def events(trace: Sequence[tuple[float, int]]) -> list[tuple[float, int, int]]:
    """``[(t_s, joins, leaves)]``: the net change at each row after the first (the first row is
    the initial state, not an event); rows that do not change the count are left out."""
    out = []
    for (_, before), (t, after) in zip(trace, trace[1:]):
        if after != before:
            out.append((t, max(after - before, 0), max(before - after, 0)))
    return out


def trace_stats(trace: Sequence[tuple[float, int]], duration_s: float) -> SegmentStats:
    """Table 5's statistics over ``[0, duration_s)``: the time-weighted mean count and the joins
    and leaves of :func:`events` before ``duration_s``.

    Raises:
        ValueError: ``duration_s`` <= 0.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    area = 0.0
    for i, (t, n) in enumerate(trace):
        end = trace[i + 1][0] if i + 1 < len(trace) else duration_s
        area += n * max(0.0, min(end, duration_s) - min(t, duration_s))
    ev = [e for e in events(trace) if e[0] < duration_s]
    return SegmentStats(area / duration_s, sum(e[1] for e in ev), sum(e[2] for e in ev))


def time_scale(trace: Sequence[tuple[float, int]], factor: float) -> Trace:
    """Multiply every time by ``factor``: 0.01 replays a 2-hour segment in 72 s. Counts stay.

    Raises:
        ValueError: ``factor`` not finite and > 0, or so small that two times merge.
    """
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    out = [(t * factor, n) for t, n in trace]
    if any(b[0] <= a[0] for a, b in zip(out, out[1:])):
        raise ValueError(f"factor {factor} merges distinct times; use a larger factor")
    return out


def _fit_area(times: np.ndarray, steps: np.ndarray, need: int, duration: int, rng) -> int:
    """Shift event times (integers, order kept, >= 1 s apart) to add ``need`` instance-seconds:
    a join moved earlier by s adds s, a leave moved later adds s. Returns what is left."""
    for _ in range(4):  # a few passes, each moving an event at most half its free room
        for k in rng.permutation(len(times)):
            if need == 0:
                return 0
            lo = times[k - 1] + 1 if k else 1
            hi = times[k + 1] - 1 if k + 1 < len(times) else duration - 1
            # direction of travel that adds area for this event, and the room that way
            later = (steps[k] < 0) == (need > 0)
            room = (hi - times[k]) if later else (times[k] - lo)
            move = min(max(room // 2, min(room, 1)), abs(need))
            times[k] += move if later else -move
            need -= int(math.copysign(move, need))
    return need


def generate_segment(kind: Literal["A", "B", "C"], duration_s: int = 7200, seed: int = 0) -> Trace:
    """A seeded synthetic 2-hour segment with Table 5's statistics (Appendix C).

    ``allocations`` +1 and ``preemptions`` -1 events in random order at distinct whole seconds
    in ``(0, duration_s)``, the count never below 0, and an initial count chosen so that the
    time-weighted average over ``[0, duration_s)`` is Table 5's to within ``1 / duration_s``
    (exact when ``avg * duration_s`` is a whole number, as for 7200 s): draws whose average is
    far off are rejected, the rest are fixed by nudging event times. Join and leave counts are
    exact. Rows only at changes; the first row is ``(0.0, initial count)``.

    Raises:
        ValueError: unknown ``kind``, ``duration_s`` too short for the events (< 1000 s), or no
            draw fits in 10000 tries (not seen for the three segments).
    """
    if kind not in SEGMENTS:
        raise ValueError(f"kind must be one of {sorted(SEGMENTS)}, got {kind!r}")
    if duration_s < 1000:
        raise ValueError(f"duration_s must be >= 1000 s, got {duration_s!r}")
    avg, joins, leaves = SEGMENTS[kind]
    duration = int(duration_s)
    target = round(avg * duration)  # instance-seconds
    rng = np.random.default_rng(seed)
    steps0 = np.array([1] * joins + [-1] * leaves)
    for _ in range(10_000):
        steps = rng.permutation(steps0)
        times = np.sort(rng.choice(np.arange(1, duration), size=len(steps), replace=False))
        offsets = np.cumsum(steps)
        # area of the offset profile: each event adds step * (duration - t)
        area = int(np.sum(steps * (duration - times)))
        n0 = round((target - area) / duration)
        if n0 + min(0, offsets.min()) < 0 or abs(target - area - n0 * duration) > duration // 10:
            continue
        if _fit_area(times, steps, target - area - n0 * duration, duration, rng) != 0:
            continue
        counts = n0 + offsets
        return [(0.0, int(n0))] + [(float(t), int(c)) for t, c in zip(times, counts)]
    raise ValueError(f"no segment {kind} fits {duration_s} s after 10000 draws")
