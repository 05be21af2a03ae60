"""Greedy held-out evaluation of a policy on a :class:`~workers.tasks.TaskDataset`."""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .rollout.generation import decode_responses, generate
from .tasks import TaskDataset, accuracy


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
    scores: list[float] = []
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        prompts = [tokenizer(it.prompt).input_ids for it in items]
        out = generate(
            model, tokenizer, prompts, n_samples=1, max_new_tokens=max_new_tokens, greedy=True
        )
        texts = decode_responses(tokenizer, out["response_ids"], out["response_mask"])
        scores += dataset.score(texts, items)
    return {
        "accuracy": accuracy(scores),
        "mean_score": sum(scores) / max(len(scores), 1),
        "n": len(scores),
    }
