"""GRPO pieces: per-token logprobs, group-normalised advantages, clipped policy loss.

References: PPO clipped surrogate (Schulman et al., 2017, eq. 7), GRPO (DeepSeekMath, Shao et
al., 2024, §4.1: group-relative advantages, eq. 3; k3 KL estimator to a reference policy,
eq. 4), decoupled clip ranges ``clip_eps_low``/``clip_eps_high`` and token-mean aggregation as in
DAPO (Yu et al., 2025).

Shapes: ``B`` responses, ``P`` prompt tokens (left padded), ``R`` response tokens (right
padded). Logprobs are natural-log probabilities, float32.
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


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised outcome advantages ``(r - mean_g) / (std_g + eps)``, shape ``[B]``.

    DeepSeekMath GRPO outcome supervision (§4.1.2): every token of a response gets its
    response's advantage. ``std_g`` is the unbiased standard deviation of the group; a group with
    identical rewards (or a single member) gets advantage 0.

    Args:
        rewards: ``[B]`` float rewards.
        group_index: ``[B]`` int64 group id of each response (any ids, need not be contiguous).
    """
    rewards = rewards.float()
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    n = counts.float()
    sums = rewards.new_zeros(len(counts)).index_add_(0, inverse, rewards)
    mean = sums / n
    sq = rewards.new_zeros(len(counts)).index_add_(0, inverse, (rewards - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (n - 1).clamp(min=1))
    adv = (rewards - mean[inverse]) / (std[inverse] + eps)
    return torch.where(counts[inverse] > 1, adv, torch.zeros_like(adv))


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with GRPO advantages, token-mean aggregated, optional k3 KL.

    ``loss = sum_t mask_t * [ -min(ratio_t A, clip(ratio_t, 1-eps_low, 1+eps_high) A)
    + kl_coef * k3_t ] / num_tokens`` with ``ratio_t = exp(logprobs_t - old_logprobs_t)`` and
    ``k3_t = exp(ref_t - logprobs_t) - (ref_t - logprobs_t) - 1`` (DeepSeekMath eq. 4).

    Args:
        logprobs: ``[B, R]`` current policy logprobs (with grad).
        old_logprobs: ``[B, R]`` behaviour policy logprobs (no grad).
        advantages: ``[B]`` per-response advantages (broadcast over tokens) or ``[B, R]``.
        response_mask: ``[B, R]`` 1 on response tokens.
        clip_eps_low, clip_eps_high: ratio clip range ``[1 - low, 1 + high]``.
        ref_logprobs: ``[B, R]`` reference policy logprobs, needed if ``kl_coef > 0``.
        kl_coef: weight of the k3 KL penalty.
        num_tokens: denominator of the token mean. Default: the tokens in this batch. With
            gradient accumulation pass the token count of the whole mini-batch so that the sum
            of micro-batch losses equals the mini-batch loss.

    Returns:
        ``(loss, metrics)``: scalar loss tensor; metrics (floats, token means over this batch):
        ``pg_loss``, ``clip_frac``, ``ratio_mean``, ``kl`` (if a reference is given).
    """
    mask = response_mask.float()
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    denom = float(num_tokens) if num_tokens is not None else mask.sum().clamp(min=1.0)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    pg = -torch.minimum(unclipped, clipped)
    per_token = pg
    n_local = mask.sum().clamp(min=1.0)
    metrics: dict[str, float] = {}
    with torch.no_grad():
        metrics["pg_loss"] = float((pg * mask).sum() / n_local)
        metrics["clip_frac"] = float(((clipped != unclipped).float() * mask).sum() / n_local)
        metrics["ratio_mean"] = float((ratio * mask).sum() / n_local)
    if ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        metrics["kl"] = float((k3.detach() * mask).sum() / n_local)
        if kl_coef:
            per_token = per_token + kl_coef * k3
    elif kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    loss = (per_token * mask).sum() / denom
    return loss, metrics
