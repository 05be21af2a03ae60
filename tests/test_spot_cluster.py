"""The cluster-scale benchmark's pure parts (benchmarks/spot_cluster.py): the emulated
trainer's time model, the offline rollout model and the planner inputs. No Ray cluster."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sc():
    spec = importlib.util.spec_from_file_location("spot_cluster", ROOT / "benchmarks" /
                                                  "spot_cluster_live.py")  # fmt: skip
    mod = importlib.util.module_from_spec(spec)
    sys.modules["spot_cluster"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_train_time_is_flops_over_cluster_rate(sc):
    t = sc.TrainModel(params=8e9, gpus=8, mfu=0.4)
    # 10 P T / (8 x 989.4 TFLOP/s x 0.4)
    assert t.train_s(1_000_000) == pytest.approx(10 * 8e9 * 1e6 / (8 * 989.4e12 * 0.4))
    two = sc.TrainModel(params=8e9, gpus=16, mfu=0.4, scale_eff=0.9)
    assert two.train_s(1_000_000) == pytest.approx(t.train_s(1_000_000) / 2 / 0.9)
    assert t.sync_s == pytest.approx(2.0 + 16e9 / 200e9)


def test_step_tokens_are_the_emulated_lengths(sc):
    n = sc.step_tokens(0, 3)
    assert n == sc.step_tokens(0, 3) != sc.step_tokens(0, 4)
    per = n / (sc.PROMPTS * sc.SAMPLES) - sc.PROMPT_TOKENS
    assert 3500 < per < 5500  # lognormal median 3000, sigma 1, cap 14,336: mean ~4.5K


def test_offline_rollout_and_plan(sc):
    r4 = sc.offline_rollout_s("qwen3-8b", 4, 0, 0, 512, 256)
    r8 = sc.offline_rollout_s("qwen3-8b", 8, 0, 0, 512, 256)
    assert 150 < r4 < 400 and r8 < r4  # docs/results/emulation.md: 236-280 s on four TP-2 engines
    p = sc.plan_for("qwen3-8b", "A", 0, 1, 512, 256, range(0, 1))
    best = p["plan"]["best"]
    assert best["mode"] in ("seeded", "spot") and best["step_s"] < p["R"] + p["t_train"]
