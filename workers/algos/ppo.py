"""PPO pieces besides the policy surrogate: KL-shaped token rewards, GAE, the clipped value
loss, masked whitening, explained variance.

The clipped policy surrogate itself is :func:`m2flow.workers.algos.grpo.grpo_loss` (it takes
per-token advantages ``[B, T]``). References: GAE (Schulman et al., 2016, "High-Dimensional
Continuous Control Using Generalized Advantage Estimation", eq. 16 and the recursion of
section 3); PPO's clipped value loss (the ``vf_clip`` of OpenAI baselines ``ppo2``, as used by
InstructGPT-style RLHF in veRL and OpenRLHF); advantage whitening (baselines, CleanRL); the KL
penalty in the reward (Ziegler et al., 2019; InstructGPT).

Time runs along the *last* dimension everywhere: ``[B, T]`` (``B`` sequences or environments,
``T`` tokens or environment steps).
"""

from __future__ import annotations

import torch


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


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    last_value: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and value targets, shapes ``[B, T]``.

    ``delta_t = r_t + gamma * (1 - done_t) * V_{t+1} - V_t`` and
    ``A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}`` (GAE eq. 16 as a recursion),
    ``returns = A + V``. ``done_t = 1`` means the episode ended with step ``t`` (the next state
    is a new episode's or nothing), so nothing is bootstrapped across it.

    Args:
        rewards: ``[B, T]`` reward of each step.
        values: ``[B, T]`` critic values ``V(s_t)`` of the states the steps start from.
        dones: ``[B, T]`` 1 where the episode ends with that step, else 0.
        last_value: ``[B]`` value of the state after step ``T - 1`` (bootstrap; ignored where
            ``dones[:, -1]`` is 1).
        gamma: discount factor; lam: GAE's lambda (bias/variance trade-off).

    Returns:
        ``(advantages, returns)``, float32 ``[B, T]``.

    Raises:
        ValueError: shapes that do not line up.
    """
    if rewards.shape != values.shape or rewards.shape != dones.shape:
        raise ValueError(
            f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and dones "
            f"{tuple(dones.shape)} must have one shape [B, T]"
        )
    if last_value.shape != rewards.shape[:-1]:
        raise ValueError(f"gae: last_value {tuple(last_value.shape)} must be [B]")
    rewards, values = rewards.float(), values.float()
    alive = 1.0 - dones.float()
    adv = torch.zeros_like(rewards)
    next_value, next_adv = last_value.float(), torch.zeros_like(last_value, dtype=torch.float32)
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[..., t] + gamma * alive[..., t] * next_value - values[..., t]
        next_adv = delta + gamma * lam * alive[..., t] * next_adv
        adv[..., t] = next_adv
        next_value = values[..., t]
    return adv, adv + values


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the positions where ``mask`` is 1 (0 elsewhere)."""
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) / (var.sqrt() + eps) * m


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss, token-mean: ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with
    ``V_clip = old_V + clip(V - old_V, -clip, clip)``.

    Args:
        values: ``[B, T]`` current critic values (with grad).
        old_values: ``[B, T]`` values when the batch was collected (no grad).
        returns: ``[B, T]`` GAE value targets.
        mask: ``[B, T]`` 1 on the steps that count.
        clip: value clip range (``None`` or <= 0: plain squared error).
        num_tokens: denominator of the mean (default: this batch's mask sum; with gradient
            accumulation, the whole mini-batch's).

    Returns:
        ``(loss, metrics)``; metrics ``vf_loss``, ``vf_clip_frac`` (share of steps where the
        clipped term was the larger one), ``value_mean``.
    """
    m = mask.float()
    denom = float(num_tokens) if num_tokens is not None else m.sum().clamp(min=1.0)
    err = (values - returns) ** 2
    if clip is not None and clip > 0:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clipped = (clipped - returns) ** 2
        per_step = torch.maximum(err, err_clipped)
        clip_frac = (err_clipped > err).float()
    else:
        per_step, clip_frac = err, torch.zeros_like(err)
    loss = 0.5 * (per_step * m).sum() / denom
    n_local = m.sum().clamp(min=1.0)
    with torch.no_grad():
        metrics = {
            "vf_loss": float(0.5 * (per_step * m).sum() / n_local),
            "vf_clip_frac": float((clip_frac * m).sum() / n_local),
            "value_mean": float((values * m).sum() / n_local),
        }
    return loss, metrics


def explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var[target - pred] / Var[target]`` over masked positions (1: perfect critic,
    0: no better than a constant; NaN when the targets do not vary)."""
    m = mask.bool()
    y, p = target[m].float(), pred[m].float()
    var = y.var(unbiased=False)
    return float("nan") if var <= 0 else float(1.0 - (y - p).var(unbiased=False) / var)
