"""``m2flow timeline``: a measured step of a run beside the planner's predicted one.

    m2flow timeline runs/grpo                       # the last step: per-group table
    m2flow timeline runs/grpo --step 12 -o step12.png

Reads ``<run>/trace.json`` (written by every run, :mod:`m2flow.core.tracefile`) and, when the run
was planned from a profile, ``<run>/plan_report.json`` (its ``plan``: the planner's tree and
costs). Prints, per group, the predicted and measured busy seconds and the end of its last
call within the step, with the differences, the step's seconds per event kind (lock waits,
hand-offs, offload/onload, channel waits, weight syncs), and the report's warnings (a profile
measured elsewhere). ``-o`` draws both Gantt charts on one time axis (matplotlib): the
predicted step (one row per device range of the plan) above the measured one (one row per
group rank; calls in the group's colour, lock waits, hand-offs, channel waits and
offload/onload over them). ``--json`` prints the figures as one JSON document.

``-o DIR`` (an existing directory) writes ``DIR/timeline_step<N>.png``.

Bad input prints one line on stderr and exits 2: no such run directory, no trace, a step the
trace does not hold, an unwritable ``-o``, and a trace or plan report that is not what a run
writes -- truncated or not JSON, an array of non-events, an event missing a key or with a
value of the wrong type, a negative or non-finite duration or time (refused, never printed as
a number), a report that is not an object or whose plan the planner cannot read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

PALETTE = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
]  # fmt: skip
#: How the measured chart draws the runtime's events over the calls.
OVERLAY = {
    "lock_wait": {"facecolor": "#d62728", "label": "device-lock wait"},
    "handoff": {"facecolor": "#ffffff", "hatch": "xx", "edgecolor": "#999999",
                "label": "devices handed off (waiting for data)"},
    "offload": {"facecolor": "#dddddd", "hatch": "///", "edgecolor": "#888888",
                "label": "offload / onload"},
    "onload": {"facecolor": "#dddddd", "hatch": "///", "edgecolor": "#888888"},
    "channel_get": {"facecolor": "#c7c7c7", "label": "channel / recv wait"},
    "channel_put": {"facecolor": "#c7c7c7"},
    "recv": {"facecolor": "#c7c7c7"},
    "weight_sync": {"facecolor": "#17becf", "label": "weight sync"},
    "reward_service": {"facecolor": "#bcbd22", "label": "reward service"},
    "spot": {"facecolor": "#8c564b", "label": "spot"},
}  # fmt: skip


def load_run(run_dir: Path):
    """``(trace events, plan report or {})`` of a run directory.

    Raises:
        ValueError: no such directory, no trace, or an unreadable one.
    """
    from ..core.tracefile import read_trace

    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run directory")
    path = run_dir / "trace.json"
    if not path.is_file():
        raise ValueError(
            f"{path} does not exist: a run writes it unless M2FLOW_TRACE=0 (runs of m2flow "
            "before the trace existed have none)"
        )
    report = {}
    rp = run_dir / "plan_report.json"
    if rp.is_file():
        try:
            report = json.loads(rp.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{rp} is not valid JSON: {e}") from None
        problem = _report_problem(report)
        if problem:
            raise ValueError(f"{rp} {problem}: not a report m2flow writes (damaged or edited?)")
    return read_trace(path), report


_JSON_TYPES = {dict: "an object", list: "an array", str: "text", bool: "a boolean"}


def _json_type(v) -> str:
    return _JSON_TYPES.get(type(v), "a number" if isinstance(v, int | float) else "null")


def _seconds(v) -> bool:
    """A finite number of seconds >= 0."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _report_problem(report) -> str | None:
    """What makes a plan report unusable (None: nothing): it is an object whose ``plan`` and
    ``unpriced`` are objects, whose ``warnings`` are a list of text, and whose times
    (``*_step_s``, ``predicted_busy_s``) are finite seconds >= 0."""
    if not isinstance(report, dict):
        return f"is {_json_type(report)}, not an object"
    for key in ("plan", "unpriced", "predicted_busy_s"):
        v = report.get(key)
        if v is not None and not isinstance(v, dict):
            return f"has {key} that is {_json_type(v)}, not an object"
    warnings = report.get("warnings", [])
    if not isinstance(warnings, list) or not all(isinstance(w, str) for w in warnings):
        return "has warnings that are not a list of text"
    times = {k: report.get(k) for k in ("predicted_step_s", "measured_step_s")}
    times.update(
        (f"predicted_busy_s.{g}", t) for g, t in (report.get("predicted_busy_s") or {}).items()
    )
    for key, v in times.items():
        if v is not None and not _seconds(v):
            return f"has {key} {v!r}: not a finite number of seconds >= 0"
    return None


def default_step(trace: list[dict]) -> int:
    """The last logged step ``>= 1`` the trace holds events of (else its last step)."""
    from .measured import trace_steps

    logged = set(trace_steps(trace))
    held = logged & {
        e["args"]["step"]
        for e in trace
        if e.get("ph") == "X" and e.get("cat") != "step" and "step" in e.get("args", {})
    }
    ones = [s for s in held if s >= 1]
    if ones or held:
        return max(ones or held)
    raise ValueError(
        "the trace holds no step with events (the run logged no step, or the file is cut short)"
    )


def timeline_doc(run_dir: Path, step: int | None) -> tuple[dict, object, object]:
    """``(document, measured step, predicted (timeline, groups) or None)``."""
    from .measured import compare, measured_step, predicted_step

    trace, report = load_run(run_dir)
    step = default_step(trace) if step is None else step
    try:
        m = measured_step(trace, step)
    except KeyError as e:
        raise ValueError(str(e.args[0])) from None
    pred = None
    plan = report.get("plan") or {}
    if plan.get("tree"):
        where = run_dir / "plan_report.json"
        try:
            pred = predicted_step(plan, report.get("predicted_busy_s"))
        except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
            raise ValueError(f"{where}: its plan is not one the planner writes: {e}") from None
        every = [(g, t) for g, x in pred[1].items() for t in (x.busy, x.start, x.end)]
        bad = [(g, t) for g, t in every if t is not None and not _seconds(t)]
        if bad or not _seconds(pred[0].end):
            g, t = bad[0] if bad else ("the step", pred[0].end)
            raise ValueError(
                f"{where}: its plan predicts {t!r} s for {g}: times are finite and >= 0 (a "
                "damaged or edited report)"
            )
    doc = {
        "run": str(run_dir),
        "step": step,
        "measured_step_s": m.duration,
        "predicted_step_s": report.get("predicted_step_s"),
        "groups": compare(m, None if pred is None else pred[1]),
        "seconds_by_kind": {k: round(v, 6) for k, v in sorted(m.totals.items())},
        "unpriced": report.get("unpriced", {}),
        "warnings": report.get("warnings", []),
    }
    return doc, m, pred


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _d(x) -> str:
    return "-" if x is None else f"{x:+.3f}"


def print_doc(doc: dict) -> None:
    pred = doc["predicted_step_s"]
    head = f"step {doc['step']} of {doc['run']}: measured {doc['measured_step_s']:.3f} s"
    head += f", predicted {pred:.3f} s" if pred else " (no prediction: not planned from a profile)"
    out.print(head, highlight=False)
    t = Table(title="per group (seconds; diff = measured - predicted)", title_justify="left")
    for col in ("group", "busy pred", "busy meas", "diff", "end pred", "end meas", "diff"):
        t.add_column(col, justify="left" if col == "group" else "right")
    for r in doc["groups"]:
        t.add_row(
            r["group"], _s(r["predicted_busy_s"]), _s(r["measured_busy_s"]), _d(r["diff_busy_s"]),
            _s(r["predicted_end_s"]), _s(r["measured_end_s"]), _d(r["diff_end_s"]),
        )  # fmt: skip
    out.print(t)
    kinds = {k: v for k, v in doc["seconds_by_kind"].items() if k != "call"}
    if kinds:
        shown = ", ".join(f"{k} {v:.3f}" for k, v in kinds.items())
        out.print(f"runtime events this step (s, summed over ranks): {shown}", highlight=False)
    for w in doc["warnings"]:
        out.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)


def draw(path: Path, doc: dict, measured, pred) -> None:
    """Predicted (top, when there is one) and measured (bottom) Gantt charts of one step on
    one time axis (matplotlib, Agg; the format from the suffix)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = sorted(measured.rows, key=lambda k: (k[0] == "driver", k))
    groups = sorted({g for g, _ in rows} - {"driver"})
    if pred is not None:
        groups += sorted({b.component for b in pred[0].bars} - set(groups))
    color = {g: PALETTE[i % len(PALETTE)] for i, g in enumerate(groups)}
    n_pred = 0 if pred is None else len(pred[0].rows)
    heights = [max(n_pred, 1), max(len(rows), 1)] if pred is not None else [max(len(rows), 1)]
    fig = Figure(figsize=(12, 1.6 + 0.45 * sum(heights)))
    axes = fig.subplots(len(heights), 1, sharex=True, height_ratios=heights, squeeze=False)[:, 0]
    end = measured.duration
    if pred is not None:
        tl = pred[0]
        ax = axes[0]
        for b in tl.bars:
            y = len(tl.rows) - 1 - b.row
            kw = {"facecolor": color.get(b.component, "#444444")}
            if b.kind == "switch":
                kw = {"facecolor": "#dddddd", "hatch": "///", "edgecolor": "#888888"}
            ax.broken_barh([(b.start, b.end - b.start)], (y - 0.4, 0.8), linewidth=0.3, **kw)
        ax.set_yticks(range(len(tl.rows)))
        ax.set_yticklabels([f"{n}  [{r.start}, {r.stop})" for n, r in reversed(tl.rows)])
        ax.set_title(f"predicted: {tl.end:.3f} s (plan tree; step overhead not drawn)", loc="left")
        end = max(end, tl.end)
    ax = axes[-1]
    for i, key in enumerate(rows):
        y = len(rows) - 1 - i
        bars = measured.rows[key]
        calls = [(b.start, b.end - b.start) for b in bars if b.kind == "call"]
        c = color.get(key[0], "#4e79a7")
        ax.broken_barh(calls, (y - 0.4, 0.8), facecolor=c, edgecolor="white", linewidth=0.3)
        for b in bars:
            kw = {k: v for k, v in OVERLAY.get(b.kind, {}).items() if k != "label"}
            if kw:
                ax.broken_barh([(b.start, b.end - b.start)], (y - 0.25, 0.5), linewidth=0.3, **kw)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([g if g == "driver" else f"{g} rank {r}" for g, r in reversed(rows)])
    ax.set_title(f"measured: step {doc['step']}, {measured.duration:.3f} s", loc="left")
    ax.set_xlabel("seconds from the step's start")
    ax.set_xlim(0, end * 1.01 or 1.0)
    handles = [Patch(facecolor=color[g], label=g) for g in groups]
    seen = {b.kind for bars in measured.rows.values() for b in bars}
    seen |= {"offload"} if "onload" in seen else set()
    seen |= {"channel_get"} if seen & {"channel_put", "recv"} else set()
    handles += [Patch(**kw) for k, kw in OVERLAY.items() if "label" in kw and k in seen]
    axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def timeline(
    run_dir: Path = typer.Argument(..., help="the run directory (trainer.run_dir)"),
    step: Optional[int] = typer.Option(None, "--step", help="the step (default: the last)"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="draw it (PNG, SVG)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document"),
) -> None:
    """Measured step of a run beside the plan's prediction: m2flow timeline runs/grpo -o t.png"""
    try:
        doc, measured, pred = timeline_doc(run_dir, step)
        if output is not None:
            output = chart_path(output, doc["step"])
            draw(output, doc, measured, pred)
    except (ValueError, OSError) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    print_doc(doc)
    if output is not None:
        out.print(f"timeline: {output}", highlight=False)


def chart_path(output: Path, step: int) -> Path:
    """Where ``-o output`` draws step ``step``: into an existing directory as
    ``timeline_step<step>.png``; a path without a suffix gets ``.png`` (matplotlib's
    default format, said here so that the path printed is the one written).

    Raises:
        ValueError: the parent directory does not exist (a typo would make a tree).
    """
    if output.is_dir():
        return output / f"timeline_step{step}.png"
    if not output.parent.is_dir():
        raise ValueError(f"cannot write {output}: {output.parent} is not a directory")
    return output if output.suffix else output.with_name(output.name + ".png")


def register(app: typer.Typer) -> None:
    app.command("timeline")(timeline)
