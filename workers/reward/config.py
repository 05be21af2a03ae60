"""The ``reward`` config section (GRPO and PPO): the run's reward function."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from m2flow.config import ConfigError
from m2flow.recipe import require

from ..scoring.builtins import BUILTINS, dispatch
from ..scoring.functions import ON_ERROR, is_file_function, load_file_function, split_function


@dataclass
class RewardConfig:
    # auto: a built-in by data_source (reasoning_gym/* -> reasoning_gym, veRL's math sets ->
    # math); math | exact | reasoning_gym; or path/to/file.py:fn with veRL's signature
    # fn(data_source, solution_str, ground_truth, extra_info) -> float | dict
    function: str = "auto"
    on_error: str = "raise"  # a failing function stops the run; "penalty": reward.penalty
    penalty: float = 0.0  # the reward of a failed sample with on_error=penalty (counted)


def check_reward(section) -> None:
    """Config-time checks: ``on_error`` and ``penalty`` are valid, and a file function's
    file exists and defines the function (the file is imported here once).

    Raises:
        ConfigError: one line naming the problem and the fix.
    """
    import math

    require(
        [
            (section.on_error in ON_ERROR, "reward.on_error must be raise or penalty"),
            (math.isfinite(section.penalty), "reward.penalty must be a finite number"),
            (bool(section.function.strip()), "reward.function must not be empty (auto)"),
        ]
    )
    function = section.function
    if not is_file_function(function):
        return
    path, name = split_function(function)
    if not path.endswith(".py"):
        raise ConfigError(
            f"reward.function={function!r} is neither auto, a built-in "
            f"({', '.join(BUILTINS)}) nor path/to/file.py:fn"
        )
    if not Path(path).expanduser().is_file():
        raise ConfigError(
            f"reward.function={function!r}: {path} does not exist (relative paths are from the "
            f"directory m2flow runs in, here {Path.cwd()})"
        )
    try:
        load_file_function(_absolute(function))
    except AttributeError:
        raise ConfigError(
            f"reward.function={function!r}: {path} defines no function {name!r}: name the "
            "function after the colon (path/to/file.py:fn)"
        ) from None
    except Exception as e:
        raise ConfigError(
            f"reward.function={function!r}: importing {path} raised {type(e).__name__}: {e}"
        ) from None


def _absolute(function: str) -> str:
    path, name = split_function(function)
    return f"{Path(path).expanduser().resolve()}:{name}"


def reward_spec(section, data_sources: Iterable[str] = ()) -> dict:
    """The section as the workers' :class:`~.functions.RewardFunction` arguments, a file
    function's path made absolute (workers run in another directory). With ``auto``, every
    ``data_source`` of the run's data must have a built-in.

    Raises:
        ConfigError: (``auto``) data sources without a built-in, named with the fix.
    """
    function = section.function
    if is_file_function(function):
        function = _absolute(function)
    elif function == "auto":
        unknown = sorted(s for s in set(data_sources) if dispatch(s) is None)
        if unknown:
            shown = ", ".join(repr(s) for s in unknown[:5])
            raise ConfigError(
                f"reward.function=auto has no built-in reward for data_source {shown}: set "
                "reward.function=math|exact or path/to/file.py:fn (veRL's signature), or use "
                "data_source names it knows (openai/gsm8k, lighteval/MATH, ...)"
            )
    return {"function": function, "on_error": section.on_error, "penalty": section.penalty}
