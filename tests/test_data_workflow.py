"""Your own data and reward through real workers and the GRPO runner: real Ray, a tiny Qwen2,
JSONL files in veRL's columns, a reward function from a file.

Checks that could fail: the reward worker's rewards are the function's on the decoded
responses (and its extra metrics come back); a failing function stops the step with one error
naming it; a GRPO run on data files logs the function's rewards per step and held-out
accuracy on the val files; a run resumed mid-epoch takes the same next batch and logs the same
metrics as an uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from m2flow.workers.data.files import load_items
from m2flow.workers.data.item import prompt_items
from m2flow.workers.llm import build_char_tokenizer
from m2flow.workers.llm.tokenizer import decode_responses
from m2flow.workers.reward.worker import RewardWorker
from m2flow.workers.rollout.config import RolloutOptions
from m2flow.workers.rollout.worker import RolloutWorker
from run_dirs import stopped_copy
from safetensors.torch import load_file
from test_workflow import ALPHABET, COMPARED, ROUNDED, TINY_MODEL, TINY_RUN, TOKENIZER, _records

from m2flow import Channel, Fanout
from m2flow.core.group import WorkerError
from m2flow.core.placement import Placement
from m2flow.run.recipe import Checkpoints
from m2flow.run.workflow import run_workflow

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"

# Partial credit (0.5 for the right first digit) gives GRPO groups with mixed rewards even
# from random weights. Every call is appended to LOG: the test recomputes each reward.
REWARD = """
import json
import time

LOG = {log!r}


def compute_score(data_source, solution_str, ground_truth, extra_info):
    gold, got = str(ground_truth), solution_str.strip()
    score = 1.0 if got == gold else (0.5 if got[:1] == gold[:1] else 0.0)
    if extra_info.get("explode"):
        raise ValueError("the row broke the scorer")
    if extra_info.get("hang"):
        time.sleep(3600)
    with open(LOG, "a") as f:
        f.write(json.dumps({{"split": extra_info["split"], "index": extra_info["index"],
                            "source": data_source, "solution": solution_str, "gold": gold,
                            "score": score}}) + "\\n")
    return {{"score": score, "length": len(solution_str)}}
"""


def expected_score(solution: str, gold: str) -> float:
    got = solution.strip()
    return 1.0 if got == gold else (0.5 if got[:1] == gold[:1] else 0.0)


def verl_rows(n: int, split: str) -> list[dict]:
    """chain_sum items in veRL's columns, string prompts for the character tokenizer."""
    rows = []
    for i in range(n):
        a, b = (3 * i + 1) % 10, (7 * i + 2) % 10
        rows.append(
            {
                "data_source": f"chain_sum/{split}",
                "prompt": f"{a}+{b}=",
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def write(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reward_file(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A reward function file that logs to its own file; returns ``(function file, log)``."""
    log = tmp_path / f"{name}.jsonl"
    fn = tmp_path / f"{name}.py"
    fn.write_text(REWARD.format(log=str(log)))
    return fn, log


def logged(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def test_reward_worker_scores_with_the_file_function(cluster, tmp_path):
    """Rollout -> reward with reward.function=<file>:compute_score: each reward is the
    function's on the decoded response; its extra metric comes back as [sum, count]; a
    function that raises, or hangs past reward.timeout_s, fails the step with its name, the
    index and the data_source."""
    fn, log = reward_file(tmp_path, "rw")
    tok = build_char_tokenizer(ALPHABET)
    items, _ = load_items(str(write(tmp_path, "t.jsonl", verl_rows(4, "train"))), tok)
    rollout = RolloutWorker.launch(
        cluster, [0], name="f_rollout", model=TINY_MODEL, tokenizer=TOKENIZER,
        options=RolloutOptions(n_samples=4, max_new_tokens=4, temperature=1.0, threads=1),
    )  # fmt: skip
    spec = {"function": f"{fn}:compute_score", "on_error": "raise", "penalty": 0.0, "timeout_s": 3}
    reward = RewardWorker.launch(cluster, [0], name="f_reward", tokenizer=TOKENIZER, reward=spec)
    try:
        prompts, rollouts, scored, copy = (Channel.create(f"f_{n}") for n in "prsc")
        prompts.put_many(prompt_items(items, [2, 0, 3, 1], step=1))
        gen = rollout.generate(prompts, rollouts, 4)
        rew = reward.score(rollouts, Fanout(scored, copy))
        gen.wait()
        (out,) = rew.wait()
        chunk = copy.get(timeout=60)
        b = chunk.batch
        texts = decode_responses(tok, b["response_ids"], b["response_mask"])
        entries = chunk.row_entries()
        expected = [expected_score(t, e["ground_truth"]) for t, e in zip(texts, entries)]
        assert b["rewards"].tolist() == expected and len(expected) == 16
        assert [e["index"] for e in entries[::4]] == [2, 0, 3, 1]  # groups in step order
        assert out["reward_metrics"] == {"length": [float(sum(map(len, texts))), 16]}
        assert out["reward_errors"] == 0 and out["reward_mean"] == sum(expected) / 16
        assert sorted(r["solution"] for r in logged(log)) == sorted(texts)
        while scored.qsize():
            scored.get(timeout=10)

        # A row the function cannot score: the step fails with one error that names it.
        (bad,) = prompt_items(items, [1], step=2)
        bad["entry"]["extra_info"] = {**bad["entry"]["extra_info"], "explode": True}
        prompts.put_many([bad])
        gen = rollout.generate(prompts, rollouts, 1)
        call = reward.score(rollouts, scored)
        gen.wait()
        with pytest.raises(
            WorkerError,
            match=r"compute_score' failed on sample index 1 "
            r"\(data_source 'chain_sum/train'\): ValueError: "
            r"the row broke the scorer",
        ):
            call.wait()  # fmt: skip

        # A row the function hangs on: its process is killed after reward.timeout_s.
        (stuck,) = prompt_items(items, [3], step=3)
        stuck["entry"]["extra_info"] = {**stuck["entry"]["extra_info"], "hang": True}
        prompts.put_many([stuck])
        gen = rollout.generate(prompts, rollouts, 1)
        call = reward.score(rollouts, scored)
        gen.wait()
        with pytest.raises(
            WorkerError,
            match=r"compute_score' failed on sample index 3 "
            r"\(data_source 'chain_sum/train'\): timed out after 3 s",
        ):
            call.wait()  # fmt: skip
    finally:
        for g in (rollout, reward):
            g.shutdown()


FILES_RUN = [
    *TINY_RUN,
    "trainer.prompts_per_step=4",  # 6 training rows: step 2 crosses into epoch 1
    "rollout.n_samples=4",
    "rollout.max_new_tokens=4",
    "actor.drop_flat_groups=false",
    "trainer.eval_every=2",
    "trainer.save_every=1",
]
# One device: one rank per group, 3 worker processes per run instead of 5 (each imports torch);
# two rollout ranks racing for prompts across a resume are test_workflow.py's.
ONE_DEVICE = Placement(mode="temporal", default_devices=[0])


def test_grpo_on_files_with_own_reward_resumes_mid_epoch(cluster, tmp_path):
    """GRPO on data.train_files/val_files (veRL's columns) scored by reward.function: each
    step's reward_mean is the function's mean on the responses it was given, reward/length
    is logged, held-out accuracy is the share of val rows scored 1; stopped after step 2
    (mid-epoch 1) and resumed, step 3 takes the same prompts and logs the same metrics as an
    uninterrupted run."""
    train = write(tmp_path, "train.jsonl", verl_rows(6, "train"))
    val = write(tmp_path, "val.jsonl", verl_rows(4, "val"))
    data = [f"data.train_files={train}", f"data.val_files={val}"]

    def run(name: str, steps: int, resume: bool = False, log_name: str = ""):
        fn, log = reward_file(tmp_path, log_name or name)  # its own log of calls
        over = [
            *FILES_RUN,
            *data,
            f"reward.function={fn}:compute_score",
            f"trainer.steps={steps}",
            f"trainer.run_dir={tmp_path / name}",
        ] + (["resume=true"] if resume else [])
        return run_workflow(GRPO, over, plan=ONE_DEVICE), log  # fmt: skip

    whole, whole_log = run("whole", 3)
    records = _records(tmp_path / "whole")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[0]["steps"] == 0  # no warm start on data files (no targets)
    calls = logged(whole_log)
    for c in calls:  # the function's own scores, recomputed from what it was given
        assert c["score"] == expected_score(c["solution"], c["gold"])
    trained = [c for c in calls if c["split"] == "train"]
    held = [c for c in calls if c["split"] == "val"]
    assert len(trained) == 3 * 16 and len(held) == 3 * 4  # evaluations: steps 0, 2, 3
    for step in (1, 2, 3):
        block = trained[(step - 1) * 16 : step * 16]
        r = records[step]
        assert r["reward_mean"] == pytest.approx(sum(c["score"] for c in block) / 16)
        assert r["reward/length"] == pytest.approx(sum(len(c["solution"]) for c in block) / 16)
        assert "reward_errors" not in r  # on_error=raise: an error would have stopped the run
    for k, step in enumerate((0, 2, 3)):
        block = held[k * 4 : (k + 1) * 4]
        assert sorted(c["index"] for c in block) == [0, 1, 2, 3]
        assert records[step]["heldout_accuracy"] == sum(c["score"] == 1.0 for c in block) / 4
    assert whole.result["final_accuracy"] == records[3]["heldout_accuracy"]
    # Epochs: step 1 and half of step 2 are epoch 0 (each row once), then epoch 1 begins and
    # step 3 ends it. (Compared as sets per step: the order of a step's prompts is the
    # rollout's, which does not matter here.)
    steps = [{c["index"] for c in trained[k * 16 : (k + 1) * 16]} for k in range(3)]
    assert [len(s) for s in steps] == [4, 4, 4]
    rest_of_epoch0 = set(range(6)) - steps[0]
    assert len(rest_of_epoch0) == 2 and rest_of_epoch0 <= steps[1]
    assert (steps[1] - rest_of_epoch0) | steps[2] == set(range(6))

    # Stopped after step 2: the uninterrupted run's directory cut back to that step.
    stopped_copy(tmp_path / "whole", tmp_path / "parts", step=2)
    state = json.loads((tmp_path / "parts/checkpoints/step_000002/runner.json").read_text())
    assert state["data"] == {"epoch": 1, "offset": 2, "size": 6}
    _, parts_log = run("parts", 3, resume=True, log_name="resumed")
    resumed = _records(tmp_path / "parts")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    step3 = sorted(c["index"] for c in logged(parts_log) if c["split"] == "train")
    assert step3 == sorted(c["index"] for c in trained[32:48])  # the same batch
    for key in (*COMPARED, "reward/length"):
        assert resumed[3][key] == records[3][key], key
    for key in ROUNDED:
        assert resumed[3][key] == pytest.approx(records[3][key], rel=1e-5, abs=1e-7), key


# Rewards of 1e308 once the run has written its step-1 checkpoint (in step 2): finite, but
# their mean overflows float32 and would turn every weight into NaN.
HUGE = """
import os


def compute_score(data_source, solution_str, ground_truth, extra_info):
    if os.path.isdir({after!r}):
        return 1e308
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
"""


def test_huge_reward_stops_the_run_and_keeps_the_last_good_checkpoint(cluster, tmp_path):
    """A reward beyond reward.max_abs (1e308, from step 2 on) stops the run with an error
    naming the function; the step-1 checkpoint stays the latest, and its weights are
    finite (before: the run exited 0 with every tensor of its checkpoint NaN)."""
    run_dir = tmp_path / "huge"
    fn = tmp_path / "huge.py"
    fn.write_text(HUGE.format(after=str(run_dir / "checkpoints" / "step_000001")))
    train = write(tmp_path, "train.jsonl", verl_rows(6, "train"))
    val = write(tmp_path, "val.jsonl", verl_rows(4, "val"))
    over = [
        *FILES_RUN,
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"reward.function={fn}:compute_score",
        "trainer.steps=3",
        f"trainer.run_dir={run_dir}",
    ]
    with pytest.raises(
        WorkerError,
        match=rf"reward function '{fn}:compute_score' failed on sample index \d+ \(data_source "
        r"'chain_sum/train'\): returned 1e\+308, beyond reward.max_abs=1e\+06",
    ):
        run_workflow(GRPO, over, plan=ONE_DEVICE)
    step, path = Checkpoints(run_dir).latest()
    assert step == 1
    assert [r["step"] for r in _records(run_dir)] == [0, 1]
    weights = load_file(path / "actor" / "model.safetensors")
    assert weights and all(t.isfinite().all() for t in weights.values())
