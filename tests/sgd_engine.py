"""A new train engine in one file: plain SGD on the GRPO loss, one rank, no reference.

tests/test_actor_dp.py runs the actor role on it (``engine="sgd_engine:SgdEngine"``, the import
path a Ray worker resolves itself: the tests directory is on its ``PYTHONPATH``) without
editing any role.
"""

from __future__ import annotations

from pathlib import Path

import torch
from m2flow.workers.algos.grpo import grpo_loss
from m2flow.workers.algos.logprobs import sequence_logprobs
from m2flow.workers.engines.trainer import PolicyTrainer
from m2flow.workers.llm import load_model

KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def sgd_update(model, data: dict, lr: float, temperature: float, clip=(0.2, 0.28)) -> dict:
    """One SGD step of ``model`` on the token-mean GRPO loss of the whole batch."""
    lp = sequence_logprobs(model, *(data[k] for k in KEYS), temperature=temperature)
    loss, metrics = grpo_loss(lp, data["old_logprobs"], data["advantages"],
                              data["response_mask"], *clip)  # fmt: skip
    model.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return {**metrics, "loss": loss.item(), "steps": 1}


class SgdEngine:
    """:class:`~m2flow.workers.engines.train.TrainEngine` with plain SGD (whole steps only)."""

    one_rank_per_device = False
    whole_step = True

    @classmethod
    def check(cls, world_size: int, kwargs: dict, role: str = "actor") -> None:
        if world_size != 1:
            raise ValueError(f"{role}.engine=sgd runs one rank")

    def __init__(self, model, tokenizer, *, device, optim, seed=0, **_) -> None:
        self.model = load_model(model, tokenizer, device, trainable=True, seed=seed)
        self.sft_trainer = PolicyTrainer(self.model, **optim)  # the warm start: AdamW
        self.lr, self.temperature = optim["lr"], optim["temperature"]
        self.clip = (optim["clip_eps_low"], optim["clip_eps_high"])
        self.steps = 0

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def read_step(self, parts) -> list:
        return [item for part in parts for item in part]

    def publish(self) -> None:
        pass

    def train(self, data, mini_batch_size, micro_batch_size, epochs=1, generator=None) -> dict:
        if not len(data["response_ids"]):
            return {}
        self.steps += 1
        return sgd_update(self.model, data, self.lr, self.temperature, self.clip)

    def accumulate(self, data, micro_batch_size) -> int:
        raise NotImplementedError

    def finish_accumulation(self) -> dict:
        raise NotImplementedError

    def get_weights(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

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
