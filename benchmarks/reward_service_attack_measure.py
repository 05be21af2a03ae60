"""Measurements and the service process of the reward service attack benchmark
(``benchmarks/reward_service_attack.py``): memory (RSS of the service and its workers) and
open file descriptors sampled every 20 ms, sandbox processes and scratch directories left
behind, and ``m2flow reward-service`` run in a subprocess (optionally under a lowered
file-descriptor limit)."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

try:
    import psutil
except ImportError:  # not a dependency: /proc gives the same numbers on Linux
    psutil = None


def fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (0 if it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def rss(pid: int) -> tuple[int, int]:
    """(RSS, peak RSS) of ``pid`` in bytes: RSS from psutil if installed, else /proc; the peak
    (VmHWM, which no sampling misses) from /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kv = dict(ln.split(":", 1) for ln in f if ":" in ln)
        rss, hwm = (int(kv[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))
    except (OSError, KeyError, ValueError):
        return 0, 0
    if psutil is not None:
        try:
            rss = psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return rss, hwm


def workers(parent: int) -> list[int]:
    """The reward worker processes whose parent is ``parent``."""
    out = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if b"reward_service.worker" in f.read():
                        out.append(int(p))
        except (OSError, ValueError, IndexError):
            pass
    return out


class Memory:
    """Samples RSS of the service process + its workers every 20 ms (peak of the sum), the
    largest worker peak RSS (VmHWM), the service process's growth over the window, and the
    peak of its open file descriptors."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = self.worker_hwm = self.service_growth = self.fds_peak = 0
        self._base = rss(pid)[0]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            own = rss(self.pid)[0]
            total = own
            for w in workers(self.pid):
                now, hwm = rss(w)
                total += now
                self.worker_hwm = max(self.worker_hwm, hwm)
            self.peak = max(self.peak, total)
            self.service_growth = max(self.service_growth, own - self._base)
            self.fds_peak = max(self.fds_peak, fds(self.pid))
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)


def leftovers(root: str, live_workers: int) -> tuple[int, int]:
    """(sandbox processes, scratch directories) left under the scratch root ``root``:
    processes whose working directory is in it (a sandbox's ``unshare``, harness and test
    child all work in their scratch directory; workers do not), sandbox directories, and
    worker directories beyond the ``live_workers`` still running."""
    procs = 0
    for p in os.listdir("/proc"):
        try:
            procs += os.readlink(f"/proc/{p}/cwd").startswith(root + "/")
        except OSError:
            pass
    dirs = 0
    if os.path.isdir(root):
        workers = [d for d in os.listdir(root) if d.startswith("w-")]
        dirs += max(0, len(workers) - live_workers)
        for w in workers:
            try:
                dirs += sum(1 for d in os.listdir(os.path.join(root, w)) if d.startswith("sbx-"))
            except OSError:
                pass
    return procs, dirs


def settle(root: str, live, timeout_s: float = 10.0) -> tuple[int, int]:
    """Leftovers once everything had ``timeout_s`` to go away; ``live()``: workers alive."""
    end = time.monotonic() + timeout_s
    while True:
        left = leftovers(root, live())
        if left == (0, 0) or time.monotonic() > end:
            return left
        time.sleep(0.1)


def wait_for_sandbox(root: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while leftovers(root, 1 << 30)[0] == 0 and time.monotonic() < end:
        time.sleep(0.1)


class Service:
    """``m2flow reward-service`` (the CLI module) in a subprocess: what is measured is that
    process and its workers, not this script's clients."""

    def __init__(self, scratch: str, config, token: str, nofile: int | None = None,
                 log: str | None = None) -> None:  # fmt: skip
        """``config(scratch, port)``: the service's :class:`ServiceConfig`; ``token``: a
        tenant's, for metrics; ``nofile``: the service's RLIMIT_NOFILE (default: inherited);
        ``log``: file for its output (default: discarded)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cfg = Path(scratch) / "service.json"
        self.config = config(scratch, port)
        cfg.write_text(self.config.model_dump_json())
        self.scratch = scratch
        self.url = f"http://127.0.0.1:{port}"

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.log = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "m2flow.reward_service.cli", "--config", str(cfg)],
            stdout=self.log, stderr=self.log if log else None, preexec_fn=limit,
        )  # fmt: skip
        end = time.monotonic() + 60
        while not self._healthy():
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError("reward service did not start")
            time.sleep(0.2)
        (name,) = [
            d for d in os.listdir(scratch) if d.startswith(f"m2flow-reward-{self.proc.pid}-")
        ]
        self.root = os.path.join(scratch, name)
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict:
        return self.http.get("/v1/metrics").json()

    def live_workers(self) -> int:
        pools = self.metrics()["pools"].values()
        return sum(p["idle"] + p["busy"] + p["starting"] for p in pools)

    def sigterm(self, timeout_s: float = 60.0) -> int:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            if self.log is not subprocess.DEVNULL:
                self.log.close()
