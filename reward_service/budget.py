"""The memory that queued requests hold: measured per payload, capped per tenant and in total.

``max_body_bytes`` bounds one request, not what waits: payloads stay in the service's memory
from submission until their result, and a batch may hold 65,536 requests. Nor is a payload's
JSON size its memory: parsed, ``[{}, {}, ...]`` takes ~24 times its JSON text (an empty
dict is 64 bytes, its JSON two). So :func:`payload_bytes` measures what a payload holds as
Python objects (``sys.getsizeof`` of every value, shared ones counted each time), and
:class:`QueueBudget` admits a submission only while its tenant's and the service's queued
bytes stay under their caps (429 while full: the client waits and retries; 413 for a call
that could never fit). A request gives its bytes back when its result is stored.
"""

from __future__ import annotations

from collections import defaultdict
from sys import getsizeof

from .state import ServiceError

#: deepest nesting of a payload (a trainer's payload is 2-3 levels; JSON encoders and
#: decoders recurse, so depth must be bounded before anything walks it)
MAX_DEPTH = 64


def payload_bytes(payload: dict, max_depth: int = MAX_DEPTH) -> int:
    """Bytes ``payload`` (a parsed JSON object) holds as Python objects: the sum of
    ``sys.getsizeof`` over every container, key and value. Walked level by level (no
    recursion), at C speed within a level.

    Raises:
        ValueError: nested deeper than ``max_depth``.
    """
    size = getsizeof(payload)
    level, depth = [payload], 0
    while level:
        depth += 1
        nested = []
        for v in level:
            if type(v) is dict:
                size += sum(map(getsizeof, v))
                items = list(v.values())
            else:
                items = v
            size += sum(map(getsizeof, items))
            nested += [x for x in items if type(x) is dict or type(x) is list]
        if nested and depth >= max_depth:
            raise ValueError(f"payload nested deeper than {max_depth} levels: send flatter data")
        level = nested
    return size


class QueueBudget:
    """Bytes held by the payloads of queued and running requests, per tenant and in total.

    Args:
        total: ``max_queued_bytes``; per_tenant: ``max_queued_bytes_per_tenant``.
    """

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self.held: dict[str, int] = defaultdict(int)
        self.held_total = 0

    def take(self, tenant: str, n: int) -> None:
        """Hold ``n`` more bytes for ``tenant``.

        Raises:
            ServiceError: 413 when ``n`` alone is over a cap (the call can never fit); 429
                (with ``Retry-After``) while the tenant's or the service's queue is full.
        """
        for cap, name in ((self.per_tenant, "max_queued_bytes_per_tenant"),
                          (self.total, "max_queued_bytes")):  # fmt: skip
            if n > cap:
                raise ServiceError(
                    413,
                    f"these requests hold {n} bytes in memory, over the service's {name} "
                    f"({cap}): send smaller or fewer requests per call",
                )
        if self.held[tenant] + n > self.per_tenant:
            raise ServiceError(
                429,
                f"this tenant's queued requests hold {self.held[tenant]} bytes; {n} more "
                f"would pass max_queued_bytes_per_tenant ({self.per_tenant}): retry when "
                "results come back",
                retry_after_s=1,
            )
        if self.held_total + n > self.total:
            raise ServiceError(
                429,
                f"the service's queued requests hold {self.held_total} bytes; {n} more "
                f"would pass max_queued_bytes ({self.total}): retry when results come back",
                retry_after_s=1,
            )
        self.held[tenant] += n
        self.held_total += n

    def give(self, tenant: str, n: int) -> None:
        """Release ``n`` bytes of ``tenant`` (its request has a result)."""
        self.held[tenant] -= n
        self.held_total -= n
        if not self.held[tenant]:
            del self.held[tenant]

    def view(self, tenant: str | None) -> dict:
        """``{"tenant": bytes, "total": bytes}`` (``tenant`` None: every tenant's)."""
        if tenant is None:
            return {"tenants": dict(self.held), "total": self.held_total}
        return {"tenant": self.held.get(tenant, 0), "total": self.held_total}
