"""Config sections and helpers shared by the LLM workflows (GRPO, PPO).

Runner-level sections (cluster, trainer, checkpoints) are in :mod:`m2flow.run.recipe`; these are
the LLM ones: the reasoning-gym task, the tiny model, the supervised warm start, rollout
sampling, the optimiser settings every trained model shares. The ``data`` section is
:class:`~m2flow.workers.data.config.DataConfig`, the ``reward`` section
:class:`~m2flow.workers.reward.config.RewardConfig`, the ``rollout`` section
:class:`~m2flow.workers.rollout.config.RolloutOptions`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from m2flow.core.config import ConfigError
from m2flow.run.recipe import (
    TrainerConfig,
    finite_positive,
    options,
    plain,
    require,
    staleness_bound,
)

from .data.config import check_data, from_files, prompt_limit
from .data.reasoning_gym import task_config
from .llm.config import DTYPES, default_max_new_tokens
from .llm.config import ModelConfig as LMShape
from .llm.tokenizer import tokenizer_spec
from .reward.config import check_reward
from .rollout.config import RolloutOptions


@dataclass
class TaskConfig:  # the reasoning-gym source: used without data.train_files
    name: str = (
        "chain_sum"  # any reasoning-gym dataset (other than chain_sum: model.tokenizer=qwen2)
    )
    # the generator's keyword arguments, over data.reasoning_gym.TASK_DEFAULTS[name] (any
    # key, e.g. task.config.max_digits=3; see task_config)
    config: dict[str, Any] = field(default_factory=dict)
    train_seed: int = 1  # generator seed of the training split
    train_size: int = 20000  # prompts in the training split
    val_seed: int = 2  # warm start stops on this split, never on the held-out one
    val_size: int = 300  # prompts in the warm start's validation split
    heldout_seed: int = 3  # generator seed of the held-out split (evaluation)
    heldout_size: int = 500  # greedy accuracy = share of items with score == 1
    # Chat-template tokenizers (model.tokenizer=qwen2): the system turn; a reasoning-gym
    # SYSTEM_PROMPTS name (default, direct, simple, ...), "" for none, or the text itself.
    system_prompt: str = "direct"


@dataclass
class ModelConfig(LMShape):  # path (a Hugging Face directory) or a tiny Qwen2's shape, dtype
    # None: the tokenizer files of model.path (pretrained), else char. char: one token per
    # character of model.alphabet (+ pad/eos/bos/unk), compact prompts; qwen2: Qwen2's BPE
    # and chat template, any reasoning-gym task (docs/results/tokenizers.md)
    tokenizer: Optional[str] = None
    alphabet: str = "0123456789+-="  # the char tokenizer's characters
    # the char tokenizer with chat tokens and template (<|user|>..<|end|>, <tool_call>; agent
    # examples on CPU); qwen2 and pretrained tokenizers carry their own template
    chat_template: bool = False


@dataclass
class WarmStartConfig:
    # None: on for a random-weight model, off for a pretrained one (model.path)
    enabled: Optional[bool] = None
    steps: int = 2000  # supervised steps at most
    batch_size: int = 256  # samples per step
    lr: float = 3e-3  # AdamW learning rate of the supervised steps
    # Stop early on purpose: an uncertain policy gives GRPO groups with mixed rewards.
    target_accuracy: Optional[float] = 0.15  # greedy accuracy on the val split
    eval_every: int = 10  # supervised steps between validation checks
    time_budget_s: Optional[float] = 360.0  # stop after this many seconds; None: no limit


@dataclass
class OptimConfig:
    """What every trained model's optimiser shares (AdamW, clipping, batch split)."""

    lr: float = 1e-4  # AdamW learning rate
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW (beta1, beta2)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # global gradient-norm clip per optimizer step
    mini_batch_size: int = 0  # responses per optimizer step; 0 = the whole global batch
    micro_batch_size: int = 0  # responses per forward/backward; 0 = the whole mini-batch
    threads: int = 0  # torch threads; 0 = the CPUs of the model's devices
    nonfinite: str = "stop"  # NaN/inf advantage, loss or grad norm: stop the run, or skip the step


@dataclass
class LoraConfig:
    """``actor.lora``: LoRA on the policy (PEFT on the torch engine; Hu et al. 2021), read as
    :class:`~m2flow.workers.engines.lora.LoraOptions`."""

    rank: int = 0  # adapter rank r; 0 = off (full fine-tuning)
    alpha: float = 16.0  # the update is (alpha / rank) * B A
    dropout: float = 0.0  # dropout on the adapter's input (> 0: stochastic training forwards)
    # linear modules adapted, by name (q_proj, v_proj, ...), or all-linear (all but the LM head)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])


def validate_lora(section, engine: str, name: str = "actor") -> None:
    """Raises ConfigError for bad ``<name>.lora`` values, or LoRA on a train engine that has
    none (:func:`~m2flow.workers.engines.lora.check_lora`: the Megatron engine)."""
    from .engines.lora import check_lora

    try:
        check_lora(engine, plain(section), name)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class OffPolicyConfig:
    """``actor.off_policy``: the policy loss's off-policy correction (docs/concepts/engines.md),
    read as :class:`~m2flow.workers.actor.config.OffPolicyOptions`."""

    correction: str = "none"  # none | tis | mis | decoupled
    clip: float = 2.0  # C: tis truncates at C; mis keeps [1/C, C]; decoupled drops > C (0: none)
    level: str = "token"  # token | sequence (a weight per response: product of token ratios)
    low: Optional[float] = None  # mis's lower bound (None: 1/clip)
    high: Optional[float] = None  # mis's upper bound (None: clip)
    allow_uncorrected: bool = False  # asynchronous training without a correction
    # drop samples whose oldest token lags more than this many versions (null: keep all; set
    # to K by trainer.staleness_policy=drop)
    max_lag: Optional[int] = None


def validate_off_policy(section) -> None:
    """Raises ConfigError for bad ``actor.off_policy`` values (naming the key)."""
    from .actor.config import OffPolicyOptions

    OffPolicyOptions.from_value(plain(section))


def validate_staleness(cfg, off_policy=None, runner: str = "", corrections: bool = True) -> None:
    """Refuse contradictory asynchronous-training settings before anything starts (issue 32
    item 5): ``trainer.max_staleness`` not an integer >= 0 or ``auto``; K >= 1 (or ``auto``,
    which may choose it) without an off-policy correction unless
    ``actor.off_policy.allow_uncorrected``; ``rollout.partial=true`` with K = 0; K >= 1 with the
    spot pool (its manager, RLBoost Algorithm 1, plans one step at a time); in a runner
    without corrections (``corrections=False``: PPO) any ``correction`` but ``none``, K >= 1
    without ``allow_uncorrected``, and ``trainer.staleness_policy=drop``; without an
    ``off_policy`` section at all (``None``) any K >= 1.

    Raises:
        ConfigError: naming the keys and the fix.
    """
    k = staleness_bound(cfg.trainer.max_staleness)
    partial = cfg.rollout.partial
    if partial not in (None, True, False):
        raise ConfigError(f"rollout.partial={partial!r}: true, false, or unset (on when K >= 1)")
    if k == 0:
        if partial:
            raise ConfigError(
                "rollout.partial=true with trainer.max_staleness=0: partial rollouts continue "
                "sequences across weight updates, and an on-policy run updates no weights "
                "during rollout; set trainer.max_staleness>=1 or leave rollout.partial unset"
            )
        return
    what = f"trainer.max_staleness={k}" + (" (may choose K >= 1)" if k == "auto" else "")
    if off_policy is None:
        raise ConfigError(
            f"{what}: the {runner or 'runner'}'s actor has no off-policy correction "
            "(actor.off_policy is GRPO's); run it with trainer.max_staleness=0"
        )
    if not corrections:
        if not off_policy.allow_uncorrected:
            raise ConfigError(
                f"{what}: the {runner}'s actor has no off-policy correction; set "
                "actor.off_policy.allow_uncorrected=true to train it asynchronously anyway "
                "(its clipped ratio is then taken against the behaviour policy's logprobs), "
                "or run with trainer.max_staleness=0"
            )
        if cfg.trainer.staleness_policy == "drop":
            raise ConfigError(
                f"trainer.staleness_policy=drop: the {runner}'s actor drops no samples; use "
                "trainer.staleness_policy=wait"
            )
    elif off_policy.correction == "none" and not off_policy.allow_uncorrected:
        raise ConfigError(
            f"{what} with actor.off_policy.correction=none: stale tokens would be trained "
            "as if on-policy; set actor.off_policy.correction=tis (or mis, decoupled), or "
            "actor.off_policy.allow_uncorrected=true to do it anyway"
        )
    if cfg.rollout.spot.enabled:
        raise ConfigError(
            f"{what} with rollout.spot.enabled: the spot pool's manager (RLBoost Algorithm 1) "
            "plans one step at a time; use trainer.max_staleness=0 with the spot pool"
        )


@dataclass
class LLMTrainerConfig(TrainerConfig):
    prompts_per_step: int = 32  # global batch: prompts (x rollout.n_samples responses)


def model_section(cfg) -> dict:
    """``plain(cfg.model)`` with ``path`` made absolute: workers load it from their own
    working directory."""
    model = plain(cfg.model)
    if model.get("path"):
        model["path"] = os.path.abspath(os.path.expanduser(model["path"]))
    return model


def rollout_options(cfg) -> tuple[RolloutOptions, str]:
    """The ``rollout`` section as :class:`~.rollout.config.RolloutOptions` (the rollout role's,
    passed whole) with ``max_new_tokens`` resolved (:func:`~.llm.config.default_max_new_tokens`
    when unset), and a console note saying where an unset one came from when the run brings its
    own model (``model.path``) or data files; ``""`` otherwise (set by the user, or the built-in
    model on its own task)."""
    opts = options(cfg.rollout)
    if opts.max_new_tokens is not None:
        return opts, ""
    opts.max_new_tokens, why = default_max_new_tokens(plain(cfg.model))
    if not (cfg.model.path or from_files(cfg)):
        return opts, ""
    return opts, (
        f"rollout.max_new_tokens: {opts.max_new_tokens} ({why}); set "
        "rollout.max_new_tokens=N to change it"
    )


def warm_start_args(cfg, source: str) -> tuple[dict, str]:
    """The actor's ``warm_start`` keyword arguments and, when there is no warm start, why
    (``""`` when there is one; then ``steps`` is 0 and the runner passes no task).

    ``warm_start.enabled`` decides; unset (None), the warm start runs for a random-weight model
    on reasoning-gym prompts, not for a pretrained ``model.path`` (it starts from its own
    weights). Data files never have one (no warm-start targets).
    """
    args = plain(cfg.warm_start)
    enabled = args.pop("enabled")
    why = ""
    if source != "reasoning_gym":
        why = "data files have no warm-start targets"
    elif enabled is False:
        why = "warm_start.enabled=false"
    elif enabled is None and cfg.model.path:
        why = "a pretrained model.path starts from its own weights"
    if why:
        args["steps"] = 0
    return args, why


def validate_model(m) -> None:
    """The ``model`` section before anything starts: ``model.path`` is a Hugging Face causal-LM
    directory whose config sizes are sane and agree with its weights' headers
    (:func:`~.llm.model_dir.check_model_directory`), with tokenizer files that load (unless
    another tokenizer is named); ``model.dtype`` is known.

    Raises:
        ConfigError: the first problem, named with its fix.
    """
    require([(m.dtype in DTYPES, f"model.dtype={m.dtype!r}: pick one of {', '.join(DTYPES)}")])
    try:
        spec = tokenizer_spec(plain(m))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not m.path:  # a model built from the shape: the shape must be one
        h, nh, kv = m.hidden_size, m.num_attention_heads, m.num_key_value_heads
        require(
            [
                (h >= 1 and m.intermediate_size >= 1, "model.hidden_size and "
                 "model.intermediate_size must be >= 1"),
                (m.num_hidden_layers >= 1, "model.num_hidden_layers must be >= 1"),
                (nh >= 1 and h % nh == 0, f"model.num_attention_heads={nh} must be >= 1 and "
                 f"divide model.hidden_size={h}"),
                (kv >= 1 and nh % kv == 0, f"model.num_key_value_heads={kv} must be >= 1 and "
                 f"divide model.num_attention_heads={nh}"),
                (m.max_position_embeddings >= 2, "model.max_position_embeddings must be >= 2"),
            ]
        )  # fmt: skip
        return
    from .llm.model_dir import check_model_directory

    try:
        check_model_directory(m.path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if spec["name"] == "pretrained":
        from .llm.tokenizer import build_pretrained_tokenizer

        try:
            build_pretrained_tokenizer(m.path)
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None


def validate_llm(cfg, min_samples: int = 1, drives_blocks: bool = False) -> None:
    """Value checks of the shared LLM sections (``data``, ``task``, ``rollout``,
    ``warm_start``, ``reward``, the ``prompts_per_step``) before anything starts.
    ``drives_blocks``: the runner's rollout role steps block engines itself (the agent
    loop), so ``rollout.engine=exact|emulated`` is its own.

    Raises:
        ConfigError: the first bad value, named.
    """
    r, w = cfg.rollout, cfg.warm_start
    why = " (GRPO compares a group)" if min_samples > 1 else ""
    require(
        [
            (cfg.trainer.prompts_per_step >= 1, "trainer.prompts_per_step must be >= 1"),
            (r.n_samples >= min_samples, f"rollout.n_samples must be >= {min_samples}{why}"),
            (finite_positive(r.temperature), "rollout.temperature must be a finite number > 0"),
            (0 < r.top_p <= 1, "rollout.top_p must be in (0, 1]"),
            (
                r.max_new_tokens is None or r.max_new_tokens >= 1,
                "rollout.max_new_tokens must be >= 1 (or unset: from the model)",
            ),
            (finite_positive(w.lr), "warm_start.lr must be a finite number > 0"),
            (w.steps >= 0 and w.batch_size >= 1, "warm_start.steps >= 0, batch_size >= 1"),
            (w.eval_every >= 1, "warm_start.eval_every must be >= 1"),
        ]
    )
    validate_model(cfg.model)
    check_engine("rollout", cfg, "rollout", drives_blocks)  # rollout.spot: the pool's check
    from .llm.tokenizer import TOKENIZERS

    require(
        [
            (
                tokenizer_spec(plain(cfg.model))["name"] in TOKENIZERS,
                f"model.tokenizer must be one of {', '.join(TOKENIZERS)}",
            )
        ]
    )
    check_data(cfg)
    check_reward(cfg.reward)
    if not from_files(cfg):
        check_task(cfg)


def check_task(cfg, sample: int = 64) -> None:
    """The task against the tokenizer, before any worker starts: ``task.name`` is a
    reasoning-gym dataset, the first ``sample`` training items encode (the char tokenizer:
    every character in ``model.alphabet``) and fit :func:`prompt_limit` (unless
    ``data.overlong_prompts=drop``; the driver checks every item again when it builds the
    splits, before any worker starts: :func:`~m2flow.workers.data.splits.run_data`).

    Raises:
        ConfigError: an unknown task, a bad ``task.config``, an item the tokenizer cannot
            encode, or a prompt over the limit (each message names the fix).
    """
    m, t = cfg.model, cfg.task
    spec = tokenizer_spec(plain(m))
    config = task_config(t.name, plain(t.config))
    limit = prompt_limit(cfg) if cfg.data.overlong_prompts == "error" else 0
    require([(t.train_size >= 1, "task.train_size must be >= 1")])
    import reasoning_gym

    if t.name not in reasoning_gym.factory.DATASETS:
        raise ConfigError(
            f"task.name={t.name!r} is not a reasoning-gym dataset (e.g. chain_sum, "
            "basic_arithmetic, leg_counting; reasoning_gym.factory.DATASETS lists them)"
        )
    from .tasks import TaskDataset, compact_prompt

    size = min(sample, t.train_size)
    if spec["name"] == "char":  # no transformers import: each character is one token
        try:
            ds = reasoning_gym.create_dataset(t.name, seed=t.train_seed, size=size, **config)
            entries = [ds[i] for i in range(size)]
        except Exception as e:
            raise ConfigError(f"task.config for {t.name}: {type(e).__name__}: {e}") from None
        alphabet = set(m.alphabet)
        for i, e in enumerate(entries):
            prompt = compact_prompt(e, t.name)
            bad = sorted(set(prompt + str(e["answer"])) - alphabet)
            if bad:
                raise ConfigError(
                    f"task.name={t.name}: item {i} has characters outside model.alphabet "
                    f"({''.join(bad)[:40]!r}; prompt {prompt[:60]!r}): use "
                    "model.tokenizer=qwen2 (any reasoning-gym task), or add them to "
                    "model.alphabet"
                )
            if limit and len(prompt) + 1 > limit:  # + <bos>
                raise ConfigError(
                    f"task.name={t.name}: item {i}'s prompt is {len(prompt) + 1} tokens > "
                    f"{limit} (data.max_prompt_tokens, or model.max_position_embeddings - "
                    "rollout.max_new_tokens): raise them, or set data.overlong_prompts=drop"
                )
        return
    from .llm.tokenizer import build_tokenizer

    tok = build_tokenizer(spec)
    try:
        TaskDataset(t.name, config, seed=t.train_seed, size=size)
    except Exception as e:
        raise ConfigError(f"task.config for {t.name}: {type(e).__name__}: {e}") from None
    TaskDataset(t.name, config, t.train_seed, size, tok, t.system_prompt, limit)


def check_engine(kind: str, cfg, name: str, drives_blocks: bool = False) -> None:
    """Ask the engine section ``name`` of ``cfg`` names (its ``engine`` key, a backend of
    ``kind`` or an import path) whether it runs that section with the run's ``model``: its
    ``check`` classmethod (:func:`~.engines.registry.check_engine`; the rollout role's:
    :func:`~.rollout.engines.check_rollout`, which also picks the spot pool). The ranks are not
    known yet (the plan places them at launch, where the engine is asked again).
    ``drives_blocks``: the rollout role steps a block engine itself (as with ``partial``).

    Raises:
        ConfigError: an unknown engine, a class missing protocol methods, or a setting the
            engine refuses (its message, naming the setting and the fix).
    """
    from .engines.registry import EngineProtocolError
    from .engines.registry import check_engine as ask

    section = plain(getattr(cfg, name))
    config = {**section, "model": model_section(cfg)}
    try:
        if kind == "rollout":
            from .rollout.engines import check_rollout

            if config.get("partial") is None:  # unset: on when the run trains asynchronously
                k = staleness_bound(cfg.trainer.max_staleness)
                config["partial"] = k == "auto" or k >= 1
            config["partial"] = config["partial"] or drives_blocks
            check_rollout(config, None, name)
        else:
            ask(kind, section["engine"], config, None, name)
    except (ValueError, EngineProtocolError) as e:
        raise ConfigError(str(e)) from None


def validate_optim(section, name: str) -> None:
    """Raises ConfigError for a non-finite or non-positive learning rate, negative batch
    sizes or a non-positive clip of the optimiser section ``name``."""
    require(
        [
            (finite_positive(section.lr), f"{name}.lr must be a finite number > 0"),
            (section.mini_batch_size >= 0, f"{name}.mini_batch_size must be >= 0 (0 = all)"),
            (section.micro_batch_size >= 0, f"{name}.micro_batch_size must be >= 0 (0 = all)"),
            (section.grad_clip > 0, f"{name}.grad_clip must be > 0"),
            (
                section.nonfinite in ("stop", "skip"),
                f"{name}.nonfinite={section.nonfinite}: pick stop or skip",
            ),
        ]
    )


def response_length(rollout_outs: list[dict]) -> float:
    """Mean response length (tokens) over every rollout rank's samples.

    Args:
        rollout_outs: ``RolloutWorker.generate``'s returns, one per rank (``samples``,
            ``response_length``).

    Which prompts a rank takes from the channel is a race, so one rank's mean is not a
    step's metric: weight each rank's mean by its sample count.
    """
    samples = sum(o["samples"] for o in rollout_outs)
    return sum(o["response_length"] * o["samples"] for o in rollout_outs) / max(samples, 1)
