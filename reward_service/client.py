"""Clients of the reward service (httpx): :class:`RewardClient` (sync) and
:class:`AsyncRewardClient` (asyncio), the same methods (the trainer side that streams a
rollout's responses and survives service restarts is :class:`.stream.RewardStream`).

Each method is written once, sans I/O (:class:`_Spec`): a generator that yields the
:class:`Call` s it needs and turns their answers into its result; the two clients only perform
the HTTP calls (with the same retry policy, :class:`_Retry`) and sleep their own way.

A trainer registers its task once, announces each rollout batch with its size as soon as the
rollout starts (the hint that lets the service scale before the first response is done), then
submits one request per finished response and collects the batch's rewards::

    with RewardClient("http://127.0.0.1:8765", token) as rc:
        rc.register("task-a", "code")
        batch = rc.announce("task-a", size=len(responses))
        for i, r in enumerate(responses):          # as each response finishes
            rc.submit("task-a", batch, {"code": r, "tests": tests[i]}, id=str(i))
        rewards = rc.rewards("task-a", batch, timeout_s=600)   # id -> reward

An agent's code tool runs in the service's sandboxes (a ``tool`` pipeline)::

    rc.run_tool("python", {"code": "print(2 ** 10)"}, timeout_s=5)["output"]  # "1024\n"

Every call is retried with backoff for up to ``retry_s`` seconds while the service is
unreachable (connection refused or reset, 500/502/503/504): a call that may not be repeated (a
submission without an id) only when it never reached the service. A 429 (the tenant's or the
service's queued requests are at their memory cap) is retried too, whatever the call: the
service refused it before doing anything. Announcements carry a batch
id (the client draws one when none is given) and the service takes a repeated id with the same
payload as a no-op, so retries never create a second batch or score a request twice. Every wait
has a timeout; :class:`RewardServiceError` carries the server's message.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import httpx

#: the header naming the service instance that answered (app.py: ``INSTANCE_HEADER``)
INSTANCE_HEADER = "x-reward-service-instance"
#: statuses worth retrying: the service (or a proxy before it) is restarting or overloaded
RETRY_STATUS = frozenset({500, 502, 503, 504})
#: refused before anything was done (queue full): retried even for a call not idempotent
RETRY_ALWAYS = frozenset({429})
#: transport errors after which the request surely never reached the service
_UNSENT = (httpx.ConnectError, httpx.ConnectTimeout)


class RewardServiceError(RuntimeError):
    """The service refused a call (``status``: HTTP status; 503: unreachable past the retry
    deadline) or a wait timed out (408). ``instance``: the service instance that answered."""

    def __init__(self, status: int, message: str, instance: str | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.instance = instance


def _decode(resp: httpx.Response) -> tuple[dict, str | None]:
    """The answer's JSON and the instance that gave it.

    Raises:
        RewardServiceError: for a 4xx/5xx answer.
    """
    inst = resp.headers.get(INSTANCE_HEADER)
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail")
        except ValueError:
            detail = resp.text
        raise RewardServiceError(resp.status_code, str(detail), inst)
    return resp.json(), inst


def _retry_after(
    error: Exception | None, resp: httpx.Response | None, idempotent: bool, delay: float, end: float
) -> bool:
    """Whether to try again after ``delay`` seconds (before the deadline ``end``)."""
    if time.monotonic() + delay > end:
        return False
    if error is not None:
        return idempotent or isinstance(error, _UNSENT)
    return resp.status_code in RETRY_ALWAYS or (idempotent and resp.status_code in RETRY_STATUS)


class _Retry:
    """The retry policy of one call: backoff from 50 ms, doubling up to 1 s, for ``retry_s``
    seconds from now."""

    def __init__(self, idempotent: bool, url, retry_s: float) -> None:
        self.idempotent, self.url, self.retry_s = idempotent, url, retry_s
        self.end, self.delay = time.monotonic() + retry_s, 0.05

    def settle(self, error: Exception | None, resp: httpx.Response | None):
        """One try's outcome: the answer's ``(json, instance)``, or ``None`` to try again
        after :meth:`wait` seconds.

        Raises:
            RewardServiceError: a 4xx/5xx answer not to retry, or still unreachable at the
                deadline.
        """
        if _retry_after(error, resp, self.idempotent, self.delay, self.end):
            return None
        if error is not None:
            raise _unreachable(self.url, error, self.retry_s) from error
        return _decode(resp)

    def wait(self) -> float:
        """Seconds to sleep before the next try (and backs off for the one after)."""
        delay, self.delay = self.delay, min(2 * self.delay, 1.0)
        return delay


def _unreachable(url, error: Exception, retry_s: float) -> RewardServiceError:
    return RewardServiceError(
        503, f"reward service at {url} unreachable for {retry_s:g} s: {error!r}"
    )


def _base(task: str, batch: str | None = None) -> str:
    return f"/v1/tasks/{task}" + (f"/batches/{batch}" if batch else "")


def _announce_body(size: int, batch: str | None, scored: dict[str, float] | None) -> dict:
    # The client names the batch, so a retried announcement cannot create a second one.
    body = {"size": size, "batch": batch or uuid.uuid4().hex[:12]}
    if scored:
        body["scored"] = [{"id": i, "reward": r} for i, r in scored.items()]
    return body


@dataclass(frozen=True)
class Call:
    """One HTTP call a method needs: ``kw`` goes to httpx's ``request`` (``json``, ``params``,
    ``timeout``); ``idempotent``: whether it may be repeated after it may have reached the
    service."""

    method: str
    path: str
    idempotent: bool = True
    kw: dict = field(default_factory=dict)


#: a method, sans I/O: yields calls, is sent each one's ``(json, instance)``, returns the result
Op = Generator[Call, tuple[dict, Any], Any]


class _Spec:
    """The client's methods, written once (``self``: the client, unused here)."""

    def register(self, task: str, pipeline: str, delay_bound_s: float | None = None) -> Op:
        """Register ``task`` with ``pipeline`` (idempotent); returns the service's answer."""
        body = {"task": task, "pipeline": pipeline, "delay_bound_s": delay_bound_s}
        return (yield Call("POST", "/v1/tasks", kw={"json": body}))[0]

    def announce(
        self, task: str, size: int, batch: str | None = None, scored: dict | None = None
    ) -> Op:
        """Announce a batch of ``size`` requests (idempotent by id); returns its id.
        ``scored``: ``id -> reward`` of its requests an earlier instance of the service scored
        (re-announcing after a restart)."""
        body = _announce_body(size, batch, scored)
        return (yield Call("POST", f"{_base(task)}/batches", kw={"json": body}))[0]["batch"]

    def submit(self, task: str, batch: str, payload: dict, id: str | None = None) -> Op:
        """Submit one request; returns its id. Without ``id`` it is retried only when it
        surely never reached the service."""
        body = {"payload": payload, "id": id}
        path = f"{_base(task, batch)}/requests"
        return (yield Call("POST", path, idempotent=id is not None, kw={"json": body}))[0]["id"]

    def submit_many(self, task: str, batch: str, requests: dict[str, dict]) -> Op:
        """Submit ``id -> payload`` in one call (all or nothing); returns the ids."""
        body = {"requests": [{"payload": p, "id": i} for i, p in requests.items()]}
        path = f"{_base(task, batch)}/requests:bulk"
        return (yield Call("POST", path, kw={"json": body}))[0]["ids"]

    def close_batch(self, task: str, batch: str) -> Op:
        """No more requests for ``batch`` (its size becomes what was submitted)."""
        return (yield Call("POST", f"{_base(task, batch)}/close"))[0]

    def status(self, task: str, batch: str) -> Op:
        """The batch's status (``GET /v1/tasks/{task}/batches/{batch}``)."""
        return (yield Call("GET", _base(task, batch)))[0]

    def metrics(self) -> Op:
        """The service's metrics (``GET /v1/metrics``)."""
        return (yield Call("GET", "/v1/metrics"))[0]

    def run_tool(
        self,
        tool: str,
        arguments: dict,
        timeout_s: float | None = None,
        pipeline: str | None = None,
        wait_s: float | None = None,
    ) -> Op:
        """Run ``tool`` (e.g. ``"python"``, ``{"code": ...}``) in the service's sandbox
        (``POST /v1/tools/run``); returns its answer ``{"tool", "ok", "status", "output",
        "error", "truncated", "seconds", "latency_s"}``: the code's failure (an exception,
        ``timeout_s`` passed, a limit) is ``ok: False`` with ``error``, not an exception.
        ``timeout_s``: the run's wall-clock limit (seconds; default the service's);
        ``wait_s``: how long to wait for the answer (default ``timeout_s`` (or 60) + 60 s,
        room for the queue and a worker's start). Not repeated once it may have reached
        the service (a 429, refused before running, is).

        Raises:
            RewardServiceError: 404 unknown tool (or no tool pipeline), 422 wrong arguments
                or ``timeout_s`` over the service's limit, 429/413 over a tenant limit past
                ``retry_s``, 503 the service unreachable or no answer within ``wait_s``.
        """
        body = {"tool": tool, "arguments": arguments, "timeout_s": timeout_s}
        if pipeline is not None:
            body["pipeline"] = pipeline
        wait = wait_s if wait_s is not None else (timeout_s or 60.0) + 60.0
        call = Call("POST", "/v1/tools/run", idempotent=False, kw={"json": body, "timeout": wait})
        return (yield call)[0]

    def results(self, task: str, batch: str, timeout_s: float = 600.0) -> Op:
        """All results of ``batch`` once it is complete (long-polls, 20 s a call).

        Raises:
            RewardServiceError: (408) not complete within ``timeout_s``.
        """
        out: list[dict] = []
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise RewardServiceError(408, f"batch {batch!r} not complete in {timeout_s} s")
            kw = {
                "params": {"offset": len(out), "wait_s": min(left, 20.0)},
                "timeout": min(left, 20.0) + 30.0,
            }
            page, _ = yield Call("GET", f"{_base(task, batch)}/results", kw=kw)
            out += page["results"]
            if page["complete"]:
                return out

    def rewards(self, task: str, batch: str, timeout_s: float = 600.0) -> Op:
        """``request id -> reward`` of the whole batch (waits up to ``timeout_s``)."""
        results = yield from _Spec.results(self, task, batch, timeout_s)
        return {r["id"]: r["reward"] for r in results}


def _sync(op: Callable[..., Op]):
    """``op`` as a method of :class:`RewardClient`: each call it yields is performed."""

    @functools.wraps(op)
    def method(self, *args, **kw):
        gen, answer = op(self, *args, **kw), None
        try:
            while True:
                c = gen.send(answer)
                answer = self.call(c.method, c.path, c.idempotent, **c.kw)
        except StopIteration as stop:
            return stop.value

    return method


def _async(op: Callable[..., Op]):
    """``op`` as a coroutine method of :class:`AsyncRewardClient`."""

    @functools.wraps(op)
    async def method(self, *args, **kw):
        gen, answer = op(self, *args, **kw), None
        try:
            while True:
                c = gen.send(answer)
                answer = await self.call(c.method, c.path, c.idempotent, **c.kw)
        except StopIteration as stop:
            return stop.value

    return method


class RewardClient:
    """Synchronous client. ``timeout_s``: per HTTP call (seconds); ``retry_s``: how long a
    call keeps retrying while the service is unreachable (seconds)."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0, retry_s: float = 30.0):
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )
        self.retry_s = retry_s

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, idempotent: bool = True, **kw):
        """One HTTP call with retries; returns ``(json, instance)``.

        Raises:
            RewardServiceError: the service refused it, or stayed unreachable ``retry_s``.
        """
        retry = _Retry(idempotent, self.http.base_url, self.retry_s)
        while True:
            error = resp = None
            try:
                resp = self.http.request(method, path, **kw)
            except httpx.TransportError as e:
                error = e
            out = retry.settle(error, resp)
            if out is not None:
                return out
            time.sleep(retry.wait())

    register = _sync(_Spec.register)
    announce = _sync(_Spec.announce)
    submit = _sync(_Spec.submit)
    submit_many = _sync(_Spec.submit_many)
    close_batch = _sync(_Spec.close_batch)
    status = _sync(_Spec.status)
    metrics = _sync(_Spec.metrics)
    run_tool = _sync(_Spec.run_tool)
    results = _sync(_Spec.results)
    rewards = _sync(_Spec.rewards)


class AsyncRewardClient:
    """Asyncio client; same methods as :class:`RewardClient`, awaitable."""

    def __init__(self, url: str, token: str, timeout_s: float = 30.0, retry_s: float = 30.0):
        self.http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )
        self.retry_s = retry_s

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.http.aclose()

    async def call(self, method: str, path: str, idempotent: bool = True, **kw):
        """One HTTP call with retries; returns ``(json, instance)`` (see RewardClient.call)."""
        retry = _Retry(idempotent, self.http.base_url, self.retry_s)
        while True:
            error = resp = None
            try:
                resp = await self.http.request(method, path, **kw)
            except httpx.TransportError as e:
                error = e
            out = retry.settle(error, resp)
            if out is not None:
                return out
            await asyncio.sleep(retry.wait())

    register = _async(_Spec.register)
    announce = _async(_Spec.announce)
    submit = _async(_Spec.submit)
    submit_many = _async(_Spec.submit_many)
    close_batch = _async(_Spec.close_batch)
    status = _async(_Spec.status)
    metrics = _async(_Spec.metrics)
    run_tool = _async(_Spec.run_tool)
    results = _async(_Spec.results)
    rewards = _async(_Spec.rewards)
