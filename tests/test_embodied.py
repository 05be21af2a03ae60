"""The embodied workflow on tiny configs: real Ray, real Gymnasium CartPole, real MLP policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from m2flow.scheduler.plan.planner import Component, Workflow, condense
from m2flow.workers.embodied.policy import ActorCritic

from m2flow.core.config import ConfigError
from m2flow.core.placement import Placement
from m2flow.run.trace import workflow_graph
from m2flow.run.workflow import prepare, run_workflow

pytestmark = pytest.mark.e2e

VIRTUAL_DEVICES = 3  # the cluster fixture's devices: one per group for the spatial plan

EMBODIED = Path(__file__).resolve().parent.parent / "workflows" / "embodied.py"
TINY_RUN = [
    "env.num_envs=4",
    "env.steps=8",
    "policy.hidden=16",
    "algorithm.epochs=2",
    "algorithm.mini_batch_size=16",
    "algorithm.threads=1",
]


def test_one_step_changes_weights_and_traces_the_cycle(cluster, tmp_path):
    """One step under a spatial plan (env, policy, actor on devices 0, 1, 2); the run stops
    after step 1 with its groups still up. The actor's weights before the step are its seeded
    init, rebuilt here."""
    run_dir = tmp_path / "spatial"
    plan = Placement(mode="spatial", groups={"env": [0], "policy": [1], "actor": [2]})
    overrides = TINY_RUN + ["trainer.steps=3", f"trainer.run_dir={run_dir}"]
    session = run_workflow(EMBODIED, overrides, plan=plan, max_steps=1, keep_cluster=True)
    try:
        assert session.groups == {"env": [[0]], "policy": [[1]], "actor": [[2]]}
        edges = workflow_graph()
        groups = {g.name: g for g in session.cluster.groups}
        after = groups["actor"].get_weights().wait()[0]
    finally:
        session.cluster.shutdown()
    # One env rank: 8 steps + 1 bootstrap round trip (each item a [4, 4] observation batch and
    # its answer), then one trajectory.
    items = {(e.src, e.dst): e.items for e in edges}
    assert items == {("env", "policy"): 9, ("policy", "env"): 9, ("env", "actor"): 1}
    # The planner sees the env <-> policy cycle and collapses it into one node.
    comps = [Component(n, lambda d: 1.0, lambda d: 0.0) for n in ("env", "policy", "actor")]
    nodes, node_edges = condense(Workflow(comps, list(items), batch_size=4))
    assert [n.name for n in nodes] == ["env+policy", "actor"] and node_edges == [(0, 1)]

    torch.manual_seed(0)
    before = ActorCritic(4, 2, hidden=16).state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "one PPO step left every policy weight unchanged"
    record = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert record["step"] == 1 and record["env_steps_per_s"] > 0
    assert record["actor_update_norm"] > 0


def _records(run_dir: Path) -> list[dict]:
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step[r["step"]] = r
    return [by_step[k] for k in sorted(by_step)]


def test_runner_completes_under_temporal_plan(cluster, tmp_path):
    run_dir = tmp_path / "temporal"
    session = run_workflow(
        EMBODIED, TINY_RUN + ["trainer.steps=3", f"trainer.run_dir={run_dir}"],
        plan=Placement(mode="temporal"),
    )  # fmt: skip
    # Env and policy are data parallel (a rank per device), the actor one rank over all.
    assert session.groups["env"] == session.groups["policy"] == [[0], [1], [2]]
    assert session.groups["actor"] == [[0, 1, 2]]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    # 3 env ranks x 4 simulators x 8 steps per update; CartPole pays 1 per step, so every
    # finished episode's return is its length (a bookkeeping check that can fail).
    assert all(r["env_steps_per_s"] > 0 for r in records)
    finished = [r for r in records if r["episodes"]]
    assert finished, "no episode ended in 3 x 96 steps of a random CartPole policy"
    assert all(r["episode_return"] == pytest.approx(r["episode_length"]) for r in finished)
    assert session.result["final_recent_return"] == records[-1]["recent_return"]


COMPARED = ("episodes", "episode_return", "recent_return", "pg_loss", "vf_loss", "entropy",
            "approx_kl", "grad_norm", "actor_update_norm")  # fmt: skip


def test_resumed_run_matches_an_uninterrupted_one(cluster, tmp_path):
    """One device (one env rank, one policy rank: no data-dependent routing). A run stopped
    after step 2 and resumed to step 3 logs the same step-3 metrics as an uninterrupted run:
    the checkpoint holds the simulators mid-episode, the policy's sampling RNG and the actor."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    one = Placement(mode="temporal", default_devices=[0])
    base = TINY_RUN + ["trainer.save_every=1"]
    run_workflow(EMBODIED, base + ["trainer.steps=3", f"trainer.run_dir={whole}"], plan=one)
    run_workflow(EMBODIED, base + ["trainer.steps=2", f"trainer.run_dir={parts}"], plan=one)
    with pytest.raises(ConfigError, match="--resume"):
        prepare(EMBODIED, base + ["trainer.steps=3", f"trainer.run_dir={parts}"])
    run_workflow(EMBODIED, base + ["trainer.steps=3", f"trainer.run_dir={parts}",
                                   "resume=true"], plan=one)  # fmt: skip
    resumed, uninterrupted = _records(parts), _records(whole)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in COMPARED:
        assert resumed[2].get(key) == uninterrupted[2].get(key), key


def test_bad_environment_is_a_clear_error(cluster, tmp_path):
    from m2flow.core.group import WorkerError

    with pytest.raises(WorkerError, match="actions must be Discrete"):
        run_workflow(EMBODIED, ["env.id=Pendulum-v1", f"trainer.run_dir={tmp_path}"])


def test_split_cycle_in_sub_batches_matches_the_unsplit_run(cluster, tmp_path):
    """The cycle split across devices (env on 0, policy on 1) with the simulators in two
    sub-batches of 2: every sub-batch goes round on its own, and the run logs the
    same episodes as the same devices without sub-batches (one env rank, one policy rank: the
    policy samples the rows in the same order, each simulator steps as in the vector env)."""
    groups = {"env": [0], "policy": [1], "actor": [2]}
    plain = Placement(mode="spatial", groups=groups)
    split = Placement(mode="hybrid", groups=groups, sub_batches={"env": 2, "policy": 2})
    runs = {}
    for name, plan in (("plain", plain), ("split", split)):
        run_dir = tmp_path / name
        overrides = TINY_RUN + ["trainer.steps=3", f"trainer.run_dir={run_dir}"]
        session = run_workflow(EMBODIED, overrides, plan=plan, max_steps=2, keep_cluster=True)
        try:
            items = {(e.src, e.dst): e.items for e in workflow_graph()}
        finally:
            session.cluster.shutdown()
        runs[name] = (_records(run_dir), items)
    (plain_rec, plain_items), (split_rec, split_items) = runs["plain"], runs["split"]
    # Per step 8 steps + 1 bootstrap round trip, per sub-batch (2 steps).
    assert plain_items[("env", "policy")] == 2 * 9
    assert split_items[("env", "policy")] == split_items[("policy", "env")] == 2 * 2 * 9
    assert [r["step"] for r in split_rec] == [1, 2]
    assert all(r["env_steps_per_s"] > 0 for r in split_rec)
    for a, b in zip(plain_rec, split_rec):
        # The same actions, so the same episodes, exactly; the policy's log-probabilities and
        # values of a 2-row batch may differ from a 4-row one in the last bits (matmul
        # kernels), which the PPO numbers carry.
        for key in ("episodes", "episode_return", "recent_return"):
            assert a.get(key) == b.get(key), key
        for key in COMPARED[3:]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), key
