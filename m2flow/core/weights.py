"""Weight synchronisation between worker groups: one runtime call, one receiving path.

    version = m2flow.sync_weights(actor, rollout)

sends the weights of the source group's rank 0 to every rank of the destination group and
returns the weight version they now hold. A source worker defines :meth:`Weights.get_weights`
(and keeps ``weight_version`` current); a receiver defines :meth:`Weights.load_weights`. The
runtime moves the weights and records the version on every receiving rank
(``worker.weight_version``) and in the run session.

Transports (``transport=``, default ``M2FLOW_WEIGHT_TRANSPORT`` or ``"object_store"``):

- ``"object_store"``: one copy in the Ray object store, referenced by every receiving rank (the
  source's ``broadcast``).
- ``"collective"``: a gloo (CPU) or NCCL (CUDA) broadcast in bucketed buffers over a process
  group of the source and the receivers, built once per pair and cached
  (:mod:`m2flow.core.weight_transport`; measured in docs/results/weight_sync.md).
- ``"cuda_ipc"``: source and receivers on one GPU: the receivers map the source's packed
  device buffers (CUDA IPC handles through the object store) and copy from them
  (:mod:`m2flow.core.weight_ipc`; GPU only, untested here).

All end in the same ``load_weights(weights, version)``. With ``cuda_ipc`` the tensors are views
of the source's memory, valid during that call only: ``load_weights`` must copy them (as
``load_state_dict`` does).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import ray

from .._context import current_session
from .._env import wait_timeout
from . import events, ordering, weight_ipc, weight_transport
from .methods import group_method

if TYPE_CHECKING:
    from .group import WorkerGroup


class Weights:
    """The weight-sync part of :class:`~m2flow.core.worker.Worker` (mixed in)."""

    #: Version of the weights this worker holds: bumped by a source after each update, set by
    #: the runtime on a receiver after each sync. -1: never synced.
    weight_version: int = -1

    @group_method
    def get_weights(self) -> dict[str, Any]:
        """This worker's weights, ``{name: tensor}`` on CPU, for :func:`sync_weights`.

        Raises:
            NotImplementedError: the worker is not a weight source.
        """
        raise NotImplementedError(
            f"{type(self).__name__} is not a weight source: define get_weights()"
        )

    def weights_for(self, dst_group: str) -> dict[str, Any]:
        """What :func:`sync_weights` sends the group named ``dst_group``: by default
        :meth:`get_weights`. A source may send each destination its own payload, e.g. only what
        changed since that destination's last sync (a LoRA adapter without its frozen base)."""
        return self.get_weights()

    def load_weights(self, weights: dict[str, Any], version: int) -> None:
        """Load ``weights`` (``{name: tensor}`` from a source's :meth:`get_weights`) in place;
        ``version`` is the source's weight version (the runtime records it on return).

        Raises:
            NotImplementedError: the worker cannot receive weights.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot receive weights: define load_weights(weights, version)"
        )

    def _m2flow_send_weights(
        self, dst_group: str, dst_world_size: int, transport: str = "object_store", link=None
    ) -> int:
        # The device locks cover get_weights only: the broadcast touches host memory, so the
        # receivers may take the devices while it is under way (over NCCL, and when packing
        # for CUDA IPC, it touches the device: the locks stay taken until the end of the call).
        collective = transport == "collective"
        on_device = transport == "cuda_ipc" or (collective and link["backend"] == "nccl")
        self._m2flow_call_wait += self._m2flow_acquire()
        try:
            weights, version = self.weights_for(dst_group), self.weight_version
        except BaseException as e:
            if collective:  # the receivers would wait for metadata that never comes
                weight_transport.send_error(self, dst_group, dst_world_size, e)
            raise
        finally:
            if not on_device:
                self._m2flow_release()
        if collective:
            weight_transport.send(self, weights, version, dst_group, **link)
        elif transport == "cuda_ipc":
            weight_ipc.send(self, weights, version, dst_group, dst_world_size)
        else:
            self.broadcast((weights, version), dst_group, dst_world_size)
        return version

    def _m2flow_recv_weights(
        self, src_group: str, src_rank: int, transport: str = "object_store"
    ) -> int:
        # Wait for the weights without the device locks (the sender needs them to read its
        # weights), then take them to load; the end of the call releases them.
        t0 = time.time()
        ref = self._m2flow_recv_ref(src_group, src_rank, wait_timeout())
        if transport == "collective":
            meta = ray.get(ref)  # the metadata; the tensors follow over the link
            on_device = meta.get("backend") == "nccl"  # receive buffers on the GPU: lock first
            self._m2flow_call_wait += time.time() - t0
            if on_device:
                self._m2flow_call_wait += self._m2flow_acquire()
            weights, version = weight_transport.recv(self, src_group, src_rank, meta)
            if not on_device:
                self._m2flow_call_wait += self._m2flow_acquire()
        else:
            self._m2flow_call_wait += time.time() - t0 + self._m2flow_acquire()
            weights, version = ray.get(ref)
            if transport == "cuda_ipc":
                weights = weight_ipc.receive(weights)
        self.load_weights(weights, version)
        self.weight_version = version
        if transport == "cuda_ipc":
            import torch

            del weights
            torch.cuda.synchronize()  # the copies out of the source's buffers are done
        return version

    def _m2flow_release_ipc(self) -> bool:
        return weight_ipc.release(self)

    def _m2flow_close_weight_links(self, peer_group: str) -> int:
        return weight_transport.close_peer(self, peer_group)

    # All take the device locks themselves, for part of the call (see above), or not at all.
    _m2flow_send_weights._m2flow_no_device_lock = True
    _m2flow_recv_weights._m2flow_no_device_lock = True
    _m2flow_close_weight_links._m2flow_no_device_lock = True
    _m2flow_release_ipc._m2flow_no_device_lock = True


def sync_weights(
    src: WorkerGroup,
    dst: WorkerGroup,
    *,
    src_rank: int = 0,
    timeout: float | None = None,
    transport: str | None = None,
    bucket_bytes: int | None = None,
) -> int:
    """Send the weights of ``src``'s rank ``src_rank`` to every rank of ``dst``.

    Args:
        timeout: seconds to wait for both sides (default ``M2FLOW_WAIT_TIMEOUT``).
        transport: ``"object_store"``, ``"collective"`` or ``"cuda_ipc"`` (module docstring);
            default the ``M2FLOW_WEIGHT_TRANSPORT`` environment variable, else
            ``"object_store"``.
        bucket_bytes: collective only: size in bytes of the buffers small tensors are packed
            into (default :data:`m2flow.core.weight_transport.BUCKET_BYTES`, 32 MiB).

    Returns:
        the weight version every rank of ``dst`` now holds.

    Raises:
        ValueError: an unknown ``transport`` (before anything is sent), a collective link
            over NCCL whose members share a GPU, or ``cuda_ipc`` with members not all on one
            GPU.
        WorkerError: either side failed (e.g. a worker that defines no ``get_weights`` or
            ``load_weights``; a member of a collective link died or timed out).
    """
    if transport is None:
        transport = os.environ.get("M2FLOW_WEIGHT_TRANSPORT", "object_store")
    weight_transport.check_transport(transport)
    if transport == "collective":
        link = weight_transport.link_spec(src, src_rank, dst, bucket_bytes)
        sent = src.on(src_rank).runtime_call(
            "_m2flow_send_weights", dst.name, dst.world_size, transport, link
        )
    else:
        if transport == "cuda_ipc":
            weight_ipc.check_placement(src, src_rank, dst)
        sent = src.on(src_rank).runtime_call(
            "_m2flow_send_weights", dst.name, dst.world_size, transport
        )
    live = ordering.live_weights() and transport == "object_store"
    with ordering.unordered():  # the receive may overtake later steps' calls (ordering)
        got = _receive(dst, src, src_rank, transport, live, timeout)
    try:
        with events.span("weight_sync", f"{src.name} -> {dst.name}", transport=transport):
            versions = got if live else got.wait(timeout)
            sent.wait(timeout)
    finally:
        if transport == "cuda_ipc":  # every receiver has copied (or failed): free the buffers
            src.on(src_rank).runtime_call("_m2flow_release_ipc").wait(timeout)
    session = current_session()
    if session is not None:
        session.weight_versions[dst.name] = versions[0]
    return versions[0]


def _receive(
    dst: WorkerGroup, src: WorkerGroup, src_rank: int, transport: str, live: bool, timeout
):
    """The receive side of a sync: queued behind each rank's running group call, or with
    ``live`` (partial rollouts) loaded beside it, between the engine's decode steps, on the
    ranks that run one (the others queue a plain receive). ``live``: returns the versions."""
    if not live:
        return dst.runtime_call("_m2flow_recv_weights", src.name, src_rank, transport)
    refs = [dst.actors[r]._m2flow_recv_weights_live.remote(src.name, src_rank) for r in dst._ranks]
    versions = ray.get(refs, timeout=timeout if timeout is not None else wait_timeout())
    idle = [r for r, v in zip(dst._ranks, versions) if v is None]
    if idle:
        late = dst.on(idle).runtime_call("_m2flow_recv_weights", src.name, src_rank, transport)
        for r, v in zip(idle, late.wait(timeout)):
            versions[dst._ranks.index(r)] = v
    return versions
