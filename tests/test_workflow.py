"""The GRPO workers and runner on tiny configs: real Ray, real tiny Qwen2, real reasoning-gym."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from m2flow.workers.actor.worker import ActorWorker
from m2flow.workers.llm import build_char_tokenizer
from m2flow.workers.reward.worker import RewardWorker
from m2flow.workers.rollout.worker import RolloutWorker, num_chunks
from m2flow.workers.tasks import TaskDataset

from m2flow import Channel
from m2flow.cli import load_workflow, prepare
from m2flow.config import ConfigError
from m2flow.placement import Placement
from m2flow.session import Session

VIRTUAL_DEVICES = 3  # the cluster fixture's devices: room for a fully spatial plan

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"
TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}
ALPHABET = "0123456789+-="
TASK = {
    "name": "chain_sum",
    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "train_seed": 1,
    "train_size": 64,
    "val_seed": 2,
    "val_size": 16,
    "heldout_seed": 3,
    "heldout_size": 16,
}
TINY_RUN = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "warm_start.steps=2",
    "warm_start.batch_size=16",
    "warm_start.eval_every=1",
    "task.train_size=64",
    "task.val_size=16",
    "task.heldout_size=16",
    "trainer.prompts_per_step=4",
    "rollout.n_samples=4",
    "actor.mini_batch_size=8",
    "actor.micro_batch_size=4",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "rollout.threads=1",
    "actor.threads=1",
]


def test_rollout_reward_train_changes_weights(cluster):
    rollout = RolloutWorker.launch(
        cluster,
        [0],
        name="t_rollout",
        model=TINY_MODEL,
        alphabet=ALPHABET,
        n_samples=4,
        max_new_tokens=4,
        temperature=1.0,
        top_p=1.0,
        task=TASK,
        threads=1,
    )
    reward = RewardWorker.launch(cluster, [0], name="t_reward", alphabet=ALPHABET)
    actor = ActorWorker.launch(
        cluster,
        [0],
        name="t_actor",
        model=TINY_MODEL,
        alphabet=ALPHABET,
        lr=1e-2,
        temperature=1.0,
        kl_coef=0.1,
        mini_batch_size=8,
        micro_batch_size=4,
        recompute_old_logprobs=True,
        threads=1,
    )
    try:
        actor.send_weights("t_rollout", 1)
        assert rollout.sync_weights("t_actor").wait() == [0]
        prompts, rollouts, scored = (Channel.create(f"t_{n}") for n in ("p", "r", "s"))
        tok = build_char_tokenizer(ALPHABET)
        train = TaskDataset(TASK["name"], TASK["config"], seed=1, size=8)
        for g in range(4):
            prompts.put(
                {"prompt_ids": tok(train[g].prompt).input_ids, "group": g, "entry": train[g].entry}
            )
        before = actor.state_dict().wait()[0]
        chunks = num_chunks(4, 1, 2)
        gen = rollout.generate(prompts, rollouts, 4, 2)
        rew = reward.score(rollouts, scored, chunks)
        upd = actor.train(scored, chunks)
        (g_out,), (r_out,), (a_out,) = gen.wait(), rew.wait(), upd.wait()
        after = actor.state_dict().wait()[0]

        assert chunks == 2 and g_out["samples"] == 16 and r_out["samples"] == 16
        assert a_out["samples"] == 16 and a_out["stale"] == 0
        assert 0.0 <= r_out["reward_mean"] <= 1.0
        # Groups with one reward for all samples are dropped (no signal); the step must still
        # have trained on some (partial credit makes mixed rewards likely even for a random
        # policy), or the weight check below would test nothing.
        assert a_out["trained_samples"] > 0
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert changed, "one GRPO step left every weight unchanged"
        assert all(torch.isfinite(v).all() for v in after.values())
    finally:
        for g in (rollout, reward, actor):
            g.shutdown()


def test_streaming_actor_trains_queued_chunks_as_one_part(cluster):
    """Chunks already queued when the actor comes for data are trained on together: two
    scored chunks waiting in the channel make one forward/backward part, not two."""
    rollout = RolloutWorker.launch(
        cluster, [0], name="q_rollout", model=TINY_MODEL, alphabet=ALPHABET, n_samples=4,
        max_new_tokens=4, temperature=1.0, threads=1,
    )  # fmt: skip
    reward = RewardWorker.launch(cluster, [0], name="q_reward", alphabet=ALPHABET)
    actor = ActorWorker.launch(
        cluster, [0], name="q_actor", model=TINY_MODEL, alphabet=ALPHABET, lr=1e-2,
        temperature=1.0, threads=1,
    )  # fmt: skip
    try:
        prompts, rollouts, scored = (Channel.create(f"q_{n}") for n in ("p", "r", "s"))
        tok = build_char_tokenizer(ALPHABET)
        train = TaskDataset(TASK["name"], TASK["config"], seed=1, size=8)
        prompts.put_many(
            [
                {"prompt_ids": tok(train[g].prompt).input_ids, "group": g, "entry": train[g].entry}
                for g in range(8)
            ]
        )
        chunks = num_chunks(8, 1, 4)
        rollout.generate(prompts, rollouts, 8, 4).wait()
        reward.score(rollouts, scored, chunks).wait()
        assert scored.qsize() == chunks == 2  # both chunks wait for the actor
        (out,) = actor.train(scored, chunks).wait()
        assert out["samples"] == 32 and scored.qsize() == 0
        # One rollout rank: the seeds fix the data, and it has groups with mixed rewards.
        assert out["trained_samples"] > 0 and out["parts"] == 1
    finally:
        for g in (rollout, reward, actor):
            g.shutdown()


def test_workflow_trains_checkpoints_and_resumes(cluster, tmp_path):
    run_dir = tmp_path / "run"
    module, cfg = prepare(
        str(GRPO), TINY_RUN + ["trainer.steps=2", f"trainer.run_dir={run_dir}"], []
    )
    summary = module.main(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["phase"] == "warm_start" and "heldout_accuracy" in records[0]
    for key in (
        "reward_mean",
        "tokens_per_s",
        "rollout_s",
        "reward_s",
        "actor_s",
        "response_length",
    ):
        assert key in records[1]
    assert "heldout_accuracy" in records[2]
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    assert (run_dir / "checkpoints" / "step_000002" / "actor_state.pt").is_file()

    # A fresh start into a run dir with checkpoints is refused; --resume continues it.
    module, cfg = prepare(
        str(GRPO), TINY_RUN + ["trainer.steps=3", f"trainer.run_dir={run_dir}"], []
    )
    with pytest.raises(ConfigError, match="--resume"):
        module.main(cfg)
    module, cfg = prepare(
        str(GRPO), TINY_RUN + ["trainer.steps=3", f"trainer.run_dir={run_dir}", "resume=true"], []
    )
    module.main(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # no second warm start


PLACEMENTS = {
    # One runner, three plans: every group on every device; every group on its own device,
    # streamed in chunks of 2 prompts; rollout and reward time-sharing device 0 while the actor
    # trains on devices 1-2 (a temporal part inside a spatial split).
    "temporal": Placement(mode="temporal"),
    "spatial": Placement(
        mode="spatial",
        groups={"rollout": [0], "reward": [1], "actor": [2]},
        granularity={"rollout->reward": 2, "reward->actor": 2},
    ),
    "hybrid": Placement(
        mode="hybrid",
        groups={"rollout": [0], "reward": [0], "actor": [1, 2]},
        granularity={"rollout->reward": 2, "reward->actor": 4},
    ),
}
EXPECTED_RANKS = {
    "temporal": {"rollout": [[0], [1], [2]], "reward": [[0], [1], [2]], "actor": [[0, 1, 2]]},
    "spatial": {"rollout": [[0]], "reward": [[1]], "actor": [[2]]},
    "hybrid": {"rollout": [[0]], "reward": [[0]], "actor": [[1, 2]]},
}


@pytest.mark.parametrize("mode", list(PLACEMENTS))
def test_same_runner_trains_under_each_plan(cluster, tmp_path, mode):
    """The unchanged runner under temporal, spatial and hybrid placements: groups land on the
    planned devices (one rank per device; the actor one rank over its devices), the rollout
    streams the planned chunks, and the actor takes optimizer steps with a gradient."""
    run_dir = tmp_path / mode
    # A longer warm start than TINY_RUN's: the policy writes numbers, so partial credit gives
    # mixed rewards within a group (which prompt lands on which rollout rank depends on timing,
    # and a near-random policy can score 0 on every sample of a step).
    overrides = ["trainer.steps=2", f"trainer.run_dir={run_dir}", "warm_start.steps=150"]
    module, cfg = prepare(str(GRPO), TINY_RUN + overrides, [])
    with Session(placement=PLACEMENTS[mode]) as session:
        module.main(cfg)
    assert session.groups == EXPECTED_RANKS[mode]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["rollout_s"] > 0 and r["actor_s"] > 0 for r in records[1:])
    # 4 prompts per step: one coalesced chunk per rollout rank, or chunks of 2 prompts.
    calls = [c for c in session.calls if c.group == "rollout" and c.method == "generate"]
    assert len(calls) == 2
    assert records[0]["val_accuracy"] >= 0  # the warm start ran (its accuracy is logged)
    assert any(r["grad_norm"] > 0 for r in records[1:])  # some step trained


@pytest.mark.parametrize(
    "args,message",
    [
        (["trainer.stepz=3"], "unknown config key 'trainer.stepz'"),
        (["trainer.steps=many"], "bad value for 'trainer.steps'"),
        (["rollout.temperature=0"], "rollout.temperature must be > 0"),
        (["plan=sideways"], "plan='sideways': give one of auto, temporal"),
        (["plan=no/such/plan.yaml"], "plan file 'no/such/plan.yaml' does not exist"),
        (["trainer.steps"], "not of the form key=value"),
    ],
)
def test_config_errors_exit_2(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "m2flow.cli", "run", str(GRPO), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_workflow_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "m2flow.cli", "run", "no_such_flow.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "neither a file nor a built-in" in proc.stderr


def test_builtin_workflow_by_name():
    module = load_workflow(Path(__import__("m2flow.cli").cli.resolve_workflow("grpo")))
    assert hasattr(module, "Config") and hasattr(module, "main")
