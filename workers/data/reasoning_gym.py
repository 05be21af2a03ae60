"""reasoning-gym's procedural tasks as prompt items (the default source).

An item's ``data_source`` is ``reasoning_gym/<task name>``, its ``ground_truth`` the entry's
answer, and its ``extra_info`` ``{"entry": <the task's entry>}``: what the task's own scorer
reads (the ``reasoning_gym`` reward function). The prompt text and the warm start's target are
:class:`~m2flow.workers.tasks.TaskDataset`'s (compact prompts for the character tokenizer,
the question through the chat template otherwise).
"""

from __future__ import annotations

from typing import Any

from m2flow.run.recipe import plain

from ..tasks import DEFAULT_SYSTEM_PROMPT, TaskDataset
from .config import prompt_limit
from .item import PromptItem, limit_prompts

#: ``data_source`` prefix of reasoning-gym items (the ``auto`` reward function's dispatch)
SOURCE_PREFIX = "reasoning_gym/"

#: ``task.config`` defaults per task, under the keys the user sets (other tasks: {}, i.e.
#: reasoning-gym's own defaults). chain_sum's: short sums the tiny model can learn.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
}


def task_config(name: str, config: dict) -> dict:
    """The generator's keyword arguments: ``TASK_DEFAULTS[name]`` updated with ``config``."""
    return {**TASK_DEFAULTS.get(name, {}), **dict(config)}


def task_section(cfg) -> dict:
    """``plain(cfg.task)`` with ``config`` (:func:`task_config`) resolved, plus the prompt
    limit (``max_prompt_tokens``: :func:`~m2flow.workers.data.config.prompt_limit`, and
    ``overlong_prompts``): what :func:`task_split` reads."""
    t = plain(cfg.task)
    return {
        **t,
        "config": task_config(t["name"], t["config"]),
        "max_prompt_tokens": prompt_limit(cfg),
        "overlong_prompts": cfg.data.overlong_prompts,
    }


def task_items(dataset: TaskDataset, tokenizer) -> list[PromptItem]:
    """The items of a :class:`TaskDataset`, their prompts tokenized with ``tokenizer``'s
    special tokens (the character tokenizer's ``<bos>``; Qwen2 adds none)."""
    ids = tokenizer([it.prompt for it in dataset.items]).input_ids
    return [
        PromptItem(
            p, f"{SOURCE_PREFIX}{dataset.name}", it.answer, {"entry": it.entry}, index=i,
            target=it.target, prompt=it.prompt,
        )
        for i, (it, p) in enumerate(zip(dataset.items, ids))
    ]  # fmt: skip


def task_split(task: dict, split: str, tokenizer) -> tuple[list[PromptItem], int]:
    """The ``split`` (``"train"``, ``"val"`` or ``"heldout"``) of a ``task`` section as
    prompt items, the prompt limit applied.

    Args:
        task: :func:`task_section`'s dict: ``name``, ``config``,
            ``{split}_seed``, ``{split}_size``, ``system_prompt``, and the resolved
            ``max_prompt_tokens`` and ``overlong_prompts`` (``data.*``).

    Returns:
        ``(items, dropped)``: ``dropped`` prompts over the limit (``overlong_prompts="drop"``).

    Raises:
        ConfigError: an item the tokenizer cannot encode, or (``overlong_prompts="error"``)
            a prompt over the limit.
    """
    ds = TaskDataset(
        task["name"],
        dict(task["config"]),
        seed=task[f"{split}_seed"],
        size=task[f"{split}_size"],
        tokenizer=tokenizer,
        system_prompt=task.get("system_prompt", DEFAULT_SYSTEM_PROMPT),
    )
    return limit_prompts(
        task_items(ds, tokenizer),
        task.get("max_prompt_tokens", 0),
        task.get("overlong_prompts", "error"),
        f"task.name={task['name']} ({split} split, seed {task[f'{split}_seed']})",
        "pick a task.config with shorter questions",
    )
