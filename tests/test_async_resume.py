"""Resume keeps the epoch whole under bounded staleness (issue 32 item 6): a GRPO run with
``trainer.max_staleness=2`` is killed with SIGKILL while steps after its checkpoint are in flight
(their prompts already generated and scored), then ``--resume`` runs it to the end. Every prompt
of the epoch is trained exactly once in the final lineage: the checkpoint's steps from the first
run, the later steps from the second (NeMo-RL shipped a resume that silently skipped about 30 %
of an epoch's prompts, the long ones still in flight at the checkpoint).

What "trained in step n" is, observed rather than assumed: the reward function returns an extra
metric ``id<NNN>`` per sample, so step n's record in ``metrics.jsonl`` (written by the driver
only after step n's ``actor.train`` and weight sync returned; ``actor.drop_flat_groups=false``:
every scored sample is in the loss) names the prompts of step n's update. The function also
appends ``(run, id)`` of every sample it scores to a file: what each run scored, in flight or
not. The actor's checkpoint records its ``weight_version``: the updates it holds.

Checked to fail without the flush at checkpoint steps (``flush_at`` of ``evaluates`` only in
``workers/skeleton.py``): the step-4 checkpoint then records data offset 24, not 16, as steps
5 and 6 had drawn their prompts: a resume would skip 8 of the 32 prompts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import wait_until
from m2flow.workers.checkpoint import load_file
from test_spot_processes import marked

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
GRPO = ROOT / "workflows" / "grpo.py"

K, STEPS, PER_STEP, SAMPLES, SAVE_EVERY = 2, 8, 4, 4, 4
PROMPTS = STEPS * PER_STEP  # one epoch
CHECKPOINT = 4  # the kill comes after step CHECKPOINT + 1 is logged, before STEPS

REWARD = """
import json
import os

LOG = {log!r}


def compute_score(data_source, solution_str, ground_truth, extra_info):
    pid = extra_info["id"]
    with open(LOG, "a") as f:  # one short line per call: appends do not interleave
        f.write(json.dumps({{"run": os.environ["ASYNC_RESUME_RUN"], "id": pid}}) + "\\n")
    return {{"score": float(len(solution_str) % 2), "id%03d" % pid: 1.0}}
"""


def records(run_dir: Path) -> list[dict]:
    """``metrics.jsonl``'s whole lines (a line being written is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def ids_of(record: dict) -> set[int]:
    """The prompts whose samples the step's update trained on (the reward's ``id`` metrics)."""
    return {int(k[len("reward/id") :]) for k in record if k.startswith("reward/id")}


def scored(log: Path, run: str) -> list[int]:
    if not log.is_file():
        return []
    calls = [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]
    return [c["id"] for c in calls if c["run"] == run]


def alive(mark: str) -> list[str]:
    """Command lines of the live processes whose environment holds ``mark``."""
    out = []
    for pid in marked(mark):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:120])
        except OSError:
            continue
    return out


def test_kill_mid_pipeline_and_resume_trains_every_prompt_once(tmp_path):
    train = tmp_path / "train.jsonl"
    with open(train, "w") as f:
        for i in range(PROMPTS):  # prompts repeat; the id in extra_info does not
            a, b = (3 * i + 1) % 10, (7 * i + 2) % 10
            row = {"data_source": "ids", "prompt": f"{a}+{b}=", "extra_info": {"id": i},
                   "reward_model": {"ground_truth": str(a + b)}}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    log = tmp_path / "scored.jsonl"
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD.format(log=str(log)))
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "m2flow.run.cli", "run", str(GRPO), "-c", "smoke",
            f"data.train_files={train}", f"reward.function={fn}:compute_score",
            f"trainer.steps={STEPS}", f"trainer.prompts_per_step={PER_STEP}",
            f"rollout.n_samples={SAMPLES}", f"trainer.max_staleness={K}",
            "actor.off_policy.correction=tis", f"trainer.save_every={SAVE_EVERY}",
            "trainer.eval_every=1000", "actor.drop_flat_groups=false", "rollout.threads=1",
            "actor.threads=1", f"trainer.run_dir={run_dir}"]  # fmt: skip
    mark = f"m2flow-async-resume-{os.getpid()}-{tmp_path.name}"

    def env(run: str) -> dict:
        return {**os.environ, "ASYNC_RESUME_RUN": run, "M2FLOW_TEST_MARK": mark,
                "TMPDIR": str(tmp_path)}  # fmt: skip

    # -- run 1: killed after step CHECKPOINT + 1 is logged, with a later step's prompts scored
    console = tmp_path / "run1.out"  # a file, not a pipe: a full pipe would stall the run
    with open(console, "w") as sink:
        first = subprocess.Popen(args, env=env("1"), stdout=sink, stderr=subprocess.STDOUT)
    try:

        def in_flight() -> bool:
            assert first.poll() is None, console.read_text()[-3000:]
            got = records(run_dir)
            if CHECKPOINT + 1 not in {r["step"] for r in got}:
                return False
            recorded = set().union(*map(ids_of, got))
            return bool(set(scored(log, "1")) - recorded)  # a step in flight reached reward

        wait_until(in_flight, timeout=600, what=f"step {CHECKPOINT + 1} logged, a later one "
                   "scored", interval=0.02)  # fmt: skip
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == -signal.SIGKILL
    # the driver's Ray session (GCS, raylet, the workers, the reward function's processes) ends
    # with it: nothing of run 1 scores or writes after this
    left: list[str] = []

    def ended() -> bool:
        left[:] = alive(mark)
        return not left

    try:
        wait_until(ended, timeout=120, what="run 1's processes to end")
    except AssertionError as e:
        raise AssertionError(f"{e}: {left}") from None
    run1 = {r["step"]: r for r in records(run_dir)}
    run1_lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    run1_scored = Counter(scored(log, "1"))
    assert STEPS not in run1, "run 1 finished before the kill: nothing was in flight"
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == [f"step_{CHECKPOINT:06d}"], ckpts  # no step_8, no .partial
    runner = json.loads((run_dir / "checkpoints" / ckpts[0] / "runner.json").read_text())
    # the checkpoint counts exactly the prompts of its steps and holds exactly their updates
    assert runner == {"step": CHECKPOINT, "data": {"epoch": 0, "offset": CHECKPOINT * PER_STEP,
                                                   "size": PROMPTS}}  # fmt: skip
    actor = load_file(run_dir / "checkpoints" / ckpts[0] / "actor" / "actor_state.pt")
    assert actor["weight_version"] == actor["trainer_steps"] == CHECKPOINT
    kept = set().union(*(ids_of(run1[s]) for s in range(1, CHECKPOINT + 1)))
    lost = set(run1_scored) - kept  # scored by run 1 in steps after the checkpoint
    assert ids_of(run1[CHECKPOINT + 1]) < lost  # step 5 logged and a later step's prompts too

    # -- run 2: --resume to the end
    second = subprocess.run([*args, "--resume"], env=env("2"), capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert f"data: resumed at epoch 0, prompt {CHECKPOINT * PER_STEP} of {PROMPTS}" in out, out
    final = records(run_dir)
    assert [r["step"] for r in final] == list(range(STEPS + 1))  # each step's record once
    for r in final[1:]:
        assert "step_interval_s" in r  # K >= 1: the steps ran pipelined
        assert r["staleness_max"] <= K, r  # versions continue from the checkpoint's
        assert len(ids_of(r)) == PER_STEP, r
    # records of the checkpoint's steps are run 1's, unchanged; run 1's later ones are dropped
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines[: CHECKPOINT + 1] == run1_lines[: CHECKPOINT + 1]
    # run 2 started at the checkpoint: it scored the later steps' prompts, each sample once, and
    # nothing of the checkpoint's steps; its first step took run 1's lost step's batch again
    later = set().union(*(ids_of(r) for r in final[CHECKPOINT + 1 :]))
    run2_scored = Counter(scored(log, "2"))
    assert run2_scored == Counter({i: SAMPLES for i in later})
    assert ids_of(final[CHECKPOINT + 1]) == ids_of(run1[CHECKPOINT + 1])
    # the lineage: every prompt of the epoch exactly once, the in-flight ones included
    lineage = Counter(i for r in final[1:] for i in ids_of(r))
    assert lineage == Counter(range(PROMPTS)), sorted(lineage.items())
    assert lost <= later
