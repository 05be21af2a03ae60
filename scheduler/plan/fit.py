"""Fit a component's time or memory as a function of its device count from measured points.

RLinf (section 3.4, "Profiler") profiles each worker on a few device counts and extrapolates
the cost to any count. This module offers a few candidate models, all fitted by (weighted,
constrained) least squares with scipy, and picks the one whose held-out error is lowest:

- ``constant``:       ``y = a``                        (does not scale)
- ``amdahl``:         ``y = a + b/n``                  (serial part + parallel part; for memory:
  replicated bytes + sharded bytes), ``a, b >= 0``
- ``amdahl_linear``:  ``y = a + b/n + c*n``            (plus a cost growing with n, e.g.
  collective communication), ``a, b, c >= 0``
- ``power``:          ``y = a * n**b``                 (``a > 0``, any ``b``; fitted in log space)

Residuals are relative (weights ``1/y``), so a 10 % miss counts the same at 1 and at 1000
devices. Selection by the number of points:

- ``>= 3`` points: every model with fewer parameters than points is scored by its
  leave-one-out mean relative error (fit on all points but one, predict that one). The
  simplest model (order: constant, amdahl, power, amdahl_linear) whose error is within 1.5x
  of the lowest wins: with noisy points a more flexible model often wins the held-out score
  by a hair and then extrapolates badly (a spurious ``c*n`` term), so it must cut the error
  by a third to be chosen. The final parameters use every point. ``error_kind = "loo"``.
- ``2`` points: no point can be held out. Two-parameter models interpolate both points
  exactly wherever they can, so the score is the in-sample mean relative residual; the same
  rule prefers ``amdahl`` over ``power`` on a tie (Amdahl's floor extrapolates more
  conservatively). ``error_kind = "residual"``; the note says extrapolation is unchecked.
- ``1`` point: nothing is known about scaling, so the fit is ``constant`` (the measured
  value at every device count: pessimistic for time and memory alike, the planner never
  counts on a speed-up or a memory saving nobody measured). ``error = nan``,
  ``error_kind = "none"``; the note says so.

Predictions are never negative (clamped at 0) and are defined for ``n >= 1``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

_TIE = 1e-6  # relative-error difference below which the simpler model wins
_PARSIMONY = 1.5  # a model with more parameters must cut the error by a third to be chosen

# name -> (parameter names, design columns as functions of n) for the linear, non-negative
# models; "power" is handled separately (log space).
_LINEAR = {
    "constant": (("a",), (lambda n: np.ones_like(n),)),
    "amdahl": (("a", "b"), (lambda n: np.ones_like(n), lambda n: 1.0 / n)),
    "amdahl_linear": (
        ("a", "b", "c"),
        (lambda n: np.ones_like(n), lambda n: 1.0 / n, lambda n: n),
    ),
}
_N_PARAMS = {"constant": 1, "amdahl": 2, "power": 2, "amdahl_linear": 3}
_ORDER = ("constant", "amdahl", "power", "amdahl_linear")  # simplest first (tie-break)
_FORMULA = {
    "constant": "{a:.4g}",
    "amdahl": "{a:.4g} + {b:.4g}/n",
    "amdahl_linear": "{a:.4g} + {b:.4g}/n + {c:.4g}*n",
    "power": "{a:.4g} * n^{b:.4g}",
}


@dataclass(frozen=True)
class Fit:
    """A fitted ``y(n)``: call it with a device count (int or int array) for a prediction.

    ``model``: the chosen model's name (module docstring); ``params``: its parameters;
    ``error``: mean relative error (a fraction; leave-one-out for ``error_kind="loo"``,
    in-sample for ``"residual"``, ``nan`` for ``"none"``); ``note``: what was assumed;
    ``points``: the ``(devices, value)`` points it was fitted to; ``candidates``: every model
    tried and its score.
    """

    model: str
    params: dict[str, float]
    error: float
    error_kind: str
    note: str
    points: tuple[tuple[float, float], ...]
    candidates: dict[str, float] = field(default_factory=dict)
    vectorized: bool = True  # the planner may call it once with an int array

    def __call__(self, n):
        """Prediction at ``n`` devices (seconds or bytes), ``>= 0``.

        Raises:
            ValueError: ``n < 1``.
        """
        arr = np.asarray(n, dtype=float)
        if np.any(arr < 1):
            raise ValueError(f"device count must be >= 1, got {n!r}")
        y = np.maximum(_predict(self.model, self.params, arr), 0.0)
        return float(y) if y.ndim == 0 else y

    def formula(self) -> str:
        """Human-readable formula, e.g. ``0.05 + 3.2/n``."""
        return _FORMULA[self.model].format(**self.params)


def _predict(model: str, p: dict[str, float], n: np.ndarray) -> np.ndarray:
    if model == "power":
        return p["a"] * n ** p["b"]
    names, cols = _LINEAR[model]
    return sum(p[k] * f(n) for k, f in zip(names, cols, strict=True))


def _weights(y: np.ndarray) -> np.ndarray:
    scale = float(np.max(np.abs(y))) or 1.0
    return 1.0 / np.maximum(np.abs(y), 1e-9 * scale)


def _fit_model(model: str, n: np.ndarray, y: np.ndarray) -> dict[str, float] | None:
    """Parameters of ``model`` fitted to the points, or None when it cannot fit them."""
    if model == "power":
        if np.any(y <= 0) or np.unique(n).size < 2:
            return None
        b, log_a = np.polyfit(np.log(n), np.log(y), 1)  # relative least squares
        return {"a": float(np.exp(log_a)), "b": float(b)}
    names, cols = _LINEAR[model]
    w = _weights(y)
    design = np.column_stack([f(n) for f in cols]) * w[:, None]
    coef, _ = nnls(design, y * w)
    return dict(zip(names, (float(c) for c in coef), strict=True))


def _rel_errors(model: str, p: dict[str, float], n: np.ndarray, y: np.ndarray) -> np.ndarray:
    pred = np.maximum(_predict(model, p, n), 0.0)
    scale = float(np.max(np.abs(y))) or 1.0
    return np.abs(pred - y) / np.maximum(np.abs(y), 1e-9 * scale)


def _loo(model: str, n: np.ndarray, y: np.ndarray) -> float:
    errs = []
    for i in range(n.size):
        keep = np.arange(n.size) != i
        p = _fit_model(model, n[keep], y[keep])
        if p is None:
            return math.inf
        errs.append(_rel_errors(model, p, n[i : i + 1], y[i : i + 1])[0])
    return float(np.mean(errs))


def fit(
    points: Sequence[tuple[float, float]], kind: str = "time", models: Sequence[str] | None = None
) -> Fit:
    """Fit ``y(n)`` to measured ``(devices, value)`` points.

    Args:
        points: ``(n, y)`` pairs, ``n >= 1`` devices, ``y >= 0`` seconds or bytes, finite.
        kind: ``"time"`` or ``"memory"``: only changes the wording of the notes.
        models: candidate names (default: all of constant, amdahl, power, amdahl_linear).

    Returns:
        the chosen :class:`Fit` (see the module docstring for how it is chosen).

    Raises:
        ValueError: no points, a device count < 1, a negative or non-finite value, an unknown
            kind or model.
    """
    if kind not in ("time", "memory"):
        raise ValueError(f"kind must be 'time' or 'memory', got {kind!r}")
    cands = tuple(models) if models is not None else _ORDER
    unknown = [m for m in cands if m not in _N_PARAMS]
    if unknown:
        raise ValueError(f"unknown models {unknown}; choose from {list(_ORDER)}")
    if not points:
        raise ValueError("no points to fit: measure at least one device count")
    n = np.array([float(p[0]) for p in points])
    y = np.array([float(p[1]) for p in points])
    if np.any(~np.isfinite(n)) or np.any(n < 1):
        raise ValueError(f"device counts must be finite and >= 1, got {n.tolist()}")
    if np.any(~np.isfinite(y)) or np.any(y < 0):
        raise ValueError(f"values must be finite and >= 0, got {y.tolist()}")
    pts = tuple(zip(n.tolist(), y.tolist(), strict=True))
    distinct = np.unique(n).size
    if distinct == 1:
        y0, n0 = float(np.mean(y)), float(n[0])
        what = "seconds" if kind == "time" else "bytes per device"
        return Fit(
            "constant",
            {"a": y0},
            math.nan,
            "none",
            f"one device count measured ({n0:g}): assumed the same {what} at every count "
            "(no scaling known; pessimistic); measure at >= 3 device counts for a checked fit",
            pts,
        )
    if distinct >= 3:
        usable = [m for m in cands if _N_PARAMS[m] < distinct]
        scores = {m: _loo(m, n, y) for m in usable}
        kind_err, note = "loo", f"{distinct} device counts: leave-one-out mean relative error"
    else:
        usable = [m for m in cands if _N_PARAMS[m] <= 2]
        scores = {}
        for m in usable:
            p = _fit_model(m, n, y)
            scores[m] = math.inf if p is None else float(np.mean(_rel_errors(m, p, n, y)))
        kind_err = "residual"
        note = (
            "2 device counts: in-sample relative residual only; extrapolation is unchecked "
            "(measure at >= 3 device counts)"
        )
    finite = {m: s for m, s in scores.items() if math.isfinite(s)}
    if not finite:
        raise ValueError(f"no model in {list(cands)} can fit points {pts}")
    best = min(finite.values())
    model = next(m for m in _ORDER if m in finite and finite[m] <= best * _PARSIMONY + _TIE)
    params = _fit_model(model, n, y)
    assert params is not None
    return Fit(model, params, finite[model], kind_err, note, pts, scores)


def fit_scaling(
    devices: Sequence[float],
    values: Sequence[float],
    models: Sequence[str] | None = None,
    kind: str = "time",
) -> Fit:
    """:func:`fit` with the points given as two sequences (devices, values)."""
    if len(devices) != len(values):
        raise ValueError(f"{len(devices)} device counts but {len(values)} values")
    return fit(list(zip(devices, values, strict=True)), kind=kind, models=models)
