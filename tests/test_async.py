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
        (GRPO, ["trainer.max_staleness=1", TIS, "trainer.staleness_policy=drop"],
         "trainer.staleness_policy='drop': only wait"),
        (PPO, ["trainer.max_staleness=1"],
         "the PPO runner's actor has no off-policy correction"),
        (EMBODIED, ["trainer.max_staleness=1"],
         "the embodied runner trains on-policy only"),
    ],
)  # fmt: skip
def test_contradictory_settings_exit_2_before_ray(tmp_path, workflow, args, message):
    code, out, _ = m2flow("run", str(workflow), *args, f"trainer.run_dir={tmp_path / 'r'}")
    assert_one_line_exit_2(code, out, message)


@pytest.mark.e2e
def test_smoke_with_staleness_2_stays_within_the_bound(tmp_path):
    """The issue's must-show: ``-c smoke trainer.max_staleness=2 actor.off_policy.correction=tis
    trainer.steps=6``: every step's ``staleness_max <= 2``, some step's ``>= 1``."""
    run_dir = tmp_path / "run"
    args = ["run", str(GRPO), "-c", "smoke", "trainer.steps=6", "trainer.max_staleness=2", TIS,
            "warm_start.steps=5", f"trainer.run_dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "m2flow.run.cli", *args], capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) >= 1 and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= 2 for r in steps), [r["staleness_max"] for r in steps]
    assert any(r["staleness_max"] >= 1 for r in steps), [r["staleness_max"] for r in steps]
    assert steps[0]["staleness_max"] == 0  # the first step runs alone
    assert all("step_interval_s" in r for r in steps)
    assert [r["weight_version"] for r in steps] == [1, 2, 3, 4, 5, 6]
