"""The GRPO workers and runner on tiny configs: real Ray, real tiny Qwen2, real reasoning-gym.

Checks that could fail: rewards equal the task scorer's on the decoded responses, one step
changes the weights, a resumed run logs the same metrics as an uninterrupted one, and the same
seed ends with the same weights under temporal, spatial and hybrid plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from m2flow.workers.actor.config import ActorOptions
from m2flow.workers.actor.worker import ActorWorker
from m2flow.workers.llm import build_char_tokenizer
from m2flow.workers.llm.tokenizer import decode_responses
from m2flow.workers.reward.worker import RewardWorker
from m2flow.workers.rollout.config import RolloutOptions
from m2flow.workers.rollout.worker import RolloutWorker
from m2flow.workers.scoring.functions import RewardFunction
from m2flow.workers.tasks import TaskDataset
from prompts import task_prompts
from run_dirs import stopped_copy
from safetensors.torch import load_file

from m2flow import Channel, Fanout, sync_weights
from m2flow.core.config import ConfigError
from m2flow.core.placement import Placement
from m2flow.run.workflow import load_workflow, prepare, resolve_workflow, run_workflow

pytestmark = pytest.mark.e2e

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
TOKENIZER = {"name": "char", "alphabet": ALPHABET}  # the character tokenizer's spec
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


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl, the last record of each step (a resumed run appends)."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


@pytest.fixture(scope="class")
def producers(cluster):
    """Rollout and reward on device 0, shared by the worker tests of one class (each launch is a
    process importing torch); each test sets the rollout's chunk size (the plan's granularity,
    read per call) and launches its own actor."""
    rollout = RolloutWorker.launch(
        cluster, [0], name="g_rollout", model=TINY_MODEL, tokenizer=TOKENIZER,
        options=RolloutOptions(n_samples=4, max_new_tokens=4, temperature=1.0, threads=1),
    )  # fmt: skip
    reward = RewardWorker.launch(cluster, [0], name="g_reward", tokenizer=TOKENIZER)
    try:
        yield rollout, reward
    finally:
        cluster.placement = None
        for g in (rollout, reward):
            g.shutdown()


def _launch_actor(cluster, prefix: str, granularity: int):
    """The actor on device 0 (mini-batches of 8 for prefix ``t``, else streaming); the rollout
    chunks ``granularity`` prompts from now on."""
    cluster.placement = Placement(default_granularity=granularity)
    return ActorWorker.launch(
        cluster, [0], name=f"{prefix}_actor", model=TINY_MODEL, tokenizer=TOKENIZER,
        options=ActorOptions(
            lr=1e-2, temperature=1.0, kl_coef=0.1, recompute_old_logprobs=True, threads=1,
            **({"mini_batch_size": 8, "micro_batch_size": 4} if prefix == "t" else {}),
        ),
    )  # fmt: skip


class TestWorkers:
    """The workers without a runner (rollout and reward shared, one actor per test)."""

    def test_rollout_reward_train_changes_weights(self, cluster, producers):
        """One GRPO step through the real workers: the rollout streams 2 chunks, the rewards are
        exactly the task scorer's on the decoded responses, and the update changes the weights."""
        rollout, reward = producers
        actor = _launch_actor(cluster, "t", granularity=2)
        try:
            assert sync_weights(actor, rollout) == 0
            prompts, rollouts, scored, copy = (Channel.create(f"t_{n}") for n in "prsc")
            tok = build_char_tokenizer(ALPHABET)
            train = TaskDataset(TASK["name"], TASK["config"], seed=1, size=8)
            prompts.put_many(task_prompts(train, tok, 4, seed=0, step=1))
            before = actor.get_weights().wait()[0]
            gen = rollout.generate(prompts, rollouts, 4)
            rew = reward.score(rollouts, Fanout(scored, copy))
            upd = actor.train(scored)
            (g_out,), (r_out,), a_out = gen.wait(), rew.wait(), upd.wait()
            after = actor.get_weights().wait()[0]

            chunks = [copy.get(timeout=60) for _ in range(2)]  # 4 prompts in chunks of 2
            assert copy.qsize() == 0 and sorted(c.num_samples for c in chunks) == [8, 8]
            rewards, expected = [], []
            for c in chunks:
                b = c.batch
                texts = decode_responses(build_char_tokenizer(ALPHABET), b["response_ids"],
                                         b["response_mask"])  # fmt: skip
                entries = c.row_entries()
                expected += RewardFunction("reasoning_gym")(texts, entries).scores
                rewards += b["rewards"].tolist()
            assert rewards == pytest.approx(expected, abs=1e-6)
            assert r_out["reward_mean"] == pytest.approx(sum(expected) / len(expected))
            assert g_out["samples"] == r_out["samples"] == a_out["samples"] == 16
            assert a_out["stale"] == 0
            # Groups with one reward for all samples are dropped (no signal); the step must still
            # have trained on some, or the weight check below would test nothing.
            assert a_out["trained_samples"] > 0
            changed = [k for k in before if not torch.equal(before[k], after[k])]
            assert changed, "one GRPO step left every weight unchanged"
            assert all(torch.isfinite(v).all() for v in after.values())
        finally:
            cluster.placement = None
            actor.shutdown()

    def test_streaming_actor_trains_queued_chunks_as_one_part(self, cluster, producers):
        """Chunks already queued when the actor comes for data are trained on together: two
        scored chunks waiting in the channel make one forward/backward part, not two; and the
        actor reads until the reward's end of step without being told how many chunks come."""
        rollout, reward = producers
        actor = _launch_actor(cluster, "q", granularity=4)
        try:
            prompts, rollouts, scored = (Channel.create(f"q_{n}") for n in ("p", "r", "s"))
            tok = build_char_tokenizer(ALPHABET)
            train = TaskDataset(TASK["name"], TASK["config"], seed=1, size=8)
            prompts.put_many(task_prompts(train, tok, 8, seed=0, step=1))
            rollout.generate(prompts, rollouts, 8).wait()
            reward.score(rollouts, scored).wait()
            assert scored.qsize() == 2  # both chunks wait for the actor
            out = actor.train(scored).wait()  # rank 0's (collect="rank0")
            assert out["samples"] == 32 and scored.qsize() == 0
            # One rollout rank: the seeds fix the data, and it has groups with mixed rewards.
            assert out["trained_samples"] > 0 and out["parts"] == 1
        finally:
            cluster.placement = None
            actor.shutdown()


COMPARED = ("reward_mean", "sample_accuracy", "response_length", "clip_frac",
            "heldout_accuracy", "weight_version")  # fmt: skip
# Equal to float32 rounding only: the rollout's logprobs (the ratio's old side) differ by an
# ulp (2.4e-7 measured) with the chunk a prompt is generated in, and which rollout rank takes
# which prompts is a race. Tokens, hence rewards, do not depend on it.
ROUNDED = ("loss", "grad_norm")


PLACEMENTS = {
    # One runner, three plans: every group on each of devices 0-1 (two rollout ranks racing
    # for prompts; 5 worker processes, not 7 on all three); every group on its own device,
    # streamed in chunks of 1 prompt; rollout and reward time-sharing device 0 while the actor
    # trains on devices 1-2 (a temporal part inside a spatial split).
    "temporal": Placement(mode="temporal", default_devices=[0, 1]),
    "spatial": Placement(
        mode="spatial",
        groups={"rollout": [0], "reward": [1], "actor": [2]},
        granularity={"rollout->reward": 1, "reward->actor": 1},
    ),
    "hybrid": Placement(
        mode="hybrid",
        groups={"rollout": [0], "reward": [0], "actor": [1, 2]},
        granularity={"rollout->reward": 2, "reward->actor": 4},
    ),
}
EXPECTED_RANKS = {
    "temporal": {"rollout": [[0], [1]], "reward": [[0], [1]], "actor": [[0, 1]]},
    "spatial": {"rollout": [[0]], "reward": [[1]], "actor": [[2]]},
    "hybrid": {"rollout": [[0]], "reward": [[0]], "actor": [[1, 2]]},
}
#: Largest weight difference allowed between plans after the steps below: the chunks of a step
#: are summed in another order (gradient accumulation per part, padding per chunk), which moves
#: fp32 results by ~1e-7 relative per operation; measured differences are in the notes.
PLAN_ATOL = 1e-4
# A longer warm start than TINY_RUN's: mixed rewards within groups, so the steps train. A
# checkpoint after every step: the resume test below stops the temporal run after step 1.
PLAN_RUN = TINY_RUN + [
    "trainer.steps=2",
    "warm_start.steps=150",
    "actor.mini_batch_size=0",
    "trainer.save_every=1",
]


@pytest.fixture(scope="module")
def temporal_run(cluster, tmp_path_factory):
    """The GRPO runner under the temporal plan (2 steps), shared by the plan and the resume
    tests (one warm start and 5 worker processes, not two of each): ``(session, run_dir)``."""
    run_dir = tmp_path_factory.mktemp("temporal") / "run"
    session = run_workflow(
        GRPO, PLAN_RUN + [f"trainer.run_dir={run_dir}"], plan=PLACEMENTS["temporal"]
    )
    return session, run_dir


def test_workflow_trains_checkpoints_and_resumes_identically(temporal_run, tmp_path):
    """A run stopped after step 1 and resumed to step 2 logs the same step-2 metrics as the
    uninterrupted 2-step run (same seed): checkpoints hold every state the run needs, and
    sampling depends only on (seed, step, prompt, sample, position). The stopped run is the
    uninterrupted run's directory cut back to step 1 (one warm start, not two). Two of the
    three devices: two rollout ranks race for prompts."""
    first, whole = temporal_run
    two = PLACEMENTS["temporal"]
    assert first.groups["rollout"] == [[0], [1]]
    records = _records(whole)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0]["phase"] == "warm_start" and "heldout_accuracy" in records[0]
    assert first.result["final_accuracy"] == records[2]["heldout_accuracy"]
    assert records[2]["grad_norm"] > 0  # the compared step trained
    assert (whole / "checkpoints" / "step_000001" / "actor" / "actor_state.pt").is_file()
    assert not list((whole / "checkpoints").glob("*.partial"))
    parts = stopped_copy(whole, tmp_path / "parts", step=1)

    # A fresh start into a run dir with checkpoints is refused before anything starts.
    with pytest.raises(ConfigError, match="--resume"):
        prepare(str(GRPO), PLAN_RUN + [f"trainer.run_dir={parts}"])
    run_workflow(GRPO, PLAN_RUN + [f"trainer.run_dir={parts}", "resume=true"], plan=two)
    resumed, uninterrupted = _records(parts), _records(whole)
    assert [r["step"] for r in resumed] == [0, 1, 2]  # no second warm start
    for key in COMPARED:
        assert resumed[2][key] == uninterrupted[2][key], key
    for key in ROUNDED:
        assert resumed[2][key] == pytest.approx(uninterrupted[2][key], rel=1e-5, abs=1e-7), key


def test_same_runner_same_weights_under_each_plan(temporal_run, tmp_path):
    """The unchanged runner under temporal, spatial and hybrid placements: groups land on the
    planned devices, the rollout streams the planned chunks, and -- with per-sample seeded
    sampling -- the same seed ends with the same weights (within ``PLAN_ATOL``)."""
    weights = {}
    for mode, placement in PLACEMENTS.items():
        if mode == "temporal":
            session, run_dir = temporal_run
        else:
            run_dir = tmp_path / mode
            session = run_workflow(GRPO, PLAN_RUN + [f"trainer.run_dir={run_dir}"], plan=placement)
        assert session.groups == EXPECTED_RANKS[mode]
        assert session.weight_versions == {"rollout": 2}
        records = _records(run_dir)
        assert [r["step"] for r in records] == [0, 1, 2]
        assert any(r["grad_norm"] > 0 for r in records[1:])  # some step trained
        calls = [c for c in session.calls if c.group == "rollout" and c.method == "generate"]
        assert len(calls) == 2
        weights[mode] = load_file(run_dir / "checkpoints/step_000002/actor/model.safetensors")
    ref = weights["temporal"]
    for mode in ("spatial", "hybrid"):
        diff = max(float((weights[mode][k] - ref[k]).abs().max()) for k in ref)
        print(f"max |w_{mode} - w_temporal| = {diff:.3g}")
        assert diff <= PLAN_ATOL, f"{mode}: weights differ from temporal by {diff:.3g}"


def test_builtin_workflow_by_name():
    module = load_workflow(resolve_workflow("grpo"))
    assert hasattr(module, "Config") and hasattr(module, "main")


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["rollout.engine=bogus"], "rollout.engine must be hf or vllm"),
        (["rollout.engine=vllm"], r"head dimension >= 64 .*model.num_attention_heads=2"),
        (
            [
                "rollout.engine=vllm",
                "model.num_attention_heads=2",
                "rollout.spot.enabled=true",
                "rollout.spot.engine=emulated",
            ],
            r"rollout.spot.engine=emulated .*rollout.engine=hf",
        ),  # fmt: skip
        (["actor.engine=bogus"], "actor.engine must be torch or megatron"),
    ],
)
def test_engine_config_errors_name_the_fix(overrides, needle, tmp_path):
    """Engine choices the config cannot run are refused before anything starts."""
    with pytest.raises(ConfigError, match=needle):
        prepare(str(GRPO), [*overrides, f"trainer.run_dir={tmp_path}"])
