"""The reward service learns of a step's batch when its rollout starts (DistRS section 4, the
proxy: "the start of a new rollout batch indicates that a new batch of reward computation
requests will arrive shortly", so that the service scales before the first request).

Real pieces, as in ``test_reward_streaming``: a live service on loopback, the tiny rollout and
the RewardWorker in Ray (rollout on device 0, reward on device 1, chunks of 2 prompts). The
calls go as the GRPO runner makes them (``RewardWorker.announce``, then the rollout and the
score call); the test puts no prompt before the service holds the step's batch, so that
batch was announced before any response of the step existed, let alone was scored. Order, not
time: a reward worker that announced at its first chunk would leave the test waiting.
"""

from __future__ import annotations

import pytest
from helpers import wait_until
from m2flow.reward_service.app import BackgroundServer
from m2flow.workers.llm import build_char_tokenizer
from m2flow.workers.reward.worker import RewardWorker
from m2flow.workers.rollout.config import RolloutOptions
from m2flow.workers.rollout.worker import RolloutWorker
from m2flow.workers.tasks import TaskDataset
from prompts import task_prompts
from test_reward_service import TOKENS, _config
from test_workflow import ALPHABET, TASK, TINY_MODEL, TOKENIZER

from m2flow import Channel
from m2flow.core.placement import Placement

pytestmark = pytest.mark.e2e

VIRTUAL_DEVICES = 2
PROMPTS, SAMPLES, PER_CHUNK = 4, 2, 2  # 2 chunks of 4 responses; the step has 8
STEP = PROMPTS * SAMPLES


def test_the_steps_batch_reaches_the_service_before_its_rollout_has_a_response(cluster):
    service = {"url": None, "token": TOKENS["alice"], "task": "announce", "pipeline": "math",
               "timeout_s": 60.0}  # fmt: skip
    cluster.placement = Placement(default_granularity=PER_CHUNK)
    server = BackgroundServer(_config())  # the service tests' config: math pipeline
    with server as url:
        rollout = RolloutWorker.launch(
            cluster, [0], name="a_rollout", model=TINY_MODEL, tokenizer=TOKENIZER,
            options=RolloutOptions(n_samples=SAMPLES, max_new_tokens=4, temperature=1.0,
                                   threads=1),
        )  # fmt: skip
        reward = RewardWorker.launch(
            cluster, [1], name="a_reward", tokenizer=TOKENIZER, service={**service, "url": url}
        )
        try:
            prompts, rollouts, scored = (Channel.create(f"a_{n}") for n in ("p", "r", "s"))
            train = TaskDataset(TASK["name"], TASK["config"], seed=1, size=32)
            items = task_prompts(train, build_char_tokenizer(ALPHABET), PROMPTS, seed=0, step=3)
            # the runner's order (workflows/grpo.py): announce, rollout, score
            ann = reward.announce(3, STEP)
            gen = rollout.generate(prompts, rollouts, PROMPTS)
            rew = reward.score(rollouts, scored)
            tasks = server.service.tasks
            task = wait_until(lambda: tasks.get(("alice", "announce")), 60, "the task", 0.005)
            batch = wait_until(
                lambda: next(iter(task.batches.values()), None), 60, "the batch", 0.005
            )
            # announced with the step's size, before any request: no prompt was put yet
            assert batch.size == STEP and batch.submitted == 0 and not batch.records
            prompts.put_many(items)
            gen.wait(60)
            (stats,) = rew.wait(60)
            ann.wait(60)
            out = [scored.get(timeout=30) for _ in range(PROMPTS // PER_CHUNK)]
        finally:
            rollout.shutdown()
            reward.shutdown()
            cluster.placement = None
    assert stats["samples"] == STEP and sum(len(c.batch["rewards"]) for c in out) == STEP
    # every response of the step went into the announced batch (no second batch at its first
    # chunk)
    (b,) = task.batches.values()
    assert b is batch and b.done and len(b.results) == STEP and b.submitted == STEP
    assert all(r.offset_s > 0 for r in b.records)  # each request came after the announcement
