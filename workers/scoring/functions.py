"""The run's reward function: a built-in by name, or your own from a file, with veRL's
signature ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``.

``reward.function``:

- ``auto`` (default): a built-in per sample by its ``data_source``
  (:func:`~.builtins.dispatch`: reasoning-gym items -> ``reasoning_gym``, veRL's math sets
  -> ``math``);
- ``math``, ``exact``, ``reasoning_gym``: that built-in (:mod:`.builtins`), called in this
  process (trusted and fast);
- ``path/to/file.py:fn`` (``path/to/file.py`` alone: ``compute_score``, veRL's default
  name): your function, run in a child process of this one that can be abandoned
  (:mod:`.isolated`; the file imported once there): a call longer than ``timeout_s`` is
  killed, what it prints is forwarded capped. The runner resolves the path to an absolute one
  before workers start (:func:`~m2flow.workers.reward.config.reward_spec`).

A dict return carries ``score`` plus extra metrics: numeric ones (bool, int, float) are
averaged per step and logged as ``reward/<name>``; others are not logged.

A function that raises (any ``BaseException``: ``sys.exit`` too), returns NaN/inf, a reward
beyond ``max_abs``, a non-number or a dict without a numeric ``score``, times out, or whose
process dies is a :class:`RewardFunctionError` naming the function, the sample's ``index`` and
its ``data_source`` -- unless ``on_error="penalty"``: then the sample gets ``penalty`` and the
call counts it (:attr:`RewardResult.errors`). Never a silent 0. A file that cannot be imported
is an error whatever ``on_error`` says.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .builtins import BUILTINS, dispatch
from .isolated import IsolatedFunction, LoadError
from .returns import BadReturn, as_score

#: ``reward.on_error`` values
ON_ERROR = ("raise", "penalty")
#: the function name of a ``reward.function`` given as a bare path (veRL's default)
DEFAULT_NAME = "compute_score"
#: defaults of ``reward.timeout_s``, ``reward.import_timeout_s`` and ``reward.max_abs``
TIMEOUT_S, IMPORT_TIMEOUT_S, MAX_ABS = 60.0, 60.0, 1e6


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
        timeout_s: (file functions) the longest one sample's call may take, in seconds.
        import_timeout_s: (file functions) the longest the file's import may take, in seconds.
        max_abs: the largest ``|reward|`` accepted; a reward beyond it is a failed sample.
        note_every_s: (file functions) seconds between notes while a batch waits on rewards.

    Raises:
        ValueError: an unknown ``on_error``, or a bound that is not a finite number > 0.

    The file function's process starts at the first call; :meth:`close` stops it (so does
    garbage collection and the interpreter's exit).
    """

    def __init__(
        self,
        function: str = "auto",
        on_error: str = "raise",
        penalty: float = 0.0,
        timeout_s: float = TIMEOUT_S,
        import_timeout_s: float = IMPORT_TIMEOUT_S,
        max_abs: float = MAX_ABS,
        note_every_s: float = 30.0,
    ):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        for key, v in [("timeout_s", timeout_s), ("import_timeout_s", import_timeout_s),
                       ("max_abs", max_abs), ("note_every_s", note_every_s)]:  # fmt: skip
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{key} must be a finite number > 0, got {v!r}")
        self.function, self.on_error, self.penalty = function, on_error, float(penalty)
        self.max_abs = float(max_abs)
        self._isolated = None
        if is_file_function(function):
            path, name = split_function(function)
            self._isolated = IsolatedFunction(
                f"{path}:{name}", timeout_s, import_timeout_s, note_every_s
            )
        self._lock = threading.Lock()  # one batch at a time through the child

    def close(self) -> None:
        """Stop the file function's process, if one runs."""
        if self._isolated is not None:
            self._isolated.close()

    def _pick(self, data_source: str) -> tuple[str, Callable[..., Any]]:
        name = dispatch(data_source) if self.function == "auto" else self.function
        if name is None:
            raise ValueError(
                f"reward.function=auto has no built-in for data_source {data_source!r}: set "
                "reward.function (math, exact, reasoning_gym, or path/to/file.py:fn)"
            )
        return name, BUILTINS[name]

    def _in_process(self, samples: list[tuple]) -> Iterator[tuple[str, tuple]]:
        """``(function name, outcome)`` per sample, scored by the built-ins here."""
        for args in samples:
            name = self.function
            try:
                name, fn = self._pick(args[0])
                yield name, ("ok", *as_score(fn(*args)))
            except BadReturn as err:
                yield name, ("error", str(err))
            except Exception as err:  # any exception is this sample's error
                yield name, ("error", f"{type(err).__name__}: {err}")

    def __call__(self, responses: Sequence[str], entries: Sequence[dict]) -> RewardResult:
        """Score ``responses[i]`` (decoded text) against ``entries[i]`` (a prompt item's
        :meth:`~m2flow.workers.data.item.PromptItem.entry`).

        Raises:
            RewardFunctionError: a failed sample, with ``on_error="raise"``; a file function
                whose file cannot be imported (any ``on_error``).
            ValueError: ``responses`` and ``entries`` differ in length.
        """
        if len(responses) != len(entries):
            raise ValueError(f"{len(responses)} responses for {len(entries)} entries")
        samples = [
            (e.get("data_source", ""), text, e.get("ground_truth"), e.get("extra_info") or {})
            for text, e in zip(responses, entries)
        ]
        if self._isolated is None:
            return self._collect(self._in_process(samples), entries)
        with self._lock:
            outcomes = self._isolated.map(samples)
            try:
                return self._collect(((self.function, o) for o in outcomes), entries)
            except LoadError as err:
                raise RewardFunctionError(
                    f"reward function {self.function!r} could not be loaded in its process: {err}"
                ) from None
            finally:
                outcomes.close()

    def _collect(self, outcomes, entries: Sequence[dict]) -> RewardResult:
        out = RewardResult([])
        for k, (name, got) in enumerate(outcomes):  # to its end: a finished child stays
            e = entries[k]
            if got[0] == "ok" and abs(got[1]) > self.max_abs:
                got = ("error", f"returned {got[1]:g}, beyond reward.max_abs={self.max_abs:g}")
            if got[0] == "ok":
                out.scores.append(got[1])
                for k, v in got[2].items():
                    out.metrics.setdefault(k, []).append(v)
                continue
            if self.on_error == "raise":
                raise RewardFunctionError(
                    f"reward function {name!r} failed on sample index {e.get('index')} "
                    f"(data_source {e.get('data_source', '')!r}): {got[1]} "
                    "(reward.on_error=penalty scores such samples reward.penalty instead)"
                )
            out.scores.append(self.penalty)
            out.errors += 1
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
