"""Cluster: the Ray session m2flow runs on and its inventory of devices.

Devices are numbered globally, node-major (RLinf section 3.1: the controller assigns workers
to accelerators): the head node's devices come first, then the other nodes in a stable order.
Placement is always by these global ids, never by Ray's packed/spread bundles.

A node with GPUs exposes them as ``cuda`` devices. A node without accelerators exposes *virtual
devices*: CPU slots with a declared memory capacity, so that placement, device locks and plans
behave exactly as on GPUs. A node declares its virtual devices through the Ray custom resource
``m2flow_virtual_device`` (set by the embedded init, or by ``ray start --resources``); where a
node declares none, ``virtual_devices_per_node`` is used.
"""

from __future__ import annotations

import logging
import os
import tempfile
import weakref
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from .._context import NAMESPACE, current_session, wait_name_free  # noqa: F401 (public)
from .._env import apply_ray_env_defaults, ray_temp_dir, release_ray_temp_dir, wait_timeout

logger = logging.getLogger(__name__)

VIRTUAL_DEVICE_RESOURCE = "m2flow_virtual_device"
GiB = 1 << 30


class Offload(StrEnum):
    """What a device switch does to the worker leaving the device (see :class:`Cluster`)."""

    auto = "auto"
    always = "always"
    never = "never"


# Ray resolves "127.0.0.1"/"localhost" to the machine's routable IP; another loopback address
# keeps the embedded session on loopback.
_LOOPBACK = "127.0.0.2"


@dataclass(frozen=True)
class Device:
    """One device of the cluster.

    Attributes:
        global_id: node-major global index, the id placements use.
        node_id: Ray node id (hex) the device lives on.
        node_index: index of the node in the cluster's node order.
        local_id: index on its node (the ``CUDA_VISIBLE_DEVICES`` value for ``cuda``).
        kind: ``"cuda"`` or ``"virtual"``.
        memory_bytes: capacity in bytes (declared for virtual devices).
    """

    global_id: int
    node_id: str
    node_index: int
    local_id: int
    kind: str
    memory_bytes: int


@dataclass(frozen=True)
class Node:
    """A Ray node in the cluster's order. ``is_head`` nodes come first."""

    index: int
    node_id: str
    address: str
    is_head: bool
    num_cpus: float
    devices: tuple[Device, ...]


class Cluster:
    """The Ray session and device inventory.

    Args:
        address: ``None`` starts an embedded local Ray (loopback, no dashboard, usage stats
            off, temp dir under ``run_dir``); ``"auto"`` or ``"host:port"`` joins a running
            cluster; an already-initialised Ray session is reused as it is.
        num_cpus: CPUs for the embedded Ray (default: all of this machine's).
        virtual_devices_per_node: virtual devices on a node that has no GPU and declares no
            ``m2flow_virtual_device`` resource.
        device_memory_gb: declared capacity of each virtual device, in GiB.
        run_dir: the run's directory: the embedded Ray keeps its session in
            ``<run_dir>/ray`` (:func:`m2flow._env.ray_temp_dir`; without one, in the
            system temp dir's ``m2flow/ray``).
        spot: a :class:`~m2flow.core.spot.LocalSpotCluster` to run on (its head node is the reserved
            cluster; its spot nodes are preemptible): the Cluster owns it and stops it on
            shutdown.
        offload: what a device switch does to the worker leaving the device. ``"always"``:
            offload it (RLinf's context switch, section 3.3); ``"never"``: keep every worker
            resident (for devices whose memory holds them all); ``"auto"`` (default):
            ``"always"`` on GPUs, ``"never"`` on virtual devices, whose "device memory" is host
            RAM either way, so offloading there costs time and frees nothing.

    Raises:
        ValueError: a cluster with no device at all (nothing can be placed), or an unknown
            ``offload`` value.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        virtual_devices_per_node: int = 1,
        device_memory_gb: float = 16.0,
        run_dir: str | os.PathLike | None = None,
        offload: str | Offload = Offload.auto,
        spot=None,
    ) -> None:
        import ray

        try:
            offload = Offload(offload)
        except ValueError:
            choices = ", ".join(m.value for m in Offload)
            raise ValueError(f"offload={offload!r}: use one of {choices}") from None
        apply_ray_env_defaults()
        self.run_dir = Path(run_dir) if run_dir else None
        self._owns_ray = spot is not None  # the local spot cluster's driver is this process
        self.spot = spot  # a m2flow.core.spot.LocalSpotCluster this cluster runs on, if any
        self._ray_link = None  # a short link to the run's Ray temp dir (deep run dirs)
        if not ray.is_initialized():
            if address is None:
                root = run_dir or Path(tempfile.gettempdir()) / "m2flow"
                temp_dir, self._ray_link = ray_temp_dir(root)
                ray.init(
                    num_cpus=num_cpus,
                    resources={VIRTUAL_DEVICE_RESOURCE: virtual_devices_per_node},
                    include_dashboard=False,
                    namespace=NAMESPACE,
                    _node_ip_address=_LOOPBACK,
                    _temp_dir=temp_dir,
                    log_to_driver=True,
                    configure_logging=False,
                )
            else:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
            self._owns_ray = True
        from .lock import get_lock_service

        # The Cluster owns the run's lock service: an actor lives while its owner holds it.
        self.lock_service = get_lock_service()
        self.groups: list = []  # worker groups launched on this cluster, for shutdown
        self.calls: weakref.WeakSet = weakref.WeakSet()  # group calls not waited yet
        self.virtual_devices_per_node = virtual_devices_per_node
        self.device_memory_bytes = int(device_memory_gb * GiB)
        self.nodes: list[Node] = self._inventory()
        self.devices: list[Device] = [d for n in self.nodes for d in n.devices]
        if not self.devices:
            raise ValueError(
                "the Ray cluster has no devices: no node has a GPU or an "
                f"'{VIRTUAL_DEVICE_RESOURCE}' resource; pass virtual_devices_per_node >= 1"
            )
        self.offload = offload
        keep = [
            d.global_id
            for d in self.devices
            if offload is Offload.never or (offload is Offload.auto and d.kind == "virtual")
        ]
        ray.get(self.lock_service.configure.remote(keep), timeout=wait_timeout())
        session = current_session()
        # The run's placement (a m2flow.core.placement.Placement from a plan, or None) needs this
        # cluster's devices to be resolved.
        self.placement = session.resolve(self) if session else None
        if session is not None:
            session.start_trace(self.run_dir)

    # -- inventory -------------------------------------------------------------------------

    def _inventory(self) -> list[Node]:
        import ray

        from .spot import SPOT_RESOURCE

        # Preemptible nodes come and go: their devices are not numbered (m2flow.core.spot).
        alive = [n for n in ray.nodes() if n.get("Alive") and not n["Resources"].get(SPOT_RESOURCE)]
        # Head first, then a stable order, so global ids do not change between calls.
        alive.sort(
            key=lambda n: (
                "node:__internal_head__" not in n["Resources"],
                n["NodeManagerAddress"],
                n["NodeManagerPort"],
            )
        )
        nodes, next_id = [], 0
        for index, raw in enumerate(alive):
            res = raw["Resources"]
            gpus = int(res.get("GPU", 0))
            if gpus:
                kind, count, mem = "cuda", gpus, _gpu_memory_bytes()
            else:
                declared = int(res.get(VIRTUAL_DEVICE_RESOURCE, 0))
                kind = "virtual"
                count = declared or self.virtual_devices_per_node
                mem = self.device_memory_bytes
            devices = tuple(
                Device(next_id + i, raw["NodeID"], index, i, kind, mem) for i in range(count)
            )
            next_id += count
            nodes.append(
                Node(
                    index=index,
                    node_id=raw["NodeID"],
                    address=raw["NodeManagerAddress"],
                    is_head="node:__internal_head__" in res,
                    num_cpus=float(res.get("CPU", 0)),
                    devices=devices,
                )
            )
        return nodes

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def device(self, global_id: int) -> Device:
        """The device with this global id.

        Raises:
            ValueError: the id is outside ``[0, num_devices)``.
        """
        if not 0 <= global_id < len(self.devices):
            raise ValueError(
                f"device id {global_id} is out of range: this cluster has {len(self.devices)} "
                f"devices (ids 0..{len(self.devices) - 1}); fix the placement or declare more "
                "devices (cluster.devices_per_node)"
            )
        return self.devices[global_id]

    def devices_for(self, group: str) -> list[int]:
        """Device ids for ``group`` when its launch names none: the run's placement, else
        every device (temporal: collocated groups share them through the device locks)."""
        if self.placement is not None:
            return self.placement.devices_for(group, self)
        return [d.global_id for d in self.devices]

    def cpus_per_device(self, device: Device) -> float:
        """CPUs of the device's node divided by its devices (threads a rank may use)."""
        node = self.nodes[device.node_index]
        return node.num_cpus / max(len(node.devices), 1)

    def describe(self) -> str:
        """One line per node: address, CPUs and devices."""
        lines = []
        for n in self.nodes:
            ids = [d.global_id for d in n.devices]
            kind = n.devices[0].kind if n.devices else "-"
            mem = n.devices[0].memory_bytes / GiB if n.devices else 0
            lines.append(
                f"node {n.index}{' (head)' if n.is_head else ''} {n.address}: "
                f"{n.num_cpus:g} CPUs, {kind} devices {ids} x {mem:.0f} GiB"
            )
        return "\n".join(lines)

    def shutdown(self) -> None:
        """Stop what this Cluster started: Ray itself if it started it, else the worker groups
        launched on it and the channels this process created (so a runner can run twice in
        one Ray session)."""
        import ray

        from .channel import created_channels, forget_channels

        session = current_session()
        if session is not None and ray.is_initialized():
            session.close_trace(self.groups)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            if self.spot is not None:
                self.spot.shutdown()
                self.spot = None
            release_ray_temp_dir(self._ray_link)
        elif ray.is_initialized():
            for group in self.groups:
                group.shutdown()
            for ch in created_channels().values():
                ch.close()
        forget_channels()
        self.groups.clear()
        self._owns_ray = False

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _gpu_memory_bytes() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:  # torch missing or no driver on the driver node: capacity unknown
        pass
    return 0
