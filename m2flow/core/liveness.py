"""Worker liveness: a dead worker stops every wait of its run within about a second.

Every worker a :class:`~m2flow.core.cluster.Cluster` launches is registered with the run's
:class:`~m2flow.core.lock.LockService`. On registration the service calls the worker's watch method,
which blocks until the process ends, so a process that dies (an exception kills nothing; the OS
OOM killer, Ray's memory monitor, a lost node, ``kill -9`` do) fails that call at once and the
service records the death with its cause. Every blocking wait of the runtime (a channel get, a
``recv``, a group call waited in the driver) polls that record every :data:`POLL_S` seconds
and raises :class:`WorkerDied` naming the dead worker, instead of waiting out its timeout.

This is fail-fast, as ``torchrun`` does: one dead worker ends the run, which ``--resume``
continues from its last checkpoint. Groups stopped on purpose (``WorkerGroup.shutdown``)
unregister first and are not deaths.

*Preemptible* members (the ranks of an :class:`~m2flow.core.elastic.ElasticGroup`, e.g. the
spot pool's instances on spot nodes) are watched the same way, but their death is expected and
stops no wait: the service records it as a :class:`Loss`, *preempted* when the member's node is
gone (Ray says the node died, or the node is marked dead within :data:`PREEMPT_GRACE_S`) and
*crashed* otherwise (the node lives on: out of memory, ``kill -9``, a segfault), with the same
one-line cause, and publishes it as the run event :data:`m2flow.core.events.WORKER_LOST` for
the member's owner to act on (the spot pool migrates the instance's requests).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from .._context import LOCK_SERVICE_NAME, NAMESPACE, current_worker

POLL_S = 1.0  # seconds between liveness checks while waiting
#: seconds a dead preemptible member's node has to be marked dead for the death to count as a
#: preemption (Ray marks a lost node dead after its missed health checks: ~15 s by default)
PREEMPT_GRACE_S = 30.0
_NODE_POLL_S = 0.25  # node liveness polls while classifying a preemptible member's death

_registry = None  # the driver's handle of the LockService (per Ray session)
_registry_session: str | None = None


@dataclass(frozen=True)
class Death:
    """A worker that died: ``group``, ``rank``, ``node`` (address), a one-line ``cause`` and
    when it was recorded (``time.time()`` seconds)."""

    group: str
    rank: int
    node: str
    cause: str
    time: float = 0.0

    def describe(self) -> str:
        return (
            f"worker group '{self.group}' rank {self.rank} on node {self.node} died: {self.cause}"
        )


@dataclass(frozen=True)
class Loss:
    """A preemptible member that died (:meth:`~m2flow.core.lock.LockService.losses`): its
    :class:`Death` (``cause`` from :func:`death_cause`) and whether it was ``preempted`` (its
    node is gone) rather than crashed (its node lives on)."""

    death: Death
    preempted: bool
    node_id: str = ""  # Ray node id (hex) of the member's node

    def describe(self) -> str:
        d = self.death
        how = "preempted" if self.preempted else "crashed"
        node = f"{d.node} ({self.node_id[:8]})" if self.node_id else d.node
        return f"worker group '{d.group}' rank {d.rank} on node {node} {how}: {d.cause}"

    def event(self) -> dict:
        """The :data:`~m2flow.core.events.WORKER_LOST` value: ``{"group", "rank", "key",
        "node", "node_id", "cause", "preempted", "time", "describe"}``."""
        d = self.death
        return {"group": d.group, "rank": d.rank, "key": f"{d.group}:{d.rank}", "node": d.node,
                "node_id": self.node_id, "cause": d.cause, "preempted": self.preempted,
                "time": d.time, "describe": self.describe()}  # fmt: skip


class WorkerDied(RuntimeError):
    """A worker of the run died while this one waited (raised by waits; see the module)."""

    def __init__(self, death: Death, waiter: str = "") -> None:
        self.death, self.waiter = death, waiter
        seen = f" (seen by {waiter} while it waited)" if waiter else ""
        super().__init__(death.describe() + seen)

    def __reduce__(self):
        return (WorkerDied, (self.death, self.waiter))


def death_cause(error: BaseException) -> str:
    """One line saying why Ray reports a worker gone: out of memory, node lost, or the exit
    Ray recorded (e.g. ``SIGKILL``-like end of the process)."""
    import ray

    text = str(error)
    if isinstance(error, ray.exceptions.OutOfMemoryError) or "low on memory" in text:
        m = re.search(r"Memory usage (\d+)B exceeded threshold of (\d+)B", text)
        used = f" ({int(m.group(1)) / 2**30:.1f} GiB used > {int(m.group(2)) / 2**30:.1f} GiB)"
        return "out of memory: Ray's memory monitor killed it" + (used if m else "")
    if (
        "node" in text.lower()
        and ("died" in text.lower() or "dead" in text.lower())
        and ("its node" in text or "node has died" in text or "NodeDiedError" in text)
    ):
        return "its node was lost (node died or was removed)"
    m = re.search(r"Worker exit type: (\w+)", text)
    if m and m.group(1) == "SYSTEM_ERROR":
        return (
            "the process ended abruptly (killed by a signal such as the kernel's OOM killer or "
            "kill -9, or crashed)"
        )
    if m:
        return f"the process exited ({m.group(1)})"
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return first[:200]


def node_lost(cause: str) -> bool:
    """Whether :func:`death_cause`'s ``cause`` says the process's node was lost."""
    return cause.startswith("its node was lost")


def node_alive(node_id: str) -> bool:
    """Whether Ray lists node ``node_id`` (hex) as alive (a GCS query: blocking)."""
    import ray

    return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())


async def preempted(node_id: str, cause: str, grace_s: float = PREEMPT_GRACE_S) -> bool:
    """Whether a preemptible member that died with ``cause`` on node ``node_id`` was preempted:
    its cause says its node was lost, or the node is marked dead within ``grace_s`` seconds
    (the member's process can be reported dead before its node is). ``False``: its node lives
    on, so the process ended for another reason (a crash). Coroutine: the node is polled every
    0.25 s off the event loop."""
    import asyncio

    if node_lost(cause):
        return True
    if not node_id:
        return False
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + grace_s
    while True:
        if not await loop.run_in_executor(None, node_alive, node_id):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_NODE_POLL_S)


def registry():
    """The run's LockService handle (which holds the death record), or ``None`` when no
    m2flow cluster runs in this Ray session."""
    global _registry, _registry_session
    import ray

    w = current_worker()
    if w is not None:
        return w._m2flow_ctx.lock_service
    if not ray.is_initialized():
        return None
    # Job ids restart at 1 in every new Ray session of a process; node ids do not repeat.
    context = ray.get_runtime_context()
    session = f"{context.get_job_id()}@{context.get_node_id()}"
    if _registry is None or _registry_session != session:
        try:
            _registry = ray.get_actor(LOCK_SERVICE_NAME, namespace=NAMESPACE)
        except ValueError:
            return None
        _registry_session = session
    return _registry


def check(waiter: str = "", since: float | None = None) -> None:
    """Raise :class:`WorkerDied` if a worker of the run has died: one whose group is not shut
    down yet, or, for a wait that started at ``since`` (``time.time()``), any death after that
    (its group may have been shut down since: the wait still has to hear of it).

    Raises:
        WorkerDied: naming the first such death.
    """
    import ray

    reg = registry()
    if reg is None:
        return
    try:
        deaths = ray.get(reg.deaths.remote(), timeout=30)
    except ray.exceptions.RayActorError:  # the run is being torn down
        return
    for death, retired in deaths:
        if retired is None or (since is not None and death.time >= since):
            raise WorkerDied(death, waiter)


def wait_ready(refs: list, timeout: float, waiter: str = "") -> bool:
    """Wait until every ref in ``refs`` is ready, checking liveness every :data:`POLL_S`.

    Returns:
        True when all are ready, False after ``timeout`` seconds.

    Raises:
        WorkerDied: a worker of the run died meanwhile.
    """
    import ray

    deadline, since = time.monotonic() + timeout, time.time()
    pending = list(refs)
    while True:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(
            pending, num_returns=len(pending), timeout=max(0, min(left, POLL_S))
        )
        if not pending:
            return True
        check(waiter, since)
        if left <= POLL_S:
            return False
