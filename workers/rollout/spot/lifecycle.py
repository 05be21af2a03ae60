"""The spot instances' lives, as the rollout manager sees them (RLBoost 4.1-4.2): started on
the live preemptible nodes up to ``N_prem``, released beyond it, and their deaths.

The instances are the ranks of one :class:`~m2flow.core.elastic.ElasticGroup`
(:data:`~.instance.GROUP`): m2flow workers under the runtime's liveness watch as preemptible
members. The lock service watches each one's process; when one dies it records the death as a
preemption (its node is gone) or a crash (its node lives on: out of memory, ``kill -9``, a
segfault), with the cause, and publishes it as the run event
:data:`m2flow.core.events.WORKER_LOST`, which :meth:`InstanceLives._lost_loop` reads. Nothing
stops the run: the instance's pending and executing requests go back to the queue with their
tokens, logprobs and per-token versions, and another instance continues them (migration).
A preemption counts in the step's ``preemptions`` (with the requests and tokens it held); a
crash, or an instance whose loop raised, counts in ``instance_errors`` and is named, with its
cause, in :meth:`RolloutManager.metrics`'s ``errors`` (and the manager's log).
"""

from __future__ import annotations

import asyncio
import logging

import ray

from m2flow.core import events
from m2flow.core.elastic import ElasticGroup
from m2flow.core.liveness import death_cause

from .instance import GROUP, LOOP_GROUP, SpotInstance
from .records import InstanceRecord, now

log = logging.getLogger(__name__)
_LOST_POLL_S = 0.2  # seconds between reads of the run's WORKER_LOST events
_KEEP_ERRORS = 20  # named instance errors kept for metrics()


class InstanceLives:
    """The rollout manager's spot-instance half (a mixin of
    :class:`~.manager.RolloutManager`, whose records, stats, queue and event bus it uses)."""

    def _open_lives(self) -> None:
        """The run's event bus (the trainer's waits and the instances' deaths arrive there),
        the instances' elastic group and the loss events' cursor (the manager's first call:
        events published before it belong to no step of this pool)."""
        self._bus = events.open_bus()
        self._bus_seen = self._bus.last.remote()
        self.group = ElasticGroup(GROUP, SpotInstance, self.cfg.preempt_grace_s,
                                  concurrency_groups={LOOP_GROUP: 1})  # fmt: skip
        self._lost_seen = self._bus.last.remote()

    def _life_loops(self) -> list:
        """The coroutines the manager runs beside dispatch and rebalancing."""
        return [self._pool_loop(), self._lost_loop()]

    async def _pool_loop(self) -> None:
        while True:
            await self._pool_tick()
            await asyncio.sleep(0.5)

    async def _pool_tick(self) -> None:
        """Start a spot instance on every preemptible node without one, up to N_prem; release
        idle instances beyond it (Algorithm 1 lowered N_prem: they would only cost). The
        policy half of the pool's life; the nodes and the instances' processes are
        :meth:`_free_nodes`, :meth:`_start_instance` and :meth:`_retire`."""
        self._integrate()
        spot = [i for i in self.instances.values() if i.kind == "spot"]
        for inst in list(reversed(spot)):  # newest first
            if len(spot) <= self.policy.n_prem:
                break
            # (an instance a test registered by hand has no member: never released)
            if inst.member is not None and not inst.pending and not inst.executing:
                self._drop(inst)  # before the kill: _watch sees it gone
                spot.remove(inst)
                self.stats["released"] += 1
                await self._retire(inst)
        used = {i.node for i in spot}
        for node in self._free_nodes():
            if len(spot) >= self.policy.n_prem:
                break
            if node in used:
                continue
            self._integrate()
            inst = self._start_instance(node)
            self.instances[inst.id] = inst
            spot.append(inst)

    def _free_nodes(self) -> list[str]:
        """The preemptible nodes alive now (Ray node ids)."""
        from m2flow.core.spot import alive_spot_nodes

        return list(alive_spot_nodes())

    def _start_instance(self, node: str) -> InstanceRecord:
        """A spot instance on ``node``: a member of the elastic group, watched until its loop
        ends (:meth:`_watch`)."""
        iid = f"spot:{node[:8]}"
        member = self.group.add(
            node, instance_id=iid, block_tokens=self.cfg.block_tokens,
            max_batch=self.cfg.max_batch, args=self.instance_args,
        )  # fmt: skip
        inst = InstanceRecord(iid, "spot", member.handle, node, member=member)
        asyncio.get_running_loop().create_task(self._watch(inst, member.handle.run.remote()))
        return inst

    async def _retire(self, inst: InstanceRecord) -> None:
        """Stop a released instance on purpose (no loss: it held nothing)."""
        await self.group.retire(inst.member)

    async def _watch(self, inst: InstanceRecord, run) -> None:
        """Until the instance's loop ends: its process died (preempted or crashed, as the
        liveness watch's ``WORKER_LOST`` event says; the instance takes no work meanwhile), or
        its loop raised (a crash, named here; the instance is retired). Then its requests move
        on (:meth:`_gone`)."""
        m = inst.member
        where = f"worker group '{GROUP}' rank {m.rank} ({inst.id}) on node {m.node or inst.node}"
        try:
            await asyncio.wrap_future(run.future())
            error = "run() returned"  # (its loop ends by an exception only)
        except ray.exceptions.RayActorError as e:  # the process is gone
            if self.instances.get(inst.id) is not inst:  # released (retired) meanwhile
                return
            inst.accepting = False
            self._changed()
            lost = await self._wait_lost(m.key, self.cfg.preempt_grace_s + 30.0)
            if lost is None:  # no liveness record (e.g. it died before it registered)
                lost = {"preempted": False, "describe": f"{where} died: {death_cause(e)}"}
            self._gone(inst, lost["preempted"], f"{inst.id}: {lost['describe']}")
            return
        except Exception as e:  # noqa: BLE001 (ray.exceptions.RayTaskError: the loop raised)
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            error = lines[-1].strip() if lines else type(e).__name__
        inst.accepting = False
        await self.group.retire(m)
        self._gone(inst, False, f"{where} raised in run(): {error}")

    async def _wait_lost(self, key: str, timeout: float) -> dict | None:
        """The ``WORKER_LOST`` event of member ``key`` (:meth:`_lost_loop`), waiting up to
        ``timeout`` seconds; ``None`` if none came."""
        deadline = now() + timeout
        while key not in self._lost and now() < deadline:
            await self._wait_change(min(1.0, deadline - now()))
        return self._lost.pop(key, None)

    async def _lost_loop(self) -> None:
        """Read the run's ``WORKER_LOST`` events of this pool's instances as they come."""
        if not isinstance(self._lost_seen, int):
            self._lost_seen = await self._lost_seen
        while True:
            got = await self._bus.read.remote(events.WORKER_LOST, self._lost_seen)
            if got:
                self._lost_seen = got[-1][0]
                for _, value in got:
                    if value.get("group") == GROUP:
                        self._lost[value["key"]] = value
                self._changed()
            await asyncio.sleep(_LOST_POLL_S)

    def _gone(self, inst: InstanceRecord, preempted: bool, describe: str) -> None:
        """Forget a dead or retired instance and requeue its requests (migration); count a
        preemption (what it held) or a named error."""
        if self.group is not None and inst.member is not None:
            self.group.forget(inst.member)
        if self.instances.get(inst.id) is not inst:  # released meanwhile
            return
        self._drop(inst)  # its busy seconds stay in the step's t_remote
        if not preempted:
            self.stats["instance_errors"] += 1
            self.errors = [*self.errors[-(_KEEP_ERRORS - 1) :], describe]
            log.warning("spot instance lost, its requests move on: %s", describe)
        elif inst.version >= 0:
            self.stats["preemptions"] += 1
            ids = (*inst.pending, *sorted(inst.executing))
            held = [self.requests[r] for r in ids if r in self.requests]
            self.stats["preempted_requests"] += len(held)
            self.stats["preempted_tokens"] += sum(len(r.tokens) for r in held)
        else:  # preempted before it pulled weights (e.g. its node was already going)
            self.stats["failed_starts"] += 1
        for rid in [*inst.pending, *sorted(inst.executing)]:
            if rid in self.requests:
                self._requeue(rid, migrated=True)
        self._changed()

    async def _retire_all(self) -> None:
        """Stop every spot instance on purpose (the manager's shutdown): no losses."""
        for inst in list(self.instances.values()):
            if inst.member is not None:
                await self._retire(inst)
