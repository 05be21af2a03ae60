"""The reward service engine: tasks, batches, EBF stage queues, elastic worker pools.

One asyncio loop owns all state. Each pipeline stage has a pool of worker processes
(:mod:`.worker`, one request at a time each) and a priority queue ordered Earliest-Batch-First
(DistRS section 5.2: the batch's estimated earliest completion ``T`` from its task's previous
batch, Eq. 1-2; FCFS within a batch; batches without history last). A request runs the stages
in order; a stage that fails, or passes its timeout (the worker process group is killed),
ends the request with the pipeline's penalty reward and skips the later stages. Every request
ends with exactly one result: nothing is dropped or left pending (a crashed worker gives an
``error`` result with the penalty).

Scaling (DistRS section 5.2): at each batch announcement and completion the policy
(:class:`~m2flow.scheduler.reward_scaling.DistRSPolicy`, Algorithm 2 + 1) sets the worker count
of every stage of the pipeline from the active batches and their tasks' histories. Scale-up
starts processes right away, so announcing a batch before its first response is ready hides
their start-up (cold start). Scale-down stops idle workers at once and busy ones when their
request ends. While a batch of a pipeline is active, each of its stages keeps >= 1 worker
(applied at once, before the decision).

No tenant can stall another's scaling: decisions run one at a time per pipeline, outside the
event loop, on a snapshot of the state, and events that arrive meanwhile are coalesced into
one follow-up decision; nothing waits on a decision (an announcement returns at once). A
decision simulates at most ``max_decision_jobs`` requests (sampled, then scaled up), and a
batch holds at most ``max_batch_size`` requests, so a decision's cost is bounded.

Requests are idempotent by id (the same id and payload again is a no-op) and announcements by
batch id, so clients retry freely; :attr:`RewardService.instance` names this run of the service
(its state is in memory), so a client notices a restart and rebuilds its batches
(docs/reward_service.md, "Streaming, retries and restarts").

Trust (docs/design.md, "Reward service trust model"): rewards are clamped to the pipeline
kind's documented range; a request's sandbox limits are validated when it is submitted (only
tighter than the service's); a tenant sees only its own tasks, in every view.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import time
import uuid

from m2flow.scheduler.reward_scaling import BatchView, DistRSPolicy
from m2flow.scheduler.reward_sim import RequestRecord, ebf_priority

from .journal import ResultJournal
from .pipelines import clamp_reward, validate_payload
from .pools import Pool, Proc, ScratchRoot
from .schemas import PipelineConfig, ServiceConfig
from .state import Batch, Req, ServiceError, Task, _digest

__all__ = ["Batch", "Req", "RewardService", "ServiceError", "Task"]


class RewardService:
    """The engine behind the HTTP app. All methods run on one asyncio loop."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.tokens = {t.token: name for name, t in config.tenants.items()}
        self.tasks: dict[str, Task] = {}
        self.pools: dict[str, list[Pool]] = {}
        for name, p in config.pipelines.items():
            self.pools[name] = [
                Pool(p.kind, s, i, c.timeout_s, c.options, c.memory_bytes)
                for i, (s, c) in enumerate(p.stages.items())
            ]
        self.policies = {n: self._policy(p) for n, p in config.pipelines.items()}
        self.scratch = ScratchRoot(config.scratch_dir)
        self.journal = ResultJournal(config.state_dir) if config.state_dir else None
        #: the last decisions (bounded: the service runs for days)
        self.decisions: collections.deque[dict] = collections.deque(maxlen=1000)
        self.n_decisions = 0
        self.decision_s_max = 0.0
        self.t0 = time.monotonic()
        #: this run of the service: its state lives in memory, so a client that sees another
        #: instance knows the service restarted (every answer carries it: see app.py)
        self.instance = uuid.uuid4().hex[:16]
        self.requests_done = 0
        self.closing = False
        self._bg: set[asyncio.Task] = set()
        self._stopping: set[Proc] = set()  # killed, not yet reaped (shutdown waits for them)
        self._deciding: dict[str, str | None] = {}  # pipeline -> pending reason, while deciding

    def _policy(self, p: PipelineConfig) -> DistRSPolicy | None:
        if self.config.policy == "static":
            return None
        stages = list(p.stages.values())
        return DistRSPolicy(
            [s.timeout_s for s in stages],
            ebf=self.config.policy != "fcfs",
            timeout_check=self.config.policy != "history-only",
            caps=[s.max_workers for s in stages],
            cold_workers=[
                s.initial_workers if s.initial_workers is not None else s.max_workers
                for s in stages
            ],
            max_jobs=self.config.max_decision_jobs,
        )

    # ---- tenants and tasks -------------------------------------------------------------
    def tenant_of(self, token: str | None) -> str:
        if token is None or token not in self.tokens:
            raise ServiceError(
                401,
                "missing or unknown bearer token: send 'Authorization: "
                "Bearer <token>' with a tenant token from the config",
            )
        return self.tokens[token]

    def register(self, tenant: str, task: str, pipeline: str, delay_bound_s: float | None) -> Task:
        if pipeline not in self.config.pipelines:
            raise ServiceError(404, f"unknown pipeline {pipeline!r}: {sorted(self.pools)}")
        old = self.tasks.get(task)
        if old is not None and old.tenant != tenant:
            raise ServiceError(409, f"task {task!r} belongs to another tenant: pick another name")
        if old is not None:
            return old
        d = self.config.default_delay_bound_s if delay_bound_s is None else delay_bound_s
        self.tasks[task] = Task(task, tenant, pipeline, d)
        return self.tasks[task]

    def task(self, tenant: str, name: str) -> Task:
        t = self.tasks.get(name)
        if t is None or t.tenant != tenant:
            raise ServiceError(404, f"no task {name!r} for this tenant: register it first")
        return t

    def batch(self, tenant: str, task: str, batch: str) -> Batch:
        b = self.task(tenant, task).batches.get(batch)
        if b is None:
            raise ServiceError(404, f"task {task!r} has no batch {batch!r}: announce it first")
        return b

    # ---- batches and requests ----------------------------------------------------------
    async def announce(
        self, tenant: str, task: str, size: int, batch: str | None, scored=()
    ) -> Batch:
        """A new batch of ``size`` requests; scaling for it starts at once (not awaited).

        Idempotent: announcing an existing batch id with the same size returns that batch (a
        client retrying, or several trainer ranks announcing their step's batch). ``scored``:
        ``(id, reward)`` of requests of this batch that an earlier instance of the service
        scored (a client re-announcing after a restart; :meth:`_settle`): they count toward
        ``size`` and are not submitted again, so the batch still completes.

        Raises:
            ServiceError: 422 for a size over ``max_batch_size`` or more ``scored`` ids than
                ``size``; 409 for an existing batch id with another size; 404 as named.
        """
        t = self.task(tenant, task)
        if size > self.config.max_batch_size:
            raise ServiceError(
                422,
                f"batch size {size} is over the service's max_batch_size "
                f"{self.config.max_batch_size}: split the batch",
            )
        bid = batch or uuid.uuid4().hex[:12]
        b = t.batches.get(bid)
        if b is not None and b.size != size:
            raise ServiceError(
                409,
                f"batch {bid!r} of task {task!r} exists with size {b.size}, not {size}: "
                "use a new id",
            )
        if b is None:
            now = time.monotonic()
            prio = ebf_priority(now, t.history) if t.history else float("inf")
            b = Batch(t, bid, size, now, list(t.history), prio)
            self._restore(b)
            t.batches[bid] = b
            self.rescale(t.pipeline, "announce")
        self._settle(b, scored)
        return b

    def _restore(self, b: Batch) -> None:
        """Give a newly announced ``b`` the results an earlier instance journaled for it
        (:mod:`.journal`): they count toward its size, and a resubmission of one of their ids
        is answered from them (with the same payload only).

        Raises:
            ServiceError: 409 when the journal holds more results for this batch id than the
                announced size (another batch under a reused id).
        """
        if self.journal is None:
            return
        done = self.journal.batch((b.task.tenant, b.task.name, b.id))
        if len(done) > b.size:
            raise ServiceError(
                409,
                f"batch {b.id!r} was scored before with {len(done)} requests, more than its "
                f"size {b.size}: use a new batch id",
            )
        for rid, (digest, result) in done.items():
            b.settled.add(rid)
            b.digests[rid] = bytes.fromhex(digest)
            b.results.append(dict(result))

    def _settle(self, b: Batch, scored) -> None:
        """Take ``(id, reward)`` pairs scored by an earlier instance as results of ``b`` (the
        reward clamped to the pipeline's range, status ``settled``): they count toward its
        size, and every reader of the batch (any trainer rank) gets them. An id already
        submitted here or settled is skipped (it is, or was, scored once here).

        Raises:
            ServiceError: 422 when they and the submitted requests exceed the size.
        """
        new: dict[str, float] = {}
        for rid, reward in scored:
            if rid not in b.digests and rid not in b.settled:
                new[rid] = reward
        if not new:
            return
        if b.accounted + len(new) > b.size:
            raise ServiceError(
                422,
                f"batch {b.id!r}: {len(new)} scored ids and {b.accounted} requests are more "
                f"than its size {b.size}",
            )
        kind = self.config.pipelines[b.task.pipeline].kind
        for rid, reward in new.items():
            b.settled.add(rid)
            b.results.append(
                {"id": rid, "reward": clamp_reward(kind, reward), "status": "settled",
                 "stage": "", "detail": "scored by an earlier instance of the service",
                 "stage_s": [], "latency_s": 0.0}
            )  # fmt: skip
        b.changed.set()
        b.changed = asyncio.Event()
        self._maybe_complete(b)

    async def close(self, tenant: str, task: str, batch: str) -> Batch:
        """No more requests: the batch's size becomes what was submitted (and settled)."""
        b = self.batch(tenant, task, batch)
        b.size = b.accounted
        self._maybe_complete(b)
        return b

    def validate(self, task: Task, payload: dict) -> None:
        """What the trainer set in ``payload`` (e.g. sandbox limits) is valid.

        Raises:
            ServiceError: 422 naming the problem.
        """
        pipe = self.config.pipelines[task.pipeline]
        try:
            validate_payload(pipe.kind, payload, {n: s.options for n, s in pipe.stages.items()})
        except ValueError as e:
            raise ServiceError(422, str(e)) from None

    def submit(self, tenant: str, task: str, batch: str, payload: dict, rid: str | None) -> str:
        """Queue one request; returns its id (``<batch>-<n>`` when ``rid`` is None)."""
        return self.submit_many(tenant, task, batch, [(payload, rid)])[0]

    def submit_many(
        self, tenant: str, task: str, batch: str, requests: list[tuple[dict, str | None]]
    ) -> list[str]:
        """Queue ``(payload, id)`` requests, all or nothing; returns their ids.

        Idempotent by id: an id the batch already holds (queued, running, done, or settled
        after a restart) with the same payload is a no-op, so a client may retry a submission
        whose answer it lost, and the request is scored once.

        Raises:
            ServiceError: 409 for an id already used with another payload, or more new
                requests than the batch has room for; 422 for a bad payload; 404 as named.
        """
        b = self.batch(tenant, task, batch)
        new: dict[str, tuple[dict, bytes]] = {}
        ids = []
        for payload, rid in requests:
            self.validate(b.task, payload)
            if rid is None:  # the service names it: always a new request
                rid = f"{batch}-{b.submitted + len(new)}"
                if rid in b.digests or rid in b.settled or rid in new:
                    raise ServiceError(409, f"request id {rid!r} already used in batch {batch!r}")
            ids.append(rid)
            digest = _digest(payload)
            if rid in b.settled:  # scored before a restart: by the client's word or journaled
                if b.digests.get(rid, digest) != digest:
                    raise ServiceError(
                        409,
                        f"request id {rid!r} was scored in batch {batch!r} with another "
                        "payload: give each request its own id",
                    )
                continue
            old = b.digests.get(rid, new.get(rid, (None, None))[1])
            if old is None:
                new[rid] = (payload, digest)
            elif old != digest:
                raise ServiceError(
                    409,
                    f"request id {rid!r} already used in batch {batch!r} with another "
                    "payload: give each request its own id",
                )
        if b.accounted + len(new) > b.size:
            raise ServiceError(
                409,
                f"batch {batch!r} already holds its {b.size} announced "
                "requests: announce a larger size or a new batch",
            )
        for rid, (payload, digest) in new.items():
            now = time.monotonic()
            req = Req(rid, b, payload, now, since=now)
            b.submitted += 1
            b.digests[rid] = digest
            b.live[rid] = req
            self._enqueue(req)
        return ids

    def _enqueue(self, req: Req) -> None:
        pool = self.pools[req.batch.task.pipeline][req.stage]
        req.since, req.running = time.monotonic(), False
        heapq.heappush(pool.queue, (req.batch.prio, req.since, next(pool.seq), req))
        self._dispatch(pool)

    def _dispatch(self, pool: Pool) -> None:
        while pool.idle and pool.queue:
            *_, req = heapq.heappop(pool.queue)
            proc = pool.idle.pop()
            pool.account()
            pool.busy.add(proc)
            req.running, req.since = True, time.monotonic()
            self._spawn(self._run(pool, proc, req))

    def _stop(self, proc: Proc) -> None:
        """Kill ``proc`` now; wait for it and remove its scratch directory in the background."""
        proc.kill()
        self._stopping.add(proc)
        self._spawn(self._reap(proc))

    async def _reap(self, proc: Proc) -> None:
        try:
            await proc.stop()
        finally:
            self._stopping.discard(proc)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _run(self, pool: Pool, proc: Proc, req: Req) -> None:
        pipe = self.config.pipelines[req.batch.task.pipeline]
        t0 = time.monotonic()
        status, out, healthy = "ok", None, True
        try:
            out = await asyncio.wait_for(proc.call(req.payload, req.carry), pool.timeout_s)
        except TimeoutError:
            status, healthy = "timeout", False
        except Exception as e:  # the worker died under the request
            status, healthy, out = "error", False, {"detail": f"worker failed: {e}"}
        dt = time.monotonic() - t0
        req.stage_s.append(min(dt, pool.timeout_s))
        pool.account()
        pool.busy.discard(proc)
        pool.busy_s += dt
        if not healthy:
            self._stop(proc)
            self._ensure(pool)
        elif proc.retire or self.closing:  # scaled down while it was busy
            self._stop(proc)
        else:
            pool.idle.append(proc)
        stages = list(pipe.stages)
        if status == "ok" and out.get("ok") and req.stage + 1 < len(stages):
            req.carry = out.get("carry") or {}
            req.stage += 1
            self._enqueue(req)
        elif status == "ok" and out.get("ok"):
            reward = clamp_reward(pipe.kind, out.get("reward"))
            self._finish(req, reward, "ok", out.get("detail", ""))
        else:
            detail = (
                (out or {}).get("detail", "")
                if status != "timeout"
                else (f"stage {pool.stage!r} passed its {pool.timeout_s:g} s timeout")
            )
            self._finish(req, pipe.penalty, "failed" if status == "ok" else status, detail)
        self._dispatch(pool)

    def _finish(self, req: Req, reward: float, status: str, detail: str) -> None:
        b = req.batch
        stages = list(self.config.pipelines[b.task.pipeline].stages)
        del b.live[req.id]
        result = {
            "id": req.id,
            "reward": reward,
            "status": status,
            "stage": stages[req.stage],
            "detail": str(detail)[:500],
            "stage_s": req.stage_s,
            "latency_s": time.monotonic() - req.arrival,
        }
        if self.journal is not None:  # before anyone can read it (module .journal)
            self.journal.append((b.task.tenant, b.task.name, b.id), b.digests[req.id], result)
        b.results.append(result)
        b.records.append(RequestRecord(req.arrival - b.start, tuple(req.stage_s), status != "ok"))
        self.requests_done += 1
        b.changed.set()
        b.changed = asyncio.Event()
        self._maybe_complete(b)

    def _maybe_complete(self, b: Batch) -> None:
        if b.done or b.accounted < b.size or b.live:
            return
        b.completed_at = time.monotonic()
        if b.records:
            b.task.history = list(b.records)
        b.changed.set()
        self.rescale(b.task.pipeline, "complete")

    # ---- scaling -----------------------------------------------------------------------
    def _active(self, pipeline: str) -> list[Batch]:
        return [
            b
            for t in self.tasks.values()
            if t.pipeline == pipeline
            for b in t.batches.values()
            if not b.done
        ]

    def _floor(self, pool: Pool) -> int:
        pipe = next(n for n, ps in self.pools.items() if pool in ps)
        cfg = list(self.config.pipelines[pipe].stages.values())[pool.index]
        return max(cfg.min_workers, 1 if self._active(pipe) else 0)

    def rescale(self, pipeline: str, why: str) -> None:
        """Schedule a decision of the worker counts of ``pipeline``'s stages (Algorithm 2 +
        1); returns at once. The floor (>= 1 worker per stage while a batch is active) is
        applied now. One decision runs at a time per pipeline; a call while one runs is
        coalesced into a single follow-up decision on the newer state."""
        for pool in self.pools[pipeline]:
            if pool.target < self._floor(pool):
                pool.target = self._floor(pool)
                self._ensure(pool)
        if pipeline in self._deciding:
            self._deciding[pipeline] = why
            return
        self._deciding[pipeline] = None
        self._spawn(self._decide_until_current(pipeline, why))

    async def _decide_until_current(self, pipeline: str, why: str | None) -> None:
        try:
            while why is not None and not self.closing:
                await self._decide(pipeline, why)
                why, self._deciding[pipeline] = self._deciding[pipeline], None
        finally:
            del self._deciding[pipeline]

    async def _decide(self, pipeline: str, why: str) -> None:
        pools = self.pools[pipeline]
        cfgs = list(self.config.pipelines[pipeline].stages.values())
        active = self._active(pipeline)
        now = time.monotonic()
        policy = self.policies[pipeline]
        if policy is None:
            counts, secs, probes = [c.max_workers if active else 0 for c in cfgs], 0.0, 0
        else:
            views = [self._view(b, now) for b in active]  # a snapshot, taken on the loop
            dec = await asyncio.to_thread(policy.decide, views, now)
            counts, secs, probes = dec.workers, dec.seconds, dec.probes
        if self.closing:
            return
        for pool, c, cfg in zip(pools, counts, cfgs):
            pool.target = min(max(c, self._floor(pool)), cfg.max_workers)
            self._ensure(pool)
        self.n_decisions += 1
        self.decision_s_max = max(self.decision_s_max, secs)
        self.decisions.append(
            {
                "t_s": now - self.t0,
                "pipeline": pipeline,
                "why": why,
                "batches": len(active),
                "workers": [p.target for p in pools],
                "seconds": secs,
                "probes": probes,
            }
        )

    def _view(self, b: Batch, now: float) -> BatchView:
        queued, running = [], []
        for i, r in enumerate(b.live.values()):
            if r.running:
                running.append((r.stage, now - r.since, i))
            else:
                queued.append((r.stage, i, r.since))
        arrived = b.accounted  # settled requests will not come: not Future, not overdue
        return BatchView(
            (b.task.name, b.id),
            b.start,
            b.size,
            b.history,
            b.task.delay_bound_s,
            arrived,
            queued,
            running,
        )

    def _ensure(self, pool: Pool) -> None:
        """Move the pool towards its target: start or stop processes."""
        if self.closing:
            return
        pool.account()
        while pool.alive < pool.target:
            retiring = next((p for p in pool.busy if p.retire), None)
            if retiring is not None:
                retiring.retire = False
                continue
            pool.starting += 1
            self._spawn(self._start(pool))
        while pool.alive > pool.target and pool.idle:
            self._stop(pool.idle.pop())
        for p in pool.busy:
            if pool.alive <= pool.target:
                break
            if not p.retire:
                p.retire = True
        pool.timeline.append((time.monotonic() - self.t0, pool.target))

    async def _start(self, pool: Pool) -> None:
        try:
            proc = await Proc.start(
                pool.kind, pool.stage, pool.options, self.scratch.worker_dir(), pool.memory_bytes
            )
        except Exception:
            pool.account()
            pool.starting -= 1
            await asyncio.sleep(1.0)
            self._ensure(pool)  # try again; queued requests must not wait forever
            return
        pool.account()
        pool.starting -= 1
        if self.closing or pool.alive >= pool.target:  # scaled down while starting
            await proc.stop()
        else:
            pool.idle.append(proc)
            self._dispatch(pool)

    async def shutdown(self) -> None:
        """Stop every worker (and so every sandbox), wait for them, remove the scratch root."""
        self.closing = True
        procs = []
        for pools in self.pools.values():
            for pool in pools:
                pool.target = 0
                procs += [*pool.idle, *pool.busy]
                pool.idle.clear()
        procs += list(self._stopping)  # their reaping tasks are cancelled below
        for p in procs:
            p.kill()
        others = [t for t in self._bg if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        await asyncio.to_thread(self.scratch.close)
        if self.journal is not None:
            self.journal.close()

    # ---- views -------------------------------------------------------------------------
    def status(self, b: Batch) -> dict:
        pools = self.pools[b.task.pipeline]
        per_stage = {
            p.stage: {
                "queued": sum(1 for r in b.live.values() if r.stage == p.index and not r.running),
                "running": sum(1 for r in b.live.values() if r.stage == p.index and r.running),
            }
            for p in pools
        }
        rewards = [r["reward"] for r in b.results]
        return {
            "task": b.task.name,
            "batch": b.id,
            "size": b.size,
            "submitted": b.submitted,
            "settled": len(b.settled),
            "done": len(b.results),
            "complete": b.done,
            "stages": per_stage,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "failed": sum(r["status"] not in ("ok", "settled") for r in b.results),
            "elapsed_s": (b.completed_at or time.monotonic()) - b.start,
        }

    def metrics(self, tenant: str | None = None) -> dict:
        """Pool-level numbers (shared by all tenants) and ``tenant``'s own tasks only
        (``None``: every task, for the operator in-process; the HTTP API always passes the
        caller)."""
        pools = {}
        for name, ps in self.pools.items():
            for p in ps:
                p.account()
                pools[f"{name}.{p.stage}"] = {
                    "target": p.target,
                    "alive": p.alive,
                    "idle": len(p.idle),
                    "busy": len(p.busy),
                    "starting": p.starting,
                    "queued": len(p.queue),
                    "worker_s": p.worker_s,
                    "busy_s": p.busy_s,
                }
        return {
            "instance": self.instance,
            "uptime_s": time.monotonic() - self.t0,
            "requests_done": self.requests_done,
            "pools": pools,
            "decisions": self.n_decisions,
            "decision_s_max": self.decision_s_max,
            "last_decisions": list(self.decisions)[-10:],
            "tasks": {
                t.name: {"tenant": t.tenant, "batches": len(t.batches)}
                for t in self.tasks.values()
                if tenant is None or t.tenant == tenant
            },
        }
