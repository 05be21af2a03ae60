"""Probes for tests/test_megatron_engine.py: the GRPO workers plus methods that show their
state. In a module of their own so that the Ray workers which unpickle them import only this,
not the test modules (and all those import)."""

from __future__ import annotations

import torch
from m2flow.workers.actor.worker import ActorWorker
from m2flow.workers.rollout.worker import RolloutWorker

from m2flow import group_method


class ShardedActor(ActorWorker):
    """The actor plus probes: its training data per step, its Megatron shard, its optimizer."""

    def _training_data(self, batch) -> dict:
        data = super()._training_data(batch)
        self.seen = {**getattr(self, "seen", {}), self.weight_version: data}
        return data

    @group_method
    def training_data(self, version: int) -> dict:
        """What the step from weight version ``version`` trained on (``[B, ...]`` tensors)."""
        return self.seen[version]

    @group_method
    def shard(self, reference: bool = False) -> tuple[int, int, int, dict]:
        """``(tp_rank, pp_rank, dp_rank, Megatron state dict)`` of this rank's policy shard (or
        reference shard)."""
        from m2flow.workers.engines.megatron.convert import megatron_state

        e = self.engine.megatron
        model = e.ref_model if reference else e.model
        return e.tp_rank, e.pp_rank, e.dp_rank, megatron_state(model)

    @group_method
    def optimizer_state(self) -> dict:
        return self.engine.megatron.optimizer.state_dict()

    @group_method
    def scramble(self) -> None:
        """Weights (and the reference's) to 0 and a fresh optimizer: what a checkpoint load
        must undo."""
        models = [self.engine.megatron.model, self.engine.megatron.ref_model]
        with torch.no_grad():
            for p in (p for m in models if m is not None for p in m.parameters()):
                p.zero_()
        self.engine.megatron.reset_optimizer()


class ProbedRollout(RolloutWorker):
    """The rollout plus a probe: the weights each sync left it with."""

    def load_weights(self, weights: dict, version: int) -> None:
        super().load_weights(weights, version)
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.history = {**getattr(self, "history", {}), version: state}

    @group_method
    def weights(self, version: int) -> dict:
        return self.history[version]
