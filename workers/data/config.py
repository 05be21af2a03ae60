"""The ``data`` config section: where prompts come from, their columns, the prompt limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from m2flow.core.config import ConfigError
from m2flow.run.recipe import plain, require

from ..llm.config import max_positions, resolved_max_new_tokens
from .item import OVERLONG


@dataclass
class DataConfig:
    # Your own data (docs/how-to/data-and-rewards.md): JSONL, JSON or Parquet, one path or a list
    # (data.train_files=[a.jsonl,b.parquet]). None: the reasoning-gym task (task.*).
    train_files: Any = None
    # Held-out evaluation rows (heldout_accuracy). None: the task's held-out split with
    # reasoning-gym, no held-out evaluation with train_files.
    val_files: Any = None
    # Columns (veRL's names by default); dotted paths reach into nested columns.
    prompt_key: str = "prompt"  # a string, or chat messages [{"role", "content"}]
    answer_key: str = "reward_model.ground_truth"  # this default falls back to "answer"
    data_source_key: str = "data_source"  # column naming each row's source (reward routing)
    extra_info_key: str = "extra_info"  # column passed to the reward function as extra_info
    # Longest prompt in tokens (both sources). 0: model.max_position_embeddings -
    # rollout.max_new_tokens.
    max_prompt_tokens: int = 0
    overlong_prompts: str = "error"  # or "drop": left out, counted and logged at start
    shuffle: bool = True  # a new seeded permutation of the training prompts every epoch


def prompt_limit(cfg) -> int:
    """Longest prompt in tokens: ``data.max_prompt_tokens``, or (0) what the position
    embeddings leave after the response: ``model.max_position_embeddings -
    rollout.max_new_tokens``."""
    model = plain(cfg.model)
    return cfg.data.max_prompt_tokens or (
        max_positions(model) - resolved_max_new_tokens(model, cfg.rollout.max_new_tokens)
    )


def from_files(cfg) -> bool:
    """True when the training prompts come from ``data.train_files`` (else reasoning-gym)."""
    return bool(cfg.data.train_files)


def file_keys(cfg) -> dict[str, str]:
    """The column keys of ``data`` (keyword arguments of :func:`~.files.load_items`)."""
    d = cfg.data
    return {
        "prompt_key": d.prompt_key,
        "answer_key": d.answer_key,
        "data_source_key": d.data_source_key,
        "extra_info_key": d.extra_info_key,
    }


def check_data(cfg) -> None:
    """Config-time checks of ``data``: the files exist and have a known suffix, the keys are
    set, the limit fits the model (reading the rows waits for :func:`~.splits.run_data`).

    Raises:
        ConfigError: the first problem, named, with the fix.
    """
    from .files import file_list

    d, model = cfg.data, plain(cfg.model)
    limit, positions = prompt_limit(cfg), max_positions(model)
    new_tokens = resolved_max_new_tokens(model, cfg.rollout.max_new_tokens)
    require(
        [
            (d.overlong_prompts in OVERLONG, "data.overlong_prompts must be error or drop"),
            (d.max_prompt_tokens >= 0, "data.max_prompt_tokens must be >= 0 (0: derived)"),
            (
                limit >= 1 and limit + new_tokens <= positions,
                f"data.max_prompt_tokens ({limit}) + rollout.max_new_tokens "
                f"({new_tokens}) must fit the model's max_position_embeddings "
                f"({positions}): lower them, or raise model.max_position_embeddings (a "
                "built model)",
            ),
            *[(bool(v.strip()), f"data.{k} must not be empty") for k, v in file_keys(cfg).items()],
        ]
    )
    for key in ("train_files", "val_files"):
        files = plain(d)[key]
        if files is not None and files != []:
            file_list(files, f"data.{key}")
        elif files == []:
            raise ConfigError(f"data.{key}=[] names no file: leave it unset, or list files")
