"""The spot instances under the runtime's liveness watch (issue 31 item 3; concepts/rlboost.md).

The spot pool's instances are the ranks of one elastic worker group (``rollout.spot``), m2flow
workers registered with the run's lock service as *preemptible* members. On a real local
multi-node Ray cluster (spot nodes are separate raylets, removed for real):

- an instance whose node is preempted mid-step does not fail the run: no wait of the run hears
  of it, the lock service records a preemption with its cause, the manager counts it and moves
  the instance's requests on, and every response of the step arrives once, at its full length;
- an instance whose process crashes (``kill -9`` while its node lives on) is named: the lock
  service records a crash with the cause, the manager names it in its ``errors``, and the pool
  starts a new instance on that node.

The instances run the emulated engine (no model; ``rollout.spot.engine=emulated``), so only
the pool's machinery is under test. Every wait is on an observed state, with a deadline.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict

import pytest
import ray
from helpers import wait_until
from m2flow.workers.rollout.emulated import EmulatedEngine
from m2flow.workers.rollout.exact import GenRequest
from m2flow.workers.rollout.spot.config import EmulatedEngineConfig, SpotPoolConfig
from m2flow.workers.rollout.spot.instance import GROUP
from m2flow.workers.rollout.spot.manager import get_manager

from m2flow.core import liveness
from m2flow.core.cluster import VIRTUAL_DEVICE_RESOURCE, Cluster
from m2flow.core.spot import LocalSpotCluster

pytestmark = pytest.mark.e2e

# 1024-token responses (~6 s each at the model's pace), 16 per block; a weight pull ~5 s
LENGTH = 1024
EMULATED = asdict(EmulatedEngineConfig(length_median=LENGTH, length_sigma=0.0, length_cap=LENGTH,
                                       time_scale=1.0))  # fmt: skip
INSTANCE = {"engine": "emulated", "emulated": EMULATED, "eos_id": 0, "filler_id": 1, "seed": 3}
POOL = {"enabled": True, "engine": "emulated", "t_seed_init": 0.0, "block_tokens": 16,
        "max_batch": 4, "theta": 4, "n_prem_init": 2, "preempt_grace_s": 10.0,
        "rebalance": False}  # fmt: skip


@pytest.fixture(scope="module")
def pool():
    """A head node (1 virtual device, the run's lock service) and 2 spot nodes, and the
    rollout manager with an emulated instance on each, on weights version 0."""
    if ray.is_initialized():
        ray.shutdown()
    local = LocalSpotCluster(2, {VIRTUAL_DEVICE_RESOURCE: 1}, spot_cpus=1)
    local.add_spot(2, timeout=300)
    cluster = Cluster(virtual_devices_per_node=1, offload="never", spot=local)
    cfg = asdict(SpotPoolConfig(**POOL))
    mgr = get_manager(cfg, 1, INSTANCE)
    try:
        ray.get(mgr.start.remote(), timeout=60)
        ray.get(mgr.stage.remote(0, [ray.put(None)]), timeout=60)
        wait_until(lambda: spot_ready(mgr) == 2, 300, "two spot instances on weights 0")
        yield cluster, local, mgr
    finally:
        try:
            ray.get(mgr.shutdown.remote(), timeout=60)
        finally:
            cluster.shutdown()


def metrics(mgr) -> dict:
    return ray.get(mgr.metrics.remote(), timeout=60)


def spot_ready(mgr) -> int:
    return ray.get(mgr.spot_ready.remote(), timeout=60)


def spot(mgr) -> dict:
    return {k: v for k, v in metrics(mgr)["instances"].items() if v["kind"] == "spot"}


def losses(cluster) -> list:
    return ray.get(cluster.lock_service.losses.remote(), timeout=60)


def assert_run_alive(cluster) -> None:
    """No death of the run is recorded: no wait of the run fails (liveness.check)."""
    assert ray.get(cluster.lock_service.deaths.remote(), timeout=60) == []
    liveness.check("the test")


def test_a_crashed_instance_is_named_and_replaced(pool):
    cluster, local, mgr = pool
    before = spot(mgr)
    iid, victim = sorted(before.items())[0]
    handle = ray.get(mgr.__ray_call__.remote(lambda self, i: self.instances[i].handle, iid))
    pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    os.kill(pid, signal.SIGKILL)  # as the kernel's OOM killer; its node lives on

    errors = wait_until(lambda: metrics(mgr)["errors"], 120, "the crash to be named")
    (loss,) = wait_until(lambda: losses(cluster), 60, "the lock service's loss record")
    assert not loss.preempted and loss.death.group == GROUP, loss
    assert f"{loss.death.group}:{loss.death.rank}" == victim["key"]
    assert "ended abruptly" in loss.death.cause, loss.death.cause  # death_cause's words
    # named: the instance, its group and rank, its node, that it crashed and why
    assert len(errors) == 1 and errors[0].startswith(f"{iid}: "), errors
    assert f"worker group '{GROUP}' rank {loss.death.rank} on node" in errors[0], errors
    assert victim["node"][:8] in errors[0] and "crashed" in errors[0], errors
    assert loss.death.cause in errors[0], errors
    m = metrics(mgr)
    assert m["instance_errors"] == 1 and m["preemptions"] == 0, m
    assert_run_alive(cluster)
    # the pool goes on: a new instance (a new rank) on the node, which is still there
    wait_until(lambda: spot_ready(mgr) == 2, 300, "a new instance on the crashed one's node")
    keys = {v["key"] for v in spot(mgr).values()}
    assert victim["key"] not in keys and len(keys) == 2, keys
    assert local.spot_nodes == 2 and local.preemptions == 0


def test_a_preempted_instance_does_not_fail_the_run_and_its_requests_finish(pool):
    cluster, local, mgr = pool
    wait_until(lambda: spot_ready(mgr) == 2, 300, "two spot instances on weights 0")
    lost_before, m0 = len(losses(cluster)), metrics(mgr)
    reqs = [GenRequest(f"1:{p}:{j}", [5, 6, 7], (1, p, j), LENGTH, owner=0)
            for p in range(4) for j in range(2)]  # fmt: skip
    ray.get(mgr.submit.remote(1, 0, reqs), timeout=60)

    def both_hold_partial():
        held = spot(mgr)
        return len(held) == 2 and all(v["partial"] for v in held.values()) and held

    held = wait_until(both_hold_partial, 120, "both instances to hold partial responses")
    iid, victim = sorted(held.items())[-1]
    local.remove_node_id(victim["node"])  # the preemption: its raylet and workers go at once

    groups = []
    deadline = time.monotonic() + 300
    while len(groups) < 4 and time.monotonic() < deadline:
        groups += ray.get(mgr.collect.remote(0, 4, 5.0), timeout=60)
    m = metrics(mgr)
    assert len(groups) == 4, (len(groups), m)
    # the instance's death was a preemption, recorded and counted, and no error
    new = losses(cluster)[lost_before:]
    assert len(new) == 1 and new[0].preempted, new
    assert f"{new[0].death.group}:{new[0].death.rank}" == victim["key"], (new, victim)
    # (no step has ended since the earlier test: its counters are still there)
    assert m["preemptions"] - m0["preemptions"] == 1 and m["preempted_requests"] >= 1, m
    assert m["preempted_tokens"] >= 1 and m["migrated_samples"] >= 1, m
    assert m["instance_errors"] == m0["instance_errors"] and m["errors"] == m0["errors"], m
    assert_run_alive(cluster)
    # every response once, at its full length (continued from its tokens on the other one)
    got = sorted((r for g in groups for r in g), key=lambda r: r.id)
    assert [r.id for r in got] == sorted(r.id for r in reqs)
    engine = EmulatedEngine.from_config(EMULATED, 0, 1, INSTANCE["seed"])
    assert [len(r.tokens) for r in got] == list(engine.targets(got)), got
    assert any(r.moves for r in got)
