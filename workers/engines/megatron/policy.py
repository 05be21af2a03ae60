"""The ``megatron`` :class:`~..train.TrainEngine`: :class:`~.engine.MegatronEngine` shards, plus
rank 0's Hugging Face copy of the policy (a torch engine: the warm start's model, the weight
source, the checkpoint's layout)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..torch_engine import TorchEngine, load_pretrained_weights, refuse_nonfinite


class MegatronPolicyEngine:
    """The policy as Megatron ``GPTModel`` shards, one rank per device (TP x PP x DP; see
    :mod:`.engine`).

    Every rank reads the whole step (:meth:`read_step`) and, given the whole batch, trains its
    rows of it (:meth:`forward_backward`, :meth:`optimizer_step`: the shards' mechanics). The
    warm start runs on rank 0's Hugging Face copy (:meth:`solo`: a one-rank
    :class:`~..torch_engine.TorchEngine`) and is scattered into the shards by :meth:`publish`;
    after each optimizer step the shards are gathered into that copy, so :meth:`get_weights`
    and checkpoints stay in Hugging Face layout (optimizer state: one file per rank).

    Raises:
        ValueError: started without the rendezvous (``dist``: the role's ``launch`` draws it).
    """

    one_rank_per_device = True
    whole_step = True
    data_parallel = True

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "actor") -> None:
        """:func:`.engine.check_config`."""
        from .engine import check_config

        check_config(world_size, config, role)

    def __init__(
        self, model: dict, tokenizer, *, device: torch.device, rank: int = 0,
        world_size: int = 1, dist: dict | None = None, optim: dict, seed: int = 0,
        tensor_parallel: int = 1, pipeline_parallel: int = 1,
    ) -> None:  # fmt: skip
        from .engine import MegatronEngine

        if dist is None:
            raise ValueError("engine='megatron' needs the rendezvous: start with launch()")
        self.rank = rank
        # rank 0's Hugging Face copy: its own AdamW (the warm start's), no reference
        self.hf: TorchEngine | None = TorchEngine(
            model, tokenizer, device=device, optim={**optim, "kl_coef": 0.0}, seed=seed
        )
        self.megatron = MegatronEngine(
            self.hf.model.config,
            self.hf.model.state_dict() if rank == 0 else None,
            rank,
            world_size,
            dist,
            device,
            tensor_parallel,
            optim,
            pipeline_parallel=pipeline_parallel,
        )
        if rank != 0:  # only rank 0 keeps a Hugging Face copy (the weight source)
            self.hf = None

    @property
    def model(self) -> torch.nn.Module | None:
        """Rank 0's Hugging Face copy (``None`` on the other ranks)."""
        return None if self.hf is None else self.hf.model

    @property
    def steps(self) -> int:
        return self.megatron.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.megatron.steps = value

    # -- training: the shards' mechanics ------------------------------------------------------

    def read_step(self, parts) -> list:
        """Every rank: the whole step (:meth:`.engine.MegatronEngine.read_step`)."""
        return self.megatron.read_step(parts)

    def forward_backward(self, batch, loss, micro_batch_size=None, normalizer=None) -> list:
        return self.megatron.forward_backward(batch, loss, micro_batch_size, normalizer)

    def optimizer_step(self, normalizer: float | None = None) -> dict[str, float]:
        """The shards' step, then their weights gathered into rank 0's copy (a collective)."""
        out = self.megatron.optimizer_step(normalizer)
        hf = self.megatron.gather_hf()  # rank 0's HF copy: the weight source
        if hf is not None:
            self.hf.model.load_state_dict(hf)
        return out

    def zero_grad(self) -> None:
        self.megatron.zero_grad()

    def reduce_metrics(self, sums: dict, keys: tuple[str, ...]) -> dict:
        return self.megatron.reduce_metrics(sums, keys)

    def infer(self, batch, fn=None, micro_batch_size=None, reference: bool = False):
        return self.megatron.infer(batch, fn, micro_batch_size, reference)

    def set_lr(self, lr: float) -> None:
        self.megatron.set_lr(lr)

    def reset_optimizer(self) -> None:
        self.megatron.reset_optimizer()

    @contextlib.contextmanager
    def solo(self):
        """Rank 0's Hugging Face copy as a one-rank torch engine (``None`` on the others)."""
        yield self.hf

    def publish(self) -> None:
        self.megatron.load_hf(None if self.hf is None else self.hf.model.state_dict())
        self.megatron.freeze_reference()

    # -- weights and checkpoints ------------------------------------------------------------

    def get_weights(self) -> dict[str, torch.Tensor]:
        if self.hf is None:
            raise RuntimeError(
                "the Megatron actor's weights are gathered on rank 0: call get_weights there "
                "(actor.on(0).get_weights(); sync_weights does)"
            )
        return self.hf.get_weights()

    def load_weights(self, weights: dict[str, torch.Tensor] | None) -> None:
        """Hugging Face layout weights (rank 0's; the others pass ``None``) into rank 0's copy
        and every rank's shard. A collective of all ranks."""
        if self.hf is not None:
            self.hf.load_weights(weights)
        self.megatron.load_hf(weights if self.hf is not None else None)

    def save(self, path: Path) -> dict | None:
        """Each rank's optimizer shard in its own file; the reference shard gathered to Hugging
        Face layout (a collective of all ranks); rank 0 the model in Hugging Face layout."""
        if self.hf is not None:
            refuse_nonfinite(self.hf, "actor")
        self.megatron.save_optimizer(path)
        reference = None
        if self.megatron.ref_model is not None:
            reference = self.megatron.gather_hf(reference=True)
        if self.rank != 0:
            return None
        path.mkdir(parents=True, exist_ok=True)
        self.hf.model.save_pretrained(path)
        return {"optimizer": None, "trainer_steps": self.steps, "reference": reference}

    def load(self, path: Path, state: dict) -> None:
        if self.hf is not None:  # rank 0's HF copy, scattered below
            load_pretrained_weights(self.hf.model, path)
        self.megatron.load_hf(None if self.hf is None else self.hf.model.state_dict())
        self.megatron.load_optimizer(path)
        self.steps = state["trainer_steps"]
        if self.megatron.ref_model is not None and state["reference"] is not None:
            self.megatron.load_hf(state["reference"] if self.rank == 0 else None, True)

    # -- memory -----------------------------------------------------------------------------

    def offload(self) -> None:
        """The shard, its AdamW state and the reference shard; rank 0's HF copy too."""
        self.megatron.offload()
        if self.hf is not None:
            self.hf.offload()

    def onload(self) -> None:
        self.megatron.onload()
        if self.hf is not None:
            self.hf.onload()
