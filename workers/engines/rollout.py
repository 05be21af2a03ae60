"""The :class:`RolloutEngine` protocol: what the rollout role and the spot pool's instances
ask of the engine that samples responses.

Backends (``rollout.engine``, ``rollout.spot.engine``), chosen by name from kind ``rollout`` of
the engine registry (:mod:`.registry`): ``hf`` (the decode loop of
:mod:`~m2flow.workers.llm.generation`), ``vllm`` (in-process vLLM), ``exact`` (block-wise
continuation with the same tokens as ``hf``), ``emulated`` (modelled time, no model), and
``spot``, the spot rollout pool composed over one of them (``rollout.spot.enabled``).

Every engine pauses, resumes and takes new weights **between decode steps**
(:class:`~m2flow.workers.llm.gate.DecodeGate`), from another thread while a ``generate`` or
``step`` call runs: the call stops at its next decode-step boundary, keeps its sequences, and
continues them after :meth:`~RolloutEngine.resume` with the weights loaded meanwhile. Every
token carries the weight version that sampled it (``versions``: a ``[B, R]`` tensor in a
generation output, a list per :class:`~m2flow.workers.rollout.exact.GenRequest`) next to its
behaviour logprob. What that needs of the KV cache -- computed with the old weights, hence
stale -- each engine says in its docstring: ``hf``, ``vllm`` and ``emulated`` recompute it,
``exact`` keeps none. This is what asynchronous partial rollouts and the spot pool's
pull-based weights (RLBoost section 4.3) both ask of an engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol, runtime_checkable

import torch


@runtime_checkable
class RolloutEngine(Protocol):
    """One rank's sampler. An engine implements what its uses need: ``generate`` (whole
    GRPO groups), ``step`` (block-wise streaming: the spot pool), or both; and all of the
    control methods.

    Built by :meth:`build` (a classmethod). What it can do is declared by class attributes:
    ``needs_model`` (the host builds a Hugging Face model for it), ``generates`` (it samples
    whole GRPO groups, as the rollout role needs: then ``generate`` is required) and ``steps``
    (it continues :class:`~m2flow.workers.rollout.exact.GenRequest` s block by block, as the
    spot pool needs: then ``step`` is required); the registry checks those methods.

    Optional members a role reads when present: ``stream(...)`` (whole groups as they finish,
    as :meth:`generate` outputs over subsets of the prompts), ``whole_share`` (``True``: the
    engine balances a rank's whole share of a step itself and takes it in one call, as the
    spot pool does), ``last_metrics()`` (a dict of the last call's counters).
    """

    #: the host builds a Hugging Face model for it
    needs_model: ClassVar[bool]
    #: it samples whole groups (:meth:`generate`)
    generates: ClassVar[bool]
    #: it continues requests block by block (:meth:`step`)
    block_steps: ClassVar[bool]
    #: the Hugging Face module it samples with (shared with the host, which loads weights into
    #: it), or ``None`` for an engine with its own copy (vLLM) or none (emulated)
    model: torch.nn.Module | None

    @classmethod
    def build(cls, args: dict, model, tokenizer) -> RolloutEngine:
        """The engine from the role's arguments: ``args`` the sampling settings
        (``temperature``, ``top_p``, ``seed``, ``min_new_tokens``, and the backend's own:
        ``batch_rows``, ``max_num_seqs``, ``dtype``, ``emulated``, ...), ``model`` the host's
        Hugging Face model (``None`` unless ``needs_model``), ``tokenizer`` the host's."""

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "rollout") -> None:
        """Refuse a configuration (the ``rollout`` section as a dict, ``model`` included)
        before any process starts; ``ValueError`` naming the setting and the fix."""

    @property
    def version(self) -> int:
        """The weight version the next decode step computes with (-1: none loaded)."""

    def generate(
        self, prompt_ids: list[list[int]], n_samples: int, max_new_tokens: int,
        sample_keys: list[tuple[int, int]],
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """``n_samples`` responses per prompt, as :func:`~m2flow.workers.llm.generation.
        generate` returns them (``[num_prompts * n_samples, ...]``, ``versions`` included)."""

    def step(self, requests: list, tokens: int, version: int | None = None, label: str = "") -> int:
        """Up to ``tokens`` more tokens for every unfinished request
        (:class:`~m2flow.workers.rollout.exact.GenRequest`); returns the tokens made.
        ``version`` declares the version of the weights the engine holds (``None``: its
        :attr:`version`)."""

    def update_weights(self, version: int, weights: Mapping[str, torch.Tensor] | None) -> None:
        """Take weights of ``version`` at the next decode-step boundary (waiting for the step
        in flight; paused or not): a Hugging Face ``state_dict``, or ``None`` where the engine
        models the transfer (emulated) or the weights are in its ``model`` already."""

    def pause(self) -> None:
        """Stop the call in flight at its next decode-step boundary; returns once there. No
        decode step runs until :meth:`resume`."""

    def resume(self) -> None:
        """Continue the paused call's sequences (with the weights loaded meanwhile)."""

    def sleep(self) -> bool:
        """Release device memory (returns whether it did)."""

    def wake_up(self) -> bool: ...
