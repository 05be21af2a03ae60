"""A new train engine in one file: plain SGD, one rank, whole steps, no reference, and no loss:
the role hands it the loss (:mod:`m2flow.workers.algos.losses`), as it does every engine.

tests/test_actor_dp.py runs the actor role on it (``engine="sgd_engine:SgdEngine"``, the import
path a Ray worker resolves itself: the tests directory is on its ``PYTHONPATH``) without
editing any role.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from m2flow.workers.algos.logprobs import sequence_logprobs
from m2flow.workers.llm import load_model

KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


class SgdEngine:
    """:class:`~m2flow.workers.engines.train.TrainEngine` with plain SGD (whole steps only, one
    forward per call: no micro-batches)."""

    one_rank_per_device = False
    whole_step = True
    data_parallel = False

    @classmethod
    def check(cls, config: dict, world_size: int | None = None, role: str = "actor") -> None:
        if world_size not in (None, 1):
            raise ValueError(f"{role}.engine=sgd runs one rank")

    def __init__(self, model, tokenizer, *, device, optim, seed=0, **_) -> None:
        self.model = load_model(model, tokenizer, device, trainable=True, seed=seed)
        self.lr, self.temperature = optim["lr"], optim["temperature"]
        self.steps = 0

    def _logprobs(self, batch: dict, temperature: float | None = None) -> torch.Tensor:
        t = self.temperature if temperature is None else temperature
        return sequence_logprobs(self.model, *(batch[k] for k in KEYS), temperature=t)

    # -- mechanics ----------------------------------------------------------------------------

    def forward_backward(self, batch, loss, micro_batch_size=None, normalizer=None) -> list:
        self.model.train()
        mb = {k: batch[k] for k in (*KEYS, *loss.keys) if k in batch}
        value, metrics = loss(self._logprobs(mb, loss.temperature), mb, normalizer or 1.0)
        value.backward()
        return [{"loss": value.item(), "weight": loss.units(mb), **metrics}]

    def optimizer_step(self, normalizer: float | None = None) -> dict:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = float(torch.stack([g.norm() for g in grads]).norm()) if grads else 0.0
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p -= self.lr * (p.grad / (normalizer or 1.0))
        self.zero_grad()
        self.steps += 1
        return {"grad_norm": norm, "skipped": 0}

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def reduce_metrics(self, sums: dict, keys) -> dict:
        return sums

    @torch.no_grad()
    def infer(self, batch, fn=None, micro_batch_size=None, reference=False) -> torch.Tensor:
        if reference:
            raise ValueError("the SGD engine keeps no reference")
        mb = {k: batch[k] for k in KEYS}
        out = self._logprobs(mb)
        return (out if fn is None else fn(out, mb)).cpu()

    @contextlib.contextmanager
    def solo(self):
        yield self

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def reset_optimizer(self) -> None:
        pass

    # -- steps, weights, checkpoints, memory ----------------------------------------------------

    def read_step(self, parts) -> list:
        return [item for part in parts for item in part]

    def publish(self) -> None:
        pass

    def get_weights(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_weights(self, weights: dict) -> None:
        self.model.load_state_dict(weights)

    def save(self, path: Path) -> dict:
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        return {"trainer_steps": self.steps}

    def load(self, path: Path, state: dict) -> None:
        from m2flow.workers.engines.torch_engine import load_pretrained_weights

        load_pretrained_weights(self.model, path)
        self.steps = state["trainer_steps"]

    def offload(self) -> None:
        pass

    def onload(self) -> None:
        pass
