"""Reward worker: verifiable rewards from reasoning-gym's own scorers."""

from __future__ import annotations

import torch
from m2flow.scheduler.balance import all_queued

from m2flow import Channel, Worker

from ..batch import num_tokens
from ..llm import build_char_tokenizer
from ..rollout.generation import decode_responses
from ..tasks import accuracy, score


class RewardWorker(Worker):
    """Scores rollout chunks with the task's ``score_answer`` (partial credit in [0, 1]), or
    through the shared reward service (DistRS; :mod:`.service`).

    Args:
        alphabet: the character tokenizer's alphabet (to decode responses).
        threads: torch intra-op threads; 0 = this rank's share of its node's CPUs.
        service: ``{"url", "token", "task", "pipeline", "timeout_s"}`` to score through the
            reward service (one batch per chunk: announced with its size, one request per
            response, rewards collected per batch); ``None``: score in process. The service's
            ``math`` pipeline verifies with math-verify: rewards are 0 or 1, no partial credit.

    Raises:
        RewardServiceError: the service refused the token or the task (at launch).
    """

    def __init__(self, alphabet: str, threads: int = 0, service: dict | None = None) -> None:
        torch.set_num_threads(threads or self.num_threads)
        self.tokenizer = build_char_tokenizer(alphabet)
        self.service, self.client = service, None
        if service:
            from .service.client import RewardClient

            self.client = RewardClient(service["url"], service["token"])
            self.client.register(service["task"], service["pipeline"])

    def _service_rewards(self, texts: list[str], entries: list[dict]) -> list[float]:
        """Rewards of one chunk from the reward service, in request order."""
        task = self.service["task"]
        batch = self.client.announce(task, len(texts))
        for i, (text, entry) in enumerate(zip(texts, entries)):
            self.client.submit(task, batch, {"response": text, "answer": entry["answer"]}, str(i))
        got = self.client.rewards(task, batch, self.service["timeout_s"])
        return [float(got[str(i)]) for i in range(len(texts))]

    def _score_chunk(self, chunk: dict) -> list[float]:
        """Add ``rewards [B]`` to the chunk's batch; returns them."""
        batch = chunk["batch"]
        texts = decode_responses(self.tokenizer, batch["response_ids"], batch["response_mask"])
        entries = [chunk["entries"][int(g)] for g in batch["group_index"]]
        if self.client is None:
            rewards = score(texts, entries)
        else:
            rewards = self._service_rewards(texts, entries)
        batch["rewards"] = torch.tensor(rewards, dtype=torch.float32)
        return rewards

    def score(self, inp: Channel, out: Channel) -> dict:
        """Score the step's rollout chunks from ``inp`` until the rollout's end of step (ranks
        share them), add ``rewards [B]`` to each batch, and put it into ``out`` (same weight:
        its tokens).

        Returns:
            ``reward_mean`` (mean partial credit), ``accuracy`` (share with score == 1),
            ``samples``.
        """
        rewards_all: list[float] = []
        # Chunks already queued are taken and passed on together: one get and one put for all
        # of them (each chunk is still scored and forwarded as its own chunk).
        for chunks in inp.stream(balance=all_queued, target_weight=1):
            for chunk in chunks:
                rewards_all += self._score_chunk(chunk)
            out.put_many(chunks, weights=[num_tokens(c["batch"]) for c in chunks])
        n = max(len(rewards_all), 1)
        return {
            "reward_mean": sum(rewards_all) / n,
            "accuracy": accuracy(rewards_all),
            "samples": len(rewards_all),
        }
