"""The ``torch`` engines: one Hugging Face model per rank, trained by the shared mechanics of
:class:`~.base.ModelEngine` with the loss the role gives. :class:`TorchEngine` hosts a policy
(the :class:`~.train.TrainEngine` of the GRPO and PPO actors: one rank, or data parallel with
one gradient all-reduce per step, :mod:`~m2flow.workers.parallel`); :class:`TorchValueEngine`
a value-head model (the critic's, the reward model's)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .. import parallel as dp
from ..llm import load_model
from . import lora as lora_mod
from .base import RESPONSE_KEYS, ModelEngine


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


def refuse_nonfinite(engine: ModelEngine, what: str) -> None:
    """Raise before a checkpoint is written from non-finite weights.

    Raises:
        NonFiniteError: a NaN or infinite parameter (the message names ``what``).
    """
    from .base import NonFiniteError

    if not engine.finite_weights():
        raise NonFiniteError(
            f"{what}: the weights hold NaN or infinite values after optimizer step "
            f"{engine.steps}; no checkpoint is written from them (the last one stays the "
            "latest)"
        )


class TorchEngine(ModelEngine):
    """The policy as one Hugging Face model per rank (see :class:`~.train.TrainEngine`).

    With ``lora`` (:class:`~.lora.LoraOptions`, rank > 0) the policy is a PEFT model whose
    optimizer holds the adapter's parameters only; :meth:`get_weights` gives the merged weights,
    :meth:`weight_payload` the adapter alone, and a checkpoint is a PEFT adapter directory
    (:meth:`save`).

    With ``kl_coef > 0`` (in ``optim``) a frozen copy of the policy, in the compute dtype, is
    the reference (:meth:`infer` with ``reference=True``; refrozen by :meth:`publish` after
    the warm start). With ``world_size > 1`` the ranks join one process group (``dist``); every
    rank holds the whole model and gradients are summed over the ranks at each step.
    """

    one_rank_per_device = False
    whole_step = False
    supports_lora = True
    lora: lora_mod.LoraOptions | None = None
    base_path: str | None = None  # model.path: the pretrained base (None: built from a shape)

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "actor") -> None:
        """Refuse model-parallel knobs, and several ranks without ``data_parallel`` or with a
        ``mini_batch_size`` (``world_size`` ``None``: ranks not known yet, not checked)."""
        for knob in ("tensor_parallel", "pipeline_parallel"):
            if config.get(knob, 1) != 1:
                raise ValueError(f"{role}.{knob} needs {role}.engine=megatron")
        if world_size is None or world_size == 1:
            return
        if not config.get("data_parallel"):
            raise ValueError(
                f"the {role} got {world_size} ranks: launch it with data_parallel=True "
                f"({role}.data_parallel=true) for data-parallel training, or give it one rank"
            )
        if config.get("mini_batch_size"):
            raise ValueError(
                f"data-parallel training takes one optimizer step per step (streaming); "
                f"mini_batch_size={config['mini_batch_size']} would need the ranks to agree "
                f"on every mini-batch: set {role}.mini_batch_size=0"
            )

    def __init__(
        self, model: dict, tokenizer, *, device: torch.device, rank: int = 0,
        world_size: int = 1, dist: dict | None = None, optim: dict, seed: int = 0,
        lora: lora_mod.LoraOptions | dict | None = None, **parallel,
    ) -> None:  # fmt: skip
        if world_size != 1:
            dp.init(rank, world_size, dist["addr"], dist["port"], device)
        self.rank, self.data_parallel = rank, world_size > 1
        # float32 master weights; forward/backward under autocast to model.dtype
        policy = load_model(model, tokenizer, device, trainable=True, seed=seed)
        lora = lora_mod.LoraOptions.from_value(lora)
        if lora.enabled:
            self.lora, self.base_path = lora, model.get("path")
            policy = lora_mod.wrap(policy, lora)
        self._setup(policy, **optim)
        self.kl_coef = optim.get("kl_coef", 0.0)
        self.ref_model: torch.nn.Module | None = None
        self.freeze_reference()

    @classmethod
    def from_module(cls, model: torch.nn.Module, **optim) -> TorchEngine:
        """A one-rank engine training ``model`` as it is (a Hugging Face causal LM already
        built; ``optim`` as the constructor's), e.g. in a script or a test."""
        engine = cls.__new__(cls)
        engine.rank, engine.data_parallel = 0, False
        engine._setup(model, **optim)
        engine.kl_coef = optim.get("kl_coef", 0.0)
        engine.ref_model = None
        engine.freeze_reference()
        return engine

    def freeze_reference(self) -> None:
        """The reference := a frozen copy of the policy now (KL on only)."""
        if self.kl_coef > 0:
            ref = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.ref_model = ref.to(self.compute_dtype)  # inference: compute dtype

    def infer(self, batch, fn=None, micro_batch_size=None, reference: bool = False):
        """:meth:`.base.ModelEngine.infer`; ``reference``: the frozen reference's logprobs
        (``ValueError`` without one: ``kl_coef`` 0)."""
        if not reference:
            return super().infer(batch, fn, micro_batch_size)
        if self.ref_model is None:
            raise ValueError("this engine keeps no reference (kl_coef is 0)")
        return super().infer(batch, fn, micro_batch_size, model=self.ref_model)

    # -- steps and weights ------------------------------------------------------------------

    def read_step(self, parts) -> list:
        return [item for part in parts for item in part]

    def publish(self) -> None:
        if dp.active():
            dp.broadcast_model(self.model)
        self.freeze_reference()

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's weights in Hugging Face layout (CPU copies; LoRA: merged)."""
        if self.lora is not None:
            return lora_mod.merged_state_dict(self.model)
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def weight_payload(self, base: bool) -> dict[str, torch.Tensor]:
        """What a weight sync sends (:mod:`.lora`): :meth:`get_weights` without LoRA; with it
        the adapter alone, plus the base weights if ``base`` (a destination's first sync)."""
        if self.lora is None:
            return self.get_weights()
        payload = lora_mod.adapter_payload(self.model)
        return {**lora_mod.base_state_dict(self.model), **payload} if base else payload

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Hugging Face layout weights into the policy (strict).

        Raises:
            ValueError: a LoRA policy (its base is frozen: load a checkpoint instead).
        """
        if self.lora is not None:
            raise ValueError("a LoRA policy's base is frozen: restore a checkpoint instead")
        self.model.load_state_dict(weights)

    def save(self, path: Path) -> dict | None:
        """Rank 0 writes the policy: a Hugging Face directory, or with LoRA a PEFT adapter
        directory (``adapter_config.json``, ``adapter_model.safetensors``; ``PeftModel.
        from_pretrained(base, path)`` loads it) whose base is ``model.path``, or, for a policy
        built from a shape, the Hugging Face directory ``path/base`` written beside it. Returns
        the state file's entries (optimizer: the adapter's only)."""
        reference = None if self.ref_model is None else self.ref_model.state_dict()
        if self.rank != 0:
            return None  # data-parallel ranks hold the same state
        refuse_nonfinite(self, "actor")
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            lora_mod.save_adapter(self.model, path, self.base_path)
        else:
            self.model.save_pretrained(path)
        return {
            "optimizer": self.optimizer.state_dict(),
            "trainer_steps": self.steps,
            "reference": reference,
        }

    def load(self, path: Path, state: dict) -> None:
        if self.lora is not None:
            lora_mod.load_adapter(self.model, path)
        else:
            load_pretrained_weights(self.model, path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["trainer_steps"]
        if state["reference"] is not None:
            self.freeze_reference()
            self.ref_model.load_state_dict(state["reference"])

    # -- memory -----------------------------------------------------------------------------

    def offload(self, spill_path: str | None = None) -> None:
        """Parameters and AdamW state (:func:`.memory.offload`); the reference moves to host
        memory on CUDA."""
        super().offload(spill_path)
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to("cpu")

    def onload(self) -> None:
        super().onload()
        if self.ref_model is not None and self.device.type == "cuda":
            self.ref_model.to(self.device)


class TorchValueEngine(ModelEngine):
    """The value-head variant (the critic's, the reward model's): a
    :class:`~.value_model.ValueModel` (the policy's trunk plus ``Linear(hidden, 1)``), one rank;
    its forward gives a scalar per position, ``[b, P + R]``. Weights and optimizer state are the
    torch critic's layout, which every value engine saves and loads.
    """

    output = "values"
    one_rank_per_device = False
    whole_step = False

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "critic") -> None:
        """Refuse a tensor-parallel size (one rank holds the whole model)."""
        if config.get("tensor_parallel", 1) != 1:
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

        dtype = compute_dtype(model.get("dtype", "auto"), device)
        if classifier:
            attn = model.get("attn_implementation", "sdpa")
            value_model = ValueModel.from_classifier(classifier, attn)
        else:
            value_model = ValueModel(model, tokenizer, seed=seed)
        self._setup(value_model.to(device), **optim, compute_dtype=dtype)

    @classmethod
    def from_module(cls, model: torch.nn.Module, **optim) -> TorchValueEngine:
        """A one-rank engine training ``model`` (a :class:`~.value_model.ValueModel` already
        built; ``optim`` as the constructor's), e.g. in a script or a test."""
        engine = cls.__new__(cls)
        engine._setup(model, **optim)
        return engine

    def _forward(self, model, mb: dict, loss=None) -> torch.Tensor:
        from .value_model import position_values

        return position_values(model, *(mb[k] for k in RESPONSE_KEYS))

    def load_backbone(self, lm_state: dict[str, torch.Tensor]) -> None:
        """Start the trunk from the policy's weights (the head is kept)."""
        self.model.load_backbone(lm_state)

    def snapshot(self) -> list[torch.Tensor]:
        from ..weight_change import snapshot

        return snapshot(self.model.parameters())

    def update_norm(self, before: list[torch.Tensor]) -> float:
        """L2 norm of the weight change since :meth:`snapshot`."""
        from ..weight_change import update_norm

        return update_norm(before, self.model.parameters())

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def checkpoint_state(self) -> tuple[dict, dict] | None:
        """``(model, optimizer)`` state dicts in the torch critic's format."""
        refuse_nonfinite(self, "critic")
        return self.model.state_dict(), self.optimizer.state_dict()

    def load_checkpoint_state(self, model: dict, optimizer: dict) -> None:
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(optimizer)
