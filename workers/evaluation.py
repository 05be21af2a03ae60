"""Greedy held-out evaluation of a policy on a :class:`~workers.tasks.TaskDataset`."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .rollout.generation import decode_responses, generate
from .tasks import TaskDataset, TaskItem, accuracy


def greedy_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: TaskDataset,
    items: Sequence[TaskItem],
    max_new_tokens: int = 8,
    batch_size: int = 512,
) -> list[float]:
    """Greedy-decode ``items`` (of ``dataset``) and score each with the task's own scorer.

    Args:
        batch_size: prompts per ``generate`` call at most (fewer where the logits of a batch
            would pass 256 MiB).

    Returns:
        one score in [0, 1] per item (partial credit; accuracy counts score == 1 only).
    """
    # generate() keeps [batch, max_new_tokens, vocab] fp32 logits: cap them at 256 MiB (a
    # 151k vocabulary at 64 tokens: 6 prompts a batch; a character vocabulary: no cap).
    per_row = len(tokenizer) * max_new_tokens * 4
    batch_size = max(1, min(batch_size, (256 << 20) // per_row))
    scores: list[float] = []
    for start in range(0, len(items), batch_size):
        batch = items[start : start + batch_size]
        prompts = [tokenizer(it.prompt).input_ids for it in batch]
        out = generate(
            model, tokenizer, prompts, n_samples=1, max_new_tokens=max_new_tokens, greedy=True
        )
        texts = decode_responses(tokenizer, out["response_ids"], out["response_mask"])
        scores += dataset.score(texts, batch)
    return scores


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: TaskDataset,
    max_new_tokens: int = 8,
    batch_size: int = 512,
) -> dict[str, float]:
    """Greedy-decode every item of ``dataset`` and score it with the task's scorer.

    Returns:
        ``accuracy`` (fraction with score == 1), ``mean_score`` (mean partial-credit reward),
        ``n`` (items).
    """
    scores = greedy_scores(model, tokenizer, dataset, dataset.items, max_new_tokens, batch_size)
    return {
        "accuracy": accuracy(scores),
        "mean_score": sum(scores) / max(len(scores), 1),
        "n": len(scores),
    }
