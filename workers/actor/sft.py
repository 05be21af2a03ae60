"""Supervised warm start: teach the policy the answer format (and some arithmetic) before GRPO.

The loss is on the answer tokens (+ EOS) only. Warm start stops at a step budget, a time
budget, or as soon as greedy accuracy on a *validation* split (not the held-out test split)
reaches ``target_accuracy``. Stopping early on purpose leaves the policy uncertain, which is
where GRPO has signal: groups with mixed rewards.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from ..algos.losses import make_loss
from ..data.item import PromptItem
from ..data.reasoning_gym import task_split
from ..llm.generation import left_pad
from ..scoring.evaluation import evaluate
from ..scoring.functions import RewardFunction


def sft_batch(
    tokenizer: PreTrainedTokenizerBase, items: Sequence[PromptItem]
) -> dict[str, torch.Tensor]:
    """Tensors for :func:`sft_step`: left-padded prompts ``[B, P]`` (the items'
    ``prompt_ids``) and right-padded ``target + EOS`` responses ``[B, R]`` with masks (the
    item's ``target``: the answer, or ``<answer>answer</answer>`` for chat prompts)."""
    prompts = [list(it.prompt_ids) for it in items]
    answers = [
        tokenizer(it.target, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        for it in items
    ]
    prompt_ids, prompt_mask = left_pad(prompts, tokenizer.pad_token_id)
    length = max(len(a) for a in answers)
    response_ids = torch.full((len(items), length), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(items), length), dtype=torch.long)
    for i, a in enumerate(answers):
        response_ids[i, : len(a)] = torch.tensor(a)
        response_mask[i, : len(a)] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }


def sft_step(engine, batch: dict, micro_batch_size: int | None = None) -> float:
    """One supervised optimizer step of ``engine`` (a :class:`~..engines.train.TrainEngine`
    training alone): :func:`~..algos.losses.sft_loss`, the token-mean NLL of the response
    (answer + EOS) tokens over the whole batch, whatever the micro split. Same layout as
    rollouts (``[B, P]`` left-padded prompts, ``[B, R]`` right-padded responses), so the
    positions the model learns match generation. Returns the loss (nats per answer token)."""
    loss = make_loss("sft", "sft")
    units = max(loss.units(batch), 1.0)
    total = 0.0
    for r in engine.forward_backward(batch, loss, micro_batch_size, normalizer=units):
        total += r["loss"]
    engine.optimizer_step()
    return total


@dataclass
class SFTResult:
    steps: int
    seconds: float
    last_loss: float
    val_accuracy: float | None


def run_sft(
    engine,
    tokenizer: PreTrainedTokenizerBase,
    train: Sequence[PromptItem],
    steps: int,
    batch_size: int = 256,
    seed: int = 0,
    val: Sequence[PromptItem] | None = None,
    reward: RewardFunction | None = None,
    target_accuracy: float | None = None,
    eval_every: int = 50,
    time_budget_s: float | None = None,
    log: Callable[[str], None] | None = print,
) -> SFTResult:
    """Supervised warm start of ``engine`` (a :class:`~..engines.train.TrainEngine` training
    alone; its ``model`` generates the checks) on ``train`` (sampled with replacement,
    ``batch_size`` items per step; each item's ``target`` is the response).

    Stops after ``steps`` optimizer steps, after ``time_budget_s`` seconds, or when greedy
    accuracy on ``val`` (checked every ``eval_every`` steps, scored by ``reward``; default:
    the ``auto`` reward function) reaches ``target_accuracy``.
    """
    reward = reward or RewardFunction()
    rng = random.Random(seed)
    t0 = time.perf_counter()
    # Greedy checks long enough for the longest target + EOS (8 tokens at least).
    val_tokens = 8
    if val:
        targets = tokenizer([it.target for it in val], add_special_tokens=False).input_ids
        val_tokens = max(8, max(len(t) for t in targets) + 1)
    loss, acc, step = float("nan"), None, 0
    for step in range(1, steps + 1):
        items = [train[rng.randrange(len(train))] for _ in range(batch_size)]
        loss = sft_step(engine, sft_batch(tokenizer, items))
        if val and step % eval_every == 0:
            acc = evaluate(engine.model, tokenizer, val, reward, val_tokens)["accuracy"]
            if log:
                elapsed = time.perf_counter() - t0
                log(f"sft step {step} loss {loss:.3f} val_acc {acc:.3f} t {elapsed:.0f}s")
            if target_accuracy is not None and acc >= target_accuracy:
                break
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            break
    return SFTResult(step, time.perf_counter() - t0, loss, acc)


def warm_start(
    engine,
    tokenizer: PreTrainedTokenizerBase,
    task: dict | None,
    steps: int,
    lr: float,
    rl_lr: float,
    reward: dict | None = None,
    **kwargs,
) -> dict:
    """:func:`run_sft` on the task's training split, checked on its validation split
    (``task["val_seed"]``, ``task["val_size"]``; never the held-out split), at learning rate
    ``lr``; then the engine is left at ``rl_lr`` with fresh AdamW moments (the supervised
    ones mislead RL). ``task=None`` (data files: no targets) or ``steps=0``: no step.

    Args:
        reward: :class:`~..scoring.functions.RewardFunction` arguments (default ``auto``).
        **kwargs: :func:`run_sft`'s ``batch_size``, ``seed``, ``target_accuracy``,
            ``eval_every``, ``time_budget_s``.

    Returns:
        ``steps``, ``seconds``, ``loss`` (last), ``val_accuracy`` (greedy, last check).
    """
    if task is None or steps == 0:
        train = val = []
        steps = 0
    else:
        train, val = (task_split(task, s, tokenizer)[0] for s in ("train", "val"))
    engine.set_lr(lr)
    res = run_sft(engine, tokenizer, train, steps=steps, val=val,
                  reward=RewardFunction(**(reward or {})), log=None, **kwargs)  # fmt: skip
    engine.set_lr(rl_lr)
    engine.reset_optimizer()
    return {"steps": res.steps, "seconds": res.seconds, "loss": res.last_loss,
            "val_accuracy": res.val_accuracy}  # fmt: skip
