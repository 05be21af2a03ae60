"""The :class:`TrainEngine` protocol: what a policy role (the GRPO or PPO actor) asks of the
engine that holds and trains its model. **An engine is mechanics; the loss is the
algorithm's**: the role hands :meth:`TrainEngine.forward_backward` a loss
(:mod:`~m2flow.workers.algos.losses`) and drives mini-batches and steps itself
(:mod:`~m2flow.workers.actor.update`); no engine knows a policy loss. The shape follows veRL's
``BaseEngine`` (``forward_backward_batch(data, loss_function)``, ``optimizer_step``,
``infer_batch``) and AReaL's ``TrainEngine`` (``train_batch(input_, loss_fn, ...)``).

Batch units are responses (samples): ``batch`` holds ``prompt_ids``/``prompt_mask`` ``[B, P]``,
``response_ids``/``response_mask`` ``[B, R]`` and what the loss reads (``advantages`` ``[B]``
or ``[B, R]``, ``old_logprobs``, ``ref_logprobs`` ``[B, R]``, ...).
Implementations: :class:`~.torch_engine.TorchEngine` (``torch``),
:class:`~.megatron.policy.MegatronPolicyEngine` (``megatron``); registered under kind ``train``
(:mod:`.registry`). Their value-head variants (kind ``value``, :class:`~.value.ValueEngine`:
the critic's and the reward model's) share the mechanics (:class:`~.base.ModelEngine`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import torch


@runtime_checkable
class TrainEngine(Protocol):
    """One rank's part of a trained causal LM: weights, optimizer, frozen reference (KL).

    Constructed as ``cls(model, tokenizer, device=, rank=, world_size=, dist=, optim=, seed=,
    **parallel)``: ``model`` a :class:`~m2flow.workers.llm.ModelConfig` dict, ``optim`` the
    mechanics' settings (:meth:`~.base.ModelEngine._setup`: lr, betas, weight decay, grad clip,
    sampling temperature, ``shared_prefix``, ``compute_dtype``, ``nonfinite``; ``kl_coef > 0``
    keeps a frozen reference), ``parallel`` the engine's own layout knobs
    (``tensor_parallel``, ``pipeline_parallel``).

    Optional members: ``supports_lora = True`` (the engine takes ``lora=``, a
    :class:`~.lora.LoraOptions`; one without it is refused by :func:`.lora.check_engine`) and
    ``weight_payload(base)`` (what a weight sync sends, when it is not :meth:`get_weights`:
    a LoRA policy's adapter; :meth:`~.train_role.OnTrainEngine.weights_for`).
    """

    #: launch one rank per device and a process group, whatever ``data_parallel`` says
    one_rank_per_device: ClassVar[bool]
    #: every rank needs the whole step's batch (:meth:`read_step`) and trains its share of
    #: what it is given; no streaming updates
    whole_step: ClassVar[bool]
    #: gradients and metric sums are summed over the ranks at each step
    data_parallel: bool
    #: the full model in Hugging Face layout (the weight source); ``None`` on ranks holding none
    model: torch.nn.Module | None
    #: optimizer steps taken (checkpointed)
    steps: int

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "actor") -> None:
        """Refuse a configuration (the role's options, ``model`` included) before any process
        starts, for ``world_size`` ranks (``None``: not placed yet, as in a workflow's
        ``validate``); ``ValueError`` naming the setting and the fix."""

    def read_step(self, parts) -> list:
        """The step's items on this rank: ``parts`` (an iterator of item lists) read to the end
        of step, gathered from every rank if :attr:`whole_step`."""

    def forward_backward(
        self, batch: dict, loss, micro_batch_size: int | None = None,
        normalizer: float | None = None,
    ) -> list[dict[str, float]]:  # fmt: skip
        """Forward and backward of ``batch`` in micro-batches with ``loss`` (a
        :class:`~m2flow.workers.algos.losses.Loss`, called ``loss(out, mb, normalizer)``);
        gradients accumulate. ``normalizer``: the mini-batch's units (each micro-batch's loss a
        share of their mean); ``None``: losses are sums, divided at :meth:`optimizer_step`.
        Returns one record per micro-batch (``loss``, ``weight``: its units, the loss's
        metrics). ``NonFiniteError`` on a non-finite loss with ``nonfinite="stop"``."""

    def optimizer_step(self, normalizer: float | None = None) -> dict[str, float]:
        """Data-parallel gradient sums, division by ``normalizer``, finite check, clipping and
        one optimizer step (a collective of the group). Returns ``grad_norm`` (pre-clip) and
        ``skipped`` (1: a non-finite value, ``nonfinite="skip"``: weights unchanged).
        ``NonFiniteError`` with ``nonfinite="stop"``."""

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""

    def reduce_metrics(self, sums: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        """``keys`` of ``sums`` summed over the ranks that each hold a share of a step's
        metric sums (``sums`` itself on one rank)."""

    def infer(
        self, batch: dict, fn: Callable | None = None, micro_batch_size: int | None = None,
        reference: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """``[B, R]`` logprobs of ``batch``'s responses under the current weights (or the
        frozen reference's) at the sampling temperature, no gradients, on CPU; ``fn(out, mb)``
        of each micro-batch's instead if given. Every rank alike (a whole-step engine: the
        same ``batch`` on every rank, the whole result on every rank)."""

    def solo(self):
        """Context manager: the engine that trains this rank's whole Hugging Face model alone
        (the warm start on rank 0; :meth:`publish` then hands its weights to every rank), or
        ``None`` on a rank holding none."""

    def publish(self) -> None:
        """After rank 0 changed :attr:`model` (warm start): every rank takes its weights, and
        the reference is refrozen. A collective of all ranks."""

    def set_lr(self, lr: float) -> None: ...

    def reset_optimizer(self) -> None:
        """Fresh optimizer moments (after the warm start)."""

    def get_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the weights in Hugging Face layout. ``RuntimeError`` on a rank that
        holds none."""

    def load_weights(self, weights: dict[str, torch.Tensor] | None) -> None:
        """Hugging Face layout weights into the model (rank 0's, ``None`` on the others of an
        engine whose weights live on rank 0; a collective there)."""

    def save(self, path: Path) -> dict | None:
        """Write the model (rank 0) and per-rank state under ``path``; rank 0 returns the
        entries of the role's state file (``optimizer``, ``trainer_steps``, ``reference``),
        the other ranks ``None``. A collective of all ranks. ``NonFiniteError`` (nothing
        written) when the weights are not finite."""

    def load(self, path: Path, state: dict) -> None:
        """Restore what :meth:`save` wrote (``state``: the role's state file)."""

    def offload(self) -> None:
        """Release parameters, gradients (dropped) and optimizer state (and the reference)
        from the device, all at once: the device lock's context switch (veRL's ``to("cpu",
        model=, optimizer=, grad=)`` with every flag on; :meth:`onload` is ``to(device)``)."""

    def onload(self) -> None: ...
