"""The run's reward function: a built-in by name, or your own from a file, with veRL's
signature ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``.

``reward.function``:

- ``auto`` (default): a built-in per sample by its ``data_source``
  (:func:`~.builtins.dispatch`: reasoning-gym items -> ``reasoning_gym``, veRL's math sets
  -> ``math``);
- ``math``, ``exact``, ``reasoning_gym``: that built-in (:mod:`.builtins`);
- ``path/to/file.py:fn`` (``path/to/file.py`` alone: ``compute_score``, veRL's default
  name): your function. The runner resolves the path to an absolute one before workers start
  (:func:`~m2flow.workers.reward.config.reward_spec`); each process imports the file once.

A dict return carries ``score`` plus extra metrics: numeric ones (bool, int, float) are
averaged per step and logged as ``reward/<name>``; others are not logged.

A function that raises, or returns NaN/inf, a non-number, or a dict without a numeric
``score``, is a :class:`RewardFunctionError` naming the function, the sample's ``index`` and
its ``data_source`` -- unless ``on_error="penalty"``: then the sample gets ``penalty`` and
the call counts it (:attr:`RewardResult.errors`). Never a silent 0.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .builtins import BUILTINS, dispatch

#: ``reward.on_error`` values
ON_ERROR = ("raise", "penalty")
#: the function name of a ``reward.function`` given as a bare path (veRL's default)
DEFAULT_NAME = "compute_score"


class RewardFunctionError(RuntimeError):
    """A reward function failed on a sample (the message names the function, the sample's
    index and data_source, and what went wrong)."""


def split_function(function: str) -> tuple[str, str]:
    """``"path/to/file.py:fn"`` -> ``(path, fn)``; a bare path names ``compute_score``."""
    path, sep, name = function.rpartition(":")
    if not sep or not path or "/" in name or name.endswith(".py"):  # no ":fn" (or "C:\\...")
        return function, DEFAULT_NAME
    return path, name


def is_file_function(function: str) -> bool:
    """True for ``reward.function`` values that name a file, not a built-in or ``auto``."""
    return function not in (*BUILTINS, "auto")


@functools.cache
def load_file_function(function: str) -> Callable[..., Any]:
    """Import ``path/to/file.py[:fn]`` (once per process) and return ``fn``.

    Raises:
        FileNotFoundError: no such file.
        AttributeError: the file defines no callable ``fn``.
        Exception: whatever importing the file raises.
    """
    path, name = split_function(function)
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    module_name = "m2flow_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path} defines no function {name!r}")
    return fn


@dataclass
class RewardResult:
    """Rewards of a batch of responses.

    Attributes:
        scores: one reward per response.
        metrics: extra numeric metrics of dict returns, name -> the values (only of the
            samples that returned them).
        errors: samples that got the penalty (``on_error="penalty"``).
    """

    scores: list[float]
    metrics: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0


class RewardFunction:
    """The run's reward function (module docstring), called on decoded responses.

    Args:
        function: ``auto``, a built-in's name, or ``path/to/file.py[:fn]`` (absolute, or
            relative to this process's directory).
        on_error: ``"raise"`` (a :class:`RewardFunctionError`) or ``"penalty"``.
        penalty: the reward of a failed sample with ``on_error="penalty"``.

    Raises:
        ValueError: an unknown ``on_error``.
        FileNotFoundError, AttributeError: a file function that cannot be loaded.
    """

    def __init__(self, function: str = "auto", on_error: str = "raise", penalty: float = 0.0):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.function, self.on_error, self.penalty = function, on_error, float(penalty)
        self._fn = load_file_function(function) if is_file_function(function) else None

    def _pick(self, data_source: str) -> tuple[str, Callable[..., Any]]:
        if self._fn is not None:
            return self.function, self._fn
        name = dispatch(data_source) if self.function == "auto" else self.function
        if name is None:
            raise ValueError(
                f"reward.function=auto has no built-in for data_source {data_source!r}: set "
                "reward.function (math, exact, reasoning_gym, or path/to/file.py:fn)"
            )
        return name, BUILTINS[name]

    def __call__(self, responses: Sequence[str], entries: Sequence[dict]) -> RewardResult:
        """Score ``responses[i]`` (decoded text) against ``entries[i]`` (a prompt item's
        :meth:`~m2flow.workers.data.item.PromptItem.entry`).

        Raises:
            RewardFunctionError: a failed sample, with ``on_error="raise"``.
            ValueError: ``responses`` and ``entries`` differ in length.
        """
        if len(responses) != len(entries):
            raise ValueError(f"{len(responses)} responses for {len(entries)} entries")
        out = RewardResult([])
        for text, e in zip(responses, entries):
            source = e.get("data_source", "")
            name = self.function
            try:
                name, fn = self._pick(source)
                got = fn(source, text, e.get("ground_truth"), e.get("extra_info") or {})
                score, extra = _as_score(got)
            except Exception as err:  # the user's code: any exception is this sample's error
                what = str(err) if isinstance(err, _BadReturn) else f"{type(err).__name__}: {err}"
                if self.on_error == "raise":
                    raise RewardFunctionError(
                        f"reward function {name!r} failed on sample index {e.get('index')} "
                        f"(data_source {source!r}): {what} (reward.on_error=penalty scores "
                        "such samples reward.penalty instead)"
                    ) from err
                out.scores.append(self.penalty)
                out.errors += 1
                continue
            out.scores.append(score)
            for k, v in extra.items():
                out.metrics.setdefault(k, []).append(v)
        return out


def result_metrics(results: list[RewardResult]) -> dict:
    """``reward_errors`` and ``reward_metrics`` (name -> ``[sum, count]``) of a call's
    :class:`~.functions.RewardResult` s."""
    sums: dict[str, list[float]] = {}
    for res in results:
        for k, values in res.metrics.items():
            acc = sums.setdefault(k, [0.0, 0])
            acc[0] += sum(values)
            acc[1] += len(values)
    return {"reward_errors": sum(r.errors for r in results), "reward_metrics": sums}


def merge_reward_metrics(outs: list[dict], on_error: str = "raise") -> dict:
    """The step's reward metrics from the reward ranks' returns: ``reward/<name>`` (the mean
    of each extra metric over the samples that returned it) and, with
    ``on_error="penalty"``, ``reward_errors`` (penalised samples)."""
    sums: dict[str, list[float]] = {}
    for o in outs:
        for k, (total, n) in o.get("reward_metrics", {}).items():
            acc = sums.setdefault(k, [0.0, 0])
            acc[0] += total
            acc[1] += n
    out = {f"reward/{k}": total / n for k, (total, n) in sorted(sums.items()) if n}
    if on_error == "penalty":
        out["reward_errors"] = sum(o.get("reward_errors", 0) for o in outs)
    return out


class _BadReturn(ValueError):
    pass


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _as_score(got: Any) -> tuple[float, dict[str, float]]:
    """``(score, extra numeric metrics)`` of a function's return value.

    Raises:
        _BadReturn: not a finite number, or a dict without a finite numeric ``score``.
    """
    extra: dict[str, float] = {}
    value = got
    if isinstance(got, dict):
        if "score" not in got:
            raise _BadReturn(f"returned a dict without 'score' (keys: {sorted(got)[:8]})")
        value = got["score"]
        for k, v in got.items():
            if k != "score" and isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
                extra[str(k)] = float(v)
    score = _number(value)
    if score is None:
        # numpy and torch scalars are numbers too
        try:
            score = float(value) if hasattr(value, "item") else None
        except (TypeError, ValueError):
            score = None
    if score is None:
        raise _BadReturn(f"returned {type(value).__name__} {value!r:.60}, not a number")
    if not math.isfinite(score):
        raise _BadReturn(f"returned {score} (rewards must be finite)")
    return score, extra
