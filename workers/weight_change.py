"""How far a training step moved the weights: the ``update_norm`` metric of the PPO actor, the
critic and the embodied actor (the Megatron critic reduces its shards over TP itself:
:meth:`~m2flow.workers.engines.megatron.critic.MegatronCritic.change_norm`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def snapshot(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``params`` (on their devices), for :func:`update_norm` after the step."""
    return [p.detach().clone() for p in params]


def update_norm(before: list[torch.Tensor], after: Iterable[torch.Tensor]) -> float:
    """L2 norm of the weight change ``after - before`` over two parameter lists in the same order
    (the tensors' squared sums added as Python floats); 0.0 for empty lists."""
    sq = sum(float(((a.detach() - b) ** 2).sum()) for a, b in zip(after, before))
    return sq**0.5
