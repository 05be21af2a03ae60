"""The idle-connection flood row of the reward service attack benchmark: no token
needed, only the port.

A service of its own runs as ``m2flow reward-service`` with its file-descriptor limit lowered
to :data:`NOFILE` (the flood stays far below the machine's limits; the issue's was 19,990
sockets against 20,000). On loopback only, the flood opens :data:`SLOW` connections that send
a request's header a line at a time, then :data:`IDLE` that send nothing, and holds them while
one tenant runs its correct batch and ``/healthz`` is asked every 0.4 s. Then it closes every
socket and waits for the service's descriptors to come back. It stops by itself in seconds.

Contained: the tenant's batch intact, every ``/healthz`` answered within 3 s, the service's
descriptors always below its limit (``accept`` never fails), the trickling connections
closed by the header timeout, descriptors back to their level before the flood, and the
service's log under 50 lines.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time

import httpx
from reward_service_attack_measure import Memory, Service, fds, settle

NOFILE = 2048
IDLE = 3000
SLOW = 50
HEADER_TIMEOUT_S = 2.0


def _connect(port: int) -> socket.socket | None:
    s = socket.socket()
    s.setblocking(False)
    if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
        s.close()
        return None
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def flood_row(scratch: str, config, tokens: dict, correct_batch) -> dict:
    """Run the flood against a service of its own (``config(scratch, port)``) and return the
    row; ``correct_batch(client, task)``: the tenant's batch (True when intact)."""
    from m2flow.reward_service.client import AsyncRewardClient

    t0 = time.monotonic()

    def cfg(scratch: str, port: int):
        return config(scratch, port).model_copy(update={"header_timeout_s": HEADER_TIMEOUT_S})

    log = f"{scratch}/flood-service.log"
    svc = Service(scratch, cfg, tokens["alice"], nofile=NOFILE, log=log)
    port = int(svc.url.rsplit(":", 1)[1])
    mem = Memory(svc.proc.pid)
    base = fds(svc.proc.pid)
    socks: list[socket.socket] = []
    latencies: list[float] = []
    try:
        slow = [s for s in (_connect(port) for _ in range(SLOW)) if s]
        time.sleep(0.5)
        socks = slow + [s for s in (_connect(port) for _ in range(IDLE)) if s]
        t_flood = time.monotonic()

        async def tenant() -> tuple[bool, float]:
            async with AsyncRewardClient(svc.url, tokens["alice"], timeout_s=60) as c:
                started = time.monotonic()
                return await correct_batch(c, "under-flood"), time.monotonic() - started

        result: dict = {}
        runner = asyncio.new_event_loop()
        th = threading.Thread(target=lambda: result.update(r=runner.run_until_complete(tenant())))
        th.start()
        i = 0
        while th.is_alive() or time.monotonic() < t_flood + HEADER_TIMEOUT_S + 1.0:
            for s in slow:
                try:
                    s.send(b"GET /healthz HTTP/1.1\r\n" if i == 0 else b"X-a: b\r\n")
                except OSError:
                    pass
            start = time.monotonic()
            try:
                ok = httpx.get(f"{svc.url}/healthz", timeout=5).status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.monotonic() - start if ok else float("inf"))
            i += 1
            time.sleep(0.4)
        th.join(timeout=120)
        runner.close()
        intact, other_s = result.get("r", (False, None))
        slow_closed = sum(_closed_by_peer(s) for s in slow)
        for s in socks:
            s.close()
        socks = []
        end = time.monotonic() + HEADER_TIMEOUT_S + 10
        while fds(svc.proc.pid) > base + 20 and time.monotonic() < end:
            time.sleep(0.2)
        after = fds(svc.proc.pid)
    finally:
        for s in socks:
            s.close()
        mem.stop()
        rc = svc.sigterm()
    procs, dirs = settle(svc.root, lambda: 0)
    with open(log) as f:
        lines = len(f.read().splitlines())
    contained = (
        intact
        and max(latencies) < 3.0
        and mem.fds_peak < NOFILE - 16
        and slow_closed == len(slow)
        and after <= base + 20
        and lines < 50
        and (procs, dirs) == (0, 0)
    )
    note = (
        f"{IDLE} idle + {SLOW} trickling connections, fd limit {NOFILE}: /healthz "
        f"{len(latencies)} x, slowest {max(latencies):.2f} s; service fds {base} -> peak "
        f"{mem.fds_peak} -> {after}; {slow_closed}/{len(slow)} trickling closed by the "
        f"{HEADER_TIMEOUT_S:g} s header timeout; log {lines} lines; exit {rc}"
    )
    return {
        "attack": "idle-connection flood (no token)",
        "attackers": ["anyone"],
        "contained": contained,
        "attacker_reward": None,
        "other_intact": intact,
        "other_batch_s": other_s,
        "service_mem_peak_bytes": mem.peak,
        "worker_peak_rss_bytes": mem.worker_hwm,
        "service_fds_peak": mem.fds_peak,
        "procs_left": procs,
        "scratch_left": dirs,
        "seconds": time.monotonic() - t0,
        "note": note,
    }
