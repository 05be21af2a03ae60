"""The ``torch`` :class:`~.train.TrainEngine`: a Hugging Face model trained by
:class:`~.trainer.PolicyTrainer`, one rank, or data parallel (one rank per device, one gradient
all-reduce per step, :mod:`~m2flow.workers.parallel`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .. import parallel as dp
from ..llm import load_model
from .trainer import PolicyTrainer, TrainerSteps


def load_pretrained_weights(model: torch.nn.Module, src: Path) -> None:
    """Load ``src/model.safetensors`` (``save_pretrained``'s file) into ``model``.

    Raises:
        ValueError: the file does not match the model (missing or unexpected keys; a missing
            LM head is fine: ``save_pretrained`` drops it when tied to the embeddings).
    """
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(src / "model.safetensors"), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(
            f"checkpoint {src} does not match the model: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()


class TorchEngine(TrainerSteps):
    """The policy as one Hugging Face model per rank (see :class:`~.train.TrainEngine`).

    With ``kl_coef > 0`` (in ``optim``) a frozen copy of the policy, in the compute dtype, is
    the reference (refrozen by :meth:`publish` after the warm start). With ``world_size > 1``
    the ranks join one process group (``dist``); every rank holds the whole model.
    """

    one_rank_per_device = False
    whole_step = False

    @classmethod
    def check(cls, world_size: int, kwargs: dict, role: str = "actor") -> None:
        """Refuse model-parallel knobs, and several ranks without ``data_parallel`` or with a
        ``mini_batch_size``."""
        if kwargs.get("tensor_parallel", 1) != 1 or kwargs.get("pipeline_parallel", 1) != 1:
            raise ValueError(
                f"{role}.tensor_parallel / {role}.pipeline_parallel need {role}.engine=megatron"
            )
        if world_size == 1:
            return
        if not kwargs.get("data_parallel"):
            raise ValueError(
                f"the {role} got {world_size} ranks: launch it with data_parallel=True "
                f"({role}.data_parallel=true) for data-parallel training, or give it one rank"
            )
        if kwargs.get("mini_batch_size"):
            raise ValueError(
                f"data-parallel training takes one optimizer step per step (streaming); "
                f"mini_batch_size={kwargs['mini_batch_size']} would need the ranks to agree "
                f"on every mini-batch: set {role}.mini_batch_size=0"
            )

    def __init__(
        self, model: dict, tokenizer, *, device: torch.device, rank: int = 0,
        world_size: int = 1, dist: dict | None = None, optim: dict, seed: int = 0, **parallel,
    ) -> None:  # fmt: skip
        if world_size != 1:
            dp.init(rank, world_size, dist["addr"], dist["port"], device)
        self.device, self.rank = device, rank
        # float32 master weights; forward/backward under autocast to model.dtype
        self.model = load_model(model, tokenizer, device, trainable=True, seed=seed)
        self.trainer = self.sft_trainer = PolicyTrainer(self.model, **optim)
        self.kl_coef = optim.get("kl_coef", 0.0)
        self.ref_model: torch.nn.Module | None = None
        self.freeze_reference()

    def freeze_reference(self) -> None:
        """The reference := a frozen copy of the policy now (KL on only)."""
        if self.kl_coef > 0:
            ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.ref_model = ref.to(self.trainer.compute_dtype)  # inference: compute dtype

    @torch.no_grad()
    def _with_reference(self, data: dict, micro_batch_size: int | None) -> dict:
        """``data`` plus the reference's ``ref_logprobs`` (same function as the policy's)."""
        if self.ref_model is None or "ref_logprobs" in data or not len(data["response_ids"]):
            return data
        policy, self.trainer.model = self.trainer.model, self.ref_model
        try:
            ref = self.trainer.compute_logprobs(data, micro_batch_size)
        finally:
            self.trainer.model = policy
        return dict(data, ref_logprobs=ref)

    # -- training ---------------------------------------------------------------------------

    def read_step(self, parts) -> list:
        return [item for part in parts for item in part]

    def publish(self) -> None:
        if dp.active():
            dp.broadcast_model(self.model)
        self.freeze_reference()

    def train(self, data, mini_batch_size, micro_batch_size, epochs=1, generator=None) -> dict:
        if not len(data["response_ids"]):
            return {}
        data = self._with_reference(data, micro_batch_size)
        return self.trainer.train_on_batch(
            data, mini_batch_size, micro_batch_size,
            epochs=epochs, shuffle=epochs > 1, generator=generator,
        )  # fmt: skip

    def accumulate(self, data: dict, micro_batch_size: int | None) -> int:
        data = self._with_reference(data, micro_batch_size)
        return self.trainer.accumulate(data, micro_batch_size)

    def finish_accumulation(self) -> dict[str, float]:
        return self.trainer.finish_accumulation()

    # -- weights and checkpoints ------------------------------------------------------------

    def get_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def save(self, path: Path) -> dict | None:
        reference = None if self.ref_model is None else self.ref_model.state_dict()
        if self.rank != 0:
            return None  # data-parallel ranks hold the same state
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        return {
            "optimizer": self.trainer.optimizer.state_dict(),
            "trainer_steps": self.trainer.steps,
            "reference": reference,
        }

    def load(self, path: Path, state: dict) -> None:
        load_pretrained_weights(self.model, path)
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.trainer.steps = state["trainer_steps"]
        if state["reference"] is not None:
            self.freeze_reference()
            self.ref_model.load_state_dict(state["reference"])

    # -- memory -----------------------------------------------------------------------------

    def offload(self) -> None:
        """:meth:`PolicyTrainer.offload` (parameters and AdamW state); the reference moves to
        host memory on CUDA."""
        self.trainer.offload()
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to("cpu")

    def onload(self) -> None:
        self.trainer.onload()
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to(self.device)


class TorchValueEngine:
    """The value-head variant (the critic's): a :class:`~.value_model.ValueModel` (the policy's
    trunk plus ``Linear(hidden, 1)``) trained by :class:`~.value_trainer.ValueTrainer`, one
    rank. Weights and optimizer state are the torch critic's layout, which every value engine
    saves and loads.
    """

    one_rank_per_device = False
    whole_step = False

    @classmethod
    def check(cls, world_size: int, kwargs: dict, role: str = "critic") -> None:
        if kwargs.get("tensor_parallel", 1) != 1:
            raise ValueError(f"{role}.tensor_parallel needs {role}.engine=megatron")

    def __init__(
        self, model: dict, tokenizer, *, device: torch.device, optim: dict, seed: int = 0,
        classifier: str | None = None, **_,
    ) -> None:  # fmt: skip
        """``classifier``: a Hugging Face sequence-classification directory (a pretrained
        reward model, :meth:`~.value_model.ValueModel.from_classifier`) instead of the
        policy's trunk with a new head."""
        from ..llm import compute_dtype
        from .value_model import ValueModel
        from .value_trainer import ValueTrainer

        dtype = compute_dtype(model.get("dtype", "auto"), device)
        if classifier:
            attn = model.get("attn_implementation", "sdpa")
            value_model = ValueModel.from_classifier(classifier, attn)
        else:
            value_model = ValueModel(model, tokenizer, seed=seed)
        self.trainer = ValueTrainer(value_model.to(device), **optim, compute_dtype=dtype)

    def load_backbone(self, lm_state: dict[str, torch.Tensor]) -> None:
        """Start the trunk from the policy's weights (the head is kept)."""
        self.trainer.model.load_backbone(lm_state)

    def snapshot(self) -> list[torch.Tensor]:
        from ..weight_change import snapshot

        return snapshot(self.trainer.model.parameters())

    def update_norm(self, before: list[torch.Tensor]) -> float:
        """L2 norm of the weight change since :meth:`snapshot`."""
        from ..weight_change import update_norm

        return update_norm(before, self.trainer.model.parameters())

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        return {k: v.detach().cpu().clone() for k, v in self.trainer.model.state_dict().items()}

    def checkpoint_state(self) -> tuple[dict, dict] | None:
        """``(model, optimizer)`` state dicts in the torch critic's format."""
        return self.trainer.model.state_dict(), self.trainer.optimizer.state_dict()

    def load_checkpoint_state(self, model: dict, optimizer: dict) -> None:
        self.trainer.model.load_state_dict(model)
        self.trainer.optimizer.load_state_dict(optimizer)

    def offload(self) -> None:
        self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()
