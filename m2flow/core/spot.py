"""Preemptible (spot) nodes: which nodes they are, and a local cluster whose spot nodes come
and go for real (RLBoost's setting, on one machine).

A node is preemptible when it carries the Ray resource :data:`SPOT_RESOURCE`
(``ray start --resources '{"m2flow_spot": 1}'``). The :class:`~m2flow.core.cluster.Cluster` numbers
only the reserved nodes' devices; spot nodes are listed live by :func:`alive_spot_nodes`, since
they join and leave during a run.

:class:`LocalSpotCluster` runs a head node (the reserved cluster) and spot nodes as separate
``ray start`` processes on this machine. Removing a spot node kills every process on it, as a
preemption does; :meth:`LocalSpotCluster.replay` adds and removes nodes to
follow an availability trace (``t_s,instances``; :mod:`m2flow.scheduler.spot`), time compressed
by ``time_scale``.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from .._context import here  # noqa: F401 (public path: m2flow.core.spot.here)
from .._env import ray_temp_dir, release_ray_temp_dir
from .reaper import Reaper, kill_tree

SPOT_RESOURCE = "m2flow_spot"
LOOPBACK = "127.0.0.2"  # as the embedded cluster's: Ray maps 127.0.0.1 to a routable address
#: Set at a run's first logged step (m2flow.run.runlog): a replayed trace's clock starts there, not
#: during the warm start.
first_step = threading.Event()


def alive_spot_nodes() -> list[str]:
    """Node ids (hex) of the live preemptible nodes, oldest first."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(SPOT_RESOURCE)]
    return [n["NodeID"] for n in nodes]


@dataclass
class _SpotNode:
    proc: subprocess.Popen
    node_id: str


class LocalSpotCluster:
    """A head node (reserved) plus spot nodes that come and go, all on this machine.

    The head and each spot node are ``ray start --block`` processes on one loopback address
    (so nodes can be added and removed from any thread, e.g. a trace replay; Ray rewrites
    127.0.0.1 to a routable address, not 127.0.0.2); this process connects as the driver.
    Removing a spot node kills its whole process tree at once (raylet, object store, workers;
    Linux ``/proc``), as a preemption does.

    Every node keeps its Ray session under ``temp_root``'s ``ray/`` (the run's directory:
    :func:`m2flow._env.ray_temp_dir`), where ``ray start --head`` also writes its
    current-cluster pointer: nothing goes to Ray's machine-wide temp dir, and the machine's
    pointer (``/tmp/ray/ray_current_cluster``, which any ``ray.init(address="auto")`` on the
    machine reads) is left as it was. Without ``temp_root``, a temporary directory of its own,
    removed at :meth:`shutdown`.

    Args:
        num_cpus: CPUs of the head node (logical).
        resources: extra head resources (e.g. virtual devices).
        spot_cpus: logical CPUs of each spot node.
        temp_root: the run's directory (Ray's session goes to ``temp_root/ray``).

    Attributes:
        address: to ``ray.init(address=...)``.
        preemptions, joins: counts so far.
    """

    def __init__(
        self,
        num_cpus: int,
        resources: dict[str, float],
        spot_cpus: float = 1.0,
        temp_root: str | os.PathLike | None = None,
    ) -> None:
        import ray

        with socket.socket() as sock:
            sock.bind((LOOPBACK, 0))
            port = sock.getsockname()[1]
        self.address = f"{LOOPBACK}:{port}"
        self.spot_cpus = spot_cpus
        self._own_root = None if temp_root else tempfile.mkdtemp(prefix="m2flow-spot-")
        self.temp_dir, self._link = ray_temp_dir(temp_root or self._own_root)
        # ends the nodes if this process is SIGKILLed (nothing of ours runs then)
        self._reaper = Reaper()
        for scratch in (self._link, self._own_root):  # and what it made outside the run
            if scratch is not None:
                self._reaper.remove(scratch)
        self._head = _ray_start(
            ["--head", f"--port={port}", f"--num-cpus={num_cpus:g}",
             f"--resources={json.dumps(resources)}", "--include-dashboard=false"],
            self.temp_dir,
        )  # fmt: skip
        self._reaper.watch(self._head.pid)
        try:
            ray.init(address=self.address, _node_ip_address=LOOPBACK, namespace="m2flow")
        except BaseException:
            kill_tree(self._head.pid)
            self._reaper.close()
            self._release_temp()
            raise
        self._spot: list[_SpotNode] = []  # live spot nodes, oldest first
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._serial = 0
        self.preemptions = self.joins = 0
        # Its nodes run in sessions of their own (a terminal's signals miss them): they end
        # with this process on a normal exit or an error (atexit) and on SIGTERM (raised as
        # SystemExit, so the run's cleanup runs as for Ctrl-C's KeyboardInterrupt); on SIGKILL
        # the reaper ends them.
        atexit.register(self._at_exit)
        self._sigterm = None
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)

    @property
    def spot_nodes(self) -> int:
        return len(self._spot)

    def add_spot(self, n: int = 1, timeout: float = 120.0) -> None:
        """Start ``n`` spot nodes and wait until each is registered.

        Raises:
            TimeoutError: a node did not register within ``timeout`` seconds.
        """
        import ray

        with self._guard:
            for _ in range(n):
                if self._stop.is_set():  # shutting down: start nothing more
                    return
                self._serial += 1
                tag = f"m2flow_spot_node_{self._serial}"
                res = json.dumps({SPOT_RESOURCE: 1, tag: 1})
                proc = _ray_start(
                    [f"--address={self.address}", f"--num-cpus={self.spot_cpus:g}",
                     f"--resources={res}"],
                    self.temp_dir,
                )  # fmt: skip
                self._reaper.watch(proc.pid)
                try:
                    deadline = time.monotonic() + timeout
                    while True:
                        ids = [x["NodeID"] for x in ray.nodes()
                               if x.get("Alive") and x["Resources"].get(tag)]  # fmt: skip
                        if ids:
                            break
                        if self._stop.is_set():
                            raise RuntimeError(f"spot node {tag}: the cluster is shutting down")
                        if time.monotonic() > deadline or proc.poll() is not None:
                            raise TimeoutError(f"spot node {tag} did not join in {timeout:.0f} s")
                        time.sleep(0.1)
                except BaseException:  # Ray gone (shutdown began), a timeout, a signal
                    kill_tree(proc.pid)
                    proc.wait(timeout=30)
                    self._reaper.forget(proc.pid)
                    raise
                self._spot.append(_SpotNode(proc, ids[0]))
                self.joins += 1

    def remove_spot(self, n: int = 1, rng: random.Random | None = None) -> None:
        """Preempt ``n`` spot nodes (random ones with ``rng``, else the newest)."""
        with self._guard:
            for _ in range(min(n, len(self._spot))):
                i = rng.randrange(len(self._spot)) if rng else len(self._spot) - 1
                self._kill(self._spot.pop(i))

    def remove_node_id(self, node_id: str) -> None:
        """Preempt the spot node with Ray node id ``node_id`` (hex).

        Raises:
            ValueError: no live spot node has that id.
        """
        with self._guard:
            for node in self._spot:
                if node.node_id == node_id:
                    self._spot.remove(node)
                    self._kill(node)
                    return
        raise ValueError(f"no live spot node {node_id}")

    def _kill(self, node: _SpotNode) -> None:
        kill_tree(node.proc.pid)
        node.proc.wait(timeout=30)
        self._reaper.forget(node.proc.pid)
        self.preemptions += 1

    def replay(self, trace: list[tuple[float, int]], time_scale: float = 1.0, seed: int = 0,
               start: threading.Event | None = None) -> None:  # fmt: skip
        """Follow ``trace`` in a background thread: at ``t_s / time_scale`` seconds after
        ``start`` is set (at once without it), keep ``instances`` spot nodes (preempting random
        ones when the count drops)."""
        rng = random.Random(seed)

        def run() -> None:
            if start is not None:
                while not start.wait(0.2):
                    if self._stop.is_set():
                        return
            t0 = time.monotonic()
            for t_s, count in trace:
                if self._stop.wait(max(0.0, t0 + t_s / time_scale - time.monotonic())):
                    return
                try:
                    if count > self.spot_nodes:
                        self.add_spot(count - self.spot_nodes)
                    elif count < self.spot_nodes:
                        self.remove_spot(self.spot_nodes - count, rng)
                except Exception:
                    if self._stop.is_set():  # shutdown began mid-change: nothing left to do
                        return
                    raise

        self._thread = threading.Thread(target=run, daemon=True, name="spot-trace")
        self._thread.start()

    def _at_exit(self) -> None:
        import ray

        if ray.is_initialized():  # the driver first, while its cluster is still there
            ray.shutdown()
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the replay and every node (call after ``ray.shutdown()``; again is a no-op)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._guard:
            for node in self._spot:
                kill_tree(node.proc.pid)
                node.proc.wait(timeout=30)
            self._spot.clear()
        kill_tree(self._head.pid)
        self._head.wait(timeout=30)
        self._reaper.close()
        self._release_temp()
        atexit.unregister(self._at_exit)
        if self._sigterm is not None and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def _release_temp(self) -> None:
        release_ray_temp_dir(self._link)
        if self._own_root is not None:  # no run directory: the session goes with the cluster
            shutil.rmtree(self._own_root, ignore_errors=True)
            self._own_root = None


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _ray_start(args: list[str], temp_dir: str) -> subprocess.Popen:
    """``ray start --block`` with ``args`` on :data:`LOOPBACK`, its own session, its files
    (and the current-cluster pointer ``ray start`` writes) under ``temp_dir``."""
    return subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
         f"--node-ip-address={LOOPBACK}", "--disable-usage-stats", f"--temp-dir={temp_dir}",
         *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        # With "0" (our CI default) Ray keeps every node single-node: this cluster is not.
        # A removed node refuses the GCS's health checks at once: checked every 0.5 s (not 3 s)
        # it is marked dead in ~2.5 s, not ~15 s, so the pool does not start instances on it
        # meanwhile; a live but slow node still answers within the 10 s timeout.
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
             "RAY_health_check_period_ms": "500"},
    )  # fmt: skip
