"""Asynchronous training from the command line (issue 32 items 1 and 5): contradictory settings
are one-line errors before Ray starts, and the smoke run with ``trainer.max_staleness=2`` keeps
every trained token within two versions of the weights that sampled it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import GRPO, ROOT, assert_one_line_exit_2, m2flow

PPO = ROOT / "workflows" / "ppo.py"
EMBODIED = ROOT / "workflows" / "embodied.py"
TIS = "actor.off_policy.correction=tis"


@pytest.mark.parametrize(
    "workflow,args,message",
    [
        (GRPO, ["trainer.max_staleness=2", "actor.off_policy.correction=none"],
         "trainer.max_staleness=2 with actor.off_policy.correction=none: stale tokens"),
        (GRPO, ["trainer.max_staleness=auto"],
         "trainer.max_staleness=auto (may choose K >= 1) with actor.off_policy.correction=none"),
        (GRPO, ["trainer.max_staleness=-1"],
         "trainer.max_staleness=-1: give an integer K >= 0"),
        (GRPO, ["trainer.max_staleness=1.5"],
         "trainer.max_staleness=1.5: give an integer K >= 0"),
        (GRPO, ["trainer.max_staleness=soon"],
         "trainer.max_staleness='soon': give an integer K >= 0"),
        (GRPO, ["rollout.partial=true"],
         "rollout.partial=true with trainer.max_staleness=0"),
        (GRPO, ["trainer.max_staleness=1", TIS, "rollout.spot.enabled=true"],
         "with rollout.spot.enabled: the spot pool's manager"),
        (GRPO, ["trainer.staleness_policy=drop"],
         "trainer.staleness_policy=drop with trainer.max_staleness=0"),
        (GRPO, ["trainer.max_staleness=1", TIS, "trainer.staleness_policy=later"],
         "trainer.staleness_policy='later': wait (a step starts"),
        (GRPO, ["actor.off_policy.max_lag=-1"], "actor.off_policy.max_lag=-1: an integer >= 0"),
        (PPO, ["trainer.max_staleness=1"],
         "the PPO runner's actor has no off-policy correction; set "
         "actor.off_policy.allow_uncorrected=true"),
        (PPO, ["actor.off_policy.correction=tis"], "the PPO actor has no correction"),
        (PPO, ["trainer.max_staleness=1", "actor.off_policy.allow_uncorrected=true",
               "trainer.staleness_policy=drop"], "the PPO runner's actor drops no samples"),
        (EMBODIED, ["trainer.max_staleness=1"],
         "the embodied runner trains on-policy only"),
    ],
)  # fmt: skip
def test_contradictory_settings_exit_2_before_ray(tmp_path, workflow, args, message):
    code, out, _ = m2flow("run", str(workflow), *args, f"trainer.run_dir={tmp_path / 'r'}")
    assert_one_line_exit_2(code, out, message)


#: small batches, small splits, no evaluation or checkpoint but the last step's (each flushes the
#: pipeline), every group trained (a step of flat groups logs no staleness)
SMALL = ["warm_start.steps=5", "warm_start.batch_size=16", "task.train_size=200",
         "task.val_size=8", "task.heldout_size=8", "trainer.prompts_per_step=4",
         "rollout.n_samples=4", "trainer.eval_every=1000", "trainer.save_every=1000",
         "rollout.threads=1", "actor.threads=1"]  # fmt: skip


def _smoke(tmp_path, *overrides: str, workflow: Path = GRPO) -> list[dict]:
    """The smoke run's step records (``metrics.jsonl``, steps >= 1), run by ``m2flow run -c
    smoke`` in a subprocess (Ray sessions started and shut down one after another in a pytest
    worker made a later module's session abort the worker once: SIGABRT)."""
    run_dir = tmp_path / "run"
    args = ["run", str(workflow), "-c", "smoke", *SMALL, *overrides, f"trainer.run_dir={run_dir}"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "m2flow.run.cli", *args], capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("step", 0) >= 1 and "step_s" in r]


@pytest.mark.e2e
def test_smoke_with_staleness_2_stays_within_the_bound(tmp_path):
    """The issue's must-show: ``-c smoke trainer.max_staleness=2 actor.off_policy.correction=tis
    trainer.steps=6``: every step's ``staleness_max <= 2``, some step's ``>= 1``
    (``actor.drop_flat_groups=false``: every step trains tokens, so every step logs its lag)."""
    steps = _smoke(tmp_path, "trainer.steps=6", "trainer.max_staleness=2", TIS,
                   "actor.drop_flat_groups=false")  # fmt: skip
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    lags = [r.get("staleness_max") for r in steps]
    assert None not in lags and all(lag <= 2 for lag in lags), lags
    assert any(lag >= 1 for lag in lags), lags
    assert steps[0].get("staleness_max", 0) == 0  # the first step runs alone
    assert all("step_interval_s" in r for r in steps)
    assert [r["weight_version"] for r in steps] == [1, 2, 3, 4, 5, 6]


@pytest.mark.e2e
def test_drop_policy_trains_no_token_beyond_the_bound(tmp_path):
    """``trainer.staleness_policy=drop``: steps start a step early, the trainer drops what broke
    the bound and counts it; no trained token lags more than K."""
    steps = _smoke(tmp_path, "trainer.steps=5", "trainer.max_staleness=1", TIS,
                   "trainer.staleness_policy=drop", "actor.drop_flat_groups=false")  # fmt: skip
    assert [r["step"] for r in steps] == list(range(1, 6))
    assert all(r["staleness_dropped"] >= 0 for r in steps)
    # a step logs the lag it trained unless the bound dropped all its samples
    lags = [r["staleness_max"] for r in steps if "staleness_max" in r]
    assert lags and all(lag <= 1 for lag in lags), lags


@pytest.mark.e2e
def test_ppo_runs_pipelined_unchanged(tmp_path):
    """The PPO runner (five roles, a fanout) runs with K = 1 as written: its records come in
    step order, each with the pipeline's period."""
    steps = _smoke(tmp_path, "trainer.steps=4", "trainer.max_staleness=1",
                   "actor.off_policy.allow_uncorrected=true", "reward_fit.batches=2",
                   "reward_fit.heldout_batches=1", "reward_fit.epochs=1", "critic.threads=1",
                   "reference.threads=1", "reward_model.threads=1", workflow=PPO)  # fmt: skip
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all("step_interval_s" in r and "pg_loss" in r for r in steps)


def test_auto_takes_the_k_and_placement_the_planner_chose():
    """``plan=auto trainer.max_staleness=auto``: the placement the run gets carries the K of
    the chosen (K, placement) row, the row ``m2flow plan --staleness`` marks."""
    from types import SimpleNamespace

    from m2flow.run.pipeline import staleness_of
    from m2flow.run.planning import (
        _with_staleness,
        load_profile,
        plan_with_remote,
        staleness_from_profile,
    )

    prof = load_profile(ROOT / "benchmarks" / "profiles" / "ppo_4_1_1_1_1.yaml")
    _, placement, spot = plan_with_remote(prof, 64, None, "auto")
    said = []
    chosen = _with_staleness(prof, 64, None, "auto", spot, placement, said.append)
    row = staleness_from_profile(prof, 64, None, "auto", spot).chosen
    assert row.k >= 1  # asynchrony pays on this profile at 64 devices
    assert chosen.max_staleness == row.k
    assert any(f"K={row.k}" in line for line in said)
    trainer = SimpleNamespace(max_staleness="auto")
    assert staleness_of(trainer, SimpleNamespace(placement=chosen)) == (
        row.k, f"trainer.max_staleness=auto: K={row.k}, the plan's")  # fmt: skip
    k, note = staleness_of(trainer, SimpleNamespace(placement=None))
    assert k == 0 and "without plan=auto" in note
