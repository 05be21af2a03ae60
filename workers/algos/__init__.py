"""Algorithms as pure torch functions, one module per family (no Ray, no workers):

- :mod:`.logprobs`: per-token logprobs of responses under a causal LM, full forward or each
  distinct prompt once (:func:`sequence_logprobs`, :func:`shared_prefix_logprobs`);
- :mod:`.grpo`: group-normalised advantages and the clipped policy loss with an optional k3 KL
  (:func:`grpo_advantages`, :func:`grpo_loss`; PPO's policy loss too);
- :mod:`.ppo`: KL-shaped token rewards, GAE, the clipped value loss, masked whitening,
  explained variance (:func:`token_rewards`, :func:`gae`, :func:`clipped_value_loss`,
  :func:`masked_whiten`, :func:`explained_variance`);
- :mod:`.losses`: every loss a train engine minimises, by name (:data:`LOSSES`: ``grpo``,
  ``gspo``, ``sft``, ``value``, ``score_bce``), bound to its settings by :func:`make_loss`
  (``actor.loss=...``); the engines call them, never define one;
- :mod:`.off_policy`: off-policy corrections (truncated and masked importance sampling,
  AReaL's decoupled PPO) as per-token weights the policy losses apply
  (``actor.off_policy.correction``), and the step's importance-weight, mismatch and
  staleness metrics (:data:`CORRECTIONS`, :func:`correction_weights`,
  :func:`decoupled_ppo_loss`, :class:`OffPolicyStats`).

A new algorithm (RLOO, a DAPO variant) is one more module here. Exports are lazy: importing
:mod:`.ppo` or :mod:`.grpo` does not import transformers.
"""

from importlib import import_module

_EXPORTS = {
    "sequence_logprobs": ".logprobs",
    "shared_prefix_logprobs": ".logprobs",
    "grpo_advantages": ".grpo",
    "grpo_loss": ".grpo",
    "token_rewards": ".ppo",
    "gae": ".ppo",
    "masked_whiten": ".ppo",
    "clipped_value_loss": ".ppo",
    "explained_variance": ".ppo",
    "k3_kl": ".grpo",
    "LOSSES": ".losses",
    "make_loss": ".losses",
    "register_loss": ".losses",
    "gspo_loss": ".losses",
    "CORRECTIONS": ".off_policy",
    "correction_weights": ".off_policy",
    "decoupled_ppo_loss": ".off_policy",
    "off_policy_metrics": ".off_policy",
    "OffPolicyStats": ".off_policy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
