"""The :class:`RolloutEngine` protocol: what the rollout role and the spot pool's instances
ask of the engine that samples responses.

Kinds (``rollout.engine``, ``rollout.spot.engine``), chosen by name from
:data:`~m2flow.workers.rollout.engines.ROLLOUT_ENGINES`: ``hf`` (the decode loop of
:mod:`~m2flow.workers.llm.generation`), ``vllm`` (in-process vLLM), ``exact`` (block-wise
continuation with the same tokens as ``hf``), ``emulated`` (modelled time, no model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RolloutEngine(Protocol):
    """One rank's sampler. An engine implements what its uses need: ``generate`` (whole
    GRPO groups), ``step`` (block-wise streaming: the spot pool), or both.

    Built by its registry entry as ``build(args, model, tokenizer)``: ``args`` the sampling
    settings (``temperature``, ``top_p``, ``seed``, ``min_new_tokens``, and the kind's own:
    ``batch_rows``, ``max_num_seqs``, ``dtype``, ``emulated``, ...), ``model`` the host's Hugging
    Face model (``None`` for a kind whose entry has ``needs_model = False``).
    """

    #: the Hugging Face module it samples with (shared with the host, which loads weights into
    #: it), or ``None`` for an engine with its own copy (vLLM) or none (emulated)
    model: torch.nn.Module | None

    def generate(
        self, prompt_ids: list[list[int]], n_samples: int, max_new_tokens: int,
        sample_keys: list[tuple[int, int]],
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """``n_samples`` responses per prompt, as :func:`~m2flow.workers.llm.generation.
        generate` returns them (``[num_prompts * n_samples, ...]``)."""

    def step(self, requests: list, tokens: int, version: int, label: str = "") -> int:
        """Up to ``tokens`` more tokens for every unfinished request
        (:class:`~m2flow.workers.rollout.exact.GenRequest`); returns the tokens made."""

    def load_weights(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> None:
        """Take new weights (Hugging Face ``state_dict``; ``None`` where the engine models the
        transfer instead)."""

    def sleep(self) -> bool:
        """Release device memory (returns whether it did)."""

    def wake_up(self) -> bool: ...
