"""Per-token logprobs of responses under a causal LM (the actor's old and training logprobs,
the reference's): one forward over ``[prompt | response]`` (:func:`sequence_logprobs`), or each
distinct prompt once and the responses on its KV cache (:func:`shared_prefix_logprobs`; a GRPO
group's samples share their prompt).

Shapes: ``B`` responses, ``P`` prompt tokens (left padded), ``R`` response tokens (right
padded). Logprobs are natural-log probabilities, float32 (float64 stays float64), of
``log_softmax(logits / T)`` at the sampling temperature ``T``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """Half-precision logits go to float32 for the softmax; float64 stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def sequence_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token logprobs ``[B, R]`` of the response tokens under ``log_softmax(logits / T)``.

    One forward pass over ``[prompt | response]`` (``[B, P + R]``) with positions
    ``cumsum(mask) - 1`` so left padding does not shift them (what ``generate`` does too).
    Used for the actor's old logprobs, the reference logprobs (under ``torch.no_grad``) and the
    training forward. Masked positions are 0.

    Args:
        prompt_ids, prompt_mask: ``[B, P]`` left-padded prompts and their mask.
        response_ids, response_mask: ``[B, R]`` right-padded responses and their mask.
        temperature: the sampling temperature ``T`` the responses were drawn with.
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
    ).logits
    # The logit at position t predicts token t + 1: response token j is predicted at P - 1 + j.
    p = prompt_ids.shape[1]
    logits = _at_least_fp32(logits[:, p - 1 : -1]) / temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    return logprobs * response_mask


def shared_prefix_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """:func:`sequence_logprobs`, computing each distinct prompt once (a GRPO group's samples
    share their prompt).

    Two forwards instead of one: the ``U`` distinct prompt rows ``[U, P]`` (their last logit
    predicts response token 0), then the responses ``[B, W]`` on top of the prompts' KV cache,
    gathered to each response's row (``DynamicCache.batch_select_indices``). ``W`` is the
    longest response less one (``<= R - 1``): a response's last token predicts nothing scored.
    Masks and positions are those of the full ``[B, P + R]`` forward, so under causal attention
    every scored logit is the same function of the same inputs: only float rounding differs.
    Gradients flow through the gathered cache into the prompt forward (gathering backpropagates
    as a sum over the rows sharing a prompt), so the loss gradient equals the full forward's.

    Rows need not be ordered: prompts are matched by value (``torch.unique`` over ids and mask),
    so a group split across micro-batches or shuffled rows still work; with ``U == B`` it only
    costs a second forward call. Token cost: ``U * P + B * W`` against ``B * (P + R)``.

    Args and result as :func:`sequence_logprobs` (``[B, R]``, 0 where masked).
    """
    (b, p), r = prompt_ids.shape, response_ids.shape[1]
    uniq, inverse = torch.unique(
        torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True
    )
    u_ids, u_mask = uniq[:, :p], uniq[:, p:]
    cache = DynamicCache(config=model.config)
    first = model(
        input_ids=u_ids,
        attention_mask=u_mask,
        position_ids=(u_mask.cumsum(dim=1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1:][inverse]  # [B, 1, V]: predicts response token 0
    parts = [_token_logprobs(first, response_ids[:, :1], temperature)]
    width = int(response_mask.sum(dim=1).max()) - 1 if b else 0
    if width > 0:
        cache.batch_select_indices(inverse)
        mask = torch.cat([prompt_mask, response_mask[:, :width]], dim=1)
        logits = model(
            input_ids=response_ids[:, :width],
            attention_mask=mask,
            position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0)[:, p:],
            past_key_values=cache,
            use_cache=True,
        ).logits
        parts.append(_token_logprobs(logits, response_ids[:, 1 : width + 1], temperature))
    if r > 1 + max(width, 0):  # columns past every response: masked anyway
        parts.append(parts[0].new_zeros(b, r - 1 - max(width, 0)))
    return torch.cat(parts, dim=1) * response_mask


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """``[N, W]`` logprobs of ``tokens`` under ``log_softmax(logits / T)``, logits ``[N, W, V]``."""
    logprobs = torch.log_softmax(_at_least_fp32(logits) / temperature, dim=-1)
    return logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
