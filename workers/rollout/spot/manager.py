"""The rollout manager: one Ray actor per run that owns every request of a step (RLBoost 4.2).

Instances are rollout engines: the reserved rollout ranks while they seed (RLBoost 4.1) and
the spot instances on preemptible nodes (:mod:`.instance`). Every decision comes from the pure
policies in :mod:`m2flow.scheduler.spot`; the manager applies them:

- **dispatch** (Algorithm 2, SELECTINSTANCE): a queued request goes to the current instance
  with the fewest pending requests among those with fewer than Θ; when every one has Θ, it
  waits for a completion (delayed dispatch). ``dispatch="round_robin"`` is the ablation. A
  seeding reserved rank is such an instance, but holds at most its share of the step's
  requests, ``ceil(requests / (N_resv + min(N_prem, spot instances held or starting)))``
  (:func:`~m2flow.scheduler.spot.seeding_share`): the rest stays queued for the spot
  instances as they become current (paper:137-139); no bound when no spot instance is
  expected, or once its window has passed with none ready (colocated fallback, paper:197).
  ``seed_share="all"`` is the old rule (up to ``max_batch`` each), an ablation.
- **lease**: an instance pulls its pending requests when it has batch room (they become
  executing) and reports each block of tokens back (``report``), so the manager always holds
  every response up to its last block.
- **migration**: the spot instances are an elastic worker group under the runtime's liveness
  watch (:mod:`.lifecycle`); an instance that dies -- its node was preempted or removed, or it
  crashed (named in :meth:`RolloutManager.metrics`'s ``errors``) -- is reported by the run
  event ``WORKER_LOST``, never failing the run; its pending and executing requests go back to
  the queue with their tokens and logprobs, and another instance continues them. No request is
  lost or duplicated: a request is on one instance at a time, and a report from an instance
  that no longer holds it is ignored.
- **rebalancing** (Algorithm 2, CONTINUOUSLB): pending requests move to idle instances;
  executing ones beyond the batching plateau ``B`` are revoked at the busiest instance's next
  report and go, with their tokens, to the front of the idle instance's pending requests
  (``MIGRATEREQS(j -> i, r)``, line 27). ``B`` comes from the online throughput profile of
  the previous step (and the current one as it goes), calibrated to the running requests'
  mean context and recomputed as it grows (paper:251). A reserved rank at its share is no
  destination.
- **admission and seeding** (Algorithm 1): at most ``N_prem`` spot instances run (an idle
  instance beyond a lowered ``N_prem`` is released); the reserved ranks generate for ``T_seed``
  seconds, then hand their partial responses over (unless no spot instance is ready: then
  they finish the rollout themselves). ``T_seed`` and ``N_prem`` are updated after every step
  from its idle and compute times: ``n_bar`` is the spot instance count integrated up to the
  step's end (a count held all step gives exactly that integer, so the memory of lines 11-14
  fires); ``t_remote`` counts the busy seconds of every instance held during the step (those
  preempted or released too); ``N_prem`` is capped at the step's request count; without
  seeding (ablation) ``T_seed`` stays 0 and line 10 still sets ``N_prem``. The trainer's idle
  time is what the trainer reports (its waits for micro-batches, outside the reserved ranks'
  generation: the run event :data:`m2flow.core.events.TRAINER_WAITS`, read from the run's
  event bus at the step's end, or :meth:`RolloutManager.trainer_waits`), else the waits of a
  trainer that collects itself.
- **weights** (4.3): staged once per update (one object-store copy); an instance pulls the
  version it lacks when it registers and at each update, and takes work only on the current
  version.
- **pause** (:meth:`RolloutManager.pause`, the pool engine's ``pause``): nothing is dispatched
  or leased to spot instances, and their executing requests are revoked at their next report
  (back to the queue's head with their tokens, logprobs and per-token versions) until
  :meth:`RolloutManager.resume`; the reserved ranks' requests stay with them (their engines
  pause in place).

Times are the manager's clock's seconds (:func:`.records.now`: ``time.monotonic()`` on
a standard event loop). Metrics per step: tokens by reserved vs spot engines,
preemptions and the requests and tokens the preempted instances held, migrated samples and
tokens, ``T_seed``, ``N_prem``. The records it keeps (instances, the step's clock, Algorithm
1's inputs) are in :mod:`.records`; the dispatch and rebalancing loops in :mod:`.placement`.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict, deque

import ray
from m2flow.scheduler.spot import SeedingPolicy, ThroughputProfile

from m2flow.core import events

from ..exact import GenRequest
from .config import SpotPoolConfig
from .lifecycle import InstanceLives
from .names import MANAGER_NAME
from .placement import RequestPlacement
from .records import InstanceRecord, StepRecord, now, wall


class RolloutManager(InstanceLives, RequestPlacement):
    """See the module docstring. Created by :func:`get_manager`; all methods are coroutines on
    one event loop (no locks needed). The spot instances' lives: :class:`~.lifecycle.
    InstanceLives`; dispatch and rebalancing: :class:`~.placement.RequestPlacement`."""

    def __init__(self, cfg: dict, n_reserved: int, instance_args: dict) -> None:
        self.cfg = SpotPoolConfig(**cfg)
        self.instance_args = instance_args
        c = self.cfg
        # n_prem_min >= 1 (deviation): with no instance in a step, line 10 can give N_prem = 0,
        # after which no instance would ever start to make it grow again.
        self.policy = SeedingPolicy(
            n_resv=n_reserved, eta=c.eta, t_init=c.t_seed_init, use_memory=c.memory,
            n_prem_min=c.n_prem_min, n_prem_max=c.n_prem_max or None,
        )  # fmt: skip
        n = c.n_prem_init or self.policy.n_prem  # a plan's N_prem, else line 3's N_resv
        self.policy.n_prem = max(c.n_prem_min, min(n, c.n_prem_max or n))
        if not c.seeding:  # ablation: everything goes to the spot instances at once
            self.policy.t_seed = 0.0
        self.profile = ThroughputProfile()
        self.plateau: int | None = None
        self._plateau_key: tuple | None = None  # (closed steps, context bucket) B was made at
        self._profiled: ThroughputProfile | None = None  # P as the last step closed it
        self.version: int = -1
        self.weights: list = []  # [ObjectRef] of the staged weights
        self.instances: dict[str, InstanceRecord] = {}
        self.requests: dict[str, GenRequest] = {}
        self.queue: deque[str] = deque()
        self.groups_left: dict[tuple[int, int], int] = {}  # (owner, prompt) -> unfinished
        self.ready: dict[int, list[list[GenRequest]]] = defaultdict(list)  # owner -> groups
        self.cur = StepRecord()
        self.changed = asyncio.Event()
        self.stats: dict = self._fresh_stats()
        self.history: list[dict] = []  # one record per finished step
        self.paused = False  # spot instances held (:meth:`pause`)
        self._rr = 0
        self._tasks: list[asyncio.Task] = []
        self._bus = None  # the run's event bus (the trainer's waits arrive there)
        self._bus_seen = None  # the last event number read (a ref to it until the first read)
        self.group = None  # the spot instances' elastic group (opened with the bus)
        self._lost: dict[str, dict] = {}  # member key -> its WORKER_LOST event, unhandled
        self._lost_seen = None  # the last WORKER_LOST event number read (as _bus_seen)
        self.errors: list[str] = []  # instances lost to crashes or loop errors, named

    async def start(self) -> None:
        """Start the background loops now: spot instances start on the nodes there are and
        are ready when the first weights are staged (the pool's creator calls it; any other
        call starts them too)."""
        self._start()

    def _start(self) -> None:
        """The background loops, started by the first call (an actor's __init__ has no event
        loop running yet)."""
        if not self._tasks:
            self._open_lives()
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._dispatch_loop()),
                loop.create_task(self._rebalance_loop()),
                *(loop.create_task(c) for c in self._life_loops()),
            ]

    # -- weights and steps ----------------------------------------------------------------

    async def stage(self, version: int, weights: list) -> None:
        """New weights (``weights``: ``[ObjectRef]``, one staged copy). Ends the step whose
        rollout used the previous version: Algorithm 1 updates ``T_seed`` and ``N_prem``."""
        self._start()
        if self.cur.step >= 0 and not self.queue and not self._unfinished():
            await self._read_trainer_waits()
            self._end_step()
        self.version, self.weights = version, weights
        self._changed()

    async def pause(self) -> None:
        """Hold the spot instances: no dispatch, no lease; each one's executing requests come
        back at its next report (module docstring). Idempotent."""
        self._start()
        self.paused = True
        for inst in self.instances.values():
            if inst.kind == "spot":
                for rid in sorted(inst.executing):  # (sets: a stable order for replays)
                    inst.revoke.setdefault(rid, None)  # to the queue's head
                while inst.pending:
                    self.queue.appendleft(inst.pending.pop())
        self._changed()

    async def resume(self) -> None:
        """Undo :meth:`pause`: dispatch and leases go on (on the current weights)."""
        self.paused = False
        self._changed()

    async def set_config(self, **fields) -> None:
        """Change pool settings from the next lease or dispatch on (e.g. an ablation's
        ``dispatch`` or ``rebalance``; ``max_batch``; ``n_prem_min``/``n_prem_max`` clamp
        ``N_prem`` at once, and ``n_prem_init`` sets it).

        Raises:
            ValueError: an unknown field or a bad value.
        """
        from dataclasses import replace

        unknown = set(fields) - set(SpotPoolConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown spot pool settings {sorted(unknown)}")
        cfg = replace(self.cfg, **fields)
        cfg.check()
        self.cfg = cfg
        p = self.policy  # Algorithm 1's clamps (and a new starting N_prem) apply from now on
        p.n_prem_min, p.n_prem_max = cfg.n_prem_min, cfg.n_prem_max or None
        n = cfg.n_prem_init if "n_prem_init" in fields and cfg.n_prem_init else p.n_prem
        p.n_prem = max(p.n_prem_min, n if p.n_prem_max is None else min(n, p.n_prem_max))
        self._changed()

    async def current_weights(self) -> tuple[int, list]:
        return self.version, self.weights

    async def submit(self, step: int, owner: int, requests: list[GenRequest]) -> float:
        """A rollout rank's share of step ``step``; it collects them. Returns ``T_seed``."""
        self._start()
        t = now()
        if step != self.cur.step:
            if self.cur.step >= 0:  # the last step ended without new weights: close it anyway
                await self._read_trainer_waits()
                self._end_step()
            self.cur = StepRecord(step=step, start=t, n_since=t, t_seed=self.policy.t_seed)
            for inst in self.instances.values():
                inst.busy_s, inst.last_done, inst.context = 0.0, None, None
        self.cur.owners[owner] = self.cur.owners.get(owner, 0) + len({r.key[1] for r in requests})
        self.cur.requests += len(requests)
        for r in requests:
            if r.id in self.requests:
                raise ValueError(f"request {r.id} submitted twice")
            self.requests[r.id] = r
            self.groups_left[(owner, r.key[1])] = self.groups_left.get((owner, r.key[1]), 0) + 1
            self.queue.append(r.id)
        self._changed()
        return self.policy.t_seed

    # -- instances --------------------------------------------------------------------------

    async def register(self, instance_id: str, kind: str = "reserved") -> None:
        """A reserved rank starts seeding (spot instances are registered by the pool loop)."""
        if kind == "spot":
            self._integrate()  # the count changes: n_bar's integral up to now
        self.instances[instance_id] = InstanceRecord(instance_id, kind, version=self.version)
        if kind == "reserved":  # the reserved devices generate from now until it leaves
            self.cur.reserved_spans.append([instance_id, wall(), None])
            self.cur.seed_from.setdefault(instance_id, now())
        self._changed()

    async def lease(self, instance_id: str, version: int, capacity: int) -> list[GenRequest]:
        """Up to ``capacity`` of the instance's pending requests, now executing on it (waits up
        to 0.2 s for some, only when it executes nothing: one that has work goes on with its
        next block at once). ``[]`` when there are none, when it is leaving, or when its
        ``version`` is not the current one (it must pull the weights first)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return []
        inst.version = version
        if version != self.version or (self.paused and inst.kind == "spot"):
            return []
        deadline = now() + 0.2
        while (not inst.pending and not inst.executing and inst.accepting
               and now() < deadline):  # fmt: skip
            await self._wait_change(deadline - now())
        out = []
        capacity = min(capacity, self.cfg.max_batch - len(inst.executing))
        while inst.pending and len(out) < capacity:
            rid = inst.pending.popleft()
            inst.executing.add(rid)
            out.append(self.requests[rid])
        return out

    async def report(
        self,
        instance_id: str,
        updates: list[GenRequest],
        busy_s: float,
        batch: int,
        tokens: int,
        context: float | None = None,
    ) -> list[str]:
        """A block of tokens from an instance: the requests as it holds them now. Returns the
        ids it must drop (revoked by rebalancing, or it is leaving)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return [r.id for r in updates]
        t = now()
        inst.busy_s += busy_s
        if context is not None:
            inst.context = context
        if batch and busy_s > 0:  # the online batching profile P (Algorithm 2, line 24)
            self.profile.record(batch, tokens, busy_s, context_len=context)
        label = "spot" if inst.kind == "spot" else "reserved"
        for r in updates:
            if r.id not in inst.executing:  # moved away meanwhile: the manager's copy stands
                continue
            old = self.requests[r.id]
            self.stats[f"{label}_tokens"] += len(r.tokens) - len(old.tokens)
            self.requests[r.id] = r
            if r.done:
                inst.executing.discard(r.id)
                inst.last_done = t
                self._finished(r)
        drop = [rid for rid in inst.revoke if rid in inst.executing]
        for rid in drop:
            inst.executing.discard(rid)
            to = inst.revoke[rid]  # None: held by a pause, back to the queue
            self._requeue(rid, migrated=to is not None, to=self.instances.get(to))
        inst.revoke.clear()
        self._changed()
        return drop

    async def leave(self, instance_id: str) -> None:
        """A reserved rank ends its seeding window: its requests go back to the queue with their
        partial responses (the "seeds" of RLBoost 4.1)."""
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return
        w = wall()
        for span in self.cur.reserved_spans:
            if span[0] == instance_id and span[2] is None:
                span[2] = w
        if self.cur.seed_end is None:
            self.cur.seed_end = now()
            self.cur.seed_end_wall = w
        for rid in [*inst.pending, *sorted(inst.executing)]:
            self._requeue(rid, migrated=False)
        self._changed()

    async def spot_ready(self) -> int:
        """Spot instances alive on the current weights."""
        return sum(
            1
            for i in self.instances.values()
            if i.kind == "spot" and i.accepting and i.version == self.version >= 0
        )

    async def collect(self, owner: int, min_groups: int, timeout: float) -> list[list[GenRequest]]:
        """Finished GRPO groups of ``owner``: at least ``min_groups`` (or all it has left),
        waiting up to ``timeout`` seconds (``[]`` if none came). The wait counts as the
        trainer's idle time (Algorithm 1's ``t_train^wait``) only in a step whose trainer
        reported no waits of its own (:meth:`trainer_waits`): then the caller is taken to be
        the trainer (it trains between calls, as the emulated cluster's does). A rollout rank
        that collects for a trainer on the same devices is not idle while the trainer trains
        there, so with a reporting trainer its waits are not counted."""
        t0 = now()
        deadline = t0 + timeout
        while True:
            left = sum(1 for (o, _), n in self.groups_left.items() if o == owner and n > 0)
            have = len(self.ready[owner])
            if (have and have >= min(min_groups, have + left)) or not left:
                break
            if now() >= deadline:
                break
            await self._wait_change(deadline - now())
        if self.cur.seed_end is not None:
            self.cur.train_wait[owner] += now() - t0
        out, self.ready[owner] = self.ready[owner], []
        return out

    async def trainer_waits(self, waits: list[list[list[float]]]) -> None:
        """The trainer's waits for micro-batches in the current step (RLBoost 4.1: the
        training cluster idle, "waiting for sufficient responses to fill a microbatch"), one
        list per trainer rank of ``[t0, t1]`` wall-clock (``time.time()``) seconds. Algorithm 1
        reads their mean over ranks, counting only what lies after the seeding window and
        outside the reserved ranks' generation. Call before the step's :meth:`stage`.

        Raises:
            ValueError: an interval that is not two finite times in order.
        """
        for rank, spans in enumerate(waits):
            for span in spans:
                t0, t1 = (float(x) for x in span)
                if not (math.isfinite(t0) and math.isfinite(t1) and t0 <= t1):
                    raise ValueError(f"trainer rank {rank}: bad wait interval {span!r}")
            self.cur.trainer_waits[rank] = [tuple(map(float, x)) for x in spans]

    async def _read_trainer_waits(self) -> None:
        """Take the trainer's waits published since the last read (the run event
        :data:`m2flow.core.events.TRAINER_WAITS`) into this step's record
        (:meth:`trainer_waits`)."""
        if self._bus is None:
            return
        if not isinstance(self._bus_seen, int):
            self._bus_seen = await self._bus_seen
        got = await self._bus.read.remote(events.TRAINER_WAITS, self._bus_seen)
        if got:
            self._bus_seen = got[-1][0]
            by_rank = {v["rank"]: v["waits"] for _, v in got}  # the latest of each rank
            await self.trainer_waits([by_rank[r] for r in sorted(by_rank)])

    async def metrics(self) -> dict:
        """This step's counters so far, the schedule, and the instances."""
        return {
            **self.stats,
            "t_seed": self.policy.t_seed,
            "n_prem": self.policy.n_prem,
            "plateau": self.plateau,
            "memory": dict(self.policy.memory),
            "queue": len(self.queue),
            "instances": {
                i.id: {
                    "kind": i.kind,
                    "version": i.version,
                    "pending": len(i.pending),
                    "executing": len(i.executing),
                    # executing requests with reported tokens: partial responses it holds
                    "partial": sum(
                        1 for r in i.executing if r in self.requests and self.requests[r].tokens
                    ),
                    "node": i.node,
                    "key": "" if i.member is None else i.member.key,  # in the liveness registry
                }
                for i in self.instances.values()
            },  # fmt: skip
            "partial": sum(1 for r in self.requests.values() if r.tokens and not r.done),
            "errors": list(self.errors),  # instances lost to a crash or a loop error, named
            "steps": self.history[-1:],
        }

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self._retire_all()

    # -- internals --------------------------------------------------------------------------

    def _fresh_stats(self) -> dict:
        return {
            "reserved_tokens": 0,
            "spot_tokens": 0,
            "preemptions": 0,
            "preempted_requests": 0,  # requests the preempted instances held (moved on)
            "preempted_tokens": 0,  # their response tokens, kept (migration)
            "migrated_samples": 0,
            "migrated_tokens": 0,
            "rebalanced_samples": 0,
            "failed_starts": 0,
            "instance_errors": 0,
            "released": 0,
        }

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    async def _wait_change(self, timeout: float) -> None:
        # at least 1 us: asyncio runs a timer within its clock resolution (1 ns) of now at
        # once, so on a virtual clock (whose now sits on a 1 us grid) a deadline a float ulp
        # away would never be reached and a `while now() < deadline` wait would spin
        try:
            await asyncio.wait_for(self.changed.wait(), max(timeout, 1e-6))
        except TimeoutError:
            pass

    def _unfinished(self) -> bool:
        return any(n > 0 for n in self.groups_left.values())

    def _finished(self, r: GenRequest) -> None:
        key = (r.owner, r.key[1])
        self.groups_left[key] -= 1
        if self.groups_left[key] == 0:
            group = [q for q in self.requests.values() if (q.owner, q.key[1]) == key]
            self.ready[r.owner].append(sorted(group, key=lambda q: q.key[2]))
            for q in group:
                del self.requests[q.id]
            del self.groups_left[key]

    def _requeue(self, rid: str, migrated: bool, to: InstanceRecord | None = None) -> None:
        """Back to the queue's head, or to the head of ``to``'s pending requests (a
        rebalancing move's destination, while it can still take work)."""
        r = self.requests[rid]
        if migrated and r.tokens:
            r.moves += 1
            self.stats["migrated_samples"] += 1
            self.stats["migrated_tokens"] += len(r.tokens)
            if self.cfg.migration == "recompute":  # ablation: restart from the prompt
                r.tokens, r.logprobs, r.versions = [], [], []
        if to is not None and to.accepting and to.version == self.version:
            to.pending.appendleft(rid)
        else:
            self.queue.appendleft(rid)  # continued first: it has the most work done

    def _drop(self, inst: InstanceRecord) -> None:
        """Forget a spot instance gone (preempted, crashed) or released; its busy seconds stay
        in the step's ``t_remote`` (:meth:`StepRecord.remote_busy`)."""
        self._integrate()
        del self.instances[inst.id]
        if inst.kind == "spot":
            self.cur.gone_busy_s += inst.busy_s

    def _integrate(self) -> float:
        """``n_bar``'s integral up to now at the spot count held (:meth:`StepRecord.
        integrate`). Returns now (monotonic)."""
        return self.cur.integrate(sum(1 for i in self.instances.values() if i.kind == "spot"))

    def _end_step(self) -> None:
        """Algorithm 1 after a step (definitions in docs/results/spot.md)."""
        t_end = self._integrate()  # n_bar's integral up to the step's end, at its clock
        c = self.cur
        spot = [i for i in self.instances.values() if i.kind == "spot"]
        stats = c.stats(t_end, spot)
        t_seed, n_prem, plateau = self.policy.t_seed, self.policy.n_prem, self.plateau
        # no seeding (ablation): T_seed stays 0, line 10 still sets N_prem (the simulator's)
        self.policy.update(stats, seeding=self.cfg.seeding, n_requests=c.requests)
        # B for the next step's start, at this step's context; recalibrated as it runs
        self.plateau = self.profile.plateau() if self.cfg.rebalance else None
        self.profile.new_step()
        self._profiled = self.profile.frozen() if self.cfg.rebalance else None
        self.history.append(
            {**self.stats, "step": c.step, "t_seed": t_seed, "n_prem": n_prem,
             "n_bar": stats.n_bar, "n_hat": stats.n_hat, "t_train_wait": stats.t_train_wait,
             "t_remote_wait": stats.t_remote_wait, "t_train": stats.t_train,
             "t_remote": stats.t_remote,
             "trainer_reported": bool(c.trainer_waits), "remote_busy_s": c.remote_busy(spot),
             "requests": c.requests, "plateau": plateau, "step_s": max(t_end - c.start, 1e-9)}
        )  # fmt: skip
        self.history = self.history[-100:]
        self.stats = self._fresh_stats()
        self.cur.step = -1


def get_manager(cfg: dict, n_reserved: int, instance_args: dict):
    """The run's rollout manager (named; created by the first caller)."""
    from m2flow.core.cluster import NAMESPACE
    from m2flow.core.spot import here

    actor = ray.remote(num_cpus=0, max_concurrency=1000)(RolloutManager)
    return actor.options(
        name=MANAGER_NAME, namespace=NAMESPACE, get_if_exists=True, scheduling_strategy=here()
    ).remote(cfg, n_reserved, instance_args)
