"""Rollout and training throughput of the two engine pairs on a ~100M-parameter Qwen2.

    python benchmarks/engines.py [--repeats 2] [--steps 3] [--task leg_counting]

Each run is the GRPO workflow itself (``m2flow run workflows/grpo.py``) with the preset
``workflows/presets/qwen2_100m.yaml`` (random weights, Qwen2's tokenizer, chat prompts of a
reasoning-gym task, 4 prompts x 4 samples x up to 64 new tokens a step), under one of:

- ``hf+torch``: ``rollout.engine=hf actor.engine=torch`` (this interpreter's environment);
- ``vllm+megatron``: ``rollout.engine=vllm actor.engine=megatron
  actor.tensor_parallel=<devices>`` (run by ``--vllm-python``, the environment with the
  ``vllm`` and ``megatron`` extras).

Both on ``cluster.devices_per_node=<devices>`` (``--devices``, default 1: TP=1, one rollout
rank; 2 gives TP=2 and two rollout ranks, which did not fit next to other jobs in 24 GiB)
under the default temporal plan.
``actor.drop_flat_groups=false``: with random weights every group's rewards are flat (0), so
the step still runs the actor's forward and backward on every sample (its advantages are 0,
so the update is a no-op; the work is not).

Per step (``metrics.jsonl``): generated tokens/s = response tokens / ``rollout_s``; trained
tokens/s = prompt + response tokens / ``actor_s`` (busy seconds of the group calls). Step 1 of
each run is warm-up and not counted. Runs of the two pairs alternate (interleaved repeats);
the table gives medians and the spread (max - min) / median over the counted steps. Results:
``benchmarks/results/engines.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "workflows" / "presets" / "qwen2_100m.yaml"
PAIRS = {
    "hf+torch": ["rollout.engine=hf", "actor.engine=torch"],
    "vllm+megatron": ["rollout.engine=vllm", "actor.engine=megatron"],
}


def run_once(pair: str, python: str, args, run_dir: Path) -> list[dict]:
    """One workflow run; returns its GRPO step records (``metrics.jsonl``)."""
    cmd = [
        python, "-m", "m2flow.run.cli", "run", str(ROOT / "workflows" / "grpo.py"),
        "-c", str(PRESET), f"task.name={args.task}", f"trainer.steps={args.steps}",
        "trainer.eval_every=100000", "trainer.save_every=100000", "task.heldout_size=2",
        f"cluster.devices_per_node={args.devices}", "actor.drop_flat_groups=false",
        f"trainer.run_dir={run_dir}", *PAIRS[pair],
        *([f"actor.tensor_parallel={args.devices}"] if pair == "vllm+megatron" else []),
    ]  # fmt: skip
    t0 = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{pair} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    print(f"  {pair}: {time.time() - t0:.0f} s wall", flush=True)
    return [r for r in records if r.get("step", 0) >= 1 and "rollout_s" in r]


def rates(rec: dict, samples: int) -> dict:
    gen = rec["response_length"] * samples
    trained = rec["tokens_per_s"] * rec["step_s"]  # prompt + response tokens of the step
    return {
        "step": rec["step"],
        "generated_tokens": gen,
        "trained_tokens": trained,
        "rollout_s": rec["rollout_s"],
        "actor_s": rec["actor_s"],
        "step_s": rec["step_s"],
        "rollout_tokens_per_s": gen / rec["rollout_s"],
        "actor_tokens_per_s": trained / rec["actor_s"],
    }


def summary(values: list[float]) -> dict:
    med = statistics.median(values)
    return {"median": med, "spread": (max(values) - min(values)) / med if med else 0.0}


def write_result(args, steps: dict[str, list[dict]], samples: int, load: list[float]) -> dict:
    """The results so far (medians and spreads of the counted steps) into ``args.out``."""
    result = {
        "task": args.task,
        "preset": str(PRESET.relative_to(ROOT)),
        "samples_per_step": samples,
        "repeats": args.repeats,
        "steps_per_run": args.steps,
        "load_average_1min": load,
        "cpus": os.cpu_count(),
        "devices": args.devices,
        "pairs": {
            pair: {
                "overrides": PAIRS[pair],
                "rollout_tokens_per_s": summary([s["rollout_tokens_per_s"] for s in rows]),
                "actor_tokens_per_s": summary([s["actor_tokens_per_s"] for s in rows]),
                "steps": rows,
            }
            for pair, rows in steps.items()
            if rows
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2, help="runs per pair, interleaved")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per run (step 1: warm-up)")
    p.add_argument("--task", default="leg_counting")
    p.add_argument("--pairs", default=",".join(PAIRS))
    p.add_argument(
        "--devices", type=int, default=1, help="virtual devices = the Megatron actor's TP size"
    )
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("M2FLOW_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
        help="interpreter of the environment with the vllm and megatron extras",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engines.json"))
    args = p.parse_args()
    pairs = args.pairs.split(",")
    samples = 4 * 4  # the preset's trainer.prompts_per_step x rollout.n_samples
    load = [os.getloadavg()[0]]
    steps: dict[str, list[dict]] = {k: [] for k in pairs}
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="m2flow-engines-") as tmp:
        for rep in range(args.repeats):
            for pair in pairs if rep % 2 == 0 else reversed(pairs):
                python = args.vllm_python if pair == "vllm+megatron" else sys.executable
                records = run_once(pair, python, args, Path(tmp) / f"{pair}-{rep}")
                steps[pair] += [rates(r, samples) | {"repeat": rep} for r in records[1:]]
                load.append(os.getloadavg()[0])
                result = write_result(args, steps, samples, load)  # after every run
    print(f"\n{'pair':<15} {'rollout tok/s':>22} {'actor tok/s':>22}  (median, spread; n)")
    for pair, r in result["pairs"].items():
        ro, ac = r["rollout_tokens_per_s"], r["actor_tokens_per_s"]
        print(
            f"{pair:<15} {ro['median']:>12.1f} ({ro['spread']:6.1%}) "
            f"{ac['median']:>12.1f} ({ac['spread']:6.1%})  n={len(r['steps'])}"
        )
    print(f"load average (1 min) during the runs: {min(load):.1f}-{max(load):.1f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
