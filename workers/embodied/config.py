"""The embodied roles' options: the ``env``, ``policy`` and ``algorithm`` sections of
``workflows/embodied.py``, typed once here (defaults included) and passed whole to
:class:`~.env.EnvWorker`, :class:`~.policy.PolicyWorker` and
:class:`~.actor.EmbodiedActorWorker`. Unknown keys and ill-typed values are refused when the
workflow's configuration is loaded (:func:`m2flow.core.config.load_config`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EnvOptions:
    id: str = "CartPole-v1"  # Gymnasium id: flat Box observations, Discrete actions
    num_envs: int = 64  # simulators per environment rank (one vectorised env)
    steps: int = 32  # environment steps per simulator per PPO update (rollout length T)
    threads: int = 1  # torch threads of an environment rank


@dataclass
class PolicyOptions:
    hidden: int = 64  # width of the two tanh layers (policy and value MLPs)
    threads: int = 1  # torch threads of a policy (inference) rank


@dataclass
class PPOOptions:
    """The embodied actor's PPO (Schulman et al. 2017, arXiv:1707.06347; clipped value loss
    as in the PPO2 baselines), with RL Zoo's CartPole settings."""

    lr: float = 1e-3  # Adam, eps 1e-5
    gamma: float = 0.98  # discount per environment step (RL Zoo CartPole)
    lam: float = 0.8  # GAE lambda (RL Zoo CartPole)
    clip_eps: float = 0.2  # PPO ratio clip: [1 - eps, 1 + eps]
    value_clip: float = 0.2  # value clip around the old values (0: none)
    vf_coef: float = 0.5  # weight of the value loss
    ent_coef: float = 0.0  # weight of the entropy bonus
    epochs: int = 10  # passes over each batch
    mini_batch_size: int = 256  # environment steps per optimizer step
    grad_clip: float = 0.5  # global gradient-norm clip
    threads: int = 0  # actor's torch threads; 0 = the CPUs of its devices
    engine: str = "torch"  # the actor's actor_critic engine: torch, or module:Class
