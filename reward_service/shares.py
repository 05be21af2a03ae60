"""Per-tenant shares of the reward service's connection slots (and so of its bodies in flight).

A connection holds one of the service's ``max_connections`` slots for good only while a
request is in flight on it (headers received, answer not yet finished): an idle connection,
and one whose headers are still arriving, is closed when the cap needs room
(:class:`~.connections.GuardedH11Protocol`: the longest-idle first) and by the header timeout
anyway. So a tenant can take slots from the others only with requests in flight -- a body sent
one byte every 5 s keeps its request in flight until ``body_timeout_s`` (408). The tenant is
known only from the ``Authorization`` header, which arrives whole before the body: here, when a
request's headers are complete and before any of its body is read, :class:`Shares` counts it
against its tenant's share and refuses it at once when the share is full (429 with
``Retry-After``, ``Connection: close``: its slot is free again at once).

Shares (:func:`shares`): every tenant ``max_requests_per_tenant`` requests in flight (default:
an equal part of ``max_connections`` after the anonymous share), requests without a known token
(``/healthz``, the 401s) ``max_anonymous_requests`` together. The shares sum to at most
``max_connections``, so a tenant under its share always finds a slot: the others' requests in
flight leave at least its share, and any other connection there is idle or still sending its
headers, which a new connection evicts.

What bounds a slot, then: a request in flight, its tenant's share and ``body_timeout_s`` (its
body) or the answer (a long poll: ``wait_s`` <= 300 s, a stream <= 3600 s); a connection
whose headers are not complete, ``header_timeout_s`` (10 s) from connecting or from its last
answer, and at the cap it is the first to go; an idle keep-alive connection, ``keep_alive_s``.
"""

from __future__ import annotations

import json

from m2flow.core.config import ConfigError


def bearer(value: str | bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, or None."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None


def shares(config, max_connections: int) -> tuple[int, int]:
    """``(per tenant, anonymous)``: requests in flight each tenant may hold, and all requests
    without a known token together, for the service ``config`` under ``max_connections``.

    Raises:
        ConfigError: the shares do not fit in ``max_connections`` (every tenant at its share
            and the anonymous share full must leave the slots they need), or the default
            leaves a tenant no request.
    """
    n = len(config.tenants)
    anonymous = config.max_anonymous_requests
    if anonymous is None:
        anonymous = max(1, min(32, max_connections // 16))
    per_tenant = config.max_requests_per_tenant
    if per_tenant is None:
        per_tenant = (max_connections - anonymous) // max(n, 1)
        if per_tenant < 1:
            raise ConfigError(
                f"max_connections {max_connections} leaves no request in flight for each of "
                f"{n} tenants after {anonymous} anonymous ones: raise max_connections (or "
                "the file-descriptor limit, ulimit -n) or lower max_anonymous_requests"
            )
    if n * per_tenant + anonymous > max_connections:
        tenants = f"{n} tenant{'s' if n != 1 else ''}"
        raise ConfigError(
            f"{tenants} x max_requests_per_tenant {per_tenant} + max_anonymous_requests "
            f"{anonymous} = {n * per_tenant + anonymous} is over max_connections "
            f"{max_connections}: the shares must fit, so that each tenant always finds its "
            "own; lower them or raise max_connections"
        )
    return per_tenant, anonymous


class Shares:
    """ASGI middleware: count each HTTP request against its tenant's share (its token's; no
    known token: the anonymous share) from the moment its headers are complete until its
    answer is sent, and answer one over the share 429 at once, its body unread.

    ``tenants``: token -> tenant name; ``per_tenant``, ``anonymous``: the shares
    (:func:`shares`). ``in_flight``: tenant name (None: anonymous) -> requests now.
    """

    def __init__(self, app, tenants: dict[str, str], per_tenant: int, anonymous: int) -> None:
        self.app, self.tenants = app, tenants
        self.per_tenant, self.anonymous = per_tenant, anonymous
        self.in_flight: dict[str | None, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), None)
        who = self.tenants.get(bearer(auth) or "")
        share = self.anonymous if who is None else self.per_tenant
        held = self.in_flight.get(who, 0)
        if held >= share:
            return await _refuse(send, who, share)
        self.in_flight[who] = held + 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.in_flight[who] -= 1


async def _refuse(send, who: str | None, share: int) -> None:
    if who is None:
        detail = (
            f"{share} requests without a known token are in flight, their share of the "
            "service's connections (max_anonymous_requests): retry in a moment"
        )
    else:
        detail = (
            f"tenant {who!r} has {share} requests in flight, its share of the service's "
            "connections (max_requests_per_tenant): wait for answers before sending more"
        )
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 429,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
