"""The main job trained asynchronously on CPU: ``K = 0, 1, 2`` (3 seeds) and ``K = 4`` uncorrected.

    python benchmarks/async_runs.py --launch --run-root /tmp/asyncruns   # ~10 runs, hours on CPU
    python benchmarks/async_runs.py --launch-ab --run-root /tmp/asyncruns  # throughput A/B
    python benchmarks/async_runs.py --run-root /tmp/asyncruns            # the table + JSON

Issue 32, "Measure", real runs: ``workflows/grpo.py`` at its default configuration (800 steps,
32 prompts x ``rollout.n_samples`` responses a step, ``plan=temporal`` on one virtual device)
with ``trainer.max_staleness=K``:

- ``k0_sS``: ``K = 0`` (on-policy, the default), seeds 0, 1, 2;
- ``k1_sS``, ``k2_sS``: ``K = 1, 2`` with ``actor.off_policy.correction=tis``, seeds 0, 1, 2;
- ``k4_s0``: ``K = 4`` with no correction (``actor.off_policy.allow_uncorrected=true``).

``--launch`` runs them one at a time, configurations interleaved (``k0_s0, k1_s0, k2_s0, k4_s0,
k0_s1, ...``) so drift in the machine's load hits all alike; each under ``timeout --limit-s``
(default 9000: the machine these ran on was loaded, ~4.5 s a step instead of ~0.4 s) and a
hang guard (``--stall-s``, 900: no log line or metrics record for that long stops the run and
leaves ``<name>.stalled``), its console output in ``<run-root>/<name>.log``, its exit status in
``<name>.rc``; a run with an ``.rc`` already there is skipped (rerun: delete it and the run's
directory).

**Per run** (from ``<run-root>/<name>/metrics.jsonl``): held-out accuracy after the warm start
(step 0) and at step 800; samples/s two ways, ``S`` = samples a step = ``prompts_per_step x
n_samples``:

- ``samples_per_s_wall`` (the headline): ``S x 799 / (time[800] - time[1])``, the run log's clock
  between step 1's and step 800's records. It holds the same 8 evaluations and 8 checkpoints
  for every K, so the configurations compare like for like;
- ``samples_per_s_metrics``: ``S x 800 / sum(step time)``, step time = ``step_interval_s``
  (the pipeline's period) for ``K >= 1``, ``step_s`` for ``K = 0``. Not like for like: a
  ``K >= 1`` step's interval after an evaluation step holds that evaluation and checkpoint,
  ``K = 0``'s ``step_s`` holds neither.

and the off-policy metrics averaged over steps: ``staleness_mean`` (mean), ``staleness_max``
(max), ``is_weight_mean`` (mean), ``mismatch_kl_k3`` (mean). The actor logs them only with a
correction on (``K = 0`` and the uncorrected ``K = 4`` have none). **Per configuration**: mean,
min and max over its seeds. A run that failed or did not reach step 800 is listed with its exit
status and the last 50 lines of its log. Results: ``benchmarks/results/async_runs.json``.

**Throughput A/B** (``--launch-ab``, after ``k0_s0``): the matrix's runs are tens of minutes
apart on a shared machine whose load moves samples/s by 3x, so their samples/s compare loads
as much as K. The A/B resumes ``K = 0, 1, 2`` from one checkpoint (``k0_s0``, step 700) for
50 steps each, alternated twice back to back: samples/s over steps 702..749 (no evaluation or
checkpoint inside), and each K's ratio to the ``K = 0`` run of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "async_runs.json"
STEPS = 800
TIMEOUT_S = 9000  # a wall limit: ~4.5 s a step on a loaded 2-core machine (0.4 s quiet)
STALL_S = 900  # no new log line or metrics record for this long: a hang

#: configuration -> (K, the overrides beyond the seed and the run directory)
CONFIGS = {
    "k0": (0, []),
    "k1": (1, ["trainer.max_staleness=1", "actor.off_policy.correction=tis"]),
    "k2": (2, ["trainer.max_staleness=2", "actor.off_policy.correction=tis"]),
    "k4": (4, ["trainer.max_staleness=4", "actor.off_policy.allow_uncorrected=true"]),
}
#: the run order: configurations interleaved seed by seed (k4 has seed 0 only)
ORDER = [
    ("k0", 0), ("k1", 0), ("k2", 0), ("k4", 0),
    ("k0", 1), ("k1", 1), ("k2", 1),
    ("k0", 2), ("k1", 2), ("k2", 2),
]  # fmt: skip
LABELS = {
    "k0": "K=0 (on-policy)",
    "k1": "K=1, tis",
    "k2": "K=2, tis",
    "k4": "K=4, no correction",
}


def command(config: str, seed: int, run_root: Path) -> list[str]:
    """The ``m2flow run`` command line of one run."""
    _, extra = CONFIGS[config]
    run_dir = run_root / f"{config}_s{seed}"
    return ["m2flow", "run", "workflows/grpo.py", *extra, f"trainer.seed={seed}",
            f"trainer.run_dir={run_dir}"]  # fmt: skip


def launch(run_root: Path, limit_s: int = TIMEOUT_S, stall_s: int = STALL_S) -> None:
    """Run every configuration of :data:`ORDER` in turn (skipping those with an ``.rc``).

    Each under ``timeout limit_s``; a run whose log and ``metrics.jsonl`` stay unchanged for
    ``stall_s`` seconds is stopped (SIGTERM, then SIGKILL a minute later) and marked
    ``<name>.stalled``: a hang, told apart from a slow run on a loaded machine.
    """
    run_root.mkdir(parents=True, exist_ok=True)
    for config, seed in ORDER:
        name = f"{config}_s{seed}"
        if (run_root / f"{name}.rc").exists():
            continue
        cmd = ["timeout", str(limit_s), *command(config, seed, run_root)]
        print(f"{time.strftime('%H:%M:%S')} {name}: {' '.join(cmd)}", flush=True)
        (run_root / f"{name}.t0").write_text(f"{time.time()}\n")
        watched = [run_root / f"{name}.log", run_root / name / "metrics.jsonl"]
        with open(watched[0], "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                time.sleep(10)
                last = max((p.stat().st_mtime for p in watched if p.exists()), default=0.0)
                if proc.poll() is None and time.time() - last > stall_s:
                    (run_root / f"{name}.stalled").write_text(f"{time.time()}\n")
                    proc.terminate()
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            rc = proc.wait()
        (run_root / f"{name}.t1").write_text(f"{time.time()}\n")
        (run_root / f"{name}.rc").write_text(f"{rc}\n")
        print(f"{time.strftime('%H:%M:%S')} {name}: exit {rc}", flush=True)


def samples_per_step() -> int:
    """``trainer.prompts_per_step x rollout.n_samples`` of ``workflows/grpo.py``'s defaults."""
    sys.path.insert(0, str(ROOT))
    from workflows.grpo import Config

    cfg = Config()
    return cfg.trainer.prompts_per_step * cfg.rollout.n_samples


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _tail(path: Path, lines: int = 50) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _read(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _loads(run_root: Path) -> list[tuple[float, float]]:
    """``(unix time, 1-min load average)`` from ``<run-root>/load.log`` (a sampler's
    ``date +%s; cat /proc/loadavg`` every 30 s), if there is one."""
    path, out = run_root / "load.log", []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2:
                out.append((float(parts[0]), float(parts[1])))
    return out


def run_summary(run_root: Path, config: str, seed: int, per_step: int) -> dict:
    """One run's figures (see the module docstring); ``status`` ok | running | failed | absent."""
    k, _ = CONFIGS[config]
    name = f"{config}_s{seed}"
    out = {"name": name, "config": config, "k": k, "seed": seed,
           "command": " ".join(command(config, seed, run_root))}  # fmt: skip
    rc = _read(run_root / f"{name}.rc")
    out["exit_status"] = None if rc is None else int(rc)
    t0, t1 = _read(run_root / f"{name}.t0"), _read(run_root / f"{name}.t1")
    if t0 is not None and t1 is not None:
        out["process_s"] = round(t1 - t0, 1)
    if t0 is not None:  # the machine's 1-min load average while it ran (shared machine)
        loads = [x for t, x in _loads(run_root) if t0 <= t <= (t1 or float("inf"))]
        out["load_1min_mean"] = round(_mean(loads), 2) if loads else None
    path = run_root / name / "metrics.jsonl"
    recs = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                pass
    by_step = {r["step"]: r for r in recs}
    steps = sorted(s for s in by_step if 1 <= s <= STEPS)
    out["last_step"] = steps[-1] if steps else (0 if 0 in by_step else None)
    complete = STEPS in by_step
    if complete and (rc is None or int(rc) == 0):
        out["status"] = "ok"
    elif rc is None:
        out["status"] = "running" if (run_root / f"{name}.t0").exists() else "absent"
    else:
        out["status"] = "failed"
        out["log_tail"] = _tail(run_root / f"{name}.log")
    start = by_step.get(0, {})
    out["accuracy_step0"] = start.get("heldout_accuracy")
    out["warm_start_steps"] = start.get("steps")  # at the target, or cut by its time budget
    out["warm_start_val_accuracy"] = start.get("val_accuracy")
    out["accuracy_step800"] = by_step.get(STEPS, {}).get("heldout_accuracy")
    evals = {s: by_step[s]["heldout_accuracy"] for s in sorted(by_step)
             if by_step[s].get("heldout_accuracy") is not None}  # fmt: skip
    out["heldout_accuracy_by_step"] = evals
    if not steps:
        return out
    key = "step_interval_s" if k else "step_s"
    times = [by_step[s][key] for s in steps if by_step[s].get(key) is not None]
    if complete and len(times) == STEPS:
        out["samples_per_s_metrics"] = round(per_step * STEPS / sum(times), 2)
    if complete and 1 in by_step:
        wall = by_step[STEPS]["time"] - by_step[1]["time"]
        out["steps_wall_s"] = round(wall, 1)
        out["samples_per_s_wall"] = round(per_step * (STEPS - 1) / wall, 2)
    elif 1 in by_step and steps[-1] > 1:  # unfinished: the rate so far (not in the means)
        wall = by_step[steps[-1]]["time"] - by_step[1]["time"]
        out["samples_per_s_wall_so_far"] = round(per_step * (steps[-1] - 1) / wall, 2)
    rows = [by_step[s] for s in steps]
    for metric, agg in (("staleness_mean", "mean"), ("staleness_max", "max"),
                        ("is_weight_mean", "mean"), ("mismatch_kl_k3", "mean")):  # fmt: skip
        xs = [r[metric] for r in rows if isinstance(r.get(metric), (int, float))]
        if xs:
            out[f"{agg}_{metric}"] = max(xs) if agg == "max" else _mean(xs)
    for metric in ("step_s", "step_interval_s", "rollout_s", "actor_s", "reward_s"):
        xs = [r[metric] for r in rows if isinstance(r.get(metric), (int, float))]
        if xs:
            out[f"mean_{metric}"] = round(_mean(xs), 4)
    if len(steps) > 1:  # the device-locked work (rollout + actor busy) against the period
        period = (by_step[steps[-1]]["time"] - by_step[steps[0]]["time"]) / (len(steps) - 1)
        out["mean_period_s"] = round(period, 4)
        gaps = sorted(by_step[b]["time"] - by_step[a]["time"] for a, b in zip(steps, steps[1:]))
        out["median_period_s"] = round(gaps[len(gaps) // 2], 4)  # evaluations left out
        busy = out.get("mean_rollout_s", 0.0) + out.get("mean_actor_s", 0.0)
        out["device_busy_share"] = round(busy / period, 3)
    return out


FIELDS = [
    "accuracy_step0", "accuracy_step800", "samples_per_s_wall", "samples_per_s_metrics",
    "mean_staleness_mean", "max_staleness_max", "mean_is_weight_mean", "mean_mismatch_kl_k3",
]  # fmt: skip


def config_summary(runs: list[dict]) -> dict:
    """Mean, min and max over a configuration's finished runs, per field of :data:`FIELDS`."""
    ok = [r for r in runs if r["status"] == "ok"]
    out = {"seeds": [r["seed"] for r in ok], "runs": len(runs), "finished": len(ok)}
    for f in FIELDS:
        xs = [r[f] for r in ok if r.get(f) is not None]
        if xs:
            out[f] = {"mean": _mean(xs), "min": min(xs), "max": max(xs)}
    return out


def _cell(stat: dict | None, fmt: str) -> str:
    if not stat:
        return "n/a"
    if stat["min"] == stat["max"]:
        return format(stat["mean"], fmt)
    return f"{stat['mean']:{fmt}} [{stat['min']:{fmt}}, {stat['max']:{fmt}}]"


def table(result: dict) -> str:
    """The per-configuration table (markdown): mean [min, max] over seeds."""
    head = ("| configuration | seeds done | acc. step 0 | acc. step 800 | samples/s (wall) | "
            "samples/s (metrics) | staleness mean | staleness max | IS weight mean | "
            "mismatch KL k3 |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for config, c in result["configs"].items():
        lines.append(
            f"| {LABELS[config]} | {c['finished']}/{c['runs']} "
            f"| {_cell(c.get('accuracy_step0'), '.3f')} "
            f"| {_cell(c.get('accuracy_step800'), '.3f')} "
            f"| {_cell(c.get('samples_per_s_wall'), '.1f')} "
            f"| {_cell(c.get('samples_per_s_metrics'), '.1f')} "
            f"| {_cell(c.get('mean_staleness_mean'), '.3f')} "
            f"| {_cell(c.get('max_staleness_max'), '.0f')} "
            f"| {_cell(c.get('mean_is_weight_mean'), '.4f')} "
            f"| {_cell(c.get('mean_mismatch_kl_k3'), '.2e')} |"
        )
    return "\n".join(lines)


def run_table(result: dict) -> str:
    """One row per run (markdown)."""
    lines = ["| run | status | last step | load | warm-start steps | acc. step 0 | acc. step 800 | "
             "samples/s (wall) | "
             "samples/s (metrics) | steps wall s | staleness mean/max | IS weight mean | "
             "KL k3 |", "|" + "---|" * 13]  # fmt: skip

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    for r in result["runs"]:
        lines.append(
            f"| {r['name']} | {r['status']} | {f(r.get('last_step'), 'd')} "
            f"| {f(r.get('load_1min_mean'), '.1f')} | {f(r.get('warm_start_steps'), 'd')} "
            f"| {f(r.get('accuracy_step0'), '.3f')} "
            f"| {f(r.get('accuracy_step800'), '.3f')} "
            f"| {f(r.get('samples_per_s_wall', r.get('samples_per_s_wall_so_far')), '.1f')} "
            f"| {f(r.get('samples_per_s_metrics'), '.1f')} | {f(r.get('steps_wall_s'), '.0f')} "
            f"| {f(r.get('mean_staleness_mean'), '.3f')}/{f(r.get('max_staleness_max'), '.0f')} "
            f"| {f(r.get('mean_is_weight_mean'), '.4f')} "
            f"| {f(r.get('mean_mismatch_kl_k3'), '.2e')} |"
        )
    return "\n".join(lines)


AB_REPS = 2
AB_FROM = 700  # the A/B runs resume from k0_s0's checkpoint of this step
AB_TO = 750  # ... and stop after this one (its evaluation and checkpoint not measured)


def launch_ab(run_root: Path, reps: int = AB_REPS) -> None:
    """The load-matched throughput A/B: ``K = 0, 1, 2`` (``tis``) each resumed from ``k0_s0``'s
    step-700 checkpoint for steps 701..750, alternated ``reps`` times back to back, so the three
    see the same load and the same policy (the matrix's runs, tens of minutes apart on a shared
    machine, do not). Each in ``<run-root>/ab/k<K>_r<rep>``; ``timeout 900``."""
    ab = run_root / "ab"
    src = run_root / "k0_s0"
    for rep in range(1, reps + 1):
        for config in ("k0", "k1", "k2"):
            name = f"{config}_r{rep}"
            if (ab / f"{name}.rc").exists():
                continue
            run_dir = ab / name
            shutil.rmtree(run_dir, ignore_errors=True)
            ckpt = f"step_{AB_FROM:06d}"
            shutil.copytree(src / "checkpoints" / ckpt, run_dir / "checkpoints" / ckpt)
            shutil.copy(src / "metrics.jsonl", run_dir / "metrics.jsonl")
            cmd = ["timeout", "900", *command(config, 0, ab)[:-1], "resume=true",
                   f"trainer.steps={AB_TO}", f"trainer.run_dir={run_dir}"]  # fmt: skip
            (ab / f"{name}.t0").write_text(f"{time.time()}\n")
            with open(ab / f"{name}.log", "w") as log:
                rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            (ab / f"{name}.rc").write_text(f"{rc}\n")
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            print(f"{time.strftime('%H:%M:%S')} ab {name}: exit {rc}", flush=True)


def analyse_ab(run_root: Path, per_step: int) -> dict | None:
    """Per A/B run: samples/s over steps 702..749 (the log's clock; no evaluation or checkpoint
    inside) and the median step period; per K: the mean over reps and the ratio to the K = 0
    run of the same rep (run minutes apart)."""
    ab = run_root / "ab"
    if not ab.exists():
        return None
    runs, a, b = {}, AB_FROM + 2, AB_TO - 1
    for rc_path in sorted(ab.glob("*.rc")):
        name = rc_path.stem
        rec = {"exit_status": int(_read(rc_path) or 0)}
        path = ab / name / "metrics.jsonl"
        by_step = {}
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                by_step[r["step"]] = r
        if a in by_step and b in by_step:
            wall = by_step[b]["time"] - by_step[a]["time"]
            rec["samples_per_s"] = round(per_step * (b - a) / wall, 2)
            gaps = sorted(by_step[n + 1]["time"] - by_step[n]["time"] for n in range(a, b))
            rec["median_period_s"] = round(gaps[len(gaps) // 2], 4)
            for m in ("rollout_s", "actor_s"):
                xs = [by_step[n][m] for n in range(a, b + 1) if m in by_step[n]]
                rec[f"mean_{m}"] = round(_mean(xs), 4)
        else:
            rec["log_tail"] = _tail(ab / f"{name}.log")
        t0 = _read(ab / f"{name}.t0")
        t1 = _read(ab / f"{name}.t1")
        if t0:
            loads = [x for t, x in _loads(run_root) if t0 <= t <= (t1 or float("inf"))]
            rec["load_1min_mean"] = round(_mean(loads), 2) if loads else None
        runs[name] = rec
    per_k = {}
    for config in ("k0", "k1", "k2"):
        rates = [r["samples_per_s"] for n, r in runs.items() if n.startswith(config + "_")
                 and "samples_per_s" in r]  # fmt: skip
        ratios = []
        for n, r in runs.items():
            base = runs.get("k0_" + n.split("_")[1], {})
            if n.startswith(config + "_") and "samples_per_s" in r and "samples_per_s" in base:
                ratios.append(r["samples_per_s"] / base["samples_per_s"])
        if rates:
            per_k[config] = {"samples_per_s": {"mean": _mean(rates), "min": min(rates),
                                               "max": max(rates)},
                             "ratio_to_k0": ratios}  # fmt: skip
    return {"steps": [a, b], "from_checkpoint": f"k0_s0 step {AB_FROM}", "runs": runs,
            "per_k": per_k}  # fmt: skip


def ab_table(ab: dict) -> str:
    """The A/B runs in run order (markdown): samples/s, ratio to the round's K = 0, busy times."""
    a, b = ab["steps"]
    lines = [f"| A/B run (steps {a}..{b}) | load | samples/s | x K=0 of round | median period s "
             "| rollout busy s | actor busy s |", "|" + "---|" * 7]  # fmt: skip
    order = sorted(ab["runs"], key=lambda n: (n.split("_r")[1], n))
    for name in order:
        r = ab["runs"][name]
        base = ab["runs"].get("k0_r" + name.split("_r")[1], {}).get("samples_per_s")
        if "samples_per_s" not in r:
            lines.append(f"| {name} | | failed (exit {r['exit_status']}) | | | | |")
            continue
        ratio = f"{r['samples_per_s'] / base:.2f}" if base else "n/a"
        lines.append(
            f"| {name} | {r.get('load_1min_mean')} | {r['samples_per_s']:.0f} | {ratio} "
            f"| {r['median_period_s']:.3f} | {r['mean_rollout_s']:.3f} | {r['mean_actor_s']:.3f} |"
        )
    return "\n".join(lines)


def analyse(run_root: Path) -> dict:
    """Every run's figures and each configuration's mean and spread (see the module docstring)."""
    per_step = samples_per_step()
    runs = [run_summary(run_root, c, s, per_step) for c, s in ORDER]
    configs = {c: config_summary([r for r in runs if r["config"] == c]) for c in CONFIGS}
    loads = [x for _, x in _loads(run_root)]
    return {
        "run_root": str(run_root),
        "samples_per_step": per_step,
        "steps": STEPS,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_1min_during_runs": {"mean": _mean(loads), "max": max(loads)} if loads else None,
        },  # fmt: skip
        "configs": configs,
        "runs": runs,
        "ab": analyse_ab(run_root, per_step),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-root", type=Path, default=Path("/tmp/asyncruns"))
    ap.add_argument("--launch", action="store_true", help="run the 10 runs first (hours)")
    ap.add_argument("--launch-ab", action="store_true", help="run the throughput A/B first")
    ap.add_argument("--limit-s", type=int, default=TIMEOUT_S, help="wall limit of a run")
    ap.add_argument("--stall-s", type=int, default=STALL_S, help="no progress this long: stop")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.launch:
        launch(args.run_root, args.limit_s, args.stall_s)
    if args.launch_ab:
        launch_ab(args.run_root)
    result = analyse(args.run_root)
    print(table(result))
    print()
    print(run_table(result))
    if result["ab"]:
        print()
        print(ab_table(result["ab"]))
    for r in result["runs"]:
        if r["status"] == "failed":
            print(f"\n{r['name']} failed (exit {r['exit_status']}); last lines of its log:")
            print(r.get("log_tail", ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
