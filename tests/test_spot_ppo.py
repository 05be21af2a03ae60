"""PPO with the spot rollout pool: the pool's Algorithm 1 gets the PPO actor's idle time.

RLBoost's seeding controller (Algorithm 1, section 4.1) needs the trainer's waits for
micro-batches, ``t_train^wait``; the GRPO actor publishes them as the run event
``m2flow.core.events.TRAINER_WAITS`` at the end of its update, and so does the PPO actor
(``PPOActorWorker.train_ppo``), so the rollout manager reads them at the step's end instead of
falling back to the collect waits of the rollout rank. A tiny PPO run on a local cluster with
one spot node: the run's event bus holds one report of the actor per PPO step, published
after the pool opened it, and the manager's record of the last step is bounded by what the
actor reported (it counts the reported waits after the seeding window only).
"""

from __future__ import annotations

import pytest
import ray
from test_ppo import PPO, TINY_RUN, _records

from m2flow.core import events
from m2flow.core.cluster import NAMESPACE
from m2flow.run.workflow import run_workflow

pytestmark = pytest.mark.e2e

STEPS = 2
RUN = [
    f"trainer.steps={STEPS}",
    "warm_start.steps=0",
    "reward_fit.batches=1",  # the reward model's fit: one rollout batch, none held out
    "reward_fit.heldout_batches=0",
]
SPOT = [
    "rollout.spot.enabled=true",
    "cluster.spot.nodes=1",
    "rollout.spot.t_seed_init=0.0",
    "rollout.spot.n_prem_init=1",
    "rollout.spot.n_prem_min=1",
    "rollout.spot.max_batch=2",
    "rollout.spot.micro_batch_prompts=1",
]


def test_ppo_with_a_spot_plan_reports_the_actors_waits_to_algorithm_1(tmp_path):
    from m2flow.workers.rollout.spot.names import MANAGER_NAME

    run_dir = tmp_path / "ppo"
    # stopped after its last step's record (max_steps), before the run's tail shuts down the
    # cluster: the manager and the run's event bus are still there to read
    session = run_workflow(PPO, TINY_RUN + RUN + SPOT + [f"trainer.run_dir={run_dir}"],
                           max_steps=STEPS, keep_cluster=True)  # fmt: skip
    try:
        bus = ray.get_actor(events.BUS_NAME, namespace=NAMESPACE)
        reports = ray.get(bus.read.remote(events.TRAINER_WAITS, 0), timeout=60)
        manager = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
        pool = ray.get(manager.metrics.remote(), timeout=60)
    finally:
        session.cluster.shutdown()
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    # the pool generated (its counters are in PPO's step records, as in GRPO's)
    assert all(r["spot_reserved_tokens"] + r["spot_spot_tokens"] > 0 for r in records[1:])
    # one report per PPO step, from the actor (the only trainer that reports), each a list of
    # [t0, t1] waits for the step's chunks, the end of the step included
    actor = [v for _, v in reports if v["group"] == "actor"]
    assert len(actor) == STEPS and len(reports) == STEPS, reports
    for v in actor:
        assert v["rank"] == 0 and v["waits"], v
        assert all(t0 <= t1 for t0, t1 in v["waits"]), v
    # the manager closed the last step with the actor's last report: its t_train^wait counts
    # part of those waits (after the seeding window, outside the reserved ranks' generation)
    last = pool["steps"][-1]
    assert last["step"] == STEPS and last["trainer_reported"], last
    reported = sum(t1 - t0 for t0, t1 in actor[-1]["waits"])
    assert 0.0 <= last["t_train_wait"] <= reported + 1e-6, (last, reported)


def test_the_embodied_runner_has_no_rollout_to_put_on_spot_instances():
    """The embodied runner's policy is no LLM rollout and has no spot pool: a spot plan is
    refused before anything starts (the agent runner trains with ``ActorWorker.train``, which
    reports the actor's waits as GRPO's does)."""
    from m2flow.core.config import ConfigError
    from m2flow.run.workflow import prepare

    embodied = PPO.parent / "embodied.py"
    with pytest.raises(ConfigError, match="unknown config key 'rollout'"):
        prepare(str(embodied), ["rollout.spot.enabled=true"])
