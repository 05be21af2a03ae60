"""Rollout engines by name: the one chain through which the rollout role and the spot pool's
instances build theirs (:class:`~m2flow.workers.engines.rollout.RolloutEngine`).

An entry is ``build(args, model, tokenizer) -> engine`` with attributes ``needs_model`` (the
host builds a Hugging Face model for it) and ``generates`` (it samples whole GRPO groups, as
the rollout role needs). A new kind is one module that registers its entry
(``ROLLOUT_ENGINES.register("sglang", build)``), or its import path ``"package.module:build"``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..engines.registry import Registry
from ..llm.generation import generate, stop_token_ids
from .emulated import EmulatedEngine
from .exact import ExactEngine

ROLLOUT_ENGINES = Registry("rollout", {})


class _OnHostModel:
    """An engine sampling from the host's Hugging Face model (``self.model``): a weight load is
    a state-dict load, and there is nothing to sleep."""

    model: torch.nn.Module

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(weights)

    def sleep(self) -> bool:
        return False

    def wake_up(self) -> bool:
        return False


class HfEngine(_OnHostModel):
    """Whole GRPO groups from the Hugging Face model (:func:`~..llm.generation.generate`); the
    host's model, so the host's weight loads are the engine's."""

    def __init__(self, model, tokenizer, args: dict) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.top_p, self.seed = args["temperature"], args["top_p"], args["seed"]
        self.shared_prefix = args.get("shared_prefix", True)

    def generate(self, prompt_ids, n_samples, max_new_tokens, sample_keys) -> dict:
        return generate(
            self.model, self.tokenizer, prompt_ids, n_samples=n_samples,
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
            shared_prefix=self.shared_prefix, sample_keys=sample_keys, seed=self.seed,
        )  # fmt: skip


class HostExactEngine(_OnHostModel, ExactEngine):
    """:class:`~.exact.ExactEngine` on the host's model, taking weight loads into it."""


class PulledEmulatedEngine(EmulatedEngine):
    """:class:`~.emulated.EmulatedEngine` (``step`` only; its ``model`` is the throughput
    model) behind the protocol's ``load_weights``: no bytes arrive, the pull's modelled time
    passes."""

    def load_weights(self, weights, version: int, nbytes: float | None = None) -> float:
        return super().load_weights(version, nbytes)


@ROLLOUT_ENGINES.register("hf")
def build_hf(args: dict, model, tokenizer) -> HfEngine:
    return HfEngine(model, tokenizer, args)


@ROLLOUT_ENGINES.register("exact")
def build_exact(args: dict, model, tokenizer) -> HostExactEngine:
    return HostExactEngine(
        model, stop_token_ids(tokenizer, model.generation_config), args["temperature"],
        args["top_p"], args["seed"], args["batch_rows"], args.get("min_new_tokens", 0),
        args.get("decode_delay_s", 0.0),
    )  # fmt: skip


@ROLLOUT_ENGINES.register("vllm")
def build_vllm(args: dict, model, tokenizer):
    """:class:`~.vllm_engine.VllmEngine` loading ``args["model"]["path"]`` in place, or the
    host's model (then its weights come by the first sync or pull)."""
    from .vllm_engine import VllmEngine

    kw = {k: args[k] for k in ("max_num_seqs", "dtype") if k in args}
    engine = VllmEngine(
        args["model"].get("path") or model.cpu(), tokenizer, args["temperature"], args["top_p"],
        seed=args["seed"], min_new_tokens=args.get("min_new_tokens", 0), **kw,
    )  # fmt: skip
    engine.model = None  # its own copy: the host loads weights into both
    return engine


@ROLLOUT_ENGINES.register("emulated")
def build_emulated(args: dict, model, tokenizer) -> PulledEmulatedEngine:
    return PulledEmulatedEngine.from_config(
        args["emulated"], args["eos_id"], args["filler_id"], args["seed"],
        args.get("min_new_tokens", 0),
    )  # fmt: skip


# needs_model: the host builds a Hugging Face model for it; generates: it samples whole groups
# (the rollout role's engines; the others continue blocks, the spot pool's)
for _build, _needs, _whole in (
    (build_hf, True, True),
    (build_vllm, True, True),
    (build_exact, True, False),
    (build_emulated, False, False),
):
    _build.needs_model, _build.generates = _needs, _whole
