"""Torch process groups of the training roles: the torch actor's data parallelism (one group
over the actor's ranks, gradients summed by all-reduce; torch.distributed: gloo on CPU, NCCL on
CUDA), and the world the Megatron engines (actor, critic) build their groups in.

Data parallel: each rank holds the whole model and trains on the chunks it reads from the
shared channel; :meth:`~m2flow.workers.engines.base.ModelEngine.optimizer_step` sums
the ranks' token-sum gradients, token counts and metric sums, so every rank takes the same
optimizer step as one rank would on the union of their chunks (the token mean is linear; only
float summation order differs).

Rendezvous: the driver picks the address of rank 0's node and a port free on the driver's
machine (:func:`rendezvous`); on a multi-node cluster whose rank 0 is remote that port is only
likely free there (a clash fails ``init_process_group`` with an address-in-use error, named).
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from m2flow._env import wait_timeout


def rendezvous(cluster, ranks: list[list[int]]) -> dict:
    """``{"addr", "port"}`` for the ranks' process group (driver side).

    Args:
        ranks: device ids per rank (rank 0's first device names its node).
    """
    addr = cluster.nodes[cluster.device(ranks[0][0]).node_index].address
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return {"addr": addr, "port": port}


def init(rank: int, world_size: int, addr: str, port: int, device: torch.device) -> None:
    """Join the actor's process group (gloo on CPU, NCCL on CUDA); every collective of the
    group waits at most ``M2FLOW_WAIT_TIMEOUT`` seconds.

    Raises:
        RuntimeError: the rendezvous failed (the message names the address).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=wait_timeout()),
        )
    except Exception as e:
        raise RuntimeError(
            f"the actor's data-parallel rendezvous at {addr}:{port} failed on rank {rank}: {e}"
        ) from e


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_grads(model: torch.nn.Module, group=None) -> None:
    """Sum every parameter's gradient over the ranks of ``group`` (default: all), in place (a
    rank that trained on nothing contributes zeros). One flat buffer per dtype: one collective,
    not one per tensor."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def all_reduce_sums(
    values: dict[str, float], keys: tuple[str, ...], group=None
) -> dict[str, float]:
    """``keys`` of ``values`` (missing: 0) summed over the ranks of ``group`` (default: all)."""
    t = torch.tensor(
        [float(values.get(k, 0.0)) for k in keys], dtype=torch.float64, device=comm_device(group)
    )
    dist.all_reduce(t, group=group)
    return dict(zip(keys, t.tolist()))


def comm_device(group=None) -> torch.device:
    """Where a collective's own tensors must live: the current GPU under NCCL (it reduces
    device memory only), the host under gloo."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_model(model: torch.nn.Module, src: int = 0) -> None:
    """Every rank takes rank ``src``'s parameters and buffers."""
    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
