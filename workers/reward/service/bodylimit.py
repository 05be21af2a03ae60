"""ASGI middleware: refuse HTTP request bodies over a size limit with 413.

A body whose ``Content-Length`` is over the limit is refused without being stored; a chunked
body (no length) is counted as it streams in and refused once it passes the limit. Either way
the service holds at most ``max_bytes`` (plus one chunk) of a request. Before answering, the
rest of the body is read and dropped (up to ``drain_bytes``): a client that sends the whole
body before reading the answer then gets its 413 instead of a connection reset.
"""

from __future__ import annotations

import json

from fastapi import HTTPException


class BodyTooLarge(HTTPException):
    """Raised into the app when a streamed body passes the limit (an HTTPException, so the
    framework answers 413 even where it wraps other errors of reading the body)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, _message(max_bytes))


def _message(max_bytes: int) -> str:
    return (
        f"request body over the service's max_body_bytes ({max_bytes} bytes): send fewer or "
        "smaller requests per call"
    )


class BodyLimit:
    """Wrap an ASGI app. ``max_bytes``: the largest request body accepted (bytes);
    ``drain_bytes``: most bytes of a refused body read and dropped before the 413 (default
    8x ``max_bytes``, at least 64 MiB)."""

    def __init__(self, app, max_bytes: int, drain_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_bytes = drain_bytes or max(64 * 2**20, 8 * max_bytes)

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

        async def counted():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    await self._drain(receive, seen, msg.get("more_body", False))
                    raise BodyTooLarge(self.max_bytes)
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

    async def _drain(self, receive, seen: int, more: bool) -> None:
        while more and seen <= self.drain_bytes:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            more = msg.get("more_body", False)

    async def _refuse(self, send) -> None:
        body = json.dumps({"detail": _message(self.max_bytes)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
