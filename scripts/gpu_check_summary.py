"""The summary table of ``scripts/gpu_check.sh``: one row per step, from its run directory.

    python scripts/gpu_check_summary.py OUT      # prints Markdown (docs/results/gpu.md keeps it)

Columns: exit status and wall time; median step time and tokens/s over the measured GRPO steps
(the first 3 dropped: start-up); held-out accuracy at the first and last evaluation; peak GPU
memory (nvidia-smi, MiB, the whole card); and for the TRL row ours / TRL tokens/s.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

#: step name -> run directory under OUT (None: not a GRPO run)
STEPS = {
    "gpu_tests": None,
    "grpo": "grpo",
    "grpo_async": "grpo_async",
    "megatron": "megatron",
    "qwen2_100m": "qwen2_100m",
    "own_model_prepare": None,
    "own_model": "own/run",
    "agent": "agent",
    "agent_vllm": "agent_vllm",
    "trl": None,
}
DROP = 3  # steps of start-up left out of the medians


def _records(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    if not f.is_file():
        return []
    by_step = {}
    for line in f.read_text().splitlines():
        r = json.loads(line)
        by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def row(out: Path, name: str, run: str | None) -> list[str]:
    status = (
        (out / f"{name}.status").read_text().split()
        if (out / f"{name}.status").is_file()
        else ["missing", "0"]
    )
    mem = (out / f"{name}.mem").read_text().strip() if (out / f"{name}.mem").is_file() else ""
    words = {"0": "ok", "124": "timeout", "137": "killed", "skipped": "skipped", "missing": "-"}
    cells = [name, words.get(status[0], f"exit {status[0]}"), f"{status[1]} s"]
    step_s = tok_s = first = last = None
    note = ""
    if run is not None:
        recs = _records(out / run)
        steps = [r for r in recs if r["step"] > DROP and "step_s" in r]
        if steps:
            # pipelined steps overlap: their period is step_interval_s, not step_s
            key = "step_interval_s" if "step_interval_s" in steps[0] else "step_s"
            step_s = statistics.median(r[key] for r in steps)
            tok_s = statistics.median(r["tokens_per_s"] for r in steps)
        evals = [r for r in recs if "heldout_accuracy" in r]
        if evals:
            first, last = evals[0]["heldout_accuracy"], evals[-1]["heldout_accuracy"]
            note = f"steps {evals[0]['step']}->{evals[-1]['step']}"
    log = out / f"{name}.log"
    if name == "gpu_tests" and log.is_file():
        found = re.findall(r"(\d+ (?:passed|failed|skipped|error)\w*)", log.read_text())
        note = ", ".join(found[-3:])
    if status[0] == "skipped" and log.is_file():  # the reason (gpu_check.sh's skip)
        note = (log.read_text().strip().splitlines() or [""])[0]
    if name == "trl" and (out / "grpo_vs_trl.json").is_file():
        res = json.loads((out / "grpo_vs_trl.json").read_text())
        if "ratio" in res:
            tok_s = res["ours"]["tokens_per_s"]
            note = f"ours/TRL {res['ratio']:.2f}x (TRL {res['trl']['tokens_per_s']:.0f} tok/s)"
    cells += [_fmt(step_s, ".3f"), _fmt(tok_s, ".0f"), _fmt(first, ".3f"), _fmt(last, ".3f"),
              mem or "-", note]  # fmt: skip
    return cells


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "scratch/gpu_check")
    gpu = (
        (out / "gpu.txt").read_text().strip().replace("\n", "; ")
        if (out / "gpu.txt").is_file()
        else "?"
    )
    print(f"GPU check on {gpu}\n")
    head = ["step", "status", "wall", "step s", "tokens/s", "held-out first", "held-out last",
            "peak MiB", "notes"]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, run in STEPS.items():
        print("| " + " | ".join(row(out, name, run)) + " |")


if __name__ == "__main__":
    main()
