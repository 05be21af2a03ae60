"""Plain-torch policy trainer: GRPO updates, supervised steps, offload/onload.

Batch units: every size here counts *responses* (samples), not prompts. A global batch of
``B`` responses is split into mini-batches of ``mini_batch_size`` responses (one optimizer step
each), and each mini-batch into micro-batches of ``micro_batch_size`` responses (gradient
accumulation, the loss scaled by the mini-batch token count so that the accumulated gradient
equals that of one full mini-batch forward).
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Mapping

import torch

from .. import parallel
from ..algos.grpo import grpo_loss
from ..algos.logprobs import sequence_logprobs, shared_prefix_logprobs
from ..batch import row_index, row_order, split_rows
from ..llm.model import checkpointing

RESPONSE_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
_PACKED = object()  # an optimizer state slot whose tensor sits in the offload buffer


def _rows(batch: Mapping[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in batch.items() if isinstance(v, torch.Tensor)}


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Asynchronous copy of a device tensor into pinned host memory (caller synchronises)."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    return host


def _pack(tensors: list[torch.Tensor]) -> tuple[dict, list]:
    """Copy CPU tensors into one flat buffer per dtype; returns ``(buffers, layout)``."""
    parts: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    offsets: dict[torch.dtype, int] = defaultdict(int)
    layout = []
    for t in tensors:
        layout.append((t.dtype, offsets[t.dtype], t.numel(), t.shape))
        offsets[t.dtype] += t.numel()
        parts[t.dtype].append(t.reshape(-1))
    return {d: torch.cat(ts) for d, ts in parts.items()}, layout


def _unpack(buffers: dict, layout: list) -> list[torch.Tensor]:
    """Inverse of :func:`_pack`: independent tensors (copies), in the packed order."""
    return [buffers[d][o : o + n].view(shape).clone() for d, o, n, shape in layout]


class PolicyTrainer:
    """AdamW trainer for a causal LM policy.

    Args:
        model: the policy (``Qwen2ForCausalLM`` or any HF causal LM).
        lr: learning rate (constant; change with :meth:`set_lr`).
        betas, weight_decay: AdamW parameters.
        grad_clip: max global grad norm (``None`` or <= 0 disables clipping).
        temperature: sampling temperature the rollouts use; logprobs are recomputed under it.
        clip_eps_low, clip_eps_high: PPO ratio clip range.
        kl_coef: k3 KL weight to the reference logprobs (batch key ``ref_logprobs``).
        shared_prefix: compute policy logprobs (GRPO training and :meth:`compute_logprobs`)
            with :func:`~m2flow.workers.algos.logprobs.shared_prefix_logprobs`, each distinct
            prompt of a micro-batch forwarded once; same values and gradients as the full
            forward up to float rounding. Supervised steps keep the full forward (their prompts
            are distinct), and so do training forwards of a model with gradient checkpointing
            (it recomputes without a KV cache, which the shared prefix is).
        compute_dtype: the forward/backward's dtype: float32, or bfloat16/float16 under
            ``torch.autocast`` over float32 master weights (mixed precision; ``model.dtype``).
    """

    #: process group of the data-parallel sums (None: every rank; Megatron: its DP group)
    dp_group = None

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        temperature: float = 1.0,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        kl_coef: float = 0.0,
        shared_prefix: bool = True,
        compute_dtype: torch.dtype = torch.float32,
    ):
        self.model = model
        self.compute_dtype = compute_dtype
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay
        )
        self.grad_clip = grad_clip
        self.temperature = temperature
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.kl_coef = kl_coef
        self.logprobs_fn = shared_prefix_logprobs if shared_prefix else sequence_logprobs
        self.steps = 0
        self._offloaded: dict | None = None
        self._accumulated: dict[str, float] | None = None  # see accumulate()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self):
        """Context of every forward (and the backward it records): autocast to
        ``compute_dtype`` on the model's device; nothing under float32."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _train_logprobs_fn(self):
        """The logprob function of training forwards: the full sequence under gradient
        checkpointing (its recomputation runs without the shared prefix's KV cache)."""
        if checkpointing(self.model):
            return sequence_logprobs
        return self.logprobs_fn

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------------ optimisation

    def _step(self) -> float:
        """Clip, step, zero grads; returns the pre-clip global grad norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip and self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(norm)

    @torch.no_grad()
    def compute_logprobs(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None = None
    ) -> torch.Tensor:
        """``[B, R]`` logprobs of the batch's responses under the current weights (no grad).

        Use for old logprobs (behaviour policy) or, on a frozen copy, reference logprobs.
        """
        was_training = self.model.training
        self.model.eval()
        out = []
        for idx in split_rows(row_index(len(batch["response_ids"])), micro_batch_size):
            mb = {k: batch[k][idx].to(self.device) for k in RESPONSE_KEYS}
            with self.autocast():
                lp = self.logprobs_fn(self.model, **mb, temperature=self.temperature)
            out.append(lp.cpu())
        self.model.train(was_training)
        return torch.cat(out)

    def train_on_batch(
        self,
        batch: Mapping[str, torch.Tensor],
        mini_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        epochs: int = 1,
        shuffle: bool = False,
        generator: torch.Generator | None = None,
    ) -> dict[str, float]:
        """GRPO/PPO update on one global batch of ``B`` responses.

        Args:
            batch: tensors ``prompt_ids``/``prompt_mask`` ``[B, P]``, ``response_ids``/
                ``response_mask`` ``[B, R]``, ``advantages`` ``[B]``; optional
                ``old_logprobs`` ``[B, R]`` (default: recomputed here before any update; the
                rollout's logprobs can be passed instead when rollout and actor weights and
                temperature agree) and ``ref_logprobs`` ``[B, R]``.
            mini_batch_size: responses per optimizer step (default: ``B``, one step).
            micro_batch_size: responses per forward/backward (default: the mini-batch).
            epochs: passes over the batch (PPO epochs).
            shuffle: shuffle responses before splitting into mini-batches.

        Returns:
            metrics averaged over mini-batches: ``loss``, ``pg_loss``, ``clip_frac``,
            ``ratio_mean``, ``grad_norm`` (pre-clip), ``kl`` (with a reference), ``steps``.
        """
        if "old_logprobs" not in batch:
            batch = dict(batch, old_logprobs=self.compute_logprobs(batch, micro_batch_size))
        keys = [*RESPONSE_KEYS, "advantages", "old_logprobs"] + (
            ["ref_logprobs"] if "ref_logprobs" in batch else []
        )
        n = len(batch["response_ids"])
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        n_steps = 0
        for _ in range(epochs):
            order = row_order(n, shuffle, generator)
            for mini in split_rows(order, mini_batch_size):
                # Token mean over the whole mini-batch, whatever the micro split.
                num_tokens = float(batch["response_mask"][mini].sum().clamp(min=1))
                for micro in split_rows(mini, micro_batch_size):
                    loss, m, tokens = self._backward(batch, micro, keys, num_tokens)
                    # Weight micro metrics by their share of the mini-batch tokens.
                    sums["loss"] += loss
                    for k, v in m.items():
                        sums[k] += v * tokens / num_tokens
                sums["grad_norm"] += self._step()
                n_steps += 1
        metrics = {k: v / n_steps for k, v in sums.items()}
        metrics["steps"] = n_steps
        return metrics

    # ------------------------------------------------------------------ streaming

    def accumulate(
        self, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None = None
    ) -> int:
        """Forward/backward of one part of a global batch, without an optimizer step.

        Gradients of the token-*sum* loss accumulate over parts; :meth:`finish_accumulation`
        divides them by the total token count and steps. Over parts ``B_1 .. B_k`` this is the
        update :meth:`train_on_batch` makes on their concatenation with one mini-batch (the
        token mean is linear), up to float rounding, while training starts on the first part:
        the consumer side of elastic pipelining (RLinf section 3.3). Same keys as
        :meth:`train_on_batch`. Returns the responses processed.
        """
        batch, keys, acc = self._begin_accumulation(batch, micro_batch_size)
        self.model.train()
        n = len(batch["response_ids"])
        for micro in split_rows(row_index(len(batch["response_ids"])), micro_batch_size):
            # A token sum (denominator 1): divided by the whole batch's tokens at the end.
            loss, m, tokens = self._backward(batch, micro, keys, 1.0)
            acc["tokens"] += tokens
            acc["loss"] += loss
            for k, v in m.items():
                acc[k] += v * tokens
        return n

    def _backward(self, batch, rows: torch.Tensor, keys: list[str], num_tokens: float):
        """Forward and backward of ``rows`` of ``batch`` with the GRPO loss divided by
        ``num_tokens``. Returns ``(loss, metrics, response tokens in rows)``."""
        mb = {k: batch[k][rows].to(self.device) for k in keys}
        with self.autocast():
            lp = self._train_logprobs_fn()(
                self.model, *(mb[k] for k in RESPONSE_KEYS), temperature=self.temperature
            )
        loss, m = self.grpo_loss(lp, mb, num_tokens)
        loss.backward()
        return loss.item(), m, float(mb["response_mask"].sum())

    def _begin_accumulation(self, batch: dict, micro_batch_size: int | None):
        """``(batch, keys, sums)``: ``batch`` with behaviour logprobs (recomputed before any
        update if absent), the keys a micro-batch needs, the step's running sums."""
        if "old_logprobs" not in batch:
            batch = dict(batch, old_logprobs=self.compute_logprobs(batch, micro_batch_size))
        keys = [*RESPONSE_KEYS, "advantages", "old_logprobs"] + (
            ["ref_logprobs"] if "ref_logprobs" in batch else []
        )
        if self._accumulated is None:
            self._accumulated = defaultdict(float)
        return batch, keys, self._accumulated

    def grpo_loss(self, lp: torch.Tensor, mb: dict, num_tokens: float):
        """:func:`~m2flow.workers.algos.grpo.grpo_loss` of logprobs ``lp`` ``[B, R]`` on
        micro-batch ``mb`` with this trainer's clip range and KL weight; returns ``(loss,
        metrics)``."""
        return grpo_loss(
            lp,
            mb["old_logprobs"],
            mb["advantages"],
            mb["response_mask"],
            self.clip_eps_low,
            self.clip_eps_high,
            ref_logprobs=mb.get("ref_logprobs"),
            kl_coef=self.kl_coef,
            num_tokens=num_tokens,
        )

    def finish_accumulation(self) -> dict[str, float]:
        """Scale the accumulated gradients to the token mean and take one optimizer step.

        Data parallel (:mod:`~m2flow.workers.parallel` active): a collective every rank calls
        once per step, its parts or none: gradients, token counts and metric sums are summed
        over the ranks first, so every rank takes the step one rank would on all the parts.

        Returns:
            ``loss``, ``pg_loss``, ``clip_frac``, ``ratio_mean``, ``kl`` (token means over the
            accumulated batch), ``grad_norm`` (pre-clip), ``steps`` (1; 0 if nothing was
            accumulated).
        """
        acc, self._accumulated = self._accumulated, None
        if parallel.active():  # every rank: the sums and gradients of all ranks' parts
            keys = ("tokens", "loss", "pg_loss", "clip_frac", "ratio_mean")
            keys += ("kl",) * (self.kl_coef > 0)
            acc = parallel.all_reduce_sums(acc or {}, keys, self.dp_group)
            if acc["tokens"] > 0:
                parallel.all_reduce_grads(self.model, self.dp_group)
        if not acc or acc["tokens"] <= 0:
            self.optimizer.zero_grad(set_to_none=True)
            return {"steps": 0}
        total = acc.pop("tokens")
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(total)
        metrics = {k: v / total for k, v in acc.items()}
        metrics["grad_norm"] = self._step()
        metrics["steps"] = 1
        return metrics

    def sft_step(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        micro_batch_size: int | None = None,
    ) -> dict[str, float]:
        """One supervised optimizer step: token-mean NLL of the response (answer + EOS) tokens.

        Prompt tokens carry no loss. Same layout as rollouts (``[B, P]`` left-padded prompts,
        ``[B, R]`` right-padded responses), so the positions the model learns match generation.

        Returns:
            ``loss`` (nats per answer token), ``grad_norm`` (pre-clip).
        """
        self.model.train()
        idx_all = row_index(len(response_ids))
        num_tokens = float(response_mask.sum().clamp(min=1))
        total = 0.0
        for idx in split_rows(idx_all, micro_batch_size):
            with self.autocast():
                lp = sequence_logprobs(
                    self.model,
                    prompt_ids[idx].to(self.device),
                    prompt_mask[idx].to(self.device),
                    response_ids[idx].to(self.device),
                    response_mask[idx].to(self.device),
                    temperature=1.0,
                )
            loss = -lp.sum() / num_tokens
            loss.backward()
            total += loss.item()
        return {"loss": total, "grad_norm": self._step()}

    # ------------------------------------------------------------------ memory

    def offload(self, spill_path: str | None = None) -> None:
        """Release the device memory held by parameters, gradients and optimizer state.

        On an accelerator they move to (pinned) host memory. On CPU the "device" is host memory
        already: parameters and optimizer state are copied into one flat buffer per dtype and
        the tensors freed (parameters become empty placeholders). The buffers are kept in
        memory, or written to ``spill_path`` (then RAM really is released). Gradients are
        dropped. :meth:`onload` restores the state bit-exactly; the trainer must not be used in
        between. (Flat copies, not ``torch.save``: ~10x cheaper, and temporal GRPO switches the
        actor out and back in every step.)
        """
        if self._offloaded is not None:
            return
        device = self.device
        self.optimizer.zero_grad(set_to_none=True)
        if device.type != "cpu":
            for p in self.model.parameters():
                p.data = _to_host(p.data)
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                        state[k] = _to_host(v)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # copies done before the device memory is reused
                torch.cuda.empty_cache()
            self._offloaded = {"device": device}
            return
        params = list(self.model.parameters())  # tied weights appear once
        states = [(p, dict(self.optimizer.state[p])) for p in params if p in self.optimizer.state]
        tensors = [p.data for p in params]
        tensors += [v for _, st in states for v in st.values() if isinstance(v, torch.Tensor)]
        flat, layout = _pack(tensors)
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device="cpu")
        self.optimizer.state = defaultdict(dict)
        saved = {"device": device, "params": params, "states": states, "layout": layout}
        if spill_path is not None:
            torch.save(flat, spill_path)
            saved["path"] = spill_path
        else:
            saved["flat"] = flat
        for _, st in states:  # keep only the structure: the tensors live in `flat`
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    st[k] = _PACKED
        self._offloaded = saved

    def onload(self) -> None:
        """Bring parameters and optimizer state back to where :meth:`offload` took them from."""
        if self._offloaded is None:
            return
        saved, self._offloaded = self._offloaded, None
        device = saved["device"]
        if "flat" not in saved and "path" not in saved:
            for p in self.model.parameters():
                p.data = p.data.to(device, non_blocking=True)
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    # Adam's "step" counter stays on CPU (torch's default for non-capturable).
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = v.to(device, non_blocking=True)
            return
        if "path" in saved:
            flat = torch.load(saved["path"], weights_only=True)
            os.remove(saved["path"])
        else:
            flat = saved["flat"]
        tensors = iter(_unpack(flat, saved["layout"]))
        for p in saved["params"]:
            p.data = next(tensors)
        for p, st in saved["states"]:
            self.optimizer.state[p] = {
                k: next(tensors) if v is _PACKED else v for k, v in st.items()
            }


class TrainerSteps:
    """``steps`` and ``set_lr`` of an engine whose optimizer lives in ``self.trainer`` (a
    :class:`PolicyTrainer`)."""

    trainer: PolicyTrainer

    @property
    def steps(self) -> int:
        return self.trainer.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.trainer.steps = value

    def set_lr(self, lr: float) -> None:
        self.trainer.set_lr(lr)
