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


def offload_module(module: torch.nn.Module, device: torch.device) -> None:
    """Move a module that holds no optimizer state off its GPU (weights to host memory, cache
    freed). No-op on CPU: a virtual device's memory is host memory already."""
    if device.type == "cuda":
        module.to("cpu")
        torch.cuda.empty_cache()


def onload_module(module: torch.nn.Module, device: torch.device) -> None:
    """Undo :func:`offload_module`."""
    if device.type == "cuda":
        module.to(device)


def split_evenly(n: int, parts: int) -> list[int]:
    """``n`` items over ``parts`` ranks, the first ``n % parts`` ranks taking one more."""
    if parts <= 0:
        raise ValueError(f"cannot split over {parts} ranks")
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def set_torch_threads(worker, threads: int = 0) -> int:
    """Set torch's intra-op threads in the worker's process: ``threads``, or with 0 the worker's
    share of its node's CPUs (:attr:`m2flow.Worker.num_threads`). Returns the count set."""
    n = threads or worker.num_threads
    torch.set_num_threads(n)
    return n
