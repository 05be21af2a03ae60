"""The trainer side of request-in, batch-out (DistRS section 3.2): :class:`RewardStream`
submits responses as they finish into a batch announced at rollout start
(:meth:`RewardStream.announce`; else at its first submission), collects their rewards in the
background, and rides out service restarts (docs/results/reward_service.md, "Streaming,
retries and restarts")."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field

from .client import AsyncRewardClient, RewardServiceError, _announce_body, _base

log = logging.getLogger(__name__)


class _Restarted(Exception):
    """Another service instance answered: what was written must be redone on the current
    one. ``data``: the answer (results stay valid whichever instance scored them)."""

    def __init__(self, data: dict | None = None) -> None:
        super().__init__("reward service restarted")
        self.data = data


#: most restarts one operation rides out before it gives up
MAX_RESTARTS = 10


@dataclass(eq=False)
class _Batch:
    id: str
    size: int
    lock: asyncio.Lock
    pending: dict[str, dict] = field(default_factory=dict)  # own requests without a result
    results: dict[str, dict] = field(default_factory=dict)  # every result seen (all ranks)
    offset: int = 0  # results read from the current instance
    instance: str | None = None  # the instance it is announced on (None: not yet)
    waiters: list[tuple[set[str], asyncio.Future]] = field(default_factory=list)
    poller: asyncio.Task | None = None


class RewardStream:
    """The trainer side of request-in, batch-out (DistRS section 3.2) for one task, safe
    across service restarts. See docs/results/reward_service.md, "Streaming, retries and restarts".

    :meth:`submit` sends responses as they finish into a batch announced with its final size (DistRS
    section 4: the trainer's hint at rollout start; :meth:`announce` sends it before the first
    response) and returns at once a future of their rewards; a background poller collects the
    batch's results meanwhile. Several streams (trainer ranks) may share one batch: the announcement
    is idempotent, each collects its own ids.

    Restarts: every answer names the service instance that gave it. When another instance
    answers (or a 404 comes from one), the stream re-registers the task, re-announces each
    batch it follows with the results it has seen, its own and other ranks' (``scored``: the
    new instance keeps them as results of the batch, status ``settled``, so they count toward
    its size and every rank can read them), and resubmits its requests without a result.
    Resubmission is idempotent by id, so a request is scored once per instance; only results
    that the old instance produced and no rank read are scored again.

    Thread-safe: the work runs on the stream's own asyncio loop (a daemon thread).

    Args:
        url, token: the service and this tenant's bearer token.
        task, pipeline, delay_bound_s: the task to register (``D`` in seconds, or the
            service's default).
        timeout_s: longest wait for one submission's rewards (seconds).
        retry_s: how long a call retries while the service is unreachable (seconds;
            default ``timeout_s``).
        poll_s: longest wait of one results long-poll (seconds); short, so that a service
            shutting down gracefully is not held up by it.
        max_bulk: most requests per submission call.

    Raises:
        RewardServiceError: the service refused the token or the task (at construction).
    """

    def __init__(
        self,
        url: str,
        token: str,
        task: str,
        pipeline: str,
        delay_bound_s: float | None = None,
        timeout_s: float = 600.0,
        retry_s: float | None = None,
        poll_s: float = 2.0,
        max_bulk: int = 256,
    ) -> None:
        self.task, self.timeout_s, self.poll_s, self.max_bulk = task, timeout_s, poll_s, max_bulk
        self._register_body = {"task": task, "pipeline": pipeline, "delay_bound_s": delay_bound_s}
        self.restarts = 0  # service restarts ridden out
        self._batches: dict[str, _Batch] = {}
        self._instance: str | None = None
        self._dead: set[str | None] = set()
        self._bg: set[asyncio.Task] = set()  # re-announcements after a restart
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="m2flow-reward-stream", daemon=True
        )
        self._thread.start()
        retry = timeout_s if retry_s is None else retry_s
        try:
            self._run(self._open(url, token, retry), retry + 60)
        except BaseException:
            self.close()
            raise

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _open(self, url: str, token: str, retry_s: float) -> None:
        self.client = AsyncRewardClient(url, token, retry_s=retry_s)
        self._lock = asyncio.Lock()
        _, self._instance = await self.client.call("POST", "/v1/tasks", json=self._register_body)

    # -- thread-side API -------------------------------------------------------------------

    def submit(self, batch: str, size: int, requests: dict[str, dict]) -> concurrent.futures.Future:
        """Submit ``id -> payload`` into ``batch`` of ``size`` requests (announced on first
        use); returns at once a future of ``id -> reward`` for these ids. The future raises
        :class:`RewardServiceError` (408 after ``timeout_s``; 409/422 for a refused batch or
        request; 503 when the service stays unreachable ``retry_s``)."""
        return asyncio.run_coroutine_threadsafe(
            self._submit(batch, size, dict(requests)), self._loop
        )

    def announce(self, batch: str, size: int) -> concurrent.futures.Future:
        """Announce ``batch`` of ``size`` requests now, before any of them is submitted (DistRS
        section 4, the proxy: the start of a rollout batch is the trainer's hint, so that the
        service scales for it ahead of its first request); returns a future that is done when
        the service has it (it raises :class:`RewardServiceError`). Idempotent: a later
        :meth:`submit` into the same batch and size does not announce it again (on the same
        service instance).

        Raises:
            ValueError: (from the future) ``batch`` is followed with another size.
        """
        return asyncio.run_coroutine_threadsafe(self._announce(batch, size), self._loop)

    def forget(self, batch: str) -> None:
        """Stop following ``batch`` (this rank's part of it is done)."""
        self._loop.call_soon_threadsafe(self._forget, batch)

    def close_batch(self, batch: str) -> concurrent.futures.Future:
        """Tell the service that ``batch`` gets no more requests (its size becomes what
        arrived), so that it does not stay active (holding workers) for requests that will
        never come: a step that failed, or fewer responses than announced. Returns a future
        of the batch's status (it raises :class:`RewardServiceError`, 404 where the current
        instance does not hold the batch)."""
        path = f"{_base(self.task, batch)}/close"
        return asyncio.run_coroutine_threadsafe(self._close_batch(path), self._loop)

    async def _close_batch(self, path: str) -> dict:
        return (await self.client.call("POST", path))[0]

    def close(self) -> None:
        """Stop the loop and close the HTTP client (pending futures are cancelled)."""
        if not self._loop.is_running():
            return
        if hasattr(self, "client"):
            try:
                self._run(self._shutdown(), 30)
            except Exception:  # closing anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    # -- loop side -------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        for b in list(self._batches):
            self._forget(b)
        await self.client.close()

    def _forget(self, batch: str) -> None:
        b = self._batches.pop(batch, None)
        if b is None:
            return
        if b.poller is not None:
            b.poller.cancel()
        for _, f in b.waiters:  # nobody collects them any more
            f.cancel()

    def _batch(self, batch: str, size: int) -> _Batch:
        """The batch followed under ``batch`` (new if none is)."""
        b = self._batches.get(batch)
        if b is None:
            b = self._batches[batch] = _Batch(batch, size, asyncio.Lock())
        elif b.size != size:
            raise ValueError(f"batch {batch!r} has size {b.size}, not {size}")
        return b

    async def _announce(self, batch: str, size: int) -> None:
        await self._ensure(self._batch(batch, size))  # once per instance (nothing pending yet)

    async def _submit(self, batch: str, size: int, requests: dict[str, dict]) -> dict:
        b = self._batch(batch, size)
        fresh = [i for i in requests if i not in b.results]
        b.pending.update((i, requests[i]) for i in fresh)
        waiter = (set(requests), self._loop.create_future())
        b.waiters.append(waiter)
        done = False
        try:
            got = await asyncio.wait_for(self._send_and_wait(b, fresh, waiter[1]), self.timeout_s)
            done = True
            return got
        except TimeoutError:
            raise RewardServiceError(
                408, f"rewards of {len(requests)} requests of batch {batch!r} not in "
                f"{self.timeout_s:g} s"
            ) from None  # fmt: skip
        finally:
            b.waiters.remove(waiter)
            if not done:  # given up: not to be resubmitted after a restart
                for i in fresh:
                    b.pending.pop(i, None)

    async def _send_and_wait(self, b: _Batch, ids: list[str], fut: asyncio.Future) -> dict:
        for _ in range(MAX_RESTARTS):
            if await self._ensure(b):  # (re)announced: every pending request went with it
                break
            try:
                await self._post(b, ids, self._instance)
                break
            except _Restarted:
                continue
        else:
            raise RewardServiceError(503, f"the service restarted {MAX_RESTARTS} times")
        self._wake(b)
        if b.poller is None or b.poller.done():
            b.poller = self._loop.create_task(self._poll(b))
        return await fut

    async def _call(self, inst: str | None, method: str, path: str, **kw) -> dict:
        """``client.call`` expecting instance ``inst``; another instance answering starts the
        recovery and raises :class:`_Restarted`."""
        try:
            data, seen = await self.client.call(method, path, **kw)
        except RewardServiceError as e:
            if e.status != 404 or e.instance == inst:
                raise
            await self._recover(e.instance)
            raise _Restarted() from None
        if seen != inst:
            await self._recover(seen)
            raise _Restarted(data)
        return data

    async def _recover(self, seen: str | None) -> None:
        """Instance ``seen`` answered: if it is new, re-register the task and have every
        batch followed re-announced (with the ids seen scored) and its pending resubmitted."""
        async with self._lock:
            if seen == self._instance or seen in self._dead:
                return
            _, inst = await self.client.call("POST", "/v1/tasks", json=self._register_body)
            if inst == self._instance or inst in self._dead:  # no new instance after all
                return
            self._dead.add(self._instance)
            self._instance = inst
            self.restarts += 1
            for b in self._batches.values():
                b.offset = 0
                if b.poller is None or b.poller.done():  # nobody will touch it otherwise
                    task = self._loop.create_task(self._ensure_quietly(b))
                    self._bg.add(task)
                    task.add_done_callback(self._bg.discard)

    async def _ensure_quietly(self, b: _Batch) -> None:
        try:
            await self._ensure(b)
        except Exception as e:  # a later submission into the batch tries again and reports
            log.warning("re-announcing batch %r after a restart failed: %r", b.id, e)

    async def _ensure(self, b: _Batch) -> bool:
        """Announce ``b`` on the current instance and resubmit its pending requests there,
        once per instance. Returns whether it did so now."""
        async with b.lock:
            for _ in range(MAX_RESTARTS):
                inst = self._instance
                if b.instance == inst:
                    return False
                if len(b.results) >= b.size:  # complete: nothing to rebuild
                    b.instance = inst
                    return False
                try:
                    # the rewards seen, max_bulk per announcement (each one adds to them)
                    seen = [(i, float(r["reward"])) for i, r in b.results.items()]
                    for k in range(0, max(len(seen), 1), self.max_bulk):
                        part = dict(seen[k : k + self.max_bulk])
                        body = _announce_body(b.size, b.id, part)
                        await self._call(inst, "POST", f"{_base(self.task)}/batches", json=body)
                    await self._post(b, list(b.pending), inst)
                except _Restarted:
                    continue
                b.instance = inst
                return True
        raise RewardServiceError(503, f"the service restarted {MAX_RESTARTS} times")

    async def _post(self, b: _Batch, ids: list[str], inst: str | None) -> None:
        todo = [i for i in ids if i in b.pending]
        path = f"{_base(self.task, b.id)}/requests:bulk"
        for k in range(0, len(todo), self.max_bulk):
            reqs = [{"payload": b.pending[i], "id": i} for i in todo[k : k + self.max_bulk]]
            if reqs:
                await self._call(inst, "POST", path, json={"requests": reqs})

    async def _poll(self, b: _Batch) -> None:
        """Collect ``b``'s results while a submission waits for them."""
        try:
            while any(not f.done() for _, f in b.waiters):
                await self._ensure(b)
                inst = self._instance
                params = {"offset": b.offset, "wait_s": self.poll_s}
                path = f"{_base(self.task, b.id)}/results"
                try:
                    page = await self._call(inst, "GET", path, params=params,
                                            timeout=self.poll_s + 30)  # fmt: skip
                except _Restarted as r:
                    self._absorb(b, (r.data or {}).get("results", []))
                    continue
                self._absorb(b, page["results"])
                b.offset = page["next_offset"]
                if page["complete"] and not page["results"]:
                    await asyncio.sleep(self.poll_s / 10)  # no busy loop on a complete batch
        except asyncio.CancelledError:
            raise
        except Exception as e:
            for _, f in b.waiters:
                if not f.done():
                    f.set_exception(e)

    def _absorb(self, b: _Batch, results: list[dict]) -> None:
        for r in results:
            if r["id"] not in b.results:
                b.results[r["id"]] = r
                b.pending.pop(r["id"], None)
        self._wake(b)

    def _wake(self, b: _Batch) -> None:
        for ids, f in b.waiters:
            if not f.done() and all(i in b.results for i in ids):
                f.set_result({i: float(b.results[i]["reward"]) for i in ids})
