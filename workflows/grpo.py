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

from m2flow.workers.data.config import DataConfig
from m2flow.workers.recipe import (
    LLMTrainerConfig,
    LoraConfig,
    ModelConfig,
    OffPolicyConfig,
    OptimConfig,
    TaskConfig,
    WarmStartConfig,
    check_engine,
    response_length,
    validate_llm,
    validate_lora,
    validate_off_policy,
    validate_optim,
    validate_staleness,
)
from m2flow.workers.reward.config import RewardConfig
from m2flow.workers.rollout.config import RolloutOptions

from m2flow.run.recipe import (
    ClusterConfig,
    finite_positive,
    plain,
    require,
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
    # none: on-policy (today's loss); tis | mis | decoupled: weigh tokens by pi_old / pi_behav
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)


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
    rollout: RolloutOptions = field(default_factory=RolloutOptions)  # passed whole
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
    validate_staleness(cfg, cfg.actor.off_policy)  # K, partial rollouts, the correction
    validate_llm(cfg, min_samples=2)
    validate_optim(cfg.actor, "actor")
    validate_lora(cfg.actor.lora, cfg.actor.engine)
    validate_off_policy(cfg.actor.off_policy)
    from m2flow.workers.algos.losses import knows_loss, loss_names  # heavy: torch

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
            (a.tensor_parallel >= 1, "actor.tensor_parallel must be >= 1"),
            (a.pipeline_parallel >= 1, "actor.pipeline_parallel must be >= 1"),
            (finite_positive(cfg.reward_service.timeout_s), "reward_service.timeout_s > 0"),
            (
                not cfg.reward_service.url or cfg.reward.function == "auto",
                f"reward.function={cfg.reward.function} with reward_service.url: the service "
                "scores with its own pipelines (reward_service.pipeline); leave "
                "reward.function at auto, or unset reward_service.url",
            ),
        ]
    )
    check_engine("train", cfg, "actor")  # the engine says what it cannot run


def main(cfg) -> dict:
    from m2flow.workers.actor.config import ActorOptions
    from m2flow.workers.actor.worker import ActorWorker
    from m2flow.workers.algos.off_policy import METRIC_PREFIXES as OFF_POLICY_METRICS
    from m2flow.workers.reward.worker import RewardWorker
    from m2flow.workers.rollout.worker import RolloutWorker
    from m2flow.workers.scoring.functions import merge_reward_metrics
    from m2flow.workers.skeleton import LLMRun, StepRecord

    from m2flow import Channel, sync_weights

    run = LLMRun(cfg)  # data, rewards, prompt sampler, cluster; the warm start and the tail
    tr, cluster, lm, seed = cfg.trainer, run.cluster, run.lm, cfg.trainer.seed
    rollout = RolloutWorker.launch(
        cluster, name="rollout", **lm, options=run.rollout, heldout=run.data.heldout,
        reward=run.rewards, seed=seed,
    )  # fmt: skip
    service = plain(cfg.reward_service) if cfg.reward_service.url else None
    reward = RewardWorker.launch(
        cluster, name="reward", tokenizer=lm["tokenizer"], service=service,
        reward=None if service else run.rewards,
    )  # fmt: skip
    # the actor's options, built once from its section (plus the sampling temperature, the seed)
    opt = ActorOptions.from_kwargs(
        {**plain(cfg.actor), "temperature": cfg.rollout.temperature, "seed": seed}
    )
    actor = ActorWorker.launch(
        cluster, name="actor", **lm, options=opt,
    )  # fmt: skip
    prompts, rollouts, scored = (Channel.create(n) for n in ("prompts", "rollouts", "scored"))

    def step(n: int) -> StepRecord:
        t0 = time.time()
        prompts.put_many(run.prompts(tr.prompts_per_step, n))
        # the reward service learns of the step's batch as its rollout starts (DistRS section
        # 4: it scales before the first response is scored); the reward ranks run it before
        # their score call
        ann = reward.announce(n, tr.prompts_per_step * cfg.rollout.n_samples) if service else None
        gen = rollout.generate(prompts, rollouts, tr.prompts_per_step)
        rew = reward.score(rollouts, scored)
        upd = actor.train(scored)
        g_out, r_out, a_out = gen.wait(), rew.wait(), upd.wait()
        if ann is not None:
            ann.wait()
        version = sync_weights(actor, rollout)
        seconds = time.time() - t0
        samples = sum(o["samples"] for o in r_out)
        metrics = {
            "reward_mean": sum(o["reward_mean"] * o["samples"] for o in r_out) / samples,
            "sample_accuracy": sum(o["accuracy"] * o["samples"] for o in r_out) / samples,
            # the reward function's extra metrics (reward/<name>), reward_errors (penalty)
            **merge_reward_metrics(r_out, cfg.reward.on_error),
            "response_length": response_length(g_out),
            "tokens_per_s": sum(o["tokens"] for o in g_out) / seconds,
            "step_s": seconds,
            "rollout_s": gen.time(busy=True),
            "reward_s": rew.time(busy=True),
            "actor_s": upd.time(busy=True),
            **{k: a_out[k] for k in ("loss", "clip_frac", "grad_norm")},
            # steps whose update a NaN/inf dropped (actor.nonfinite=skip); absent if none
            **{k: a_out[k] for k in ("nonfinite_skips",) if k in a_out},
            # actor.off_policy.correction != none: importance weights, logprob mismatch,
            # staleness (workers/algos/off_policy.py); absent without a correction
            **{k: v for k, v in a_out.items() if k.startswith(OFF_POLICY_METRICS)},
            "weight_version": version,
            # the spot pool's counters (rollout.spot.enabled): tokens by reserved and spot
            # engines, preemptions, migrations, T_seed, N_prem
            **{f"spot_{k}": v for k, v in g_out[0].get("spot", {}).items()},
        }
        return StepRecord(metrics, f"reward {metrics['reward_mean']:.3f}")

    return run.train("GRPO steps", actor, rollout, {"actor": actor}, step)


if __name__ == "__main__":
    from m2flow.run.cli import run_as_script

    run_as_script(__file__)
