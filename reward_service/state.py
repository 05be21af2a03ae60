"""The reward service's state records (:mod:`.core` owns and changes them, on its loop)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field

from m2flow.scheduler.reward.sim import RequestRecord


class ServiceError(Exception):
    """A client mistake: ``status`` is the HTTP status, the message says what to fix;
    ``retry_after_s``: for 429, when to try again (the ``Retry-After`` header)."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


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
    #: what its payload holds in memory (:mod:`.budget`), given back with its result
    bytes: int = 0


@dataclass
class Batch:
    task: Task
    id: str
    size: int
    start: float
    history: list[RequestRecord]
    prio: float
    submitted: int = 0
    #: request id -> digest of its payload, for every request submitted (idempotent resubmission)
    digests: dict[str, bytes] = field(default_factory=dict)
    #: ids an earlier instance of the service scored (re-announced after a restart, with their
    #: rewards, which are among ``results``): they count toward ``size``, never submitted here
    settled: set[str] = field(default_factory=set)
    results: list[dict] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    live: dict[str, Req] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    completed_at: float | None = None

    @property
    def done(self) -> bool:
        return self.completed_at is not None

    @property
    def accounted(self) -> int:
        """Requests of ``size`` that arrived or were settled (scored before a restart)."""
        return self.submitted + len(self.settled)


@dataclass
class Task:
    name: str
    tenant: str
    pipeline: str
    delay_bound_s: float
    history: list[RequestRecord] = field(default_factory=list)
    batches: dict[str, Batch] = field(default_factory=dict)


def _digest(payload: dict) -> bytes:
    """A request payload's fingerprint (16 bytes): a resubmitted id must carry the same one.

    Raises:
        ValueError: the payload holds NaN or an infinity (which JSON has not: Python's parser
            takes ``NaN``, ``Infinity`` and ``1e400``, so the service refuses them here).
    """
    try:
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise ValueError(
            "payload holds NaN or Infinity (or a number too large for a float, e.g. 1e400), "
            "which JSON has not: send such values as strings"
        ) from None
    return hashlib.blake2b(text.encode(), digest_size=16).digest()
