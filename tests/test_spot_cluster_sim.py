"""The emulated cluster of benchmarks/spot_cluster_sim.py: the paper's baselines, Algorithm 1's
memory on a constant pool, migration vs recompute, pull vs synchronized weights. Emulated time
(no Ray, no sleeping): deterministic given the seed."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sim():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "spot_cluster_sim", ROOT / "benchmarks" / "spot_cluster_sim.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["spot_cluster_sim"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def verl(sim, nodes=1):
    return sim.System("veRL", "verl", nodes, dispatch="static", rebalance=False, seeding=False)


def test_verl_is_static_and_deterministic(sim):
    wl = sim.Workload("qwen3-8b", seed=0)
    a = sim.Sim(verl(sim), wl).run(math.inf, 2)
    b = sim.Sim(verl(sim), wl).run(math.inf, 2)
    assert [r["step_s"] for r in a] == [r["step_s"] for r in b]  # emulated time: same seed
    r = a[0]
    # colocated: rollout on the reserved engines only, then the training of every token
    assert r["spot_tokens"] == 0 and r["n_bar"] == 0
    assert r["step_s"] == pytest.approx(
        r["last_response"] + r["t_train"] + 2.0 + 2 * 8.19e9 / 200e9, rel=1e-3
    )
    assert r["tokens"] == 1024 * sim.PROMPT_TOKENS + r["reserved_tokens"]


def test_disagg_pushes_weights_and_never_seeds(sim):
    wl = sim.Workload("qwen3-8b", seed=0)
    sy = sim.System(
        "Disagg.BAL",
        "disagg",
        dispatch="shared",
        rebalance=False,
        seeding=False,
        weights="sync",
        instances=6,
    )
    r = sim.Sim(sy, wl).run(math.inf, 1)[0]
    assert r["reserved_tokens"] == 0 and r["spot_tokens"] > 0
    assert r["push_s"] == pytest.approx(sim.transfer_s(sim.throughput_preset("qwen3-8b"), 6, 1))
    assert r["n_bar"] == pytest.approx(6.0)


def test_memory_fires_on_a_constant_pool(sim):
    """Algorithm 1 lines 11-14: with the pool constant during a step, n_bar equals n_hat and
    the memory stores and recalls T_seed."""
    wl = sim.Workload("qwen3-8b", seed=0)
    s = sim.Sim(sim.System("RLBoost", n_prem_fixed=3), wl, [(0.0, 3)])
    rec = s.run(math.inf, 3)
    assert all(r["n_bar"] == pytest.approx(3.0) and r["n_hat"] == 3 for r in rec)
    assert 3 in s.policy.memory and any(r["memory_hit"] for r in rec)


def test_migration_keeps_tokens_that_recompute_loses(sim):
    wl = sim.Workload("qwen3-14b", seed=0)
    steps = {}
    for mode in ("tokens", "recompute"):
        sy = sim.System(mode, n_prem_fixed=6, migration=mode)
        rec = sim.Sim(sy, wl, [(0.0, 6)], [(1, 200.0, "preempt", 3)]).run(math.inf, 2)
        assert rec[1]["preemptions"] == 3 and rec[1]["migrated"] > 0
        steps[mode] = rec[1]["step_s"]
    assert steps["tokens"] < steps["recompute"]


def test_sync_weights_keep_a_new_instance_out_until_the_next_step(sim):
    wl = sim.Workload("qwen3-8b", seed=0)
    got = {}
    for mode in ("pull", "sync"):
        sy = sim.System(mode, weights=mode, n_prem_fixed=1)
        got[mode] = sim.Sim(sy, wl, [(0.0, 0)], [(0, 0.0, "add", 1)]).run(math.inf, 2)
    assert got["sync"][0]["spot_tokens"] == 0 < got["sync"][1]["spot_tokens"]
    assert got["pull"][0]["spot_tokens"] > 0  # pulled on arrival, served this step


def test_fair_share_seeding_leaves_the_instances_their_share(sim):
    """Ours: a reserved engine is dispatched at most N / (engines + instances) requests, so
    the instances (pulling weights when the step starts) still find work in the queue."""
    wl = sim.Workload("qwen3-8b", seed=0)
    spot = {}
    for fair in (False, True):
        sy = sim.System("x", n_prem_fixed=6, fair_seed=fair)
        rec = sim.Sim(sy, wl, [(0.0, 6)]).run(math.inf, 2)
        spot[fair] = rec[1]["spot_tokens"] / (rec[1]["spot_tokens"] + rec[1]["reserved_tokens"])
    assert spot[True] > spot[False] + 0.2


def test_pulls_share_the_training_nodes_frontend_nics(sim):
    m = sim.throughput_preset("qwen3-32b")
    one = sim.transfer_s(m, 1, 1)  # the instance's own 50 Gb/s bounds it
    assert one == pytest.approx(m.latency_s + m.weight_bytes / (50e9 / 8) / 0.8)
    assert sim.transfer_s(m, 6, 1) > sim.transfer_s(m, 6, 2) == pytest.approx(one)
