"""How a role drives an engine (:class:`~.train.TrainEngine`, or a value engine) through one
update: the batch split into mini-batches (one optimizer step each, PPO epochs over shuffled
orders), or streamed parts accumulated into one step. The loss is the role's
(:mod:`~m2flow.workers.algos.losses`); the engine forwards, backpropagates and steps; these
loops hold neither a loss nor a model.

Batch units: sizes count responses (samples); the loss's normalizer counts its units (tokens,
or sequences) of a whole mini-batch, or of the whole streamed step. A whole-step engine's ranks
are all given the same batch and each trains its share.

The policy's and the value model's mini-batch loops (:func:`minibatch_update`,
:func:`value_update`) differ only in how they add up logged metrics (over the whole update, or
per step), two orders of float additions kept so every logged number stays what it was.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..batch import row_order, split_rows

_RECORD = ("loss", "weight")


def _metrics(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if k not in _RECORD}


def minibatch_update(
    engine, data: dict, loss, mini_batch_size: int | None, micro_batch_size: int | None,
    epochs: int = 1, generator: torch.Generator | None = None,
) -> dict[str, float]:  # fmt: skip
    """``epochs`` passes over ``data`` (shuffled by ``generator`` when more than one), each in
    mini-batches of ``mini_batch_size`` responses, one optimizer step each; every micro-batch's
    loss divided by its mini-batch's units (token mean over the mini-batch, whatever the micro
    split).

    Args:
        engine: the :class:`~..engines.train.TrainEngine` (a whole-step engine: every rank
            passes the same ``data`` and trains its share).
        data: ``[B, ...]`` tensors the loss reads (behaviour logprobs, advantages, ...).
        loss: a :class:`~m2flow.workers.algos.losses.Loss`.

    Returns:
        the loss's metrics and ``loss`` averaged over the optimizer steps (each step's
        micro-batch metrics weighted by their share of its units), ``grad_norm`` (pre-clip, its
        mean), ``steps`` and ``nonfinite_skips`` (steps skipped for a non-finite value).
    """
    n = len(data["response_ids"])
    sums: dict[str, float] = defaultdict(float)
    n_steps = skips = 0
    for _ in range(epochs):
        order = row_order(n, epochs > 1, generator)
        for mini in split_rows(order, mini_batch_size):
            part = {k: v[mini] for k, v in data.items()}
            # Token mean over the whole mini-batch, whatever the micro split.
            units = max(loss.units(part), 1.0)
            for r in engine.forward_backward(part, loss, micro_batch_size, normalizer=units):
                # Weight micro metrics by their share of the mini-batch's units.
                sums["loss"] += r["loss"]
                for k, v in _metrics(r).items():
                    sums[k] += v * r["weight"] / units
            step = engine.optimizer_step()
            sums["grad_norm"] += step["grad_norm"]
            skips += step["skipped"]
            n_steps += 1
    keys = ("loss", *loss.metrics)  # a data-parallel rank's shares of the sums
    sums.update(engine.reduce_metrics({k: sums[k] for k in keys}, keys))
    metrics = {k: v / n_steps for k, v in sums.items()}
    metrics["steps"] = n_steps
    metrics["nonfinite_skips"] = skips
    return metrics


class StreamedStep:
    """One optimizer step over parts that arrive one by one (the streaming update: the consumer
    side of elastic pipelining, RLinf section 3.3): :meth:`add` forwards and backpropagates a
    part with its loss summed (gradients accumulate), :meth:`finish` divides the accumulated
    gradients by the units of every part (summed over data-parallel ranks) and steps. Over parts
    ``B_1 .. B_k`` this is the one-mini-batch update on their concatenation (the token mean is
    linear), up to float rounding."""

    def __init__(self, engine, loss, micro_batch_size: int | None) -> None:
        self.engine, self.loss, self.micro = engine, loss, micro_batch_size
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, data: dict) -> int:
        """Forward/backward of one part; returns its responses."""
        for r in self.engine.forward_backward(data, self.loss, self.micro):
            self.sums["units"] += r["weight"]
            self.sums["loss"] += r["loss"]
            for k, v in _metrics(r).items():
                self.sums[k] += v * r["weight"]
        return len(data["response_ids"])

    def finish(self, skip: bool = False) -> dict[str, float]:
        """The step (data parallel: a collective every rank calls once, with parts or none).
        ``skip``: drop the accumulated gradients instead (counted in ``nonfinite_skips``).

        Returns:
            ``loss`` and the loss's metrics (means over the accumulated units), ``grad_norm``
            (pre-clip), ``steps`` (1; 0 if nothing was accumulated), ``nonfinite_skips``.
        """
        keys = ("units", "loss", *self.loss.metrics)
        sums, self.sums = self.sums, defaultdict(float)
        if self.engine.data_parallel:  # every rank skips if one does
            sums["skip"] = float(skip)
            keys += ("skip",)
        acc = self.engine.reduce_metrics(sums, keys)
        skip = acc.pop("skip", 0.0) > 0 or skip
        if skip or not acc or acc["units"] <= 0:
            self.engine.zero_grad()
            return {"steps": 0, "nonfinite_skips": int(skip)}
        total = acc.pop("units")
        metrics = {k: v / total for k, v in acc.items()}
        step = self.engine.optimizer_step(normalizer=total)
        metrics["grad_norm"] = step["grad_norm"]
        metrics["steps"] = 1
        metrics["nonfinite_skips"] = step["skipped"]
        return metrics


def value_update(
    engine, data: dict, loss, mini_batch_size: int | None, micro_batch_size: int | None,
    epochs: int = 1, generator: torch.Generator | None = None,
) -> dict[str, float]:  # fmt: skip
    """:func:`minibatch_update` for a value loss (the critic's clipped value regression): each
    step's metric sums (micro-batch metrics times their share of the mini-batch's tokens,
    summed over the data-parallel ranks) added to the update's.

    Returns:
        the loss's metrics and ``grad_norm`` averaged over optimizer steps, ``steps``;
        ``nonfinite_skips`` if a step was skipped.
    """
    n, keys = len(data["response_ids"]), loss.metrics
    sums: dict[str, float] = defaultdict(float)
    steps = skips = 0
    for _ in range(epochs):
        order = row_order(n, epochs > 1, generator)
        for mini in split_rows(order, mini_batch_size):
            part = {k: v[mini] for k, v in data.items()}
            # Token mean over the whole mini-batch (all DP slices), whatever the split.
            units = max(loss.units(part), 1.0)
            step_sums: dict[str, float] = defaultdict(float)
            for r in engine.forward_backward(part, loss, micro_batch_size, normalizer=units):
                share = r["weight"] / units
                for k in keys:
                    step_sums[k] += r[k] * share
            for k, v in engine.reduce_metrics(step_sums, keys).items():
                sums[k] += v
            step = engine.optimizer_step()
            sums["grad_norm"] += step["grad_norm"]
            skips += step["skipped"]
            steps += 1
    out = {k: v / max(steps, 1) for k, v in sums.items()}
    out["steps"] = steps
    return out | ({"nonfinite_skips": skips} if skips else {})
