"""Elastic worker groups: ranks that join and leave during a run, on nodes outside the cluster's
device numbering (preemptible spot nodes, RLBoost's setting).

A :class:`~m2flow.core.group.WorkerGroup` has a fixed set of ranks on the reserved devices,
and any of them dying ends the run (:mod:`m2flow.core.liveness`). An :class:`ElasticGroup`'s
ranks are m2flow :class:`~m2flow.core.worker.Worker` s too, registered with the run's lock
service, whose liveness watch holds one call open on each; but they are *preemptible*: each
is started on a node of its own choosing (:meth:`ElasticGroup.add`), numbered in launch order
(a rank number is never reused), takes no device lock, and its death fails no wait of the run.
The lock service records it as preempted (its node is gone) or crashed (its node lives on),
with the cause, and publishes it as the run event :data:`m2flow.core.events.WORKER_LOST`; the
group's owner (the spot pool's rollout manager) reads that and moves the rank's work on.
Retiring a rank on purpose (:meth:`ElasticGroup.retire`) unregisters it first: not a death.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .group import _actor_class
from .liveness import PREEMPT_GRACE_S, registry
from .mailbox import IO_GROUP, actor_name
from .worker import CONTROL_GROUP, WATCH_GROUP, Worker, WorkerContext


@dataclass
class Member:
    """One rank of an elastic group: its ``rank`` (launch order), registry ``key``
    (``"<group>:<rank>"``, as a death names it), actor ``handle``, and node (Ray id, address)."""

    rank: int
    key: str
    handle: object
    node_id: str
    node: str = ""


class ElasticGroup:
    """Preemptible ranks of one worker class (see the module docstring).

    Args:
        name: the group's name (deaths name it with the rank).
        worker_cls: a :class:`~m2flow.core.worker.Worker` subclass; each rank calls its
            ``__init__`` with :meth:`add`'s keyword arguments.
        preempt_grace_s: seconds a dead rank's node has to be marked dead for the death to
            count as a preemption (:func:`m2flow.core.liveness.preempted`).
        lock_service: the run's lock service (default: the one running, else a new one).
        concurrency_groups: Ray concurrency groups of the ranks' own methods (name -> threads),
            besides the runtime's: e.g. ``{"loop": 1}`` for a method that runs for the rank's
            life, so that other calls (``__ray_call__``) still reach it.

    Raises:
        TypeError: ``worker_cls`` is not a Worker subclass.
    """

    def __init__(
        self,
        name: str,
        worker_cls: type,
        preempt_grace_s: float = PREEMPT_GRACE_S,
        lock_service=None,
        concurrency_groups: dict[str, int] | None = None,
    ) -> None:
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"{worker_cls!r} is not a subclass of m2flow.Worker")
        self.name, self.worker_cls = name, worker_cls
        self.preempt_grace_s = preempt_grace_s
        if lock_service is None:
            lock_service = registry()
        if lock_service is None:
            from .lock import get_lock_service

            lock_service = get_lock_service()
        self.lock_service = lock_service
        self.members: dict[int, Member] = {}
        self._ranks = itertools.count()
        groups = {**(concurrency_groups or {}), IO_GROUP: 8, WATCH_GROUP: 1, CONTROL_GROUP: 1}
        self._actor_cls = ray.remote(concurrency_groups=groups)(_actor_class(worker_cls))

    def add(self, node_id: str, num_cpus: float = 0.0, **init_kwargs) -> Member:
        """Start a new rank on node ``node_id`` (hex; it dies with the node). Returns at once:
        the rank registers with the lock service in its ``__init__``; a failing ``__init__``
        fails the rank's first call."""
        rank = next(self._ranks)
        node = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "")
        ctx = WorkerContext(
            self.name, rank, 1, [], self.lock_service, lock=False, node=node,
            preempt_grace_s=self.preempt_grace_s, node_id=node_id,
        )  # fmt: skip
        handle = self._actor_cls.options(
            num_cpus=num_cpus,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(ctx, init_kwargs)
        member = self.members[rank] = Member(rank, actor_name(self.name, rank), handle, node_id,
                                             node)  # fmt: skip
        return member

    async def retire(self, member: Member) -> None:
        """Stop ``member`` on purpose: unregister it (its end is no death, and a rank still
        starting never registers), then kill it. Coroutine (an async actor's loop)."""
        self.members.pop(member.rank, None)
        try:
            await self.lock_service.unregister.remote([member.key],
                                                      [member.handle._actor_id.hex()])  # fmt: skip
        except ray.exceptions.RayActorError:  # the run is being torn down
            pass
        ray.kill(member.handle, no_restart=True)

    def forget(self, member: Member) -> None:
        """Drop a member that died (its loss was recorded): nothing to stop."""
        self.members.pop(member.rank, None)
