"""Releasing and restoring a trained model's device memory (the device lock's context switch):
parameters and optimizer state, bit-exactly.

On an accelerator they move to (pinned) host memory. On CPU the "device" is host memory
already: parameters and optimizer state are copied into one flat buffer per dtype and the
tensors freed (parameters become empty placeholders), kept in memory or spilled to a file. Flat
copies, not ``torch.save``: ~10x cheaper, and temporal GRPO switches the actor out and back in
every step.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

_PACKED = object()  # an optimizer state slot whose tensor sits in the offload buffer


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Asynchronous copy of a device tensor into pinned host memory (caller synchronises)."""
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    return host


def pack(tensors: list[torch.Tensor]) -> tuple[dict, list]:
    """Copy CPU tensors into one flat buffer per dtype; returns ``(buffers, layout)``."""
    parts: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    offsets: dict[torch.dtype, int] = defaultdict(int)
    layout = []
    for t in tensors:
        layout.append((t.dtype, offsets[t.dtype], t.numel(), t.shape))
        offsets[t.dtype] += t.numel()
        parts[t.dtype].append(t.reshape(-1))
    return {d: torch.cat(ts) for d, ts in parts.items()}, layout


def unpack(buffers: dict, layout: list) -> list[torch.Tensor]:
    """Inverse of :func:`pack`: independent tensors (copies), in the packed order."""
    return [buffers[d][o : o + n].view(shape).clone() for d, o, n, shape in layout]


def offload(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, spill_path: str | None = None
) -> dict:
    """Release the device memory of ``model``'s parameters, their gradients (dropped) and
    ``optimizer``'s state; returns what :func:`onload` needs. ``spill_path``: on CPU, write the
    flat buffers there (then RAM really is released). Neither may be used until
    :func:`onload`."""
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    if device.type != "cpu":
        for p in model.parameters():
            p.data = to_host(p.data)
        for state in optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    state[k] = to_host(v)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # copies done before the device memory is reused
            torch.cuda.empty_cache()
        return {"device": device}
    params = list(model.parameters())  # tied weights appear once
    states = [(p, dict(optimizer.state[p])) for p in params if p in optimizer.state]
    tensors = [p.data for p in params]
    tensors += [v for _, st in states for v in st.values() if isinstance(v, torch.Tensor)]
    flat, layout = pack(tensors)
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device="cpu")
    optimizer.state = defaultdict(dict)
    saved = {"device": device, "params": params, "states": states, "layout": layout}
    if spill_path is not None:
        torch.save(flat, spill_path)
        saved["path"] = spill_path
    else:
        saved["flat"] = flat
    for _, st in states:  # keep only the structure: the tensors live in `flat`
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                st[k] = _PACKED
    return saved


def onload(saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Bring parameters and optimizer state back to where :func:`offload` took them from."""
    device = saved["device"]
    if "flat" not in saved and "path" not in saved:
        for p in model.parameters():
            p.data = p.data.to(device, non_blocking=True)
        for state in optimizer.state.values():
            for k, v in state.items():
                # Adam's "step" counter stays on CPU (torch's default for non-capturable).
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(device, non_blocking=True)
        return
    if "path" in saved:
        flat = torch.load(saved["path"], weights_only=True)
        os.remove(saved["path"])
    else:
        flat = saved["flat"]
    tensors = iter(unpack(flat, saved["layout"]))
    for p in saved["params"]:
        p.data = next(tensors)
    for p, st in saved["states"]:
        optimizer.state[p] = {k: next(tensors) if v is _PACKED else v for k, v in st.items()}
