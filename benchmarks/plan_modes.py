"""Predicted vs measured step time of a runner (GRPO by default) under each plan mode, side
by side.

    python benchmarks/plan_modes.py [--profile grpo_profile.yaml] [--devices 2] [--steps 30]
    python benchmarks/plan_modes.py --workflow workflows/embodied.py --devices 3 \
        --modes auto --plan-files spatial_yaml=workflows/plans/embodied_spatial.yaml \
        --metric env_steps_per_s

Every run resumes from one shared warm-started checkpoint (so no run pays the warm start and
all start from the same weights). Without ``--profile`` the workflow is first profiled here,
from that checkpoint, side by side with the measurements (same machine, same minutes, same
policy; the profile is written next to the JSON). For each mode (temporal, hybrid, spatial and
the planner's own pick, ``auto``) the planner plans the profiled workflow on ``--devices``
virtual devices; the unchanged runner (``--workflow``) then runs ``--steps`` steps under
that plan, ``--repeats`` times, round-robin over the modes and the hand-written plans of
``--plan-files`` (``NAME=PATH``, measured alongside, no prediction). A mode the planner finds
infeasible on this cluster (spatial needs a device per group) is reported as such, not run.
``--metric KEY`` also reports the median of that per-step metric from the runs'
``metrics.jsonl`` (e.g. the embodied runner's ``env_steps_per_s``), per run and pooled.

Measured step time of a mode: the median of its steps pooled over its runs (after ``--skip``
steps of each). The spread of the per-run medians around it (half the range, relative) is
the noise floor a prediction error can be judged against. Per group, the measured busy
seconds per step are printed next to the profile's, to show which component a miss comes
from. JSON goes to ``benchmarks/results/plan_modes.json``.

RLinf's targets for the prediction error: < 2 % temporal, < 5 % spatial.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from m2flow.core.cluster import GiB
from m2flow.core.config import ConfigError
from m2flow.core.placement import Placement
from m2flow.run.planning import load_profile, plan_from_profile, profile_to_file
from m2flow.run.session import Session
from m2flow.run.workflow import run_workflow

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = str(ROOT / "workflows" / "grpo.py")  # --workflow


def _run(overrides: list[str], placement) -> Session:
    return run_workflow(WORKFLOW, overrides, plan=placement)


def _use_workflow(path: str) -> None:
    global WORKFLOW
    WORKFLOW = str(path)


def _metric(run_dir: Path, key: str, first_step: int) -> list[float]:
    """Per logged step >= ``first_step``: the value of ``key`` in ``metrics.jsonl``."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step[rec["step"]] = rec
    return [by_step[s][key] for s in sorted(by_step) if s >= first_step and key in by_step[s]]


def _cpu_jiffies() -> tuple[int, int] | None:
    """``(steal, total)`` CPU jiffies of this machine so far, or None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


def _steal(before, after) -> float | None:
    """Fraction of CPU time stolen by the hypervisor between two :func:`_cpu_jiffies`."""
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


@dataclass
class Runs:
    """The runs of one plan: steps pooled, run medians, busy seconds per group, CPU stolen."""

    steps: list[float] = field(default_factory=list)
    medians: list[float] = field(default_factory=list)
    busy: dict[str, list[float]] = field(default_factory=dict)
    steal: list[float | None] = field(default_factory=list)
    metric: list[float] = field(default_factory=list)  # --metric, steps pooled
    metric_medians: list[float] = field(default_factory=list)

    def measure(self, overrides: list[str], placement, skip: int, metric: str = "") -> None:
        """Run once under ``placement`` and record it, the first ``skip`` steps left out."""
        before = _cpu_jiffies()
        session = _run(overrides, placement)
        if metric:
            run_dir = Path(next(o for o in overrides if o.startswith("trainer.run_dir="))[16:])
            first = 2 + skip  # resumed after the warm start's step 1
            values = _metric(run_dir, metric, first)
            self.metric += values
            self.metric_medians.append(statistics.median(values))
        self.steal.append(_steal(before, _cpu_jiffies()))
        times = session.step_times()[skip:]
        self.steps += times
        self.medians.append(statistics.median(times))
        for group, xs in _busy(session, skip).items():
            self.busy.setdefault(group, []).extend(xs)

    def busy_s(self) -> dict[str, float]:
        """Group -> median busy seconds per step over every run."""
        return {g: statistics.median(xs) for g, xs in self.busy.items()}


def warm_start(work: Path, common: list[str]):
    """Warm-start the runner once into ``work/warm`` (the previous ``work`` is removed);
    returns ``resumed(name) -> overrides``: a fresh run directory ``work/name`` holding a copy
    of that checkpoint, and the overrides that resume from it without saving."""
    shutil.rmtree(work, ignore_errors=True)
    base = work / "warm"
    t0 = time.time()
    _run(common + ["trainer.steps=1", "trainer.save_every=1", f"trainer.run_dir={base}"], None)
    print(f"shared warm start: {time.time() - t0:.0f} s")

    def resumed(name: str) -> list[str]:
        run_dir = work / name
        shutil.copytree(base, run_dir, ignore=shutil.ignore_patterns("ray"))
        return common + [f"trainer.save_every={10**9}", f"trainer.run_dir={run_dir}", "resume=true"]

    return resumed


def _busy(session: Session, skip: int) -> dict[str, list[float]]:
    """Group -> busy seconds of each measured step."""
    out: dict[str, list[float]] = {}
    for step in session.busy_per_step()[skip:]:
        for group, busy in step.items():
            out.setdefault(group, []).append(busy)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="profile from `m2flow profile` (default: profile here)")
    ap.add_argument(
        "--profile-steps",
        type=int,
        help="steps per profiled point (default: the measured window, --steps less --skip)",
    )
    ap.add_argument("--devices", type=int, default=2, help="virtual devices (one per core)")
    ap.add_argument("--steps", type=int, default=30, help="steps measured per run")
    ap.add_argument("--skip", type=int, default=3, help="steps of each run left out")
    ap.add_argument(
        "--modes",
        default="temporal@1,temporal,hybrid,spatial,auto",
        help="modes to plan and run; MODE@N plans on N of the devices (temporal@1 is the "
        "profile's own 1-device run, the control)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode, round-robin")
    ap.add_argument("--work", default="scratch/plan_modes", help="run directories")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan_modes.json"))
    ap.add_argument("--workflow", default=WORKFLOW, help="the runner (default: GRPO)")
    ap.add_argument(
        "--plan-files",
        default="",
        help="hand-written plans measured alongside: NAME=PATH,NAME=PATH (no prediction)",
    )
    ap.add_argument("--metric", default="", help="per-step metric to report (metrics.jsonl)")
    args = ap.parse_args()
    _use_workflow(args.workflow)

    common = [f"cluster.devices_per_node={args.devices}", "trainer.eval_every=100000"]
    resumed = warm_start(Path(args.work), common)

    profile_path = args.profile
    if profile_path is None:
        profile_path = Path(args.out).with_name("plan_modes_profile.yaml")
        t0 = time.time()
        # The same steps as each measured run: skip the first --skip, measure the rest.
        window = args.profile_steps or args.steps - args.skip
        profile_to_file(
            WORKFLOW, resumed("profile"), [], profile_path, steps=window, warmup=args.skip
        )
        print(f"profiled side by side in {time.time() - t0:.0f} s: {profile_path}")
    prof = load_profile(profile_path)

    plans, rows, same = {}, [], {}
    for mode in args.modes.split(","):
        kind, _, n = mode.partition("@")
        try:
            plan = plan_from_profile(prof, int(n or args.devices), 16 * GiB, kind)
        except ConfigError as e:
            rows.append({"mode": mode, "feasible": False, "why": str(e)})
            print(f"{mode}: infeasible: {e}")
            continue
        twin = next((m for m, (_, pl) in plans.items() if pl.tree == plan[1].tree), None)
        if twin is None:
            plans[mode] = plan
        else:  # e.g. auto picks the hybrid plan: run it once, report it under both names
            same[mode] = twin
            print(f"{mode}: the same plan as {twin}, measured once")
    for item in filter(None, args.plan_files.split(",")):
        name, _, path = item.partition("=")
        hand = Placement.load(path)
        hand.tree = hand.tree or f"hand-written {path}: {hand.groups}"
        plans[name] = (None, hand)
    # Round-robin over modes, so slow drift on a shared machine hits every mode alike.
    runs = {m: Runs() for m in plans}
    for rep in range(args.repeats):
        for mode, (_, placement) in plans.items():
            overrides = resumed(f"{mode}-{rep}") + [f"trainer.steps={1 + args.steps}"]
            runs[mode].measure(overrides, placement, args.skip, args.metric)
            stolen = runs[mode].steal[-1]
            shown = "" if stolen is None else f", {stolen:.1%} CPU stolen"
            if args.metric:
                shown += f", {args.metric} {runs[mode].metric_medians[-1]:.4g}"
            print(f"{mode} run {rep}: {runs[mode].medians[-1]:.4f} s/step{shown}")
    for mode, (_, placement) in plans.items():
        r = runs[mode]
        measured = statistics.median(r.steps)
        predicted = placement.predicted_step_s
        rows.append(
            {
                "mode": mode,
                "feasible": True,
                "plan": placement.tree,
                "groups": placement.groups,
                "granularity": placement.granularity,
                "predicted_step_s": predicted,
                "measured_step_s": measured,
                "measured_runs_s": r.medians,
                "steal_per_run": r.steal,
                "run_spread": (max(r.medians) - min(r.medians)) / 2 / measured,
                "error": None if predicted is None else (measured - predicted) / measured,
                "busy_s": r.busy_s(),
                **(
                    {
                        "metric": args.metric,
                        "metric_median": statistics.median(r.metric),
                        "metric_runs": r.metric_medians,
                        "metric_spread": (max(r.metric_medians) - min(r.metric_medians))
                        / 2
                        / statistics.median(r.metric),
                    }
                    if args.metric
                    else {}
                ),
            }
        )

    for mode, twin in same.items():
        row = next(r for r in rows if r.get("mode") == twin)
        rows.append({**row, "mode": mode, "same_plan_as": twin})

    ran = [r for r in rows if r["feasible"] and r["mode"] != "auto"]
    auto = next((r for r in rows if r["mode"] == "auto" and r["feasible"]), None)
    print(f"\n{'mode':<10} {'predicted s':>12} {'measured s':>11} {'error':>8} {'spread':>7}  plan")
    for r in rows:
        if not r["feasible"]:
            print(f"{r['mode']:<10} {'infeasible':>12}")
            continue
        first = r["plan"].splitlines()[0]
        pred = "-" if r["predicted_step_s"] is None else f"{r['predicted_step_s']:.4f}"
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        extra = (
            f"  [{args.metric} {r['metric_median']:.4g}, spread {r['metric_spread']:.1%}]"
            if args.metric
            else ""
        )
        print(
            f"{r['mode']:<10} {pred:>12} {r['measured_step_s']:>11.4f} "
            f"{err:>8} {r['run_spread']:>7.1%}  {first}{extra}"
        )
    print("\nbusy seconds per step, measured (profile on 1 device):")
    for r in rows:
        if r["feasible"]:
            shown = ", ".join(
                f"{g} {b:.3f} ({prof.components[g].points[0].seconds:.3f})"
                for g, b in r["busy_s"].items()
                if g in prof.components
            )
            print(f"  {r['mode']:<10} {shown}")
    summary = {
        "devices": args.devices,
        "steps": args.steps,
        "repeats": args.repeats,
        "profile": str(profile_path),
        "step_overhead_s": prof.step_overhead_s,
        "rows": rows,
    }
    if ran and auto is not None:
        fastest = min(ran, key=lambda r: r["measured_step_s"])
        summary["planner_pick"] = auto["plan"].splitlines()[0]
        summary["fastest_measured"] = fastest["mode"]
        summary["pick_vs_fastest"] = auto["measured_step_s"] / fastest["measured_step_s"]
        print(
            f"\nplanner's pick measured {auto['measured_step_s']:.4f} s/step; fastest "
            f"measured mode {fastest['mode']} {fastest['measured_step_s']:.4f} s/step "
            f"(ratio {summary['pick_vs_fastest']:.3f})"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
