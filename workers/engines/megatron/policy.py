"""The ``megatron`` :class:`~..train.TrainEngine`: :class:`~.engine.MegatronEngine` shards, plus
rank 0's Hugging Face copy of the policy (the warm start's model, the weight source, the
checkpoint's layout)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...batch import row_order
from ...llm import load_model
from ..torch_engine import load_pretrained_weights
from ..trainer import PolicyTrainer, TrainerSteps


class MegatronPolicyEngine(TrainerSteps):
    """The policy as Megatron ``GPTModel`` shards, one rank per device (TP x PP x DP; see
    :mod:`.engine`).

    Every rank reads the whole step (:meth:`read_step`) and trains its rows of it; the warm
    start runs on rank 0's Hugging Face copy (:attr:`sft_trainer`, a torch
    :class:`~..trainer.PolicyTrainer`) and is scattered into the shards by :meth:`publish`; after
    each update the shards are gathered into that copy, so :meth:`get_weights` and
    checkpoints stay in Hugging Face layout (optimizer state: one file per rank).

    Raises:
        ValueError: started without the rendezvous (``dist``: the role's ``launch`` draws it).
    """

    one_rank_per_device = True
    whole_step = True

    @classmethod
    def check(cls, world_size: int, kwargs: dict, role: str = "actor") -> None:
        """:func:`.engine.check_config`."""
        from .engine import check_config

        check_config(world_size, kwargs, role)

    def __init__(
        self, model: dict, tokenizer, *, device: torch.device, rank: int = 0,
        world_size: int = 1, dist: dict | None = None, optim: dict, seed: int = 0,
        tensor_parallel: int = 1, pipeline_parallel: int = 1,
    ) -> None:  # fmt: skip
        from .engine import MegatronEngine

        if dist is None:
            raise ValueError("engine='megatron' needs the rendezvous: start with launch()")
        self.rank = rank
        self.model = load_model(model, tokenizer, device, trainable=True, seed=seed)
        self.sft_trainer = PolicyTrainer(self.model, **optim)
        self.megatron = MegatronEngine(
            self.model.config,
            self.model.state_dict() if rank == 0 else None,
            rank,
            world_size,
            dist,
            device,
            tensor_parallel,
            optim,
            pipeline_parallel=pipeline_parallel,
        )
        self.trainer = self.megatron.trainer
        if rank != 0:  # only rank 0 keeps a Hugging Face copy (the weight source)
            self.model = self.sft_trainer = None

    # -- training ---------------------------------------------------------------------------

    def read_step(self, parts) -> list:
        """Every rank: the whole step (:meth:`.engine.MegatronEngine.read_step`)."""
        return self.megatron.read_step(parts)

    def publish(self) -> None:
        self.megatron.load_hf(None if self.model is None else self.model.state_dict())
        self.megatron.freeze_reference()

    def _gather(self) -> None:
        hf = self.megatron.gather_hf()  # rank 0's HF copy: the weight source
        if hf is not None:
            self.model.load_state_dict(hf)

    def train(self, data, mini_batch_size, micro_batch_size, epochs=1, generator=None) -> dict:
        """GRPO (no ``generator``): one :meth:`.engine.MegatronEngine.train` pass; PPO:
        :func:`ppo_epochs`. Every rank calls it with the same ``data``."""
        metrics = {}
        if len(data["response_ids"]):  # every rank decides alike: they hold the same batch
            if generator is None and epochs == 1:
                metrics = self.megatron.train(data, mini_batch_size, micro_batch_size)
            else:
                split = (mini_batch_size, micro_batch_size, epochs, generator)
                metrics = ppo_epochs(self.megatron, data, *split)
        self._gather()
        return metrics

    def accumulate(self, data: dict, micro_batch_size: int | None) -> int:
        raise NotImplementedError("the Megatron engine trains on whole steps (whole_step)")

    def finish_accumulation(self) -> dict[str, float]:
        raise NotImplementedError("the Megatron engine trains on whole steps (whole_step)")

    # -- weights and checkpoints ------------------------------------------------------------

    def get_weights(self) -> dict[str, torch.Tensor]:
        if self.model is None:
            raise RuntimeError(
                "the Megatron actor's weights are gathered on rank 0: call get_weights there "
                "(actor.on(0).get_weights(); sync_weights does)"
            )
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def save(self, path: Path) -> dict | None:
        """Each rank's optimizer shard in its own file; the reference shard gathered to Hugging
        Face layout (a collective of all ranks); rank 0 the model in Hugging Face layout."""
        self.megatron.save_optimizer(path)
        reference = None
        if self.megatron.ref_model is not None:
            reference = self.megatron.gather_hf(reference=True)
        if self.rank != 0:
            return None
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        return {"optimizer": None, "trainer_steps": self.trainer.steps, "reference": reference}

    def load(self, path: Path, state: dict) -> None:
        if self.model is not None:  # rank 0's HF copy, scattered below
            load_pretrained_weights(self.model, path)
        self.megatron.load_hf(None if self.model is None else self.model.state_dict())
        self.megatron.load_optimizer(path)
        self.trainer.steps = state["trainer_steps"]
        if self.megatron.ref_model is not None and state["reference"] is not None:
            self.megatron.load_hf(state["reference"] if self.rank == 0 else None, True)

    # -- memory -----------------------------------------------------------------------------

    def offload(self) -> None:
        """The shard, its AdamW state and the reference shard; rank 0's HF copy too."""
        self.megatron.offload()
        if self.sft_trainer is not None:
            self.sft_trainer.offload()

    def onload(self) -> None:
        self.megatron.onload()
        if self.sft_trainer is not None:
            self.sft_trainer.onload()


def ppo_epochs(
    engine, data: dict, mini_batch_size, micro_batch_size, epochs: int, generator
) -> dict[str, float]:
    """:meth:`PolicyTrainer.train_on_batch` (``epochs``, ``shuffle=epochs > 1``) on a
    :class:`~.engine.MegatronEngine`: per epoch one ``engine.train`` pass over the batch
    permuted by ``torch.randperm(n, generator=generator)``, the same draws as the torch
    engine's, so the mini-batches hold the same rows. Old logprobs, if absent, are computed once
    for every row before the first update (every rank alike: a TP collective). Every rank
    calls it with the same ``data`` and generator state.

    Returns:
        the torch engine's metrics: means over all optimizer steps, ``steps``.
    """
    n = len(data["response_ids"])
    if "old_logprobs" not in data:
        data = dict(data, old_logprobs=engine.trainer.compute_logprobs(data, micro_batch_size))
    sums: dict[str, float] = {}
    steps = 0
    for _ in range(epochs):
        order = row_order(n, epochs > 1, generator)
        m = engine.train({k: v[order] for k, v in data.items()}, mini_batch_size, micro_batch_size)
        k_steps = int(m.pop("steps", 0))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v * k_steps
        steps += k_steps
    out = {k: v / max(steps, 1) for k, v in sums.items()}
    out["steps"] = steps
    return out
