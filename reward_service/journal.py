"""The reward service's results journal: what an instance scored survives its restart.

Without it a result that the service produced but no client read before a restart is lost
with the instance's memory, and the client's resubmission scores the request again. With
``state_dir`` set, :meth:`ResultJournal.append` writes each result as one JSON line (tenant,
task, batch, request id, payload digest, the result) to ``<state_dir>/results.jsonl`` when it
is produced, flushed before the service answers anyone with it; the next instance loads the
file and a batch announced again gets its results back (``RewardService._restore``): the
request is scored once, and a resubmission of the id with the same payload is answered from
the journal (another payload is refused as before).

Only the service writes the journal; a tenant's results come back only into that tenant's
own task and batch. One service instance per ``state_dir`` (an exclusive ``flock``). The file
grows by ~250 bytes per result; delete the directory to start afresh. A line cut short by a
crash mid-write is skipped at load (its request is scored again).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections import defaultdict
from pathlib import Path

log = logging.getLogger(__name__)

Key = tuple[str, str, str]  # (tenant, task, batch)


class ResultJournal:
    """Append-only results of one service, loaded at start.

    Args:
        state_dir: the directory (created if missing, mode 0700).

    Raises:
        RuntimeError: another service instance holds ``state_dir``.
    """

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = open(self.dir / "lock", "w")  # noqa: SIM115 (held for the service's life)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(
                f"another reward service uses state_dir {str(self.dir)!r}: give each instance "
                "its own"
            ) from None
        self.path = self.dir / "results.jsonl"
        #: (tenant, task, batch) -> request id -> (payload digest hex, result)
        self.scored: dict[Key, dict[str, tuple[str, dict]]] = defaultdict(dict)
        self.skipped = 0
        if self.path.exists():
            self._load()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _load(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    e = json.loads(line)
                    key = (e["tenant"], e["task"], e["batch"])
                    self.scored[key][e["result"]["id"]] = (e["digest"], e["result"])
                except (ValueError, KeyError, TypeError):
                    self.skipped += 1  # a torn last line: that request is scored again
        if self.skipped:
            log.warning("results journal %s: skipped %d unreadable lines", self.path, self.skipped)

    def append(self, key: Key, digest: bytes, result: dict) -> None:
        """Record ``result`` (its ``id`` names the request) of batch ``key``; flushed to the
        OS before returning, so a service crash after this keeps it."""
        tenant, task, batch = key
        entry = {"tenant": tenant, "task": task, "batch": batch, "digest": digest.hex(),
                 "result": result}  # fmt: skip
        self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")
        self._file.flush()
        self.scored[key][result["id"]] = (digest.hex(), result)

    def batch(self, key: Key) -> dict[str, tuple[str, dict]]:
        """Request id -> (digest hex, result) journaled for batch ``key`` (empty if none)."""
        return self.scored.get(key, {})

    def close(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._lock.close()
