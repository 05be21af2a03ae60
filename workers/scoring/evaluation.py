"""Greedy held-out evaluation of a policy on prompt items, scored by the run's reward
function (:class:`~m2flow.workers.scoring.functions.RewardFunction`)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..data.item import PromptItem
from ..llm.generation import generate
from ..llm.tokenizer import decode_responses
from ..tasks import accuracy
from .functions import RewardFunction, RewardResult


def greedy_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    max_new_tokens: int = 8,
    batch_size: int = 512,
) -> list[str]:
    """Greedy-decode each prompt (token ids); returns the decoded responses.

    Args:
        batch_size: prompts per ``generate`` call at most (fewer where the logits of a batch
            would pass 256 MiB).
    """
    # generate() keeps [batch, max_new_tokens, vocab] fp32 logits: cap them at 256 MiB (a
    # 151k vocabulary at 64 tokens: 6 prompts a batch; a character vocabulary: no cap).
    per_row = len(tokenizer) * max_new_tokens * 4
    batch_size = max(1, min(batch_size, (256 << 20) // per_row))
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        out = generate(
            model, tokenizer, list(prompts[start : start + batch_size]), n_samples=1,
            max_new_tokens=max_new_tokens, greedy=True,
        )  # fmt: skip
        texts += decode_responses(tokenizer, out["response_ids"], out["response_mask"])
    return texts


def greedy_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    items: Sequence[PromptItem],
    reward: RewardFunction,
    max_new_tokens: int = 8,
    batch_size: int = 512,
) -> RewardResult:
    """Greedy-decode ``items`` and score each response with ``reward``.

    Returns:
        the rewards (``scores``: one per item; reasoning-gym gives partial credit, accuracy
        counts score == 1 only), extra metrics and the count of penalised samples.

    Raises:
        RewardFunctionError: the reward function failed (``on_error="raise"``).
    """
    texts = greedy_responses(
        model, tokenizer, [it.prompt_ids for it in items], max_new_tokens, batch_size
    )
    return reward(texts, [it.entry() for it in items])


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    items: Sequence[PromptItem],
    reward: RewardFunction,
    max_new_tokens: int = 8,
    batch_size: int = 512,
) -> dict[str, float]:
    """Greedy-decode every item and score it with ``reward``.

    Returns:
        ``accuracy`` (fraction with score == 1), ``mean_score`` (mean reward), ``n`` (items),
        ``reward_errors`` (penalised samples).
    """
    res = greedy_scores(model, tokenizer, items, reward, max_new_tokens, batch_size)
    return {
        "accuracy": accuracy(res.scores),
        "mean_score": sum(res.scores) / max(len(res.scores), 1),
        "n": len(res.scores),
        "reward_errors": res.errors,
    }
