"""Training a :class:`~m2flow.workers.engines.value_model.ValueModel`: the critic's clipped value
regression and the reward model's fit to verifier labels.

Reuses :class:`~m2flow.workers.engines.trainer.PolicyTrainer` for what is not policy-specific:
AdamW, gradient clipping, and offload/onload of parameters and optimizer state. Sizes count
responses (samples), as in the policy trainer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .. import parallel
from ..algos.ppo import clipped_value_loss
from ..batch import row_index, row_order, split_rows
from .trainer import RESPONSE_KEYS, PolicyTrainer
from .value_model import ValueModel, response_values, sequence_scores

_METRICS = ("vf_loss", "vf_clip_frac", "value_mean")


class ValueTrainer(PolicyTrainer):
    """AdamW on a value model (``lr``, ``betas``, ``weight_decay``, ``grad_clip`` as in
    :class:`PolicyTrainer`).

    ``values_fn`` computes ``[B, R]`` values (:func:`response_values`; the Megatron critic's
    :func:`~.megatron_engine.megatron_values`). With ``dp_size > 1`` (the Megatron critic) this
    rank trains on the ``dp_rank``-th contiguous slice of every mini-batch and gradients and
    metric sums are summed over ``dp_group`` before each step.
    """

    model: ValueModel
    values_fn = staticmethod(response_values)
    dp_rank, dp_size = 0, 1

    def _inputs(self, batch: Mapping[str, torch.Tensor], idx: torch.Tensor) -> list:
        return [batch[k][idx].to(self.device) for k in RESPONSE_KEYS]

    @torch.no_grad()
    def values(self, batch: Mapping[str, torch.Tensor], micro_batch_size=None) -> torch.Tensor:
        """``[B, R]`` per-token values (see :func:`response_values`), no grad."""
        self.model.eval()
        idx_all = row_index(len(batch["response_ids"]))
        out = []
        for i in split_rows(idx_all, micro_batch_size):
            with self.autocast():
                out.append(self.values_fn(self.model, *self._inputs(batch, i)).cpu())
        return torch.cat(out)

    @torch.no_grad()
    def scores(self, batch: Mapping[str, torch.Tensor], micro_batch_size=None) -> torch.Tensor:
        """``[B]`` sequence scores in (0, 1): sigmoid of :func:`sequence_scores`, no grad."""
        self.model.eval()
        idx_all = row_index(len(batch["response_ids"]))
        out = []
        for i in split_rows(idx_all, micro_batch_size):
            with self.autocast():
                out.append(torch.sigmoid(sequence_scores(self.model, *self._inputs(batch, i))))
        return torch.cat([o.cpu() for o in out])

    def train_values(
        self,
        batch: Mapping[str, torch.Tensor],
        value_clip: float | None,
        mini_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        epochs: int = 1,
        generator: torch.Generator | None = None,
    ) -> dict[str, float]:
        """Clipped value regression on ``batch`` (``old_values`` and ``returns`` ``[B, R]``
        besides the response tensors), ``epochs`` shuffled passes of mini-batches.

        Returns:
            metrics averaged over optimizer steps: ``vf_loss``, ``vf_clip_frac``,
            ``value_mean``, ``grad_norm`` (pre-clip), ``steps``.
        """
        n = len(batch["response_ids"])
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        steps = 0
        for _ in range(epochs):
            order = row_order(n, epochs > 1, generator)
            for mini in split_rows(order, mini_batch_size):
                # Token mean over the whole mini-batch (all DP slices), whatever the split.
                num_tokens = float(batch["response_mask"][mini].sum().clamp(min=1))
                mine = torch.tensor_split(mini, self.dp_size)[self.dp_rank]
                part: dict[str, float] = defaultdict(float)
                for micro in split_rows(mine, micro_batch_size) if len(mine) else []:
                    inputs = self._inputs(batch, micro)
                    with self.autocast():
                        values = self.values_fn(self.model, *inputs)
                    loss, m = clipped_value_loss(
                        values,
                        batch["old_values"][micro].to(self.device),
                        batch["returns"][micro].to(self.device),
                        inputs[3],
                        value_clip,
                        num_tokens,
                    )
                    loss.backward()
                    share = float(inputs[3].sum()) / num_tokens
                    for k, v in m.items():
                        part[k] += v * share
                if self.dp_size > 1:  # every DP rank: the sums and gradients of all slices
                    part = parallel.all_reduce_sums(part, _METRICS, self.dp_group)
                    parallel.all_reduce_grads(self.model, self.dp_group)
                for k, v in part.items():
                    sums[k] += v
                sums["grad_norm"] += self._step()
                steps += 1
        out = {k: v / max(steps, 1) for k, v in sums.items()}
        out["steps"] = steps
        return out

    def fit_step(self, batch: Mapping[str, torch.Tensor], targets: torch.Tensor) -> float:
        """One optimizer step of binary cross-entropy between the sequence score and soft
        labels ``targets [B]`` in [0, 1] (the verifier's partial credit). Returns the loss."""
        self.model.train()
        idx = row_index(len(targets))
        with self.autocast():
            logits = sequence_scores(self.model, *self._inputs(batch, idx))
        loss = F.binary_cross_entropy_with_logits(logits, targets.float().to(self.device))
        loss.backward()
        self._step()
        return loss.item()
