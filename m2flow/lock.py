"""Device locks: who may use a device now, and who must leave it (RLinf section 4.3).

One lock per device, shared by every worker placed on it, all held by one ``LockService``
actor so that a rank spanning several devices takes them atomically (no partial holds, hence
no lock-order deadlock).

- Acquire: granted once every device of the rank is free. The grant returns the other workers
  still resident on those devices; the new holder offloads them and onloads itself (its own
  state may have been offloaded by an earlier switch). Re-acquiring by the worker that used
  the device last moves nothing.
- Release: frees the devices; the holder stays resident until a *different* worker takes them
  (lazy offload), so a worker that calls twice in a row pays no switch. Devices configured to
  keep everyone resident (:meth:`LockService.configure`; the Cluster's ``offload`` setting)
  never evict: the lock only serialises the workers' use of the device.
- Priority follows data dependencies: channels report every producer -> consumer edge they
  see (:meth:`LockService.add_dependency`), and a waiter is not granted while a waiter of an
  upstream group (one that feeds it, directly or not) waits too. So a consumer never takes the
  device ahead of the producer it would wait for. Otherwise waiters go by explicit priority
  (:meth:`LockService.set_priorities`, e.g. from a plan), then launch order of their group,
  then arrival. A waiter blocked on a device also blocks the ones behind it on that device (no
  starvation).
- Liveness: a waiter pings the holders every few seconds; a dead holder's locks are freed.
  Every wait has a deadline and fails with a message naming the holder.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import defaultdict

import ray

LOCK_SERVICE_NAME = "m2flow:locks"
_PING_INTERVAL_S = 5.0


@ray.remote(num_cpus=0)
class LockService:
    """All device locks of a run. Methods are coroutines: waits cost no thread."""

    def __init__(self) -> None:
        self.workers: dict[str, dict] = {}  # key -> {group, devices, handle, launch_index}
        self.holder: dict[int, str] = {}  # device id -> holding worker key
        self.resident: dict[int, set[str]] = defaultdict(set)  # device -> keys in its memory
        self.waiters: list[list] = []  # [priority, seq, key, event]
        self.priority: dict[str, int] = {}  # group -> rank in data-dependency order
        self.grant_log: list[tuple[str, float]] = []
        self.downstream: dict[str, set[str]] = defaultdict(set)  # group -> groups it feeds
        self.keep_resident: set[int] = set()  # devices whose switches offload no one
        self._seq = itertools.count()

    async def configure(self, keep_resident: list[int]) -> None:
        """Devices on which a switch leaves the other workers resident (no offload): their
        memory holds everyone, or offloading frees nothing there (a virtual CPU device)."""
        self.keep_resident = set(keep_resident)

    async def register(
        self, key: str, group: str, devices: list[int], handle, launch_index: int
    ) -> None:
        """Declare a worker; it starts resident (loaded) on its devices."""
        self.workers[key] = {
            "group": group,
            "devices": list(devices),
            "handle": handle,
            "launch_index": launch_index,
        }
        for d in devices:
            self.resident[d].add(key)

    async def unregister(self, keys: list[str]) -> None:
        """Forget stopped workers: free their locks and residency."""
        for key in keys:
            info = self.workers.pop(key, None)
            if info is None:
                continue
            for d in info["devices"]:
                if self.holder.get(d) == key:
                    del self.holder[d]
                self.resident[d].discard(key)
        self.waiters = [e for e in self.waiters if e[2] not in keys]
        self._grant()

    async def add_dependency(self, producer: str, consumer: str) -> None:
        """Record that group ``producer`` feeds group ``consumer`` (from channel traffic)."""
        if producer != consumer:
            self.downstream[producer].add(consumer)
            self._grant()

    def _feeds(self, a: str, b: str) -> bool:
        """True if group ``a`` reaches group ``b`` in the dependency graph."""
        seen, stack = set(), [a]
        while stack:
            for nxt in self.downstream.get(stack.pop(), ()):
                if nxt == b:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    def _upstream_first(self, entries: list[list]) -> list[list]:
        """Reorder so no waiter precedes a waiter of a group feeding it (cycles: keep order)."""
        group = {e[2]: self.workers[e[2]]["group"] for e in entries}
        rest, out = list(entries), []
        while rest:
            for i, e in enumerate(rest):  # noqa: B007 (i is used after the loop)
                g = group[e[2]]
                if not any(
                    self._feeds(group[o[2]], g) and not self._feeds(g, group[o[2]])
                    for o in rest
                    if o is not e
                ):
                    break
            else:
                i = 0
            out.append(rest.pop(i))
        return out

    async def set_priorities(self, order: dict[str, int]) -> None:
        """Set group priorities (lower goes first), e.g. a topological order of the graph."""
        self.priority.update(order)
        self._grant()

    async def acquire(self, key: str, timeout: float) -> list:
        """Wait until ``key``'s devices are all free, take them, and return the handles of the
        other workers resident there (the caller offloads them).

        Raises:
            TimeoutError: not granted within ``timeout`` seconds; names the holders.
        """
        info = self.workers[key]
        devices = info["devices"]
        if all(self.holder.get(d) == key for d in devices):
            return []
        prio = self.priority.get(info["group"], info["launch_index"])
        event = asyncio.Event()
        entry = [prio, next(self._seq), key, event]
        self.waiters.append(entry)
        self._grant()
        deadline = time.monotonic() + timeout
        while not event.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self.waiters.remove(entry)
                holders = sorted({self.holder[d] for d in devices if d in self.holder})
                raise TimeoutError(
                    f"{key} waited {timeout:.0f} s for devices {devices}, held by {holders}; "
                    "a worker holds its device for a whole group call: a call that never "
                    "returns keeps it (raise M2FLOW_WAIT_TIMEOUT if the work is that long)"
                )
            try:
                await asyncio.wait_for(event.wait(), min(left, _PING_INTERVAL_S))
            except TimeoutError:
                await self._free_dead_holders(devices)
        evict = set()
        for d in devices:
            if d in self.keep_resident:
                self.resident[d].add(key)
                continue
            evict |= self.resident[d] - {key}
            self.resident[d] = {key}
        for other in evict:  # an evicted worker leaves all its devices' memory
            for d in self.workers[other]["devices"]:
                self.resident[d].discard(other)
        self.grant_log.append((key, time.time()))
        return [self.workers[k]["handle"] for k in sorted(evict)]

    async def release(self, key: str) -> None:
        """Free ``key``'s devices; it stays resident until another worker takes them."""
        for d in self.workers[key]["devices"]:
            if self.holder.get(d) == key:
                del self.holder[d]
        self._grant()

    async def state(self) -> dict:
        """Holders, residents and the grant log (for tests and debugging)."""
        return {
            "holder": dict(self.holder),
            "resident": {d: sorted(k) for d, k in self.resident.items()},
            "grant_log": list(self.grant_log),
            "waiting": [e[2] for e in self.waiters],
        }

    def _grant(self) -> None:
        blocked: set[int] = set()
        for entry in self._upstream_first(sorted(self.waiters, key=lambda e: (e[0], e[1]))):
            key = entry[2]
            devices = self.workers[key]["devices"]
            if any(d in self.holder or d in blocked for d in devices):
                blocked.update(devices)
                continue
            for d in devices:
                self.holder[d] = key
            self.waiters.remove(entry)
            entry[3].set()

    async def _free_dead_holders(self, devices: list[int]) -> None:
        for key in {self.holder[d] for d in devices if d in self.holder}:
            try:
                await asyncio.wait_for(self.workers[key]["handle"]._m2flow_ping.remote(), 10)
            except ray.exceptions.RayActorError:
                for d in self.workers[key]["devices"]:
                    if self.holder.get(d) == key:
                        del self.holder[d]
                    self.resident[d].discard(key)
            except TimeoutError:  # alive but busy: keep waiting
                pass
        self._grant()


def get_lock_service():
    """The run's LockService actor, created on first use (named, in the m2flow namespace)."""
    from .cluster import NAMESPACE

    return LockService.options(
        name=LOCK_SERVICE_NAME, namespace=NAMESPACE, get_if_exists=True
    ).remote()
