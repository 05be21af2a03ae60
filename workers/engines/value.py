"""The :class:`ValueEngine` protocol: what a value-head role (the PPO critic, the reward model)
asks of the engine that holds and trains its model. Mechanics only, as for
:class:`~.train.TrainEngine`: the role gives the loss (:func:`~m2flow.workers.algos.losses.
make_loss`, ``value`` or ``score_bce``) and drives the mini-batches
(:mod:`~m2flow.workers.engines.update`).

The model is the policy's trunk plus ``Linear(hidden, 1)`` (:class:`~.value_model.ValueModel`),
or a pretrained sequence classifier; its forward gives a scalar per position, ``[B, P + R]``.
Weights and optimizer state leave and enter in the torch critic's layout, so every value engine
resumes the others' checkpoints. Implementations: :class:`~.torch_engine.TorchValueEngine`
(``torch``), :class:`~.megatron.critic.MegatronValueEngine` (``megatron``), registered under
kind ``value`` (:mod:`.registry`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol, runtime_checkable

import torch


@runtime_checkable
class ValueEngine(Protocol):
    """One rank's part of a trained value-head model and its optimizer.

    Constructed as ``cls(model, tokenizer, device=, rank=, world_size=, dist=, optim=, seed=,
    tensor_parallel=, classifier=)``: ``model`` a :class:`~m2flow.workers.llm.ModelConfig`
    dict, ``optim`` the mechanics' settings (:meth:`~.base.ModelEngine._setup`),
    ``classifier`` a pretrained reward model's directory (``None``: a new head).
    """

    #: launch one rank per device and a process group
    one_rank_per_device: ClassVar[bool]
    #: every rank needs the whole step's batch and trains its share of it
    whole_step: ClassVar[bool]
    #: gradients and metric sums are summed over the ranks at each step
    data_parallel: bool
    #: ``"values"``: what the forward gives a loss
    output: str

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "critic") -> None:
        """Refuse a configuration (the role's options, ``model`` included) before any process
        starts, for ``world_size`` ranks (``None``: not placed yet); ``ValueError`` naming the
        setting and the fix."""

    def forward_backward(
        self, batch: dict, loss, micro_batch_size: int | None = None,
        normalizer: float | None = None,
    ) -> list[dict[str, float]]:  # fmt: skip
        """As :meth:`~.train.TrainEngine.forward_backward`, the loss reading values."""

    def optimizer_step(self, normalizer: float | None = None) -> dict[str, float]:
        """As :meth:`~.train.TrainEngine.optimizer_step`."""

    def zero_grad(self) -> None: ...

    def reduce_metrics(self, sums: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        """``keys`` of ``sums`` summed over the data-parallel ranks."""

    def infer(
        self, batch: dict, fn: Callable | None = None, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """``[B, P + R]`` values of ``batch`` (no gradients, on CPU), or ``fn(out, mb)`` of
        each micro-batch's (e.g. :func:`~m2flow.workers.algos.losses.response_values`)."""

    def reset_optimizer(self) -> None:
        """Fresh optimizer moments."""

    def load_backbone(self, lm_state: dict[str, torch.Tensor]) -> None:
        """Start the trunk from the policy's Hugging Face weights (the head is kept)."""

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of this rank's parameters (for :meth:`update_norm`)."""

    def update_norm(self, before: list[torch.Tensor]) -> float:
        """L2 norm of the weight change since :meth:`snapshot` (the whole model's)."""

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights in the torch critic's layout (``None`` on ranks holding none)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def checkpoint_state(self) -> tuple[dict, dict] | None:
        """``(model, optimizer)`` state dicts in the torch critic's layout (``None`` on ranks
        holding none); ``NonFiniteError`` when the weights are not finite."""

    def load_checkpoint_state(self, model: dict, optimizer: dict) -> None: ...

    def offload(self) -> None:
        """Release parameters, gradients and optimizer state from the device."""

    def onload(self) -> None: ...
