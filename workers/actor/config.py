"""The actor's options: what the workflow's ``actor`` section (plus the rollout's temperature and
the run's seed) gives :class:`~.worker.ActorWorker`, typed and checked in one place."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from m2flow.core.config import ConfigError

from ..engines.lora import LoraOptions

if TYPE_CHECKING:  # the options import no torch: the workflows' config checks read them
    import torch


@dataclass(frozen=True)
class OffPolicyOptions:
    """``actor.off_policy``: how the policy loss corrects for data sampled by another policy
    than the trainer's (:mod:`~..algos.off_policy`, docs/concepts/engines.md).

    Fields:
        correction: ``none`` (today's on-policy loss; the rollout's logprobs are the old
            ones), ``tis`` (truncated importance sampling, Yao et al. 2025), ``mis`` (masked,
            IcePop) or ``decoupled`` (AReaL's decoupled PPO). Any but ``none`` recomputes the
            old (proximal) logprobs under the trainer's weights and weighs each token by
            ``pi_old / pi_behav`` against the rollout's logprobs.
        clip: ``C``: ``tis`` truncates at ``C``; ``mis`` keeps ``[1/C, C]`` (unless
            ``low``/``high``); ``decoupled`` drops tokens above ``C`` (``0``: no cap). 2.0 by
            default: veRL's rollout-correction threshold.
        level: ``token`` (a weight per token) or ``sequence`` (per response: the product of
            its token ratios).
        low, high: ``mis``'s bounds (``None``: ``1/C`` and ``C``).
        allow_uncorrected: accept asynchronous training (a staleness bound >= 1) with
            ``correction=none``; read by the staleness bound's checks.
        max_lag: drop, before the loss, every sample whose oldest response token was sampled
            more than ``max_lag`` weight versions before the trainer's (``None``: keep all);
            the run sets it to K with ``trainer.staleness_policy=drop``. Counted per step as
            ``staleness_dropped`` (samples).
    """

    correction: str = "none"
    clip: float = 2.0
    level: str = "token"
    low: float | None = None
    high: float | None = None
    allow_uncorrected: bool = False
    max_lag: int | None = None

    @classmethod
    def from_value(cls, value, role: str = "actor") -> OffPolicyOptions:
        """The options from a dict (the config section), ``None`` (defaults) or options.

        Raises:
            ConfigError: an unknown key (named, with the options there are), or a bad value
                (checked when built: the message names ``actor.off_policy.<key>`` and the fix).
        """
        if isinstance(value, OffPolicyOptions):
            return value
        value = dict(value or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ConfigError(
                f"{role}.off_policy has no option {', '.join(unknown)}: its options are "
                f"{', '.join(names)}"
            )
        return cls(**value)

    def __post_init__(self) -> None:
        from ..algos.off_policy import CORRECTION_NAMES, LEVELS  # heavy: the module imports torch

        opt, key = self, "actor.off_policy"

        def number(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if opt.correction not in CORRECTION_NAMES:
            raise ConfigError(
                f"{key}.correction={opt.correction!r}: pick one of {', '.join(CORRECTION_NAMES)}"
            )
        if opt.level not in LEVELS:
            raise ConfigError(f"{key}.level={opt.level!r}: pick one of {', '.join(LEVELS)}")
        if (
            not number(opt.clip)
            or opt.clip < 0
            or (opt.clip == 0 and opt.correction != "decoupled")
        ):
            raise ConfigError(
                f"{key}.clip={opt.clip!r}: give a number > 0 (2.0: veRL's cap; 0 means no cap "
                "for correction=decoupled only)"
            )
        for name in ("low", "high"):
            bound = getattr(opt, name)
            if bound is not None and (not number(bound) or bound < 0):
                raise ConfigError(
                    f"{key}.{name}={bound!r}: give a number >= 0, or null (1/clip, clip)"
                )
        low = 1.0 / opt.clip if opt.low is None and opt.clip else opt.low
        high = opt.clip if opt.high is None else opt.high
        if low is not None and high is not None and low > high:
            raise ConfigError(f"{key}.low={low} > {key}.high={high}: give low <= high")
        if not isinstance(opt.allow_uncorrected, bool):
            raise ConfigError(f"{key}.allow_uncorrected={opt.allow_uncorrected!r}: true or false")
        lag = opt.max_lag
        if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 0):
            raise ConfigError(f"{key}.max_lag={lag!r}: an integer >= 0 (versions), or null")

    @property
    def enabled(self) -> bool:
        """A correction is on (the loss reads the rollout's logprobs as ``behav_logprobs``)."""
        return self.correction != "none"

    @property
    def settings(self) -> dict:
        """The loss's ``off_policy`` setting (:func:`~..algos.losses.off_policy_weights`)."""
        return {"correction": self.correction, "clip": self.clip, "level": self.level,
                "low": self.low, "high": self.high}  # fmt: skip


@dataclass(frozen=True)
class ActorOptions:
    """The GRPO (and PPO) actor's optimiser, loss, batch split and engine, passed whole to
    :class:`~.worker.ActorWorker` (the workflows build it once from their ``actor`` section:
    :meth:`from_kwargs`). A bad ``nonfinite`` value: ``ValueError``; an unknown option:
    ``ValueError`` from :meth:`from_kwargs`.

    Fields:
        lr, betas, weight_decay, grad_clip: AdamW (``grad_clip``: global L2 norm; 0: none).
        temperature: the rollout's sampling temperature (logprobs are recomputed under it).
        loss: the policy loss, a :data:`~..algos.losses.LOSSES` name of kind ``policy``
            (``grpo``: token-level clipped ratio; ``gspo``: sequence-level) or
            ``"module:function"``.
        clip_eps_low, clip_eps_high: ratio clip range ``[1 - low, 1 + high]`` (the loss's).
        kl_coef: k3 KL weight to the reference (the warm-started policy, frozen); 0 = off.
        nonfinite: a NaN or infinite advantage, loss or gradient norm before an optimizer
            step: ``stop`` the run naming the step and the cause, or ``skip`` that step's
            update (gradients dropped, counted as ``nonfinite_skips``).
        mini_batch_size, micro_batch_size: responses per optimizer step / per forward
            (0: the whole global batch, streamed as it arrives / the whole mini-batch).
        recompute_old_logprobs: recompute behaviour logprobs instead of using the rollout's.
        drop_flat_groups: leave out groups whose samples all got the same reward (advantage 0;
            DAPO's dynamic-sampling filter without resampling).
        shared_prefix: forward each GRPO group's prompt once
            (:func:`~m2flow.workers.algos.logprobs.shared_prefix_logprobs`; same math).
        threads: torch intra-op threads; 0 = this rank's share of its node's CPUs.
        seed: model init seed.
        data_parallel: one rank per device and a gradient all-reduce (streaming updates only).
        engine: a backend of kind ``train`` (:mod:`~..engines.registry`) or ``"module:Class"``.
        tensor_parallel, pipeline_parallel: the Megatron engine's TP and PP sizes.
        lora: :class:`~..engines.lora.LoraOptions` (a dict of them is converted; ``rank`` 0:
            full fine-tuning); needs an engine with ``supports_lora`` (``torch``).
        off_policy: :class:`OffPolicyOptions` (a dict of them is converted): the off-policy
            correction of the policy loss (``none`` by default).
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    temperature: float = 1.0
    loss: str = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    nonfinite: str = "stop"
    mini_batch_size: int = 0
    micro_batch_size: int = 0
    recompute_old_logprobs: bool = False
    drop_flat_groups: bool = True
    shared_prefix: bool = True
    threads: int = 0
    seed: int = 0
    data_parallel: bool = False
    engine: str = "torch"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    lora: LoraOptions = LoraOptions()
    off_policy: OffPolicyOptions = field(default_factory=OffPolicyOptions)  # built: imports torch

    @classmethod
    def from_kwargs(cls, kwargs: dict, role: str = "actor") -> ActorOptions:
        """The options in ``kwargs``, the rest at their defaults.

        Raises:
            ValueError: a key that is no option (named, with the options there are); a bad
                ``lora`` value (:meth:`~..engines.lora.LoraOptions.from_value`).
            ConfigError: a bad ``off_policy`` value (:meth:`OffPolicyOptions.from_value`).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(
                f"the {role} has no option {', '.join(unknown)}: its options are "
                f"{', '.join(sorted(names))} (m2flow.workers.actor.config.ActorOptions)"
            )
        lora = LoraOptions.from_value(kwargs.get("lora"), role)
        off_policy = OffPolicyOptions.from_value(kwargs.get("off_policy"), role)
        return cls(**{**kwargs, "betas": tuple(kwargs.get("betas", cls.betas)), "lora": lora,
                      "off_policy": off_policy})  # fmt: skip

    def __post_init__(self) -> None:
        if self.nonfinite not in ("stop", "skip"):
            raise ValueError(f"actor.nonfinite={self.nonfinite!r}: pick stop or skip")
        if isinstance(self.off_policy, dict):  # built directly with a plain section
            object.__setattr__(self, "off_policy", OffPolicyOptions.from_value(self.off_policy))

    @property
    def mini(self) -> int | None:
        """Responses per optimizer step; ``None``: the whole step (streamed)."""
        return self.mini_batch_size or None

    @property
    def micro(self) -> int | None:
        """Responses per forward; ``None``: the whole mini-batch."""
        return self.micro_batch_size or None

    @property
    def parallel(self) -> dict[str, int]:
        """The engine's model-parallel sizes."""
        return {
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
        }

    def engine_check(self, dist: dict | None, model: dict) -> dict:
        """What the engine's ``check`` reads (``data_parallel`` counts once launched with a
        process group)."""
        return {
            "data_parallel": self.data_parallel and dist, "mini_batch_size": self.mini_batch_size,
            "engine": self.engine, "model": model, "kl_coef": self.kl_coef, **self.parallel,
            "lora": self.lora,
        }  # fmt: skip

    @property
    def engine_kwargs(self) -> dict:
        """The engine's own keyword arguments: its parallel sizes, and ``lora`` when on (an
        engine without LoRA support never sees the key; its ``check`` refuses it)."""
        return {**self.parallel, **({"lora": self.lora} if self.lora.enabled else {})}

    def optim(self, compute_dtype: torch.dtype) -> dict:
        """The engine's ``optim``: AdamW, clipping, the sampling temperature, the shared prefix,
        ``kl_coef`` (> 0: the engine keeps a frozen reference), ``nonfinite``, the compute
        dtype (:meth:`~..engines.base.ModelEngine._setup`)."""
        keys = ("lr", "betas", "weight_decay", "grad_clip", "temperature", "kl_coef",
                "shared_prefix", "nonfinite")  # fmt: skip
        return {k: getattr(self, k) for k in keys} | {"compute_dtype": compute_dtype}

    @property
    def loss_settings(self) -> dict:
        """The policy loss's settings (:func:`~..algos.losses.make_loss`); ``off_policy`` only
        with a correction on."""
        off = {"off_policy": self.off_policy.settings} if self.off_policy.enabled else {}
        return {"clip_eps_low": self.clip_eps_low, "clip_eps_high": self.clip_eps_high,
                "kl_coef": self.kl_coef, **off}  # fmt: skip


@dataclass
class ReferenceOptions:
    """The reference's options: the PPO workflow's ``reference`` section, passed whole to
    :class:`~.reference.ReferenceWorker`."""

    micro_batch_size: int = 0  # responses per forward; 0 = a whole chunk
    threads: int = 0  # torch threads; 0 = the CPUs of the model's devices
    engine: str = "torch"  # a logprob engine: torch, or module:Class (docs/concepts/engines.md)
