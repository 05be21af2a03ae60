"""Logprob-only engines: a frozen causal LM that scores given responses, nothing trained.

:class:`LogprobEngine` is the protocol (the PPO reference's engine); :class:`TorchLogprobEngine`
is its ``torch`` backend (kind ``logprob`` in :mod:`.registry`): the model held in its compute
dtype (as the rollout holds it), logprobs by the actor's own function
(:func:`~m2flow.workers.algos.logprobs.sequence_logprobs`: same numerics), micro-batched.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..algos.logprobs import sequence_logprobs
from ..llm import load_model
from ..llm.placement import offload_module, onload_module
from .base import RESPONSE_KEYS


class LogprobEngine(Protocol):
    """What a logprob-only role (the reference) asks of its model."""

    def __init__(
        self, model: dict, tokenizer, *, device: torch.device, temperature: float = 1.0,
        micro_batch_size: int | None = None,
    ) -> None: ...  # fmt: skip

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "reference") -> None:
        """Refuse a configuration (the role's options, ``model`` included) before any process
        starts; ``ValueError`` naming the setting and the fix."""
        ...

    def logprobs(self, batch) -> torch.Tensor:
        """``[B, R]`` float32 logprobs (CPU) of ``batch``'s responses (``prompt_ids``,
        ``prompt_mask`` ``[B, P]``, ``response_ids``, ``response_mask`` ``[B, R]``) under
        ``log_softmax(logits / temperature)``."""
        ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Hugging Face layout weights (``m2flow.sync_weights``, a checkpoint)."""
        ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def offload(self) -> None: ...

    def onload(self) -> None: ...


class TorchLogprobEngine:
    """The frozen Hugging Face model of this rank (see :class:`LogprobEngine`).

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields (held in ``model.dtype``).
        tokenizer: fills a built model's vocabulary size and special ids.
        device: where the weights go.
        temperature: the rollout's sampling temperature.
        micro_batch_size: responses per forward (``None``: the whole batch).
    """

    def __init__(
        self, model: dict, tokenizer, *, device: torch.device, temperature: float = 1.0,
        micro_batch_size: int | None = None,
    ) -> None:  # fmt: skip
        self.device = device
        self.model = load_model(model, tokenizer, device).eval()  # in model.dtype
        self.model.requires_grad_(False)
        self.temperature, self.micro = temperature, micro_batch_size

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "reference") -> None:
        """Nothing to refuse: any model :func:`~m2flow.workers.llm.load_model` builds, any
        number of ranks (each scores its share)."""

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        out = []
        for idx in torch.split(torch.arange(len(batch), device="cpu"), self.micro or len(batch)):
            mb = [batch[k][idx].to(self.device) for k in RESPONSE_KEYS]
            out.append(sequence_logprobs(self.model, *mb, temperature=self.temperature).cpu())
        return torch.cat(out)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def offload(self) -> None:
        offload_module(self.model, self.device)

    def onload(self) -> None:
        onload_module(self.model, self.device)
