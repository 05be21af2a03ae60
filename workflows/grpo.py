"""GRPO on a reasoning-gym task: supervised warm start, then rollout -> reward -> actor.

    m2flow run workflows/grpo.py trainer.steps=50 rollout.temperature=0.8
    m2flow run workflows/grpo.py plan=auto cluster.devices_per_node=2

The runner below is the whole algorithm; it holds no placement logic. Where each group runs and
how finely the rollout streams to its consumers is the runtime's plan (``plan=temporal``, the
default: every group on every device, the device locks switching between them;
``plan=auto|spatial|hybrid`` from a profile; or ``plan=path/to/plan.yaml``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from m2flow.workers.llm.config import ModelConfig as LMShape

from m2flow.cluster import Offload
from m2flow.config import ConfigError


@dataclass
class ClusterConfig:
    address: Optional[str] = None  # None: embedded local Ray; "auto"/"host:port": join one
    devices_per_node: int = 1  # virtual devices per node without GPUs
    device_memory_gb: float = 16.0  # declared capacity of a virtual device
    num_cpus: Optional[int] = None  # CPUs of the embedded Ray (default: all)
    # On a device switch, offload the leaving worker: always, never, or auto (GPUs only; a
    # virtual device's memory is host RAM, so offloading there frees nothing).
    offload: Offload = Offload.auto


@dataclass
class TaskConfig:
    name: str = "chain_sum"
    config: dict[str, Any] = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    )
    train_seed: int = 1
    train_size: int = 20000
    val_seed: int = 2  # warm start stops on this split, never on the held-out one
    val_size: int = 300
    heldout_seed: int = 3
    heldout_size: int = 500  # greedy accuracy = share of items with score == 1


@dataclass
class ModelConfig(LMShape):  # hidden_size, num_hidden_layers, ...: a tiny Qwen2
    alphabet: str = "0123456789+-="  # character tokenizer (+ pad/eos/bos/unk)


@dataclass
class WarmStartConfig:
    steps: int = 2000  # supervised steps at most
    batch_size: int = 256  # samples per step
    lr: float = 3e-3
    # Stop early on purpose: an uncertain policy gives GRPO groups with mixed rewards.
    target_accuracy: Optional[float] = 0.15  # greedy accuracy on the val split
    eval_every: int = 10
    time_budget_s: Optional[float] = 360.0


@dataclass
class RolloutConfig:
    n_samples: int = 16  # GRPO group size (responses per prompt)
    max_new_tokens: int = 6
    temperature: float = 0.7  # 1.0 samples too far from the greedy policy to learn from
    top_p: float = 1.0
    shared_prefix: bool = True  # prefill each prompt once per group, not once per sample
    threads: int = 0  # torch threads; 0 = the rank's share of its node's CPUs


@dataclass
class ActorConfig:
    lr: float = 1e-4  # 1e-3 collapsed the policy in our runs
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28  # DAPO's clip-higher
    kl_coef: float = 0.0  # k3 KL to the warm-started policy; 0 = no reference
    mini_batch_size: int = 0  # responses per optimizer step; 0 = the whole global batch
    micro_batch_size: int = 0  # responses per forward/backward; 0 = the whole mini-batch
    drop_flat_groups: bool = True  # groups with one reward for all samples: no signal
    recompute_old_logprobs: bool = False
    shared_prefix: bool = True  # forward each group's prompt once (same math, ~3x fewer tokens)
    threads: int = 0  # torch threads; 0 = the CPUs of the actor's devices


@dataclass
class RewardServiceConfig:
    url: Optional[str] = None  # None: score in process; "http://127.0.0.1:8765": the service
    token: str = ""  # this tenant's bearer token from the service's config
    task: str = "grpo"  # task name registered with the service
    pipeline: str = "math"  # answer extraction + math-verify (0/1 rewards)
    timeout_s: float = 600.0  # longest wait for one chunk's rewards


@dataclass
class TrainerConfig:
    steps: int = 800  # GRPO steps
    prompts_per_step: int = 32  # global batch: prompts (x n_samples responses)
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    run_dir: str = "runs/grpo"
    tensorboard: bool = False


@dataclass
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    reward_service: RewardServiceConfig = field(default_factory=RewardServiceConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resume: bool = False  # continue from the last checkpoint in trainer.run_dir


def validate(cfg) -> None:
    """Value checks the types cannot express. Raises ConfigError."""
    checks = [
        (cfg.trainer.steps >= 0, "trainer.steps must be >= 0"),
        (cfg.trainer.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1"),
        (cfg.rollout.n_samples >= 2, "rollout.n_samples must be >= 2 (GRPO compares a group)"),
        (cfg.rollout.temperature > 0, "rollout.temperature must be > 0"),
        (0 < cfg.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        (cfg.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
        (cfg.actor.lr > 0 and cfg.warm_start.lr > 0, "learning rates must be > 0"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


def main(cfg) -> dict:
    from m2flow.workers.actor.worker import ActorWorker
    from m2flow.workers.llm import build_char_tokenizer
    from m2flow.workers.reward.worker import RewardWorker
    from m2flow.workers.rollout.worker import RolloutWorker, num_chunks
    from m2flow.workers.tasks import TaskDataset

    from m2flow import Channel
    from m2flow.runlog import RunLog

    run_dir, t, tr = Path(cfg.trainer.run_dir), cfg.task, cfg.trainer
    _check_run_dir(run_dir, cfg.resume)
    cluster = start_cluster(cfg.cluster, run_dir)
    model, task = _plain(cfg.model), _plain(cfg.task)
    alphabet = model.pop("alphabet")
    rollout = RolloutWorker.launch(
        cluster,
        name="rollout",
        model=model,
        alphabet=alphabet,
        task=task,
        seed=tr.seed,
        **_plain(cfg.rollout),
    )
    service = _plain(cfg.reward_service) if cfg.reward_service.url else None
    reward = RewardWorker.launch(cluster, name="reward", alphabet=alphabet, service=service)
    actor = ActorWorker.launch(
        cluster,
        name="actor",
        model=model,
        alphabet=alphabet,
        temperature=cfg.rollout.temperature,
        seed=tr.seed,
        **_plain(cfg.actor),
    )
    prompts, rollouts, scored = (Channel.create(n) for n in ("prompts", "rollouts", "scored"))
    tokenizer = build_char_tokenizer(alphabet)
    train = TaskDataset(t.name, dict(t.config), seed=t.train_seed, size=t.train_size)
    granularity = cluster.granularity("rollout", default=tr.prompts_per_step)
    chunks = num_chunks(tr.prompts_per_step, rollout.world_size, granularity)

    def sync_weights():
        sent = actor.send_weights("rollout", rollout.world_size)
        rollout.sync_weights("actor").wait()
        sent.wait()

    def evaluate() -> float:
        scores = [s for shard in rollout.evaluate().wait() for s in shard]
        return sum(s == 1.0 for s in scores) / len(scores)

    start = _restore(actor, run_dir) if cfg.resume else 0
    summary = {}
    with RunLog(run_dir, tr.steps, tr.tensorboard) as log:
        log.print(cluster.describe())
        if start == 0:
            ws = actor.warm_start(task, seed=tr.seed, **_plain(cfg.warm_start)).wait()[0]
            sync_weights()
            acc = summary["accuracy_after_warm_start"] = evaluate()
            log.log(0, {"phase": "warm_start", **ws, "heldout_accuracy": acc})
        else:
            sync_weights()
        log.advance(start)
        for step in range(start + 1, tr.steps + 1):
            t0 = time.time()
            prompts.put_many(_prompt_items(train, tokenizer, tr.prompts_per_step, tr.seed, step))
            gen = rollout.generate(prompts, rollouts, tr.prompts_per_step, granularity)
            rew = reward.score(rollouts, scored, chunks)
            upd = actor.train(scored, chunks)
            g_out, r_out, a_out = gen.wait(), rew.wait()[0], upd.wait()[0]
            sync_weights()
            seconds = time.time() - t0
            tokens = sum(o["tokens"] for o in g_out)
            metrics = {
                "reward_mean": r_out["reward_mean"],
                "sample_accuracy": r_out["accuracy"],
                "response_length": g_out[0]["response_length"],
                "tokens_per_s": tokens / seconds,
                "step_s": seconds,
                "rollout_s": gen.time(busy=True),
                "reward_s": rew.time(busy=True),
                "actor_s": upd.time(busy=True),
                "loss": a_out["loss"],
                "clip_frac": a_out["clip_frac"],
                "grad_norm": a_out["grad_norm"],
            }
            if step % tr.eval_every == 0 or step == tr.steps:
                metrics["heldout_accuracy"] = summary["final_accuracy"] = evaluate()
            if step % tr.save_every == 0 or step == tr.steps:
                actor.save_checkpoint(str(run_dir / "checkpoints" / f"step_{step:06d}")).wait()
            log.log(step, metrics, echo="heldout_accuracy" in metrics or step % 10 == 0)
            log.advance(step, f"reward {metrics['reward_mean']:.3f}")
        log.print(f"summary: {summary}")
    cluster.shutdown()
    return summary


def start_cluster(c: ClusterConfig, run_dir: Path):
    """The run's :class:`~m2flow.Cluster` from the ``cluster`` config section."""
    from m2flow import Cluster

    return Cluster(
        c.address,
        num_cpus=c.num_cpus,
        virtual_devices_per_node=c.devices_per_node,
        device_memory_gb=c.device_memory_gb,
        run_dir=run_dir,
        offload=c.offload,
    )


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to start a fresh run over an earlier run's checkpoints (nothing is lost)."""
    if not resume and any(run_dir.glob("checkpoints/step_*")):
        raise ConfigError(
            f"{run_dir} already holds checkpoints: pass --resume to continue "
            "that run, or set trainer.run_dir to start a new one"
        )


def _prompt_items(train, tokenizer, n: int, seed: int, step: int) -> list[dict]:
    """The step's ``n`` prompts (GRPO groups ``0..n-1``); the draw depends only on seed and
    step, so a resumed run sees the same data."""
    rng = random.Random(seed * 1_000_003 + step)
    return [
        {"prompt_ids": tokenizer(train[i].prompt).input_ids, "group": g, "entry": train[i].entry}
        for g, i in enumerate(rng.sample(range(len(train)), n))
    ]


def _plain(section) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(section, resolve=True)


def _restore(actor, run_dir: Path) -> int:
    """Load the newest checkpoint of ``run_dir``; returns its step.

    Raises:
        ConfigError: --resume without a checkpoint to resume from.
    """
    found = sorted(run_dir.glob("checkpoints/step_*"))
    if not found:
        raise ConfigError(f"--resume: no checkpoint under {run_dir / 'checkpoints'}")
    actor.load_checkpoint(str(found[-1])).wait()
    return int(found[-1].name.split("_")[1])


if __name__ == "__main__":
    from m2flow.cli import run_as_script

    run_as_script(__file__)
