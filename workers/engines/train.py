"""The :class:`TrainEngine` protocol: what a policy role (the GRPO or PPO actor) asks of the
engine that holds and trains its model.

Batch units are responses (samples): ``data`` holds ``prompt_ids``/``prompt_mask`` ``[B, P]``,
``response_ids``/``response_mask`` ``[B, R]``, ``advantages`` ``[B]`` or ``[B, R]``, optionally
``old_logprobs`` ``[B, R]`` (recomputed by the engine before any update if absent).
Implementations: :class:`~.torch_engine.TorchEngine` (``torch``),
:class:`~.megatron.policy.MegatronPolicyEngine` (``megatron``); registered in
:data:`~.registry.TRAIN_ENGINES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainEngine(Protocol):
    """One rank's part of a trained causal LM: weights, optimizer, frozen reference (KL).

    Constructed as ``cls(model, tokenizer, device=, rank=, world_size=, dist=, optim=, seed=,
    **parallel)``: ``model`` a :class:`~m2flow.workers.llm.ModelConfig` dict, ``optim`` the
    :class:`~.trainer.PolicyTrainer` arguments (lr, betas, clip range, ``kl_coef``: > 0 keeps a
    frozen reference, ``compute_dtype``, ...), ``parallel`` the engine's own layout knobs
    (``tensor_parallel``, ``pipeline_parallel``).
    """

    #: launch one rank per device and a process group, whatever ``data_parallel`` says
    one_rank_per_device: ClassVar[bool]
    #: every rank needs the whole step's batch (:meth:`read_step`); no streaming updates
    whole_step: ClassVar[bool]
    #: the full model in Hugging Face layout (the weight source); ``None`` on ranks holding none
    model: torch.nn.Module | None
    #: supervised trainer of :attr:`model` (the warm start); ``None`` where ``model`` is
    sft_trainer: Any
    #: optimizer steps taken (checkpointed)
    steps: int

    @classmethod
    def check(cls, world_size: int, kwargs: dict, role: str = "actor") -> None:
        """Refuse a configuration (the role's arguments) before any process starts;
        ``ValueError`` naming the setting and the fix."""

    def read_step(self, parts) -> list:
        """The step's items on this rank: ``parts`` (an iterator of item lists) read to the end
        of step, gathered from every rank if :attr:`whole_step`."""

    def publish(self) -> None:
        """After rank 0 changed :attr:`model` (warm start): every rank takes its weights, and
        the reference is refrozen. A collective of all ranks."""

    def train(
        self, data: dict, mini_batch_size: int | None, micro_batch_size: int | None,
        epochs: int = 1, generator: torch.Generator | None = None,
    ) -> dict[str, float]:  # fmt: skip
        """Clipped-surrogate update(s) on the whole batch (``generator``: PPO epochs over
        shuffled orders); reference logprobs added when the engine keeps a reference. Returns
        ``loss``, ``pg_loss``, ``clip_frac``, ``ratio_mean``, ``grad_norm``, ``kl``, ``steps``;
        ``{}`` for an empty batch. :attr:`model` holds the new weights afterwards."""

    def accumulate(self, data: dict, micro_batch_size: int | None) -> int:
        """Forward/backward of one part of the step (streaming); returns its responses."""

    def finish_accumulation(self) -> dict[str, float]:
        """One optimizer step over the accumulated parts (a collective across ranks)."""

    def set_lr(self, lr: float) -> None: ...

    def get_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the weights in Hugging Face layout. ``RuntimeError`` on a rank that
        holds none."""

    def save(self, path: Path) -> dict | None:
        """Write the model (rank 0) and per-rank state under ``path``; rank 0 returns the
        entries of the role's state file (``optimizer``, ``trainer_steps``, ``reference``),
        the other ranks ``None``. A collective of all ranks."""

    def load(self, path: Path, state: dict) -> None:
        """Restore what :meth:`save` wrote (``state``: the role's state file)."""

    def offload(self) -> None: ...

    def onload(self) -> None: ...


def train_engine(name: str, role: str = "actor") -> type[TrainEngine]:
    """The :class:`TrainEngine` class registered as ``name`` (or at import path
    ``"module:Class"``); ``ValueError`` if none is."""
    from .registry import TRAIN_ENGINES

    return TRAIN_ENGINES.get(name, role)
