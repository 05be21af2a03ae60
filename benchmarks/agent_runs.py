"""The agent example on CPU: GRPO with a calculator tool against the same model without it.

    python benchmarks/agent_runs.py --launch --run-root /tmp/agentruns   # all at once, ~1 h
    python benchmarks/agent_runs.py --run-root /tmp/agentruns             # the table + JSON

Issue 33 item 6: ``workflows/agent.py`` at its defaults (3-digit sums and differences that the
tiny character model cannot do in its head, ``agent.env=calculator``; runs ``tool``, ``tool_s1``)
and the no-tool baseline ``agent.env=answer`` (one turn: the answer; ``notool``,
``notool_s1``), seeds 0 and 1.
Each starts with the same 300 supervised warm-start steps on demonstrations of its own
environment (tool-use traces; the answers), then trains 150 GRPO
steps; the held-out accuracy (greedy episodes, 200 prompts) is logged every
``trainer.eval_every`` steps. ``--launch`` runs them side by side (each under ``timeout
--limit-s``; console output in ``<run-root>/<name>.log``, exit status in ``<name>.rc``), so the
machine's load hits all alike. The table: held-out accuracy after the warm start and at each
evaluation, per run; ``benchmarks/results/agent_runs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "agent_runs.json"

#: name -> overrides of workflows/agent.py (its defaults otherwise)
RUNS = {
    "tool": [],
    "notool": ["agent.env=answer"],
    "tool_s1": ["trainer.seed=1"],
    "notool_s1": ["agent.env=answer", "trainer.seed=1"],
}


def launch(run_root: Path, limit_s: float, extra: list[str]) -> None:
    """Start every run at once (each alone in its process group) and wait for them."""
    run_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "TMPDIR": str(run_root)}
    procs = {}
    for name, overrides in RUNS.items():
        if (run_root / f"{name}.rc").exists():
            print(f"{name}: done before (delete {name}.rc and {name}/ to rerun)")
            continue
        args = ["timeout", str(int(limit_s)), sys.executable, "-m", "m2flow.run.cli", "run",
                str(ROOT / "workflows" / "agent.py"), *overrides, *extra,
                f"trainer.run_dir={run_root / name}"]  # fmt: skip
        log = open(run_root / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        print(f"{name}: started: {' '.join(args[3:])}")
    for name, (proc, log) in procs.items():
        rc = proc.wait()
        log.close()
        (run_root / f"{name}.rc").write_text(f"{rc}\n")
        print(f"{name}: exit {rc}")


def read_run(run_root: Path, name: str) -> dict:
    """One run's evaluations and per-step agent metrics (means over its steps)."""
    path = run_root / name / "metrics.jsonl"
    rc = (
        (run_root / f"{name}.rc").read_text().strip()
        if (run_root / f"{name}.rc").exists()
        else None
    )
    if not path.exists():
        return {"name": name, "exit": rc, "evaluations": []}
    records = [json.loads(line) for line in path.read_text().splitlines()]
    evals = [(r["step"], r["heldout_accuracy"]) for r in records if "heldout_accuracy" in r]
    steps = [r for r in records if r.get("step", 0) >= 1 and "step_s" in r]

    def mean(key: str, rows=steps) -> float | None:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else None

    first, last = steps[:10], steps[-10:]
    return {
        "name": name,
        "overrides": RUNS[name],
        "exit": rc,
        "steps": len(steps),
        "evaluations": evals,
        "reward_mean_first10": mean("reward_mean", first),
        "reward_mean_last10": mean("reward_mean", last),
        "num_turns_mean": mean("num_turns_mean"),
        "tool_calls_mean": mean("tool_calls_mean"),
        "tool_errors_per_step": mean("tool_errors"),
        "masked_share": mean("masked_share"),
        "step_s": mean("step_s"),
        "warm_start_s": next((r.get("seconds") for r in records if r.get("step") == 0), None),
    }


def table(runs: list[dict]) -> str:
    steps = sorted({s for r in runs for s, _ in r["evaluations"]})
    head = "| step | " + " | ".join(r["name"] for r in runs) + " |"
    lines = [head, "|---:|" + "---:|" * len(runs)]
    for s in steps:
        cells = []
        for r in runs:
            acc = dict(r["evaluations"]).get(s)
            cells.append("" if acc is None else f"{acc:.3f}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-root", type=Path, required=True)
    ap.add_argument("--launch", action="store_true", help="run both configurations first")
    ap.add_argument("--limit-s", type=float, default=7200.0, help="each run's time limit")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("overrides", nargs="*", help="more overrides for both runs (key=value)")
    a = ap.parse_args()
    if a.launch:
        launch(a.run_root, a.limit_s, a.overrides)
    runs = [read_run(a.run_root, n) for n in RUNS]
    print("held-out accuracy (greedy episodes), step 0 = after the warm start:")
    print(table(runs))
    for r in runs:
        extra = {k: v for k, v in r.items() if k not in ("evaluations", "overrides", "name")}
        print(r["name"], json.dumps(extra))
    out = {"machine": platform.node(), "cpus": os.cpu_count(), "written": time.time(),
           "extra_overrides": a.overrides, "runs": runs}  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
