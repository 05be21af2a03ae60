"""Rollout engines by name: the one chain through which the rollout role and the spot pool's
instances build theirs (:class:`~m2flow.workers.engines.rollout.RolloutEngine`).

An entry is ``build(args, model, tokenizer) -> engine`` with attributes ``needs_model`` (the
host builds a Hugging Face model for it), ``generates`` (it samples whole GRPO groups, as the
rollout role needs) and ``steps`` (it continues :class:`~.exact.GenRequest` s block by block,
as the spot pool needs). A new kind is one module that registers its entry
(``ROLLOUT_ENGINES.register("sglang", build)``, then set those attributes), or its import path
``"package.module:build"``.

``spot`` is an engine composed over another: with ``rollout.spot.enabled`` the role's engine is
the spot rollout pool (:class:`~.spot.pool.SpotPoolEngine`), which continues blocks with the
configured engine when that one steps (``vllm``), else with ``rollout.spot.engine`` (``exact``
or ``emulated``); :func:`build_rollout_engine` makes that choice.
"""

from __future__ import annotations

from collections.abc import Callable

from ..engines.lora import apply_payload
from ..engines.registry import Registry
from ..llm.gate import PAUSE_TIMEOUT_S, DecodeGate
from ..llm.generation import generate, stop_token_ids
from .emulated import EmulatedEngine
from .exact import ExactEngine

ROLLOUT_ENGINES = Registry("rollout", {"spot": "m2flow.workers.rollout.spot.pool:build_spot_pool"})


def _entry(name: str, *, needs_model: bool, generates: bool, steps: bool) -> Callable:
    """Register a builder under ``name`` with what it needs and can do (module docstring)."""

    def register(build: Callable) -> Callable:
        build.needs_model, build.generates, build.steps = needs_model, generates, steps
        return ROLLOUT_ENGINES.register(name, build)

    return register


class HfEngine:
    """Whole GRPO groups from the host's Hugging Face model (:func:`~..llm.generation.generate`,
    KV cache): the host's model, so the host's weight loads are the engine's.

    Pause, resume and weight updates act between decode steps (:class:`~..llm.gate.DecodeGate`);
    after an update the KV cache is **recomputed** with the new weights (one forward over the
    prompts and the tokens so far), not kept: a cache computed with the old weights would give
    the next tokens logprobs of neither version, and every token must carry the version that
    sampled it and its behaviour logprob under that version (what the off-policy corrections
    read). The cost is one prefill of the sequences per update. (The field differs: vLLM's
    ``pause_generation(clear_cache=False)`` and PipelineRL keep the stale cache; AReaL's
    interruptible rollout, veRL's fully asynchronous partial rollout and slime recompute.)
    """

    def __init__(self, model, tokenizer, args: dict) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.seed = args["temperature"], args["top_p"], args["seed"]
        self.shared_prefix = args.get("shared_prefix", True)
        timeout = args.get("pause_timeout_s", PAUSE_TIMEOUT_S)
        self.gate = DecodeGate(args.get("version", -1), timeout)

    @property
    def version(self) -> int:
        return self.gate.version

    def generate(self, prompt_ids, n_samples, max_new_tokens, sample_keys) -> dict:
        return generate(
            self.model, self.tokenizer, prompt_ids, n_samples=n_samples,
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            shared_prefix=self.shared_prefix, sample_keys=sample_keys, seed=self.seed,
            gate=self.gate,
        )  # fmt: skip

    #: takes a LoRA adapter alone (:func:`~..engines.lora.apply_payload`)
    applies_adapter = True

    def update_weights(self, version: int, weights=None) -> None:
        """Load ``weights`` (a ``state_dict``, or a LoRA adapter payload merged into the model,
        :mod:`~..engines.lora`; ``None``: already in the shared model) between decode steps."""
        apply = None if weights is None else (lambda: apply_payload(self.model, weights))
        self.gate.update(version, apply)

    def pause(self) -> None:
        self.gate.pause()

    def resume(self) -> None:
        self.gate.resume()

    def sleep(self) -> bool:
        return False  # the host's model: the host offloads it

    def wake_up(self) -> bool:
        return False


class HostExactEngine(ExactEngine):
    """:class:`~.exact.ExactEngine` on the host's model (its weight loads are the host's)."""

    def sleep(self) -> bool:
        return False

    def wake_up(self) -> bool:
        return False


@_entry("hf", needs_model=True, generates=True, steps=False)
def build_hf(args: dict, model, tokenizer) -> HfEngine:
    return HfEngine(model, tokenizer, args)


@_entry("exact", needs_model=True, generates=False, steps=True)
def build_exact(args: dict, model, tokenizer) -> HostExactEngine:
    return HostExactEngine(
        model, stop_token_ids(tokenizer, model.generation_config), args["temperature"],
        args["top_p"], args["seed"], args["batch_rows"], args.get("min_new_tokens", 0),
        args.get("decode_delay_s", 0.0), args.get("version", -1),
        args.get("pause_timeout_s", PAUSE_TIMEOUT_S),
    )  # fmt: skip


@_entry("vllm", needs_model=True, generates=True, steps=True)
def build_vllm(args: dict, model, tokenizer):
    """:class:`~.vllm_engine.VllmEngine` loading ``args["model"]["path"]`` in place, or the
    host's model (then its weights come by the first sync or pull)."""
    from .vllm_engine import VllmEngine

    kw = {k: args[k] for k in ("max_num_seqs", "dtype") if k in args}
    engine = VllmEngine(
        args["model"].get("path") or model.cpu(), tokenizer, args["temperature"], args["top_p"],
        seed=args["seed"], min_new_tokens=args.get("min_new_tokens", 0),
        pause_timeout_s=args.get("pause_timeout_s", PAUSE_TIMEOUT_S), **kw,
    )  # fmt: skip
    engine.model = None  # its own copy: the host loads weights into both
    return engine


@_entry("emulated", needs_model=False, generates=False, steps=True)
def build_emulated(args: dict, model, tokenizer) -> EmulatedEngine:
    return EmulatedEngine.from_config(
        args["emulated"], args["eos_id"], args["filler_id"], args["seed"],
        args.get("min_new_tokens", 0),
    )  # fmt: skip


def build_rollout_engine(kind: str, args: dict, model, tokenizer, spot: dict | None = None):
    """The rollout role's engine: ``kind`` from :data:`ROLLOUT_ENGINES`, or, with
    ``spot["enabled"]``, the spot pool (registry entry ``spot``) composed over the engine it
    continues blocks with (module docstring).

    Args:
        kind: ``rollout.engine``: a registered name or ``"package.module:build"``.
        args: the builders' arguments (sampling settings, ``model`` and ``tokenizer`` specs,
            ``rank``, ``world_size``, ...).
        model, tokenizer: the host's Hugging Face model and tokenizer.
        spot: ``rollout.spot`` (:class:`~.spot.config.SpotPoolConfig` fields).

    Raises:
        ValueError: an unknown kind; a kind that does not sample whole groups without the pool;
            ``vllm`` with ``spot.engine=emulated``.
    """
    build = ROLLOUT_ENGINES.get(kind, "rollout")
    if spot and spot.get("enabled"):
        if getattr(build, "steps", False) and spot.get("engine", "exact") != "exact":
            raise ValueError(
                f"rollout.engine={kind!r} with rollout.spot.engine={spot.get('engine')!r}: the "
                "emulated engine models the rollout engine; use rollout.engine=hf with it"
            )
        pool = ROLLOUT_ENGINES.get("spot", "rollout.spot")
        return pool({**args, "engine": kind, "spot": spot}, model, tokenizer)
    if not getattr(build, "generates", False):
        raise ValueError(
            f"rollout.engine={kind!r} continues blocks for the spot pool only "
            f"(rollout.spot.engine): pick an engine that samples whole groups, hf or vllm"
        )
    return build(args, model, tokenizer)
