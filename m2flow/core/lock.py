"""Device locks and the run's worker registry (RLinf section 3.3).

One lock per device, shared by every worker placed on it, all held by one ``LockService``
actor so that a rank spanning several devices takes them atomically (no partial holds, hence
no lock-order deadlock).

- Acquire: granted once every device of the rank is free, in the order of the pure policy
  :func:`m2flow.scheduler.runtime.lock_order.grants` (launch order, producers before the consumers
  they feed, no starvation). The grant returns the other workers still
  resident on those devices; the new holder offloads them and onloads itself. Re-acquiring by
  the worker that used the device last moves nothing.
- Release: frees the devices; the holder stays resident until a *different* worker takes them
  (lazy offload). Devices configured to keep everyone resident (:meth:`LockService.configure`;
  the Cluster's ``offload`` setting) never evict: the lock only serialises their use.
- Reservation: a worker ending a group call, or yielding its devices while it waits for data
  in one, releases with ``reserve``; when nobody waits for its devices they stay *reserved*
  for it (free, but granted to no one else), and its next acquire takes them without a round
  trip here (the release's reply told it so). A request for reserved devices first revokes
  the reservation (:meth:`LockService._revoke` asks the worker, which says whether it has
  taken them again meanwhile, and then holds them until its release). So a worker running
  consecutive calls on idle devices (the rollout's weight load, then its next generation), or
  waiting for data many times in one call, does not ask each time.
- Dependencies: channels report every producer -> consumer edge they see
  (:meth:`LockService.add_dependency`); the grant order reads them.
- Registry and liveness: every worker of the run registers here, locking or not. The service
  keeps one watch call open on each (:mod:`m2flow.core.liveness`): when a process dies its locks and
  residency are freed and the death is recorded for every waiter to see. A *preemptible*
  member's death (registered with ``preempt_grace_s``: an elastic group's rank on a spot node)
  is recorded apart, as preempted or crashed, and published as a run event; no wait fails
  for it (:mod:`m2flow.core.liveness`).
  Every wait has a deadline and fails with a message naming the holder.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field

import ray

from m2flow.scheduler.runtime.lock_order import LockRequest, grants

from .._context import LOCK_SERVICE_NAME, NAMESPACE, here
from . import events
from .liveness import Death, Loss, death_cause, preempted


@dataclass
class _Registered:
    group: str
    rank: int
    devices: list[int]
    handle: object
    launch_index: int
    node: str
    watch: asyncio.Task | None = None
    preempt_grace_s: float | None = None  # preemptible: its death is a Loss, not a Death
    node_id: str = ""


@dataclass
class _Waiting:
    request: LockRequest
    granted: asyncio.Event = field(default_factory=asyncio.Event)


@ray.remote(num_cpus=0)
class LockService:
    """All device locks and the worker registry of a run. Methods are coroutines: waits cost
    no thread."""

    def __init__(self) -> None:
        self.workers: dict[str, _Registered] = {}
        self.holder: dict[int, str] = {}  # device id -> holding worker key
        self.resident: dict[int, set[str]] = defaultdict(set)  # device -> keys in its memory
        self.waiting: dict[str, _Waiting] = {}  # worker key -> its pending acquire
        self.downstream: dict[str, set[str]] = defaultdict(set)  # group -> groups it feeds
        self.keep_resident: set[int] = set()  # devices whose switches offload no one
        # (death, when its group was shut down or None), oldest first: kept after a shutdown
        # so a wait that started before the death still hears of it (liveness.check)
        self.died: list[list] = []
        self.lost: list[Loss] = []  # preemptible members' deaths, oldest first (last 1000)
        self.retired_actors: set[str] = set()  # actors of shut-down groups: never register
        self.reserved: dict[int, tuple[str, int]] = {}  # device -> (worker key, release number)
        self.revoking: set[str] = set()  # workers asked to give up their reservation
        self.grants = 0  # acquires granted so far
        self._seq = itertools.count()

    async def configure(self, keep_resident: list[int]) -> None:
        """Devices on which a switch leaves the other workers resident (no offload): their
        memory holds everyone, or offloading frees nothing there (a virtual CPU device)."""
        self.keep_resident = set(keep_resident)

    # -- registry ---------------------------------------------------------------------------

    async def register(
        self,
        key: str,
        group: str,
        rank: int,
        devices: list[int],
        handle,
        launch_index: int,
        node: str = "",
        watch: bool = True,
        preempt_grace_s: float | None = None,
        node_id: str = "",
    ) -> None:
        """Declare a worker; it starts resident (loaded) on its devices. With ``watch`` its
        death is recorded. With ``preempt_grace_s`` (seconds) it is *preemptible*: its death
        is expected and fails no wait; it is recorded as a :class:`~m2flow.core.liveness.Loss`
        (preempted if its node ``node_id`` is gone within that grace, else crashed) and
        published as the run event :data:`~m2flow.core.events.WORKER_LOST`. A rank of a
        group already shut down (it started late) is ignored."""
        if handle._actor_id.hex() in self.retired_actors:
            return
        w = _Registered(group, rank, list(devices), handle, launch_index, node,
                        preempt_grace_s=preempt_grace_s, node_id=node_id)  # fmt: skip
        self.workers[key] = w
        for d in devices:
            self.resident[d].add(key)
        if watch:
            w.watch = asyncio.get_running_loop().create_task(self._watch(key, w))

    async def _watch(self, key: str, w: _Registered) -> None:
        try:
            await w.handle._m2flow_watch.remote()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 (whatever Ray says, the process is gone)
            if self.workers.get(key) is w:
                death = Death(w.group, w.rank, w.node, death_cause(e), time.time())
                self._forget(key)
                if w.preempt_grace_s is None:
                    self.died.append([death, None])
                else:
                    await self._lose(death, w)

    async def _lose(self, death: Death, w: _Registered) -> None:
        """Record a preemptible member's death as preempted or crashed, and publish it."""
        was_preempted = await preempted(w.node_id, death.cause, w.preempt_grace_s)
        loss = Loss(death, was_preempted, w.node_id)
        self.lost = [*self.lost[-999:], loss]
        try:
            await events.publish_async(events.WORKER_LOST, loss.event())
        except Exception:  # noqa: BLE001 (the bus is gone: the run is ending; losses() has it)
            pass

    async def losses(self) -> list[Loss]:
        """Preemptible members that died, oldest first (the last 1000): preempted or crashed,
        with the cause."""
        return list(self.lost)

    async def unregister(self, keys: list[str], actor_ids: list[str] = ()) -> None:
        """Forget stopped workers: free their locks and residency, stop watching them, mark
        their deaths as handled (``deaths``), and refuse any later registration of the actors
        ``actor_ids`` (a rank that starts after its group was shut down)."""
        self.retired_actors.update(actor_ids)
        now = time.time()
        for key in keys:
            w = self.workers.get(key)
            if w is not None and w.watch is not None:
                w.watch.cancel()
            self._forget(key)
        for entry in self.died:
            d = entry[0]
            if entry[1] is None and f"{d.group}:{d.rank}" in keys:
                entry[1] = now
        # handled deaths only matter to waits that started before them: keep a minute
        self.died = [e for e in self.died if e[1] is None or now - e[1] < 60.0]

    def _forget(self, key: str) -> None:
        w = self.workers.pop(key, None)
        if w is None:
            return
        for d in w.devices:
            if self.holder.get(d) == key:
                del self.holder[d]
            if self.reserved.get(d, ("",))[0] == key:
                del self.reserved[d]
            self.resident[d].discard(key)
        self.waiting.pop(key, None)
        self._grant()

    async def deaths(self) -> list[tuple[Death, float | None]]:
        """Workers of the run that died, oldest first, each with the time its group was shut
        down (``None``: not yet). See :func:`m2flow.core.liveness.check`."""
        return [(d, retired) for d, retired in self.died]

    # -- dependencies -------------------------------------------------------------------------

    async def add_dependency(self, producer: str, consumer: str) -> None:
        """Record that group ``producer`` feeds group ``consumer`` (from channel traffic)."""
        if producer != consumer:
            self.downstream[producer].add(consumer)
            self._grant()

    # -- locks ------------------------------------------------------------------------------

    async def acquire(self, key: str, timeout: float) -> list:
        """Wait until ``key``'s devices are all free, take them, and return the handles of the
        other workers resident there (the caller offloads them).

        Raises:
            TimeoutError: not granted within ``timeout`` seconds; names the holders.
        """
        w = self.workers[key]
        if all(self.holder.get(d) == key for d in w.devices):
            return []
        if all(self.reserved.get(d, ("",))[0] == key for d in w.devices):  # its own
            for d in w.devices:
                del self.reserved[d]
                self.holder[d] = key
            self.grants += 1
            return []
        req = LockRequest(key, w.group, tuple(w.devices), w.launch_index, next(self._seq))
        entry = self.waiting[key] = _Waiting(req)
        self._grant()
        try:
            await asyncio.wait_for(entry.granted.wait(), timeout)
        except TimeoutError:
            self.waiting.pop(key, None)
            holders = sorted({self.holder[d] for d in w.devices if d in self.holder})
            raise TimeoutError(
                f"{key} waited {timeout:.0f} s for devices {w.devices}, held by {holders}; "
                "a worker holds its device for a whole group call: a call that never "
                "returns keeps it (raise M2FLOW_WAIT_TIMEOUT if the work is that long)"
            ) from None
        evict: set[str] = set()
        for d in w.devices:
            if d in self.keep_resident:
                self.resident[d].add(key)
                continue
            evict |= self.resident[d] - {key}
            self.resident[d] = {key}
        for other in evict:  # an evicted worker leaves all its devices' memory
            for d in self.workers[other].devices:
                self.resident[d].discard(other)
        self.grants += 1
        return [self.workers[k].handle for k in sorted(evict)]

    async def release(self, key: str, reserve: int | None = None) -> bool:
        """Free ``key``'s devices (held, or reserved and taken again without asking); it stays
        resident until another worker takes them. With ``reserve`` (the worker's number for
        this release), keep them reserved for it if nobody waits for any of them.

        Returns:
            whether they are reserved for ``key`` now.
        """
        w = self.workers.get(key)
        if w is None:
            return False
        for d in w.devices:
            if self.holder.get(d) == key:
                del self.holder[d]
            if self.reserved.get(d, ("",))[0] == key:
                del self.reserved[d]
        wanted = any(set(e.request.devices) & set(w.devices) for e in self.waiting.values())
        free = not any(d in self.holder or d in self.reserved for d in w.devices)
        if reserve is not None and free and not wanted:
            for d in w.devices:
                self.reserved[d] = (key, reserve)
            return True
        self._grant()
        return False

    async def _revoke(self, key: str, number: int) -> None:
        """Take back ``key``'s reservation ``number``: it holds the devices if it took them
        again meanwhile (until its release), else they are free."""
        w = self.workers.get(key)
        try:
            taken = await w.handle._m2flow_revoke.remote(number)
        except Exception:  # noqa: BLE001 (gone: the devices are free; liveness records it)
            taken = False
        finally:
            self.revoking.discard(key)
        if self.workers.get(key) is not w:  # forgotten meanwhile (died, unregistered)
            return
        for d in w.devices:
            if self.reserved.get(d) == (key, number):  # else released meanwhile
                del self.reserved[d]
                if taken:
                    self.holder[d] = key
        self._grant()

    async def state(self) -> dict:
        """Holders, residents, waiters and the number of grants (for tests and debugging)."""
        return {
            "holder": dict(self.holder),
            "reserved": {d: k for d, (k, _) in self.reserved.items()},
            "resident": {d: sorted(k) for d, k in self.resident.items()},
            "waiting": list(self.waiting),
            "grants": self.grants,
            "time": time.time(),
        }

    def _grant(self) -> None:
        requests = [e.request for e in self.waiting.values()]
        for req in grants(requests, [*self.holder, *self.reserved], self.downstream):
            for d in req.devices:
                self.holder[d] = req.key
            self.waiting.pop(req.key).granted.set()
        # Reservations in the way of a waiting request are revoked (then granted as above).
        for e in self.waiting.values():
            for d in e.request.devices:
                key, number = self.reserved.get(d, ("", 0))
                if key and key not in self.revoking:
                    self.revoking.add(key)
                    asyncio.get_running_loop().create_task(self._revoke(key, number))


def get_lock_service():
    """The run's LockService actor, created on first use (named, in the m2flow namespace)."""
    return LockService.options(
        name=LOCK_SERVICE_NAME, namespace=NAMESPACE, get_if_exists=True, scheduling_strategy=here()
    ).remote()
