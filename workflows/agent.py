"""GRPO over multi-turn, tool-calling episodes (issue 33): supervised warm start on tool-use
traces, then episodes -> actor.

    m2flow run workflows/agent.py -c smoke trainer.steps=2
    m2flow run workflows/agent.py                          # calculator tool, CPU, ~20 minutes
    m2flow run workflows/agent.py agent.env=answer         # the same task without the tool
    m2flow run workflows/agent.py model.path=/models/Qwen2.5-0.5B-Instruct rollout.engine=vllm

Each prompt's ``rollout.n_samples`` episodes form its GRPO group; an episode's return (the
environment's rewards: here the task's scorer on the final answer) is its reward. Episodes
play turn by turn on the rollout engine, keeping the sampled tokens; tool output and template
tokens are in the sequence the actor reads but out of its loss (``loss_mask``:
docs/concepts/agents.md). The default is a task the tiny model cannot do in its head
(3-digit sums and differences) with a calculator tool: docs/results/agent.md has both curves.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from m2flow.workers.agent.config import MODES, AgentConfig
from m2flow.workers.data.config import DataConfig
from m2flow.workers.recipe import (
    LLMTrainerConfig,
    ModelConfig,
    OffPolicyConfig,
    OptimConfig,
    TaskConfig,
    WarmStartConfig,
    check_engine,
    validate_llm,
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

#: the character model's alphabet: arithmetic, and the JSON of a calculator call
AGENT_ALPHABET = "0123456789+-*=()" + '{}[]":,_ ' + "abcdefghijklmnopqrstuvwxyz"


@dataclass
class ActorConfig(OptimConfig):
    lr: float = 1e-4
    loss: str = "grpo"  # grpo (token ratio) or gspo (sequence ratio)
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    drop_flat_groups: bool = True
    recompute_old_logprobs: bool = False
    shared_prefix: bool = True
    engine: str = "torch"
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    task: TaskConfig = field(
        default_factory=lambda: TaskConfig(
            config={"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3},
            val_size=64,
            heldout_size=200,
        )  # fmt: skip
    )
    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(
            tokenizer="char",
            alphabet=AGENT_ALPHABET,
            chat_template=True,
            max_position_embeddings=192,
        )  # fmt: skip
    )
    warm_start: WarmStartConfig = field(
        default_factory=lambda: WarmStartConfig(
            steps=500, batch_size=64, target_accuracy=None, time_budget_s=1200.0
        )
    )
    rollout: RolloutOptions = field(
        default_factory=lambda: RolloutOptions(n_samples=8, max_new_tokens=96, temperature=0.8)
    )
    agent: AgentConfig = field(default_factory=AgentConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: LLMTrainerConfig = field(
        default_factory=lambda: LLMTrainerConfig(
            steps=150, prompts_per_step=16, eval_every=25, save_every=50, run_dir="runs/agent"
        )
    )
    resume: bool = False


def validate(cfg) -> None:
    """Value checks the types cannot express, before anything starts. Raises ConfigError."""
    from m2flow.workers.checkpoint import TRAIN_ROLE

    validate_cluster(cfg.cluster)
    validate_trainer(cfg.trainer, cfg.resume, {"actor": TRAIN_ROLE})
    validate_staleness(cfg, cfg.actor.off_policy)
    validate_llm(cfg, min_samples=2, drives_blocks=True)  # exact/emulated: the loop steps
    validate_optim(cfg.actor, "actor")
    validate_off_policy(cfg.actor.off_policy)
    a = cfg.agent
    require(
        [
            (a.mode in MODES, f"agent.mode={a.mode}: pick one of {', '.join(MODES)}"),
            (
                a.mode != "openai" or bool(a.agent),
                "agent.mode=openai needs agent.agent=module:function (the agent, given an "
                "openai client and the prompt's item, returns its reward)",
            ),
            (a.max_turns >= 1, "agent.max_turns must be >= 1"),
            (a.max_turn_tokens >= 1, "agent.max_turn_tokens must be >= 1"),
            (
                a.max_episode_tokens >= a.max_turn_tokens,
                f"agent.max_episode_tokens={a.max_episode_tokens} < agent.max_turn_tokens="
                f"{a.max_turn_tokens}: raise it",
            ),
            (finite_positive(a.tool_timeout_s), "agent.tool_timeout_s must be > 0"),
            (finite_positive(a.env_timeout_s), "agent.env_timeout_s must be > 0"),
            (a.concurrency >= 1, "agent.concurrency must be >= 1"),
            (cfg.actor.loss in ("grpo", "gspo"), "actor.loss: grpo or gspo"),
        ]
    )
    for key, spec in (("agent.env", a.env), ("agent.agent", a.agent)):
        path = (spec or "").rpartition(":")[0]
        require(
            [
                (
                    not path.endswith(".py") or os.path.isfile(os.path.expanduser(path)),
                    f"{key}={spec}: no file {path} (give path/to/file.py:function, or an "
                    "importable module:function)",
                )
            ]
        )
    check_engine("train", cfg, "actor")


def _absolute(spec: str | None) -> str | None:
    """``path/to/file.py:function`` with the path made absolute (workers import it from their
    own working directory); any other spec as it is."""
    path, _, attr = (spec or "").rpartition(":")
    if not path.endswith(".py"):
        return spec
    return f"{os.path.abspath(os.path.expanduser(path))}:{attr}"


def main(cfg) -> dict:
    from m2flow.workers.actor.config import ActorOptions
    from m2flow.workers.actor.worker import ActorWorker
    from m2flow.workers.agent.loop import merge_episode_metrics
    from m2flow.workers.agent.worker import AgentRolloutWorker
    from m2flow.workers.algos.off_policy import METRIC_PREFIXES as OFF_POLICY_METRICS
    from m2flow.workers.skeleton import LLMRun, StepRecord

    from m2flow import Channel, sync_weights

    run = LLMRun(cfg)
    tr, cluster, lm, seed = cfg.trainer, run.cluster, run.lm, cfg.trainer.seed
    compact = lm["tokenizer"]["name"] == "char"
    agent = {**plain(cfg.agent), "env": _absolute(cfg.agent.env),
             "agent": _absolute(cfg.agent.agent)}  # fmt: skip
    rollout = AgentRolloutWorker.launch(
        cluster, name="rollout", **lm, options=run.rollout, agent=agent,
        heldout=run.data.heldout, reward=run.rewards, seed=seed, compact=compact,
    )  # fmt: skip
    opt = ActorOptions.from_kwargs(
        {**plain(cfg.actor), "temperature": cfg.rollout.temperature, "seed": seed}
    )
    actor = ActorWorker.launch(cluster, name="actor", **lm, options=opt)
    prompts, rollouts = Channel.create("prompts"), Channel.create("rollouts")

    def warm_start(ws: dict) -> dict:
        """Supervised steps on tool-use traces of the training prompts (built-in envs)."""
        from m2flow.workers.agent.traces import agent_traces

        n = min(len(run.data.train), ws["steps"] * ws["batch_size"], 4096)  # resampled
        traces = agent_traces(cfg, lm, [it.entry() for it in run.data.train[:n]], compact)
        return actor.warm_start(None, seed=seed, traces=traces, **ws)

    def step(n: int) -> StepRecord:
        t0 = time.time()
        prompts.put_many(run.prompts(tr.prompts_per_step, n))
        gen = rollout.generate(prompts, rollouts, tr.prompts_per_step)
        upd = actor.train(rollouts)
        g_out, a_out = gen.wait(), upd.wait()
        version = sync_weights(actor, rollout)
        seconds = time.time() - t0
        metrics = {
            **merge_episode_metrics([o["agent"] for o in g_out if o["agent"]]),
            "response_length": sum(o["response_length"] * o["samples"] for o in g_out)
            / max(1, sum(o["samples"] for o in g_out)),
            "tokens_per_s": sum(o["tokens"] for o in g_out) / seconds,
            "step_s": seconds,
            "rollout_s": gen.time(busy=True),
            "actor_s": upd.time(busy=True),
            **{k: a_out[k] for k in ("loss", "clip_frac", "grad_norm")},
            **{k: a_out[k] for k in ("nonfinite_skips",) if k in a_out},
            **{k: v for k, v in a_out.items() if k.startswith(OFF_POLICY_METRICS)},
            "weight_version": version,
            # rollout.spot.enabled: the pool's counters of the step's last turn
            **{f"spot_{k}": v for k, v in g_out[0].get("spot", {}).items()},
        }
        note = f"reward {metrics['reward_mean']:.3f} turns {metrics['num_turns_mean']:.2f}"
        return StepRecord(metrics, note)

    # openai mode: the agent is the user's; the warm start is the task's answers (default)
    own = warm_start if cfg.agent.mode == "env" else None
    return run.train("agent GRPO steps", actor, rollout, {"actor": actor}, step, warm_start=own)


if __name__ == "__main__":
    from m2flow.run.cli import run_as_script

    run_as_script(__file__)
