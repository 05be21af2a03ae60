"""The embodied actor's PPO loss on an actor-critic network (CleanRL's ``ppo.py``, Huang et
al., 2022): clipped policy surrogate (:func:`~.grpo.grpo_loss` with one "token" per step), plus
``vf_coef`` times the clipped value loss (:func:`~.ppo.clipped_value_loss`), minus ``ent_coef``
times the mean entropy. Called by an ``actor_critic`` engine
(:class:`~m2flow.workers.engines.actor_critic.ActorCriticEngine`) as ``loss(model, mb)``."""

from __future__ import annotations

import torch

from .grpo import grpo_loss
from .ppo import clipped_value_loss


def actor_critic_loss(
    model, mb: dict[str, torch.Tensor], clip_eps: float, value_clip: float, vf_coef: float,
    ent_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """The loss of one mini-batch of environment steps.

    Args:
        model: ``dist(obs)`` (a ``torch.distributions`` over actions) and ``value(obs)``
            (``[N]``).
        mb: ``obs`` ``[N, obs_dim]``, ``actions``, ``logprobs`` (behaviour), ``values`` (old),
            ``advantages`` (whitened), ``returns``: ``[N]``.
        clip_eps: ratio clip; value_clip: value clip around the old values (0: none).
        vf_coef, ent_coef: weights of the value loss and of the entropy bonus.

    Returns:
        the scalar loss and ``pg_loss``, ``clip_frac``, ``vf_loss``, ``entropy``,
        ``approx_kl`` (``E[(r - 1) - log r]``).
    """
    dist = model.dist(mb["obs"])
    logprob = dist.log_prob(mb["actions"])
    mask = torch.ones_like(logprob).unsqueeze(1)
    pg, m = grpo_loss(
        logprob.unsqueeze(1), mb["logprobs"].unsqueeze(1), mb["advantages"], mask,
        clip_eps, clip_eps,
    )  # fmt: skip
    vf, vm = clipped_value_loss(
        model.value(mb["obs"]).unsqueeze(1), mb["values"].unsqueeze(1),
        mb["returns"].unsqueeze(1), mask, value_clip,
    )  # fmt: skip
    entropy = dist.entropy().mean()
    loss = pg + vf_coef * vf - ent_coef * entropy
    with torch.no_grad():
        log_ratio = logprob - mb["logprobs"]
        approx_kl = float(((log_ratio.exp() - 1) - log_ratio).mean())
    return loss, {
        "pg_loss": m["pg_loss"], "clip_frac": m["clip_frac"], "vf_loss": vm["vf_loss"],
        "entropy": entropy.item(), "approx_kl": approx_kl,
    }  # fmt: skip
