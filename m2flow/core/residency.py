"""Device residency: device locks around group calls, offload and onload (RLinf section 3.3).

Around every group call that takes the device lock the worker acquires its devices' locks
(:mod:`m2flow.core.lock`); acquiring a device another worker used last offloads that worker and
onloads this one (context switching). While a call blocks on data (a channel ``get`` or a
``recv``) the worker yields its devices, so a producer on the same devices can run: no worker
waits for data while holding a device, which is what makes collocation deadlock-free.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
import time
from dataclasses import dataclass, field

import ray

from .._env import wait_timeout
from . import events
from .mailbox import IO_GROUP


@dataclass
class LoadState:
    """Whether the worker's state is on its devices, and what switching cost so far."""

    loaded: bool = True
    onloads: int = 0
    offloads: int = 0
    onload_s: float = 0.0  # total seconds spent in onload() / offload()
    offload_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Residency:
    """The device-lock and offload part of :class:`~m2flow.core.worker.Worker` (mixed in)."""

    def _m2flow_init_residency(self) -> None:
        self._m2flow_load = LoadState()
        self._m2flow_holding = False
        self._m2flow_call_wait = 0.0

    @property
    def is_offloaded(self) -> bool:
        return not self._m2flow_load.loaded

    # -- memory: subclasses override ----------------------------------------------------------

    def onload(self) -> None:
        """Bring this worker's state back onto its devices. No-op by default."""

    def offload(self) -> None:
        """Release this worker's device memory (weights, optimizer state, caches). No-op by
        default. Called by the runtime when another worker takes the device."""

    # -- device lock ------------------------------------------------------------------------

    @property
    def device_lock(self) -> DeviceLockView:
        """The lock of this rank's devices, for explicit ``with self.device_lock:`` use."""
        return DeviceLockView(self)

    def _m2flow_acquire(self) -> float:
        """Take this rank's device locks; offload evicted workers, onload self. Returns the
        seconds spent waiting."""
        ctx = self._m2flow_ctx
        if not ctx.lock or self._m2flow_holding:
            return 0.0
        t0, t0_ns = time.time(), events.now()
        evict = ray.get(
            ctx.lock_service.acquire.remote(self.worker_key, wait_timeout()),
            timeout=wait_timeout() + 30,
        )
        # The previous holders released these devices but still sit in their memory: they
        # leave before we come in (a different worker is taking over).
        for ref in [h._m2flow_offload.remote() for h in evict]:
            try:
                ray.get(ref, timeout=wait_timeout())
            except ray.exceptions.RayActorError:  # died meanwhile: its memory is gone anyway
                pass
        events.record("lock_wait", "device lock", t0_ns, evicted=len(evict))
        self._m2flow_holding = True
        self._m2flow_onload_if_needed()
        return time.time() - t0

    def _m2flow_release(self, reserve: bool = False) -> None:
        # Worker overrides this with a non-blocking release that can keep a reservation.
        ctx = self._m2flow_ctx
        if not ctx.lock or not self._m2flow_holding:
            return
        self._m2flow_holding = False
        ray.get(ctx.lock_service.release.remote(self.worker_key), timeout=wait_timeout())

    @contextlib.contextmanager
    def _m2flow_yield_devices(self):
        """Release the devices while blocked on data, and take them back afterwards.

        The release keeps a reservation (:mod:`m2flow.core.lock`): a worker waiting for them, or
        asking later, gets them at once, but when nobody does (a cycle member whose device
        another group uses only at other times of the step) taking them back costs no round
        trip to the lock service. Without it every wait for data cost two round trips: 33 per
        step for an embodied env on the actor's device (docs/results/planning.md, "Cycles split
        across devices")."""
        if not self._m2flow_holding:
            yield
            return
        self._m2flow_release(reserve=True)
        t0, t0_ns = time.time(), events.now()
        try:
            yield
        finally:
            self._m2flow_acquire()
            self._m2flow_call_wait += time.time() - t0
            events.record("handoff", "devices yielded", t0_ns)

    def _m2flow_onload_if_needed(self) -> None:
        st = self._m2flow_load
        with st.lock:
            if not st.loaded:
                t0, t0_ns = time.perf_counter(), events.now()
                self.onload()
                st.onload_s += time.perf_counter() - t0
                events.record("onload", "onload", t0_ns)
                st.loaded = True
                st.onloads += 1

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_offload(self) -> bool:
        """Offload if loaded (called by the worker taking over this one's device)."""
        st = self._m2flow_load
        with st.lock:
            if not st.loaded:
                return False
            t0, t0_ns = time.perf_counter(), events.now()
            self.offload()
            st.offload_s += time.perf_counter() - t0
            events.record("offload", "offload", t0_ns, track="io")
            st.loaded = False
            st.offloads += 1
            return True

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_load_stats(self) -> dict:
        """``{"loaded", "onloads", "offloads", "onload_s", "offload_s", "peak_memory_bytes"}``
        of this rank (seconds are totals; memory: see :meth:`peak_memory_bytes`)."""
        st = self._m2flow_load
        return {
            "loaded": st.loaded,
            "onloads": st.onloads,
            "offloads": st.offloads,
            "onload_s": st.onload_s,
            "offload_s": st.offload_s,
            "peak_memory_bytes": self.peak_memory_bytes(),
        }

    def peak_memory_bytes(self) -> int:
        """Peak device memory of this rank, bytes: CUDA's peak allocation on a GPU; on a
        virtual device, the process's peak resident set (an upper bound: it includes the
        Python runtime and libraries). Subclasses may override with a tighter figure."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class DeviceLockView:
    """``with worker.device_lock:`` takes the rank's devices outside a group call."""

    def __init__(self, worker: Residency) -> None:
        self._w = worker

    def __enter__(self):
        self._w._m2flow_acquire()
        return self

    def __exit__(self, *exc):
        self._w._m2flow_release()
