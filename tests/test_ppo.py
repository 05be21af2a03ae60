"""The PPO workflow on tiny configs: real Ray, real tiny Qwen2s, real reasoning-gym verifier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from m2flow.workers.algos.ppo import clipped_value_loss, gae, token_rewards
from m2flow.workers.llm import build_char_tokenizer, build_model
from run_dirs import stopped_copy

from m2flow.core.placement import Placement
from m2flow.run.trace import workflow_graph
from m2flow.run.workflow import run_workflow

pytestmark = pytest.mark.e2e

VIRTUAL_DEVICES = 5  # the cluster fixture's devices: one per role for the spatial plan

ROOT = Path(__file__).resolve().parent.parent
PPO = ROOT / "workflows" / "ppo.py"
TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
TINY_RUN = [f"model.{k}={v}" for k, v in TINY_MODEL.items()] + [
    "warm_start.batch_size=16",
    "warm_start.eval_every=1",
    "task.train_size=64",
    "task.val_size=16",
    "task.heldout_size=16",
    "trainer.prompts_per_step=4",
    "trainer.eval_every=2",
    "rollout.n_samples=4",
    "rollout.threads=1",
    "actor.mini_batch_size=8",
    "actor.threads=1",
    "critic.mini_batch_size=8",
    "critic.threads=1",
    "reference.threads=1",
    "reward_model.batch_size=8",
    "reward_model.threads=1",
    "reward_fit.batches=2",
    "reward_fit.heldout_batches=1",
    "reward_fit.epochs=1",
    "algorithm.epochs=1",
]
SPATIAL = Placement(
    mode="spatial",
    groups={"rollout": [0], "reward": [1], "reference": [2], "critic": [3], "actor": [4]},
    granularity={"rollout->reward": 2, "rollout->reference": 2, "rollout->critic": 2},
)
EDGES = {
    ("rollout", "reward"),
    ("rollout", "reference"),
    ("rollout", "critic"),
    ("reward", "critic"),
    ("reference", "critic"),
    ("critic", "actor"),
}


def test_gae_matches_hand_computation():
    # Two steps, the episode ends with the second: A_1 = r_1 - V_1, A_0 = d_0 + g*l*A_1.
    r, v = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]])
    adv, ret = gae(r, v, torch.tensor([[0.0, 1.0]]), torch.tensor([9.0]), gamma=0.9, lam=0.5)
    a1 = 1.0 - 0.25
    a0 = (0.0 + 0.9 * 0.25 - 0.5) + 0.9 * 0.5 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1]])) and torch.allclose(ret, adv + v)
    # Not done: the last value is bootstrapped.
    adv, _ = gae(r[:, :1], v[:, :1], torch.zeros(1, 1), torch.tensor([2.0]), gamma=0.9, lam=0.5)
    assert torch.allclose(adv, torch.tensor([[0.9 * 2.0 - 0.5]]))
    with pytest.raises(ValueError, match="one shape"):
        gae(r, v[:, :1], r, torch.zeros(1))


def test_token_rewards_and_value_clip():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    lp, ref = torch.full((2, 3), -1.0), torch.full((2, 3), -1.5)
    rewards, dones, kl = token_rewards(torch.tensor([1.0, 0.0]), lp, ref, mask, kl_coef=0.1)
    assert torch.equal(dones, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.95, 0.0], [-0.05, 0.0, 0.0]]))
    assert torch.allclose(kl, 0.5 * mask)
    # A new value 1.0 from an old 0.0 is clipped to 0.2: the clipped error (0.8^2) counts.
    loss, m = clipped_value_loss(
        torch.ones(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip=0.2
    )
    assert loss.item() == pytest.approx(0.5 * 0.8**2) and m["vf_clip_frac"] == 1.0


def _records(run_dir: Path) -> list[dict]:
    """metrics.jsonl, the last record of each step (a resumed run appends)."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


def test_one_step_changes_weights_and_traces_the_graph(cluster, tmp_path):
    """One PPO step of the runner under a spatial plan (one device per role, chunks of 2
    prompts). The warm start is skipped, so the weights before the step are the seeded init,
    rebuilt here; the run stops after step 1 with its groups still up."""
    run_dir = tmp_path / "spatial"
    overrides = ["warm_start.steps=0", "trainer.steps=3", f"trainer.run_dir={run_dir}"]
    session = run_workflow(PPO, TINY_RUN + overrides, plan=SPATIAL, max_steps=1,
                           keep_cluster=True)  # fmt: skip
    try:
        assert session.groups == {g: [d] for g, d in SPATIAL.groups.items()}
        assert {(e.src, e.dst) for e in workflow_graph()} == EDGES
        groups = {g.name: g for g in session.cluster.groups}
        actor_after = groups["actor"].get_weights().wait()[0]
        critic_after = groups["critic"].state_dict().wait()[0]
    finally:
        session.cluster.shutdown()
    tok = build_char_tokenizer("0123456789+-=")
    init = build_model(TINY_MODEL, tok, seed=0).state_dict()
    changed = [k for k in init if not torch.equal(init[k], actor_after[k])]
    assert changed, "one PPO step left every actor weight unchanged"
    # The critic started from the actor's transformer and a zero head; both moved.
    assert critic_after["head.weight"].abs().sum() > 0
    backbone = [k for k in critic_after if k.startswith("backbone.")]
    assert any(not torch.equal(critic_after[k], init["model." + k[9:]]) for k in backbone)
    records = _records(run_dir)
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["rm_train_samples"] == 16  # one batch of 4 prompts x 4 samples
    assert records[1]["actor_update_norm"] > 0 and records[1]["critic_update_norm"] > 0


COMPARED = ("reward_mean", "verifier_mean", "rm_mean", "kl", "explained_variance", "vf_loss",
            "pg_loss", "clip_frac", "grad_norm", "actor_update_norm", "critic_update_norm",
            "heldout_accuracy")  # fmt: skip


def test_resumed_run_matches_an_uninterrupted_one(cluster, tmp_path):
    """Temporal on one device (the five groups take turns under its lock). A run stopped
    after step 1 and resumed to step 2 logs the same step-2 metrics as an uninterrupted run:
    every trained group (actor, critic, reward model, reference) and its RNGs are in the
    checkpoint. The stopped run is the uninterrupted run's directory cut back to step 1."""
    whole = tmp_path / "whole"
    one_device = Placement(mode="temporal", default_devices=[0])
    base = TINY_RUN + ["warm_start.steps=2", "trainer.save_every=1"]
    session = run_workflow(PPO, base + ["trainer.steps=2", f"trainer.run_dir={whole}"],
                           plan=one_device)  # fmt: skip
    assert session.groups == {g: [[0]] for g in SPATIAL.groups}
    for g in ("actor", "critic", "reward", "reference"):
        assert (whole / "checkpoints" / "step_000001" / g).is_dir(), g
    parts = stopped_copy(whole, tmp_path / "parts", step=1)
    run_workflow(PPO, base + ["trainer.steps=2", f"trainer.run_dir={parts}", "resume=true"],
                 plan=one_device)  # fmt: skip
    resumed, uninterrupted = _records(parts), _records(whole)
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert resumed[2]["actor_update_norm"] > 0 and resumed[2]["critic_update_norm"] > 0
    for key in COMPARED:
        assert resumed[2][key] == uninterrupted[2][key], key


def test_bad_value_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "m2flow.run.cli", "run", str(PPO), f"trainer.run_dir={tmp_path}"]
        + ["reward_fit.batches=2", "reward_fit.heldout_batches=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "reward_fit.heldout_batches" in proc.stderr and "Traceback" not in proc.stderr
