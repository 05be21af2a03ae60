"""Supervised warm start: teach the policy the answer format (and some arithmetic) before GRPO.

The loss is on the answer tokens (+ EOS) only. Warm start stops at a step budget, a time
budget, or as soon as greedy accuracy on a *validation* split (not the held-out test split)
reaches ``target_accuracy``. Stopping early on purpose leaves the policy uncertain, which is
where GRPO has signal: groups with mixed rewards.

Multi-turn traces (an agent's tool-use episodes) are given already tokenised instead
(:func:`trace_batch`, ``warm_start(..., traces=...)``): the episode after its opening messages
is the response, its ``loss_mask`` keeps the loss on the model's own tokens and leaves tool
output and template tokens as context only.
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


#: the keys of a multi-turn SFT trace
TRACE_KEYS = ("prompt_ids", "response_ids", "loss_mask")


def check_traces(traces: Sequence[dict]) -> None:
    """Raise ``ValueError`` naming the first malformed trace: each is a dict of token lists
    :data:`TRACE_KEYS` (``prompt_ids`` non-empty, ``loss_mask`` as long as ``response_ids``,
    0/1, with at least one 1)."""
    if not traces:
        raise ValueError("warm start traces: give at least one trace")
    for i, t in enumerate(traces):
        missing = [k for k in TRACE_KEYS if k not in t]
        if missing:
            raise ValueError(
                f"warm start trace {i}: missing {', '.join(missing)}; each trace is a dict of "
                "token lists prompt_ids, response_ids, loss_mask (1 on the model's tokens)"
            )
        if not len(t["prompt_ids"]):
            raise ValueError(f"warm start trace {i}: empty prompt_ids (the opening messages)")
        if len(t["loss_mask"]) != len(t["response_ids"]):
            raise ValueError(
                f"warm start trace {i}: loss_mask has {len(t['loss_mask'])} entries and "
                f"response_ids {len(t['response_ids'])}: give one 0/1 per response token"
            )
        if set(map(int, t["loss_mask"])) - {0, 1} or not any(t["loss_mask"]):
            raise ValueError(
                f"warm start trace {i}: loss_mask must be 0/1 with at least one 1 (a model "
                "token to learn)"
            )


def trace_batch(traces: Sequence[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Tensors for :func:`sft_step` from multi-turn traces (dicts of token lists
    :data:`TRACE_KEYS`, as :class:`~..agent.chat.Trajectory` holds them): left-padded
    ``prompt_ids``/``prompt_mask`` ``[B, P]``, right-padded ``response_ids``,
    ``response_mask`` (1 on every response token: the forward attends to tool output) and
    ``loss_mask`` ``[B, R]`` (the trace's: 1 on the model's tokens, 0 on tool output and
    padding). Raises ``ValueError`` for a malformed trace (:func:`check_traces`)."""
    check_traces(traces)
    prompt_ids, prompt_mask = left_pad([list(t["prompt_ids"]) for t in traces], pad_token_id)
    length = max(max(len(t["response_ids"]) for t in traces), 1)
    response_ids = torch.full((len(traces), length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(traces), length), dtype=torch.long)
    mask = torch.zeros((len(traces), length), dtype=torch.long)
    for i, t in enumerate(traces):
        n = len(t["response_ids"])
        response_ids[i, :n] = torch.tensor(list(t["response_ids"]), dtype=torch.long)
        response_mask[i, :n] = 1
        mask[i, :n] = torch.tensor([int(v) for v in t["loss_mask"]], dtype=torch.long)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "loss_mask": mask,
    }


def sft_step(engine, batch: dict, micro_batch_size: int | None = None) -> float:
    """One supervised optimizer step of ``engine`` (a :class:`~..engines.train.TrainEngine`
    training alone): :func:`~..algos.losses.sft_loss`, the token-mean NLL of the response
    (answer + EOS) tokens over the whole batch, whatever the micro split; of the
    ``loss_mask`` tokens when ``batch`` has one (:func:`trace_batch`). Same layout as
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
    make_batch: Callable[[list], dict] | None = None,
) -> SFTResult:
    """Supervised warm start of ``engine`` (a :class:`~..engines.train.TrainEngine` training
    alone; its ``model`` generates the checks) on ``train`` (sampled with replacement,
    ``batch_size`` items per step; each item's ``target`` is the response).

    Stops after ``steps`` optimizer steps, after ``time_budget_s`` seconds, or when greedy
    accuracy on ``val`` (checked every ``eval_every`` steps, scored by ``reward``; default:
    the ``auto`` reward function) reaches ``target_accuracy``. ``make_batch``: the batch of a
    step's items (default :func:`sft_batch`; :func:`trace_batch` for multi-turn traces).
    """
    if make_batch is None:
        make_batch = lambda items: sft_batch(tokenizer, items)  # noqa: E731
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
        loss = sft_step(engine, make_batch(items))
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
    traces: Sequence[dict] | None = None,
    **kwargs,
) -> dict:
    """:func:`run_sft` on the task's training split, checked on its validation split
    (``task["val_seed"]``, ``task["val_size"]``; never the held-out split), at learning rate
    ``lr``; then the engine is left at ``rl_lr`` with fresh AdamW moments (the supervised
    ones mislead RL). ``task=None`` (data files: no targets) or ``steps=0``: no step.

    With ``traces`` (multi-turn episodes, e.g. tool-use traces: dicts of token lists
    ``prompt_ids``, ``response_ids``, ``loss_mask``, :func:`trace_batch`) the steps train on
    them instead of the task's training split, the loss on the ``loss_mask`` tokens only;
    the task, if given, still supplies the validation split (``task=None``: no check).

    Args:
        reward: :class:`~..scoring.functions.RewardFunction` arguments (default ``auto``).
        traces: the multi-turn traces to train on (see above).
        **kwargs: :func:`run_sft`'s ``batch_size``, ``seed``, ``target_accuracy``,
            ``eval_every``, ``time_budget_s``.

    Returns:
        ``steps``, ``seconds``, ``loss`` (last), ``val_accuracy`` (greedy, last check).

    Raises:
        ValueError: a malformed trace (:func:`check_traces`).
    """
    make_batch = None
    if traces is not None:
        check_traces(traces)
        train = list(traces)
        val = [] if task is None or steps == 0 else task_split(task, "val", tokenizer)[0]
        make_batch = lambda items: trace_batch(items, tokenizer.pad_token_id)  # noqa: E731
    elif task is None or steps == 0:
        train = val = []
        steps = 0
    else:
        train, val = (task_split(task, s, tokenizer)[0] for s in ("train", "val"))
    engine.set_lr(lr)
    res = run_sft(engine, tokenizer, train, steps=steps, val=val,
                  reward=RewardFunction(**(reward or {})), log=None, make_batch=make_batch,
                  **kwargs)  # fmt: skip
    engine.set_lr(rl_lr)
    engine.reset_optimizer()
    return {"steps": res.steps, "seconds": res.seconds, "loss": res.last_loss,
            "val_accuracy": res.val_accuracy}  # fmt: skip
