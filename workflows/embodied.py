"""Embodied RL: vectorised Gymnasium simulators <-> a policy group, every step, then PPO.

    m2flow run workflows/embodied.py trainer.steps=40 env.id=Acrobot-v1
    m2flow run workflows/embodied.py cluster.devices_per_node=3 \\
        plan=workflows/plans/embodied_spatial.yaml

Each step, every environment rank runs ``env.steps`` steps of its ``env.num_envs``
simulators: it puts observations into a channel, the policy group answers with actions on
another (the env -> policy -> env cycle of the workflow graph), and the finished trajectories
go to the actor, which runs a PPO update and sends the new weights to the policy. The runner
holds no placement logic: ``plan=...`` decides devices (see ``workflows/grpo.py``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from m2flow.workers.embodied.config import EnvOptions, PolicyOptions, PPOOptions

from m2flow.run.recipe import (
    Checkpoints,
    ClusterConfig,
    TrainerConfig,
    finite_positive,
    options,
    plain,
    require,
    start_cluster,
    validate_cluster,
    validate_trainer,
)


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    env: EnvOptions = field(default_factory=EnvOptions)  # the roles' options, passed whole
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    algorithm: PPOOptions = field(default_factory=PPOOptions)
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(
            steps=60, save_every=20, log_every=5, run_dir="runs/embodied"
        )
    )
    resume: bool = False  # continue from the last checkpoint in trainer.run_dir


def validate(cfg) -> None:
    """Value checks the types cannot express, before anything starts. Raises ConfigError."""
    from m2flow.workers.checkpoint import RANK_STATE
    from m2flow.workers.engines.registry import check_engine

    from m2flow.core.config import ConfigError

    a = cfg.algorithm
    validate_cluster(cfg.cluster)
    validate_trainer(cfg.trainer, cfg.resume, dict.fromkeys(("env", "policy", "actor"), RANK_STATE))
    if cfg.trainer.max_staleness != 0:  # its loop is its own (no LLMRun pipeline)
        raise ConfigError(
            f"trainer.max_staleness={cfg.trainer.max_staleness}: the embodied runner trains "
            "on-policy only; run it with trainer.max_staleness=0"
        )
    require(
        [
            (cfg.env.num_envs >= 1 and cfg.env.steps >= 1, "env.num_envs, env.steps: >= 1"),
            (finite_positive(a.lr), "algorithm.lr must be a finite number > 0"),
            (a.clip_eps > 0, "algorithm.clip_eps must be > 0"),
            (0 <= a.gamma <= 1 and 0 <= a.lam <= 1, "algorithm.gamma and algorithm.lam: [0, 1]"),
            (a.epochs >= 1 and a.mini_batch_size >= 1, "algorithm.epochs, mini_batch_size: >= 1"),
        ]
    )
    try:  # the engine says what it cannot run
        check_engine("actor_critic", a.engine, plain(a), None, "algorithm")
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def main(cfg) -> dict:
    from m2flow.workers.embodied.actor import EmbodiedActorWorker
    from m2flow.workers.embodied.env import EnvWorker
    from m2flow.workers.embodied.policy import PolicyWorker

    from m2flow import Channel, sync_weights
    from m2flow.run.runlog import RunLog

    tr = cfg.trainer
    cluster = start_cluster(cfg.cluster, tr.run_dir)
    e = cfg.env
    env = EnvWorker.launch(cluster, name="env", options=options(e), seed=tr.seed)
    spec = env.spec().wait()
    policy = PolicyWorker.launch(
        cluster, name="policy", **spec, options=options(cfg.policy), seed=tr.seed
    )
    actor = EmbodiedActorWorker.launch(
        cluster, name="actor", **spec, hidden=cfg.policy.hidden,
        options=options(cfg.algorithm), seed=tr.seed,
    )  # fmt: skip
    obs, actions, trajectories = map(Channel.create, ("obs", "actions", "trajectories"))
    trained = {"env": env, "policy": policy, "actor": actor}
    checkpoints = Checkpoints(tr.run_dir)

    summary: dict = {}
    start = checkpoints.restore(trained)[0] if cfg.resume else 0
    resumed = start if cfg.resume else None  # later records are dropped, time continues
    with RunLog(tr.run_dir, tr.steps, tr.logger, resumed, tr.log_every, plain(cfg)) as log:
        log.print(cluster.describe())
        sync_weights(actor, policy)
        log.advance(start)
        for step in range(start + 1, tr.steps + 1):
            t0 = time.time()
            roll = env.rollout(obs, actions, trajectories, e.steps)
            act = policy.act(obs, actions)
            upd = actor.train(trajectories)
            e_out, _, a_out = roll.wait(), act.wait(), upd.wait()
            sync_weights(actor, policy)
            seconds, env_steps = time.time() - t0, sum(o["env_steps"] for o in e_out)
            episodes = sum(o["episodes"] for o in e_out)
            recent = [o["recent_return"] for o in e_out if not math.isnan(o["recent_return"])]
            metrics = {
                "episodes": episodes,  # finished this step; their mean return and length:
                **({"episode_return": sum(o["return_sum"] for o in e_out) / episodes,
                    "episode_length": sum(o["length_sum"] for o in e_out) / episodes}
                   if episodes else {}),
                "recent_return": sum(recent) / len(recent) if recent else 0.0,
                "env_steps_per_s": env_steps / roll.time(),  # during the rollout
                "env_steps_per_s_overall": env_steps / seconds,  # whole step, update included
                "step_s": seconds,
                "env_s": roll.time(busy=True),
                "env_sim_s": max(o["env_s"] for o in e_out),
                "policy_s": act.time(busy=True),
                "actor_s": upd.time(busy=True),
                **{k: a_out[k] for k in ("pg_loss", "vf_loss", "entropy", "approx_kl",
                                         "clip_frac", "explained_variance", "grad_norm")},
                "actor_update_norm": a_out["update_norm"],
            }  # fmt: skip
            if step == 1:
                summary["first_return"] = metrics.get("episode_return", 0.0)
            summary["final_recent_return"] = metrics["recent_return"]
            if step % tr.save_every == 0 or step == tr.steps:
                checkpoints.save(step, trained)
            log.log(step, metrics)
            log.advance(step, f"return {metrics['recent_return']:.1f}")
        log.print(f"summary: {summary}")
    cluster.shutdown()
    return summary


if __name__ == "__main__":
    from m2flow.run.cli import run_as_script

    run_as_script(__file__)
