"""The slow-body row of the reward service attack benchmark: one tenant holds connections with
complete headers and a body that trickles in, one byte every :data:`BYTE_EVERY_S` seconds.

A service of its own runs as ``m2flow reward-service`` with its file-descriptor limit lowered
to :data:`NOFILE` (so its connection cap is ~1,700, not 4,096; the issue's attack filled all
4,096). The attacker (``bob``, with his token) opens :data:`ATTACK` connections, more than the
cap: each sends a request's headers (``Content-Length: 1000``) and one body byte, then one
byte every 5 s; a connection the service refuses or closes is opened again at the next round,
as an attacker would. Meanwhile the other tenant (``alice``) runs its correct batch, and every
0.4 s this script asks ``/healthz`` and one of alice's own requests (``GET /v1/metrics``),
timing each. The attack runs until alice's batch is done and for at least
:data:`MIN_ATTACK_S` seconds (three byte rounds), then every socket is closed.

Contained: alice's batch intact, every ``/healthz`` and every alice request answered within
3 s, the attacker's connections held by the service (requests in flight, unanswered) at most
its share (``max_requests_per_tenant``), nothing left behind.
"""

from __future__ import annotations

import asyncio
import re
import socket
import statistics
import threading
import time

import httpx
from reward_service_attack_measure import Memory, Service, settle

NOFILE = 2048
ATTACK = 1800
BYTE_EVERY_S = 5.0
MIN_ATTACK_S = 3 * BYTE_EVERY_S
ATTACKER, VICTIM = "bob", "alice"


class Attacker:
    """``ATTACK`` slow-body connections of one tenant: each sends complete headers and a
    body one byte per round; :meth:`round` sends the next byte on the open ones, reads the
    answers that came (429: refused over the share; 408: the body timed out) and reopens the
    connections the service answered or closed."""

    def __init__(self, port: int, token: str, task: str) -> None:
        self.port, self.task = port, task
        self.head = (
            f"POST /v1/tasks/{task}/batches/b/requests HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{"
        ).encode()
        self.socks: list[socket.socket | None] = [None] * ATTACK
        self.answers: dict[str, int] = {}  # status line start -> count
        self.closed = 0  # closed by the service without an answer (at the cap)
        self.held_peak = 0

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            s.sendall(self.head)
            s.setblocking(False)
            return s
        except OSError:
            self.closed += 1
            return None

    def round(self) -> int:
        """One round; returns the connections the service held through it (open since the
        last round, unanswered)."""
        held = 0
        for i, s in enumerate(self.socks):
            if s is not None:
                try:
                    got = s.recv(4096)
                except BlockingIOError:
                    got = None
                except OSError:
                    got = b""
                if got is None:
                    try:
                        s.send(b" ")
                        held += 1
                        continue
                    except OSError:
                        got = b""
                if got:
                    status = got.split(b"\r\n", 1)[0].decode("latin-1")[:12]
                    self.answers[status] = self.answers.get(status, 0) + 1
                else:
                    self.closed += 1
                s.close()
            self.socks[i] = self._open()
        self.held_peak = max(self.held_peak, held)
        return held

    def run(self, stop: threading.Event) -> None:
        """A round every :data:`BYTE_EVERY_S` seconds until ``stop`` is set."""
        while not stop.wait(BYTE_EVERY_S):
            self.round()

    def close(self) -> None:
        for s in self.socks:
            if s is not None:
                s.close()
        self.socks = [None] * ATTACK


def _timed(get) -> float:
    start = time.monotonic()
    try:
        ok = get().status_code == 200
    except httpx.HTTPError:
        ok = False
    return time.monotonic() - start if ok else float("inf")


def slow_body_row(scratch: str, config, tokens: dict, correct_batch) -> dict:
    """Run the attack against a service of its own (``config(scratch, port)``) and return
    the row; ``correct_batch(client, task)``: the victim's batch (True when intact)."""
    from m2flow.reward_service.client import AsyncRewardClient

    t0 = time.monotonic()
    log = f"{scratch}/slowbody-service.log"
    svc = Service(scratch, config, tokens[VICTIM], nofile=NOFILE, log=log)
    port = int(svc.url.rsplit(":", 1)[1])
    with open(log) as f:  # its start-up line: "... at most N connections)"
        cap = int(re.search(r"at most (\d+) connections", f.read()).group(1))
    try:
        from m2flow.reward_service.shares import shares

        share, anonymous = shares(svc.config, cap)
    except ImportError:  # the code before the shares
        share = anonymous = None
    with httpx.Client(base_url=svc.url, timeout=30) as c:  # the attacker's own task
        head = {"Authorization": f"Bearer {tokens[ATTACKER]}"}
        c.post("/v1/tasks", json={"task": "trickle", "pipeline": "code"}, headers=head)
        c.post("/v1/tasks/trickle/batches", json={"size": 1, "batch": "b"}, headers=head)
    mem = Memory(svc.proc.pid)
    attacker = Attacker(port, tokens[ATTACKER], "trickle")
    healthz: list[float] = []
    victim: list[float] = []
    result: dict = {}
    try:
        attacker.round()  # every connection opened once
        t_attack = time.monotonic()

        async def tenant() -> tuple[bool, float]:
            async with AsyncRewardClient(svc.url, tokens[VICTIM], timeout_s=60) as c:
                started = time.monotonic()
                return await correct_batch(c, "under-slow-bodies"), time.monotonic() - started

        runner = asyncio.new_event_loop()
        th = threading.Thread(target=lambda: result.update(r=runner.run_until_complete(tenant())))
        th.start()
        stop = threading.Event()
        rounds = threading.Thread(target=attacker.run, args=(stop,))
        rounds.start()
        mine = httpx.Client(
            base_url=svc.url, headers={"Authorization": f"Bearer {tokens[VICTIM]}"}, timeout=5
        )
        while th.is_alive() or time.monotonic() < t_attack + MIN_ATTACK_S:
            healthz.append(_timed(lambda: httpx.get(f"{svc.url}/healthz", timeout=5)))
            victim.append(_timed(lambda: mine.get("/v1/metrics")))
            time.sleep(0.4)
        mine.close()
        stop.set()
        rounds.join(timeout=120)
        th.join(timeout=120)
        runner.close()
        held_end = attacker.round()
    finally:
        attacker.close()
        mem.stop()
        rc = svc.sigterm()
    procs, dirs = settle(svc.root, lambda: 0)
    intact, other_s = result.get("r", (False, None))
    refused = attacker.answers.get("HTTP/1.1 429", 0)
    contained = (
        intact
        and max(healthz) < 3.0
        and max(victim) < 3.0
        and share is not None
        and attacker.held_peak <= share
        and (procs, dirs) == (0, 0)
    )

    def shown(xs: list[float]) -> str:
        answered = [x for x in xs if x != float("inf")]
        med = statistics.median(answered) if answered else float("nan")
        return f"{len(answered)}/{len(xs)} answered, median {med:.3f} s, slowest {max(xs):.3f} s"

    note = (
        f"{ATTACK} slow-body connections of {ATTACKER} (one byte every {BYTE_EVERY_S:g} s, "
        f"reopened when refused or closed) against a cap of {cap} connections (fd limit "
        f"{NOFILE}; shares: {share} per tenant, {anonymous} anonymous): the service held at "
        f"most {attacker.held_peak} through a round ({held_end} in the last), answers "
        f"{attacker.answers}, "
        f"{attacker.closed} closed without an answer; during it /healthz {shown(healthz)}; "
        f"{VICTIM}'s GET /v1/metrics {shown(victim)}; {VICTIM}'s batch "
        f"{'intact' if intact else 'NOT intact'} in {other_s or 0:.1f} s; service fds peak "
        f"{mem.fds_peak}; exit {rc}"
    )
    return {
        "attack": "slow bodies (one tenant, a byte every 5 s)",
        "attackers": [ATTACKER],
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
        "attacker_held_peak": attacker.held_peak,
        "attacker_refused": refused,
        "share_per_tenant": share,
        "healthz_s": healthz,
        "other_request_s": victim,
        "note": note,
    }
