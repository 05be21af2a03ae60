"""Connections to the reward service: bounded, timed out, and a log that stays short.

Anyone who reaches the port, with a token or not, can open connections. uvicorn (0.54, h11)
closes an idle *keep-alive* connection after ``timeout_keep_alive``, but a connection that
never sends a request, or sends its headers a byte at a time, stays open forever; at the
file-descriptor limit ``accept`` fails, asyncio retries it (and logs a traceback for each
queued connection, every second), and no one gets in. So :func:`uvicorn_config` serves the
app with :class:`GuardedH11Protocol`:

- **Header timeout.** A connection must complete a request's headers within
  ``header_timeout_s`` of connecting, and of each answer; data that trickles in does not
  extend it (unlike the keep-alive timer, which any byte resets). Then it is closed.
- **Connection cap.** At most ``max_connections`` are open, below the file-descriptor limit
  (:func:`connection_budget`, which keeps room for the workers' pipes and for three bursts of
  :data:`BACKLOG` connections: two accepted before the cap sees them, one evicted whose
  descriptors close an event-loop iteration later), so ``accept`` does not run out of
  descriptors. A connection
  over the cap makes room by closing the longest-idle one (no request in flight: a flood of
  idle sockets evicts itself, not the tenants' requests); if every one is busy, it is
  closed itself.
- **Bounded log.** :class:`RateLimit` passes at most a few records of each kind per minute
  from the ``asyncio`` and ``uvicorn.error`` loggers (e.g. "socket.accept() out of system
  resource", should descriptors run out anyway: asyncio then stops accepting for 1 s),
  then one line saying how many it dropped.

Bodies are bounded in size and time by :mod:`.bodylimit`; requests without a known token are
refused before their body is read (:class:`.app.AuthGate`). A connection with a request in
flight is never evicted: :mod:`.shares` bounds those per tenant, so that one tenant's slow
bodies cannot take every slot.
"""

from __future__ import annotations

import logging
import resource
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from m2flow.core.config import ConfigError

#: descriptors kept for everything but connections (listening socket, event loop, journal,
#: logs, imports) ...
_FD_RESERVE = 64
#: ... and per worker process the service may run (its stdin and stdout pipes, a pidfd,
#: one spare while it starts)
_FD_PER_WORKER = 4
#: the listen backlog, which is also the most connections asyncio accepts in one loop
#: iteration. Under a flood three bursts hold descriptors beyond the cap at once: one just
#: accepted, one whose transports wait for :meth:`GuardedH11Protocol.connection_made` (where
#: the cap applies; asyncio calls it two iterations after ``accept``), and the connections
#: that burst evicted, whose sockets close one iteration after ``transport.close()``. Two
#: bursts were not enough (measured: the descriptor count reached the limit at 1024)
BACKLOG = 128


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout and a connection cap (class attributes,
    set by :func:`uvicorn_config` on a subclass)."""

    header_timeout_s: float = 10.0
    max_connections: int = 1000

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = None
        self._idle_since = time.monotonic()
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived: it is served, not idle
            self._disarm()

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        self._arm()  # before super(): it may start a pipelined request (which disarms)
        super().on_response_complete()

    def _idle(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if self._idle():
            self._close()

    def _close(self) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:
            pass
        self.transport.close()

    def _make_room(self) -> None:
        idle = [c for c in self.connections if c is not self and getattr(c, "_idle", None)]
        idle = [c for c in idle if c._idle() and not c.transport.is_closing()]
        victim = min(idle, key=lambda c: c._idle_since, default=self)
        victim._close()


def connection_budget(config) -> int:
    """Connections the service may hold open under its file-descriptor limit: the soft
    ``RLIMIT_NOFILE`` (raised to the hard limit first) less a reserve for its worker processes
    (every stage's ``max_workers``), itself, and three bursts of :data:`BACKLOG` connections
    in flight."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    workers = sum(s.max_workers for p in config.pipelines.values() for s in p.stages.values())
    limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return limit - _FD_RESERVE - _FD_PER_WORKER * workers - 3 * BACKLOG


def max_connections(config) -> int:
    """``config.max_connections``, or the :func:`connection_budget` (at most 4096).

    Raises:
        ConfigError: the budget leaves fewer than 16 connections, or ``max_connections``
            is over it.
    """
    budget = connection_budget(config)
    if budget < 16:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise ConfigError(
            f"the file-descriptor limit (RLIMIT_NOFILE {nofile}) leaves "
            f"{budget} connections after the workers' pipes: raise it (ulimit -n) or lower "
            "the stages' max_workers"
        )
    if config.max_connections is None:
        return min(budget, 4096)
    if config.max_connections > budget:
        raise ConfigError(
            f"max_connections {config.max_connections} is over the {budget} this process's "
            "file-descriptor limit allows next to its workers: lower it or raise the limit "
            "(ulimit -n)"
        )
    return config.max_connections


def uvicorn_config(app, config, **kw) -> uvicorn.Config:
    """The uvicorn configuration serving ``app`` for the service ``config`` (a
    :class:`~.schemas.ServiceConfig`): h11 with :class:`GuardedH11Protocol`, the asyncio loop
    (its ``accept`` backs off 1 s when descriptors run out), ``keep_alive_s``; ``kw`` goes to
    :class:`uvicorn.Config` (e.g. ``log_level``). Installs :class:`RateLimit` on the
    ``asyncio`` and ``uvicorn.error`` loggers.

    Raises:
        ConfigError: see :func:`max_connections`.
    """
    protocol = type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout_s": config.header_timeout_s, "max_connections": max_connections(config)},
    )
    kw.setdefault("log_level", "warning")
    out = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http=protocol,
        loop="asyncio",
        backlog=BACKLOG,
        timeout_keep_alive=config.keep_alive_s,
        **kw,
    )
    for name in ("asyncio", "uvicorn.error"):  # after uvicorn.Config: it configures logging
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimit) for f in logger.filters):
            logger.addFilter(RateLimit())
    return out


class RateLimit(logging.Filter):
    """Pass at most ``burst`` records of each message (its format string) per ``window_s``;
    the first one passed after a window that dropped some says how many."""

    def __init__(self, burst: int = 5, window_s: float = 60.0) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._seen: dict[str, list] = {}  # message -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = str(record.msg)[:200]
        now = time.monotonic()
        state = self._seen.get(key)
        if state is None or now - state[0] > self.window_s:
            dropped = state[2] if state else 0
            if len(self._seen) > 1000:  # many distinct messages: forget the old windows
                self._seen.clear()
            self._seen[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} ({dropped} like it dropped in the last window)"
            return True
        if state[1] < self.burst:
            state[1] += 1
            return True
        state[2] += 1
        return False
