"""Losses: what a train engine minimises, as pure torch functions behind one registry.

An engine (:class:`~m2flow.workers.engines.train.TrainEngine`) is mechanics: it forwards
micro-batches, calls the loss, backpropagates and steps. The loss is the algorithm's, chosen by
name (``actor.loss=gspo``) from :data:`LOSSES` and bound to its settings by :func:`make_loss`.
A new policy loss is one function and one :func:`register_loss` line here; no engine changes.

The call an engine makes, once per micro-batch::

    loss, metrics = loss_fn(out, mb, normalizer)

- ``out``: the engine's forward of the micro-batch. ``output="logprobs"`` losses get per-token
  logprobs ``[b, R]`` of the response tokens (0 where masked) at the loss's temperature;
  ``output="values"`` losses get the value head's scalar per position ``[b, P + R]`` of
  ``prompt | response`` (:func:`response_values`, :func:`sequence_scores` read it).
- ``mb``: the micro-batch's tensors on the model's device: ``prompt_ids``/``prompt_mask``
  ``[b, P]``, ``response_ids``/``response_mask`` ``[b, R]`` and the loss's :attr:`Loss.keys`.
  A loss that lists ``loss_mask`` among its keys gets the batch's optional ``loss_mask``
  ``[b, R]`` (0/1): 1 on the tokens the model sampled, 0 on tool output, observations and
  template tokens of a multi-turn episode (and on padding). Such a loss sums over it, and its
  token unit counts it; ``response_mask`` stays the forward's attention mask (tool tokens are
  attended to, not trained on). Absent: the loss mask is ``response_mask``, the same numbers.
- ``normalizer``: the denominator of the mean, in the loss's :attr:`Loss.unit` (response tokens,
  or sequences) of the whole mini-batch, so that the micro-batch losses add up to the mini-batch
  mean; ``1.0`` when the engine accumulates a sum over parts and divides the gradients at the
  step (the streaming update).

It returns the scalar loss (backpropagated as it is) and metrics: floats, means over this
micro-batch's units (:meth:`Loss.units`).

Policy losses registered with ``off_policy=True`` (``grpo``, ``gspo``) take an ``off_policy``
setting (``actor.off_policy``): each token's surrogate term is weighted by the correction's
importance weight between ``old_logprobs`` and the rollout's ``behav_logprobs``
(:mod:`.off_policy`).

Sources: each function's docstring. Shapes: ``B`` responses, ``P`` prompt and ``R`` response
tokens; logprobs are natural-log, float32.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .grpo import grpo_loss, k3_kl
from .off_policy import correction_weights
from .ppo import clipped_value_loss

#: what an engine's forward gives a loss
OUTPUTS = ("logprobs", "values")


@dataclass(frozen=True)
class LossEntry:
    """A registered loss: the function and what the engine must know to call it.

    Fields:
        fn: ``fn(out, mb, normalizer, **settings) -> (loss, metrics)``.
        kind: ``policy`` (``actor.loss``), ``value``, ``sft`` or ``score``.
        output: ``logprobs`` or ``values`` (see the module docstring).
        unit: what ``normalizer`` counts: ``tokens`` (response tokens) or ``sequences``.
        keys: batch keys it reads besides the four response tensors (absent ones are skipped).
        metrics: the metric names it reports (``kl`` is added for a policy loss with
            ``kl_coef > 0``): a data-parallel rank that got no rows still sums them.
        temperature: the forward's temperature; ``None``: the engine's (the sampling one).
        full_forward: one forward over ``prompt | response`` even where the engine would
            forward each distinct prompt once (its rows have distinct prompts).
        off_policy: it applies an off-policy correction (:mod:`.off_policy`) given as its
            ``off_policy`` setting (a policy loss reading ``behav_logprobs``).
    """

    fn: Callable
    kind: str
    output: str = "logprobs"
    unit: str = "tokens"
    keys: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    temperature: float | None = None
    full_forward: bool = False
    off_policy: bool = False


#: name -> :class:`LossEntry`
LOSSES: dict[str, LossEntry] = {}


def register_loss(name: str, kind: str, **entry) -> Callable:
    """Decorator: register ``fn`` under ``name`` (:class:`LossEntry` fields as keywords).
    Replaces an earlier registration of ``name``."""

    def deco(fn: Callable) -> Callable:
        LOSSES[name] = LossEntry(fn, kind, **entry)
        return fn

    return deco


@dataclass(frozen=True)
class Loss:
    """A registered loss bound to its settings: what ``TrainEngine.forward_backward`` takes.

    Call it as ``loss(out, mb, normalizer) -> (loss, metrics)`` (module docstring). Its other
    attributes are :class:`LossEntry`'s (``output``, ``unit``, ``keys``, ``temperature``,
    ``full_forward``) and :attr:`metrics`.
    """

    name: str
    entry: LossEntry
    settings: dict = field(default_factory=dict)

    def __call__(self, out: torch.Tensor, mb: dict, normalizer: float):
        return self.entry.fn(out, mb, normalizer, **self.settings)

    def __getattr__(self, attr: str):
        if attr in ("output", "unit", "keys", "temperature", "full_forward", "kind"):
            return getattr(self.entry, attr)
        raise AttributeError(attr)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metric names it reports."""
        kl = self.entry.kind == "policy" and self.settings.get("kl_coef", 0.0) > 0
        return self.entry.metrics + ("kl",) * kl

    def units(self, batch: dict) -> float:
        """How many of its units ``batch`` holds: trained response tokens (:func:`loss_mask`
        summed, for a loss reading ``loss_mask``; ``response_mask`` summed otherwise) or
        sequences (rows)."""
        if self.entry.unit == "sequences":
            return float(len(batch["response_mask"]))
        if "loss_mask" in self.entry.keys:
            return float(loss_mask(batch).sum())
        return float(batch["response_mask"].sum())


def make_loss(name: str, kind: str | None = None, **settings) -> Loss:
    """The loss registered as ``name`` (or at import path ``"module:function"``, a function
    taking ``(out, mb, normalizer, **settings)``, registered as a policy loss), bound to
    ``settings``.

    Raises:
        ValueError: an unknown name, or one of another kind than ``kind``; the message names
            the losses of that kind; an ``off_policy`` setting for a loss that applies none.
    """
    entry = LOSSES.get(name)
    if entry is None and ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"loss {name!r}: cannot import it ({e})") from e
        entry = LossEntry(fn, kind or "policy", metrics=("pg_loss", "clip_frac", "ratio_mean"))
    if entry is None or (kind is not None and entry.kind != kind):
        raise ValueError(
            f"loss {name!r}: pick one of {', '.join(loss_names(kind))} "
            "(or a function's import path, 'package.module:function')"
        )
    if settings.get("off_policy") and not entry.off_policy:
        raise ValueError(
            f"loss {name!r} applies no off-policy correction: with actor.off_policy.correction="
            f"{settings['off_policy']['correction']} pick one that does "
            f"({', '.join(n for n, e in LOSSES.items() if e.off_policy)})"
        )
    return Loss(name, entry, dict(settings))


def loss_names(kind: str | None = None) -> list[str]:
    """The registered losses (of ``kind``)."""
    return [n for n, e in LOSSES.items() if kind is None or e.kind == kind]


def knows_loss(name: str, kind: str = "policy") -> bool:
    """Whether ``name`` is a registered ``kind`` loss or has the form of an import path
    (checked without importing: config validation runs before any worker starts)."""
    module, _, attr = name.partition(":")
    return name in loss_names(kind) or bool(module and attr)


# -- pieces --------------------------------------------------------------------------------


def loss_mask(mb: dict) -> torch.Tensor:
    """``[b, R]`` the tokens a loss trains on: ``mb["loss_mask"]`` when the batch has one (a
    multi-turn episode's model tokens), else ``mb["response_mask"]`` (the very tensor, so a
    batch without a loss mask gives the same numbers bit for bit).

    Raises:
        ValueError: a ``loss_mask`` of another shape than ``response_mask``.
    """
    mask = mb.get("loss_mask")
    if mask is None:
        return mb["response_mask"]
    if mask.shape != mb["response_mask"].shape:
        raise ValueError(
            f"loss_mask {tuple(mask.shape)} must have response_mask's shape "
            f"{tuple(mb['response_mask'].shape)}: one 0/1 entry per response token"
        )
    return mask


def response_values(out: torch.Tensor, mb: dict) -> torch.Tensor:
    """``[b, R]`` values ``V(s_j)`` of the state before response token ``j``, read from a value
    head's ``[b, P + R]`` output where the policy's logit for token ``j`` is; 0 where masked."""
    p = mb["prompt_ids"].shape[1]
    return out[:, p - 1 : -1] * mb["response_mask"]


def off_policy_weights(mb: dict, off_policy: dict | None) -> torch.Tensor | None:
    """The ``[b, R]`` weights of the correction ``off_policy`` names
    (:func:`~.off_policy.correction_weights`'s keywords: ``correction``, ``clip``, ``level``,
    ``low``, ``high``) between ``mb["old_logprobs"]`` (the trainer's, recomputed) and
    ``mb["behav_logprobs"]`` (the rollout's), over the :func:`loss_mask` tokens (a sequence's
    ratio is the product over its model tokens; tool tokens weigh 0); ``None`` without a
    correction.

    Raises:
        ValueError: a correction and no ``behav_logprobs`` in ``mb``.
    """
    if not off_policy:
        return None
    if "behav_logprobs" not in mb:
        raise ValueError(
            f"off-policy correction {off_policy['correction']!r} needs the rollout's behaviour "
            "logprobs in the batch (behav_logprobs)"
        )
    return correction_weights(
        mb["old_logprobs"], mb["behav_logprobs"], loss_mask(mb), **off_policy
    ).weights


def sequence_scores(out: torch.Tensor, mb: dict) -> torch.Tensor:
    """``[b]`` head output (a logit) at the last real token of ``prompt | response`` (the EOS
    when the response has one): a reward model's score of the whole sample."""
    last = mb["prompt_ids"].shape[1] - 1 + mb["response_mask"].sum(dim=1).clamp(min=1)
    return out.gather(1, last.unsqueeze(1)).squeeze(1)


# -- policy losses (actor.loss) ------------------------------------------------------------

#: what the policy losses read besides the response tensors
POLICY_KEYS = ("advantages", "old_logprobs", "ref_logprobs", "behav_logprobs", "loss_mask")


@register_loss(
    "grpo", "policy", keys=POLICY_KEYS,
    metrics=("pg_loss", "clip_frac", "ratio_mean"), off_policy=True,
)  # fmt: skip
def clipped_policy_loss(
    logprobs: torch.Tensor, mb: dict, normalizer: float, clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2, kl_coef: float = 0.0, off_policy: dict | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """The token-level clipped surrogate (PPO, Schulman et al., 2017, eq. 7) with GRPO's
    group-relative advantages and k3 KL (DeepSeekMath, Shao et al., 2024, eqs. 3-4), DAPO's
    decoupled clip range and token-mean aggregation (Yu et al., 2025); PPO's policy loss too
    (per-token advantages). :func:`~.grpo.grpo_loss`:

    ``loss = sum_t mask_t [-min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + kl_coef k3_t]
    / normalizer``, ``r_t = exp(logprobs_t - old_logprobs_t)``.

    ``mb``: ``advantages`` ``[b]`` or ``[b, R]``, ``old_logprobs`` ``[b, R]``, and
    ``ref_logprobs`` ``[b, R]`` with ``kl_coef > 0``; ``mask`` is :func:`loss_mask` (the
    optional ``loss_mask``, else ``response_mask``). Metrics (means over those tokens):
    ``pg_loss``, ``clip_frac``, ``ratio_mean``, ``kl`` (with a reference).

    ``off_policy`` (``actor.off_policy``): the surrogate term of each token is multiplied by
    the correction's weight (:func:`off_policy_weights`; ``mb["behav_logprobs"]`` ``[b, R]``,
    the rollout's): ``tis``/``mis`` as Yao et al. 2025 and IcePop, and with ``old_logprobs``
    the recomputed proximal policy, ``decoupled`` is AReaL's decoupled PPO
    (:func:`~.off_policy.decoupled_ppo_loss`).
    """
    return grpo_loss(
        logprobs,
        mb["old_logprobs"],
        mb["advantages"],
        loss_mask(mb),
        clip_eps_low,
        clip_eps_high,
        ref_logprobs=mb.get("ref_logprobs"),
        kl_coef=kl_coef,
        num_tokens=normalizer,
        weights=off_policy_weights(mb, off_policy),
    )


@register_loss(
    "gspo", "policy", unit="sequences",
    keys=POLICY_KEYS,
    metrics=("pg_loss", "clip_frac", "ratio_mean"), off_policy=True,
)  # fmt: skip
def gspo_loss(
    logprobs: torch.Tensor, mb: dict, normalizer: float, clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4, kl_coef: float = 0.0, off_policy: dict | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """GSPO's sequence-level clipped objective (Zheng et al., 2025, "Group Sequence Policy
    Optimization", eqs. 5-7; its token form GSPO-token, eqs. 13-14, which takes per-token
    advantages and equals GSPO when they are the sequence's):

    ``s_i = exp(1/|y_i| sum_t (logprobs_it - old_logprobs_it))`` (the length-normalised
    sequence ratio), ``s_it = sg[s_i] * exp(logprobs_it - sg[logprobs_it])`` (value ``s_i``,
    gradient ``s_i * grad logprobs_it``),
    ``loss = sum_i 1/|y_i| sum_t [-min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it)
    + kl_coef k3_it] / normalizer``: a mean over sequences (``normalizer`` counts them), each
    sequence's tokens averaged first, so a long response weighs as much as a short one. The
    whole sequence is clipped or none of it. The paper's clip range is tiny (3e-4, 4e-4, its
    defaults here): set ``actor.clip_eps_low`` / ``actor.clip_eps_high`` to match.

    ``mb`` as :func:`clipped_policy_loss`; ``|y_i|`` counts the :func:`loss_mask` tokens (a
    multi-turn episode's model tokens). Metrics (sequence means): ``pg_loss``,
    ``clip_frac`` (share of sequences clipped), ``ratio_mean`` (mean ``s_i``), ``kl``.
    ``off_policy``: each token's surrogate term times the correction's weight, as
    :func:`clipped_policy_loss`.
    """
    mask = loss_mask(mb).float()
    adv = mb["advantages"]
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    lengths = mask.sum(dim=1).clamp(min=1.0)
    seq_log_ratio = ((logprobs - mb["old_logprobs"]) * mask).sum(dim=1) / lengths  # [b]
    ratio = torch.exp(logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(1))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    weights = off_policy_weights(mb, off_policy)
    if weights is not None:
        per_token = per_token * weights
    metrics: dict[str, float] = {}
    n = float(max(len(mask), 1))
    with torch.no_grad():
        seq_ratio = torch.exp(seq_log_ratio)
        metrics["pg_loss"] = float(((per_token * mask).sum(dim=1) / lengths).sum() / n)
        was_clipped = ((clipped != unclipped).float() * mask).sum(dim=1) > 0
        metrics["clip_frac"] = float(was_clipped.float().sum() / n)
        metrics["ratio_mean"] = float(seq_ratio.sum() / n)
    ref = mb.get("ref_logprobs")
    if ref is not None:
        k3 = k3_kl(logprobs, ref)
        metrics["kl"] = float(((k3.detach() * mask).sum(dim=1) / lengths).sum() / n)
        if kl_coef:
            per_token = per_token + kl_coef * k3
    elif kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    loss = ((per_token * mask).sum(dim=1) / lengths).sum() / float(normalizer)
    return loss, metrics


# -- supervised, value and reward-model losses ---------------------------------------------


@register_loss("sft", "sft", keys=("loss_mask",), temperature=1.0, full_forward=True)
def sft_loss(logprobs: torch.Tensor, mb: dict, normalizer: float):
    """Supervised fine-tuning: the token-mean negative log-likelihood of the response tokens
    (``-sum_t mask_t log p(y_t) / normalizer``; prompt tokens carry no loss), at temperature 1
    over one full forward. ``mask``: ``mb["loss_mask"]`` ``[b, R]`` when given (a multi-turn
    trace's model tokens; tool output is context only), else the response (``logprobs`` are 0
    off it). No metrics besides the loss itself."""
    if "loss_mask" in mb:
        return -(logprobs * loss_mask(mb)).sum() / normalizer, {}
    return -logprobs.sum() / normalizer, {}


@register_loss(
    "value", "value", output="values", keys=("old_values", "returns"),
    metrics=("vf_loss", "vf_clip_frac", "value_mean"),
)  # fmt: skip
def value_loss(out: torch.Tensor, mb: dict, normalizer: float, value_clip: float | None = 0.2):
    """PPO's clipped value loss on the response tokens' values (:func:`response_values`):
    :func:`~.ppo.clipped_value_loss`, ``0.5 * max((V - R)^2, (V_clip - R)^2) / normalizer``
    summed over tokens, ``V_clip = old_V + clip(V - old_V, -value_clip, value_clip)``
    (baselines ``ppo2``'s ``vf_clip``). ``mb``: ``old_values``, ``returns`` ``[b, R]``.
    Metrics: ``vf_loss``, ``vf_clip_frac``, ``value_mean``."""
    return clipped_value_loss(
        response_values(out, mb),
        mb["old_values"],
        mb["returns"],
        mb["response_mask"],
        value_clip,
        normalizer,
    )


@register_loss("score_bce", "score", output="values", unit="sequences", keys=("targets",))
def score_bce_loss(out: torch.Tensor, mb: dict, normalizer: float):
    """A reward model's fit to soft labels: binary cross-entropy between the sequence score
    (:func:`sequence_scores`, a logit) and ``mb["targets"]`` ``[b]`` in [0, 1] (a verifier's
    partial credit), the mean over the micro-batch scaled to its share of ``normalizer``
    sequences (InstructGPT section 3.5 fits a reward model the same way to comparisons)."""
    logits = sequence_scores(out, mb)
    loss = F.binary_cross_entropy_with_logits(logits, mb["targets"].float())
    return loss * (len(logits) / normalizer), {}
