"""The built-in rollout engines on the host's model, and the one chain through which the
rollout role and the spot pool's instances build theirs: backends of kind ``rollout`` in the
engine registry (:mod:`~m2flow.workers.engines.registry`), each a class implementing
:class:`~m2flow.workers.engines.rollout.RolloutEngine` (built by its ``build`` classmethod;
``needs_model``, ``generates`` and ``block_steps`` say what it needs and can do). A new backend
is one module with such a class, registered (``register("rollout", "sglang", SglangEngine)``)
or named by its import path ``"package.module:Class"``.

``spot`` is an engine composed over another: with ``rollout.spot.enabled`` the role's engine is
the spot rollout pool (:class:`~.spot.pool.SpotPoolEngine`), which continues blocks with the
configured engine when that one steps (``vllm``), else with ``rollout.spot.engine`` (``exact``
or ``emulated``); :func:`rollout_engine_class` makes that choice and :func:`check_rollout`
refuses a configuration the role cannot run.
"""

from __future__ import annotations

from ..engines.lora import apply_payload
from ..engines.registry import choices, engine_class, knows, names
from ..llm.gate import PAUSE_TIMEOUT_S, DecodeGate
from ..llm.generation import generate, stop_token_ids
from .config import RolloutOptions
from .exact import ExactEngine
from .spot.config import SpotPoolConfig


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

    needs_model, generates, block_steps = True, True, False

    @classmethod
    def build(cls, args: dict, model, tokenizer) -> HfEngine:
        return cls(model, tokenizer, args)

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "rollout") -> None:
        """Nothing to refuse: any model the host builds."""

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
    """:class:`~.exact.ExactEngine` on the host's model (its weight loads are the host's):
    continues blocks for the spot pool (``rollout.spot.engine=exact``)."""

    needs_model, generates, block_steps = True, False, True

    @classmethod
    def build(cls, args: dict, model, tokenizer) -> HostExactEngine:
        return cls(
            model, stop_token_ids(tokenizer, model.generation_config), args["temperature"],
            args["top_p"], args["seed"], args["batch_rows"], args.get("min_new_tokens", 0),
            args.get("decode_delay_s", 0.0), args.get("version", -1),
            args.get("pause_timeout_s", PAUSE_TIMEOUT_S),
        )  # fmt: skip

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "rollout") -> None:
        """Nothing to refuse: any model the host builds."""

    def sleep(self) -> bool:
        return False

    def wake_up(self) -> bool:
        return False


def _groups() -> list[str]:
    """The backends that sample whole groups themselves (the role's choices; ``spot``
    composes over one of them)."""
    return [n for n in names("rollout") if n != "spot" and engine_class("rollout", n).generates]


def rollout_engine_class(
    kind: str, spot: dict | None = None, role: str = "rollout", partial: bool = False
) -> type:
    """The rollout role's engine class: ``kind`` (``rollout.engine``) from the registry, or,
    with ``spot["enabled"]``, the spot pool (backend ``spot``) that composes over it. With
    ``partial`` (``rollout.partial``) a block engine that does not sample whole groups
    (``exact``, ``emulated``) is the role's own: the rank batches continuously across steps
    (:mod:`.continuous`).

    Raises:
        ValueError: an unknown kind; a kind that does not sample whole groups without the pool
            (nor, with ``partial``, continues blocks); an engine that continues blocks itself
            (vllm) with ``spot.engine=emulated``.
        EngineProtocolError: a class missing members of the protocol.
    """
    if not knows("rollout", kind):
        raise ValueError(
            f"{role}.engine={kind!r}: {role}.engine must be {choices('rollout', _groups())}"
        )
    cls = engine_class("rollout", kind, role)
    if spot and spot.get("enabled"):
        # the pool continues with the configured engine: another spot.engine would be ignored
        if cls.block_steps and spot.get("engine", SpotPoolConfig.engine) != SpotPoolConfig.engine:
            stepless = [n for n in _groups() if not engine_class("rollout", n).block_steps]
            raise ValueError(
                f"rollout.spot.engine={spot.get('engine')} models the rollout engine: use it "
                f"with rollout.engine={' or '.join(stepless)} (rollout.engine={kind} runs "
                f"{kind} on the spot instances)"
            )
        return engine_class("rollout", "spot", f"{role}.spot")
    if not cls.generates and not (partial and cls.block_steps):
        raise ValueError(
            f"rollout.engine={kind!r} continues blocks for the spot pool (rollout.spot.engine) "
            f"or with rollout.partial=true only: pick an engine that samples whole groups, "
            f"{choices('rollout', _groups())}"
        )
    return cls


def check_rollout(config: dict, world_size: int | None = None, role: str = "rollout") -> type:
    """Ask the engine whether it runs ``config`` (the ``rollout`` section as a dict, ``model``
    included): :func:`rollout_engine_class`, then the configured engine's ``check`` (and the
    spot pool's with ``spot.enabled``). Returns the class the role builds.

    Raises:
        ValueError: the first problem, naming the setting and the fix.
    """
    kind, spot = config.get("engine", RolloutOptions.engine), config.get("spot")
    cls = rollout_engine_class(kind, spot, role, bool(config.get("partial")))
    engine_class("rollout", kind, role).check(config, world_size, role)
    if cls is not engine_class("rollout", kind, role):
        cls.check(config, world_size, role)
    return cls


def build_rollout_engine(
    kind: str, args: dict, model, tokenizer, spot: dict | None = None, partial: bool = False
):
    """The rollout role's engine (:func:`rollout_engine_class`), built.

    Args:
        kind: ``rollout.engine``: a registered backend or ``"package.module:Class"``.
        args: the engines' arguments (sampling settings, ``model`` and ``tokenizer`` specs,
            ``rank``, ``world_size``, ...).
        model, tokenizer: the host's Hugging Face model and tokenizer.
        spot: ``rollout.spot`` (:class:`~.spot.config.SpotPoolConfig` fields).
        partial: ``rollout.partial`` (a block engine may be the role's own).

    Raises:
        ValueError: as :func:`rollout_engine_class`.
    """
    cls = rollout_engine_class(kind, spot, partial=partial)
    if spot and spot.get("enabled"):
        args = {**args, "engine": kind, "spot": spot}
    return cls.build(args, model, tokenizer)
