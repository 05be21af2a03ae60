"""Worker: the base class of every m2flow component (RLinf section 4.1, worker abstraction).

A worker is one rank of a :class:`~m2flow.group.WorkerGroup`, running as a Ray actor on the
devices its placement gives it. Subclasses write plain methods; the group turns each public
method into a group call. Around every group call the worker takes its devices' locks
(:mod:`m2flow.lock`): acquiring a device another worker used last offloads that worker and
onloads this one (context switching, RLinf section 4.3). While a call blocks on data (a channel
``get`` or a ``recv``), the worker yields its devices so a producer on the same devices can run:
no worker ever waits for data while holding a device, which is what makes collocation
deadlock-free.

Subclasses override :meth:`onload` / :meth:`offload` (release and reacquire device memory; no-ops
by default) and use :meth:`timer` for named timings.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import resource
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import ray

from ._env import wait_timeout
from .cluster import NAMESPACE, Device

IO_GROUP = "m2flow_io"  # Ray concurrency group for runtime traffic (deliveries, offload, ping)

_YIELD_GRACE_S = 0.005
_current: Worker | None = None  # the worker hosted by this process, if any


def current_worker() -> Worker | None:
    """The worker this process hosts, or ``None`` in the driver."""
    return _current


def actor_name(group: str, rank: int) -> str:
    """The Ray actor name of a rank, unique within the m2flow namespace."""
    return f"{group}:{rank}"


def no_device_lock(method):
    """Mark a worker method as not touching device memory: its group calls skip the lock.

    Use it for bookkeeping methods (metrics, checkpoint paths) so they can run while another
    worker holds the device.
    """
    method._m2flow_no_device_lock = True
    return method


@dataclass
class WorkerContext:
    """What a rank knows about itself, set before the subclass ``__init__`` runs."""

    group: str
    rank: int
    world_size: int
    devices: list[Device]
    lock_service: object  # Ray actor handle of the LockService, or None for no locking
    launch_index: int = 0  # order of the group's launch: the default lock priority
    cpus: float = 1.0  # CPUs of this rank's devices (its share of the node's CPUs)


@dataclass
class CallStats:
    """One group call on one rank. Times in seconds (``time.time()`` clock)."""

    start: float
    end: float
    wait: float = 0.0  # waiting for device locks or for data (channel get, recv)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def busy(self) -> float:
        """Seconds the call worked: its duration less its waits."""
        return max(self.duration - self.wait, 0.0)


@dataclass
class _LoadState:
    loaded: bool = True
    onloads: int = 0
    offloads: int = 0
    onload_s: float = 0.0  # total seconds spent in onload() / offload()
    offload_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Worker:
    """Base class of every m2flow component.

    Attributes available in ``__init__`` and after: ``rank``, ``world_size``, ``group_name``,
    ``devices`` (this rank's :class:`~m2flow.cluster.Device` list), ``device_ids``.
    """

    _m2flow_ctx: WorkerContext

    #: How a group of this class uses the devices a plan gives it: ``True``, one rank per
    #: device (data parallel); ``False``, one rank over all of them (a model that does not
    #: shard its batch uses them as one wider device: more threads, or CUDA devices for TP).
    data_parallel: bool = True

    @classmethod
    def launch(
        cls,
        cluster,
        placement=None,
        *,
        name: str | None = None,
        num_cpus: float = 0.0,
        lock: bool = True,
        **init_kwargs,
    ):
        """Start one Ray actor per rank of this worker on ``placement``.

        Args:
            cluster: the :class:`~m2flow.cluster.Cluster`.
            placement: global device ids, one per rank (``[0, 1]``), a list per rank
                (``[[0, 1], [2, 3]]``), or an int ``n`` for devices ``0..n-1``. ``None``
                (the default): where the run's plan puts the group ``name``, else every
                device; one rank per device if :attr:`data_parallel`, else one rank.
            name: group name (default: the class name); unique in the run.
            num_cpus: Ray CPU request per rank (fractions allowed; 0 = no reservation).
            lock: take device locks around group calls (collocation-safe; default on).
            **init_kwargs: passed to the subclass ``__init__`` on every rank.

        Returns:
            a :class:`~m2flow.group.WorkerGroup`.

        Raises:
            ValueError: bad placement, or a group of that name already runs.
            WorkerError: a rank's ``__init__`` failed (with its traceback).
        """
        from .group import launch

        return launch(
            cls, cluster, placement, name=name, num_cpus=num_cpus, lock=lock, **init_kwargs
        )

    # -- set-up (runs in the actor before the subclass __init__) ------------------------------

    def _m2flow_bind(self, ctx: WorkerContext) -> None:
        global _current
        self._m2flow_ctx = ctx
        self._m2flow_load = _LoadState()
        self._m2flow_holding = False
        self._m2flow_inbox: dict[tuple[str, int], _Inbox] = defaultdict(_Inbox)
        self._m2flow_inbox_guard = threading.Lock()
        self._m2flow_send_seq: dict[tuple[str, int], itertools.count] = defaultdict(itertools.count)
        self._m2flow_send_guard = threading.Lock()
        self._m2flow_timers: dict[str, list[float]] = defaultdict(list)
        self._m2flow_peers: dict[tuple[str, int], object] = {}
        self._m2flow_call_wait = 0.0
        cuda = [d.local_id for d in ctx.devices if d.kind == "cuda"]
        if cuda:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cuda))
        _current = self
        if ctx.lock_service is not None:
            me = ray.get_runtime_context().current_actor
            ray.get(
                ctx.lock_service.register.remote(
                    self.worker_key, ctx.group, self.device_ids, me, ctx.launch_index
                ),
                timeout=wait_timeout(),
            )

    # -- identity ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._m2flow_ctx.rank

    @property
    def world_size(self) -> int:
        return self._m2flow_ctx.world_size

    @property
    def group_name(self) -> str:
        return self._m2flow_ctx.group

    @property
    def num_threads(self) -> int:
        """CPU threads this rank should use: its devices' share of the node's CPUs (>= 1)."""
        return max(1, int(self._m2flow_ctx.cpus + 1e-9))

    @property
    def devices(self) -> list[Device]:
        return self._m2flow_ctx.devices

    @property
    def device_ids(self) -> list[int]:
        return [d.global_id for d in self._m2flow_ctx.devices]

    @property
    def worker_key(self) -> str:
        return actor_name(self.group_name, self.rank)

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
    def device_lock(self) -> _DeviceLockView:
        """The lock of this rank's devices, for explicit ``with self.device_lock:`` use."""
        return _DeviceLockView(self)

    def _m2flow_acquire(self) -> float:
        """Take this rank's device locks; offload evicted workers, onload self. Returns the
        seconds spent waiting."""
        ctx = self._m2flow_ctx
        if ctx.lock_service is None or self._m2flow_holding:
            return 0.0
        t0 = time.time()
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
        self._m2flow_holding = True
        self._m2flow_onload_if_needed()
        return time.time() - t0

    def _m2flow_release(self) -> None:
        ctx = self._m2flow_ctx
        if ctx.lock_service is None or not self._m2flow_holding:
            return
        self._m2flow_holding = False
        ray.get(ctx.lock_service.release.remote(self.worker_key), timeout=wait_timeout())

    @contextlib.contextmanager
    def _m2flow_yield_devices(self):
        """Release the devices while blocked on data, and take them back afterwards."""
        if not self._m2flow_holding:
            yield
            return
        self._m2flow_release()
        t0 = time.time()
        try:
            yield
        finally:
            self._m2flow_acquire()
            self._m2flow_call_wait += time.time() - t0

    def _m2flow_onload_if_needed(self) -> None:
        st = self._m2flow_load
        with st.lock:
            if not st.loaded:
                t0 = time.perf_counter()
                self.onload()
                st.onload_s += time.perf_counter() - t0
                st.loaded = True
                st.onloads += 1

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_offload(self) -> bool:
        """Offload if loaded (called by the worker taking over this one's device)."""
        st = self._m2flow_load
        with st.lock:
            if not st.loaded:
                return False
            t0 = time.perf_counter()
            self.offload()
            st.offload_s += time.perf_counter() - t0
            st.loaded = False
            st.offloads += 1
            return True

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_ping(self) -> str:
        return self.worker_key

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

    # -- group calls ------------------------------------------------------------------------

    def _m2flow_call(self, method: str, args: tuple, kwargs: dict):
        """Run one public method for a group call; returns ``(result, CallStats)``."""
        fn = getattr(self, method)
        locked = not getattr(fn, "_m2flow_no_device_lock", False)
        start = time.time()
        self._m2flow_call_wait = self._m2flow_acquire() if locked else 0.0
        try:
            result = fn(*args, **kwargs)
        finally:
            if locked:
                self._m2flow_release()
        end = time.time()
        self._m2flow_timers[method].append(end - start)
        return result, CallStats(start, end, self._m2flow_call_wait)

    # -- point to point ---------------------------------------------------------------------

    def _m2flow_peer(self, group: str, rank: int):
        key = (group, rank)
        if key not in self._m2flow_peers:
            self._m2flow_peers[key] = ray.get_actor(actor_name(group, rank), namespace=NAMESPACE)
        return self._m2flow_peers[key]

    def send(self, obj, dst_group: str, dst_rank: int = 0, async_op: bool = False):
        """Send ``obj`` to rank ``dst_rank`` of group ``dst_group``.

        The object goes into the Ray object store once; the receiver gets a reference
        (tensors are not copied through actor mailboxes). With ``async_op=True`` returns a
        :class:`Work` whose ``wait()`` returns when the receiver's inbox holds the object.

        Raises:
            ValueError: no such group/rank is running.
        """
        work = self._m2flow_deliver_to(ray.put(obj), dst_group, dst_rank)
        return work if async_op else work.wait()

    def broadcast(self, obj, dst_group: str, dst_world_size: int) -> None:
        """Send ``obj`` to ranks ``0..dst_world_size-1`` of ``dst_group`` and wait until every
        inbox holds it. The object goes into the object store once; every receiver gets the
        same reference (``send`` per rank would store one copy per rank).

        Raises:
            ValueError: no such group/rank is running.
        """
        ref = ray.put(obj)
        works = [self._m2flow_deliver_to(ref, dst_group, r) for r in range(dst_world_size)]
        for w in works:
            w.wait()

    def _m2flow_deliver_to(self, ref, dst_group: str, dst_rank: int) -> Work:
        try:
            peer = self._m2flow_peer(dst_group, dst_rank)
        except ValueError:
            raise ValueError(
                f"send from {self.worker_key}: no worker '{actor_name(dst_group, dst_rank)}' is "
                "running; check the group name and rank"
            ) from None
        with self._m2flow_send_guard:  # numbers follow submission order
            seq = next(self._m2flow_send_seq[(dst_group, dst_rank)])
            return Work(peer._m2flow_deliver.remote(self.group_name, self.rank, seq, [ref]))

    def recv(
        self,
        src_group: str,
        src_rank: int = 0,
        async_op: bool = False,
        timeout: float | None = None,
    ):
        """Receive the next object sent by rank ``src_rank`` of ``src_group`` (FIFO per sender).

        Blocks up to ``timeout`` seconds (default ``M2FLOW_WAIT_TIMEOUT``), yielding this
        worker's devices meanwhile. With ``async_op=True`` returns a :class:`Work` whose
        ``wait()`` does the receive.

        Raises:
            TimeoutError: nothing arrived in time.
        """
        if async_op:
            return Work(run=lambda: self.recv(src_group, src_rank, timeout=timeout))
        timeout = wait_timeout() if timeout is None else timeout
        with self._m2flow_inbox_guard:
            box = self._m2flow_inbox[(src_group, src_rank)]
        if box.ready():
            ref = box.take(0)
        else:
            with self._m2flow_yield_devices():
                ref = box.take(timeout)
        if ref is None:
            raise TimeoutError(
                f"{self.worker_key}: nothing received from "
                f"{actor_name(src_group, src_rank)} in {timeout:.0f} s"
            )
        return ray.get(ref[0])

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_deliver(self, src_group: str, src_rank: int, seq: int, ref: list) -> None:
        with self._m2flow_inbox_guard:
            box = self._m2flow_inbox[(src_group, src_rank)]
        box.deliver(seq, ref)

    # -- timers -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def timer(self, name: str):
        """Time a block; read back with :meth:`pop_timings`. Seconds."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._m2flow_timers[name].append(time.perf_counter() - t0)

    @no_device_lock
    def pop_timings(self) -> dict[str, float]:
        """Sum of each timer since the last call, in seconds, then reset."""
        out = {k: float(sum(v)) for k, v in self._m2flow_timers.items()}
        self._m2flow_timers.clear()
        return out


class _Inbox:
    """Objects from one sender, handed out in the sender's order (deliveries run on several
    threads, so they may arrive out of order)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: dict[int, list] = {}
        self._next = 0

    def deliver(self, seq: int, ref: list) -> None:
        with self._cv:
            self._items[seq] = ref
            self._cv.notify_all()

    def ready(self) -> bool:
        with self._cv:
            return self._next in self._items

    def take(self, timeout: float) -> list | None:
        """The next object in order, or ``None`` after ``timeout`` seconds."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._next in self._items, timeout):
                return None
            self._next += 1
            return self._items.pop(self._next - 1)


class _DeviceLockView:
    """``with worker.device_lock:`` takes the rank's devices outside a group call."""

    def __init__(self, worker: Worker) -> None:
        self._w = worker

    def __enter__(self):
        self._w._m2flow_acquire()
        return self

    def __exit__(self, *exc):
        self._w._m2flow_release()


class Work:
    """Handle of an asynchronous operation; ``wait()`` (or ``await``) returns its result.

    Built from a Ray ``ref`` (optionally post-processed by ``then``) or from a deferred
    callable ``run``. With ``yields=True`` (waits for data), waiting inside a worker yields
    the worker's devices while the result is not ready.
    """

    def __init__(self, ref=None, then=None, run=None, yields: bool = False) -> None:
        self._ref, self._then, self._run, self._yields = ref, then, run, yields

    def wait(self, timeout: float | None = None):
        if self._run is not None:
            return self._run()
        timeout = wait_timeout() if timeout is None else timeout
        worker = current_worker()
        if self._yields and worker is not None and worker._m2flow_holding:
            # A short grace first: data already queued comes back within a round trip,
            # without giving the devices away and taking them back.
            ready, _ = ray.wait([self._ref], timeout=_YIELD_GRACE_S)
            if not ready:
                with worker._m2flow_yield_devices():
                    ray.wait([self._ref], timeout=timeout)
        value = ray.get(self._ref, timeout=timeout)
        return self._then(value) if self._then is not None else value

    def __await__(self):
        import asyncio

        return asyncio.get_running_loop().run_in_executor(None, self.wait).__await__()


# Base-class methods that are group methods too (everything else of Worker is runtime API).
_BASE_GROUP_METHODS = frozenset({"pop_timings"})


@functools.cache
def public_methods(cls: type) -> frozenset[str]:
    """Names of the methods a group exposes: public callables the subclass defines, plus
    :meth:`Worker.pop_timings`."""
    base = set(dir(Worker)) - _BASE_GROUP_METHODS
    return frozenset(
        n
        for n in dir(cls)
        if not n.startswith("_") and callable(getattr(cls, n, None)) and n not in base
    )
