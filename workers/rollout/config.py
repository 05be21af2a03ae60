"""The rollout role's options: the LLM workflows' ``rollout`` section, typed once here (defaults
included) and passed whole to :class:`~.worker.RolloutWorker`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from .spot.config import SpotPoolConfig


@dataclass
class RolloutOptions:
    """Sampling (GRPO groups of ``n_samples`` responses per prompt), the engine and the spot
    pool, checked by the workflow's ``validate`` and, at launch, by the engine's ``check``
    (:func:`~.engines.check_rollout`). The run's seed, the held-out prompts and the reward
    function are the role's own arguments (not of this section). A ``spot`` given as a dict
    (a direct launch) is converted to :class:`~.spot.config.SpotPoolConfig`."""

    n_samples: int = 16  # GRPO group size (responses per prompt)
    # Response cap in tokens (EOS included). None: 6 for the built-in model; with model.path
    # the max_new_tokens of its generation_config.json, else half its context (at most 1024),
    # said on the console.
    max_new_tokens: Optional[int] = None
    temperature: float = 0.7  # 1.0 samples too far from the greedy policy to learn from
    top_p: float = 1.0  # nucleus sampling: smallest token set of this probability; 1 = off
    shared_prefix: bool = True  # prefill each prompt once per group, not once per sample
    threads: int = 0  # torch threads; 0 = the rank's share of its node's CPUs
    # a registered rollout backend: hf (transformers generate) or vllm (vLLM's CPU build in
    # process: the vllm extra, docs/results/vllm.md), or an import path, module:Class
    engine: str = "hf"
    # partial rollouts (issue 32 item 2): weight updates reach the engines during generation,
    # between decode steps, and the sequences continue with the new weights. None: on when
    # trainer.max_staleness >= 1 (m2flow.run.pipeline); true needs max_staleness >= 1. With
    # a block engine (engine=exact|emulated, no spot pool) each rank also batches
    # continuously across steps (workers/rollout/continuous.py): freed slots (at most
    # spot.max_batch sequences, blocks of spot.block_tokens) take the next steps' queued
    # prompts; exact keeps no KV cache, emulated drops its modelled one at each update. With
    # hf or vllm (whole-group engines): in-flight weight updates only (KV cache recomputed).
    partial: Optional[bool] = None
    # the RLBoost spot rollout pool (docs/how-to/spot.md)
    spot: SpotPoolConfig = field(default_factory=SpotPoolConfig)

    def __post_init__(self) -> None:
        if isinstance(self.spot, dict):  # a direct launch's rollout.spot fields
            self.spot = SpotPoolConfig(**self.spot)

    def engine_check(self, model: dict) -> dict:
        """What the engines' ``check`` reads (:func:`~.engines.check_rollout`): these options
        as a dict (``spot`` too) and the run's ``model``."""
        return {**asdict(self), "model": model}
