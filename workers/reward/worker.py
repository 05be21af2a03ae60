"""Reward worker: verifiable rewards from reasoning-gym's own scorers."""

from __future__ import annotations

import torch

from m2flow import Channel, Worker

from ..batch import num_tokens
from ..llm import build_char_tokenizer
from ..llm.placement import split_evenly
from ..rollout.generation import decode_responses
from ..tasks import accuracy, score


class RewardWorker(Worker):
    """Scores rollout chunks with the task's ``score_answer`` (partial credit in [0, 1]).

    Args:
        alphabet: the character tokenizer's alphabet (to decode responses).
        threads: torch intra-op threads; 0 = this rank's share of its node's CPUs.
    """

    def __init__(self, alphabet: str, threads: int = 0) -> None:
        torch.set_num_threads(threads or self.num_threads)
        self.tokenizer = build_char_tokenizer(alphabet)

    def score(self, inp: Channel, out: Channel, num_chunks: int) -> dict:
        """Take this rank's share of ``num_chunks`` rollout chunks from ``inp``, add
        ``rewards [B]`` to each batch, and put it into ``out`` (same weight: its tokens).

        Returns:
            ``reward_mean`` (mean partial credit), ``accuracy`` (share with score == 1),
            ``samples``.
        """
        rewards_all: list[float] = []
        for _ in range(split_evenly(num_chunks, self.world_size)[self.rank]):
            chunk = inp.get()
            batch = chunk["batch"]
            texts = decode_responses(self.tokenizer, batch["response_ids"], batch["response_mask"])
            entries = [chunk["entries"][int(g)] for g in batch["group_index"]]
            rewards = score(texts, entries)
            batch["rewards"] = torch.tensor(rewards, dtype=torch.float32)
            out.put(chunk, weight=num_tokens(batch))
            rewards_all += rewards
        n = max(len(rewards_all), 1)
        return {
            "reward_mean": sum(rewards_all) / n,
            "accuracy": accuracy(rewards_all),
            "samples": len(rewards_all),
        }
