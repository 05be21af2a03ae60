"""Where a worker's torch tensors live, from the m2flow devices it was placed on."""

from __future__ import annotations

import torch


def torch_device(devices) -> torch.device:
    """``cuda`` (the rank's first visible GPU) on GPU placements, else ``cpu``.

    Virtual devices are CPU slots: their tensors live in host memory.
    """
    if any(d.kind == "cuda" for d in devices):
        return torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES already narrows to this rank
    return torch.device("cpu")


def split_evenly(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` ranks, the first ``n % parts`` ranks taking one more."""
    if parts <= 0:
        raise ValueError(f"cannot split over {parts} ranks")
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]
