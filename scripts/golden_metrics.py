"""Golden metrics: short deterministic workflow runs whose every logged number must stay the same
across a refactor (issue 31: "the golden metrics ... byte-identical before and after each move").

Each case runs a built-in workflow through :func:`m2flow.run.workflow.run_workflow` in a temporary
run directory, on one virtual device with one torch thread per worker (so no rank races for
prompts and no thread count changes a reduction), and keeps every step's record of its
``metrics.jsonl`` minus wall-clock fields (``time``, ``*_s``, ``tokens_per_s``, ``seconds``,
``*_per_s_*`` such as ``env_steps_per_s_overall``; also left out when comparing). The warm
start is bounded by steps, never by time.

    python scripts/golden_metrics.py -o before.json               # every case
    python scripts/golden_metrics.py -o after.json grpo_stream ppo  # some cases
    python scripts/golden_metrics.py --compare before.json after.json

``--compare`` prints every differing field (case, step, key, both values) and exits 1 if any
differ, 0 if the files agree on every case both hold (a case only one holds is reported and
counts as a difference). Floats are compared as JSON writes them (``repr``: every bit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "workflows"

#: one device, one thread per worker, the warm start bounded by steps only
_GRPO = [
    "cluster.devices_per_node=1",
    "cluster.num_cpus=2",
    "warm_start.steps=20",
    "warm_start.time_budget_s=100000",
    "warm_start.target_accuracy=null",
    "rollout.threads=1",
    "actor.threads=1",
    "trainer.log_every=1",
]
_TINY_LM = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
]

#: name -> (workflow, config files, overrides)
CASES: dict[str, tuple[str, list[str], list[str]]] = {
    # the default streaming update (one optimizer step per step, chunks accumulated)
    "grpo_stream": ("grpo.py", ["smoke"], [*_GRPO, "trainer.steps=3", "trainer.save_every=2"]),
    # mini-batches split into micro-batches, KL to a frozen reference (every group kept: four
    # mini-batches of three micro-batches a step)
    "grpo_mini_kl": (
        "grpo.py",
        ["smoke"],
        [
            *_GRPO,
            "trainer.steps=2",
            "actor.mini_batch_size=16",
            "actor.micro_batch_size=6",
            "actor.kl_coef=0.05",
            "actor.drop_flat_groups=false",
        ],
    ),
    # actor (epochs over shuffled mini-batches), critic, reference, reward model (fit + score)
    "ppo": (
        "ppo.py",
        [],
        [
            *_TINY_LM,
            "cluster.devices_per_node=1",
            "cluster.num_cpus=2",
            "warm_start.steps=3",
            "warm_start.batch_size=16",
            "warm_start.eval_every=1",
            "warm_start.time_budget_s=100000",
            "warm_start.target_accuracy=null",
            "task.train_size=64",
            "task.val_size=16",
            "task.heldout_size=16",
            "trainer.prompts_per_step=4",
            "trainer.eval_every=2",
            "trainer.steps=2",
            "trainer.log_every=1",
            "rollout.n_samples=4",
            "rollout.threads=1",
            "actor.mini_batch_size=8",
            "actor.micro_batch_size=4",
            "actor.threads=1",
            "critic.mini_batch_size=8",
            "critic.micro_batch_size=4",
            "critic.threads=1",
            "reference.threads=1",
            "reward_model.batch_size=8",
            "reward_model.threads=1",
            "reward_fit.batches=2",
            "reward_fit.heldout_batches=1",
            "reward_fit.epochs=1",
            "algorithm.epochs=2",
        ],
    ),
    "embodied": (
        "embodied.py",
        [],
        [
            "cluster.devices_per_node=1",
            "cluster.num_cpus=2",
            "env.num_envs=4",
            "env.steps=8",
            "policy.hidden=16",
            "algorithm.epochs=2",
            "algorithm.mini_batch_size=16",
            "algorithm.threads=1",
            "trainer.steps=3",
            "trainer.log_every=1",
        ],
    ),
    # the Megatron engine (one rank, TP = PP = 1); needs the megatron extra
    "grpo_megatron": (
        "grpo.py",
        ["smoke"],
        [
            *_GRPO,
            "trainer.steps=2",
            "actor.engine=megatron",
            "actor.mini_batch_size=16",
            "actor.kl_coef=0.05",
        ],
    ),
}

_WALL_CLOCK = {"time", "seconds", "tokens_per_s"}
_RATE = re.compile(r"_per_s(_|$)")  # env_steps_per_s_overall


def _kept(key: str) -> bool:
    return key not in _WALL_CLOCK and not key.endswith("_s") and not _RATE.search(key)


def records(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` without wall-clock fields, one record per line, in order."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if _kept(k)})
    return out


def run_case(name: str, scratch: Path) -> list[dict]:
    """Run case ``name`` in a fresh run directory under ``scratch``; its records."""
    from m2flow.run.workflow import run_workflow

    workflow, files, overrides = CASES[name]
    for attempt in range(6):  # a loaded machine can time Ray's start-up out: start again
        run_dir = scratch / f"{name}-{attempt}"
        try:
            run_workflow(
                WORKFLOWS / workflow,
                [*overrides, f"trainer.run_dir={run_dir}"],
                plan="temporal",
                config_files=files,
            )
            return records(run_dir)
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == 5:
                raise
            print(f"Ray did not start ({e}); again", flush=True)
    raise AssertionError("unreachable")


def compare(a: dict, b: dict) -> list[str]:
    """Every difference between two golden files, as printable lines."""
    diffs = []
    for case in sorted(set(a) | set(b)):
        if case not in a or case not in b:
            diffs.append(f"{case}: only in {'first' if case in a else 'second'} file")
            continue
        ra, rb = a[case], b[case]
        if len(ra) != len(rb):
            diffs.append(f"{case}: {len(ra)} records vs {len(rb)}")
        for i, (x, y) in enumerate(zip(ra, rb)):
            step = x.get("step", i)
            for key in sorted(k for k in set(x) | set(y) if _kept(k)):
                vx, vy = x.get(key, "<absent>"), y.get(key, "<absent>")
                if json.dumps(vx) != json.dumps(vy):
                    diffs.append(f"{case} step {step} {key}: {vx!r} != {vy!r}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", help=f"cases to run (default all: {', '.join(CASES)})")
    p.add_argument("-o", "--output", help="write the metrics here (JSON)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two golden files")
    p.add_argument("--skip", nargs="*", default=[], help="cases to leave out")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.compare)
        diffs = compare(a, b)
        for d in diffs:
            print(d)
        print(f"{len(diffs)} differing fields over {len(set(a) | set(b))} cases")
        return 1 if diffs else 0
    if not args.output:
        p.error("give -o FILE (or --compare A B)")
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}: pick from {', '.join(CASES)}")
    cases = [c for c in (args.cases or CASES) if c not in args.skip]
    ray_env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
               "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "M2FLOW_TRACE": "0"}  # fmt: skip
    for k, v in ray_env.items():
        os.environ.setdefault(k, v)
    out: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="golden-") as scratch:
        for name in cases:
            print(f"== {name}", flush=True)
            out[name] = run_case(name, Path(scratch))
            Path(args.output).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.output}: {', '.join(f'{k} ({len(v)} records)' for k, v in out.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
