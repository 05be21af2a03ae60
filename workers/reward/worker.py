"""Reward worker: rewards from the run's reward function (a built-in or your own:
:mod:`.functions`), or from the shared reward service (DistRS), request-in, batch-out."""

from __future__ import annotations

import logging
import uuid
from collections import deque
from contextlib import nullcontext

import torch
from m2flow.scheduler.runtime.balance import all_queued

from m2flow import Channel, Worker, group_method, no_device_lock
from m2flow.core import events

from ..batch import num_tokens
from ..chunk import RolloutChunk
from ..llm import build_tokenizer
from ..llm.placement import set_torch_threads
from ..llm.tokenizer import decode_responses
from ..scoring.functions import RewardFunction, RewardResult, result_metrics
from ..tasks import accuracy

log = logging.getLogger(__name__)

#: seconds a rank waits past the service's own ``timeout_s`` before it gives up on a future
_GRACE_S = 60.0


class RewardWorker(Worker):
    """Scores rollout chunks with the run's reward function (:class:`.functions.
    RewardFunction`; by default ``auto``: reasoning-gym's ``score_answer``, partial credit in
    [0, 1], for reasoning-gym prompts), or through the shared reward service (DistRS;
    :mod:`.service`).

    With the service, the step is one batch (DistRS section 3.2, request-in, batch-out), announced
    with the step's number of responses when its rollout starts: the runner calls :meth:`announce`
    before the step's rollout (DistRS section 4, the proxy: "the start of a new rollout batch
    indicates that a new batch of reward computation requests will arrive shortly", so the service
    scales and warms workers up before the first request; the announcement time is the batch's
    arrival time ``AT`` of Algorithm 2). A step not announced so is announced by the first chunk of
    it that any rank takes, with the chunk's ``step_samples`` (the announcement is idempotent, so
    every rank sharing the step may send it). Each chunk's responses are submitted the moment the
    chunk arrives, one request per response with the id ``"<step>:<group>:<sample>"``, while the
    rewards of earlier chunks are collected in the background
    (:class:`~.service.stream.RewardStream`, which also rides out service restarts). Chunks are
    forwarded in order, each once its rewards are in, at the rank's next channel operation (the next
    chunk's arrival or the step's end: channel operations stay on the call's thread). A chunk
    without ``step_samples`` is a batch of its own. A rank whose step fails closes its batches on
    the service (so that they do not stay active for requests that will not come); a lone rank
    closes them at the end of every step.

    Args:
        tokenizer: the tokenizer spec (:func:`~m2flow.workers.llm.build_tokenizer`), to decode
            responses.
        threads: torch intra-op threads; 0 = this rank's share of its node's CPUs.
        service: ``{"url", "token", "task", "pipeline", "timeout_s"}`` to score through the
            reward service (``timeout_s``: longest wait for a chunk's rewards, and for an
            unreachable service, in seconds); ``None``: score in process. The service's
            ``math`` pipeline verifies with math-verify: rewards are 0 or 1, no partial credit.
            Each request's payload is ``{"response", "answer"}``, the answer being the prompt's
            ground truth.
        reward: :class:`~.functions.RewardFunction` arguments (``function``, ``on_error``,
            ``penalty``, ``timeout_s``, ``import_timeout_s``, ``max_abs``) for scoring here
            (default: ``auto``; a file function runs in a child process of this rank); not
            with ``service``.

    Raises:
        RewardServiceError: the service refused the token or the task (at launch).
    """

    @classmethod
    def launch(cls, cluster, placement=None, **kwargs):
        """:meth:`Worker.launch`; with a ``service``, its ranks share a run id drawn here,
        which names the run's batches on the service (a resumed or repeated run gets new
        ones)."""
        service = kwargs.get("service")
        if service and not service.get("run"):
            kwargs["service"] = {**service, "run": uuid.uuid4().hex[:12]}
        return super().launch(cluster, placement, **kwargs)

    def __init__(
        self,
        tokenizer: dict,
        threads: int = 0,
        service: dict | None = None,
        reward: dict | None = None,
    ) -> None:
        if service and reward and reward.get("function", "auto") != "auto":
            raise ValueError(
                "a reward function and the reward service: the service scores with its own "
                "pipelines (reward_service.pipeline); leave reward.function at auto"
            )
        set_torch_threads(self, threads)
        self.tokenizer = build_tokenizer(tokenizer)
        self.reward_fn = RewardFunction(**(reward or {}))
        self._results: list[RewardResult] = []  # this call's, for its metrics
        self.service, self.stream = service, None
        self._calls = 0  # score calls so far: the same count on every rank (group calls)
        self._announces = 0  # announce calls so far: the same count on every rank
        self._announced: dict[int, tuple[str, int]] = {}  # step -> (batch, size), not yet scored
        if service:
            from m2flow.reward_service.stream import RewardStream

            # Not launched through launch() (no shared run id): batches are then per rank.
            self.run = service.get("run") or f"{uuid.uuid4().hex[:12]}-r{self.rank}"
            self.stream = RewardStream(
                service["url"], service["token"], service["task"], service["pipeline"],
                timeout_s=service["timeout_s"],
            )  # fmt: skip

    def _texts(self, chunk: RolloutChunk) -> tuple[list[str], list[dict]]:
        batch = chunk.batch
        texts = decode_responses(self.tokenizer, batch["response_ids"], batch["response_mask"])
        return texts, chunk.row_entries()

    def _score_chunk(self, chunk: RolloutChunk) -> list[float]:
        """Add ``rewards [B]`` to the chunk's batch (in process); returns them."""
        res = self.reward_fn(*self._texts(chunk))
        self._results.append(res)
        chunk.batch["rewards"] = torch.tensor(res.scores, dtype=torch.float32)
        return res.scores

    def _submit(self, chunk: RolloutChunk, n: int, batches: set[str]):
        """Submit the chunk's responses to the service; returns ``(ids, future of rewards)``.
        ``n``: the chunk's number in this call on this rank."""
        texts, entries = self._texts(chunk)
        step = chunk.step
        groups = [int(g) for g in chunk.batch["group_index"]]
        seen: dict[int, int] = {}
        ids = []
        for g in groups:  # a chunk holds whole groups: sample j of group g is its j-th row
            ids.append(f"{step}:{g}:{seen.get(g, 0)}")
            seen[g] = seen.get(g, 0) + 1
        if self._announced.get(step, (None, 0))[1] == chunk.step_samples > 0:
            batch, size = self._announced[step]  # announced at the step's rollout start
        elif chunk.step_samples:
            batch, size = f"{self.run}-c{self._calls}-s{step}", chunk.step_samples
        else:
            batch, size = f"{self.run}-c{self._calls}-r{self.rank}-n{n}", len(ids)
        batches.add(batch)
        payloads = {
            i: {"response": t, "answer": e["ground_truth"]} for i, t, e in zip(ids, texts, entries)
        }
        return ids, self.stream.submit(batch, size, payloads)

    def _forward(self, pending: deque, out: Channel, rewards_all: list, wait: bool) -> None:
        """Put the scored chunks at the head of ``pending`` into ``out``, in order; with
        ``wait``, all of them, each as its rewards arrive."""
        while pending:
            ready = []
            while pending and (pending[0][2].done() or (wait and not ready)):
                chunk, ids, fut = pending.popleft()
                # a wait for the service shows in the run's trace (trace.json)
                waiting = nullcontext() if fut.done() else events.span("reward_service", "rewards")
                with waiting:
                    got = fut.result(timeout=self.service["timeout_s"] + _GRACE_S)
                rewards = [got[i] for i in ids]
                chunk.batch["rewards"] = torch.tensor(rewards, dtype=torch.float32)
                rewards_all += rewards
                ready.append(chunk)
            if not ready:
                return
            out.put_many(ready, weights=[num_tokens(c.batch) for c in ready])

    def _close(self, batch: str) -> None:
        """Close ``batch`` on the service (best effort, logged): after a failed step (its
        other requests will not come), or where this rank fills it alone (a no-op unless the
        step had fewer responses than announced). Another rank's later submission into a
        closed batch is refused (409): the step failed anyway."""
        try:
            self.stream.close_batch(batch).result(timeout=60)
        except Exception as e:  # the service may be gone: its batches with it
            log.warning("closing reward-service batch %r failed: %r", batch, e)

    @group_method
    @no_device_lock
    def announce(self, step: int, samples: int) -> None:
        """Announce step ``step``'s batch of ``samples`` responses (all rollout ranks) on the
        reward service now, at its rollout's start (DistRS section 4; see the class
        docstring); returns once the service has it. The step's chunks then go into this
        batch (those whose ``step_samples`` is ``samples``). A no-op without the service.
        Call it before the step's :meth:`score` (a rank runs its calls in order), on every
        rank (group call): each rank announces before it submits.

        Raises:
            RewardServiceError: the service refused the batch (e.g. 422, ``samples`` over its
                ``max_batch_size``) or stayed unreachable.
        """
        if self.stream is None or samples <= 0:
            return
        self._announces += 1
        batch = f"{self.run}-a{self._announces}-s{step}"
        self.stream.announce(batch, samples).result(timeout=self.service["timeout_s"] + _GRACE_S)
        self._announced[step] = (batch, samples)

    @group_method
    def score(self, inp: Channel, out: Channel) -> dict:
        """Score the step's rollout chunks from ``inp`` until the rollout's end of step (ranks
        share them), add ``rewards [B]`` to each batch, and put it into ``out`` (same weight:
        its tokens).

        Returns:
            ``reward_mean`` (mean reward), ``accuracy`` (share with score == 1), ``samples``;
            in process also ``reward_errors`` (penalised samples) and ``reward_metrics``
            (the reward function's extra metrics: name -> ``[sum, count]``; merge ranks with
            :func:`merge_reward_metrics`).
        """
        rewards_all: list[float] = []
        self._calls += 1
        self._results = []
        pending: deque = deque()  # (chunk, ids, future of rewards), in arrival order
        batches: set[str] = set()
        n, ended = 0, False
        try:
            # Chunks already queued are taken together: one get for all of them (each chunk
            # is still scored and forwarded as its own chunk).
            for chunks in inp.stream(balance=all_queued, target_weight=1):
                if self.stream is None:
                    for chunk in chunks:
                        rewards_all += self._score_chunk(chunk)
                    out.put_many(chunks, weights=[num_tokens(c.batch) for c in chunks])
                    continue
                for chunk in chunks:
                    pending.append((chunk, *self._submit(chunk, n, batches)))
                    n += 1
                self._forward(pending, out, rewards_all, wait=False)
            self._forward(pending, out, rewards_all, wait=True)
            ended = True
        finally:
            announced = {b for b, _ in self._announced.values()}
            if not ended:  # the run's announced steps will not come either
                batches |= announced
                self._announced.clear()
            for step in [k for k, (b, _) in self._announced.items() if b in batches]:
                del self._announced[step]  # scored: a later call of the step is a new batch
            for b in batches:
                self.stream.forget(b)
                if not ended or self.world_size == 1:
                    self._close(b)
        m = max(len(rewards_all), 1)
        return {
            "reward_mean": sum(rewards_all) / m,
            "accuracy": accuracy(rewards_all),
            "samples": len(rewards_all),
            **result_metrics(self._results),
        }
