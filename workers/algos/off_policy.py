"""Off-policy corrections: importance weights between the trainer's and the rollout's logprobs,
as pure torch functions, and the metrics that say how off-policy a step's data was.

Three policies meet in an off-policy step (AReaL, Fu et al. 2025, section 5.1):

- ``pi_behav``: the policy that *sampled* each token, as the rollout engine computed it; its
  logprobs arrive with the batch (``behav_logprobs``, the rollout's ``logprobs``). It can be
  an older version than the trainer's (asynchronous training) and, even at the same version,
  differs from the trainer's numerics (another kernel, dtype or engine: Yao et al. 2025);
- ``pi_old`` (AReaL's ``pi_prox``, the proximal policy): the trainer's own weights at the start
  of the step, recomputed by the actor (``old_logprobs``); PPO's trust region is drawn
  around it;
- ``pi_theta``: the weights being trained (``logprobs``, with gradients).

A correction reweights the clipped PPO/GRPO surrogate (``ratio = pi_theta / pi_old``) by a
detached per-token weight ``w`` derived from ``log rho = old_logprobs - behav_logprobs``:

- ``tis``, truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"; veRL's rollout correction ``rollout_is``):
  ``w = min(rho, C)``;
- ``mis``, masked importance sampling (IcePop, Ling team 2025, "Every Step Evolves": the
  weight kept inside ``[low, high]``, zero outside): ``w = rho * 1[low <= rho <= high]``,
  ``low = 1/C``, ``high = C`` unless given;
- ``decoupled``, AReaL's decoupled PPO objective (Fu et al. 2025, section 5.1, eq. 5): the
  clipped ratio against ``pi_prox`` times the behaviour weight ``rho = pi_prox / pi_behav``,
  tokens whose ``rho`` exceeds the cap ``C`` dropped (AReaL's ``behav_imp_weight_cap``:
  "we filter out the tokens where behav_imp_weight exceeds behav_imp_weight_cap"); ``C = None``
  (or ``<= 0``): no cap.

Level: ``token`` (one ``rho`` per token) or ``sequence`` (one per response:
``rho_i = exp(sum_t mask_it log rho_it)``, the *product* of the token ratios, as veRL's
sequence-level TIS; not the geometric mean), broadcast over the response's tokens.
Log ratios are clamped to ``[-20, 20]`` before ``exp`` (veRL's safety bound), so a weight is
finite; a truncated or masked weight is unaffected.

Shapes: ``B`` responses, ``R`` response tokens, right padded; ``mask`` ``[B, R]`` is 1 on
response tokens. Logprobs are natural-log, float32. Weights are unitless and carry no
gradient. With ``behav_logprobs == old_logprobs`` every weight is 1 (``mis``, ``decoupled``)
or ``min(1, C)`` (``tis``; 1 for ``C >= 1``): the on-policy loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .grpo import grpo_loss, k3_kl

#: the corrections ``actor.off_policy.correction`` names (``none``: no reweighting)
CORRECTION_NAMES = ("none", "tis", "mis", "decoupled")
#: ``actor.off_policy.level``
LEVELS = ("token", "sequence")
#: what the names of :meth:`OffPolicyStats.result`'s metrics start with
METRIC_PREFIXES = ("is_", "mismatch_kl_", "staleness_")
#: log ratios are clamped to this magnitude before exp (veRL's rollout-correction bound)
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class Weights:
    """A correction's per-token weights and what it did.

    Fields:
        weights: ``[B, R]`` detached weights to multiply the per-token policy loss by (0 on
            padding and on masked tokens or sequences).
        rho: ``[B, R]`` the untruncated importance weight ``pi_old / pi_behav`` (per token, or
            the sequence's broadcast over its tokens), 0 on padding.
        truncated: ``[B, R]`` bool, where ``tis`` capped the weight at ``C``.
        masked: ``[B, R]`` bool, where ``mis`` or ``decoupled`` zeroed it.
    """

    weights: torch.Tensor
    rho: torch.Tensor
    truncated: torch.Tensor
    masked: torch.Tensor


def log_ratio(
    old_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """``[B, R]`` detached ``log(pi_old / pi_behav)``: per token (``level="token"``) or the
    response's sum over its tokens, broadcast (``"sequence"``; the log of the product of the
    token ratios), clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]``; 0 on padding.

    Raises:
        ValueError: an unknown ``level``, or shapes that differ.
    """
    if level not in LEVELS:
        raise ValueError(f"off-policy level {level!r}: pick one of {', '.join(LEVELS)}")
    if old_logprobs.shape != behav_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, behav_logprobs "
            f"{tuple(behav_logprobs.shape)} and mask {tuple(mask.shape)} must be one [B, R]"
        )
    m = mask.float()
    lr = (old_logprobs.detach().float() - behav_logprobs.detach().float()) * m
    if level == "sequence":
        lr = lr.sum(dim=1, keepdim=True).expand_as(lr) * m
    return lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def tis_weights(
    old_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
    clip: float = 2.0, level: str = "token",
) -> Weights:  # fmt: skip
    """Truncated importance sampling (Yao et al. 2025; veRL ``rollout_is`` with
    ``rollout_is_threshold = C``): ``w = min(rho, C)``, ``rho = exp(old - behav)`` per token or
    per sequence (:func:`log_ratio`). ``truncated``: ``rho > C``. ``[B, R]`` in and out.

    Raises:
        ValueError: ``clip <= 0``, a bad ``level``.
    """
    if not clip > 0:
        raise ValueError(f"tis: clip={clip!r}, give the truncation cap C > 0 (veRL: 2.0)")
    m = mask.bool()
    rho = torch.exp(log_ratio(old_logprobs, behav_logprobs, mask, level)) * m
    truncated = (rho > clip) & m
    return Weights(torch.clamp(rho, max=clip), rho, truncated, torch.zeros_like(m))


def mis_weights(
    old_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
    clip: float = 2.0, level: str = "token", low: float | None = None,
    high: float | None = None,
) -> Weights:  # fmt: skip
    """Masked importance sampling (IcePop, Ling team 2025: ``M(rho) = rho`` inside
    ``[alpha, beta]``, 0 outside; veRL's rejection sampling at token or sequence level):
    ``w = rho * 1[low <= rho <= high]``, ``low = 1/C`` and ``high = C`` unless given.
    ``masked``: response tokens (or whole sequences) outside the bounds. ``[B, R]``.

    Raises:
        ValueError: ``clip <= 0`` without both bounds, ``low > high``, a bad ``level``.
    """
    if low is None or high is None:
        if not clip > 0:
            raise ValueError(f"mis: clip={clip!r}, give C > 0 (bounds [1/C, C]) or low/high")
    low = 1.0 / clip if low is None else float(low)
    high = float(clip) if high is None else float(high)
    if not 0 <= low <= high:
        raise ValueError(f"mis: bounds [{low}, {high}]: give 0 <= low <= high")
    m = mask.bool()
    rho = torch.exp(log_ratio(old_logprobs, behav_logprobs, mask, level)) * m
    keep = (rho >= low) & (rho <= high) & m
    return Weights(torch.where(keep, rho, 0.0), rho, torch.zeros_like(m), m & ~keep)


def decoupled_weights(
    prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
    clip: float | None = None, level: str = "token",
) -> Weights:  # fmt: skip
    """AReaL's behaviour weight (Fu et al. 2025, section 5.1, eq. 5): ``w = pi_prox /
    pi_behav`` where it is at most the cap ``C = clip`` and 0 where above (AReaL's
    ``behav_imp_weight_cap`` filters those tokens out; it truncates nothing). ``clip`` ``None``
    or ``<= 0``: no cap. ``masked``: tokens (or sequences) above the cap. ``[B, R]``.

    Raises:
        ValueError: a bad ``level``.
    """
    m = mask.bool()
    rho = torch.exp(log_ratio(prox_logprobs, behav_logprobs, mask, level)) * m
    if clip is None or clip <= 0:
        return Weights(rho, rho, torch.zeros_like(m), torch.zeros_like(m))
    drop = (rho > clip) & m
    return Weights(torch.where(drop, 0.0, rho), rho, torch.zeros_like(m), drop)


#: name -> ``fn(old_logprobs, behav_logprobs, mask, clip=..., level=..., **bounds) -> Weights``
CORRECTIONS: dict[str, Callable[..., Weights]] = {
    "tis": tis_weights,
    "mis": mis_weights,
    "decoupled": decoupled_weights,
}


def correction_weights(
    old_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
    correction: str, clip: float | None = 2.0, level: str = "token",
    low: float | None = None, high: float | None = None,
) -> Weights:  # fmt: skip
    """The weights of the correction named ``correction`` (:data:`CORRECTIONS`); ``low`` and
    ``high`` are read by ``mis`` only.

    Raises:
        ValueError: an unknown ``correction`` (``none`` included: it has no weights), or the
            correction's own errors.
    """
    fn = CORRECTIONS.get(correction)
    if fn is None:
        raise ValueError(
            f"off-policy correction {correction!r}: pick one of {', '.join(CORRECTIONS)}"
        )
    bounds = {"low": low, "high": high} if correction == "mis" else {}
    return fn(old_logprobs, behav_logprobs, mask, clip=clip, level=level, **bounds)


def decoupled_ppo_loss(
    logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
    advantages: torch.Tensor, response_mask: torch.Tensor, clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2, cap: float | None = None, level: str = "token",
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
    Reinforcement Learning System for Language Reasoning", section 5.1, eq. 5), token-mean:

    ``loss = -sum_t mask_t w_t min(u_t A, clip(u_t, 1 - eps_low, 1 + eps_high) A) / num_tokens``,
    ``u_t = pi_theta / pi_prox = exp(logprobs - prox_logprobs)`` (the trust region is drawn
    around the proximal policy), ``w_t = pi_prox / pi_behav`` (:func:`decoupled_weights`,
    tokens above ``cap`` dropped). With ``prox == behav`` it is PPO's clipped loss
    (:func:`~.grpo.grpo_loss`).

    Args:
        logprobs: ``[B, R]`` the trained policy's (with grad); prox_logprobs,
            behav_logprobs: ``[B, R]`` the recomputed and the rollout's (no grad).
        advantages: ``[B]`` or ``[B, R]``; response_mask: ``[B, R]``.
        cap, level: :func:`decoupled_weights`'s ``clip`` and ``level``.
        num_tokens: the token mean's denominator (default: this batch's tokens).

    Returns:
        :func:`~.grpo.grpo_loss`'s ``(loss, metrics)``.
    """
    w = decoupled_weights(prox_logprobs, behav_logprobs, response_mask, cap, level)
    return grpo_loss(
        logprobs, prox_logprobs, advantages, response_mask, clip_eps_low, clip_eps_high,
        num_tokens=num_tokens, weights=w.weights,
    )  # fmt: skip


# -- metrics -------------------------------------------------------------------------------


@dataclass
class OffPolicyStats:
    """Off-policy metrics of a step, accumulated over its parts (the streaming update trains
    on chunks as they arrive): :meth:`add` each part, :meth:`result` at the end.

    ``correction``, ``clip``, ``level``, ``low``, ``high``: as :func:`correction_weights`
    (``none``: weights are reported as ``tis`` would compute them, nothing is truncated or
    masked). See :meth:`result` for the metrics.
    """

    correction: str = "tis"
    clip: float | None = 2.0
    level: str = "token"
    low: float | None = None
    high: float | None = None
    _sums: dict = field(default_factory=dict)
    _lags: dict = field(default_factory=dict)

    def add(
        self, old_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
        versions: torch.Tensor | None = None, trained_version: int | None = None,
    ) -> None:  # fmt: skip
        """One part: ``[B, R]`` recomputed and behaviour logprobs and the mask of the tokens
        trained on (the loss mask: a multi-turn episode's model tokens; else the response
        mask); ``versions`` ``[B, R]`` (int: the weight version that sampled each
        token) and ``trained_version`` (the version of the weights the step starts from)
        for the staleness metrics (both, or neither)."""
        s = self._sums
        m = mask.bool()
        name = "tis" if self.correction == "none" else self.correction
        w = correction_weights(old_logprobs, behav_logprobs, mask, name, self.clip,
                               self.level, self.low, self.high)  # fmt: skip
        # one unit per token, or per sequence (its first token stands for it)
        unit = m if self.level == "token" else m & (m.cumsum(dim=1) == 1)
        rho = w.rho[unit]
        add = {
            "units": float(unit.sum()), "rho_sum": float(rho.sum()),
            "truncated": float(w.truncated[unit].sum()), "masked": float(w.masked[unit].sum()),
            "tokens": float(m.sum()),
        }  # fmt: skip
        # float64: a mismatch of 1e-7 nats would round to 0 (or below) in k3 at float32
        old, behav = old_logprobs.detach().double()[m], behav_logprobs.detach().double()[m]
        add["k1"] = float((behav - old).sum())
        add["k3"] = float(k3_kl(behav, old).sum())
        for k, v in add.items():
            s[k] = s.get(k, 0.0) + v
        if len(rho):
            s["rho_max"] = max(s.get("rho_max", 0.0), float(rho.max()))
        if versions is not None:
            lag = (trained_version - versions[m].long()).tolist()
            for v in lag:
                self._lags[v] = self._lags.get(v, 0) + 1

    def reset(self) -> None:
        """Forget the parts added (the next step starts)."""
        self._sums, self._lags = {}, {}

    def result(self) -> dict[str, float]:
        """The step's metrics (``{}`` before any :meth:`add`):

        - ``is_weight_mean``, ``is_weight_max``: the importance weight ``rho = pi_old /
          pi_behav`` before truncation or masking, over response tokens (``level=token``) or
          sequences (``sequence``: the product of its token ratios); unitless;
        - ``is_truncated_frac``, ``is_masked_frac``: the share of those tokens (sequences) that
          ``tis`` truncated / ``mis`` or ``decoupled`` masked;
        - ``mismatch_kl_k1``, ``mismatch_kl_k3``: the rollout-trainer logprob mismatch,
          ``KL(pi_behav || pi_old)`` estimated from the sampled tokens, nats per response
          token: ``k1 = behav - old``, ``k3 = rho - 1 - log rho`` (Schulman 2020; k3 is
          non-negative);
        - with versions: ``staleness_max``, ``staleness_mean`` (versions: the trained version
          minus the version that sampled each token, over trained response tokens) and
          ``staleness_lag_<k>`` for ``k = 0 .. staleness_max``: the share of tokens ``k``
          versions old.
        """
        s = self._sums
        if not s.get("tokens"):
            return {}
        units, tokens = max(s["units"], 1.0), s["tokens"]
        out = {
            "is_weight_mean": s["rho_sum"] / units, "is_weight_max": s.get("rho_max", 0.0),
            "is_truncated_frac": s["truncated"] / units, "is_masked_frac": s["masked"] / units,
            "mismatch_kl_k1": s["k1"] / tokens, "mismatch_kl_k3": s["k3"] / tokens,
        }  # fmt: skip
        if self._lags:
            n = sum(self._lags.values())
            out["staleness_max"] = max(self._lags)
            out["staleness_mean"] = sum(k * c for k, c in self._lags.items()) / n
            for k in range(out["staleness_max"] + 1):
                out[f"staleness_lag_{k}"] = self._lags.get(k, 0) / n
        return out


def off_policy_metrics(
    old_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
    correction: str = "tis", clip: float | None = 2.0, level: str = "token",
    versions: torch.Tensor | None = None, trained_version: int | None = None,
    low: float | None = None, high: float | None = None,
) -> dict[str, float]:  # fmt: skip
    """:meth:`OffPolicyStats.result` of one batch (``[B, R]`` tensors; see there for the
    metrics and their units)."""
    stats = OffPolicyStats(correction, clip, level, low, high)
    stats.add(old_logprobs, behav_logprobs, mask, versions, trained_version)
    return stats.result()
