"""Reward-model worker: a small LM with a scalar head, mixed with reasoning-gym's verifier.

Many RLHF setups score with a learned reward model and mix in a rule-based check where one
exists. Here the learned part starts from the warm-started policy's transformer and is fitted
briefly (:meth:`RewardModelWorker.fit`) to verifier labels of the policy's own samples: binary
cross-entropy towards the verifier's partial credit (InstructGPT section 3.5 fits to human
comparisons instead; no humans here). The reward of a sample is then
``w * verifier + (1 - w) * sigmoid(rm_logit)``, both in [0, 1].
"""

from __future__ import annotations

import torch

from m2flow import Channel, Worker

from ..batch import concat, num_tokens
from ..critic.data import chunk_key
from ..critic.model import ValueModel
from ..critic.trainer import ValueTrainer
from ..llm import build_char_tokenizer
from ..llm.placement import torch_device
from ..rollout.generation import decode_responses
from ..tasks import accuracy, score


class RewardModelWorker(Worker):
    """Scores rollout chunks: learned reward model plus verifier.

    One rank (``data_parallel = False``): :meth:`fit` trains, and ranks would diverge.

    Args:
        model: :class:`~m2flow.workers.llm.ModelConfig` fields (the policy's shape).
        alphabet: the character tokenizer's alphabet.
        verifier_weight: ``w`` in the mix (1: verifier only, 0: reward model only).
        lr, grad_clip: AdamW for :meth:`fit`.
        batch_size: samples per fit step; micro_batch_size: samples per scoring forward.
        threads: torch threads (0: the CPUs of the rank's devices); seed: init and shuffling.

    Raises:
        ValueError: ``verifier_weight`` outside [0, 1].
    """

    data_parallel = False

    def __init__(
        self,
        model: dict,
        alphabet: str,
        verifier_weight: float = 0.5,
        lr: float = 3e-4,
        grad_clip: float = 1.0,
        batch_size: int = 64,
        micro_batch_size: int = 0,
        threads: int = 0,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= verifier_weight <= 1.0:
            raise ValueError(f"verifier_weight must be in [0, 1], got {verifier_weight}")
        torch.set_num_threads(threads or self.num_threads)
        self.tokenizer = build_char_tokenizer(alphabet)
        device = torch_device(self.devices)
        self.trainer = ValueTrainer(
            ValueModel(model, self.tokenizer, seed=seed).to(device), lr=lr, grad_clip=grad_clip
        )
        self.w, self.batch_size = verifier_weight, batch_size
        self.micro = micro_batch_size or None
        self.generator = torch.Generator().manual_seed(seed)

    def init_from(self, src_group: str = "actor", src_rank: int = 0) -> None:
        """Receive ``(state_dict, version)`` of the policy and start from its transformer."""
        state, _ = self.recv(src_group, src_rank)
        self.trainer.model.load_backbone(state)

    def _verify(self, chunk: dict) -> torch.Tensor:
        batch = chunk["batch"]
        texts = decode_responses(self.tokenizer, batch["response_ids"], batch["response_mask"])
        entries = [chunk["entries"][int(g)] for g in batch["group_index"]]
        return torch.tensor(score(texts, entries), dtype=torch.float32)

    def fit(self, inp: Channel, num_chunks: int, heldout_chunks: int, epochs: int) -> dict:
        """Fit the reward model to verifier labels: the first ``num_chunks - heldout_chunks``
        rollout chunks from ``inp`` train it (``epochs`` shuffled passes, ``batch_size``
        samples a step), the last ``heldout_chunks`` measure it, before and after.

        Returns:
            ``rm_train_samples``, ``rm_heldout_samples``, ``rm_label_mean`` (mean verifier
            score of the training samples), ``rm_loss`` (last step, nats), and on the held-out
            samples before/after fitting: ``rm_corr_*`` (Pearson correlation of the score with
            the verifier's) and ``rm_auc_*`` (probability that a fully correct sample scores
            above an incorrect one; NaN without both kinds).

        Raises:
            ValueError: no chunk left to train on.
        """
        if not 0 <= heldout_chunks < num_chunks:
            raise ValueError(f"heldout_chunks must be in [0, {num_chunks}), got {heldout_chunks}")
        chunks = [inp.get() for _ in range(num_chunks)]
        labels = [self._verify(c) for c in chunks]
        cut = num_chunks - heldout_chunks
        pad = self.tokenizer.pad_token_id
        train = concat([c["batch"] for c in chunks[:cut]], pad)
        y = torch.cat(labels[:cut])
        held = concat([c["batch"] for c in chunks[cut:]], pad) if heldout_chunks else None
        y_held = torch.cat(labels[cut:]) if heldout_chunks else None
        out = {"rm_train_samples": len(y), "rm_label_mean": float(y.mean())}
        if held is not None:
            out |= _quality(self.trainer.scores(held, self.micro), y_held, "before")
        loss = float("nan")
        for _ in range(epochs):
            for idx in torch.split(
                torch.randperm(len(y), generator=self.generator), self.batch_size
            ):
                loss = self.trainer.fit_step({k: v[idx] for k, v in train.items()}, y[idx])
        out["rm_loss"] = loss
        if held is not None:
            out |= _quality(self.trainer.scores(held, self.micro), y_held, "after")
            out["rm_heldout_samples"] = len(y_held)
        # Frozen from here on: drop the optimizer moments.
        self.trainer.optimizer.state.clear()
        return out

    def score(self, inp: Channel, out: Channel, num_chunks: int) -> dict:
        """Score ``num_chunks`` rollout chunks from ``inp``; put ``{"scores": [B],
        "verifier": [B], "rm": [B]}`` into ``out`` under each chunk's key.

        Returns:
            means of the mixed reward (``reward_mean``), of the verifier score
            (``verifier_mean``) and of the reward-model score (``rm_mean``); ``accuracy``
            (share of samples the verifier scores 1); ``samples``.
        """
        mixed, ver, rm = [], [], []
        for _ in range(num_chunks):
            chunk = inp.get()
            batch = chunk["batch"]
            v = self._verify(chunk)
            r = self.trainer.scores(batch, self.micro)
            s = self.w * v + (1.0 - self.w) * r
            out.put({"scores": s}, weight=num_tokens(batch), key=chunk_key(batch))
            mixed.append(s)
            ver.append(v)
            rm.append(r)
        v_all = torch.cat(ver)
        return {
            "reward_mean": float(torch.cat(mixed).mean()),
            "verifier_mean": float(v_all.mean()),
            "rm_mean": float(torch.cat(rm).mean()),
            "accuracy": accuracy(v_all.tolist()),
            "samples": len(v_all),
        }

    def offload(self) -> None:
        self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()


def _quality(pred: torch.Tensor, label: torch.Tensor, tag: str) -> dict[str, float]:
    """Pearson correlation and the correct-vs-incorrect AUC of ``pred`` against ``label``."""
    corr = float("nan")
    if pred.std() > 0 and label.std() > 0:
        corr = float(torch.corrcoef(torch.stack([pred, label]))[0, 1])
    pos, neg = pred[label == 1.0], pred[label < 1.0]
    auc = float("nan")
    if len(pos) and len(neg):
        diff = pos.unsqueeze(1) - neg.unsqueeze(0)
        auc = float((diff > 0).float().mean() + 0.5 * (diff == 0).float().mean())
    return {f"rm_corr_{tag}": corr, f"rm_auc_{tag}": auc}
