"""The ``reward`` config section (GRPO and PPO): the run's reward function."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from m2flow.core.config import ConfigError
from m2flow.run.recipe import require

from ..scoring.builtins import BUILTINS, dispatch
from ..scoring.functions import (
    IMPORT_TIMEOUT_S,
    MAX_ABS,
    ON_ERROR,
    TIMEOUT_S,
    is_file_function,
    split_function,
)
from ..scoring.isolated import IsolatedFunction, LoadError


@dataclass
class RewardModelOptions:
    """The learned reward model's options: the PPO workflow's ``reward_model`` section, passed
    whole to :class:`~.model.RewardModelWorker`."""

    # Your reward model: a Hugging Face sequence-classification directory (num_labels=1, the
    # policy's tokenizer), used as it is. None: the policy's transformer with a head fitted to
    # the verifier's labels (reward_fit.*).
    path: Optional[str] = None
    # the verifier is the run's reward function (reward.function)
    verifier_weight: float = 0.5  # reward = w * verifier + (1 - w) * reward model
    lr: float = 1e-3  # reward-model fit
    grad_clip: float = 1.0  # global gradient-norm clip of the fit
    batch_size: int = 64  # samples per fit step
    micro_batch_size: int = 0  # samples per forward/backward; 0 = the whole batch
    threads: int = 0  # torch threads; 0 = the CPUs of the model's devices
    engine: str = "torch"  # a one-rank value engine: torch, or module:Class


@dataclass
class RewardConfig:
    # auto: a built-in by data_source (reasoning_gym/* -> reasoning_gym, veRL's math sets ->
    # math); math | exact | reasoning_gym; or path/to/file.py:fn with veRL's signature
    # fn(data_source, solution_str, ground_truth, extra_info) -> float | dict
    function: str = "auto"
    on_error: str = "raise"  # a failing function stops the run; "penalty": reward.penalty
    penalty: float = 0.0  # the reward of a failed sample with on_error=penalty (counted)
    # seconds one sample's call of a file function may take: then its process is killed and
    # the sample is an error (on_error); > 0
    timeout_s: float = TIMEOUT_S
    # seconds a file function's import may take (before the run and in each worker); > 0
    import_timeout_s: float = IMPORT_TIMEOUT_S
    # the largest |reward| accepted: a larger (finite) reward is an error like NaN (on_error);
    # far above any scorer's scale, far below what float32 statistics overflow on
    max_abs: float = MAX_ABS


def check_reward(section) -> None:
    """Config-time checks: ``on_error``, ``penalty`` and the bounds are valid, and a file
    function's file exists, imports and defines the function. The file is imported in a child
    process (:mod:`~m2flow.workers.scoring.isolated`) within ``import_timeout_s``: an import
    that exits (``sys.exit``, ``os._exit``), raises or blocks is one line, never this
    process's exit or hang.

    Raises:
        ConfigError: one line naming the problem and the fix.
    """
    require(
        [
            (section.on_error in ON_ERROR, "reward.on_error must be raise or penalty"),
            (math.isfinite(section.penalty), "reward.penalty must be a finite number"),
            (_positive(section.timeout_s), "reward.timeout_s must be a finite number > 0"),
            (
                _positive(section.import_timeout_s),
                "reward.import_timeout_s must be a finite number > 0",
            ),
            (_positive(section.max_abs), "reward.max_abs must be a finite number > 0"),
            (
                not _positive(section.max_abs) or abs(section.penalty) <= section.max_abs,
                f"reward.penalty={section.penalty:g} is beyond reward.max_abs="
                f"{section.max_abs:g}: raise reward.max_abs or lower the penalty",
            ),
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
    probe = IsolatedFunction(_absolute(function), import_timeout_s=section.import_timeout_s,
                             forward_output=False)  # fmt: skip
    try:
        probe.start()
    except LoadError as e:
        hint = {
            "missing": f"{path} defines no function {name!r}: name the function after the "
            "colon (path/to/file.py:fn)",
            "raised": f"importing {path} raised {e.detail}",
            "exited": f"importing {path} ended its process ({e.detail}): a reward file must "
            "define the function and return",
            "timeout": f"importing {path} did not finish within {e.detail} s: does it wait "
            "for input or a lock? (reward.import_timeout_s raises the bound)",
        }[e.kind]
        raise ConfigError(f"reward.function={function!r}: {hint}") from None
    finally:
        probe.close()


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


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
    keys = ("on_error", "penalty", "timeout_s", "import_timeout_s", "max_abs")
    return {"function": function, **{k: getattr(section, k) for k in keys}}
