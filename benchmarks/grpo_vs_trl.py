"""GRPO step throughput: m2flow's GRPO workflow vs TRL's ``GRPOTrainer``, side by side.

Both train the same tiny Qwen2 (built from config, no hub) with the same character tokenizer on
the same reasoning-gym task and reward, with the same batch shape: 32 prompts x 16 samples,
at most 6 new tokens, temperature 0.7 (top-p 1, no top-k), AdamW lr 1e-4, clip 0.2 / 0.28,
token-mean loss, no KL, one optimizer step per batch.

Runs are interleaved: one shared supervised warm start (untimed), then ``--repeats`` rounds of
ours and TRL, each starting from the warm-started weights; the ratio reported is the median of
the per-round ratios, with half their range as the spread.

1. Ours: ``workflows/grpo.py`` through ``m2flow.run_workflow``, resumed from the warm start,
   under the planned mode, as ``m2flow run ... plan=auto --profile P`` would run it: one
   virtual device per core (``--devices``), the plan from this machine's profile
   (``benchmarks/profiles/grpo_2cpu.yaml``), each rank using its devices' share of the CPUs.
   ``--plan none`` runs the runner's default instead (temporal, every group on one device with
   ``--threads`` threads). ``--warmup + --steps`` GRPO steps; throughput is the workflow's
   own ``tokens_per_s`` (real prompt + response tokens of the step / step wall time).
2. TRL: ``GRPOTrainer`` (``use_cpu``, fp32, no gradient checkpointing, no vLLM; transformers
   ``generate``), started from the same warm-started weights, so that both policies write
   answers of the same length. Throughput is TRL's own token count
   (``num_input_tokens_seen``: prompt + completion tokens) per step over the wall time between
   consecutive step ends.

Both use the workflow's model config, attention kernel included (``--attn`` sets it for
both), the machine's cores (TRL: one process with ``--threads`` torch threads; ours: the plan's
ranks, or ``--threads`` with ``--plan none``), and the same niceness (Ray runs our workers at
15; the TRL process lowers itself to 15), so that other load on a shared machine hurts both
alike.

Reported: median tokens/s over the measured steps (warm-up steps dropped), the ratio, and per
phase medians (rollout = generation, reward = scoring, actor = the rest of TRL's step: loss
forward/backward and optimizer; ours: each group's busy time, so ours' phases do not add up to
its step: the rest is Ray calls, prompt puts, device switches and the weight sync). Writes
``benchmarks/results/grpo_vs_trl.json``.

    python benchmarks/grpo_vs_trl.py [--steps 20] [--warmup 5] [--threads 2] [--attn eager]
        [--plan auto|none|...] [--profile P] [--devices N] [--repeats 3]
        [--only ours|trl] [workflow overrides for ours ...]

Needs the ``bench`` extra (``pip install -c constraints.txt -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from plan_modes import warm_start  # noqa: E402  (the shared warm start, resumed run dirs)

# Ray starts its workers (ours) at this niceness (raylet's ``worker_niceness``); TRL runs at
# the same, so background load on a shared machine slows both sides alike.
RAY_WORKER_NICENESS = 15
PROMPTS, SAMPLES, MAX_NEW, TEMPERATURE, LR = 32, 16, 6, 0.7, 1e-4


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def run_ours(
    steps: int,
    warmup: int,
    threads: int,
    resumed: list[str],
    extra: list[str],
    plan: str | None = None,
    profile: str | None = None,
) -> dict:
    """The GRPO workflow resumed from the shared warm start (``resumed``: its overrides, from
    :func:`plan_modes.warm_start`) for ``warmup + steps`` more steps under ``plan`` (as
    ``m2flow run plan=...``; None: the default, temporal on every device); medians over the
    last ``steps``."""
    from m2flow.run.workflow import run_workflow

    run_dir = Path(next(o for o in resumed if o.startswith("trainer.run_dir="))[16:])
    overrides = [
        *resumed,
        f"trainer.steps={1 + warmup + steps}",  # the warm start's run ended at step 1
        # Under a plan each rank gets its devices' share of the CPUs (threads=0).
        f"rollout.threads={0 if plan else threads}",
        f"actor.threads={0 if plan else threads}",
        *extra,
    ]
    workflow = str(ROOT / "workflows" / "grpo.py")
    t0 = time.time()
    session = run_workflow(workflow, overrides, plan=plan, profile=profile)
    wall = time.time() - t0
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    warm = next(r for r in rows if r.get("phase") == "warm_start")
    grpo = [r for r in rows if "tokens_per_s" in r and r["step"] > 1][warmup:]
    return {
        "tokens_per_s": _median(grpo, "tokens_per_s"),
        "step_s": _median(grpo, "step_s"),
        "rollout_s": _median(grpo, "rollout_s"),
        "reward_s": _median(grpo, "reward_s"),
        "actor_s": _median(grpo, "actor_s"),
        "tokens_per_step": statistics.median(r["tokens_per_s"] * r["step_s"] for r in grpo),
        "response_length": _median(grpo, "response_length"),
        "steps_measured": len(grpo),
        "per_step_tokens_per_s": [round(r["tokens_per_s"], 1) for r in grpo],
        "warm_start_s": warm["seconds"],
        "wall_s": wall,
        "overrides": overrides,
        "plan": session.placement.tree if session.placement else "temporal (default)",
    }


def run_trl(
    steps: int, warmup: int, threads: int, checkpoint: str, out_dir: Path, attn: str
) -> dict:
    """TRL's GRPOTrainer on the same model (``attn``: its attention implementation), data,
    reward and batch shape."""
    import datasets
    import torch
    import trl
    from m2flow.workers.llm import load_checkpoint
    from m2flow.workers.tasks import TaskDataset
    from transformers import TrainerCallback

    torch.set_num_threads(threads)
    os.nice(max(0, RAY_WORKER_NICENESS - os.nice(0)))
    model, tok = load_checkpoint(checkpoint)
    model.set_attn_implementation(attn)
    model.train()
    train = TaskDataset(
        "chain_sum",
        {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
        seed=1,
        size=20000,
    )
    data = datasets.Dataset.from_dict(
        {"prompt": [it.prompt for it in train.items], "idx": list(range(len(train)))}
    )

    def reasoning_gym_reward(prompts, completions, idx, **_):
        return train.score(completions, [train[i] for i in idx])

    args = trl.GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=not torch.cuda.is_available(),  # on a GPU machine both sides use the GPU
        bf16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        per_device_train_batch_size=PROMPTS * SAMPLES,  # completions per device step
        gradient_accumulation_steps=1,
        num_generations=SAMPLES,
        max_completion_length=MAX_NEW,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        learning_rate=LR,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the batch, as ours
        num_iterations=1,
        max_steps=warmup + steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )

    class Timer(TrainerCallback):
        def __init__(self):
            self.rows: list[dict] = []
            self.t = self.tokens = None

        def on_train_begin(self, args, state, control, **kw):
            self.t, self.tokens = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.rows.append(
                {
                    "step_s": now - self.t,
                    "tokens": state.num_input_tokens_seen - self.tokens,
                    "rollout_s": phases.pop("rollout", 0.0),
                    "reward_s": phases.pop("reward", 0.0),
                }
            )
            self.t, self.tokens = now, state.num_input_tokens_seen

    timer, phases = Timer(), {}
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reasoning_gym_reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[timer],
    )

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0

        return wrapper

    trainer._generate_single_turn = timed("rollout", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    rows = timer.rows[warmup:]
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["step_s"]
        r["actor_s"] = r["step_s"] - r["rollout_s"] - r["reward_s"]
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h][warmup:]
    return {
        "tokens_per_s": _median(rows, "tokens_per_s"),
        "step_s": _median(rows, "step_s"),
        "rollout_s": _median(rows, "rollout_s"),
        "reward_s": _median(rows, "reward_s"),
        "actor_s": _median(rows, "actor_s"),
        "tokens_per_step": statistics.median(r["tokens"] for r in rows),
        "response_length": statistics.median(h["completions/mean_length"] for h in logs),
        "steps_measured": len(rows),
        "per_step_tokens_per_s": [round(r["tokens_per_s"], 1) for r in rows],
        "wall_s": wall,
        "trl_version": trl.__version__,
        "attn_implementation": model.config._attn_implementation,
        "niceness": os.nice(0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="measured GRPO steps per side")
    ap.add_argument("--warmup", type=int, default=5, help="GRPO steps dropped before measuring")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process")
    ap.add_argument("--only", choices=["ours", "trl"], default=None)
    ap.add_argument("--repeats", type=int, default=3, help="ours, TRL, ours, TRL, ...")
    ap.add_argument("--work", default="scratch/grpo_vs_trl", help="run directories (removed)")
    ap.add_argument(
        "--attn", default=None, help="attention kernel for both (default: the workflow's)"
    )
    ap.add_argument(
        "--plan",
        default="auto",
        help="ours' plan= (auto|temporal|spatial|hybrid|plan.yaml), or 'none': the runner's "
        "default placement (temporal on one device with --threads threads)",
    )
    ap.add_argument(
        "--profile",
        default=str(ROOT / "benchmarks" / "profiles" / "grpo_2cpu.yaml"),
        help="profile for --plan auto|spatial|hybrid (default: this machine's, 1 core/device)",
    )
    ap.add_argument(
        "--devices", type=int, default=os.cpu_count(), help="virtual devices under --plan"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grpo_vs_trl.json"))
    ap.add_argument("overrides", nargs="*", help="extra workflow overrides for ours (key=value)")
    a = ap.parse_args()

    import torch
    import transformers

    results: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "batch": {
            "prompts": PROMPTS,
            "samples_per_prompt": SAMPLES,
            "max_new_tokens": MAX_NEW,
            "temperature": TEMPERATURE,
        },
        "steps": a.steps,
        "warmup": a.warmup,
    }
    from m2flow.workers.llm import ModelConfig

    attn = results["attn_implementation"] = a.attn or ModelConfig.attn_implementation
    plan = None if a.plan == "none" else a.plan
    overrides = [f"model.attn_implementation={attn}", *a.overrides]
    if plan is not None:
        overrides.insert(0, f"cluster.devices_per_node={a.devices}")
    common = [
        f"trainer.prompts_per_step={PROMPTS}",
        f"trainer.eval_every={10**6}",  # the last step still evaluates (after its timing)
        f"rollout.n_samples={SAMPLES}",
        f"rollout.max_new_tokens={MAX_NEW}",
        f"rollout.temperature={TEMPERATURE}",
        f"actor.lr={LR}",
    ]
    work = Path(a.work)
    resumed = warm_start(work, common + overrides)  # one warm start, every run resumes it
    checkpoint = str(work / "warm" / "checkpoints" / "step_000001" / "actor")
    runs: dict[str, list[dict]] = {"ours": [], "trl": []}
    for r in range(a.repeats):  # interleaved, so drift on a shared machine hits both alike
        if a.only in (None, "ours"):
            runs["ours"].append(
                run_ours(a.steps, a.warmup, a.threads, resumed(f"ours{r}"), [], plan, a.profile)
            )
        if a.only in (None, "trl"):
            runs["trl"].append(
                run_trl(a.steps, a.warmup, a.threads, checkpoint, work / f"trl{r}", attn)
            )
    shutil.rmtree(work, ignore_errors=True)

    sides = [s for s in ("ours", "trl") if runs[s]]
    cols = ("tokens_per_s", "step_s", "rollout_s", "reward_s", "actor_s", "response_length")
    print(f"{'':6}" + "".join(f"{c:>16}" for c in cols) + "   (medians over repeats)")
    for s in sides:
        results[s] = {c: statistics.median(x[c] for x in runs[s]) for c in cols}
        results[s]["repeats"] = runs[s]
        print(f"{s:6}" + "".join(f"{results[s][c]:16.3f}" for c in cols))
    if len(sides) == 2:
        ratios = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(*runs.values())]
        results["ratios"] = ratios
        results["ratio"] = statistics.median(ratios)
        results["ratio_spread"] = (max(ratios) - min(ratios)) / 2
        shown = ", ".join(f"{x:.2f}" for x in ratios)
        print(
            f"ours / trl tokens/s: median {results['ratio']:.2f}x, spread "
            f"+-{results['ratio_spread']:.2f} (repeats: {shown})"
        )
    if a.only is None:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")
    else:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
