"""The embodied workflow on tiny configs: real Ray, real Gymnasium CartPole, real MLP policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from m2flow.scheduler.planner import Component, Workflow, condense
from m2flow.workers.embodied.policy import ActorCritic

from m2flow.cli import prepare
from m2flow.placement import Placement
from m2flow.session import Session, StopRun
from m2flow.trace import workflow_graph

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
    module, cfg = prepare(
        str(EMBODIED), TINY_RUN + ["trainer.steps=3", f"trainer.run_dir={run_dir}"], []
    )
    plan = Placement(mode="spatial", groups={"env": [0], "policy": [1], "actor": [2]})
    session = Session(placement=plan, max_steps=1)
    try:
        with session, pytest.raises(StopRun):
            module.main(cfg)
        assert session.groups == {"env": [[0]], "policy": [[1]], "actor": [[2]]}
        edges = workflow_graph()
        groups = {g.name: g for g in session.cluster.groups}
        after = groups["actor"].state_dict().wait()[0]
    finally:
        if session.cluster is not None:
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


def test_runner_completes_under_temporal_plan(cluster, tmp_path):
    run_dir = tmp_path / "temporal"
    module, cfg = prepare(
        str(EMBODIED), TINY_RUN + ["trainer.steps=3", f"trainer.run_dir={run_dir}"], []
    )
    with Session(placement=Placement(mode="temporal")) as session:
        summary = module.main(cfg)
    # Env and policy are data parallel (a rank per device), the actor one rank over all.
    assert session.groups["env"] == session.groups["policy"] == [[0], [1], [2]]
    assert session.groups["actor"] == [[0, 1, 2]]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # Three env ranks of 4 simulators, 24 steps each in all: a random CartPole policy ends
    # episodes after ~20 steps, so some finish.
    assert all(r["env_steps_per_s"] > 0 for r in records)
    assert sum(r["episodes"] for r in records) > 0 and summary["final_recent_return"] > 0


def test_bad_environment_is_a_clear_error(cluster, tmp_path):
    from m2flow.group import WorkerError

    module, cfg = prepare(str(EMBODIED), ["env.id=Pendulum-v1", f"trainer.run_dir={tmp_path}"], [])
    with pytest.raises(WorkerError, match="actions must be Discrete"):
        module.main(cfg)
