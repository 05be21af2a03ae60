"""PPO batch plumbing: joining a rollout chunk with its scores and reference logprobs, the
KL-shaped token rewards (one producer feeds the three consumers through ``m2flow.Fanout``).

A PPO step sends every rollout chunk to three consumers at once (reward model, reference,
critic); the reward model and the reference put their outputs under the chunk's key
(:func:`chunk_key`), and the critic, which also gets the chunk itself, takes them by that key.
"""

from __future__ import annotations

import torch


def chunk_key(batch) -> int:
    """The key of a rollout chunk: the GRPO group id (prompt index) of its first row. Prompt
    ids are unique within a step and chunks hold disjoint prompts, so keys are unique in a
    step."""
    return int(batch["group_index"][0])


def token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token rewards of RLHF PPO with the KL penalty in the reward (Ziegler et al., 2019,
    eq. 2; InstructGPT eq. 2): ``r_t = -kl_coef * (log pi(y_t) - log pi_ref(y_t))``, plus the
    sequence score on the response's last token.

    Args:
        scores: ``[B]`` sequence rewards (reward model and verifier mixed).
        logprobs, ref_logprobs: ``[B, R]`` behaviour and reference logprobs.
        response_mask: ``[B, R]`` 1 on response tokens (right padded, at least one).
        kl_coef: the KL weight ``beta``.

    Returns:
        ``(rewards, dones, kl)`` ``[B, R]``: rewards, 1 on each response's last token (the
        episode ends there), the per-token KL estimate ``log pi - log pi_ref`` (0 where masked).
    """
    mask = response_mask.float()
    kl = (logprobs - ref_logprobs) * mask
    last = (response_mask.sum(dim=1) - 1).clamp(min=0)
    dones = torch.zeros_like(mask).scatter_(1, last.unsqueeze(1), 1.0)
    rewards = -kl_coef * kl + dones * scores.float().unsqueeze(1)
    return rewards * mask, dones, kl
