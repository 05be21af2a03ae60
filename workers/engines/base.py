"""Engine mechanics every trained model shares, whatever the backend: micro-batched forward and
backward with a loss given by the caller, the optimizer step (data-parallel gradient sums,
division, finite checks, clipping), forward-only inference, and releasing device memory.

:class:`ModelEngine` holds one model (a policy: per-token logprobs; or a value head: a scalar
per position) and its AdamW. Backends subclass it and override the forward
(:meth:`ModelEngine._forward`), the gradient norm (:meth:`ModelEngine._clip_grads`) or the rows
a rank trains (:meth:`ModelEngine._rows`); the loss is never theirs
(:mod:`m2flow.workers.algos.losses`).

Batch units: sizes count *responses* (samples). A mini-batch is one optimizer step; a micro-batch
one forward/backward. With ``normalizer`` (the mini-batch's units) each micro-batch's loss is
divided by it, so their gradients add up to the mini-batch mean's; without, losses are sums and
:meth:`ModelEngine.optimizer_step` divides the accumulated gradients (the streaming update:
parts ``B_1 .. B_k`` give the update of their concatenation, RLinf section 3.3).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from .. import parallel as dp
from ..algos.logprobs import sequence_logprobs, shared_prefix_logprobs
from ..batch import row_index, split_rows
from ..llm.model import checkpointing
from . import memory

RESPONSE_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
NONFINITE = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """A NaN or infinite loss, gradient norm or advantage before an optimizer step
    (``nonfinite="stop"``); the message names the cause and the step."""


class ModelEngine:
    """One rank's trained model and its optimizer (see the module docstring).

    Set up by :meth:`_setup`. Attributes: ``model``, ``optimizer`` (AdamW), ``steps``
    (optimizer steps taken), ``skipped`` (steps skipped for a non-finite value), ``output``
    (``"logprobs"`` or ``"values"``: what :meth:`_forward` gives a loss), ``dp_group`` and
    ``data_parallel`` (gradients and metric sums summed over that group before a step).
    """

    output = "logprobs"
    dp_group = None
    data_parallel = False
    #: every rank gets the whole batch and trains its data-parallel share (:meth:`_rows`)
    whole_step = False

    def _setup(
        self, model: torch.nn.Module, *, lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
        grad_clip: float | None = 1.0, temperature: float = 1.0, shared_prefix: bool = True,
        compute_dtype: torch.dtype = torch.float32, nonfinite: str = "stop", **_,
    ) -> None:  # fmt: skip
        """``model`` and its AdamW (``lr``, ``betas``, ``weight_decay``) over the parameters
        that require gradients (a LoRA model: the adapter's); ``grad_clip``: max
        global gradient norm (``None`` or <= 0: none); ``temperature``: the sampling
        temperature logprobs are computed under; ``shared_prefix``: forward each distinct
        prompt once (:func:`~..algos.logprobs.shared_prefix_logprobs`; same math); forwards run
        under ``torch.autocast`` to ``compute_dtype`` over float32 weights unless float32;
        ``nonfinite``: ``stop`` or ``skip`` (:meth:`optimizer_step`)."""
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite={nonfinite!r}: pick stop or skip")
        self.model = model
        self._home = next(model.parameters()).device
        self.compute_dtype = compute_dtype
        # frozen parameters (a LoRA model's base) get no optimizer state
        trained = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=lr, betas=betas, weight_decay=weight_decay)
        self.grad_clip, self.temperature, self.nonfinite = grad_clip, temperature, nonfinite
        self.logprobs_fn = shared_prefix_logprobs if shared_prefix else sequence_logprobs
        self.steps = self.skipped = 0
        self._offloaded: dict | None = None
        self._cause: str | None = None  # a non-finite value since the last step (skip)
        self._solo = False

    @property
    def device(self) -> torch.device:
        """Where the model trains (its parameters' device when set up; offloading keeps it)."""
        return self._home

    def autocast(self):
        """Context of every forward (and the backward it records): autocast to
        ``compute_dtype`` on the model's device; nothing under float32."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reset_optimizer(self) -> None:
        """Drop the optimizer's moments (a fresh AdamW state; hyper-parameters kept)."""
        self.optimizer.state.clear()

    @contextlib.contextmanager
    def solo(self):
        """This rank trains its model alone inside the block (no data-parallel sums: the warm
        start on rank 0, whose weights :meth:`publish` then hands to the others)."""
        self._solo, before = True, self._solo
        try:
            yield self
        finally:
            self._solo = before

    def _synced(self) -> bool:
        return self.data_parallel and not self._solo and dp.active()

    # -- forward -----------------------------------------------------------------------------

    def _forward(self, model: torch.nn.Module, mb: dict, loss=None) -> torch.Tensor:
        """``model``'s output on micro-batch ``mb``: per-token logprobs ``[b, R]`` at the loss's
        temperature (default the engine's). Training forwards of a model with gradient
        checkpointing, and losses asking for it, take one full forward (recomputation has no
        KV cache, which the shared prefix is)."""
        temperature = self.temperature
        fn = self.logprobs_fn
        if loss is not None:
            if loss.temperature is not None:
                temperature = loss.temperature
            if loss.full_forward or checkpointing(model):
                fn = sequence_logprobs
        return fn(model, *(mb[k] for k in RESPONSE_KEYS), temperature=temperature)

    def _rows(self, n: int) -> torch.Tensor:
        """The rows of an ``n``-row batch this rank trains (all; a whole-step engine: its
        data-parallel share)."""
        return row_index(n)

    def _check_output(self, loss) -> None:
        if loss.output != self.output:
            raise ValueError(
                f"loss {loss.name!r} reads the model's {loss.output}; this engine's model "
                f"gives {self.output}"
            )

    # -- training ----------------------------------------------------------------------------

    def forward_backward(
        self, batch: dict, loss, micro_batch_size: int | None = None,
        normalizer: float | None = None,
    ) -> list[dict[str, float]]:  # fmt: skip
        """Forward and backward of ``batch`` in micro-batches with ``loss``; gradients
        accumulate until :meth:`optimizer_step`.

        Args:
            batch: ``[B, ...]`` tensors: the four response tensors and the loss's ``keys``.
            loss: a :class:`~m2flow.workers.algos.losses.Loss` (``loss(out, mb, normalizer)``).
            micro_batch_size: responses per forward (``None``: the whole batch).
            normalizer: the mini-batch's units (see the module docstring); ``None``: ``1.0``,
                a sum, divided at the step.

        Returns:
            one record per micro-batch: ``loss`` (its value), ``weight`` (its units) and the
            loss's metrics (means over its units). A non-finite loss is not backpropagated
            (``nonfinite="skip"``: the next step is skipped).

        Raises:
            NonFiniteError: a non-finite loss with ``nonfinite="stop"``.
            ValueError: a loss reading another output than this model gives.
        """
        self._check_output(loss)
        self.model.train()
        denom = 1.0 if normalizer is None else float(normalizer)
        keys = [k for k in (*RESPONSE_KEYS, *loss.keys) if k in batch]
        rows = self._rows(len(batch["response_ids"]))
        records = []
        for idx in split_rows(rows, micro_batch_size) if len(rows) else []:
            mb = {k: batch[k][idx].to(self.device) for k in keys}
            with self.autocast():
                out = self._forward(self.model, mb, loss)
            value, metrics = loss(out, mb, denom)
            records.append(self._backward(value, metrics, loss.units(mb)))
        return records

    def _backward(self, value: torch.Tensor, metrics: dict, weight: float) -> dict:
        """Backpropagate a micro-batch's loss unless it is not finite; its record."""
        v = value.item()
        if math.isfinite(v):
            value.backward()
        else:
            self._nonfinite(f"loss {v}")
        return {"loss": v, "weight": weight, **metrics}

    def _nonfinite(self, cause: str) -> None:
        """A non-finite ``cause`` before step ``steps + 1``: stop now, or skip that step."""
        if self.nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite {cause} before optimizer step {self.steps + 1}; the weights are "
                "those of the step before (set nonfinite=skip to skip such steps instead)"
            )
        self._cause = self._cause or cause

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, normalizer: float | None = None) -> dict[str, float]:
        """One optimizer step on the accumulated gradients.

        Data parallel: every rank calls it (a collective): gradients are summed over the group
        first. Then divided by ``normalizer`` if given (the units accumulated, summed over the
        ranks: the streaming update's token mean), clipped by the global norm, stepped, zeroed.

        Returns:
            ``grad_norm`` (pre-clip global norm) and ``skipped``: 1 when a non-finite loss since
            the last step or a non-finite gradient norm made it skip the step (gradients
            zeroed, weights unchanged; ``nonfinite="skip"``), else 0.

        Raises:
            NonFiniteError: a non-finite gradient norm with ``nonfinite="stop"``.
        """
        if self._synced():
            dp.all_reduce_grads(self.model, self.dp_group)
            if self.nonfinite == "skip":  # every rank of the world skips if one does
                bad = dp.all_reduce_sums({"bad": float(self._cause is not None)}, ("bad",))
                if bad["bad"] and self._cause is None:
                    self._cause = "loss on another rank"
        if normalizer is not None:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.div_(normalizer)
        norm = self._clip_grads()
        cause, self._cause = self._cause, None
        if cause is None and not math.isfinite(norm):
            cause = f"gradient norm {norm}"
            if self.nonfinite == "stop":
                self.optimizer.zero_grad(set_to_none=True)
                self._nonfinite(cause)
        if cause is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            return {"grad_norm": norm, "skipped": 1}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": norm, "skipped": 0}

    def _clip_grads(self) -> float:
        """Clip the gradients by their global norm (``grad_clip``); the pre-clip norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def reduce_metrics(self, sums: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
        """``keys`` of ``sums`` (missing: 0) summed over the data-parallel ranks (each rank's
        share of a step's metric sums); ``sums`` itself when training alone. A collective of
        the group when data parallel."""
        if not self._synced():
            return sums
        return dp.all_reduce_sums(sums, keys, self.dp_group)

    # -- inference ---------------------------------------------------------------------------

    @torch.no_grad()
    def infer(
        self, batch: dict, fn: Callable | None = None, micro_batch_size: int | None = None,
        model: torch.nn.Module | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The model's output on ``batch`` (no gradients, eval mode), micro-batched, on CPU:
        ``[B, R]`` logprobs (a policy) or ``[B, P + R]`` values (a value head), or
        ``fn(out, mb)`` of each micro-batch's (``mb``: its response tensors on the device).
        ``model``: another module of the same kind (the frozen reference)."""
        model = self.model if model is None else model
        was_training = model.training
        model.eval()
        out = []
        for idx in split_rows(row_index(len(batch["response_ids"])), micro_batch_size):
            mb = {k: batch[k][idx].to(self.device) for k in RESPONSE_KEYS}
            with self.autocast():
                o = self._forward(model, mb)
                if fn is not None:
                    o = fn(o, mb)
            out.append(o.cpu())
        model.train(was_training)
        return torch.cat(out)

    # -- weights and memory ------------------------------------------------------------------

    def finite_weights(self) -> bool:
        """Whether every parameter of the model is finite (checked before a checkpoint)."""
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def offload(self, spill_path: str | None = None) -> None:
        """Release parameters, gradients and optimizer state (:func:`.memory.offload`);
        :meth:`onload` restores them bit-exactly. Idempotent."""
        if self._offloaded is None:
            self._offloaded = memory.offload(self.model, self.optimizer, spill_path)

    def onload(self) -> None:
        if self._offloaded is not None:
            saved, self._offloaded = self._offloaded, None
            memory.onload(saved, self.model, self.optimizer)
