"""Driver-side overhead of a GRPO step: a baseline m2flow against a candidate, interleaved.

    python benchmarks/step_overhead.py [--baseline REV] [--candidate tree|REV|DIR] \\
        [--repeats 3] [--steps 15] [--skip 3]

**Definition.** For a measured step ``s`` of ``workflows/grpo.py`` under ``plan=temporal`` on
one virtual device (``cluster.devices_per_node=1``: every group has one rank on device 0):

    overhead(s) = wall(s) - sum over groups g of busy_g(s)

``wall(s)``: seconds between the run log's marks of steps ``s - 1`` and ``s``
(``Session.marks``). ``busy_g(s)``: seconds group ``g`` worked in the calls the driver waited
for between those marks (``Session.calls``): per call, the rank's duration less its waits for
the device lock and for data (``CallStats.busy``), summed over the group's calls, the weight
sync's two calls included. On one device the device lock runs the groups one at
a time, so the sum of their busy times is the step's critical path of group work, and the rest
is what no group accounts for: the driver's own work (prompts, dispatch, waits, logging) and
the runtime's hand-offs between groups (channel round trips, lock grants, end-of-step markers,
call returns). The profiler's ``step_overhead_s`` (:mod:`m2flow.run.profiler`) is the same
quantity less the groups' switch costs (zero here: virtual devices do not offload).

Every run resumes from one shared warm-started checkpoint (warm-started once, here, with the
candidate) in a fresh process and measures ``--steps`` steps after ``--skip`` warm-up steps;
the run's last step (which evaluates and saves a checkpoint) is not measured. Runs alternate
``baseline, candidate, baseline, ...`` so drift on a shared machine hits both alike. Each
variant is the package (``m2flow``, ``workers``, ``scheduler``, ``workflows``) as of a git
revision (``git archive``), or the working tree (``--candidate tree``, the default), or a
directory laid out like an export. Per variant it reports the median of every measured step
pooled over its runs, the per-run medians and their spread (half the range of the run
medians, seconds). Results go to ``benchmarks/results/step_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRPO = str(ROOT / "workflows" / "grpo.py")
COMMON = [
    "cluster.devices_per_node=1",
    "trainer.eval_every=1000000",
    "warm_start.time_budget_s=60",
]


def _child(args) -> None:
    """In a fresh process: one run; writes its per-step records as JSON to ``args.result``."""
    import m2flow
    from m2flow.run.workflow import run_workflow

    overrides = json.loads(args.overrides)
    t0 = time.time()
    session = run_workflow(args.workflow, overrides, plan="temporal")
    steps = [
        {**_step(session, i), "step": session.marks[i][0]} for i in range(1, len(session.marks))
    ]
    Path(args.result).write_text(
        json.dumps({"m2flow": str(Path(m2flow.__file__).parent), "steps": steps,
                    "run_s": time.time() - t0})
    )  # fmt: skip


def _step(session, i: int) -> dict:
    """Wall, group busy seconds and overhead of the step logged at ``session.marks[i]``: the
    calls waited between marks ``i - 1`` and ``i``. (Paired by mark here: on a resumed run,
    which logs no step 0, ``Session.step_times()`` starts one step later than
    ``Session.busy_per_step()``.)"""
    wall = session.marks[i][1] - session.marks[i - 1][1]
    busy: dict[str, float] = {}
    for c in session.calls:
        if c.step == i:
            busy[c.group] = busy.get(c.group, 0.0) + c.busy
    return {"wall_s": wall, "busy_s": busy, "overhead_s": wall - sum(busy.values())}


def _run_child(src: Path | None, overrides: list[str], result: Path) -> dict:
    """Run :func:`_child` with ``m2flow`` (and its workflow) from ``src`` (``None``: this
    tree, as installed)."""
    env = dict(os.environ)
    workflow = GRPO
    if src is not None:  # Ray's workers inherit the path, so they import the same m2flow
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(":")
        workflow = str(src / "workflows" / "grpo.py")
    cmd = [sys.executable, __file__, "--child", "--result", str(result), "--workflow", workflow]
    cmd += ["--overrides", json.dumps(overrides)]
    # Ray's workers put the driver's working directory first on their path: run it in src.
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=src or ROOT)
    return json.loads(result.read_text())


def _export(rev: str, dest: Path) -> Path:
    """The package (``m2flow/``, ``workers/``, ``scheduler/``, ``workflows/``) as of git
    revision ``rev``, unpacked under ``dest``, its subpackages linked where ``m2flow`` imports
    them (the installed package maps them from this tree otherwise)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    parts = ["m2flow", "workers", "scheduler", "workflows"]
    archive = subprocess.run(
        ["git", "archive", rev, *parts], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for sub in parts[1:]:
        (dest / "m2flow" / sub).symlink_to(Path("..") / sub)
    return dest


def _source(spec: str, dest: Path) -> Path | None:
    """A variant's source: ``tree`` (this working tree, ``None``), a prepared directory laid
    out as :func:`_export` makes it, or a git revision (exported)."""
    if spec == "tree":
        return None
    if Path(spec).is_dir():
        return Path(spec).resolve()
    return _export(spec, dest)


def _measured(run: dict, skip: int) -> list[dict]:
    """The measured steps of a run: after ``skip``, before the last (it evaluates, saves)."""
    return run["steps"][skip:-1]


def _summary(runs: list[dict], skip: int) -> dict:
    per_run = [[s["overhead_s"] for s in _measured(r, skip)] for r in runs]
    walls = [s["wall_s"] for r in runs for s in _measured(r, skip)]
    pooled = [x for xs in per_run for x in xs]
    medians = [statistics.median(xs) for xs in per_run]
    return {
        "overhead_s": statistics.median(pooled),
        "run_medians_s": medians,
        "spread_s": (max(medians) - min(medians)) / 2,
        "step_s": statistics.median(walls),
        "steps": len(pooled),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="a git revision, or a dir, or tree")
    ap.add_argument(
        "--candidate", default="tree", help="tree (this working tree), a git revision, or a dir"
    )
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved")
    ap.add_argument("--steps", type=int, default=15, help="measured steps per run")
    ap.add_argument("--skip", type=int, default=3, help="steps of each run left out first")
    ap.add_argument("--work", default="scratch/step_overhead", help="run directories")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_overhead.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", help=argparse.SUPPRESS)
    ap.add_argument("--workflow", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)

    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    variants = {
        "baseline": _source(args.baseline, work / "baseline_src"),
        "candidate": _source(args.candidate, work / "candidate_src"),
    }

    warm = work / "warm"
    t0 = time.time()
    _run_child(variants["candidate"], COMMON + ["trainer.steps=1", "trainer.save_every=1",
                               f"trainer.run_dir={warm}"], work / "warm.json")  # fmt: skip
    print(f"shared warm start: {time.time() - t0:.0f} s", flush=True)

    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        for name, src in variants.items():
            run_dir = work / f"{name}-{rep}"
            shutil.copytree(warm, run_dir, ignore=shutil.ignore_patterns("ray"))
            overrides = COMMON + [
                f"trainer.steps={1 + args.skip + args.steps + 1}",
                f"trainer.save_every={10**9}",
                f"trainer.run_dir={run_dir}",
                "resume=true",
            ]
            load = os.getloadavg()[0]
            res = _run_child(src, overrides, work / f"{name}-{rep}.json")
            res["load_avg_1m"] = load
            runs[name].append(res)
            xs = [s["overhead_s"] for s in _measured(res, args.skip)]
            ws = [s["wall_s"] for s in _measured(res, args.skip)]
            print(
                f"{name} run {rep}: overhead {statistics.median(xs):.4f} s of a "
                f"{statistics.median(ws):.4f} s step (load {load:.1f}; m2flow {res['m2flow']})",
                flush=True,
            )

    summary = {v: _summary(rs, args.skip) for v, rs in runs.items()}
    before, after = summary["baseline"]["overhead_s"], summary["candidate"]["overhead_s"]
    out = {
        "benchmark": "step_overhead",
        "definition": "wall(step) - sum of group busy seconds in the step; GRPO, plan=temporal, "
        "1 virtual device (see benchmarks/step_overhead.py)",
        "baseline": args.baseline,
        "candidate": args.candidate,
        "config": {
            "repeats": args.repeats,
            "steps": args.steps,
            "skip": args.skip,
            "overrides": COMMON,
        },  # fmt: skip
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "summary": summary,
        "after_over_before": after / before,
        "runs": runs,
    }
    for name, s in summary.items():
        shown = ", ".join(f"{m:.4f}" for m in s["run_medians_s"])
        print(
            f"{name:>8}: overhead {s['overhead_s']:.4f} s (runs {shown}; spread "
            f"±{s['spread_s']:.4f}) of a {s['step_s']:.4f} s step"
        )
    print(f"after / before: {after / before:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
