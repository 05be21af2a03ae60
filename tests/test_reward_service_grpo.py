"""The GRPO runner scoring through the shared reward service (DistRS) instead of in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from m2flow.reward_service.app import BackgroundServer
from m2flow.reward_service.client import RewardClient
from test_reward_service import TOKENS, _config
from test_workflow import TINY_RUN

from m2flow.run.workflow import run_workflow

pytestmark = pytest.mark.e2e

GRPO = str(Path(__file__).resolve().parent.parent / "workflows" / "grpo.py")
TOKEN = TOKENS["alice"]


def test_grpo_scores_through_the_reward_service(cluster, tmp_path):
    run_dir = tmp_path / "run"
    server = BackgroundServer(_config())  # the service tests' config: math pipeline
    with server as url:
        run_workflow(
            GRPO,
            TINY_RUN
            + [
                "trainer.steps=2",
                f"trainer.run_dir={run_dir}",
                f"reward_service.url={url}",
                f"reward_service.token={TOKEN}",
                "reward_service.timeout_s=120",
            ],
        )
        with RewardClient(url, TOKEN) as client:
            served = client.metrics()
        batches = dict(server.service.tasks[("alice", "grpo")].batches)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    # math-verify rewards are 0 or 1, so the sample accuracy is the reward mean.
    for r in records[1:]:
        assert r["reward_mean"] == r["sample_accuracy"]
    # Every response of both steps went through the service: 2 steps x 4 prompts x 4 samples.
    assert served["requests_done"] == 2 * 4 * 4
    assert served["tasks"]["grpo"]["batches"] >= 2
    # the runner announced each step's batch as its rollout started (RewardWorker.announce,
    # DistRS section 4), and the step's responses went into it: no batch opened at a chunk
    steps = [b for b in batches if "-a" in b]
    assert sorted(b.rpartition("-s")[2] for b in steps) == ["1", "2"], list(batches)
    assert all(batches[b].size == 16 and len(batches[b].results) == 16 for b in steps)
    # the reward ranks' waits for the service are spans of the run's trace
    trace = json.loads((run_dir / "trace.json").read_text())
    waits = [e for e in trace if e.get("cat") == "reward_service"]
    assert waits and all(e["dur"] >= 0 and e["name"] == "rewards" for e in waits)
