"""Collective weight transport: ``m2flow.sync_weights(src, dst, transport="collective")``.

The source rank and every rank of the destination group form a process group of their own
(rank 0: the source; rank ``1 + r``: destination rank ``r``), built directly from a
``torch.distributed.TCPStore`` that the source hosts and a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (every member on CUDA). It is not the default process group, so a group
that already has one (the actor's data-parallel group) keeps it. The link is built at the first
sync of a (source rank, destination group) pair and cached on its members; a later sync reuses
it, and a sync whose members changed (a relaunched group) builds a new one. A link ends with
its processes, with :func:`close_links`, or when a collective on it fails.

One sync: the source sends the metadata (names, shapes, dtypes, the bucket plan, the version)
through the object store, as the object-store transport sends the weights; then it broadcasts
the tensors' bytes, small tensors packed into buckets of about :data:`BUCKET_BYTES`, large ones
on their own (no packing copy). The receivers rebuild ``{name: tensor}``, every tensor with its
own storage, and hand it to the same ``load_weights(weights, version)``.

Waits: every collective and store wait has the run's timeout (``M2FLOW_WAIT_TIMEOUT``); they
run in a helper thread while the calling thread, every second, checks the run's liveness, pings
the link's other members and reads the store for an abort. So a dead member (in the run's death
record, or a process that no longer answers) ends the sync with
:class:`~m2flow.core.liveness.WorkerDied` naming it, and a member that fails aborts the sync for the
others, instead of a hang. A failed sync drops the link; the next one builds a new one.

The NCCL path (members on CUDA) is written but untested here (no GPU); two members on one GPU
cannot share an NCCL group, and :func:`link_spec` refuses that (``transport="cuda_ipc"``,
:mod:`m2flow.core.weight_ipc`, serves it).
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .._env import wait_timeout
from . import liveness

TRANSPORTS = ("object_store", "collective", "cuda_ipc")
BUCKET_BYTES = 32 << 20  # packed-bucket size: tens of MB amortise a collective's fixed cost


@dataclass
class _Link:
    """One member's end of a weight link."""

    uid: str
    pg: Any
    store: Any  # the TCPStore the source hosts (a client of it on a receiver)
    backend: str
    addr: str  # where the store listens
    port: int
    members: tuple[str, ...] = ()  # actor ids, source first (kept by the source)
    ctl: Any = None  # a second store client, for the watching thread
    syncs: int = 0  # syncs done on this link (the source numbers its handshakes by it)
    spare: list = field(default_factory=list)  # reusable bucket buffers


def check_transport(name: str) -> str:
    """``name`` if it is a known transport.

    Raises:
        ValueError: not one of :data:`TRANSPORTS`.
    """
    if name not in TRANSPORTS:
        raise ValueError(
            f"unknown weight transport {name!r}; choose one of {', '.join(TRANSPORTS)}"
        )
    return name


# -- driver side ------------------------------------------------------------------------------


def link_spec(src, src_rank: int, dst, bucket_bytes: int | None = None) -> dict:
    """What the source needs to open or reuse the link to ``dst`` (driver side).

    Returns:
        ``{"members": actor ids (source first), "backend": "gloo" | "nccl",
        "bucket_bytes": int}``.

    Raises:
        ValueError: ``bucket_bytes`` < 1, or NCCL members that share a GPU.
    """
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else int(bucket_bytes)
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, not {bucket_bytes}")
    members = (src.actors[src_rank]._actor_id.hex(), *(a._actor_id.hex() for a in dst.actors))
    placements = [src.placement[src_rank], *dst.placement]
    kinds = {src.cluster.device(d).kind for p in placements for d in p}
    backend = "nccl" if kinds == {"cuda"} else "gloo"
    if backend == "nccl":
        seen: dict[int, int] = {}
        for i, p in enumerate(placements):
            for d in p:
                if seen.setdefault(d, i) != i:
                    raise ValueError(
                        f"collective weight sync {src.name}:{src_rank} -> {dst.name}: two members "
                        f"share GPU {d}, which one NCCL group cannot; use transport="
                        "'cuda_ipc' (one GPU for all) or 'object_store'"
                    )
    return {"members": members, "backend": backend, "bucket_bytes": bucket_bytes}


def close_links(src, dst, timeout: float = 60.0) -> int:
    """Close the weight links between groups ``src`` and ``dst`` (driver side), both ends:
    their process groups and stores. The next collective sync between them builds a new one.
    Call it before shutting down one of the two while the other goes on (a process that ends
    closes its ends anyway).

    Returns:
        the number of link ends closed (1 + ``dst.world_size`` per source rank with a link).

    Raises:
        WorkerError: a rank failed or died.
    """
    ends = src.runtime_call("_m2flow_close_weight_links", dst.name).wait(timeout)
    ends += dst.runtime_call("_m2flow_close_weight_links", src.name).wait(timeout)
    return sum(ends)


# -- bucket plan ------------------------------------------------------------------------------


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[tuple]:
    """The broadcasts of one sync, in order, for tensors of ``sizes`` bytes.

    Returns:
        ops, each ``("direct", index)`` (a tensor of at least half a bucket, sent from and
        received into its own storage) or ``("packed", [(index, offset), ...], nbytes)`` (small
        tensors' bytes back to back in one buffer of ``nbytes``). Empty tensors get no op.
    """
    ops: list[tuple] = []
    packed: list[tuple[int, int]] = []
    used = 0
    for i, n in enumerate(sizes):
        if n == 0:
            continue
        if n >= bucket_bytes // 2:
            ops.append(("direct", i))
            continue
        if used + n > bucket_bytes:
            ops.append(("packed", packed, used))
            packed, used = [], 0
        packed.append((i, used))
        used += n
    if packed:
        ops.append(("packed", packed, used))
    return ops


def _bytes_of(t):
    """The tensor's bytes as a flat uint8 view (no copy for a contiguous tensor)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# -- worker side ------------------------------------------------------------------------------


def _links(worker) -> dict:
    links = getattr(worker, "_m2flow_weight_links", None)
    if links is None:
        links = worker._m2flow_weight_links = {}
    return links


def _drop(worker, key) -> bool:
    """Forget the link under ``key`` and shut its process group down. Only for a link no
    collective runs on: a failed sync just forgets its link, as its helper thread may still be
    blocked in one (it ends with its timeout)."""
    link = _links(worker).pop(key, None)
    if link is None:
        return False
    shutdown = getattr(link.pg, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # best effort: the process group may already be broken
            pass
    return True


def close_peer(worker, peer_group: str) -> int:
    """Close this worker's links to or from ``peer_group``; the number closed."""
    return sum(_drop(worker, key) for key in list(_links(worker)) if key[1] == peer_group)


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=wait_timeout())


def _device(backend: str):
    import torch

    if backend == "nccl":  # CUDA path (untested here): the worker's first visible GPU
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _process_group(backend: str, store, rank: int, world: int, host: str):
    from torch.distributed import ProcessGroupGloo

    if backend == "nccl":  # CUDA path (untested here)
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = _timeout()
        return ProcessGroupNCCL(store, rank, world, opts)
    opts = ProcessGroupGloo._Options()
    opts._timeout = _timeout()
    # Bind to the node's address (the one the run reaches it by), not whatever the hostname
    # resolves to (often a loopback alias).
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return ProcessGroupGloo(store, rank, world, opts)


def _check_peers(worker, peers, since: float) -> None:
    """Raise :class:`~m2flow.core.liveness.WorkerDied` if the run recorded a death, or if one of
    ``peers`` (``(group, rank)`` pairs) does not answer a ping because its process is gone
    (also one whose group was shut down before the run heard of its death)."""
    import ray

    liveness.check(worker.worker_key, since)
    refs = {}
    for group, rank in peers:
        try:
            refs[worker._m2flow_peer(group, rank)._m2flow_ping.remote()] = (group, rank)
        except ValueError:  # no actor of that name any more
            death = liveness.Death(group, rank, "", "its process is gone", time.time())
            raise liveness.WorkerDied(death, worker.worker_key) from None
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=liveness.POLL_S)
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            group, rank = refs[ref]
            death = liveness.Death(group, rank, "", liveness.death_cause(e), time.time())
            raise liveness.WorkerDied(death, worker.worker_key) from None


def _control(link: _Link):
    """The watching thread's own client of the link's store: a client runs one call at a time,
    and the helper thread may be blocked in one (``wait``)."""
    import torch

    if link.ctl is None:
        link.ctl = torch.distributed.TCPStore(
            link.addr, link.port, is_master=False, timeout=datetime.timedelta(seconds=10)
        )
    return link.ctl


def _aborted(link: _Link, key: str) -> str | None:
    """Who aborted this sync and why, if a member did (``None`` too when the store is out of
    reach: its host, the source, is gone, which the pings report)."""
    try:
        ctl = _control(link)
        return ctl.get(key).decode() if ctl.check([key]) else None
    except Exception:
        return None


def _abort(link: _Link, key: str, reason: str) -> None:
    """Tell the other members this sync failed here (they stop waiting). Best effort."""
    try:
        ctl = _control(link)
        if not ctl.check([key]):
            ctl.set(key, reason[:1000])
    except Exception:
        pass


def _watched(worker, what: str, fn, peers, link: _Link, abort_key: str):
    """Run ``fn()`` in a helper thread; meanwhile, every :data:`~m2flow.core.liveness.POLL_S`
    seconds, check the run's liveness, ping ``peers`` (the link's other members) and look for
    another member's abort of this sync. On failure, abort the sync for the others.

    Raises:
        WorkerDied: a worker of the run or a peer died (also when the death first showed as a
            broken connection in ``fn``).
        TimeoutError: ``fn`` did not end within the run's wait timeout (plus a margin).
        RuntimeError: ``fn`` raised, or another member aborted (the message says who and
            why; a raised cause is chained).
    """
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    since, limit = time.time(), wait_timeout() + 30.0
    deadline = time.monotonic() + limit
    thread = threading.Thread(target=run, name="m2flow-weight-sync", daemon=True)
    thread.start()
    try:
        while True:
            thread.join(liveness.POLL_S)
            if not thread.is_alive():
                break
            _check_peers(worker, peers, since)
            reason = _aborted(link, abort_key)
            if reason is not None:
                raise RuntimeError(f"{worker.worker_key}: {what} aborted by {reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{worker.worker_key}: {what} did not end in {limit:.0f} s")
        if "error" in box:
            # A dead peer usually reaches gloo as a closed connection before the run records
            # the death (within about a second): name the dead worker if there is one.
            for _ in range(2):
                _check_peers(worker, peers, since)
                time.sleep(liveness.POLL_S)
            _check_peers(worker, peers, since)
            e = box["error"]
            raise RuntimeError(
                f"{worker.worker_key}: {what} failed: {type(e).__name__}: {e}"[:2000]
            ) from e
    except BaseException as e:
        _abort(link, abort_key, f"{worker.worker_key}: {type(e).__name__}: {e}")
        raise
    return box.get("value")


def _run_ops(pg, ops, prepare, finish, timeout) -> None:
    """Broadcast ``prepare(op)`` for every op from rank 0, two in flight (the next bucket
    packs or unpacks while one is on the wire); ``finish(op, tensor)`` once it arrived."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    inflight: deque = deque()
    for op in ops:
        t = prepare(op)
        inflight.append((op, t, pg.broadcast([t], opts)))
        if len(inflight) > 1:
            o, tt, work = inflight.popleft()
            work.wait(timeout)
            finish(o, tt)
    while inflight:
        o, tt, work = inflight.popleft()
        work.wait(timeout)
        finish(o, tt)


def send_error(worker, dst_group: str, dst_world_size: int, error: BaseException) -> None:
    """Tell the receivers the source failed before sending (they raise at once instead of
    waiting out their timeout). Best effort."""
    try:
        worker.broadcast(
            {"error": f"{type(error).__name__}: {error}"[:1000]}, dst_group, dst_world_size
        )
    except Exception:
        pass


def send(
    worker, weights: dict, version: int, dst_group: str, members, backend: str, bucket_bytes: int
) -> None:
    """Broadcast ``weights`` (``{name: tensor}``, any dtypes; non-tensor values travel with the
    metadata) from ``worker`` (the source) to every rank of ``dst_group`` over the cached link,
    building it first if it is missing or its members changed (source side).

    Raises:
        WorkerDied, TimeoutError, RuntimeError: see :func:`_watched`; also a receiver that
            lost the link (the source then drops it: the next sync builds a new one).
    """
    import torch

    key = ("to", dst_group)
    links = _links(worker)
    link = links.get(key)
    members = tuple(members)
    if link is not None and (link.members != members or link.backend != backend):
        _drop(worker, key)
        link = None
    new = link is None
    world = len(members)
    if new:
        host = worker._m2flow_ctx.node or "127.0.0.1"
        store = torch.distributed.TCPStore(
            host, 0, None, is_master=True, timeout=_timeout(), wait_for_workers=False
        )
        link = _Link(uuid.uuid4().hex, None, store, backend, host, store.port, members)
    tensors = {n: v for n, v in weights.items() if isinstance(v, torch.Tensor)}
    order = [n for n in weights if n in tensors]
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in order]
    ops = plan_buckets(sizes, bucket_bytes)
    link.syncs += 1
    tag = f"{link.uid}/{link.syncs}"
    meta = {
        "uid": link.uid,
        "new": new,
        "addr": link.addr,
        "port": link.port,
        "world": world,
        "backend": backend,
        "sync": link.syncs,
        "names": list(weights),
        "entries": [(n, tuple(tensors[n].shape), tensors[n].dtype) for n in order],
        "extras": {n: v for n, v in weights.items() if n not in tensors},
        "ops": ops,
        "version": version,
    }
    dev = _device(backend)
    timeout = _timeout()
    flat = [_bytes_of(tensors[n]) for n in order]

    def prepare(op):
        if op[0] == "direct":
            return flat[op[1]].to(dev)
        buf = link.spare.pop() if link.spare else None
        if buf is None or buf.numel() < op[2]:
            buf = torch.empty(max(op[2], bucket_bytes), dtype=torch.uint8, device=dev)
        for i, off in op[1]:
            buf[off : off + sizes[i]].copy_(flat[i])
        return buf[: op[2]]

    def finish(op, t):
        if op[0] == "packed":
            link.spare.append(t._base if t._base is not None else t)

    def run() -> None:
        if new:
            link.pg = _process_group(backend, link.store, 0, world, link.addr)
        else:
            # Each receiver says whether it still holds this link before any collective.
            keys = [f"{tag}/{r}" for r in range(1, world)]
            link.store.wait(keys, timeout)
            lost = [int(k.rsplit("/", 1)[1]) - 1 for k in keys if link.store.get(k) != b"ok"]
            for k in keys:
                link.store.delete_key(k)
            if lost:
                raise RuntimeError(
                    f"ranks {lost} of '{dst_group}' no longer hold the weight link; it is "
                    "dropped, and the next sync builds a new one"
                )
        _run_ops(link.pg, ops, prepare, finish, timeout)
        del link.spare[2:]  # keep two buffers for the next sync, not one per bucket

    links[key] = link
    what = f"collective weight sync ({backend}) to '{dst_group}'"
    peers = [(dst_group, r) for r in range(world - 1)]
    try:
        try:
            worker.broadcast(meta, dst_group, world - 1)
        except BaseException as e:  # the receivers that have the metadata wait for the rest
            _abort(link, f"{tag}/abort", f"{worker.worker_key}: sending the metadata failed: {e}")
            raise
        _watched(worker, what, run, peers, link, f"{tag}/abort")
    except BaseException:
        links.pop(key, None)  # broken or half-built: the next sync builds a new one
        raise


def recv(worker, src_group: str, src_rank: int, meta: dict) -> tuple[dict, int]:
    """Receive one sync's tensors from the source over the link ``meta`` names, joining it if
    it is new (destination side).

    Returns:
        ``(weights, version)``: ``{name: tensor}`` in the source's order, every tensor with its
        own storage (on CPU; on the receiver's GPU over NCCL), and the source's version.

    Raises:
        RuntimeError: the source failed before sending, or aborted the sync, or this rank no
            longer holds the link the source reuses (the source drops it too: the next sync
            builds a new one).
        WorkerDied, TimeoutError: see :func:`_watched`.
    """
    import torch

    src = f"{src_group}:{src_rank}"
    if meta.get("error"):
        raise RuntimeError(f"weight source {src} failed before sending: {meta['error']}")
    key = ("from", src_group, src_rank)
    links = _links(worker)
    link = links.get(key)
    rank, world, backend, timeout = worker.rank + 1, meta["world"], meta["backend"], _timeout()
    tag = f"{meta['uid']}/{meta['sync']}"
    if meta["new"] or link is None or link.uid != meta["uid"]:
        if link is not None:
            _drop(worker, key)
        link = _Link(meta["uid"], None, None, backend, meta["addr"], meta["port"])
        if not meta["new"]:  # the source reuses a link this rank lost: say so, fail now
            _abort(link, f"{tag}/{rank}", "lost")
            raise RuntimeError(
                f"{worker.worker_key} no longer holds the weight link from {src}; the next "
                "sync builds a new one"
            )
    dev = _device(backend)
    entries = meta["entries"]
    out = [torch.empty(shape, dtype=dtype, device=dev) for _, shape, dtype in entries]
    flat = [_bytes_of(t) for t in out]  # views: writing them fills ``out``
    sizes = [f.numel() for f in flat]

    def prepare(op):
        if op[0] == "direct":
            return flat[op[1]]
        buf = link.spare.pop() if link.spare else None
        if buf is None or buf.numel() < op[2]:
            buf = torch.empty(op[2], dtype=torch.uint8, device=dev)
        return buf[: op[2]]

    def finish(op, t):
        if op[0] == "packed":
            for i, off in op[1]:
                flat[i].copy_(t[off : off + sizes[i]])
            link.spare.append(t._base if t._base is not None else t)

    def run() -> None:
        if meta["new"]:
            link.store = torch.distributed.TCPStore(
                link.addr, link.port, None, is_master=False, timeout=timeout
            )
            host = worker._m2flow_ctx.node or "127.0.0.1"
            link.pg = _process_group(backend, link.store, rank, world, host)
        else:
            link.store.set(f"{tag}/{rank}", "ok")
        _run_ops(link.pg, meta["ops"], prepare, finish, timeout)
        del link.spare[2:]

    links[key] = link
    what = f"collective weight sync ({backend}) from {src}"
    try:
        _watched(worker, what, run, [(src_group, src_rank)], link, f"{tag}/abort")
    except BaseException:
        links.pop(key, None)
        raise
    tensors = {name: t for (name, _, _), t in zip(entries, out)}
    extras = meta["extras"]
    weights = {n: tensors[n] if n in tensors else extras[n] for n in meta["names"]}
    return weights, meta["version"]
