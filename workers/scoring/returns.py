"""What a reward function may return, checked: a finite number, or a dict with a finite numeric
``score`` plus extra numeric metrics. Standard library only: the isolated reward process
(:mod:`.child`) imports it before the user's file."""

from __future__ import annotations

import math
from typing import Any


class BadReturn(ValueError):
    """A reward function's return value is not a reward (the message says what it was)."""


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def as_score(got: Any) -> tuple[float, dict[str, float]]:
    """``(score, extra numeric metrics)`` of a function's return value: a number (numpy and
    torch scalars count), or a dict with ``score``; its other bool/int/float finite values are
    the extra metrics.

    Raises:
        BadReturn: not a finite number, or a dict without a finite numeric ``score``.
    """
    extra: dict[str, float] = {}
    value = got
    if isinstance(got, dict):
        if "score" not in got:
            raise BadReturn(f"returned a dict without 'score' (keys: {sorted(map(str, got))[:8]})")
        value = got["score"]
        for k, v in got.items():
            if k == "score" or not isinstance(v, (bool, int, float)):
                continue
            try:
                v = float(v)
            except OverflowError:  # an int beyond float's range is no metric
                continue
            if math.isfinite(v):
                extra[str(k)] = v
    try:
        score = _number(value)
        if score is None and hasattr(value, "item"):  # numpy and torch scalars are numbers too
            score = float(value)
    except (TypeError, ValueError, OverflowError):
        score = None
    if score is None:
        raise BadReturn(f"returned {type(value).__name__} {_short(value)}, not a number")
    if not math.isfinite(score):
        raise BadReturn(f"returned {score} (rewards must be finite)")
    return score, extra


def _short(value: Any) -> str:
    try:
        return f"{value!r:.60}"
    except Exception:  # a repr that raises says nothing more
        return "(no repr)"
