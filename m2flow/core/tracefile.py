"""The run's measured timeline as a Chrome trace: ``<run_dir>/trace.json``.

Opens in ``ui.perfetto.dev`` and ``chrome://tracing``. Layout: process ``driver`` holds one
``step N`` slice per logged step (from the previous step's log line to this one's; step 0 is
what ran before the first, e.g. a warm start) and the driver's own waits; each worker group
is a process named after the group, with one thread per rank (``rank r``) and one for the
runtime requests the rank serves while it runs (``rank r io``: offloads other workers ask
for). Slices are the events of :mod:`m2flow.core.events`, ``cat`` their kind, ``args.step`` the step
whose window they start in; times are microseconds from the start of the run's cluster.

A resumed run (or any run into a directory that holds a trace) first renames the earlier
trace to ``trace.1.json`` (``.2``, ...), so no part of a run is lost.

Format: the JSON array form, one event per line, written at each logged step; a run that is
killed leaves a file whose closing ``]`` is missing, which both viewers accept
(:func:`read_trace` too).

Size bound: the file stays under ``max_bytes`` (``M2FLOW_TRACE_MAX_MB``, default 64 MiB).
Every step is written while it is under half of that; then every 2nd step until three
quarters, every 4th until seven eighths, and so on (a step is written whole or not at all;
the steps left out are counted in the final ``trace summary`` event), so a run of any length
keeps its early steps in full and later ones at a falling rate. One process ships at most
:data:`m2flow.core.events.MAX_BUFFERED` events per call; the excess is counted as dropped.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

from . import events

DEFAULT_MAX_MB = 64.0
DRIVER_PID = 0
#: largest time (microseconds, ~31 years) a trace event may hold: beyond, sums overflow
MAX_US = 1e15


def max_bytes_from_env() -> int:
    """``M2FLOW_TRACE_MAX_MB`` in bytes (default 64 MiB).

    Raises:
        ValueError: not a positive number.
    """
    raw = os.environ.get("M2FLOW_TRACE_MAX_MB", str(DEFAULT_MAX_MB))
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise ValueError(f"M2FLOW_TRACE_MAX_MB={raw!r}: give the trace's size bound in MiB (> 0)")
    return int(mb * 2**20)


class TraceWriter:
    """Collects every process's events during a run and writes them per step.

    Args:
        path: the trace file (overwritten).
        max_bytes: size bound (module docstring).
    """

    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():  # a resumed run: keep the earlier part's trace
            n = 1
            while self.path.with_name(f"{self.path.stem}.{n}{self.path.suffix}").exists():
                n += 1
            self.path.rename(self.path.with_name(f"{self.path.stem}.{n}{self.path.suffix}"))
        self.max_bytes = max_bytes
        self.origin_ns = time.time_ns()  # wall time of ts 0
        self._file = open(self.path, "w")  # noqa: SIM115 (open for the run; closed in close)
        self._file.write("[\n")
        self.bytes = 2
        self.marks: list[float] = []  # wall seconds of each logged step, in order
        self.steps: list[int] = []  # the step number of each mark
        self.pending: list[tuple] = []  # events after the last mark: step not known yet
        self.pids: dict[str, int] = {}
        self.threads: set[tuple[int, int]] = set()
        self.keep: dict[int, bool] = {}
        self.totals: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.skipped_steps = 0
        self.dropped = 0
        self.cost_s = 0.0  # seconds the driver spent here (the trace's cost on its thread)
        self._lock = threading.Lock()  # calls may be waited from several driver threads
        self._meta(DRIVER_PID, None, "process_name", {"name": "driver"})
        self._meta(DRIVER_PID, 0, "thread_name", {"name": "driver"})
        events.enable(True)

    @property
    def closed(self) -> bool:
        return self._file.closed

    # -- input --------------------------------------------------------------------------------

    def add(self, group: str, rank: int, shipped: tuple | None) -> None:
        """Events a rank of ``group`` shipped (:meth:`m2flow.core.events.Recorder.drain`)."""
        if shipped is None:
            return
        with self._lock:
            if not self._file.closed:
                self._add(group, rank, shipped)

    def _add(self, group: str, rank: int, shipped: tuple) -> None:
        t0 = time.perf_counter()
        wall0, mono0, _pid, evs, dropped = shipped
        self.dropped += dropped
        pid = self._pid(group)
        off = wall0 - mono0 - self.origin_ns  # monotonic ns -> ns since origin
        for kind, name, start, end, track, args in evs:
            tid = 2 * rank + (track == "io")
            if (pid, tid) not in self.threads:
                self.threads.add((pid, tid))
                label = f"rank {rank}" + (" io" if track == "io" else "")
                self._meta(pid, tid, "thread_name", {"name": label})
                self._meta(pid, tid, "thread_sort_index", {"sort_index": tid})
            self._route((pid, tid, kind, name, (start + off) / 1e3, (end - start) / 1e3, args))
        self.cost_s += time.perf_counter() - t0

    def mark(self, step: int, wall: float) -> None:
        """Step ``step`` was logged at ``wall`` (seconds): its window closes; the events that
        started in it are written (or left out, past the size bound)."""
        with self._lock:
            if not self._file.closed:
                self._mark(step, wall)

    def _mark(self, step: int, wall: float) -> None:
        t0 = time.perf_counter()
        start = self.marks[-1] if self.marks else self.origin_ns / 1e9
        self.marks.append(wall)
        self.steps.append(step)
        self._take_driver()
        begin = (start * 1e9 - self.origin_ns) / 1e3
        dur = (wall - start) * 1e6
        self._write(step, (DRIVER_PID, 0, "step", f"step {step}", begin, dur, None))
        pending, self.pending = self.pending, []
        for ev in pending:
            self._route(ev)
        self._file.flush()
        self.cost_s += time.perf_counter() - t0

    def close(self) -> None:
        """Write what is left (events after the last step go to a step ``last + 1``), a
        ``trace summary`` event, and the closing bracket."""
        with self._lock:
            if not self._file.closed:
                self._close()

    def _close(self) -> None:
        self._take_driver()
        events.enable(False)
        after = (self.steps[-1] + 1) if self.steps else 0
        for ev in self.pending:
            self._write(after, ev)
        summary = {
            "steps_written": sum(self.keep.values()),
            "steps_left_out": self.skipped_steps,
            "events_dropped": self.dropped,
            "max_bytes": self.max_bytes,
            "origin_unix_s": self.origin_ns / 1e9,
            "driver_cost_s": round(self.cost_s, 6),
        }
        doc = {"name": "trace summary", "ph": "i", "s": "g", "ts": 0, "pid": DRIVER_PID,
               "tid": 0, "cat": "summary", "args": summary}  # fmt: skip
        self._file.write(json.dumps(doc) + "\n]\n")
        self._file.close()

    # -- writing ------------------------------------------------------------------------------

    def _take_driver(self) -> None:
        shipped = events.recorder.drain()
        if shipped is None:
            return
        wall0, mono0, _pid, evs, dropped = shipped
        self.dropped += dropped
        off = wall0 - mono0 - self.origin_ns
        for kind, name, t0, t1, _track, args in evs:
            self._route((DRIVER_PID, 0, kind, name, (t0 + off) / 1e3, (t1 - t0) / 1e3, args))

    def _route(self, ev: tuple) -> None:
        """Write ``ev`` under the step whose window it starts in, or hold it until that window
        closes."""
        start_s = (ev[4] * 1e3 + self.origin_ns) / 1e9
        i = bisect.bisect_left(self.marks, start_s)
        if i == len(self.marks):
            self.pending.append(ev)
        else:
            self._write(self.steps[i], ev)

    def _write(self, step: int, ev: tuple) -> None:
        pid, tid, kind, name, ts, dur, args = ev
        self.totals[step][kind] += dur / 1e6
        if not self._kept(step):
            return
        args = {**(args or {}), "step": step}
        doc = {"name": name, "cat": kind, "ph": "X", "ts": round(ts, 3), "dur": round(dur, 3),
               "pid": pid, "tid": tid, "args": args}  # fmt: skip
        line = json.dumps(doc, default=str) + ",\n"
        if self.bytes + len(line) > self.max_bytes:
            self.dropped += 1
            return
        self._file.write(line)
        self.bytes += len(line)

    def _kept(self, step: int) -> bool:
        keep = self.keep.get(step)
        if keep is None:
            level, used = 0, self.bytes / self.max_bytes
            while used >= 1 - 0.5 ** (level + 1) and level < 60:
                level += 1
            keep = step % (2**level) == 0 and self.bytes < self.max_bytes
            self.keep[step] = keep
            self.skipped_steps += not keep
        return keep

    def _pid(self, group: str) -> int:
        pid = self.pids.get(group)
        if pid is None:
            pid = self.pids[group] = len(self.pids) + 1
            self._meta(pid, None, "process_name", {"name": group})
            self._meta(pid, None, "process_sort_index", {"sort_index": pid})
        return pid

    def _meta(self, pid: int, tid: int | None, name: str, args: dict) -> None:
        doc = {"name": name, "ph": "M", "pid": pid, "args": args}
        if tid is not None:
            doc["tid"] = tid
        line = json.dumps(doc) + ",\n"
        self._file.write(line)
        self.bytes += len(line)


def read_trace(path: str | Path) -> list[dict]:
    """The events of a trace file written by :class:`TraceWriter`, including one a killed run
    left without its closing bracket.

    Raises:
        ValueError: the file is not a trace (the message names it), or an event is not one
            of the layout above (the message names the event and what is wrong: a key
            missing, a value of the wrong type, a duration that is negative or not finite).
        OSError: the file cannot be read.
    """
    try:
        text = Path(path).read_text().rstrip()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a Chrome trace: not UTF-8 text") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if not text.startswith("["):
            raise ValueError(f"{path} is not a Chrome trace (JSON array of events): {e}") from None
        lines = text.splitlines()  # a killed run: no closing bracket, maybe a torn last line
        doc = None
        for end in (len(lines), len(lines) - 1):
            try:
                doc = json.loads("\n".join(lines[:end]).rstrip().rstrip(",") + "]")
                break
            except json.JSONDecodeError:
                continue
        if doc is None:
            raise ValueError(f"{path} is not a Chrome trace (JSON array of events): {e}") from None
    if isinstance(doc, dict):
        doc = doc.get("traceEvents", [])
    if not isinstance(doc, list):
        raise ValueError(f"{path} is not a Chrome trace (JSON array of events)")
    for i, event in enumerate(doc, 1):
        problem = _event_problem(event)
        if problem:
            raise ValueError(
                f"{path}: event {i} {problem}: not a trace m2flow writes (damaged or edited?)"
            )
    return doc


def _number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _event_problem(e) -> str | None:
    """What makes ``e`` unusable as an event of the layout above (None: nothing): a slice
    (``ph: X``) needs a ``name`` and ``cat`` (text), ``pid`` and ``tid`` (integers), a finite
    ``ts`` and a finite ``dur >= 0`` (microseconds) and ``args`` with an integer ``step``;
    metadata (``ph: M``) a ``name``, an integer ``pid`` and ``args`` (an object)."""
    if not isinstance(e, dict):
        return f"is {type(e).__name__} {json.dumps(e, default=str)[:40]}, not an object"
    ph = e.get("ph")
    if ph not in ("X", "M"):
        return None if ph is None or isinstance(ph, str) else f"has ph {ph!r}, not text"
    need = {"name": str, "pid": int, "args": dict}
    if ph == "X":
        need.update(cat=str, tid=int, ts=float, dur=float)
    for key, kind in need.items():
        if key not in e:
            return f"(ph {ph}) has no {key!r}"
        v = e[key]
        if kind is float:
            if not _number(v) or not math.isfinite(v) or abs(v) > MAX_US:
                return f"has {key} {v!r}: not a finite number of microseconds (|x| <= 1e15)"
        elif not isinstance(v, kind) or isinstance(v, bool):
            what = {str: "text", int: "an integer", dict: "an object"}[kind]
            return f"has {key} {json.dumps(v, default=str)[:40]}: not {what}"
    if ph == "X":
        if e["dur"] < 0:
            return f"has dur {e['dur']!r}: a duration is >= 0"
        step = e["args"].get("step")
        if step is None and e["cat"] == "step":
            return "(a step slice) has no args.step"
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            return f"has args.step {json.dumps(step, default=str)[:40]}: not an integer"
    if e["name"] == "process_name" and not isinstance(e["args"].get("name"), str):
        return "(process_name) has no args.name text"
    return None


def drain_groups(writer: TraceWriter, groups, timeout: float = 10.0) -> None:
    """Add what the ranks of ``groups`` recorded since their last call (an offload served
    after it); ranks that do not answer within ``timeout`` seconds in all (dead, or gone with
    Ray) are skipped: their last events are lost."""
    import ray

    asked = {}
    for group in groups:
        for rank, actor in enumerate(group.actors):
            asked[actor._m2flow_drain_events.remote()] = (group.name, rank)
    try:
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout)
    except Exception:  # noqa: BLE001 (Ray going down: nothing more to collect)
        return
    for ref in ready:
        try:
            writer.add(*asked[ref], ray.get(ref))
        except Exception:  # noqa: BLE001 (a rank that died: its last events are lost)
            continue
