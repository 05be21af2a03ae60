"""A run's prompt splits, built in the driver before any worker starts: training prompts and
held-out evaluation prompts, from data files or from the reasoning-gym task."""

from __future__ import annotations

from dataclasses import dataclass, field

from m2flow.core.config import ConfigError
from m2flow.run.recipe import plain

from .config import file_keys, from_files, prompt_limit
from .files import load_items
from .item import PromptItem
from .reasoning_gym import task_section, task_split


@dataclass
class RunData:
    """The run's splits and what to log about them once at start.

    Attributes:
        train: training prompts (the sampler's split).
        heldout: held-out evaluation prompts; empty: no held-out evaluation.
        source: ``"files"`` or ``"reasoning_gym"`` (the training prompts').
        notes: lines for the run log (prompts dropped, no held-out evaluation).
    """

    train: list[PromptItem]
    heldout: list[PromptItem]
    source: str
    notes: list[str] = field(default_factory=list)

    def data_sources(self) -> set[str]:
        """Every ``data_source`` of both splits (the reward function's dispatch checks them)."""
        return {it.data_source for it in (*self.train, *self.heldout)}


def run_data(cfg, tokenizer) -> RunData:
    """The run's splits (see :class:`RunData`) from the config's ``data`` and ``task``.

    Training prompts: ``data.train_files``, else the task's train split. Held-out prompts:
    ``data.val_files``, else the task's held-out split with reasoning-gym, else none.

    Raises:
        ConfigError: a bad file or row, a prompt over the limit (``overlong_prompts=error``),
            or no training prompt left.
    """
    d, limit = cfg.data, prompt_limit(cfg)
    notes: list[str] = []

    def files(key: str) -> list[PromptItem]:
        items, dropped = load_items(
            plain(d)[key], tokenizer, f"data.{key}", **file_keys(cfg),
            max_prompt_tokens=limit, overlong_prompts=d.overlong_prompts,
        )  # fmt: skip
        _note_drops(notes, f"data.{key}", dropped, len(items) + dropped, limit)
        return items

    def task(split: str) -> list[PromptItem]:
        items, dropped = task_split(task_section(cfg), split, tokenizer)
        _note_drops(notes, f"task {split} split", dropped, len(items) + dropped, limit)
        return items

    source = "files" if from_files(cfg) else "reasoning_gym"
    train = files("train_files") if source == "files" else task("train")
    if not train:
        raise ConfigError(
            f"every training prompt is longer than data.max_prompt_tokens={limit}: raise it "
            "(and model.max_position_embeddings)"
        )
    if d.val_files:
        heldout = files("val_files")
    elif source == "reasoning_gym":
        heldout = task("heldout")
    else:
        heldout = []
        notes.append("data: no data.val_files: no held-out evaluation in this run")
    return RunData(train, heldout, source, notes)


def _note_drops(notes: list[str], what: str, dropped: int, total: int, limit: int) -> None:
    if dropped:
        notes.append(
            f"data: dropped {dropped} of {total} prompts of {what} over "
            f"data.max_prompt_tokens={limit} (data.overlong_prompts=drop)"
        )
