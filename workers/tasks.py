"""reasoning-gym task wrapper: prompts the tiny model can read, scoring by the task's own scorer.

The model never sees reasoning-gym's verbose question ("State the final answer to ... 4 - 1 =").
:func:`compact_prompt` maps it to a short prompt (``"4-1="``); the model's response is scored
as-is by ``dataset.score_answer(response, entry)``, so the answer format is whatever
reasoning-gym accepts (for ``chain_sum``: a decimal number, sign and leading zeros tolerated).

Train and held-out splits are the same generator with different seeds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import reasoning_gym


def compact_prompt(entry: dict[str, Any], name: str = "chain_sum") -> str:
    """Short prompt for an entry: for ``chain_sum`` the bare expression (``98+93-77=``)."""
    if name == "chain_sum":
        return entry["metadata"]["expression"].replace(" ", "") + "="
    # Generic fallback: the question text itself (needs a tokenizer alphabet that covers it).
    return entry["question"]


@dataclass
class TaskItem:
    """One task instance: ``prompt`` is what the model sees, ``entry`` is what the scorer needs."""

    prompt: str
    question: str
    answer: str
    entry: dict[str, Any]


class TaskDataset:
    """A reasoning-gym procedural dataset with compact prompts.

    Args:
        name: reasoning-gym dataset name, e.g. ``"chain_sum"``.
        config: generator config, e.g. ``{"min_terms": 2, "max_terms": 3, "min_digits": 1,
            "max_digits": 2}``.
        seed: generator seed; use different seeds for train and held-out splits.
        size: number of items.
    """

    def __init__(
        self, name: str = "chain_sum", config: dict | None = None, seed: int = 0, size: int = 1000
    ):
        self.name = name
        self.config = dict(config or {})
        self.seed = seed
        self.dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **self.config)
        # Items are generated once: reasoning-gym regenerates on every __getitem__.
        self.items = [self._item(self.dataset[i]) for i in range(size)]

    def _item(self, entry: dict[str, Any]) -> TaskItem:
        return TaskItem(compact_prompt(entry, self.name), entry["question"], entry["answer"], entry)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, idx: int) -> TaskItem:
        return self.items[idx]

    def score(
        self, responses: Sequence[str], entries: Sequence[dict[str, Any] | TaskItem]
    ) -> list[float]:
        """Per-response reward in [0, 1] from the dataset's own ``score_answer``.

        ``responses[i]`` is the decoded response text (special tokens removed, whitespace
        stripped by the caller or here); ``entries[i]`` the matching entry or :class:`TaskItem`.
        reasoning-gym gives partial credit (e.g. 0.75 if the true answer is a substring), so the
        mean reward is not the accuracy.
        """
        if len(responses) != len(entries):
            raise ValueError(f"{len(responses)} responses for {len(entries)} entries")
        out = []
        for text, e in zip(responses, entries):
            entry = e.entry if isinstance(e, TaskItem) else e
            out.append(float(self.dataset.score_answer(text.strip(), entry)))
        return out


@functools.cache
def _score_fn(source_dataset: str):
    return reasoning_gym.get_score_answer_fn(source_dataset)


def score(responses: Sequence[str], entries: Sequence[dict[str, Any] | TaskItem]) -> list[float]:
    """Per-response reward in [0, 1] without a dataset object at hand.

    Each entry names its generator in ``entry["metadata"]["source_dataset"]``; the score is that
    reasoning-gym dataset's own ``score_answer(response, entry)`` (see :meth:`TaskDataset.score`).
    Useful in a reward worker that only receives entries.
    """
    if len(responses) != len(entries):
        raise ValueError(f"{len(responses)} responses for {len(entries)} entries")
    out = []
    for text, e in zip(responses, entries):
        entry = e.entry if isinstance(e, TaskItem) else e
        fn = _score_fn(entry["metadata"]["source_dataset"])
        out.append(float(fn(text.strip(), entry)))
    return out


def accuracy(scores: Sequence[float]) -> float:
    """Fraction of responses that are fully correct (score == 1.0), not the mean partial credit."""
    return sum(1 for s in scores if s == 1.0) / max(len(scores), 1)
