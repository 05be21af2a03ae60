"""CUDA IPC weight transport: ``m2flow.sync_weights(src, dst, transport="cuda_ipc")``.

For a source and receivers collocated on one GPU (the temporal plan's actor and rollout), where
an NCCL group cannot form (one GPU, two ranks) and the object store would copy every byte
through host memory twice. The source packs its weights into one contiguous CUDA buffer per
dtype and shares each buffer's CUDA IPC handle (``torch.multiprocessing.reductions.
reduce_tensor``: a few hundred bytes, sent through the object store); each receiver opens the
handles, which maps the *same* device memory into its process, and gets ``{name: view}``
without a copy. The receiver's ``load_weights`` copies from the views into its own parameters
(device to device); the views are valid only during that call. After every receiver returns,
the driver tells the source to drop its buffers (:func:`release`).

The handles carry the source's device index, which means nothing in a receiver with another
``CUDA_VISIBLE_DEVICES``: the source also sends its GPU's UUID, and a receiver opens the handles
on its visible device with that UUID (:func:`open_buffers`).

Same approach as veRL's and RLinf's collocated weight update (CUDA IPC handles of the trainer's
tensors passed to the inference engine). Written without a GPU at hand: the packing and the
placement checks are tested on CPU (tests/test_weight_sync.py), the transfer itself only by
``tests/test_gpu.py`` on a CUDA machine (``scripts/gpu_tests.sh``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # m2flow itself imports no torch: the workers bring it
    import torch


def check_placement(src, src_rank: int, dst) -> int:
    """The one GPU that ``src``'s rank ``src_rank`` and every rank of ``dst`` share (driver
    side).

    Returns:
        the cluster device id of that GPU.

    Raises:
        ValueError: a member is not on a CUDA device (virtual devices are host memory), is on
            more than one, or the members are on different GPUs; the message names the
            transport to use instead.
    """
    placements = [src.placement[src_rank], *dst.placement]
    devices = {d for p in placements for d in p}
    kinds = {src.cluster.device(d).kind for d in devices}
    if kinds != {"cuda"}:
        raise ValueError(
            f"weight transport 'cuda_ipc' ({src.name}:{src_rank} -> {dst.name}) shares GPU "
            f"memory, but the members are on {'/'.join(sorted(kinds))} devices: use "
            "transport='object_store' or 'collective'"
        )
    if len(devices) != 1:
        raise ValueError(
            f"weight transport 'cuda_ipc' ({src.name}:{src_rank} -> {dst.name}) needs the "
            f"source rank and every receiver on one GPU, not on devices {sorted(devices)}: use "
            "transport='collective' (NCCL between GPUs) or 'object_store'"
        )
    return devices.pop()


def pack(weights: dict[str, torch.Tensor], device: torch.device) -> tuple[dict, list]:
    """Copy ``weights`` into one contiguous buffer per dtype on ``device``.

    Args:
        weights: ``{name: tensor}`` (any device; CPU tensors are copied to ``device``).
        device: where the buffers live (the source's GPU; tests pass ``cpu``).

    Returns:
        ``(buffers, layout)``: ``buffers`` is ``{dtype name: 1-D tensor}``; ``layout`` lists
        ``(name, dtype name, shape, offset, numel)`` in ``weights``' order, offsets in
        elements of that dtype's buffer.
    """
    import torch

    sizes: dict[str, int] = {}
    layout = []
    for name, t in weights.items():
        key = str(t.dtype).removeprefix("torch.")
        layout.append((name, key, tuple(t.shape), sizes.get(key, 0), t.numel()))
        sizes[key] = sizes.get(key, 0) + t.numel()
    buffers = {
        key: torch.empty(n, dtype=getattr(torch, key), device=device) for key, n in sizes.items()
    }
    for (_, key, _, offset, numel), t in zip(layout, weights.values(), strict=True):
        buffers[key][offset : offset + numel].copy_(t.detach().reshape(-1), non_blocking=True)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the receivers read on their streams
    return buffers, layout


def unpack(buffers: dict[str, torch.Tensor], layout: list) -> dict[str, torch.Tensor]:
    """``{name: view}`` into ``buffers`` as :func:`pack` laid them out (no copy)."""
    return {
        name: buffers[key][offset : offset + numel].view(shape)
        for name, key, shape, offset, numel in layout
    }


def share(buffers: dict[str, torch.Tensor]) -> dict:
    """The CUDA IPC handles of ``buffers`` and the UUID of their GPU (small, picklable).

    Raises:
        ValueError: a buffer is not on a CUDA device.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if any(b.device.type != "cuda" for b in buffers.values()):
        raise ValueError("cuda_ipc shares CUDA buffers only")
    device = next(iter(buffers.values())).device
    handles = {key: reduce_tensor(b) for key, b in buffers.items()}
    return {"uuid": _uuid(device.index or 0), "handles": handles}


def open_buffers(shared: dict) -> dict[str, torch.Tensor]:
    """Map the source's buffers into this process (no copy).

    Raises:
        RuntimeError: no visible GPU of this process is the source's (its UUID).
    """
    import torch

    local = [i for i in range(torch.cuda.device_count()) if _uuid(i) == shared["uuid"]]
    if not local:
        raise RuntimeError(
            f"cuda_ipc: the source's GPU (uuid {shared['uuid']}) is not visible here "
            f"(CUDA_VISIBLE_DEVICES gives {torch.cuda.device_count()} other devices)"
        )
    out = {}
    for key, (rebuild, args) in shared["handles"].items():
        args = list(args)
        args[6] = local[0]  # storage_device: the source's index, re-mapped to ours
        out[key] = rebuild(*args)
    return out


def _uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


# -- the two ends, called from m2flow.core.weights ------------------------------------------------


def send(worker, weights: dict[str, Any], version: int, dst_group: str, world: int) -> None:
    """Source side: pack the tensors onto this rank's GPU, keep the buffers until
    :func:`release`, and broadcast the handles (and any non-tensor values, as they are) to the
    ``world`` ranks of ``dst_group``."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    tensors = {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
    other = {k: v for k, v in weights.items() if k not in tensors}
    buffers, layout = pack(tensors, device)
    worker._m2flow_ipc_buffers = buffers  # alive until every receiver has copied
    payload = {"shared": share(buffers), "layout": layout, "other": other, "order": list(weights)}
    worker.broadcast((payload, version), dst_group, world)


def receive(payload: dict) -> dict[str, torch.Tensor]:
    """Receiver side: ``{name: view}`` of the source's packed buffers (valid until the caller's
    ``load_weights`` returns), non-tensor values as sent, in the source's order."""
    views = unpack(open_buffers(payload["shared"]), payload["layout"]) | payload["other"]
    return {k: views[k] for k in payload["order"]}


def release(worker) -> bool:
    """Source side: drop the buffers of the last sync. A shared CUDA block outlives its
    tensor until every receiver has unmapped it; ``torch.cuda.ipc_collect`` frees the ones they
    have. Returns whether there were any."""
    had = getattr(worker, "_m2flow_ipc_buffers", None) is not None
    worker._m2flow_ipc_buffers = None
    if had:
        import torch

        torch.cuda.ipc_collect()
    return had
