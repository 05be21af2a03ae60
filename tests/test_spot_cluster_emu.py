"""RLBoost at cluster scale on the live rollout manager in emulated time
(benchmarks/spot_cluster_emu.py): the runs are the real RolloutManager's (its per-step history,
its migration), deterministic, and every request finishes once. No Ray, virtual time."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def emu():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "spot_cluster_emu", ROOT / "benchmarks" / "spot_cluster_emu.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["spot_cluster_emu"] = mod
    spec.loader.exec_module(mod)
    return mod


def _wl(emu, model="qwen3-8b"):
    from spot_cluster_model import Workload

    return Workload(model, seed=0)


def _spy(emu, monkeypatch):
    """Record every manager the run builds and every finished request it reports."""
    made, finished = [], []
    orig_init = emu.EmulatedManager.__init__
    orig_finished = emu.RolloutManager._finished

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        made.append(self)

    def fin(self, r):
        finished.append(r.id)
        orig_finished(self, r)

    monkeypatch.setattr(emu.EmulatedManager, "__init__", init)
    monkeypatch.setattr(emu.RolloutManager, "_finished", fin)
    return made, finished


def test_runs_the_live_manager_one_history_record_per_step(emu, monkeypatch):
    from spot_cluster_model import PROMPTS, SAMPLES, System

    made, finished = _spy(emu, monkeypatch)
    r = emu.run_rlboost(System("RLBoost"), _wl(emu), math.inf, [(0.0, 6)], max_steps=2)
    (mgr,) = made
    assert isinstance(mgr, emu.RolloutManager)
    # RolloutManager._end_step wrote one record per step, and the run's records are those
    assert [h["step"] for h in mgr.history] == [0, 1]
    for rec, h in zip(r["records"], mgr.history):
        assert rec["t_seed"] == h["t_seed"] and rec["n_bar"] == h["n_bar"]
        assert rec["spot_tokens"] == h["spot_tokens"] > 0
    # every request finished exactly once, and its tokens are the step's
    assert len(finished) == len(set(finished)) == 2 * PROMPTS * SAMPLES
    for rec in r["records"]:
        made_tokens = rec["spot_tokens"] + rec["reserved_tokens"]
        assert rec["tokens"] - PROMPTS * SAMPLES * 200 <= made_tokens
    # Algorithm 1 ran on the step's measurements: T_seed moved from T_init
    assert r["records"][1]["t_seed"] != r["records"][0]["t_seed"] == System("x").t_init


def test_same_seed_same_records(emu):
    from spot_cluster_model import System

    sy = System("RLBoost", n_prem_fixed=4)
    ev = [(1, 50.0, "preempt", 2)]
    a = emu.run_rlboost(sy, _wl(emu), math.inf, [(0.0, 4)], ev, max_steps=2, seed=3)
    b = emu.run_rlboost(sy, _wl(emu), math.inf, [(0.0, 4)], ev, max_steps=2, seed=3)
    assert a["records"] == b["records"] and a["timeline"] == b["timeline"]


def test_preemption_migrates_requests_with_their_tokens(emu, monkeypatch):
    from spot_cluster_model import PROMPTS, SAMPLES, System

    made, finished = _spy(emu, monkeypatch)
    sy = System("RLBoost", n_prem_fixed=6)
    r = emu.run_rlboost(
        sy, _wl(emu, "qwen3-14b"), math.inf, [(0.0, 6)], [(1, 120.0, "preempt", 3)], max_steps=2
    )
    rec = r["records"][1]
    assert rec["preemptions"] == 3 and rec["preempted_tokens"] > 0
    assert made[0].history[1]["preempted_requests"] > 0
    assert rec["available"] == 3  # the preempted instances' nodes went
    assert len(finished) == len(set(finished)) == 2 * PROMPTS * SAMPLES
    # recompute (the ablation) loses what migration keeps: a longer step
    rc = emu.run_rlboost(
        System("RLBoost", n_prem_fixed=6, migration="recompute"),
        _wl(emu, "qwen3-14b"),
        math.inf,
        [(0.0, 6)],
        [(1, 120.0, "preempt", 3)],
        max_steps=2,
    )
    assert rc["records"][1]["step_s"] > rec["step_s"]


def test_sync_weights_keep_a_new_instance_out_until_the_next_step(emu):
    from spot_cluster_model import System

    got = {}
    for mode in ("pull", "sync"):
        sy = System(mode, weights=mode, n_prem_fixed=1)
        got[mode] = emu.run_rlboost(sy, _wl(emu), math.inf, [(0.0, 0)], [(0, 0.0, "add", 1)],
                                    max_steps=2)["records"]  # fmt: skip
    assert got["sync"][0]["spot_tokens"] == 0 < got["sync"][1]["spot_tokens"]
    assert got["sync"][1]["push_s"] > 0
    assert got["pull"][0]["spot_tokens"] > 0  # pulled on arrival, served this step


def test_no_nodes_is_the_colocated_fallback(emu):
    from spot_cluster_model import System

    r = emu.run_rlboost(System("RLBoost"), _wl(emu), math.inf, None, max_steps=1)
    rec = r["records"][0]
    assert rec["spot_tokens"] == 0 < rec["reserved_tokens"] and rec["instance_s"] == 0


def test_baseline_systems_are_refused(emu):
    from spot_cluster_model import System

    with pytest.raises(ValueError, match="not RLBoost"):
        emu.pool_config(System("veRL", "verl", dispatch="static"))


def test_memory_fires_on_a_constant_pool(emu, monkeypatch):
    """Algorithm 1 lines 11-14 on the live manager: a pool held constant through a step gives
    n_bar == n_hat exactly, so the memory stores T_seed and recalls it."""
    from spot_cluster_model import System

    made, _ = _spy(emu, monkeypatch)
    r = emu.run_rlboost(System("RLBoost", n_prem_fixed=3), _wl(emu), math.inf, [(0.0, 3)],
                        max_steps=3)  # fmt: skip
    assert all(x["n_bar"] == pytest.approx(3.0) and x["n_hat"] == 3 for x in r["records"][1:])
    assert 3 in made[0].policy.memory and any(x["memory_hit"] for x in r["records"])


def test_pulls_share_the_training_nodes_frontend_nics(emu):
    from spot_cluster_model import transfer_s

    m = emu.throughput_preset("qwen3-32b")
    one = transfer_s(m, 1, 1)  # the instance's own 50 Gb/s bounds it
    assert one == pytest.approx(m.latency_s + m.weight_bytes / (50e9 / 8) / 0.8)
    assert transfer_s(m, 6, 1) > transfer_s(m, 6, 2) == pytest.approx(one)


def test_benchmark_prints_the_per_model_ratios_last(tmp_path):
    """``benchmarks/spot_cluster.py`` (Fig. 10, here one model, 10 emulated minutes) ends with
    one ``model=<name> throughput_vs_verl=<x> tokens_per_dollar_vs_verl=<y>`` line per model,
    the ratios of its RLBoost run (the live manager's: its records carry Algorithm 1's
    ``n_hat`` and ``T_seed``) to its veRL run, as written to the results JSON."""
    import json
    import re
    import subprocess

    out = tmp_path / "sc.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "spot_cluster.py"), "--only", "fig10",
           "--models", "qwen3-8b", "--segments", "A", "--duration", "600", "--no-ablations",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"model=qwen3-8b throughput_vs_verl=(\S+) tokens_per_dollar_vs_verl=(\S+)",
                     last)  # fmt: skip
    assert m, last
    runs = json.loads(out.read_text())["fig10"]["runs"]
    rl, base = runs["qwen3-8b/RLBoost/A"], runs["qwen3-8b/veRL"]
    assert all("n_hat" in r and "t_seed" in r for r in rl["records"])
    assert float(m[1]) == pytest.approx(rl["throughput"] / base["throughput"], abs=5e-4)
    assert float(m[2]) == pytest.approx(
        rl["tokens_per_dollar"] / base["tokens_per_dollar"], abs=5e-4
    )
