"""The HTTP API of the reward service (FastAPI). See docs/results/reward_service.md.

Every route except ``/healthz`` needs ``Authorization: Bearer <tenant token>`` (a request
without a known token is refused before its body is read: :class:`AuthGate`); a tenant sees
only its own tasks (metrics included), and names them itself (two tenants may use the same
task name). Errors are JSON ``{"detail": "..."}`` (one line) with a status naming the problem:
401 (no/unknown token), 404 (unknown task, batch, pipeline or tool), 408 (a body slower than
``body_timeout_s``), 409 (conflict: batch full, an id reused with another payload, a batch id
re-announced with another size), 413 (body over ``max_body_bytes``, or requests holding more
memory than ``max_queued_bytes_per_tenant``), 422 (malformed body: a field of the wrong type,
NaN or an infinity, nesting over 64 levels; a batch over ``max_batch_size``; sandbox limits
that are not positive numbers within the service's own; a tool's wrong arguments), 429 (the
tenant's or the service's queued requests are at their memory cap, or a tool call found no
worker in time; ``Retry-After``). Tool calls: ``GET /v1/tools``, ``POST /v1/tools/run``
(:mod:`.tools`). Every answer is JSON that UTF-8
encodes, whatever a sandbox or a request put in it (:mod:`.safejson`), and carries
:data:`INSTANCE_HEADER`.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, field_validator

from . import safejson
from .bodylimit import BodyLimit
from .connections import max_connections, uvicorn_config
from .core import RewardService, ServiceError, payload_sizes
from .schemas import (
    AnnounceBatch,
    RegisterTask,
    RunTool,
    ServiceConfig,
    SubmitMany,
    SubmitRequest,
    _utf8,
)
from .shares import Shares, bearer, shares
from .tools import TOOLS

#: longest a results long-poll may wait (seconds)
MAX_WAIT_S = 300.0
#: response header naming this run of the service (a client seeing another one knows that the
#: service restarted and lost its in-memory state)
INSTANCE_HEADER = "x-reward-service-instance"


class Scored(BaseModel):
    """A request an earlier instance of the service scored, and its reward (clamped here)."""

    id: str = Field(min_length=1, max_length=128)
    reward: float = Field(allow_inf_nan=False, strict=True)

    _id_utf8 = field_validator("id")(_utf8)


class Announce(AnnounceBatch):
    """An announcement; ``scored``: requests of this batch that an earlier instance of the
    service scored before it restarted (a client re-announcing after a restart; repeatable,
    so a long list may come in several announcements)."""

    scored: list[Scored] = Field(default_factory=list)


class Instance:
    """ASGI middleware: every HTTP answer carries :data:`INSTANCE_HEADER`."""

    def __init__(self, app, instance: str) -> None:
        self.app, self.value = app, instance.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message):
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (INSTANCE_HEADER.encode(), self.value)]
            await send(message)

        await self.app(scope, receive, tagged)


UNAUTHORIZED = (
    "missing or unknown bearer token: send 'Authorization: Bearer <token>' with a tenant token "
    "from the config"
)


class AuthGate:
    """ASGI middleware: a request to ``/v1/`` without a known bearer token gets 401 at once,
    its body unread and its connection closed, so a stranger cannot hold the service busy
    reading a slow or large body (the routes still resolve the tenant themselves)."""

    def __init__(self, app, tokens: set[str]) -> None:
        self.app, self.tokens = app, tokens

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), None)
        if bearer(auth) in self.tokens:
            return await self.app(scope, receive, send)
        body = safejson.dumps({"detail": UNAUTHORIZED}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def create_app(config: ServiceConfig) -> FastAPI:
    """The FastAPI app serving ``config``; the engine is ``app.state.service``.

    Raises:
        ConfigError: the connection shares do not fit (:func:`.shares.shares`), or the
            service cannot start (:class:`~.core.RewardService`).
    """
    per_tenant, anonymous = shares(config, max_connections(config))  # before any scratch
    service = RewardService(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await service.shutdown()

    app = FastAPI(
        title="m2flow reward service (DistRS)",
        version="1",
        lifespan=lifespan,
        default_response_class=safejson.SafeJSONResponse,
    )
    app.state.service = service
    safejson.install(app)
    app.add_middleware(
        BodyLimit,
        max_bytes=config.max_body_bytes,
        timeout_s=config.body_timeout_s,
        max_large=config.max_large_bodies,
    )
    app.add_middleware(AuthGate, tokens=set(service.tokens))
    tenants = {t.token: name for name, t in config.tenants.items()}
    app.add_middleware(Shares, tenants=tenants, per_tenant=per_tenant, anonymous=anonymous)
    app.add_middleware(Instance, instance=service.instance)  # outermost: 413s carry it too

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        headers = None
        if exc.retry_after_s is not None:
            headers = {"Retry-After": str(exc.retry_after_s)}
        return safejson.SafeJSONResponse(
            {"detail": safejson.clean_text(str(exc))}, status_code=exc.status, headers=headers
        )

    def tenant(authorization: str | None = Header(None)) -> str:
        token = bearer(authorization)
        try:
            return service.tenant_of(token)
        except ServiceError as e:
            raise HTTPException(e.status, str(e), headers={"WWW-Authenticate": "Bearer"}) from e

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.post("/v1/tasks")
    async def register(body: RegisterTask, who: str = Depends(tenant)):
        t = service.register(who, body.task, body.pipeline, body.delay_bound_s)
        stages = list(config.pipelines[t.pipeline].stages)
        return {
            "task": t.name,
            "pipeline": t.pipeline,
            "delay_bound_s": t.delay_bound_s,
            "stages": stages,
        }

    @app.post("/v1/tasks/{task}/batches")
    async def announce(task: str, body: Announce, who: str = Depends(tenant)):
        scored = [(r.id, r.reward) for r in body.scored]
        b = await service.announce(who, task, body.size, body.batch, scored)
        return {"task": task, "batch": b.id, "size": b.size}

    @app.post("/v1/tasks/{task}/batches/{batch}/requests")
    async def submit(task: str, batch: str, body: SubmitRequest, who: str = Depends(tenant)):
        service.batch(who, task, batch)  # 404 before measuring
        sizes = await asyncio.to_thread(payload_sizes, [body.payload])  # off the loop
        return {"id": service.submit_many(who, task, batch, [(body.payload, body.id)], sizes)[0]}

    @app.post("/v1/tasks/{task}/batches/{batch}/requests:bulk")
    async def submit_many(task: str, batch: str, body: SubmitMany, who: str = Depends(tenant)):
        # all or nothing: a bad one refuses the whole call
        service.batch(who, task, batch)
        requests = [(r.payload, r.id) for r in body.requests]
        sizes = await asyncio.to_thread(payload_sizes, [p for p, _ in requests])
        return {"ids": service.submit_many(who, task, batch, requests, sizes)}

    @app.post("/v1/tasks/{task}/batches/{batch}/close")
    async def close(task: str, batch: str, who: str = Depends(tenant)):
        return service.status(await service.close(who, task, batch))

    @app.get("/v1/tasks/{task}/batches/{batch}")
    async def status(task: str, batch: str, who: str = Depends(tenant)):
        return service.status(service.batch(who, task, batch))

    @app.get("/v1/tasks/{task}/batches/{batch}/results")
    async def results(
        task: str,
        batch: str,
        offset: int = Query(0, ge=0),
        wait_s: float = Query(0.0, ge=0, le=MAX_WAIT_S),
        who: str = Depends(tenant),
    ):
        """Results from ``offset`` on (in completion order); waits up to ``wait_s`` for at
        least one new result unless the batch is complete."""
        b = service.batch(who, task, batch)
        deadline = time.monotonic() + wait_s
        while len(b.results) <= offset and not b.done and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(b.changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        return {
            "results": b.results[offset:],
            "next_offset": len(b.results),
            "complete": b.done and len(b.results) == b.size,
        }

    @app.get("/v1/tasks/{task}/batches/{batch}/stream")
    async def stream(
        task: str,
        batch: str,
        timeout_s: float = Query(600.0, gt=0, le=3600.0),
        who: str = Depends(tenant),
    ):
        """NDJSON: one result per line as requests finish; ends when the batch completes
        (or after ``timeout_s``, with a last line ``{"timeout": true}``)."""
        b = service.batch(who, task, batch)

        async def lines():
            sent, end = 0, time.monotonic() + timeout_s
            while True:
                while sent < len(b.results):
                    yield safejson.dumps(b.results[sent]) + "\n"
                    sent += 1
                if b.done and sent >= len(b.results):
                    return
                left = end - time.monotonic()
                if left <= 0:
                    yield safejson.dumps({"timeout": True}) + "\n"
                    return
                try:
                    await asyncio.wait_for(b.changed.wait(), min(left, 5.0))
                except TimeoutError:
                    pass

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/metrics")
    async def metrics(who: str = Depends(tenant)):
        return service.metrics(who)

    @app.get("/v1/tools")
    async def tools(who: str = Depends(tenant)):
        """The tools (JSON schemas, as a chat template's ``tools=`` takes them) and the tool
        pipelines."""
        names = sorted(n for n, p in config.pipelines.items() if p.kind == "tool")
        return {"tools": list(TOOLS.values()), "pipelines": names}

    @app.post("/v1/tools/run")
    async def run_tool(body: RunTool, who: str = Depends(tenant)):
        """Run a tool in a sandbox (module .tools); waits for its answer."""
        size = (await asyncio.to_thread(payload_sizes, [body.arguments]))[0]
        return await service.run_tool(
            who, body.tool, body.arguments, body.timeout_s, body.pipeline, size
        )

    return app


class BackgroundServer:
    """Run the service in a thread of this process (tests, scripts, notebooks)::

        with BackgroundServer(config) as url: ...

    Binds ``config.host`` (loopback by default) on ``config.port`` (0: a free port).
    """

    def __init__(self, config: ServiceConfig, start_timeout_s: float = 30.0) -> None:
        import socket

        import uvicorn

        if config.port == 0:
            with socket.socket() as s:
                s.bind((config.host, 0))
                config = config.model_copy(update={"port": s.getsockname()[1]})
        self.config = config
        self.app = create_app(config)
        self.server = uvicorn.Server(uvicorn_config(self.app, config))
        self.start_timeout_s = start_timeout_s
        self.url = f"http://{config.host}:{config.port}"

    @property
    def service(self) -> RewardService:
        return self.app.state.service

    def __enter__(self) -> str:
        import threading

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if time.monotonic() > end or not self.thread.is_alive():
                raise RuntimeError(f"reward service did not start on {self.url}")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
