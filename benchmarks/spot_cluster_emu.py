"""RLBoost at cluster scale in emulated time, driving the LIVE rollout manager: what
``benchmarks/spot_cluster.py`` runs for every RLBoost row and figure (RLBoost section 6).

The manager is :class:`~m2flow.workers.rollout.spot.manager.RolloutManager` itself (dispatch,
leases, reports, migration, rebalancing, Algorithm 1's update), on a ``looptime`` event loop:
its clock (:func:`~m2flow.workers.rollout.spot.records.now`) is the loop's virtual time, every
``asyncio.sleep`` takes no real time, and the run is deterministic given the seed (one loop,
one thread; every RNG seeded). :class:`EmulatedManager` overrides only the pool's lifecycle
seam (:mod:`~m2flow.workers.rollout.spot.lifecycle`): no event bus or elastic group, nodes
offered by an availability trace, instances that are coroutines; the policy (``_pool_tick``:
start up to ``N_prem``, release idle ones beyond it) and a death (``_gone``: requeue with
tokens, count the preemption) are the manager's own.

What is emulated around it:

- **spot instances** (:class:`SpotEmu`): the loop of
  :class:`~m2flow.workers.rollout.spot.instance.SpotInstance` (pull the staged version, lease,
  one engine block, report copies of the requests, drop what is revoked) with the engine time
  of :class:`~spot_cluster_model.EngineModel` slept on the virtual clock. An instance starts
  :data:`~spot_cluster_model.START_S` after its node is taken (those up at t = 0 are
  started), then pulls the weights (pull-based, section 4.3): ``transfer_s`` with ``n`` = the
  instances up and not yet on the version (those pulling together share the training nodes'
  NICs). ``weights="sync"`` (Figs. 13/17): the trainer pushes to the instances up at the
  step's start and waits; one that comes up mid-step serves from the next step.
- **availability**: the trace's offered nodes (``[(t, count)]``); when the count drops, a
  random offered node goes, and the instance on it, if any, dies mid-block (the manager keeps
  what it reported: migration). Step-relative ``events`` ``(step, t_rel, action, n)`` after
  the step's weights: ``add`` a node, ``preempt`` a random instance (its node goes),
  ``restart`` one (its node stays: a new instance starts there).
- **the training cluster**: ``4 x reserved_nodes`` TP-2 engines running the reserved seeding
  loop of :func:`~m2flow.workers.rollout.spot.pool.seed` (register, lease, block, report,
  leave after ``T_seed`` once a spot instance is ready; the colocated fallback of
  ``SpotPoolEngine._groups`` when none is), then a trainer
  (:class:`~spot_cluster_model.TrainModel`) collecting finished GRPO groups in dynamic
  micro-batches (``collect(0, m_b, 1.0)``), reporting its waits (``trainer_waits``, wall
  clock = ``loop.wall()``), training, resharding (``sync_s``) and staging the next version
  (which ends the step at the manager: Algorithm 1's update, a ``history`` record).

Engine model (shared with the baselines, ``spot_cluster_baselines.py``): the old simulator's
block time (KV admission, prefill of cold requests, :func:`block_seconds` over
:class:`~m2flow.workers.rollout.emulated.ThroughputModel`), not ``EmulatedEngine`` itself:
that one materialises every token (a 4.6M-token step, copied at each report) and sleeps in
real time. A response is carried as :class:`Tokens` (its length only: all the manager reads).

Deviation from the old simulator: a preempted or seeding-stopped block keeps only what was
reported (the live protocol: the manager holds every response up to its last report), not the
tokens made up to the instant.
"""

from __future__ import annotations

import asyncio
import copy
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
from m2flow.workers.rollout.emulated import throughput_preset
from m2flow.workers.rollout.exact import GenRequest
from m2flow.workers.rollout.spot.config import SpotPoolConfig
from m2flow.workers.rollout.spot.manager import RolloutManager
from m2flow.workers.rollout.spot.records import InstanceRecord, now, wall

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spot_cluster_model import (  # noqa: E402
    PROMPT_TOKENS,
    PROMPTS,
    RESERVED_GPU_PER_H,
    RESERVED_NODE_PER_H,
    SAMPLES,
    SPOT_INSTANCE_PER_H,
    START_S,
    EngineModel,
    System,
    TrainModel,
    Workload,
    run_virtual,
    summarise,
    transfer_s,
)

PROMPT = [0] * PROMPT_TOKENS  # every request's prompt (only its length matters)
COLLECT_POLL_S = 1.0  # the trainer's collect timeout (pool.py's _COLLECT_POLL_S)
IDLE_S = 0.01  # an instance with nothing leased waits this long (SpotInstance.run)


class Tokens:
    """A response's placeholder tokens: its length, which is all the manager reads of it
    (``len``, truth). Makes a report's copy O(1) instead of O(length)."""

    __slots__ = ("n",)

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class EmulatedManager(RolloutManager):
    """The live manager with the lifecycle seam over :class:`Cluster` (module docstring)."""

    def __init__(self, cfg: dict, n_reserved: int, cluster: Cluster) -> None:
        super().__init__(cfg, n_reserved, {})
        self.cluster = cluster

    def _open_lives(self) -> None:
        pass  # no event bus, no elastic group: the cluster below is the lives

    def _life_loops(self) -> list:
        return [self._pool_loop()]  # deaths come from the cluster (it calls _gone)

    def _free_nodes(self) -> list[str]:
        return list(self.cluster.nodes)

    def _start_instance(self, node: str) -> InstanceRecord:
        return self.cluster.start(node)

    async def _retire(self, inst: InstanceRecord) -> None:
        self.cluster.stop(inst, preempted=False)


class Cluster:
    """The emulated hardware of one run: offered spot nodes, spot instances, the reserved
    engines, and the bookkeeping the records need (instance-seconds, the spot timeline)."""

    def __init__(self, sy: System, wl: Workload, seed: int) -> None:
        self.sy, self.wl = sy, wl
        self.model = throughput_preset(wl.model)
        self.agents = sy.agents or sy.reserved_nodes  # weight senders (section 4.3)
        self.rng = np.random.default_rng(seed + 7919)
        self.nodes: list[str] = []
        self._node_ids = 0
        self.spots: dict[str, SpotEmu] = {}  # instance id -> instance
        self._ids = 0
        self.warm = False  # instances started now are up at once (present at t = 0)
        self.mgr: EmulatedManager | None = None
        self.targets: dict[str, int] = {}  # request id -> response length
        self.version = -1  # the reserved engines' weights (resharded in place)
        self.held_s = 0.0  # spot instance-seconds so far
        self._held_t = 0.0
        self.last_done = 0.0  # when a response last finished
        self.timeline: list[tuple[float, float, int]] = []  # (t0, t1, tokens) per spot block

    # -- instances ------------------------------------------------------------------------

    def _count(self) -> None:
        t = now()
        self.held_s += len(self.spots) * (t - self._held_t)
        self._held_t = t

    def start(self, node: str) -> InstanceRecord:
        self._count()
        self._ids += 1
        emu = SpotEmu(self, f"spot:{node}:{self._ids}", node, up=self.warm)
        self.spots[emu.id] = emu
        emu.task = asyncio.get_running_loop().create_task(emu.run())
        return InstanceRecord(emu.id, "spot", node=node, member=emu)

    def stop(self, inst: InstanceRecord, preempted: bool) -> None:
        """End the instance's coroutine (released, or its node died mid-block)."""
        emu = self.spots.pop(inst.id, None)
        if emu is None:
            return
        self._count()
        emu.stopped = True
        emu.task.cancel()
        if preempted:
            self.mgr._gone(inst, True, f"{inst.id}: node {inst.node} preempted")

    def _record(self, emu: SpotEmu) -> InstanceRecord | None:
        inst = self.mgr.instances.get(emu.id)
        return inst if inst is not None and inst.member is emu else None

    def _kill_random(self) -> SpotEmu | None:
        held = [e for e in self.spots.values() if self._record(e) is not None]
        if not held:
            return None
        emu = held[int(self.rng.integers(len(held)))]
        self.stop(self._record(emu), preempted=True)
        return emu

    async def offer(self, count: int) -> None:
        """The trace's count of offered nodes: a drop takes random offered nodes (and their
        instances); a rise offers new ones (the pool tick starts instances there)."""
        while len(self.nodes) > count:
            node = self.nodes.pop(int(self.rng.integers(len(self.nodes))))
            for emu in list(self.spots.values()):
                if emu.node == node and self._record(emu) is not None:
                    self.stop(self._record(emu), preempted=True)
        while len(self.nodes) < count:
            self._node_ids += 1
            self.nodes.append(f"n{self._node_ids}")
        await self.mgr._pool_tick()

    async def event(self, action: str, n: int) -> None:
        for _ in range(n):
            if action == "add":
                self._node_ids += 1
                self.nodes.append(f"n{self._node_ids}")
            elif action in ("preempt", "restart"):
                emu = self._kill_random()
                if emu is not None and action == "preempt":
                    self.nodes.remove(emu.node)
            else:
                raise ValueError(f"unknown event action {action!r}")
        await self.mgr._pool_tick()

    # -- an engine block ---------------------------------------------------------------------

    async def block(
        self, label: str, engine: EngineModel, executing: list[GenRequest], version: int
    ) -> tuple[list[GenRequest], float, int, float]:
        """One engine block over ``executing`` (slept on the loop's clock); returns the
        requests as they are now (copies: what a Ray call would carry), the seconds, the
        tokens made and the mean context before the block."""
        have = np.fromiter((len(r.tokens) for r in executing), np.int64, len(executing))
        target = np.fromiter((self.targets[r.id] for r in executing), np.int64, len(executing))
        dt, made = engine.block([r.id for r in executing], have, target, self.sy.block)
        context = float(PROMPT_TOKENS + have.mean())
        t0 = now()
        await asyncio.sleep(dt)
        out, total, done = [], int(made.sum()), False
        for r, h, m, tgt in zip(executing, have.tolist(), made.tolist(), target.tolist()):
            c = copy.copy(r)
            c.tokens = Tokens(h + m)
            c.done = h + m >= tgt
            if m:
                c.weight_version = version
            done |= c.done
            out.append(c)
        if done:
            self.last_done = now()
        if label == "spot":
            self.timeline.append((t0, now(), total))
        return out, dt, total, context


class SpotEmu:
    """One spot instance: :class:`~m2flow.workers.rollout.spot.instance.SpotInstance`'s loop
    as a coroutine (module docstring)."""

    def __init__(self, cluster: Cluster, iid: str, node: str, up: bool) -> None:
        self.cluster, self.id, self.node, self.up = cluster, iid, node, up
        self.version = -1
        self.engine = EngineModel(cluster.model)
        self.pushed = asyncio.Event()  # sync weights: the trainer's push arrived
        self.task: asyncio.Task | None = None
        self.stopped = False  # released or preempted (a cancel that wait_for swallowed)

    async def run(self) -> None:
        cl, mgr, sy = self.cluster, self.cluster.mgr, self.cluster.sy
        if not self.up:
            await asyncio.sleep(START_S)
            self.up = True
        executing: list[GenRequest] = []
        while not self.stopped:
            version, _ = await mgr.current_weights()
            if version != self.version and version >= 0:
                if sy.weights == "sync":  # pushed by the trainer at a step's start
                    self.pushed.clear()
                    await self.pushed.wait()
                    continue
                n = sum(1 for e in cl.spots.values() if e.up and e.version != version)
                await asyncio.sleep(transfer_s(cl.model, n, cl.agents))
                self.version = version
                self.engine.cached = {}  # new weights: every KV cache is stale
            room = sy.max_batch - len(executing)
            if room > 0:
                executing += await mgr.lease(self.id, self.version, room)
            if not executing:
                await asyncio.sleep(IDLE_S)
                continue
            out, busy, made, ctx = await cl.block("spot", self.engine, executing, self.version)
            drop = set(await mgr.report(self.id, out, busy, len(out), made, ctx))
            executing = [r for r in out if not r.done and r.id not in drop]


async def seed(cl: Cluster, i: int, engine: EngineModel, t_seed: float) -> float:
    """Reserved engine ``i``'s seeding loop (:func:`~m2flow.workers.rollout.spot.pool.seed`)
    on the loop's clock. Returns the seconds it generated."""
    mgr, iid = cl.mgr, f"reserved:{i}"
    await mgr.register(iid)
    t0 = now()
    executing: list[GenRequest] = []
    try:
        while True:
            if now() - t0 >= t_seed and await mgr.spot_ready() > 0:
                break  # hand the seeds over
            room = cl.sy.max_batch - len(executing)
            executing += await mgr.lease(iid, cl.version, room) if room else []
            if not executing:
                break
            out, busy, made, ctx = await cl.block("reserved", engine, executing, cl.version)
            drop = set(await mgr.report(iid, out, busy, len(out), made, ctx))
            executing = [r for r in out if not r.done and r.id not in drop]
    finally:
        await mgr.leave(iid)
    return now() - t0


def pool_config(sy: System) -> dict:
    """``rollout.spot`` settings of RLBoost ``sy`` (its switches on the live manager).

    Raises:
        ValueError: a switch the live manager has no setting for.
    """
    if sy.kind != "rlboost" or sy.dispatch not in ("jsq", "round_robin"):
        raise ValueError(f"{sy.name}: not RLBoost (kind {sy.kind!r}, dispatch {sy.dispatch!r})")
    cfg = {
        "enabled": True, "t_seed_init": sy.t_init, "eta": sy.eta, "memory": sy.memory,
        "seeding": sy.seeding, "theta": sy.theta, "dispatch": sy.dispatch,
        "rebalance": sy.rebalance, "block_tokens": sy.block, "max_batch": sy.max_batch,
        "micro_batch_prompts": sy.micro_batch, "migration": sy.migration,
    }  # fmt: skip
    if sy.seed_share is not None:
        if "seed_share" in SpotPoolConfig.__dataclass_fields__:
            cfg["seed_share"] = sy.seed_share
        elif sy.seed_share != "all":  # a manager before the seeding share: the old rule
            raise ValueError(f"{sy.name}: this manager has no rollout.spot.seed_share")
    if sy.n_prem_fixed is not None:  # Fig. 11's static pool (0: no node is offered anyway)
        n = max(1, sy.n_prem_fixed)
        cfg.update(n_prem_min=n, n_prem_max=n, n_prem_init=n)
    return cfg


class EmuRun:
    """One run: the steps of the training cluster around the manager (module docstring)."""

    def __init__(self, sy: System, wl: Workload, trace, events, seed: int) -> None:
        self.sy, self.wl = sy, wl
        self.trace, self.events = list(trace or []), list(events)
        self.cl = Cluster(sy, wl, seed)
        self.n_resv = 4 * sy.reserved_nodes  # TP-2 engines of the training cluster
        self.trainer = TrainModel(
            self.cl.model.params, 8 * sy.reserved_nodes, scale_eff=sy.scale_eff
        )
        self.engines = [EngineModel(self.cl.model) for _ in range(self.n_resv)]
        self.records: list[dict] = []
        self._tasks: list[asyncio.Task] = []

    async def main(self, duration: float, max_steps: int) -> list[dict]:
        sy, cl = self.sy, self.cl
        mgr = cl.mgr = EmulatedManager(pool_config(sy), self.n_resv, cl)
        loop = asyncio.get_running_loop()
        await mgr.start()
        cl.warm = True  # the instances offered at t = 0 are up (started before the clock)
        await cl.offer(self.trace[0][1] if self.trace else 0)
        cl.warm = False
        self._tasks.append(loop.create_task(self._replay()))
        await mgr.stage(0, [])
        try:
            step = 0
            while now() < duration and step < max_steps:
                await self.step(step)
                step += 1
        finally:
            spots = [e.task for e in cl.spots.values()]
            await mgr.shutdown()
            await _end([*self._tasks, *mgr._tasks, *spots])
        return self.records

    async def _replay(self) -> None:
        for t, count in self.trace[1:]:
            await asyncio.sleep(max(t - now(), 0.0))
            await self.cl.offer(count)

    async def _event(self, t: float, action: str, n: int) -> None:
        await asyncio.sleep(max(t - now(), 0.0))
        await self.cl.event(action, n)

    async def step(self, k: int) -> None:
        sy, cl, mgr, wl = self.sy, self.cl, self.cl.mgr, self.wl
        t_start = now()
        cl._count()
        held0 = cl.held_s
        cl.version = k  # the reserved engines: resharded in place after the last training
        push_s = 0.0
        if sy.weights == "sync":  # pushed to the instances up now; the trainer waits
            up = [e for e in cl.spots.values() if e.up]
            push_s = transfer_s(cl.model, len(up), cl.agents) if up else 0.0
            await asyncio.sleep(push_s)
            for e in up:
                e.version = k
                e.pushed.set()
        t_roll = now()
        loop = asyncio.get_running_loop()
        for s, t_rel, action, n in self.events:
            if s == k:
                self._tasks.append(loop.create_task(self._event(t_roll + t_rel, action, n)))
        keys = [(k, p, j) for p in range(PROMPTS) for j in range(SAMPLES)]
        lengths = wl.lengths.lengths(wl.seed, keys)
        reqs = [
            GenRequest(f"{s}:{p}:{j}", PROMPT, (s, p, j), wl.lengths.cap, tokens=Tokens())
            for s, p, j in keys
        ]
        cl.targets = {r.id: int(n) for r, n in zip(reqs, lengths)}
        t_seed = await mgr.submit(k, 0, reqs)
        await asyncio.gather(*(seed(cl, i, e, t_seed) for i, e in enumerate(self.engines)))
        seed_end = now() - t_start
        waits: list[list[float]] = []
        got = tokens = 0
        train_s = 0.0
        while got < PROMPTS:
            w0 = wall()
            groups = await mgr.collect(0, sy.micro_batch, COLLECT_POLL_S)
            w1 = wall()
            if waits and waits[-1][1] == w0:
                waits[-1][1] = w1
            elif w1 > w0:
                waits.append([w0, w1])
            if not groups:
                if await mgr.spot_ready() == 0:  # colocated fallback (pool.py _groups)
                    await asyncio.gather(*(seed(cl, i, e, 0.0) for i, e in enumerate(self.engines)))
                continue
            got += len(groups)
            n_tok = sum(PROMPT_TOKENS + len(r.tokens) for g in groups for r in g)
            tokens += n_tok
            dt = self.trainer.train_s(n_tok)
            train_s += dt
            await asyncio.sleep(dt)
        await asyncio.sleep(self.trainer.sync_s)
        await mgr.trainer_waits([waits])
        memory = dict(mgr.policy.memory)
        await mgr.stage(k + 1, [])  # ends step k at the manager: Algorithm 1, its history
        h = mgr.history[-1]
        if h["step"] != k:
            raise RuntimeError(f"the manager did not end step {k} (last record {h['step']})")
        cl._count()
        dur = now() - t_start
        inst_s = cl.held_s - held0
        price = 2 * RESERVED_GPU_PER_H if sy.reserved_price else SPOT_INSTANCE_PER_H
        self.records.append(
            {
                "step": k, "t_start": t_start, "step_s": dur, "tokens": tokens,
                "reserved_cost": dur / 3600 * sy.reserved_nodes * RESERVED_NODE_PER_H,
                "instance_s": inst_s, "spot_cost": inst_s / 3600 * price,
                "t_seed": h["t_seed"], "n_prem": h["n_prem"], "n_bar": h["n_bar"],
                "n_hat": h["n_hat"], "available": len(cl.nodes),
                "memory_hit": (h["n_hat"] in memory) if sy.seeding else None,
                "t_train_wait": h["t_train_wait"], "t_remote_wait": h["t_remote_wait"],
                "t_train": h["t_train"], "t_remote": h["t_remote"], "train_s": train_s,
                "spot_tokens": h["spot_tokens"], "reserved_tokens": h["reserved_tokens"],
                "migrated": h["migrated_samples"], "migrated_tokens": h["migrated_tokens"],
                "preemptions": h["preemptions"], "preempted_tokens": h["preempted_tokens"],
                "failed_starts": h["failed_starts"], "released": h["released"],
                "rebalanced": h["rebalanced_samples"], "seed_end": seed_end, "push_s": push_s,
                "last_response": max(cl.last_done - t_start, 0.0), "manager_step_s": h["step_s"],
            }
        )  # fmt: skip


async def _end(tasks: list[asyncio.Task]) -> None:
    """Cancel ``tasks`` until they are done (Python 3.11's ``wait_for`` swallows a cancel that
    arrives as its awaitable completes: the manager's loops wait in it)."""
    while True:
        live = [t for t in tasks if not t.done()]
        if not live:
            return
        for t in live:
            t.cancel()
        await asyncio.wait(live, timeout=1.0)


def run_rlboost(
    system: System,
    wl: Workload,
    duration: float,
    trace=None,
    events=(),
    max_steps: int = 10**6,
    warmup: int = 0,
    seed: int = 0,
) -> dict:
    """RLBoost ``system`` on workload ``wl`` for ``duration`` emulated seconds (or
    ``max_steps`` steps) under availability ``trace`` (``[(t, offered nodes)]``, absolute
    seconds) and step-relative ``events``, on the live manager (module docstring).

    Returns ``{"system", "records", "timeline", **summarise(records, warmup)}``: one record per
    step (emulated seconds, $; the keys the figures read), the spot blocks ``(t0, t1,
    tokens)``. Deterministic given ``seed`` (and ``wl.seed``, the response lengths'), across
    processes too: the manager walks its sets of request ids in sorted order (checked: Fig. 10's
    8B runs are equal under ``PYTHONHASHSEED`` 0 and 1).

    Raises:
        ValueError: ``system`` is not RLBoost, or uses a switch the live manager lacks.
    """
    run = EmuRun(system, wl, trace, events, seed)
    rec = run_virtual(run.main(duration, max_steps))
    return {
        "system": asdict(system),
        "records": rec,
        "timeline": run.cl.timeline,
        **summarise(rec, warmup),
    }
