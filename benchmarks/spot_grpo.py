"""GRPO with a spot rollout pool under a replayed preemption trace, next to the same run
without spot instances (same seed, same warm start).

1. One supervised warm start (``workflows/grpo.py`` for one step, checkpointed), shared.
2. ``reserved``: the GRPO runner resumed from it for ``--steps`` steps, no spot pool.
3. ``spot``: the same, with ``rollout.spot.enabled=true`` and ``cluster.spot.trace`` = a trace
   whose availability drops ``--preemptions`` times (``t_s,instances``, generated here and saved
   next to the results), replayed on a local cluster from the first logged step.

Both runs sample with the same counter keys, so their rollouts agree token for token while the
weights do (reported: the steps until the curves part, and both curves). Writes
``benchmarks/results/spot_grpo.json`` and ``spot_grpo.png``.

    python benchmarks/spot_grpo.py [--steps 560] [--preemptions 24] [--period 12]

The trace lasts 540 s at ``--period 12`` (3 instance drops per 72 s); the default steps run
long enough on this 2-core machine (~560 s with spot) for 20+ of them to hit a live instance
(with a shorter ``--period`` nodes go before their instances are up, and do not count).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from plan_modes import warm_start  # noqa: E402

from m2flow.run.workflow import run_workflow  # noqa: E402

GRPO = str(ROOT / "workflows" / "grpo.py")
PATTERN = [2, 1, 2, 0, 1, 2]  # spot instances available, one entry per trace period


def make_trace(preemptions: int, period_s: float) -> list[tuple[float, int]]:
    """A trace cycling through :data:`PATTERN` until ``preemptions`` drops happened."""
    trace, drops, i = [(0.0, PATTERN[0])], 0, 1
    while drops < preemptions:
        prev, cur = trace[-1][1], PATTERN[i % len(PATTERN)]
        drops += max(prev - cur, 0)
        trace.append((i * period_s, cur))
        i += 1
    return trace


def records(run_dir: Path) -> list[dict]:
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step) if k > 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=560)
    ap.add_argument("--preemptions", type=int, default=24)
    ap.add_argument("--period", type=float, default=12.0, help="trace seconds per entry")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--work", default="scratch/spot_grpo")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spot_grpo.json"))
    ap.add_argument("overrides", nargs="*", help="extra workflow overrides (key=value)")
    a = ap.parse_args()
    from m2flow.scheduler.spot import save_trace

    work = Path(a.work)
    common = [f"trainer.eval_every={a.eval_every}", "trainer.prompts_per_step=16",
              "rollout.n_samples=8", "rollout.threads=1", "actor.threads=1",
              *a.overrides]  # fmt: skip
    resumed = warm_start(work, common)
    trace = make_trace(a.preemptions, a.period)
    trace_file = Path(a.out).with_name("spot_grpo_trace.csv")
    trace_file.parent.mkdir(parents=True, exist_ok=True)
    save_trace(trace_file, trace)
    steps = [f"trainer.steps={1 + a.steps}"]
    spot = ["rollout.spot.enabled=true", f"cluster.spot.trace={trace_file}",
            "rollout.spot.n_prem_max=2", "rollout.spot.micro_batch_prompts=4"]  # fmt: skip
    runs = {}
    for name, extra in (("reserved", []), ("spot", spot)):
        t0 = time.time()
        run_workflow(GRPO, resumed(name) + steps + extra)
        runs[name] = {"wall_s": time.time() - t0, "records": records(work / name)}
        print(f"{name}: {runs[name]['wall_s']:.0f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)

    sr, rr = runs["spot"]["records"], runs["reserved"]["records"]
    same = next((i for i, (x, y) in enumerate(zip(sr, rr))
                 if x["reward_mean"] != y["reward_mean"]), len(sr))  # fmt: skip
    counts = {k: sum(r.get(f"spot_{k}", 0) for r in sr) for k in
              ("preemptions", "migrated_samples", "migrated_tokens", "spot_tokens",
               "reserved_tokens", "failed_starts")}  # fmt: skip
    summary = {
        "steps": a.steps,
        "trace_drops": a.preemptions,
        "counts": counts,
        "identical_reward_steps": same,
        "final_heldout": {
            n: [r for r in runs[n]["records"] if "heldout_accuracy" in r][-1]["heldout_accuracy"]
            for n in runs
        },
        "wall_s": {n: runs[n]["wall_s"] for n in runs},
    }
    print(json.dumps(summary, indent=2))
    Path(a.out).write_text(json.dumps({"summary": summary, "trace": trace, "runs": runs},
                                      indent=2) + "\n")  # fmt: skip
    _plot(runs, Path(a.out).with_suffix(".png"))


def _plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in runs.items():
        rec = run["records"]
        ax1.plot([r["step"] for r in rec], [r["reward_mean"] for r in rec], label=name, lw=1)
        ev = [r for r in rec if "heldout_accuracy" in r]
        ax2.plot([r["step"] for r in ev], [r["heldout_accuracy"] for r in ev], "o-", label=name)
    ax1.set(xlabel="step", ylabel="reward mean", title="GRPO reward, with and without spot")
    ax2.set(xlabel="step", ylabel="held-out accuracy", title="held-out accuracy")
    for ax in (ax1, ax2):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
