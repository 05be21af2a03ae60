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

from typing import TYPE_CHECKING, Any

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

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Load ``weights`` (``{name: tensor}`` from a source's :meth:`get_weights`) in place.

        Raises:
            NotImplementedError: the worker cannot receive weights.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot receive weights: define load_weights(weights)"
        )

    def _m2flow_send_weights(self, dst_group: str, dst_world_size: int) -> int:
        self.broadcast((self.get_weights(), self.weight_version), dst_group, dst_world_size)
        return self.weight_version

    def _m2flow_recv_weights(self, src_group: str, src_rank: int) -> int:
        weights, version = self.recv(src_group, src_rank)
        self.load_weights(weights)
        self.weight_version = version
        return version


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
