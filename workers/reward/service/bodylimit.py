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
    (seconds, from the app's first read; None: no limit)."""

    def __init__(
        self, app, max_bytes: int, drain_bytes: int | None = None, timeout_s: float | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes or max(64 * 2**20, 8 * max_bytes)
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            if length.isdigit() and int(length) <= self.drain_bytes:
                await self._drain(receive, 0, True)
            return await self._refuse(send)
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

    async def _refuse(self, send, status: int = 413, message: str | None = None) -> None:
        body = json.dumps({"detail": message or _message(self.max_bytes)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
