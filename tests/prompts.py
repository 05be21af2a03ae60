"""The step's prompt items from a reasoning-gym :class:`~m2flow.workers.tasks.TaskDataset`,
for tests that feed a rollout directly (no runner, no sampler)."""

from __future__ import annotations

import random

from m2flow.workers.data.item import prompt_items
from m2flow.workers.data.reasoning_gym import task_items


def task_prompts(dataset, tokenizer, n: int, seed: int, step: int) -> list[dict]:
    """``n`` prompt items of ``dataset`` for ``step`` (``RolloutWorker.generate``'s input),
    drawn without replacement by a generator seeded with ``(seed, step)``."""
    rng = random.Random(seed * 1_000_003 + step)
    return prompt_items(task_items(dataset, tokenizer), rng.sample(range(len(dataset)), n), step)
