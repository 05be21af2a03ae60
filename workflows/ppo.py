"""RLHF-style PPO on a reasoning-gym task (or your own data): rollout, actor, critic,
reference and reward model.

    m2flow run workflows/ppo.py trainer.steps=100 algorithm.kl_coef=0.02
    m2flow run workflows/ppo.py cluster.devices_per_node=5 plan=workflows/plans/ppo_spatial.yaml
    m2flow run workflows/ppo.py data.train_files=train.jsonl reward.function=my_reward.py:fn

Phases: a supervised warm start of the actor (as in GRPO; reasoning-gym only); the
warm-started weights go to the rollout, the reference (frozen), the critic and the reward
model (their transformers); the reward model's head (``reward_model``) is fitted briefly to
verifier labels of the policy's own samples, the verifier being the run's reward function
(``reward``). Then PPO
steps: every rollout chunk goes to the reward model (learned score mixed with the verifier),
the reference (logprobs) and the critic, which joins the three, computes KL-shaped token
rewards and GAE, passes the chunk to the actor and fits its values. The runner holds no
placement logic: ``plan=...`` decides devices and chunking (see ``workflows/grpo.py``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from m2flow.workers.actor.config import ActorOptions, ReferenceOptions
from m2flow.workers.critic.config import CriticOptions
from m2flow.workers.data.config import DataConfig
from m2flow.workers.recipe import (
    LLMTrainerConfig,
    ModelConfig,
    OffPolicyConfig,
    OptimConfig,
    TaskConfig,
    WarmStartConfig,
    check_engine,
    model_section,
    response_length,
    validate_llm,
    validate_optim,
    validate_staleness,
)
from m2flow.workers.reward.config import RewardConfig, RewardModelOptions
from m2flow.workers.rollout.config import RolloutOptions
from m2flow.workers.scoring.functions import merge_reward_metrics

from m2flow.core.config import ConfigError
from m2flow.run.recipe import (
    ClusterConfig,
    options,
    plain,
    require,
    validate_cluster,
    validate_trainer,
)

#: keys of earlier versions -> their names now (an override with an old key names the new one)
RENAMED = {
    "task.max_prompt_tokens": "data.max_prompt_tokens",
    **{f"reward.{k}": f"reward_model.{k}" for k in
       ("verifier_weight", "lr", "grad_clip", "batch_size", "micro_batch_size", "threads")},
}  # fmt: skip


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0  # GAE discount per token (veRL/OpenRLHF: 1, no discount in a response)
    lam: float = 0.95  # GAE lambda
    kl_coef: float = 0.05  # beta of the per-token KL penalty in the reward: -beta*(logp - ref)
    clip_eps: float = 0.2  # PPO ratio clip: [1 - eps, 1 + eps]
    value_clip: float = 0.2  # critic: new values kept within old +- value_clip in the loss
    epochs: int = 2  # passes over each batch (actor and critic), mini-batches shuffled


@dataclass
class ActorConfig(OptimConfig):
    loss: str = "grpo"  # policy loss: grpo (token ratio), gspo (sequence ratio), or module:function
    mini_batch_size: int = 128  # responses per optimizer step; 0 = the whole batch
    whiten_advantages: bool = True  # advantages to mean 0, std 1 over the batch's tokens
    recompute_old_logprobs: bool = False  # the rollout's logprobs are the same weights'
    engine: str = "torch"  # or "megatron": one rank per device (docs/results/megatron.md)
    tensor_parallel: int = 1  # megatron: TP size; DP = the actor's devices / TP
    # PPO's actor has no correction (correction=none only); allow_uncorrected=true trains with
    # trainer.max_staleness >= 1, the ratio taken against the behaviour policy's logprobs
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)


@dataclass
class RewardFitConfig:
    batches: int = 18  # rollout batches (trainer.prompts_per_step prompts each) to label
    heldout_batches: int = 2  # of which held out to measure the reward model
    epochs: int = 3  # passes over the training samples (batches of reward_model.batch_size)


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)  # none: task.* (reasoning-gym)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rollout: RolloutOptions = field(default_factory=lambda: RolloutOptions(n_samples=4))
    reward: RewardConfig = field(default_factory=RewardConfig)  # the verifier
    reward_model: RewardModelOptions = field(default_factory=RewardModelOptions)
    reward_fit: RewardFitConfig = field(default_factory=RewardFitConfig)
    reference: ReferenceOptions = field(default_factory=ReferenceOptions)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticOptions = field(default_factory=CriticOptions)
    trainer: LLMTrainerConfig = field(
        default_factory=lambda: LLMTrainerConfig(
            steps=100, prompts_per_step=64, eval_every=25, save_every=25, run_dir="runs/ppo"
        )
    )
    resume: bool = False  # continue from the last checkpoint in trainer.run_dir


def validate(cfg) -> None:
    """Value checks the types cannot express, before anything starts. Raises ConfigError."""
    from m2flow.workers.checkpoint import PPO_ACTOR, RANK_STATE

    a, f = cfg.algorithm, cfg.reward_fit
    validate_cluster(cfg.cluster)
    groups = {"actor": PPO_ACTOR, "critic": RANK_STATE, "reward": RANK_STATE,
              "reference": RANK_STATE}  # fmt: skip
    validate_trainer(cfg.trainer, cfg.resume, groups)
    off = cfg.actor.off_policy
    require(
        [
            (
                off.correction == "none" and off.max_lag is None,
                f"actor.off_policy: the PPO actor has no correction and drops no samples (got "
                f"correction={off.correction}, max_lag={off.max_lag}); leave them unset",
            )
        ]
    )
    validate_staleness(cfg, off, "PPO runner", corrections=False)  # no correction yet
    validate_llm(cfg)
    validate_optim(cfg.actor, "actor")
    validate_optim(cfg.critic, "critic")
    from m2flow.workers.algos.losses import knows_loss, loss_names  # heavy: torch

    require(
        [
            (0 <= a.gamma <= 1 and 0 <= a.lam <= 1, "algorithm.gamma and algorithm.lam: [0, 1]"),
            (a.kl_coef >= 0, "algorithm.kl_coef must be >= 0"),
            (a.clip_eps > 0 and a.epochs >= 1, "algorithm.clip_eps > 0 and algorithm.epochs >= 1"),
            (
                0 <= cfg.reward_model.verifier_weight <= 1,
                "reward_model.verifier_weight must be in [0, 1]",
            ),
            (0 <= f.heldout_batches < f.batches, "need 0 <= reward_fit.heldout_batches < batches"),
            (cfg.actor.tensor_parallel >= 1, "actor.tensor_parallel must be >= 1"),
            (cfg.critic.tensor_parallel >= 1, "critic.tensor_parallel must be >= 1"),
            (
                knows_loss(cfg.actor.loss, "policy"),
                f"actor.loss={cfg.actor.loss}: pick one of {', '.join(loss_names('policy'))} "
                "(or a function's import path, module:function)",
            ),
        ]
    )
    # the engines say what they cannot run
    check_engine("train", cfg, "actor")
    check_engine("value", cfg, "critic")
    check_engine("logprob", cfg, "reference")
    from m2flow.workers.reward.model import check_reward_engine

    try:
        check_reward_engine(
            cfg.reward_model.engine, {**plain(cfg.reward_model), "model": model_section(cfg)}
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.reward_model.path:
        from m2flow.workers.llm import tokenizer_spec
        from m2flow.workers.reward.model import check_reward_model

        try:
            check_reward_model(cfg.reward_model.path, tokenizer_spec(plain(cfg.model)))
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None


def main(cfg) -> dict:
    from m2flow.workers.actor.ppo import PPOActorWorker
    from m2flow.workers.actor.reference import ReferenceWorker
    from m2flow.workers.critic.worker import CriticWorker
    from m2flow.workers.reward.model import RewardModelWorker
    from m2flow.workers.rollout.worker import RolloutWorker
    from m2flow.workers.skeleton import LLMRun, StepRecord

    from m2flow import Channel, Fanout, sync_weights

    run = LLMRun(cfg)  # data, rewards, prompt sampler, cluster; the warm start and the tail
    tr, alg, cluster, lm, seed = cfg.trainer, cfg.algorithm, run.cluster, run.lm, cfg.trainer.seed
    temp, n = cfg.rollout.temperature, tr.prompts_per_step
    rollout = RolloutWorker.launch(
        cluster, name="rollout", **lm, options=run.rollout, heldout=run.data.heldout,
        reward=run.rewards, seed=seed,
    )  # fmt: skip
    rm = options(cfg.reward_model)
    if rm.path:  # workers load it from their own working directory
        rm.path = os.path.abspath(os.path.expanduser(rm.path))
    reward = RewardModelWorker.launch(
        cluster, name="reward", **lm, options=rm, seed=seed, reward=run.rewards
    )
    reference = ReferenceWorker.launch(
        cluster, name="reference", **lm, options=options(cfg.reference), temperature=temp
    )
    critic = CriticWorker.launch(
        cluster, name="critic", **lm, options=options(cfg.critic), gamma=alg.gamma, lam=alg.lam,
        kl_coef=alg.kl_coef, value_clip=alg.value_clip, epochs=alg.epochs, seed=seed,
    )  # fmt: skip
    section = plain(cfg.actor)
    whiten = section.pop("whiten_advantages")  # the PPO actor's own argument
    opt = ActorOptions.from_kwargs(
        section | {"temperature": temp, "clip_eps_low": alg.clip_eps,
                   "clip_eps_high": alg.clip_eps, "seed": seed}
    )  # fmt: skip
    actor = PPOActorWorker.launch(
        cluster, name="actor", **lm, options=opt, epochs=alg.epochs, whiten_advantages=whiten
    )
    names = ("prompts", "fit", "to_reward", "to_reference", "to_critic", "scores", "refs", "adv")
    prompts, fit, to_reward, to_reference, to_critic, scores, refs, adv = map(Channel.create, names)
    fanout = Fanout(to_reward, to_reference, to_critic)

    def after_warm_start() -> dict:
        """The warm-started weights to every model; the reward model's head fitted to verifier
        labels of the warm-started policy's samples (unless reward_model.path: as it is)."""
        fitted = not cfg.reward_model.path
        for group in (rollout, reference, critic) + ((reward,) if fitted else ()):
            sync_weights(actor, group)
        if not fitted:
            return {}
        fit_n = cfg.reward_fit.batches * n
        prompts.put_many(run.prompts(fit_n, 0))
        gen = rollout.generate(prompts, fit, fit_n)
        call = reward.fit(fit, cfg.reward_fit.heldout_batches * n, cfg.reward_fit.epochs)
        gen.wait()
        return run.log.wait("reward model fit", call)

    def step(number: int) -> StepRecord:
        t0 = time.time()
        prompts.put_many(run.prompts(n, number))
        gen = rollout.generate(prompts, fanout, n)
        rew = reward.score(to_reward, scores)
        ref = reference.logprobs(to_reference, refs)
        val = critic.step(to_critic, scores, refs, adv)
        upd = actor.train_ppo(adv)
        g_out, r_out, c_out, a_out = gen.wait(), rew.wait(), val.wait(), upd.wait()
        ref.wait()
        sync_weights(actor, rollout)
        calls = {"rollout": gen, "reward": rew, "reference": ref, "critic": val, "actor": upd}
        metrics = _step_metrics(cfg, time.time() - t0, calls, g_out, r_out, c_out, a_out)
        return StepRecord(metrics, f"verifier {metrics['verifier_mean']:.3f}")

    trained = {"actor": actor, "critic": critic, "reward": reward, "reference": reference}
    return run.train("PPO steps", actor, rollout, trained, step, after_warm_start)


def _step_metrics(cfg, seconds: float, calls: dict, g_out, r_out, c_out, a_out) -> dict:
    """One PPO step's record: rewards, lengths, throughput, each role's busy seconds, the
    critic's and the actor's update statistics."""
    return {
        **{k: r_out[k] for k in ("reward_mean", "verifier_mean", "rm_mean")},
        "sample_accuracy": r_out["accuracy"],
        **merge_reward_metrics([r_out], cfg.reward.on_error),
        "response_length": response_length(g_out),
        "tokens_per_s": sum(o["tokens"] for o in g_out) / seconds,
        "step_s": seconds,
        **{f"{name}_s": call.time(busy=True) for name, call in calls.items()},
        **{k: c_out[k] for k in ("kl", "explained_variance", "vf_loss", "vf_clip_frac")},
        "critic_update_norm": c_out["update_norm"],
        **{k: a_out[k] for k in ("pg_loss", "clip_frac", "ratio_mean", "grad_norm")},
        "actor_update_norm": a_out["update_norm"],
        # rollout.spot.enabled: the pool's counters (its Algorithm 1 reads the actor's waits
        # for the step's chunks, published by train_ppo: RLBoost 4.1's t_train^wait)
        **{f"spot_{k}": v for k, v in g_out[0].get("spot", {}).items()},
        # steps whose update a NaN/inf dropped (<role>.nonfinite=skip); absent if none
        **{f"{name}_nonfinite_skips": o["nonfinite_skips"] for name, o in
           (("actor", a_out), ("critic", c_out)) if "nonfinite_skips" in o},
    }  # fmt: skip


if __name__ == "__main__":
    from m2flow.run.cli import run_as_script

    run_as_script(__file__)
