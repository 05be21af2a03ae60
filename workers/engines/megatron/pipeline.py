"""Micro-batches through Megatron's pipeline schedule (``actor.pipeline_parallel > 1``).

Every rank of a pipeline (the stages of one TP rank of one DP replica) holds the same rows; the
first stage embeds them, the activations travel stage to stage by p2p (gloo on CPU, NCCL on
GPU), the last stage turns its logits into per-token logprobs and the loss, and the backward
runs in reverse. Megatron's 1F1B schedule without interleaving
(``get_forward_backward_func()``) drives it, as in the parity harness (:mod:`.parity`).

The schedule sends activations of one fixed shape ``[S, b, H]``, so every micro-batch of a call
must have the same number of rows: :func:`pad_rows` fills a short one with rows that carry no
response token (mask 0: no loss, no gradient, logprobs dropped).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: keys of a training micro-batch, and what a padding row holds for each
_PAD_FILL = {
    "response_ids": 0,
    "response_mask": 0,
    "loss_mask": 0,
    "advantages": 0.0,
    "old_logprobs": 0.0,  # ratio exp(0 - 0) = 1 and k3 = 0 on padding: finite, masked
    "ref_logprobs": 0.0,
}


def pad_rows(mb: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
    """``mb`` (``[b, ...]`` tensors) grown to ``size`` rows: the prompt of row 0 (a valid
    left-padded prompt), an empty response (``response_mask`` 0), zero advantages and
    logprobs. Masked rows add nothing to the loss or the gradient."""
    b = len(mb["response_ids"])
    if b >= size:
        return mb
    out = {}
    for k, v in mb.items():
        if k in _PAD_FILL:
            fill = torch.full(
                (size - b, *v.shape[1:]), _PAD_FILL[k], dtype=v.dtype, device=v.device
            )
        else:  # prompt ids and mask: a copy of row 0
            fill = v[:1].expand(size - b, *v.shape[1:])
        out[k] = torch.cat([v, fill.to(v.device)])
    return out


def run_schedule(
    model,
    micro_batches: list[dict[str, torch.Tensor]],
    temperature: float,
    loss_fn: Callable[[torch.Tensor, dict], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Forward (and, with ``loss_fn``, backward) of ``micro_batches`` through the pipeline.

    Args:
        model: this rank's stage (a Megatron ``GPTModel`` with ``m2flow_shape``).
        micro_batches: dicts of ``[b, ...]`` tensors (``prompt_ids``, ``prompt_mask``,
            ``response_ids``, ``response_mask`` and what ``loss_fn`` reads), the same ``b``
            and lengths in each (see :func:`pad_rows`); identical on every stage.
        temperature: logprobs of ``log_softmax(logits / T)``.
        loss_fn: ``(logprobs [b, R], micro-batch) -> scalar loss`` on the last stage; its
            gradient is backpropagated through every stage, unscaled (the loss is a token sum:
            ``calculate_per_token_loss`` keeps the schedule from dividing it by the number of
            micro-batches). ``None``: forward only.

    Returns:
        the last stage: each micro-batch's logprobs ``[b, R]`` (detached, 0 where masked);
        other stages: ``[]``.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .model import logprobs_from_rolled_logits, rolled_inputs

    shape = model.m2flow_shape
    outputs: list[torch.Tensor] = []

    def forward_step(data_iterator, stage_model):
        mb = next(data_iterator)
        tokens, position_ids, causal, back = rolled_inputs(
            mb["prompt_ids"], mb["prompt_mask"], mb["response_ids"]
        )
        out = stage_model(tokens, position_ids, attention_mask=causal)  # activations or logits

        def last_stage(logits):
            lp = logprobs_from_rolled_logits(
                logits,
                back,
                mb["prompt_ids"].shape[1],
                mb["response_ids"],
                mb["response_mask"],
                shape.vocab_size,
                temperature,
            )
            outputs.append(lp.detach())
            loss = loss_fn(lp, mb) if loss_fn is not None else lp.sum().detach() * 0
            return loss, torch.ones((), dtype=torch.int, device=lp.device), {}

        return out, last_stage

    first = micro_batches[0]
    model.config.calculate_per_token_loss = True  # our loss is already scaled (see above)
    forward_only = loss_fn is None
    with torch.set_grad_enabled(not forward_only):
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=first["prompt_ids"].shape[1] + first["response_ids"].shape[1],
            micro_batch_size=len(first["response_ids"]),
            forward_only=forward_only,
        )
    return outputs
