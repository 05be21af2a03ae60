"""Reference worker: the frozen starting policy's logprobs, for the KL penalty of PPO."""

from __future__ import annotations

from m2flow import Channel, Worker, group_method

from ..batch import num_tokens
from ..checkpoint import load_state, save_state
from ..engines.registry import engine_class
from ..llm import build_tokenizer
from ..llm.placement import set_torch_threads, torch_device
from .config import ReferenceOptions


class ReferenceWorker(Worker):
    """A frozen copy of the policy (weights arrive once, with :meth:`sync_weights`), on the
    logprob-only engine ``engine`` names (kind ``logprob``, :mod:`~..engines.registry`).

    Inference only, so data parallel: each rank takes its share of the chunks.

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields.
        tokenizer: the tokenizer spec, ``{"name": "char", "alphabet": str}`` or
            ``{"name": "qwen2"}`` (:func:`~m2flow.workers.llm.build_tokenizer`).
        temperature: the rollout's sampling temperature (logprobs of ``logits / T``, as the
            rollout's).
        options: the workflow's ``reference`` section (:class:`~.config.ReferenceOptions`:
            responses per forward, 0: a whole chunk; torch threads, 0: this rank's share of
            its node's CPUs; ``engine``, a backend of kind ``logprob`` or ``"module:Class"``).

    Raises:
        ValueError: an unknown ``engine``, or a setting it refuses (its ``check``).
    """

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        options: ReferenceOptions,
        temperature: float,
    ) -> None:
        self.options = options
        cls = engine_class("logprob", options.engine, "reference")
        cls.check({"engine": options.engine, "model": model}, self.world_size, "reference")
        set_torch_threads(self, options.threads)
        self.engine = cls(
            model, build_tokenizer(tokenizer), device=torch_device(self.devices),
            temperature=temperature, micro_batch_size=options.micro_batch_size or None,
        )  # fmt: skip

    def load_weights(self, weights: dict, version: int) -> None:
        """The frozen reference: the policy's weights when synced (``m2flow.sync_weights``)."""
        self.engine.load_state_dict(weights)

    @group_method
    def logprobs(self, inp: Channel, out: Channel) -> dict:
        """For the step's rollout chunks from ``inp`` (until the rollout's end of step; ranks
        share them), put ``{"ref_logprobs": [B, R]}`` into ``out`` under the chunk's key
        (the actor's own logprob function: same numerics).

        Returns:
            ``samples`` scored.
        """
        samples = 0
        for (chunk,) in inp.stream():
            batch = chunk.batch
            ref = self.engine.logprobs(batch)
            out.put({"ref_logprobs": ref}, weight=num_tokens(batch), key=chunk.key)
            samples += len(batch)
        return {"samples": samples}

    @group_method
    def save_checkpoint(self, path: str) -> str:
        """The frozen reference weights under ``path``."""
        return save_state(path, self.rank, {"model": self.engine.state_dict()})

    @group_method
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        self.engine.load_state_dict(load_state(path, self.rank)["model"])

    def offload(self) -> None:
        self.engine.offload()

    def onload(self) -> None:
        self.engine.onload()
