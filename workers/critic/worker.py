"""Critic worker: values of rollout chunks, GAE advantages and returns, clipped value training.

The critic is where a PPO step's branches join: it takes each rollout chunk, the reward
model's scores and the reference logprobs for that chunk (by :func:`~.data.chunk_key`),
computes KL-shaped token rewards and GAE, hands the chunk with its advantages to the actor,
then fits its values to the returns.
"""

from __future__ import annotations

import torch

from m2flow import Channel, Worker

from ..batch import concat, num_tokens
from ..checkpoint import load_state, save_state
from ..llm import build_tokenizer
from ..llm.placement import torch_device
from .data import chunk_key, token_rewards
from .losses import explained_variance, gae
from .model import ValueModel
from .trainer import ValueTrainer


class CriticWorker(Worker):
    """Value head on a tiny Qwen2, initialised from the (warm-started) policy.

    One rank (``data_parallel = False``): training needs a gradient all-reduce across ranks,
    which the runtime does not have yet; given several devices it uses them as one.

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields (the policy's shape).
        tokenizer: the tokenizer spec, ``{"name": "char", "alphabet": str}`` or
            ``{"name": "qwen2"}`` (:func:`~m2flow.workers.llm.build_tokenizer`).
        lr, betas, weight_decay, grad_clip: AdamW.
        value_clip: PPO value clip around the old values (0: none).
        gamma, lam: GAE discount and lambda (per token).
        kl_coef: weight of the per-token KL penalty in the reward.
        epochs: passes over each batch; mini_batch_size, micro_batch_size: responses per
            optimizer step / per forward (0: the whole batch / mini-batch).
        threads: torch threads (0: the CPUs of the rank's devices); seed: init and shuffling.
        engine: ``"torch"`` only.

    Raises:
        ValueError: another ``engine`` (there is no Megatron value head yet).
    """

    data_parallel = False

    def __init__(
        self,
        model: dict,
        tokenizer: dict,
        lr: float = 1e-4,
        betas: tuple = (0.9, 0.99),
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        value_clip: float = 0.2,
        gamma: float = 1.0,
        lam: float = 0.95,
        kl_coef: float = 0.05,
        epochs: int = 1,
        mini_batch_size: int = 0,
        micro_batch_size: int = 0,
        threads: int = 0,
        seed: int = 0,
        engine: str = "torch",
    ) -> None:
        if engine != "torch":
            raise ValueError(
                f"critic.engine={engine!r}: the critic runs on the torch engine only (no "
                "Megatron value head yet, docs/megatron.md): set critic.engine=torch"
            )
        torch.set_num_threads(threads or self.num_threads)
        self.tokenizer = build_tokenizer(tokenizer)
        device = torch_device(self.devices)
        self.trainer = ValueTrainer(
            ValueModel(model, self.tokenizer, seed=seed).to(device),
            lr=lr,
            betas=tuple(betas),
            weight_decay=weight_decay,
            grad_clip=grad_clip,
        )
        self.value_clip, self.gamma, self.lam, self.kl_coef = value_clip, gamma, lam, kl_coef
        self.epochs = epochs
        self.mini, self.micro = mini_batch_size or None, micro_batch_size or None
        self.generator = torch.Generator().manual_seed(seed)

    def load_weights(self, weights: dict, version: int) -> None:
        """Start from the policy's transformer (``m2flow.sync_weights(actor, critic)``)."""
        self.trainer.model.load_backbone(weights)

    def step(self, rollouts: Channel, scores: Channel, refs: Channel, out: Channel) -> dict:
        """Advantages for the step's rollout chunks (until the rollout's end of step), then one
        value update on them (chunks in a fixed order: by their first prompt id).

        Each chunk from ``rollouts`` is joined with the ``{"scores": [B]}`` item from
        ``scores`` and the ``{"ref_logprobs": [B, R]}`` item from ``refs`` put under its key.
        The chunk goes on into ``out`` with ``advantages`` and ``returns`` ``[B, R]`` (GAE over
        tokens, not whitened) added to its batch.

        Returns:
            ``kl`` (mean per-token ``log pi - log pi_ref``), ``score_mean``, ``return_mean``,
            ``explained_variance`` (of the old values), value-training metrics (``vf_loss``,
            ``vf_clip_frac``, ``value_mean``, ``grad_norm``), ``update_norm`` (L2 norm of the
            weight change).
        """
        batches = []
        for (chunk,) in rollouts.stream():
            batch, key = chunk["batch"], chunk_key(chunk["batch"])
            score = scores.get(key=key)["scores"]
            ref = refs.get(key=key)["ref_logprobs"]
            values = self.trainer.values(batch, self.micro)
            rewards, dones, kl = token_rewards(
                score, batch["logprobs"], ref, batch["response_mask"], self.kl_coef
            )
            adv, ret = gae(rewards, values, dones, torch.zeros(len(batch)), self.gamma, self.lam)
            mask = batch["response_mask"]
            batch["advantages"], batch["returns"] = adv * mask, ret * mask
            batch["old_values"], batch["kl"], batch["scores"] = values, kl, score.float()
            out.put(chunk, weight=num_tokens(batch))
            batches.append(batch)
        batches.sort(key=chunk_key)
        data = concat(batches, self.tokenizer.pad_token_id)
        mask = data["response_mask"]
        n_tok = float(mask.sum().clamp(min=1))
        stats = {
            "kl": float(data["kl"].sum() / n_tok),
            "score_mean": float(data["scores"].mean()),
            "return_mean": float((data["returns"] * mask).sum() / n_tok),
            "explained_variance": explained_variance(data["old_values"], data["returns"], mask),
        }
        before = [p.detach().clone() for p in self.trainer.model.parameters()]
        stats |= self.trainer.train_values(
            data, self.value_clip, self.mini, self.micro, self.epochs, self.generator
        )
        stats["update_norm"] = _change(before, self.trainer.model.parameters())
        return stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The value model's weights, on CPU (copies)."""
        return {k: v.detach().cpu().clone() for k, v in self.trainer.model.state_dict().items()}

    def save_checkpoint(self, path: str) -> str:
        """Value model, optimizer state and the shuffling RNG under ``path``."""
        return save_state(
            path,
            self.rank,
            {
                "model": self.trainer.model.state_dict(),
                "optimizer": self.trainer.optimizer.state_dict(),
                "generator": self.generator.get_state(),
            },
        )

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        state = load_state(path, self.rank)
        self.trainer.model.load_state_dict(state["model"])
        self.trainer.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])

    def offload(self) -> None:
        self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()


def _change(before: list[torch.Tensor], after) -> float:
    """L2 norm of the difference between two parameter lists."""
    sq = sum(float(((a.detach() - b) ** 2).sum()) for a, b in zip(after, before))
    return sq**0.5
