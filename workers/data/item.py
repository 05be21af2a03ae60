"""The prompt item every data source gives, the prompt limit, and the step's prompt items.

A :class:`PromptItem` is tokenized once, when its split is built. What travels with a rollout
chunk is its :meth:`PromptItem.entry`, a small plain dict (``chunk.entries[group]``) that
the reward function reads: ``{"data_source", "ground_truth", "extra_info", "index"}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from m2flow.core.config import ConfigError

#: ``data.overlong_prompts`` values: stop before the run starts, or drop (counted, logged).
OVERLONG = ("error", "drop")


@dataclass
class PromptItem:
    """One prompt of a split.

    Attributes:
        prompt_ids: the prompt's token ids (the tokenizer's encoding of the prompt text).
        data_source: where it comes from: ``reasoning_gym/<task>``, or a file row's
            ``data_source`` (the reward function dispatches on it).
        ground_truth: what the reward function compares a response with (any JSON value).
        extra_info: whatever else the reward function needs (reasoning-gym: ``{"entry":
            <the task's entry>}``, which its scorer reads).
        index: the row's position in its split (files: in the listed files, in order, counted
            before any overlong prompt is dropped); error messages name it.
        target: the supervised warm start's response (reasoning-gym only; ``""`` otherwise).
        prompt: the prompt text the ids encode (for logs and tests).
    """

    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    index: int = 0
    target: str = ""
    prompt: str = ""

    def entry(self) -> dict[str, Any]:
        """What a rollout chunk carries for the reward function (plain, picklable)."""
        return {
            "data_source": self.data_source,
            "ground_truth": self.ground_truth,
            "extra_info": self.extra_info,
            "index": self.index,
        }


def limit_prompts(
    items: list[PromptItem],
    limit: int,
    overlong: str,
    where: str,
    fix: str = "",
    first_row: int = 0,
) -> tuple[list[PromptItem], int]:
    """Apply the prompt limit: prompts of more than ``limit`` tokens stop the run
    (``overlong="error"``) or are dropped (``"drop"``).

    Args:
        limit: the longest prompt in tokens (``data.max_prompt_tokens``, resolved); 0: none.
        where: names the split in the error (``"data.train_files: /path/a.jsonl"``).
        fix: source-specific advice added to the error's fix.
        first_row: the ``index`` of the first row of ``where`` (the error names the row
            within it).

    Returns:
        ``(kept items, dropped count)``.

    Raises:
        ConfigError: with ``"error"``, the first overlong item: its row, length, the limit
            and the fix.
        ValueError: an unknown ``overlong``.
    """
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be one of {OVERLONG}, got {overlong!r}")
    if limit <= 0:
        return items, 0
    kept = [it for it in items if len(it.prompt_ids) <= limit]
    if len(kept) < len(items) and overlong == "error":
        bad = next(it for it in items if len(it.prompt_ids) > limit)
        raise ConfigError(
            f"{where}: row {bad.index - first_row}'s prompt is {len(bad.prompt_ids)} tokens > "
            f"data.max_prompt_tokens={limit}: raise data.max_prompt_tokens (and "
            "model.max_position_embeddings >= it + rollout.max_new_tokens)"
            f"{', ' + fix if fix else ''}, or set data.overlong_prompts=drop to leave such "
            f"prompts out ({len(items) - len(kept)} of {len(items)} here)"
        )
    return kept, len(items) - len(kept)


def prompt_items(items: Sequence[PromptItem], indices: Sequence[int], step: int) -> list[dict]:
    """The step's prompt items for the rollout (``RolloutWorker.generate``): item
    ``items[indices[g]]`` as group ``g`` (``0..len(indices)-1``): ``{"prompt_ids", "group",
    "entry", "step"}`` (``(step, group)`` keys the rollout's sampling)."""
    return [
        {"prompt_ids": items[i].prompt_ids, "group": g, "entry": items[i].entry(), "step": step}
        for g, i in enumerate(indices)
    ]
