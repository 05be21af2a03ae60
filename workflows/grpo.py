"""GRPO on a reasoning-gym task (or your own data): supervised warm start, then rollout ->
reward -> actor.

    m2flow run workflows/grpo.py trainer.steps=50 rollout.temperature=0.8
    m2flow run workflows/grpo.py plan=auto cluster.devices_per_node=2
    m2flow run workflows/grpo.py data.train_files=train.jsonl data.val_files=val.jsonl \
        reward.function=my_reward.py:compute_score      # docs/how-to/data-and-rewards.md

The runner below is the whole algorithm; it holds no placement logic. Where each group runs and
how finely the rollout streams to its consumers is the runtime's plan (``plan=temporal``, the
default: every group on every device, the device locks switching between them;
``plan=auto|spatial|hybrid`` from a profile; or ``plan=path/to/plan.yaml``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from m2flow.workers.algos.losses import knows_loss, loss_names
from m2flow.workers.data.config import DataConfig
from m2flow.workers.data.reasoning_gym import task_section
from m2flow.workers.engines.registry import TRAIN_ENGINES
from m2flow.workers.recipe import (
    LLMTrainerConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    WarmStartConfig,
    model_section,
    response_length,
    rollout_section,
    validate_llm,
    validate_lora,
    validate_optim,
    warm_start_args,
)
from m2flow.workers.reward.config import RewardConfig

from m2flow.recipe import (
    Checkpoints,
    ClusterConfig,
    finite_positive,
    plain,
    require,
    start_cluster,
    validate_cluster,
    validate_trainer,
)

#: keys of earlier versions -> their names now (an override with an old key names the new one)
RENAMED = {"task.max_prompt_tokens": "data.max_prompt_tokens"}


@dataclass
class ActorConfig(OptimConfig):
    lr: float = 1e-4  # 1e-3 collapsed the policy in our runs
    loss: str = "grpo"  # policy loss: grpo (token ratio), gspo (sequence ratio), or module:function
    clip_eps_low: float = 0.2  # ratio clip [1 - low, 1 + high] of the policy loss
    clip_eps_high: float = 0.28  # DAPO's clip-higher
    kl_coef: float = 0.0  # k3 KL to the warm-started policy; 0 = no reference
    drop_flat_groups: bool = True  # groups with one reward for all samples: no signal
    recompute_old_logprobs: bool = False  # recompute behaviour logprobs, not the rollout's
    shared_prefix: bool = True  # forward each group's prompt once (same math, ~3x fewer tokens)
    data_parallel: bool = False  # one rank per device, gradients all-reduced (gloo/NCCL)
    engine: str = "torch"  # or "megatron": one rank per device (docs/results/megatron.md)
    tensor_parallel: int = 1  # megatron: TP size (divides the heads)
    pipeline_parallel: int = 1  # megatron: PP size (divides the layers); DP = devices / (TP*PP)
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank > 0: train a LoRA adapter (torch)


@dataclass
class GRPORolloutConfig(RolloutConfig):
    engine: str = "hf"  # or "vllm": vLLM's CPU build in process (vllm extra; docs/results/vllm.md)


@dataclass
class RewardServiceConfig:
    url: Optional[str] = None  # None: score in process; "http://127.0.0.1:8765": the service
    token: str = ""  # this tenant's bearer token from the service's config
    task: str = "grpo"  # task name registered with the service
    pipeline: str = "math"  # answer extraction + math-verify (0/1 rewards)
    timeout_s: float = 600.0  # longest wait for one chunk's rewards


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)  # none: task.* (reasoning-gym)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rollout: GRPORolloutConfig = field(default_factory=GRPORolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_service: RewardServiceConfig = field(default_factory=RewardServiceConfig)
    trainer: LLMTrainerConfig = field(
        default_factory=lambda: LLMTrainerConfig(
            steps=800, eval_every=100, save_every=100, run_dir="runs/grpo"
        )
    )
    resume: bool = False  # continue from the last checkpoint in trainer.run_dir


def validate(cfg) -> None:
    """Value checks the types cannot express, before anything starts. Raises ConfigError."""
    from m2flow.workers.checkpoint import TRAIN_ROLE

    validate_cluster(cfg.cluster)
    validate_trainer(cfg.trainer, cfg.resume, {"actor": TRAIN_ROLE})
    validate_llm(cfg, min_samples=2)
    validate_optim(cfg.actor, "actor")
    validate_lora(cfg.actor.lora, cfg.actor.engine)
    a = cfg.actor
    require(
        [
            (a.clip_eps_low > 0 and a.clip_eps_high > 0, "actor.clip_eps_* must be > 0"),
            (a.kl_coef >= 0, "actor.kl_coef must be >= 0"),
            (
                knows_loss(a.loss, "policy"),
                f"actor.loss={a.loss}: pick one of {', '.join(loss_names('policy'))} "
                "(or a function's import path, module:function)",
            ),
            (TRAIN_ENGINES.knows(a.engine), f"actor.engine must be {TRAIN_ENGINES.choices()}"),
            (a.engine == "megatron" or a.tensor_parallel == 1, "TP needs actor.engine=megatron"),
            (a.tensor_parallel >= 1, "actor.tensor_parallel must be >= 1"),
            (a.pipeline_parallel >= 1, "actor.pipeline_parallel must be >= 1"),
            (
                a.engine == "megatron" or a.pipeline_parallel == 1,
                "actor.pipeline_parallel needs actor.engine=megatron",
            ),
            (
                cfg.model.num_hidden_layers % max(a.pipeline_parallel, 1) == 0,
                f"actor.pipeline_parallel={a.pipeline_parallel} must divide "
                f"model.num_hidden_layers={cfg.model.num_hidden_layers} (equal stages)",
            ),
            (finite_positive(cfg.reward_service.timeout_s), "reward_service.timeout_s > 0"),
            (
                not cfg.reward_service.url or cfg.reward.function == "auto",
                f"reward.function={cfg.reward.function} with reward_service.url: the service "
                "scores with its own pipelines (reward_service.pipeline); leave "
                "reward.function at auto, or unset reward_service.url",
            ),
            (cfg.rollout.engine in ("hf", "vllm"), "rollout.engine must be hf or vllm"),
            (
                cfg.rollout.engine == "hf"
                or not cfg.rollout.spot.enabled
                or cfg.rollout.spot.engine == "exact",
                "rollout.spot.engine=emulated models the rollout engine: use it with "
                "rollout.engine=hf (rollout.engine=vllm runs vLLM on the spot instances)",
            ),
            (
                cfg.rollout.engine == "hf"
                or cfg.model.hidden_size // cfg.model.num_attention_heads >= 64,
                "rollout.engine=vllm: vLLM's CPU attention needs a head dimension >= 64 "
                f"(model.hidden_size / model.num_attention_heads = {cfg.model.hidden_size} / "
                f"{cfg.model.num_attention_heads}); e.g. model.num_attention_heads=2",
            ),
        ]
    )


def main(cfg) -> dict:
    from m2flow.workers.actor.worker import ActorWorker
    from m2flow.workers.data.item import prompt_items
    from m2flow.workers.data.sampler import PromptSampler, load_sampler
    from m2flow.workers.data.splits import run_data
    from m2flow.workers.llm import build_tokenizer, tokenizer_spec
    from m2flow.workers.reward.config import reward_spec
    from m2flow.workers.reward.worker import RewardWorker
    from m2flow.workers.rollout.worker import RolloutWorker
    from m2flow.workers.scoring.functions import merge_reward_metrics

    from m2flow import Channel, sync_weights
    from m2flow.runlog import RunLog

    tr = cfg.trainer
    model, task = model_section(cfg), task_section(cfg)  # model.path made absolute
    spec = tokenizer_spec(model)  # model.tokenizer / model.alphabet; the rest is the shape
    tokenizer = build_tokenizer(spec)
    data = run_data(cfg, tokenizer)  # every prompt read and checked before any worker starts
    rewards = reward_spec(cfg.reward, data.data_sources())
    sampler = PromptSampler(len(data.train), tr.seed, cfg.data.shuffle)
    cluster = start_cluster(cfg.cluster, tr.run_dir)
    lm = {"model": model, "tokenizer": spec, "seed": tr.seed}
    rollout_args, length_note = rollout_section(cfg)  # max_new_tokens resolved
    rollout = RolloutWorker.launch(
        cluster, name="rollout", heldout=data.heldout, reward=rewards, **lm, **rollout_args
    )
    service = plain(cfg.reward_service) if cfg.reward_service.url else None
    reward = RewardWorker.launch(
        cluster, name="reward", tokenizer=spec, service=service, reward=None if service else rewards
    )
    actor = ActorWorker.launch(
        cluster, name="actor", temperature=cfg.rollout.temperature, **lm, **plain(cfg.actor)
    )
    prompts, rollouts, scored = (Channel.create(n) for n in ("prompts", "rollouts", "scored"))
    checkpoints = Checkpoints(tr.run_dir)

    def evaluate() -> dict:
        """``heldout_accuracy`` (share of held-out prompts with reward 1); none without them."""
        if not data.heldout:
            return {}
        outs = log.wait("evaluation", rollout.evaluate())
        scores = [s for o in outs for s in o["scores"]]
        out = {"heldout_accuracy": sum(s == 1.0 for s in scores) / len(scores)}
        if cfg.reward.on_error == "penalty":
            out["heldout_reward_errors"] = sum(o["reward_errors"] for o in outs)
        return out

    start = 0
    if cfg.resume:
        start, state = checkpoints.restore({"actor": actor})
        data.notes += load_sampler(sampler, state)
    summary = {}
    resumed = start if cfg.resume else None  # later records are dropped, time continues
    with RunLog(
        tr.run_dir, tr.steps, tr.logger, resumed, tr.log_every, plain(cfg), "GRPO steps"
    ) as log:
        log.print(cluster.describe())
        for note in filter(None, [*data.notes, length_note]):
            log.print(note)
        if start == 0:
            ws_args, skipped = warm_start_args(cfg, data.source)
            task_or_none = None if skipped else task
            call = actor.warm_start(task_or_none, seed=tr.seed, reward=rewards, **ws_args)
            ws = log.wait("warm start", call, None if skipped else ws_args["time_budget_s"])[0]
            if skipped:
                log.print(f"warm start: skipped ({skipped})")
            sync_weights(actor, rollout)
            ev = evaluate()
            if ev:
                summary["accuracy_after_warm_start"] = ev["heldout_accuracy"]
            log.log(0, {"phase": "start" if skipped else "warm_start", **ws, **ev})
        else:
            sync_weights(actor, rollout)
        log.advance(start)
        for step in range(start + 1, tr.steps + 1):
            t0 = time.time()
            prompts.put_many(prompt_items(data.train, sampler.take(tr.prompts_per_step), step))
            gen = rollout.generate(prompts, rollouts, tr.prompts_per_step)
            rew = reward.score(rollouts, scored)
            upd = actor.train(scored)
            g_out, r_out, a_outs = gen.wait(), rew.wait(), upd.wait()
            a_out = a_outs[0]
            version = sync_weights(actor, rollout)
            seconds = time.time() - t0
            tokens = sum(o["tokens"] for o in g_out)
            samples = sum(o["samples"] for o in r_out)
            metrics = {
                "reward_mean": sum(o["reward_mean"] * o["samples"] for o in r_out) / samples,
                "sample_accuracy": sum(o["accuracy"] * o["samples"] for o in r_out) / samples,
                # the reward function's extra metrics (reward/<name>), reward_errors (penalty)
                **merge_reward_metrics(r_out, cfg.reward.on_error),
                "response_length": response_length(g_out),
                "tokens_per_s": tokens / seconds,
                "step_s": seconds,
                "rollout_s": gen.time(busy=True),
                "reward_s": rew.time(busy=True),
                "actor_s": upd.time(busy=True),
                "loss": a_out["loss"],
                "clip_frac": a_out["clip_frac"],
                "grad_norm": a_out["grad_norm"],
                # steps whose update a NaN/inf dropped (actor.nonfinite=skip); absent if none
                **{k: a_out[k] for k in ("nonfinite_skips",) if k in a_out},
                "weight_version": version,
                # the spot pool's counters (rollout.spot.enabled): tokens by reserved and spot
                # engines, preemptions, migrations, T_seed, N_prem
                **{f"spot_{k}": v for k, v in g_out[0].get("spot", {}).items()},
            }
            if step % tr.eval_every == 0 or step == tr.steps:
                metrics |= evaluate()
                if "heldout_accuracy" in metrics:
                    summary["final_accuracy"] = metrics["heldout_accuracy"]
            if step % tr.save_every == 0 or step == tr.steps:
                checkpoints.save(step, {"actor": actor}, {"data": sampler.state_dict()})
            log.log(step, metrics, echo="heldout_accuracy" in metrics or None)
            log.advance(step, f"reward {metrics['reward_mean']:.3f}")
        log.print(f"summary: {summary}")
    cluster.shutdown()
    return summary


if __name__ == "__main__":
    from m2flow.cli import run_as_script

    run_as_script(__file__)
