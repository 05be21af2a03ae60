"""Worker: the base class of every m2flow component (RLinf section 3.2, worker abstraction).

A worker is one rank of a :class:`~m2flow.core.group.WorkerGroup`, running as a Ray actor on the
devices its placement gives it. It is made of parts a reader finds by name:

- :mod:`m2flow.core.mailbox` -- ``send`` / ``recv`` / ``broadcast`` between workers;
- :mod:`m2flow.core.residency` -- device locks around calls, ``offload`` / ``onload``;
- :mod:`m2flow.core.weights` -- ``get_weights`` / ``load_weights`` for ``m2flow.sync_weights``;
- this module -- identity, group calls, timers, liveness watch.

**Group methods.** A method is a group method when it is declared with
:func:`~m2flow.core.methods.group_method` (with how its per-rank results are collected: all ranks,
rank 0 or their sum): ``group.method(...)`` runs it on every rank. Other public methods are
the rank's own helpers. Of the base class, only :meth:`Worker.pop_timings` and
:meth:`~m2flow.core.weights.Weights.get_weights` are group methods. A group method takes the rank's
device locks for its whole run, unless it is marked :func:`~m2flow.core.methods.no_device_lock`
(bookkeeping that touches no device memory). ``Worker.group_methods()`` lists them with their
collection and that flag.

Group calls run one at a time on a rank, in call order, except **control methods**
(:func:`~m2flow.core.methods.control_method`): those run on a thread of their own while another
group call runs, e.g. a rollout role's ``pause`` arriving in the middle of its ``generate``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import ray

from .._context import current_worker, set_current_worker  # noqa: F401 (public path)
from .._env import wait_timeout
from . import events
from .calls import CallContext
from .cluster import Device
from .mailbox import IO_GROUP, Mailbox, actor_name
from .methods import declared_methods, group_method, no_device_lock
from .residency import Residency
from .weights import Weights
from .work import Work  # noqa: F401  (re-exported: m2flow.core.worker.Work)

WATCH_GROUP = "m2flow_watch"  # one thread, blocked for the actor's life (liveness sentinel)
CONTROL_GROUP = "m2flow_control"  # control methods, beside the group call that runs


@dataclass
class WorkerContext:
    """What a rank knows about itself, set before the subclass ``__init__`` runs.

    Attributes:
        group, rank, world_size: identity.
        devices: this rank's devices.
        lock_service: the run's :class:`~m2flow.core.lock.LockService` (locks and liveness).
        lock: whether group calls take device locks.
        launch_index: order of the group's launch (its device-lock priority).
        cpus: CPUs of this rank's devices (its share of the node's CPUs).
        node: address of the node the rank runs on.
        trace: record the rank's runtime events (:mod:`m2flow.core.events`).
        preempt_grace_s: set for a preemptible rank (an elastic group's, on a spot node): its
            death fails no wait; see :meth:`~m2flow.core.lock.LockService.register`.
        node_id: the Ray node id (hex) of the rank's node (preemptible ranks).
    """

    group: str
    rank: int
    world_size: int
    devices: list[Device]
    lock_service: object
    lock: bool = True
    launch_index: int = 0
    cpus: float = 1.0
    node: str = ""
    trace: bool = False
    preempt_grace_s: float | None = None
    node_id: str = ""


@dataclass
class CallStats:
    """One group call on one rank. Times in seconds (``time.time()`` clock)."""

    start: float
    end: float
    wait: float = 0.0  # waiting for device locks or for data (channel get, recv)
    # the rank's runtime events since its last call (m2flow.core.events)
    events: tuple | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def busy(self) -> float:
        """Seconds the call worked: its duration less its waits."""
        return max(self.duration - self.wait, 0.0)


class Worker(Mailbox, Residency, Weights):
    """Base class of every m2flow component (see the module docstring).

    Attributes available in ``__init__`` and after: ``rank``, ``world_size``, ``group_name``,
    ``devices`` (this rank's :class:`~m2flow.core.cluster.Device` list), ``device_ids``.
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
            cluster: the :class:`~m2flow.core.cluster.Cluster`.
            placement: global device ids, one per rank (``[0, 1]``), a list per rank
                (``[[0, 1], [2, 3]]``), or an int ``n`` for devices ``0..n-1``. ``None``
                (the default): where the run's plan puts the group ``name``, else every
                device; one rank per device if :attr:`data_parallel`, else one rank.
            name: group name (default: the class name); unique in the run.
            num_cpus: Ray CPU request per rank (fractions allowed; 0 = no reservation).
            lock: take device locks around group calls (collocation-safe; default on).
            **init_kwargs: passed to the subclass ``__init__`` on every rank.

        Returns:
            a :class:`~m2flow.core.group.WorkerGroup`.

        Raises:
            ValueError: bad placement, or a group of that name already runs.
            WorkerError: a rank's ``__init__`` failed (with its traceback).
        """
        from .group import launch

        return launch(
            cls, cluster, placement, name=name, num_cpus=num_cpus, lock=lock, **init_kwargs
        )

    @classmethod
    def group_methods(cls) -> dict[str, tuple[str, bool]]:
        """Group method name -> ``(collection, takes the device lock)``
        (:mod:`m2flow.core.methods`)."""
        return {
            n: (mode, not getattr(getattr(cls, n), "_m2flow_no_device_lock", False))
            for n, mode in declared_methods(cls).items()
        }

    # -- set-up (runs in the actor before the subclass __init__) ------------------------------

    def _m2flow_bind(self, ctx: WorkerContext) -> None:
        self._m2flow_ctx = ctx
        self._m2flow_init_mailbox()
        self._m2flow_init_residency()
        self._m2flow_timers: dict[str, list[float]] = defaultdict(list)
        self._m2flow_call_ctx: CallContext | None = None
        self._m2flow_releasing = None  # (ref, number) of the last lock release, reply unseen
        self._m2flow_lease = threading.Lock()  # reservation state vs. the lock service's revoke
        self._m2flow_releases = 0  # numbers reserving releases
        self._m2flow_taken: int | None = None  # the reservation this worker holds the devices by
        self._m2flow_revoked: int | None = None  # the last reservation the service took back
        self._m2flow_exit = threading.Event()
        self._m2flow_in_call = False  # a group call runs (a live weight receive loads beside it)
        self._m2flow_live = threading.Lock()  # a call's start vs. a live weight load
        cuda = [d.local_id for d in ctx.devices if d.kind == "cuda"]
        if cuda:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cuda))
        set_current_worker(self)
        events.enable(ctx.trace)
        me = ray.get_runtime_context().current_actor
        ray.get(
            ctx.lock_service.register.remote(
                self.worker_key, ctx.group, ctx.rank, self.device_ids, me, ctx.launch_index,
                ctx.node, preempt_grace_s=ctx.preempt_grace_s, node_id=ctx.node_id,
            ),
            timeout=wait_timeout(),
        )  # fmt: skip

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

    def chunk_size(self, default: int) -> int:
        """Items per chunk this rank should put on its output channels in the current group
        call: the plan's granularity for this group (elastic pipelining, RLinf section 3.3), or
        ``default`` (coalesced: the whole share) when the run has no plan for it."""
        ctx = self._m2flow_call_ctx
        g = None if ctx is None else ctx.granularity
        return max(1, int(default if g is None else g))

    # -- group calls ------------------------------------------------------------------------

    def _m2flow_call(self, method: str, call: tuple[tuple, dict, CallContext | None]):
        """Run one group method, ``call`` being ``(args, kwargs, context)``; returns ``(result,
        CallStats)``. Afterwards releases the device locks (without waiting) and ends the call
        on its channels: end-of-step (or, on an exception, abort) markers, and a wait until
        the channels applied this call's puts (:func:`m2flow.core.channel.finish_call`,
        :mod:`m2flow.core.calls`)."""
        args, kwargs, ctx = call
        fn = getattr(self, method)
        locked = not getattr(fn, "_m2flow_no_device_lock", False)
        with self._m2flow_live:  # a live weight load in progress finishes first
            self._m2flow_in_call = True
        self._m2flow_call_ctx = ctx
        start, t0 = time.time(), events.now()
        self._m2flow_call_wait = self._m2flow_acquire() if locked else 0.0
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:
            self._m2flow_in_call = False
            self._m2flow_release(reserve=True)
            self._m2flow_call_ctx = None
            self._m2flow_end_channels(ctx, f"{type(e).__name__}: {e}"[:300])
            raise
        end = time.time()
        self._m2flow_in_call = False
        self._m2flow_release(reserve=True)
        self._m2flow_end_channels(ctx, None)
        self._m2flow_call_ctx = None
        self._m2flow_timers[method].append(end - start)
        shipped = None
        if events.enabled():
            kind, name = _CALL_KINDS.get(method, ("call", method))
            events.record(kind, name, t0, wait_s=round(self._m2flow_call_wait, 6))
            shipped = events.recorder.drain()
        return result, CallStats(start, end, self._m2flow_call_wait, shipped)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def _m2flow_call_control(self, method: str, call: tuple[tuple, dict, CallContext | None]):
        """Run one :func:`~m2flow.core.methods.control_method` beside the group call in flight: no
        device lock, no call context (the running call's stays), no channel epilogue. Returns
        ``(result, CallStats)``."""
        args, kwargs, _ = call
        start = time.time()
        result = getattr(self, method)(*args, **kwargs)
        return result, CallStats(start, time.time())

    @ray.method(concurrency_group=CONTROL_GROUP)
    def _m2flow_recv_weights_live(self, src_group: str, src_rank: int) -> int:
        """Receive weights (object-store transport) and load them now, not after the group
        calls queued on this rank: a partial rollout's weight update. Beside a running call the
        engine applies them between its decode steps
        (:meth:`~m2flow.core.weights.Weights.load_weights`) on that call's devices (not taken,
        not yielded); between calls this rank takes its devices for the load, as a plain
        receive does, and no call starts until it is done. Returns the version loaded."""
        with self._m2flow_live:  # no call starts while the weights load
            ref = self._m2flow_recv_ref(src_group, src_rank, wait_timeout(), yield_devices=False)
            weights, version = ray.get(ref)
            between = not self._m2flow_in_call
            if between:
                self._m2flow_acquire()
            try:
                self.load_weights(weights, version)
                self.weight_version = version
            finally:
                if between:
                    self._m2flow_release(reserve=True)
            return version

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_drain_events(self):
        """The events recorded since the last call returned (the run's end collects them)."""
        return events.recorder.drain()

    def _m2flow_end_channels(self, ctx: CallContext | None, abort: str | None) -> None:
        from .channel import finish_call

        if ctx is None:
            return
        finish_call(ctx.channels, self.rank, ctx.participants, abort)

    def _m2flow_release(self, reserve: bool = False) -> None:
        """Release the device locks without waiting for the lock service's reply (the next
        holder is granted as soon as the service reads it); the next acquire reads it. With
        ``reserve`` (the end of a call) the devices stay reserved for this worker if nobody
        waits for them (:mod:`m2flow.core.lock`)."""
        ctx = self._m2flow_ctx
        if not ctx.lock or not self._m2flow_holding:
            return
        with self._m2flow_lease:
            self._m2flow_holding, self._m2flow_taken = False, None
            number = None
            if reserve:
                self._m2flow_releases += 1
                number = self._m2flow_releases
            ref = ctx.lock_service.release.remote(self.worker_key, number)
            self._m2flow_releasing = (ref, number)

    def _m2flow_acquire(self) -> float:
        # The lock service runs calls concurrently: our release must be applied before our
        # next acquire (or that acquire would see the devices still ours), and its reply says
        # whether they are still reserved for us: then they are ours without asking.
        releasing, self._m2flow_releasing = self._m2flow_releasing, None
        if releasing is not None:
            ref, number = releasing
            if ray.get(ref, timeout=wait_timeout()):
                with self._m2flow_lease:
                    taken = self._m2flow_revoked != number
                    if taken:
                        self._m2flow_holding, self._m2flow_taken = True, number
                if taken:
                    self._m2flow_onload_if_needed()
                    return 0.0
        return super()._m2flow_acquire()

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_revoke(self, number: int) -> bool:
        """The lock service takes back reservation ``number``: True if this worker holds the
        devices by it (then it releases them at the end of its call), else it will ask."""
        with self._m2flow_lease:
            if self._m2flow_holding and self._m2flow_taken == number:
                return True
            self._m2flow_revoked = number
            return False

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_ping(self) -> str:
        return self.worker_key

    @ray.method(concurrency_group=WATCH_GROUP)
    def _m2flow_watch(self) -> str:
        """Blocks for the life of the process: the lock service's liveness sentinel (its call
        fails the moment this process dies; :mod:`m2flow.core.liveness`)."""
        self._m2flow_exit.wait()
        return self.worker_key

    # -- timers -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def timer(self, name: str):
        """Time a block; read back with :meth:`pop_timings`. Seconds."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._m2flow_timers[name].append(time.perf_counter() - t0)

    @group_method
    @no_device_lock
    def pop_timings(self) -> dict[str, float]:
        """Sum of each timer since the last call, in seconds, then reset."""
        out = {k: float(sum(v)) for k, v in self._m2flow_timers.items()}
        self._m2flow_timers.clear()
        return out


# Runtime calls drawn as weight syncs in the trace, not as the group's own work.
_CALL_KINDS = {
    "_m2flow_send_weights": ("weight_sync", "send weights"),
    "_m2flow_recv_weights": ("weight_sync", "receive weights"),
}
