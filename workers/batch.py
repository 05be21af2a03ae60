"""Rollout batches as TensorDicts, and joining chunks of different padded widths.

A rollout batch of ``B`` responses (samples) holds, per row (see
:mod:`m2flow.workers.llm.generation`):

- ``prompt_ids`` / ``prompt_mask`` ``[B, P]``, left padded;
- ``response_ids`` / ``response_mask`` / ``logprobs`` ``[B, R]``, right padded;
- ``group_index`` ``[B]``: the GRPO group (prompt) the sample belongs to, unique in a step;
- after scoring: ``rewards`` ``[B]``.

Chunks produced separately (elastic pipelining) have their own ``P`` and ``R``; :func:`concat`
pads them to a common width so they form one global batch.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

LEFT_PADDED = ("prompt_ids", "prompt_mask")  # every other 2-D field is right padded


def to_batch(tensors: dict[str, torch.Tensor]) -> TensorDict:
    """Wrap a dict of ``[B, ...]`` tensors as a TensorDict with batch size ``[B]``."""
    n = len(next(iter(tensors.values())))
    return TensorDict(dict(tensors), batch_size=[n])


def _pad(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra == 0:
        return t
    fill = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if left else [t, fill], dim=1)


def concat(chunks: list[TensorDict], pad_token_id: int) -> TensorDict:
    """Concatenate rollout chunks along the batch, padding 2-D fields to a common width.

    Raises:
        ValueError: chunks with different keys, or no chunk at all.
    """
    if not chunks:
        raise ValueError("concat needs at least one chunk")
    keys = set(chunks[0].keys())
    if any(set(c.keys()) != keys for c in chunks):
        raise ValueError(f"chunks have different fields: {[sorted(c.keys()) for c in chunks]}")
    out = {}
    for k in keys:
        parts = [c[k] for c in chunks]
        if parts[0].dim() == 2:
            width = max(p.shape[1] for p in parts)
            value = pad_token_id if k.endswith("_ids") else 0
            parts = [_pad(p, width, value, left=k in LEFT_PADDED) for p in parts]
        out[k] = torch.cat(parts)
    return to_batch(out)


def num_tokens(batch: TensorDict) -> int:
    """Real (unpadded) prompt + response tokens in the batch."""
    return int(batch["prompt_mask"].sum() + batch["response_mask"].sum())


def row_index(n: int) -> torch.Tensor:
    """``[n]`` row indices ``0..n-1`` on the host, where batches live between workers."""
    return torch.arange(n, device="cpu")


def row_order(n: int, shuffle: bool, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[n]`` host row indices, permuted by ``torch.randperm(n, generator=generator)`` when
    ``shuffle`` (PPO epochs), else in order."""
    if shuffle:
        return torch.randperm(n, generator=generator, device="cpu")
    return row_index(n)


def split_rows(idx: torch.Tensor, size: int | None) -> list[torch.Tensor]:
    """``idx`` in consecutive pieces of ``size`` rows (the last may be shorter); ``None`` or 0:
    one piece. How global batches split into mini-batches and those into micro-batches."""
    return list(torch.split(idx, size or len(idx)))
