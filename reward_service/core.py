"""The reward service engine: tasks, batches, EBF stage queues, elastic worker pools.

One asyncio loop owns all state. Each pipeline stage has a pool of worker processes (:mod:`.worker`,
one request at a time each) and a priority queue ordered Earliest-Batch-First (DistRS section 5.2:
the batch's estimated earliest completion ``T`` from its task's previous batch, section 5.1's Eq.
1-2; FCFS within a batch; batches without history last). A request runs the stages in order; a stage
that fails, or passes its timeout (the worker process group is killed), ends the request with the
pipeline's penalty reward and skips the later stages. Every request ends with exactly one result:
nothing is dropped or left pending (a crashed worker gives an ``error`` result with the penalty).

Scaling (DistRS section 5.2): at each batch announcement and completion the policy
(:class:`~m2flow.scheduler.reward.scaling.DistRSPolicy`, Algorithm 2 + 1) sets the worker count
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
(docs/results/reward_service.md, "Streaming, retries and restarts").

Tool calls (``POST /v1/tools/run``) run on the pools of ``tool`` pipelines, with the same
sandboxes and per-tenant limits (:mod:`.tools`).

Trust (docs/concepts/design.md, "Reward service trust model"): rewards are clamped to the pipeline
kind's documented range; a request's sandbox limits are validated when it is submitted (only
tighter than the service's); a tenant sees only its own tasks, in every view.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import time
import uuid

from m2flow.scheduler.reward.sim import RequestRecord, ebf_priority

from m2flow.core.config import ConfigError

from .budget import QueueBudget, payload_bytes
from .journal import ResultJournal
from .pipelines import clamp_reward, validate_payload
from .pools import Pool, Proc, ScratchRoot
from .safejson import clean, clean_text
from .scaling import Scaling
from .schemas import ServiceConfig
from .state import Batch, Req, ServiceError, Task, _digest
from .tools import ToolRuns
from .views import batch_status, service_metrics

__all__ = ["Batch", "Req", "RewardService", "ServiceError", "Task"]


class RewardService(Scaling, ToolRuns):
    """The engine behind the HTTP app. All methods run on one asyncio loop.

    Raises:
        ConfigError: ``scratch_dir`` or ``state_dir`` is not a usable directory.
        RuntimeError: another service instance holds ``state_dir``.
    """

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.tokens = {t.token: name for name, t in config.tenants.items()}
        #: (tenant, task name) -> task: each tenant names its own tasks
        self.tasks: dict[tuple[str, str], Task] = {}
        self.pools: dict[str, list[Pool]] = {}
        for name, p in config.pipelines.items():
            self.pools[name] = [
                Pool(p.kind, s, i, c.timeout_s, c.options, c.memory_bytes)
                for i, (s, c) in enumerate(p.stages.items())
            ]
        self.policies = {n: self._policy(p) for n, p in config.pipelines.items()}
        self.budget = QueueBudget(config.max_queued_bytes, config.max_queued_bytes_per_tenant)
        self.journal = _usable("state_dir", config.state_dir, ResultJournal)
        try:
            self.scratch = _usable("scratch_dir", config.scratch_dir, ScratchRoot)
        except ConfigError:
            if self.journal is not None:
                self.journal.close()
            raise
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
        self._init_tools()

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
        if self.config.pipelines[pipeline].kind == "tool":
            raise ServiceError(
                422, f"pipeline {pipeline!r} runs tools, not rewards: use POST /v1/tools/run"
            )
        old = self.tasks.get((tenant, task))
        if old is not None:  # idempotent (its pipeline and D stay those first registered)
            return old
        d = self.config.default_delay_bound_s if delay_bound_s is None else delay_bound_s
        self.tasks[(tenant, task)] = Task(task, tenant, pipeline, d)
        return self.tasks[(tenant, task)]

    def task(self, tenant: str, name: str) -> Task:
        t = self.tasks.get((tenant, name))
        if t is None:
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
            shown = size if size < 10**18 else "over 10**18"
            raise ServiceError(
                422,
                f"batch size {shown} is over the service's max_batch_size "
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
            b.results.append(clean(result))  # journaled by an older service, maybe unclean

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
        self,
        tenant: str,
        task: str,
        batch: str,
        requests: list[tuple[dict, str | None]],
        sizes: list[int] | None = None,
    ) -> list[str]:
        """Queue ``(payload, id)`` requests, all or nothing; returns their ids.

        Idempotent by id: an id the batch already holds (queued, running, done, or settled
        after a restart) with the same payload is a no-op, so a client may retry a submission
        whose answer it lost, and the request is scored once. ``sizes``: what each payload
        holds in memory (:func:`.budget.payload_bytes`; measured here when None, the HTTP
        app measures off the event loop); the new requests' bytes are held from the tenant's
        and the service's queue budget until their results.

        Raises:
            ServiceError: 409 for an id already used with another payload, or more new
                requests than the batch has room for; 422 for a bad payload (NaN or an
                infinity, nested too deep); 413/429 for a call over the queued-bytes caps
                (:class:`.budget.QueueBudget`); 404 as named.
        """
        b = self.batch(tenant, task, batch)
        if sizes is None:
            sizes = payload_sizes([p for p, _ in requests])
        new: dict[str, tuple[dict, bytes, int]] = {}
        ids = []
        for (payload, rid), size in zip(requests, sizes, strict=True):
            self.validate(b.task, payload)
            if rid is None:  # the service names it: always a new request
                rid = f"{batch}-{b.submitted + len(new)}"
                if rid in b.digests or rid in b.settled or rid in new:
                    raise ServiceError(409, f"request id {rid!r} already used in batch {batch!r}")
            ids.append(rid)
            try:
                digest = _digest(payload)
            except ValueError as e:
                raise ServiceError(422, str(e)) from None
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
                new[rid] = (payload, digest, size)
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
        self.budget.take(tenant, sum(size for *_, size in new.values()))
        for rid, (payload, digest, size) in new.items():
            now = time.monotonic()
            req = Req(rid, b, payload, now, since=now, bytes=size)
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
            run = self._run_tool if pool.kind == "tool" else self._run  # module .tools
            self._spawn(run(pool, proc, req))

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
        self.budget.give(b.task.tenant, req.bytes)
        result = {
            "id": req.id,
            "reward": reward,
            "status": status,
            "stage": stages[req.stage],
            # text from a sandbox may hold lone surrogates: stored escaped, so every read of
            # the batch (and the journal) encodes as UTF-8
            "detail": clean_text(str(detail)[:500]),
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

    # ---- views (module .views) ------------------------------------------------------------
    def status(self, b: Batch) -> dict:
        """The status of batch ``b`` (:func:`.views.batch_status`)."""
        return batch_status(self, b)

    def metrics(self, tenant: str | None = None) -> dict:
        """Pool-level numbers and ``tenant``'s own tasks (:func:`.views.service_metrics`)."""
        return service_metrics(self, tenant)


def payload_sizes(payloads: list[dict]) -> list[int]:
    """What each payload holds in memory (:func:`.budget.payload_bytes`).

    Raises:
        ServiceError: 422 for a payload nested too deep.
    """
    try:
        return [payload_bytes(p) for p in payloads]
    except ValueError as e:
        raise ServiceError(422, str(e)) from None


def _usable(key: str, path: str | None, make):
    """``make(path)`` (None for a ``path`` of None, where the key is optional).

    Raises:
        ConfigError: the directory is not usable (one line naming the key and the reason).
    """
    if path is None and key == "state_dir":
        return None
    try:
        return make(path)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise ConfigError(
            f"{key} {path!r} is not usable: {e.strerror or e}{where}: give a directory the "
            "service can create and write"
        ) from None
