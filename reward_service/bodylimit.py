"""ASGI middleware: refuse HTTP request bodies over a size limit with 413, or slower than a
time limit with 408.

A body whose ``Content-Length`` is over the limit is refused without being stored; a chunked
body (no length) is counted as it streams in and refused once it passes the limit. Either way
the service holds at most ``max_bytes`` (plus one chunk) of a request. Before answering, the
rest of the body is read and dropped (up to ``drain_bytes``): a client that sends the whole
body before reading the answer then gets its 413 instead of a connection reset. A body that
has not arrived whole ``timeout_s`` after the app first asks for it gets 408 and the
connection is closed (a client trickling a body cannot hold a request open); once the body is
complete, the app's later reads (waiting for a disconnect) are not timed.

Large bodies (over :data:`LARGE_BYTES`, or chunked) are read and handled at most
``max_large`` at a time, at most half of them (at least one) per bearer token (tenant): a body
in flight costs ~3-4 times its size (the bytes, the parsed payload, the texts made of it), so
memory of bodies in flight stays under ``max_large x max_bytes x 4`` however many
connections send one, and one tenant cannot take every turn. A body waits for its turn up to
half of ``timeout_s``, then gets 429 (retry).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import HTTPException


class BodyTooLarge(HTTPException):
    """Raised into the app when a streamed body passes the limit (an HTTPException, so the
    framework answers 413 even where it wraps other errors of reading the body)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _message(max_bytes))


#: bodies over this size (bytes) wait for a turn (``max_large`` at a time)
LARGE_BYTES = 2**20


class BodyTimeout(HTTPException):
    """Raised into the app when a body is slower than the limit (answered 408)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, _late(timeout_s))


def _late(timeout_s: float) -> str:
    return (
        f"request body not received within the service's body_timeout_s ({timeout_s:g} s): "
        "send it at once"
    )


def _message(max_bytes: int) -> str:
    return (
        f"request body over the service's max_body_bytes ({max_bytes} bytes): send fewer or "
        "smaller requests per call"
    )


class BodyLimit:
    """Wrap an ASGI app. ``max_bytes``: the largest request body accepted (bytes);
    ``drain_bytes``: most bytes of a refused body read and dropped before the 413 (default
    8x ``max_bytes``, at least 64 MiB); ``timeout_s``: longest a body may take to arrive
    (seconds, from the app's first read; None: no limit); ``max_large``: large bodies read
    and handled at once (None: no limit)."""

    def __init__(
        self,
        app,
        max_bytes: int,
        drain_bytes: int | None = None,
        timeout_s: float | None = None,
        max_large: int | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes or max(64 * 2**20, 8 * max_bytes)
        self.timeout_s = timeout_s
        self.max_large = max_large
        self._turns: asyncio.Semaphore | None = None  # made on the serving loop
        self._own: dict[bytes, asyncio.Semaphore] = {}  # per bearer token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            if length.isdigit() and int(length) <= self.drain_bytes:
                await self._drain(receive, 0, True)
            return await self._refuse(send)
        large = (length is not None and int(length) > LARGE_BYTES) or (
            length is None and b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        )
        if not large or self.max_large is None:
            return await self._serve(scope, receive, send)
        if self._turns is None:
            self._turns = asyncio.Semaphore(self.max_large)
        key = headers.get(b"authorization", b"")
        if key not in self._own and len(self._own) >= 256:  # strangers' keys: one shared
            key = b""
        own = self._own.setdefault(key, asyncio.Semaphore(max(1, self.max_large // 2)))
        end = time.monotonic() + (self.timeout_s or 3600.0) / 2  # then the body's own time
        try:
            await asyncio.wait_for(own.acquire(), end - time.monotonic())
        except TimeoutError:
            return await self._busy(receive, send)
        try:
            try:
                await asyncio.wait_for(self._turns.acquire(), end - time.monotonic())
            except TimeoutError:
                return await self._busy(receive, send)
            try:
                await self._serve(scope, receive, send)
            finally:
                self._turns.release()
        finally:
            own.release()

    async def _busy(self, receive, send) -> None:
        await self._drain(receive, 0, True)  # dropped as it comes: the client reads the 429
        await self._refuse(
            send, 429, "too many large request bodies in flight: retry in a moment", retry=True
        )

    async def _serve(self, scope, receive, send) -> None:
        seen = 0
        started = False
        complete = False
        deadline = None

        async def counted():
            nonlocal seen, complete, deadline
            if complete or self.timeout_s is None:
                msg = await receive()
            else:
                deadline = deadline or time.monotonic() + self.timeout_s
                try:
                    msg = await asyncio.wait_for(receive(), deadline - time.monotonic())
                except TimeoutError:
                    raise BodyTimeout(self.timeout_s) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                complete = not msg.get("more_body", False)
                if seen > self.max_bytes:
                    await self._drain(receive, seen, msg.get("more_body", False))
                    raise BodyTooLarge(self.max_bytes)
            else:
                complete = True
            return msg

        async def watched(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)
        except BodyTimeout:
            if not started:
                await self._refuse(send, 408, _late(self.timeout_s))

    async def _drain(self, receive, seen: int, more: bool) -> None:
        while more and seen <= self.drain_bytes:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            more = msg.get("more_body", False)

    async def _refuse(
        self, send, status: int = 413, message: str | None = None, retry: bool = False
    ) -> None:
        body = json.dumps({"detail": message or _message(self.max_bytes)}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        if retry:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
