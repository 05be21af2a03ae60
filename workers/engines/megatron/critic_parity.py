"""Rank body of the Megatron-critic-vs-torch-critic parity check (tests/test_megatron_critic.py).

The parent builds a torch critic (``ValueModel``), a batch with old values and returns, and
runs the torch critic's update on it twice: from the initial weights (step A) and, as a resume
check, from step A's weights and AdamW state (step B). It saves all that (``case.pt``) and
spawns ``tp * dp`` processes (:func:`~.parity.spawn_parity` with
``target=critic_parity_rank``); each builds this rank's :class:`~.critic.MegatronCritic`
from the torch critic's state, computes the values, runs the critic's update
(:func:`~..update.value_update`, step A), gathers weights and AdamW state into the torch
critic's format, then loads the torch critic's state after step A (weights and optimizer: the
cross-engine resume) and runs step B. Rank 0 writes ``rank0.pt``; the parent compares.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def critic_parity_rank(rank: int, world: int, workdir: str, tp: int, dp: int, pp: int = 1):
    """One rank of the critic parity run (``pp`` must be 1); writes ``workdir/rank0.pt``."""
    from .parity import join_world

    workdir = join_world(rank, world, workdir)
    try:
        _run(rank, world, workdir, tp)
    finally:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _run(rank: int, world: int, workdir: Path, tp: int) -> None:
    from ...algos.losses import make_loss, response_values
    from ..update import value_update
    from .critic import MegatronCritic

    case = torch.load(workdir / "case.pt", weights_only=False)
    engine = MegatronCritic(
        case["hf_config"],
        case["initial"],
        case["names"],
        rank,
        world,
        None,
        torch.device("cpu"),
        tp,
        case["optim"],
    )
    batch, t = case["batch"], case["train"]

    loss = make_loss("value", "value", value_clip=t["value_clip"])

    def update():
        before = [p.detach().clone() for p in engine.model.parameters()]
        gen = torch.Generator().manual_seed(t["seed"])
        metrics = value_update(engine, batch, loss, t["mini"], t["micro"], t["epochs"], gen)
        return metrics, engine.change_norm(before)

    out = {"values": engine.infer(batch, response_values, t["micro"])}
    out["metrics_a"], out["change_a"] = update()
    out["state_a"], out["optimizer_a"] = engine.gather(), engine.gather_optimizer()
    engine.load(case["state_a"])  # the torch critic's step-A checkpoint, loaded here
    engine.load_optimizer(case["optimizer_a"])
    out["metrics_b"], _ = update()
    out["state_b"], out["optimizer_b"] = engine.gather(), engine.gather_optimizer()
    if rank == 0:
        torch.save(out, workdir / "rank0.pt")
