"""The cluster-scale benchmark's shared models (benchmarks/spot_cluster_model.py): the emulated
training cluster's time and the workload's response lengths. No Ray cluster."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from spot_cluster_model import CAP, PROMPTS, SAMPLES, TrainModel, Workload  # noqa: E402


def test_train_time_is_flops_over_cluster_rate():
    t = TrainModel(params=8e9, gpus=8, mfu=0.4)
    # 10 P T / (8 x 989.4 TFLOP/s x 0.4)
    assert t.train_s(1_000_000) == pytest.approx(10 * 8e9 * 1e6 / (8 * 989.4e12 * 0.4))
    two = TrainModel(params=8e9, gpus=16, mfu=0.4, scale_eff=0.9)
    assert two.train_s(1_000_000) == pytest.approx(t.train_s(1_000_000) / 2 / 0.9)
    assert t.sync_s == pytest.approx(2.0 + 16e9 / 200e9)


def test_step_lengths_are_keyed_and_capped():
    wl = Workload()
    keys = [(3, p, j) for p in range(PROMPTS) for j in range(SAMPLES)]
    a = wl.lengths.lengths(wl.seed, keys)
    assert np.array_equal(a, wl.lengths.lengths(wl.seed, keys))  # every system sees the same
    assert not np.array_equal(a, wl.lengths.lengths(wl.seed, [(4, *k[1:]) for k in keys]))
    assert a.max() <= CAP
    assert 3500 < a.mean() < 5500  # lognormal median 3000, sigma 1, cap 14,336: mean ~4.4K
