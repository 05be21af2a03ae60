"""Weight synchronisation between worker groups: one runtime call, one receiving path.

    version = m2flow.sync_weights(actor, rollout)

sends the weights of the source group's rank 0 to every rank of the destination group and
returns the weight version they now hold. A source worker defines :meth:`Weights.get_weights`
(and keeps ``weight_version`` current); a receiver defines :meth:`Weights.load_weights`. The
runtime moves the weights and records the version on every receiving rank
(``worker.weight_version``) and in the run session.

Transport: the object store (one copy, referenced by every receiving rank; the source's
``broadcast``). Collective transports (NCCL/gloo broadcast, CUDA IPC) and versioned pulls plug
in here, behind the same call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ray

from ._env import wait_timeout

if TYPE_CHECKING:
    from .group import WorkerGroup


class Weights:
    """The weight-sync part of :class:`~m2flow.worker.Worker` (mixed in)."""

    #: Version of the weights this worker holds: bumped by a source after each update, set by
    #: the runtime on a receiver after each sync. -1: never synced.
    weight_version: int = -1

    def get_weights(self) -> dict[str, Any]:
        """This worker's weights, ``{name: tensor}`` on CPU, for :func:`sync_weights`.

        Raises:
            NotImplementedError: the worker is not a weight source.
        """
        raise NotImplementedError(
            f"{type(self).__name__} is not a weight source: define get_weights()"
        )

    def load_weights(self, weights: dict[str, Any], version: int) -> None:
        """Load ``weights`` (``{name: tensor}`` from a source's :meth:`get_weights`) in place;
        ``version`` is the source's weight version (the runtime records it on return).

        Raises:
            NotImplementedError: the worker cannot receive weights.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot receive weights: define load_weights(weights, version)"
        )

    def _m2flow_send_weights(self, dst_group: str, dst_world_size: int) -> int:
        # The device locks cover get_weights only: the broadcast touches host memory, so the
        # receivers may take the devices while it is under way.
        self._m2flow_call_wait += self._m2flow_acquire()
        try:
            weights, version = self.get_weights(), self.weight_version
        finally:
            self._m2flow_release()
        self.broadcast((weights, version), dst_group, dst_world_size)
        return version

    def _m2flow_recv_weights(self, src_group: str, src_rank: int) -> int:
        # Wait for the weights without the device locks (the sender needs them to read its
        # weights), then take them to load; the end of the call releases them.
        t0 = time.time()
        ref = self._m2flow_recv_ref(src_group, src_rank, wait_timeout())
        self._m2flow_call_wait += time.time() - t0 + self._m2flow_acquire()
        weights, version = ray.get(ref)
        self.load_weights(weights, version)
        self.weight_version = version
        return version

    # Both take the device locks themselves, for part of the call (see above).
    _m2flow_send_weights._m2flow_no_device_lock = True
    _m2flow_recv_weights._m2flow_no_device_lock = True


def sync_weights(
    src: WorkerGroup, dst: WorkerGroup, *, src_rank: int = 0, timeout: float | None = None
) -> int:
    """Send the weights of ``src``'s rank ``src_rank`` to every rank of ``dst``.

    Returns:
        the weight version every rank of ``dst`` now holds.

    Raises:
        WorkerError: either side failed (e.g. a worker that defines no ``get_weights`` or
            ``load_weights``).
    """
    from .session import current_session

    sent = src.on(src_rank).call("_m2flow_send_weights", dst.name, dst.world_size)
    got = dst.call("_m2flow_recv_weights", src.name, src_rank)
    versions = got.wait(timeout)
    sent.wait(timeout)
    session = current_session()
    if session is not None:
        session.weight_versions[dst.name] = versions[0]
    return versions[0]
