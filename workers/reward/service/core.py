"""The reward service engine: tasks, batches, EBF stage queues, elastic worker pools.

One asyncio loop owns all state. Each pipeline stage has a pool of worker processes
(:mod:`.worker`, one request at a time each) and a priority queue ordered Earliest-Batch-First
(DistRS section 5.3: the batch's estimated earliest completion ``T`` from its task's previous
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
request ends. While a batch of a pipeline is active, each of its stages keeps >= 1 worker.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

from m2flow.scheduler.reward_scaling import BatchView, DistRSPolicy
from m2flow.scheduler.reward_sim import RequestRecord, ebf_priority

from .schemas import PipelineConfig, ServiceConfig


class ServiceError(Exception):
    """A client mistake: ``status`` is the HTTP status, the message says what to fix."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Req:
    id: str
    batch: Batch
    payload: dict
    arrival: float
    stage: int = 0
    since: float = 0.0
    running: bool = False
    carry: dict = field(default_factory=dict)
    stage_s: list[float] = field(default_factory=list)


@dataclass
class Batch:
    task: Task
    id: str
    size: int
    start: float
    history: list[RequestRecord]
    prio: float
    submitted: int = 0
    results: list[dict] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    live: dict[str, Req] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    completed_at: float | None = None

    @property
    def done(self) -> bool:
        return self.completed_at is not None


@dataclass
class Task:
    name: str
    tenant: str
    pipeline: str
    delay_bound_s: float
    history: list[RequestRecord] = field(default_factory=list)
    batches: dict[str, Batch] = field(default_factory=dict)


class Proc:
    """One worker process (its own process group, so a kill takes its sandbox children)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.retire = False

    @classmethod
    async def start(cls, kind: str, stage: str, options: dict) -> Proc:
        mod = "m2flow.workers.reward.service.worker"
        p = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            mod,
            kind,
            stage,
            json.dumps(options),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self = cls(p)
        line = await p.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            self.kill()
            raise RuntimeError(f"worker for {kind}.{stage} failed to start")
        return self

    async def call(self, payload: dict, carry: dict) -> dict:
        self.proc.stdin.write((json.dumps({"payload": payload, "carry": carry}) + "\n").encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (code {self.proc.returncode})")
        return json.loads(line)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Pool:
    """The elastic worker pool and EBF queue of one pipeline stage."""

    def __init__(self, kind: str, stage: str, index: int, timeout_s: float, options: dict):
        self.kind, self.stage, self.index = kind, stage, index
        self.timeout_s, self.options = timeout_s, options
        self.idle: list[Proc] = []
        self.busy: set[Proc] = set()
        self.starting = 0
        self.target = 0
        self.queue: list = []
        self.seq = itertools.count()
        self.worker_s = 0.0
        self.busy_s = 0.0
        self._t = time.monotonic()
        self.timeline: list[tuple[float, int]] = []

    @property
    def alive(self) -> int:
        return len(self.idle) + len([p for p in self.busy if not p.retire]) + self.starting

    def account(self) -> None:
        now = time.monotonic()
        self.worker_s += (len(self.idle) + len(self.busy) + self.starting) * (now - self._t)
        self._t = now


class RewardService:
    """The engine behind the HTTP app. All methods run on one asyncio loop."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.tokens = {t.token: name for name, t in config.tenants.items()}
        self.tasks: dict[str, Task] = {}
        self.pools: dict[str, list[Pool]] = {}
        for name, p in config.pipelines.items():
            self.pools[name] = [
                Pool(p.kind, s, i, c.timeout_s, c.options)
                for i, (s, c) in enumerate(p.stages.items())
            ]
        self.policies = {n: self._policy(p) for n, p in config.pipelines.items()}
        self.decisions: list[dict] = []
        self.t0 = time.monotonic()
        self.requests_done = 0
        self._bg: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()

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
    async def announce(self, tenant: str, task: str, size: int, batch: str | None) -> Batch:
        t = self.task(tenant, task)
        bid = batch or uuid.uuid4().hex[:12]
        if bid in t.batches:
            raise ServiceError(409, f"batch {bid!r} of task {task!r} exists: use a new id")
        now = time.monotonic()
        prio = ebf_priority(now, t.history) if t.history else float("inf")
        b = Batch(t, bid, size, now, list(t.history), prio)
        t.batches[bid] = b
        await self.rescale(t.pipeline, "announce")
        return b

    async def close(self, tenant: str, task: str, batch: str) -> Batch:
        """No more requests: the batch's size becomes what was submitted."""
        b = self.batch(tenant, task, batch)
        b.size = b.submitted
        self._maybe_complete(b)
        return b

    def submit(self, tenant: str, task: str, batch: str, payload: dict, rid: str | None) -> str:
        b = self.batch(tenant, task, batch)
        if b.submitted >= b.size:
            raise ServiceError(
                409,
                f"batch {batch!r} already holds its {b.size} announced "
                "requests: announce a larger size or a new batch",
            )
        rid = rid or f"{batch}-{b.submitted}"
        if rid in b.live or any(r["id"] == rid for r in b.results):
            raise ServiceError(409, f"request id {rid!r} already used in batch {batch!r}")
        now = time.monotonic()
        req = Req(rid, b, payload, now, since=now)
        b.submitted += 1
        b.live[rid] = req
        self._enqueue(req)
        return rid

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
            proc.kill()
            self._ensure(pool)
        elif proc.retire:  # scaled down while it was busy
            proc.kill()
        else:
            pool.idle.append(proc)
        stages = list(pipe.stages)
        if status == "ok" and out.get("ok") and req.stage + 1 < len(stages):
            req.carry = out.get("carry") or {}
            req.stage += 1
            self._enqueue(req)
        elif status == "ok" and out.get("ok"):
            self._finish(req, float(out.get("reward") or 0.0), "ok", out.get("detail", ""))
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
        b.results.append(
            {
                "id": req.id,
                "reward": reward,
                "status": status,
                "stage": stages[req.stage],
                "detail": str(detail)[:500],
                "stage_s": req.stage_s,
                "latency_s": time.monotonic() - req.arrival,
            }
        )
        b.records.append(RequestRecord(req.arrival - b.start, tuple(req.stage_s), status != "ok"))
        self.requests_done += 1
        b.changed.set()
        b.changed = asyncio.Event()
        self._maybe_complete(b)

    def _maybe_complete(self, b: Batch) -> None:
        if b.done or b.submitted < b.size or b.live:
            return
        b.completed_at = time.monotonic()
        if b.records:
            b.task.history = list(b.records)
        b.changed.set()
        self._spawn(self.rescale(b.task.pipeline, "complete"))

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

    async def rescale(self, pipeline: str, why: str) -> None:
        """Decide and apply the worker counts of ``pipeline``'s stages (Algorithm 2 + 1)."""
        async with self._lock:
            pools = self.pools[pipeline]
            cfgs = list(self.config.pipelines[pipeline].stages.values())
            active = self._active(pipeline)
            now = time.monotonic()
            policy = self.policies[pipeline]
            if policy is None:
                counts, secs, probes = [c.max_workers if active else 0 for c in cfgs], 0.0, 0
            else:
                views = [self._view(b, now) for b in active]
                dec = await asyncio.to_thread(policy.decide, views, now)
                counts, secs, probes = dec.workers, dec.seconds, dec.probes
            for pool, c, cfg in zip(pools, counts, cfgs):
                pool.target = min(max(c, self._floor(pool)), cfg.max_workers)
                self._ensure(pool)
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
        arrived = b.submitted
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
        pool.account()
        while pool.alive < pool.target:
            retiring = next((p for p in pool.busy if p.retire), None)
            if retiring is not None:
                retiring.retire = False
                continue
            pool.starting += 1
            self._spawn(self._start(pool))
        while pool.alive > pool.target and pool.idle:
            pool.idle.pop().kill()
        for p in pool.busy:
            if pool.alive <= pool.target:
                break
            if not p.retire:
                p.retire = True
        pool.timeline.append((time.monotonic() - self.t0, pool.target))

    async def _start(self, pool: Pool) -> None:
        try:
            proc = await Proc.start(pool.kind, pool.stage, pool.options)
        except Exception:
            pool.account()
            pool.starting -= 1
            await asyncio.sleep(1.0)
            self._ensure(pool)  # try again; queued requests must not wait forever
            return
        pool.account()
        pool.starting -= 1
        if pool.alive >= pool.target:  # scaled down while starting
            proc.kill()
        else:
            pool.idle.append(proc)
            self._dispatch(pool)

    async def shutdown(self) -> None:
        for pools in self.pools.values():
            for pool in pools:
                pool.target = 0
                for p in [*pool.idle, *pool.busy]:
                    p.kill()
                pool.idle.clear()
        for t in list(self._bg):
            t.cancel()

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
            "done": len(b.results),
            "complete": b.done,
            "stages": per_stage,
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "failed": sum(r["status"] != "ok" for r in b.results),
            "elapsed_s": (b.completed_at or time.monotonic()) - b.start,
        }

    def metrics(self) -> dict:
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
        secs = [d["seconds"] for d in self.decisions]
        return {
            "uptime_s": time.monotonic() - self.t0,
            "requests_done": self.requests_done,
            "pools": pools,
            "decisions": len(self.decisions),
            "decision_s_max": max(secs, default=0.0),
            "last_decisions": self.decisions[-10:],
            "tasks": {
                t.name: {"tenant": t.tenant, "batches": len(t.batches)} for t in self.tasks.values()
            },
        }
