"""The emulated rollout engine (docs/results/emulation.md): its throughput model, response lengths,
migration, and a step of the real spot pool (RolloutManager, SpotInstance actors on spot nodes,
the reserved seeder) running it.

The pure tests need no Ray; the pool tests share one local multi-node cluster (module fixture).
"""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import ray
from helpers import wait_until
from m2flow.workers.actor.config import ActorOptions
from m2flow.workers.actor.worker import ActorWorker
from m2flow.workers.llm import build_char_tokenizer
from m2flow.workers.rollout.config import RolloutOptions
from m2flow.workers.rollout.emulated import (
    LLAMA31_8B,
    LLAMA33_70B,
    PRESETS,
    EmulatedEngine,
    ResponseLengths,
    ThroughputModel,
    TokenRuns,
    throughput_preset,
)
from m2flow.workers.rollout.engines import HfEngine
from m2flow.workers.rollout.exact import GenRequest
from m2flow.workers.rollout.spot.config import SpotPoolConfig
from m2flow.workers.rollout.spot.names import MANAGER_NAME
from m2flow.workers.rollout.worker import RolloutWorker
from test_spot import metrics, pool_step

from m2flow import sync_weights
from m2flow.core.cluster import NAMESPACE, VIRTUAL_DEVICE_RESOURCE, Cluster
from m2flow.core.spot import LocalSpotCluster

EOS, FILL = 2, 7


def engine(model: str = "qwen3-8b", sleep=lambda s: None, **kw) -> EmulatedEngine:
    return EmulatedEngine(throughput_preset(model), ResponseLengths(), EOS, FILL, seed=3,
                          sleep=sleep, **kw)  # fmt: skip


def requests(n_groups: int = 4, samples: int = 8, step: int = 0, cap: int = 16384) -> list:
    return [GenRequest(f"{step}:{g}:{j}", [1] * 200, (step, g, j), cap)
            for g in range(n_groups) for j in range(samples)]  # fmt: skip


def run_to_end(eng: EmulatedEngine, reqs: list, block: int) -> int:
    blocks = 0
    while any(not r.done for r in reqs):
        eng.step(reqs, block, version=0, label="e")
        blocks += 1
    return blocks


# -- throughput model -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_decode_throughput_plateaus_with_batch_and_context_slows_it(name):
    m = PRESETS[name]
    b = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    tps = m.decode_tokens_per_s(b, 4000)
    assert np.all(np.diff(tps) > 0)  # more requests, more tokens/s ...
    gain = tps[1:] / tps[:-1]  # ... doubling the batch nearly doubles it while weights dominate
    assert gain[0] > 1.9 and gain[-1] < 1.3  # ... and barely helps once KV reads dominate
    # the plateau B (90 % of the best) comes sooner at long context (RLBoost's calibration)
    assert m.plateau(16000) < m.plateau(4000) < m.plateau(500)
    # a longer context is slower at any batch; a lone request is weight-read bound
    assert np.all(m.decode_tokens_per_s(b, 16000) < m.decode_tokens_per_s(b, 1000))
    assert m.decode_step_s(1, 100) == pytest.approx(
        m.weight_bytes / m.bandwidth + m.step_overhead_s, rel=0.02
    )


# TensorRT-LLM perf overview (H100 SXM, FP8, output tokens/s; docs/results/emulation.md):
# (ISL, OSL) -> Llama-3.1-8B TP1, Llama-3.3-70B TP2
PUBLISHED = {
    (128, 2048): (22714, 6651),
    (128, 4096): (14325, 4199),
    (1000, 1000): (15220, 4205),
    (2048, 2048): (9305, 3082),
    (5000, 500): (3459, 898),
    (20000, 2000): (1351, 437),
}


def test_calibration_reproduces_published_h100_throughput():
    fp8 = {"weight_bytes_per_param": 1, "kv_bytes_per_elem": 1, "mem_util": 0.9}
    m8 = ThroughputModel(LLAMA31_8B, tp=1, **fp8)
    m70 = ThroughputModel(LLAMA33_70B, tp=2, **fp8)
    for (isl, osl), (t8, t70) in PUBLISHED.items():
        assert m8.steady_state_tps(isl, osl) == pytest.approx(t8, rel=0.10), (isl, osl)
        assert m70.steady_state_tps(isl, osl) == pytest.approx(t70, rel=0.20), (isl, osl)


def test_prefill_and_weight_transfer_times():
    m = PRESETS["qwen3-8b"]
    # compute-bound prefill: 2 P n FLOPs plus causal attention; one call shares the weight read
    n = 8192
    attn = 2 * m.shape.layers * m.shape.q_heads * m.shape.head_dim * n * n
    assert m.prefill_s(n) == pytest.approx((2 * m.params * n + attn) / m.flops
                                           + m.step_overhead_s)  # fmt: skip
    assert m.prefill_s([n, n]) < 2 * m.prefill_s(n)
    assert m.prefill_s(1000, cached=8000) > m.prefill_s(1000)  # attends to the cached tokens
    assert m.prefill_s([]) == 0.0
    # 16.4 GB of BF16 weights over the spot instance's 50 Gb/s NIC at 80 %, + latency
    assert m.weight_transfer_s() == pytest.approx(2.0 + m.weight_bytes / (50e9 / 8 * 0.8))
    assert m.weight_bytes == pytest.approx(16.4e9, rel=0.01)
    assert PRESETS["qwen3-32b"].params == pytest.approx(32.8e9, rel=0.01)
    assert PRESETS["qwen3-14b"].params == pytest.approx(14.8e9, rel=0.01)


# -- response lengths -------------------------------------------------------------------------


def test_lengths_are_deterministic_long_tailed_and_capped():
    dist = ResponseLengths()  # median 3000, sigma 1.0, cap 16384
    keys = [(s, g, j) for s in range(2) for g in range(128) for j in range(8)]  # 2 paper steps
    a, b = dist.lengths(0, keys), dist.lengths(0, keys)
    assert np.array_equal(a, b)  # a function of (seed, step, prompt, sample) alone
    assert dist.length(0, keys[5]) == a[5]
    assert not np.array_equal(a, dist.lengths(1, keys))  # the seed matters
    assert a.max() == 16384 and a.min() >= 1
    med, p99 = np.median(a), np.percentile(a, 99)
    assert 2700 < med < 3300 and p99 >= 5 * med  # long tail: p99 >> median
    assert 0.02 < np.mean(a == 16384) < 0.08  # a few % cut at the cap (4.5 % expected)
    assert dist.quantile(0.5) == pytest.approx(3000)


# -- the engine -------------------------------------------------------------------------------


def test_engine_generates_each_drawn_length_and_sleeps_the_modelled_time():
    slept = []
    eng = engine(sleep=slept.append, time_scale=20.0)
    reqs = requests(cap=6000)
    blocks = run_to_end(eng, reqs, block=256)
    want = np.minimum(ResponseLengths().lengths(3, [r.key for r in reqs]), 6000)
    for r, n in zip(reqs, want):
        assert len(r.tokens) == len(r.logprobs) == n and r.done
        ends_early = n < 6000  # EOS when the response ended before the cap, else cut there
        assert list(r.tokens[-1:]) == [EOS if ends_early else FILL]
        assert set(r.tokens[:-1]) <= {FILL} and set(r.logprobs) == {0.0}
        assert r.by == {"e": n} and r.weight_version == 0
    assert eng.tokens == sum(want) and len(slept) == blocks == eng.steps
    assert sum(slept) == pytest.approx(eng.emulated_s / 20.0)
    # the first block prefills the 32 prompts; the rest are decode iterations of that model
    assert eng.emulated_s > eng.model.prefill_s([200] * 32)


def test_migrated_request_finishes_with_the_same_length_and_costs_a_prefill():
    reqs_a, reqs_ref = requests(), requests()
    a, b, ref = engine(), engine(), engine()
    for _ in range(3):  # 3 blocks on engine a, then a preemption: the partials move to b
        a.step(reqs_a, 256, version=0, label="a")
    moved = pickle.loads(pickle.dumps(reqs_a))  # what the manager holds (Ray pickles it)
    assert all(type(r.tokens) is TokenRuns for r in moved)
    partial = [r for r in moved if not r.done]
    assert partial, "every response ended in 3 blocks: nothing to migrate"
    ctx = [200 + len(r.tokens) for r in partial]
    # the same block on a (their KV cache is there) and on b (it is not): b pays one prefill
    t_a, t_b = a.emulated_s, b.emulated_s
    a.step(pickle.loads(pickle.dumps(reqs_a)), 256, version=0)
    b.step(moved, 256, version=0, label="b")
    extra = (b.emulated_s - t_b) - (a.emulated_s - t_a)
    assert extra == pytest.approx(b.model.prefill_s(ctx), rel=1e-9)
    run_to_end(b, moved, 256)
    run_to_end(ref, reqs_ref, 256)  # the same requests, never moved
    for m, r in zip(moved, reqs_ref):
        assert list(m.tokens) == list(r.tokens) and list(m.logprobs) == list(r.logprobs)
        assert m.done and sum(m.by.values()) == len(m.tokens)


def test_kv_cache_capacity_bounds_the_running_batch():
    base = PRESETS["qwen3-8b"]
    mem = (base.weight_bytes + 1500 * base.kv_bytes_per_token) / (base.tp * base.hw.hbm_bytes)
    small = throughput_preset("qwen3-8b", mem_util=mem)  # KV cache for ~1500 tokens
    eng = EmulatedEngine(small, ResponseLengths(median=2000), EOS, FILL, sleep=lambda s: None)
    reqs = requests(n_groups=1)  # 8 x (200 prompt + 64) tokens > 1500
    made = eng.step(reqs, 64, version=0)
    advanced = [r for r in reqs if r.tokens]
    assert advanced == reqs[: len(advanced)] and len(advanced) == 1500 // 264
    assert made == 64 * len(advanced)  # the others wait (and will prefill again)
    assert set(eng.cached) == {r.id for r in advanced}


def test_engine_step_costs_little_cpu():
    """Many emulated instances share one CPU: a 256-request block is bookkeeping, not compute."""
    eng = engine()
    reqs = requests(n_groups=32)
    eng.step(reqs, 128, version=0)  # warm up (imports)
    t0 = time.process_time()
    for _ in range(10):
        eng.step(reqs, 128, version=0)
    per_block = (time.process_time() - t0) / 10
    assert per_block < 0.05, f"{per_block * 1e3:.1f} ms CPU per block"
    assert eng.emulated_s / eng.steps > 1.0  # against > 1 s of modelled GPU time per block


def test_token_runs_pickle_compactly_and_exactly():
    t = TokenRuns()
    t.add(FILL, 16000)
    t.add(EOS, 1)
    assert len(pickle.dumps(t)) < 200 and pickle.loads(pickle.dumps(t)) == t
    t.append(9)  # changed by hand: still exact, encoded from its items
    back = pickle.loads(pickle.dumps(t))
    assert back == t and back[-3:] == [FILL, EOS, 9]
    back.add(9, 2)
    assert back[-3:] == [9, 9, 9] and len(back) == 16004


def test_config_selects_and_checks_the_emulated_engine():
    cfg = SpotPoolConfig(
        enabled=True,
        engine="emulated",
        emulated={"model": "Qwen3-32B", "time_scale": 5, "length_median": 9},
    )
    cfg.check()
    e = EmulatedEngine.from_config(vars(cfg.emulated), EOS, FILL, seed=1)
    assert e.model == PRESETS["qwen3-32b"] and e.time_scale == 5 and e.lengths.median == 9
    for bad, msg in [({"model": "gpt"}, "emulated.model"), ({"time_scale": 0}, "time_scale")]:
        with pytest.raises(ValueError, match=msg):
            SpotPoolConfig(engine="emulated", emulated=bad).check()
    with pytest.raises(ValueError, match="engine"):
        SpotPoolConfig(engine="nonesuch").check()


class SpotCapableEngine(EmulatedEngine):
    """An engine of a third party that continues requests block by block (``block_steps``)."""


class GroupsOnlyEngine(HfEngine):
    """An engine of a third party that samples whole groups only (no ``step``)."""


def test_spot_engine_is_asked_of_the_registry_not_a_fixed_list():
    """``rollout.spot.engine`` is any rollout engine that serves spot instances, as its class
    says (``block_steps``): built-ins and engines by import path alike; one that cannot is
    refused naming the engine, why, and the engines to pick instead."""
    for name in ("exact", "emulated", "test_emulated:SpotCapableEngine"):
        cls = SpotPoolConfig(engine=name).check_engine()
        assert cls.block_steps, name
        SpotPoolConfig(engine=name).check()
    for name, path in [("hf", "m2flow.workers.rollout.engines.HfEngine"),
                       ("test_emulated:GroupsOnlyEngine", "test_emulated.GroupsOnlyEngine"),
                       ("spot", "m2flow.workers.rollout.spot.pool.SpotPoolEngine")]:  # fmt: skip
        with pytest.raises(ValueError) as e:
            SpotPoolConfig(engine=name).check()
        msg = str(e.value)
        assert f"rollout.spot.engine={name!r} ({path}) cannot serve spot instances" in msg, msg
        assert "block_steps is False" in msg and "Set rollout.spot.engine to " in msg, msg
        assert "exact" in msg.split("Set")[1] and "emulated" in msg.split("Set")[1], msg
        assert " hf " not in msg.split("Set")[1], msg  # the fix lists only engines that can


# -- the real pool with emulated engines ------------------------------------------------------

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64}  # fmt: skip
ALPHABET = "0123456789+-="
TOKENIZER = {"name": "char", "alphabet": ALPHABET}  # the character tokenizer's spec
SAMPLES, MAX_NEW, SEED, SPOT_NODES = 8, 48, 7, 2
EMU = {"model": "qwen3-8b", "time_scale": 2.0, "length_median": 20.0, "length_sigma": 1.0,
       "length_cap": 64, "prompt_tokens": 300}  # fmt: skip
SPOT = {"enabled": True, "engine": "emulated", "emulated": EMU, "t_seed_init": 0.3,
        "block_tokens": 8, "micro_batch_prompts": 4, "theta": 4, "max_batch": 16,
        "n_prem_min": SPOT_NODES, "n_prem_max": SPOT_NODES}  # fmt: skip


@pytest.fixture(scope="module")
def pool():
    """A head node (the reserved rank, 1 virtual device) and 2 spot nodes, each running an
    emulated instance; the actor is the weight source."""
    if ray.is_initialized():
        ray.shutdown()
    local = LocalSpotCluster(2, {VIRTUAL_DEVICE_RESOURCE: 1}, spot_cpus=1)
    local.add_spot(SPOT_NODES)
    cluster = Cluster(virtual_devices_per_node=1, offload="never", spot=local)
    try:
        actor = ActorWorker.launch(cluster, [0], name="actor", model=TINY, tokenizer=TOKENIZER,
                                   options=ActorOptions(threads=1))  # fmt: skip
        opts = RolloutOptions(n_samples=SAMPLES, max_new_tokens=MAX_NEW, temperature=1.0,
                              threads=1, spot=SPOT)  # fmt: skip
        rollout = RolloutWorker.launch(
            cluster, [0], name="rollout", model=TINY, tokenizer=TOKENIZER, options=opts, seed=SEED
        )
        assert sync_weights(actor, rollout) == 0
        mgr = ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
        yield local, rollout, mgr
    finally:
        cluster.shutdown()


def run_step(rollout, mgr, step: int, prompts: int = 16, during=None) -> tuple:
    """One rollout step through the pool (test_spot's :func:`pool_step`). Returns
    ``(generate's result, {(prompt, sample): response ids}, prompt items)``."""
    res, rows, items = pool_step(rollout, mgr, step, prompts, SAMPLES, during)
    got = {}
    for key, (chunk, i) in rows.items():
        b = chunk.batch
        got[key] = b["response_ids"][i, : int(b["response_mask"][i].sum())].tolist()
    return res, {k: got[k] for k in sorted(got)}, items


def check_lengths(got: dict, items: list, step: int) -> None:
    """Every sample once, with its drawn length (capped at max_new_tokens) and EOS iff it
    ended before the cap."""
    tok = build_char_tokenizer(ALPHABET)
    dist = ResponseLengths(EMU["length_median"], EMU["length_sigma"], EMU["length_cap"])
    keys = [(step, it["group"], j) for it in items for j in range(SAMPLES)]
    want = dict(zip([(k[1], k[2]) for k in keys], np.minimum(dist.lengths(SEED, keys), MAX_NEW)))
    assert set(got) == set(want)
    for key, ids in got.items():
        assert len(ids) == want[key], key
        assert (ids[-1] == tok.eos_token_id) == (want[key] < MAX_NEW), key


@pytest.mark.e2e
def test_emulated_pool_completes_a_step_with_every_sample(pool):
    local, rollout, mgr = pool
    wait_until(lambda: ray.get(mgr.spot_ready.remote()) >= SPOT_NODES, 240,
               "2 emulated spot instances on the current weights")  # fmt: skip
    res, got, items = run_step(rollout, mgr, step=1)
    check_lengths(got, items, step=1)
    spot = res["spot"]
    assert res["samples"] == 16 * SAMPLES and res["weight_versions"] == [0]
    # the reserved rank seeded with its emulated engine, the spot instances continued
    assert spot["reserved_tokens"] > 0 and spot["spot_tokens"] > 0
    assert spot["reserved_tokens"] + spot["spot_tokens"] == sum(map(len, got.values()))
    used = {k for k, v in metrics(mgr)["instances"].items() if v["kind"] == "spot"}
    assert len(used) == SPOT_NODES


@pytest.mark.e2e
def test_emulated_partial_responses_survive_a_preemption(pool):
    local, rollout, mgr = pool
    wait_until(lambda: ray.get(mgr.spot_ready.remote()) >= SPOT_NODES, 240, "spot instances")
    killed = []

    def preempt_one(m):
        # the spot instance holding the most partial responses (per instance: the pool-wide
        # count may be the reserved rank's, and CI once killed a node holding none)
        held = sorted((v["partial"], v["node"]) for v in m["instances"].values()
                      if v["kind"] == "spot" and v["partial"])  # fmt: skip
        if held and not killed:
            local.remove_node_id(held[-1][1])
            killed.append(held[-1][1])

    res, got, items = run_step(rollout, mgr, step=2, prompts=24, during=preempt_one)
    assert killed, "the step ended before a spot instance held a partial response"
    spot, m = res["spot"], metrics(mgr)
    # a node's death is a preemption whichever of the instance's two calls fails first
    assert m["preemptions"] == 1 and m["instance_errors"] == 0, m
    assert spot["migrated_samples"] >= 1, spot
    assert spot["migrated_tokens"] >= spot["migrated_samples"]  # partials kept their tokens
    check_lengths(got, items, step=2)  # and finished at the same lengths elsewhere
