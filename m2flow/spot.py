"""Preemptible (spot) nodes: which nodes they are, and a local cluster whose spot nodes come
and go for real (RLBoost's setting, on one machine).

A node is preemptible when it carries the Ray resource :data:`SPOT_RESOURCE`
(``ray start --resources '{"m2flow_spot": 1}'``). The :class:`~m2flow.cluster.Cluster` numbers
only the reserved nodes' devices; spot nodes are listed live by :func:`alive_spot_nodes`, since
they join and leave during a run.

:class:`LocalSpotCluster` runs a head node (the reserved cluster) and spot nodes as separate
raylets of ``ray.cluster_utils.Cluster`` on this machine. Removing a spot node kills every
process on it, as a preemption does; :meth:`LocalSpotCluster.replay` adds and removes nodes to
follow an availability trace (``t_s,instances``; :mod:`m2flow.scheduler.spot`), time compressed
by ``time_scale``.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

SPOT_RESOURCE = "m2flow_spot"
#: Set at a run's first logged step (m2flow.runlog): a replayed trace's clock starts there, not
#: during the warm start.
first_step = threading.Event()


def here():
    """A scheduling strategy pinning an actor to this process's node. The runtime's own actors
    (lock service, channels, the rollout manager) are created from reserved nodes and must stay
    there: a 0-CPU actor could otherwise land on a preemptible node and die with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def alive_spot_nodes() -> list[str]:
    """Node ids (hex) of the live preemptible nodes, oldest first."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(SPOT_RESOURCE)]
    return [n["NodeID"] for n in nodes]


class LocalSpotCluster:
    """A head node (reserved) plus spot nodes that come and go, all on this machine.

    Args:
        num_cpus: CPUs of the head node (logical).
        resources: extra head resources (e.g. virtual devices).
        spot_cpus: logical CPUs of each spot node.
        temp_dir: Ray's temp dir (short path).

    Attributes:
        address: to ``ray.init(address=...)``.
        preemptions, joins: counts so far.
    """

    def __init__(
        self,
        num_cpus: int,
        resources: dict[str, float],
        spot_cpus: float = 1.0,
        temp_dir: str | None = None,
    ) -> None:
        from ray.cluster_utils import Cluster

        head: dict[str, Any] = {"num_cpus": num_cpus, "resources": resources}
        if temp_dir:
            head["_temp_dir"] = temp_dir
        self._cluster = Cluster(initialize_head=True, head_node_args=head)
        self.address = self._cluster.address
        self.spot_cpus = spot_cpus
        self._spot: list = []  # live spot nodes, oldest first
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.preemptions = self.joins = 0

    @property
    def spot_nodes(self) -> int:
        return len(self._spot)

    def add_spot(self, n: int = 1) -> None:
        """Start ``n`` spot nodes (waits until they are registered)."""
        with self._guard:
            for _ in range(n):
                node = self._cluster.add_node(
                    num_cpus=self.spot_cpus, resources={SPOT_RESOURCE: 1}, wait=True
                )
                self._spot.append(node)
                self.joins += 1

    def remove_spot(self, n: int = 1, rng: random.Random | None = None) -> None:
        """Preempt ``n`` spot nodes (random ones with ``rng``, else the newest)."""
        with self._guard:
            for _ in range(min(n, len(self._spot))):
                i = rng.randrange(len(self._spot)) if rng else len(self._spot) - 1
                self._cluster.remove_node(self._spot.pop(i), allow_graceful=False)
                self.preemptions += 1

    def remove_node_id(self, node_id: str) -> None:
        """Preempt the spot node with Ray node id ``node_id`` (hex).

        Raises:
            ValueError: no live spot node has that id.
        """
        with self._guard:
            for node in self._spot:
                if node.node_id == node_id:
                    self._spot.remove(node)
                    self._cluster.remove_node(node, allow_graceful=False)
                    self.preemptions += 1
                    return
        raise ValueError(f"no live spot node {node_id}")

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
                if count > self.spot_nodes:
                    self.add_spot(count - self.spot_nodes)
                elif count < self.spot_nodes:
                    self.remove_spot(self.spot_nodes - count, rng)

        self._thread = threading.Thread(target=run, daemon=True, name="spot-trace")
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the replay and every node (call after ``ray.shutdown()``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._cluster.shutdown()
