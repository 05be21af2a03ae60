"""Reference worker: the frozen starting policy's logprobs, for the KL penalty of PPO."""

from __future__ import annotations

import torch

from m2flow import Channel, Worker

from ..algos.logprobs import sequence_logprobs
from ..batch import num_tokens
from ..checkpoint import load_state, save_state
from ..engines.trainer import RESPONSE_KEYS
from ..llm import build_tokenizer, load_model
from ..llm.placement import offload_module, onload_module, set_torch_threads, torch_device


class ReferenceWorker(Worker):
    """A frozen copy of the policy (weights arrive once, with :meth:`sync_weights`).

    Inference only, so data parallel: each rank takes its share of the chunks.

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields.
        tokenizer: the tokenizer spec, ``{"name": "char", "alphabet": str}`` or
            ``{"name": "qwen2"}`` (:func:`~m2flow.workers.llm.build_tokenizer`).
        temperature: the rollout's sampling temperature (logprobs of ``logits / T``, as the
            rollout's).
        micro_batch_size: responses per forward (0: a whole chunk).
        threads: torch threads; 0 = this rank's share of its node's CPUs.
    """

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        temperature: float = 1.0,
        micro_batch_size: int = 0,
        threads: int = 0,
    ) -> None:
        set_torch_threads(self, threads)
        self.device = torch_device(self.devices)
        tokenizer = build_tokenizer(tokenizer)
        self.model = load_model(model, tokenizer, self.device).eval()  # in model.dtype
        self.model.requires_grad_(False)
        self.temperature = temperature
        self.micro = micro_batch_size or None

    def load_weights(self, weights: dict, version: int) -> None:
        """The frozen reference: the policy's weights when synced (``m2flow.sync_weights``)."""
        self.model.load_state_dict(weights)

    def logprobs(self, inp: Channel, out: Channel) -> dict:
        """For the step's rollout chunks from ``inp`` (until the rollout's end of step; ranks
        share them), put ``{"ref_logprobs": [B, R]}`` into ``out`` under the chunk's key.

        Returns:
            ``samples`` scored.
        """
        samples = 0
        for (chunk,) in inp.stream():
            batch = chunk.batch
            ref = self._logprobs(batch)
            out.put({"ref_logprobs": ref}, weight=num_tokens(batch), key=chunk.key)
            samples += len(batch)
        return {"samples": samples}

    @torch.no_grad()
    def _logprobs(self, batch) -> torch.Tensor:
        """``[B, R]`` logprobs by the actor's own function (same numerics), micro-batched."""
        out = []
        for idx in torch.split(torch.arange(len(batch), device="cpu"), self.micro or len(batch)):
            mb = [batch[k][idx].to(self.device) for k in RESPONSE_KEYS]
            out.append(sequence_logprobs(self.model, *mb, temperature=self.temperature).cpu())
        return torch.cat(out)

    def save_checkpoint(self, path: str) -> str:
        """The frozen reference weights under ``path``."""
        return save_state(path, self.rank, {"model": self.model.state_dict()})

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        self.model.load_state_dict(load_state(path, self.rank)["model"])

    def offload(self) -> None:
        offload_module(self.model, self.device)

    def onload(self) -> None:
        onload_module(self.model, self.device)
