"""Fits of time/memory over device counts (scheduler/plan/fit.py): recovery, extrapolation, choice,
the 1- and 2-point rules, non-negative predictions, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from m2flow.scheduler.plan.fit import fit, fit_scaling

NS = (1, 2, 4, 8, 16)


@pytest.mark.parametrize(
    ("model", "fn", "params"),
    [
        ("amdahl", lambda n: 0.5 + 12.0 / n, {"a": 0.5, "b": 12.0}),
        ("amdahl_linear", lambda n: 1.0 + 10.0 / n + 0.1 * n, {"a": 1.0, "b": 10.0, "c": 0.1}),
        ("power", lambda n: 3.0 * n**-0.7, {"a": 3.0, "b": -0.7}),
        ("constant", lambda n: 2.5 + 0 * n, {"a": 2.5}),
    ],
)
def test_recovers_known_parameters_and_extrapolates(model, fn, params):
    f = fit([(n, fn(n)) for n in NS])
    assert f.model == model, f.candidates
    for k, v in params.items():
        assert math.isclose(f.params[k], v, rel_tol=1e-6, abs_tol=1e-9), (k, f.params)
    assert f.error_kind == "loo" and f.error < 1e-6
    for n in (64, 1024):  # far outside the measured 1..16
        assert math.isclose(f(n), fn(n), rel_tol=1e-6)
    assert isinstance(f.formula(), str) and f.formula()


@pytest.mark.parametrize("seed", range(5))
def test_noisy_points_pick_the_generating_model(seed):
    """1 % noise must not let the flexible a + b/n + c*n win and extrapolate 4x too slow."""
    rng = np.random.default_rng(seed)
    pts = [(n, (0.4 + 76.8 / n) * (1 + rng.uniform(-0.01, 0.01))) for n in (4, 8, 16, 32, 64)]
    f = fit(pts)
    assert f.model == "amdahl", f.candidates
    assert 0 < f.error < 0.05
    assert math.isclose(f(1024), 0.4 + 76.8 / 1024, rel_tol=0.05)
    # within the parsimony margin of the best held-out error
    assert f.error <= 1.5 * min(f.candidates.values()) + 1e-6


def test_array_call_and_non_negative():
    f = fit([(1, 1.0), (2, 2.0), (4, 4.0)])  # grows with n: power law a*n^b with b = 1
    assert f.model == "power" and math.isclose(f.params["b"], 1.0, rel_tol=1e-9)
    ys = f(np.arange(1, 9))
    assert isinstance(ys, np.ndarray) and ys.shape == (8,)
    # amdahl_linear forced onto decreasing data cannot go negative: clamped at 0
    g = fit([(1, 10.0), (2, 4.0), (4, 1.0), (8, 0.0)], models=["amdahl_linear", "constant"])
    assert all(g(n) >= 0 for n in range(1, 100))
    with pytest.raises(ValueError, match=">= 1"):
        f(0)


def test_one_point_is_constant_and_says_so():
    t = fit([(4, 10.0)])
    m = fit([(4, 3e9)], kind="memory")
    for f, y in ((t, 10.0), (m, 3e9)):
        assert f.model == "constant" and f(1) == y and f(1024) == y
        assert math.isnan(f.error) and f.error_kind == "none"
        assert "one device count" in f.note and "3 device counts" in f.note


def test_two_points_interpolate_with_an_unchecked_note():
    f = fit([(1, 10.0), (2, 6.0)])
    assert f.model == "amdahl"  # exact through both, preferred over the power law on a tie
    assert math.isclose(f(1), 10.0) and math.isclose(f(2), 6.0) and math.isclose(f(4), 4.0)
    assert f.error_kind == "residual" and f.error < 1e-9 and "unchecked" in f.note
    g = fit([(1, 10.0), (2, 2.0)])  # superlinear drop: a + b/n with a >= 0 cannot fit
    assert g.model == "power" and math.isclose(g(2), 2.0, rel_tol=1e-9)


def test_fit_scaling_and_bad_input():
    f = fit_scaling([1, 2, 4], [4.0, 2.0, 1.0], models=("amdahl",))
    assert f.model == "amdahl" and math.isclose(f.params["b"], 4.0, rel_tol=1e-9)
    with pytest.raises(ValueError, match="no points"):
        fit([])
    with pytest.raises(ValueError, match=">= 0"):
        fit([(1, -1.0)])
    with pytest.raises(ValueError, match=">= 1"):
        fit([(0, 1.0)])
    with pytest.raises(ValueError, match="unknown models"):
        fit([(1, 1.0)], models=["cubic"])
    with pytest.raises(ValueError, match="2 device counts but 1"):
        fit_scaling([1, 2], [1.0])


def test_zero_values_fit_without_dividing_by_zero():
    """A component measured at 0 everywhere (seconds below the profiler's 1 us, or no device
    memory) fits the constant 0, with no division by zero anywhere (numpy would raise)."""
    with np.errstate(all="raise"):
        for pts in ([(1, 0.0)], [(1, 0.0), (2, 0.0)], [(1, 0.0), (2, 0.0), (4, 0.0)]):
            f = fit(pts)
            assert f.model == "constant" and f(np.arange(1, 9)).tolist() == [0.0] * 8
