"""GRPO: group-normalised advantages and the clipped policy loss (also PPO's policy loss, with
per-token advantages).

References: PPO clipped surrogate (Schulman et al., 2017, eq. 7), GRPO (DeepSeekMath, Shao et
al., 2024, §4.1: group-relative advantages, eq. 3; k3 KL estimator to a reference policy,
eq. 4), decoupled clip ranges ``clip_eps_low``/``clip_eps_high`` and token-mean aggregation as in
DAPO (Yu et al., 2025).

Shapes: ``B`` responses, ``R`` response tokens (right padded). Logprobs are natural-log
probabilities, float32.
"""

from __future__ import annotations

import torch


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


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)``: ``exp(d) - d - 1`` with
    ``d = ref - logprobs`` (Schulman, "Approximating KL divergence", 2020; DeepSeekMath eq. 4).
    Non-negative, unbiased; ``[B, R]`` in, ``[B, R]`` out."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


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
    weights: torch.Tensor | None = None,
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
        weights: ``[B, R]`` per-token weights (no gradient) multiplying the surrogate term,
            an off-policy correction's (:mod:`.off_policy`): ``loss = sum_t mask_t [w_t pg_t
            + kl_coef k3_t] / num_tokens``. ``None``: none (the same numbers bit for bit).

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
    if weights is not None:
        pg = pg * weights.detach()
    per_token = pg
    n_local = mask.sum().clamp(min=1.0)
    metrics: dict[str, float] = {}
    with torch.no_grad():
        metrics["pg_loss"] = float((pg * mask).sum() / n_local)
        metrics["clip_frac"] = float(((clipped != unclipped).float() * mask).sum() / n_local)
        metrics["ratio_mean"] = float((ratio * mask).sum() / n_local)
    if ref_logprobs is not None:
        k3 = k3_kl(logprobs, ref_logprobs)
        metrics["kl"] = float((k3.detach() * mask).sum() / n_local)
        if kl_coef:
            per_token = per_token + kl_coef * k3
    elif kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    loss = (per_token * mask).sum() / denom
    return loss, metrics
