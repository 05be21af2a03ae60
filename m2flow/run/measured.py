"""A measured step beside the planner's prediction: read from ``trace.json`` and the plan.

- :func:`measured_step`: one step of a trace (:mod:`m2flow.core.tracefile`): each rank's events
  relative to the step's start, and per group its busy seconds (its calls' durations less
  their lock and data waits, max over ranks, as the profiler measures busy time) and the span
  from its first call's start to its last call's end.
- :func:`predicted_step`: the same for the plan that ran (:attr:`Placement.plan
  <m2flow.core.placement.Placement>`), from :func:`m2flow.scheduler.plan.timeline.step_timeline`.
- :func:`compare`: per group, predicted and measured busy time and end, and the differences.
- :func:`unpriced`: what the run spent per step on what the profile has no price for (device
  lock waits, hand-offs) or prices apart (offload + onload against ``switch_s``).
- :func:`machine` and :func:`provenance_warnings`: where a profile was measured, and the
  warnings when this run is elsewhere (another host, CPU or GPU model, device count out of the
  profiled range, or another load).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

WORK_KINDS = ("call", "weight_sync")  # events that are a group's own (busy) time
LOAD_RATIO = 1.5  # a load this many times the other's (and 1 more) counts as another load


# -- where ------------------------------------------------------------------------------------


def load_1m() -> float:
    """The 1-minute load average (0.0 where the OS has none)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return 0.0


def machine(load: float | None = None) -> dict[str, Any]:
    """``{"host", "cpu", "cpus", "gpu", "load_1m"}`` of this machine; ``load`` replaces the
    current 1-minute load average (a profile's mean over its runs)."""
    return {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "gpu": _gpu_model(),
        "load_1m": round(load_1m() if load is None else float(load), 2),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_model() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    names = out.stdout.strip().splitlines()
    return names[0].strip() if names else None


def provenance_warnings(plan: dict, num_devices: int | None, here: dict) -> list[str]:
    """Why the plan's profile may not hold for this run, one line each (empty: nothing seen).

    Args:
        plan: :attr:`Placement.plan <m2flow.core.placement.Placement>` (``measured_on``,
            ``profiled_devices``).
        num_devices: the devices this run planned for.
        here: :func:`machine` of this run.
    """
    if not plan:
        return []
    out = []
    where = plan.get("measured_on")
    if not where:
        out.append(
            "the profile does not say where it was measured (no measured_on): its times may "
            "come from another machine or load; profile here with `m2flow profile`"
        )
    else:
        diff = [k for k in ("host", "cpu", "cpus", "gpu") if where.get(k) != here.get(k)]
        if diff:
            was = ", ".join(f"{k} {where.get(k)}" for k in diff)
            now = ", ".join(f"{k} {here.get(k)}" for k in diff)
            out.append(
                f"the profile was measured on another machine ({was}; this run: {now}): its "
                "times may not hold here; profile here with `m2flow profile`"
            )
        a, b = float(where.get("load_1m") or 0.0), float(here.get("load_1m") or 0.0)
        if max(a, b) > LOAD_RATIO * min(a, b) + 1.0:
            out.append(
                f"the profile was measured at load {a:.1f}, this run ended at load {b:.1f} "
                "(1-minute load average): on shared CPUs times scale with the load"
            )
    counts = sorted({n for ns in (plan.get("profiled_devices") or {}).values() for n in ns})
    if counts and num_devices is not None and not counts[0] <= num_devices <= counts[-1]:
        out.append(
            f"planned for {num_devices} devices, but the profile measured "
            f"{', '.join(map(str, counts))} devices: its fits extrapolate; profile up to "
            f"{num_devices} devices (m2flow profile --devices)"
        )
    return out


# -- measured -----------------------------------------------------------------------------------


@dataclass
class Bar:
    """One event of a step: seconds from the step's start."""

    kind: str
    name: str
    start: float
    end: float


@dataclass
class GroupTimes:
    """A group's times in one step, seconds: ``busy`` (max over ranks), ``start`` and ``end``
    of its calls (from the step's start); ``None`` where it ran no call."""

    busy: float = 0.0
    start: float | None = None
    end: float | None = None


@dataclass
class MeasuredStep:
    """``rows``: ``(group, rank)`` -> its events; ``groups``: group -> :class:`GroupTimes`;
    ``duration``: seconds of the step's window; ``totals``: kind -> seconds summed over
    every process."""

    step: int
    duration: float
    rows: dict[tuple[str, int], list[Bar]] = field(default_factory=dict)
    groups: dict[str, GroupTimes] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)


def trace_steps(trace: list[dict]) -> dict[int, tuple[float, float]]:
    """Step -> ``(start, duration)`` in microseconds, from the driver's ``step`` slices."""
    return {
        int(e["args"]["step"]): (float(e["ts"]), float(e["dur"]))
        for e in trace
        if e.get("cat") == "step" and e.get("ph") == "X"
    }


def measured_step(trace: list[dict], step: int) -> MeasuredStep:
    """Step ``step`` of a trace (events whose ``args.step`` is ``step``).

    Raises:
        KeyError: the trace holds no such step (the message lists those it holds).
    """
    steps = trace_steps(trace)
    if step not in steps:
        have = sorted(s for s in steps if any(_in_step(e, s) for e in trace))
        raise KeyError(f"step {step} is not in the trace; it holds steps {_ranges(have)}")
    t0, dur = steps[step]
    names = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    out = MeasuredStep(step, dur / 1e6)
    busy: dict[tuple[str, int], float] = {}
    totals: dict[str, float] = {}
    for e in trace:
        if e.get("ph") != "X" or not _in_step(e, step) or e.get("cat") == "step":
            continue
        kind, start, end = e["cat"], (e["ts"] - t0) / 1e6, (e["ts"] + e["dur"] - t0) / 1e6
        totals[kind] = totals.get(kind, 0.0) + e["dur"] / 1e6
        if e["pid"] == 0:
            key = ("driver", 0)
        else:
            key = (names.get(e["pid"], f"pid {e['pid']}"), int(e["tid"]) // 2)
        out.rows.setdefault(key, []).append(Bar(kind, e["name"], start, end))
        if kind in WORK_KINDS and key[0] != "driver":
            wait = float(e.get("args", {}).get("wait_s", 0.0))
            busy[key] = busy.get(key, 0.0) + max(e["dur"] / 1e6 - wait, 0.0)
            g = out.groups.setdefault(key[0], GroupTimes())
            g.start = start if g.start is None else min(g.start, start)
            g.end = end if g.end is None else max(g.end, end)
    for (group, _), b in busy.items():
        out.groups[group].busy = max(out.groups[group].busy, b)
    out.totals = totals
    return out


def _in_step(e: dict, step: int) -> bool:
    args = e.get("args")
    return isinstance(args, dict) and args.get("step") == step and e.get("ph") == "X"


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    if not xs:
        return "none"
    parts, a, prev = [], xs[0], xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(a) if a == prev else f"{a}-{prev}")
        if x is not None:
            a = prev = x
    return ", ".join(parts)


# -- predicted ----------------------------------------------------------------------------------


def predicted_step(plan: dict, predicted_busy: dict[str, float] | None = None):
    """``(timeline, groups)`` of the plan that ran: the
    :class:`~m2flow.scheduler.plan.timeline.Timeline` and group -> :class:`GroupTimes`
    (``busy`` from ``predicted_busy``, the placement's ``predicted``, else the bars' sum).

    Raises:
        ValueError: ``plan`` holds no planner tree (a placement not planned from a profile).
    """
    from ..scheduler.plan.timeline import step_timeline
    from ..scheduler.plan.tree import Plan

    if not plan or "tree" not in plan:
        raise ValueError("the run's placement was not planned from a profile: no prediction")
    tree = Plan.from_dict(plan["tree"])
    tl = step_timeline(tree, plan.get("switch_s"), plan.get("chunk_overhead_s"))
    members = {lf.name: list(lf.components) for lf in tree.leaves()}
    groups: dict[str, GroupTimes] = {}
    for b in tl.bars:
        for comp in [b.component] if b.component not in members else members[b.component]:
            g = groups.setdefault(comp, GroupTimes())
            g.start = b.start if g.start is None else min(g.start, b.start)
            g.end = b.end if g.end is None else max(g.end, b.end)
            if b.kind in ("compute", "switch", "busy"):
                g.busy += b.end - b.start
    for comp, t in (predicted_busy or {}).items():
        groups.setdefault(comp, GroupTimes()).busy = float(t)
    return tl, groups


def compare(measured: MeasuredStep, predicted: dict[str, GroupTimes] | None) -> list[dict]:
    """Per group (sorted): predicted and measured ``busy`` and ``end`` seconds and the
    differences measured - predicted (``None`` where a side has no figure)."""
    predicted = predicted or {}
    rows = []
    for g in sorted(set(measured.groups) | set(predicted)):
        m, p = measured.groups.get(g), predicted.get(g)
        row = {
            "group": g,
            "predicted_busy_s": None if p is None else p.busy,
            "measured_busy_s": None if m is None else m.busy,
            "predicted_end_s": None if p is None else p.end,
            "measured_end_s": None if m is None else m.end,
        }
        for what in ("busy", "end"):
            a, b = row[f"measured_{what}_s"], row[f"predicted_{what}_s"]
            row[f"diff_{what}_s"] = None if a is None or b is None else a - b
        rows.append(row)
    return rows


def unpriced(totals: dict[int, dict[str, float]], steps: list[int], plan: dict) -> dict:
    """Median seconds per step (summed over ranks) of what a profile does not price --
    ``lock_wait_s`` (device-lock waits, offloading the previous holder and onloading
    included) and ``handoff_s`` (devices yielded while a call waits for data) -- and of
    offload + onload (``switch_s``) beside what the profile prices for them
    (``switch_priced_s``: ``switch_s`` of the time-shared components)."""
    if not steps:
        return {}

    def med(kinds: tuple[str, ...]) -> float:
        return statistics.median(sum(totals.get(s, {}).get(k, 0.0) for k in kinds) for s in steps)

    out = {
        "lock_wait_s": med(("lock_wait",)),
        "handoff_s": med(("handoff",)),
        "switch_s": med(("offload", "onload")),
        "channel_wait_s": med(("channel_get", "channel_put", "recv")),
        "weight_sync_s": med(("weight_sync",)),
    }
    if plan and "tree" in plan:
        from ..scheduler.plan.tree import Plan

        shared = [c for lf in Plan.from_dict(plan["tree"]).leaves() if lf.shared
                  for c in lf.components]  # fmt: skip
        out["switch_priced_s"] = sum(float(plan.get("switch_s", {}).get(c, 0.0)) for c in shared)
    return out


def unpriced_line(u: dict) -> str:
    """One line for the step report (empty without figures)."""
    if not u:
        return ""
    line = (
        f"not priced by the profile (median s/step, summed over ranks): device-lock waits "
        f"{u['lock_wait_s']:.3f}, hand-offs while waiting for data {u['handoff_s']:.3f}; "
        f"offload+onload {u['switch_s']:.3f}"
    )
    if "switch_priced_s" in u:
        line += f" (priced {u['switch_priced_s']:.3f})"
    return line + "; see trace.json and `m2flow timeline`"
