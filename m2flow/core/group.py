"""WorkerGroup: one Ray actor per rank, placed on global device ids (RLinf sections 3.1-3.2).

``MyWorker.launch(cluster, placement=[0, 1], name="actor", **init_kwargs)`` starts rank ``i`` on
device ``placement[i]``, pinned to that device's node. The methods ``MyWorker`` declares with
:func:`m2flow.group_method` are group methods: ``group.generate(x)`` runs ``generate(x)`` on
every rank (or ``group.on([0]).generate(x)`` on a subset) and returns a :class:`GroupCall` at
once; ``.wait()`` returns the results collected as the method declares (every rank's, rank
0's, or their sum; :mod:`m2flow.core.methods`) and ``.time()`` the call's duration reduced across
ranks. A rank that fails raises :class:`WorkerError` in the driver with the group, rank, method
and the remote traceback, without waiting for the other ranks.
"""

from __future__ import annotations

import inspect
import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .._context import NAMESPACE, current_session, wait_name_free
from .._env import wait_timeout
from . import liveness, ordering
from .calls import CallContext, channels_in
from .cluster import Cluster
from .mailbox import IO_GROUP
from .methods import RUNTIME_CALLS, collect, undeclared
from .placement import PlacementError, merge_options
from .tracefile import drain_groups
from .work import flush_puts
from .worker import (
    CONTROL_GROUP,
    WATCH_GROUP,
    CallStats,
    Worker,
    WorkerContext,
    actor_name,
    declared_methods,
)

_launch_counter = itertools.count()


class WorkerError(RuntimeError):
    """A rank of a worker group failed: it raised (the message carries the remote
    traceback) or its process died (``died`` is True; ``cause`` says why: out of memory, node
    lost, killed).

    Attributes:
        group, rank, method: where it failed (``method`` is the call that saw it).
        node: address of the rank's node ("" if unknown).
        died: the process is gone (as opposed to an exception raised in the method).
        cause: the exception (raised), or one line saying why the process ended (died).
        seen_by: another worker whose wait noticed the death, if any.
    """

    def __init__(
        self,
        group: str,
        rank: int,
        method: str,
        cause,
        node: str = "",
        died: bool = False,
        seen_by: str = "",
    ) -> None:
        self.group, self.rank, self.method, self.cause = group, rank, method, cause
        self.node, self.died, self.seen_by = node, died, seen_by
        where = f"worker group '{group}' rank {rank}" + (f" on node {node}" if node else "")
        if died:
            seen = f"; {seen_by} noticed while it waited" if seen_by else ""
            msg = f"{where} died during {method}(): {cause}{seen}"
        else:
            msg = f"{where} failed in {method}():\n{cause}"
        super().__init__(msg)

    def __reduce__(self):
        return (
            WorkerError,
            (self.group, self.rank, self.method, self.cause, self.node, self.died, self.seen_by),
        )

    @property
    def summary(self) -> str:
        """One paragraph for a person: what failed and where, without a traceback."""
        if self.died:
            return str(self)
        head = str(self.cause).strip().splitlines()
        last = next((ln for ln in reversed(head) if ln.strip()), type(self.cause).__name__)
        where = f"worker group '{self.group}' rank {self.rank}" + (
            f" on node {self.node}" if self.node else ""
        )
        return f"{where} raised in {self.method}(): {last.strip()}"


def _as_worker_error(group: WorkerGroup, rank: int, method: str, e: BaseException) -> WorkerError:
    """The :class:`WorkerError` for what ``ray.get`` raised for one rank's call."""
    died = _find_cause(e, liveness.WorkerDied)
    if died is not None:  # a peer died while this rank waited: report the dead one
        d = died.death
        return WorkerError(d.group, d.rank, method, d.cause, d.node, True, died.waiter)
    if isinstance(e, ray.exceptions.RayTaskError) or getattr(e, "actor_init_failed", False):
        return WorkerError(group.name, rank, method, e, group.node_of(rank))
    return WorkerError(
        group.name, rank, method, liveness.death_cause(e), group.node_of(rank), died=True
    )


def _find_cause(e: BaseException, kind: type):
    """``e`` or the first exception of type ``kind`` in its cause chain (Ray wraps a remote
    exception as ``RayTaskError``, with the original as ``cause``)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        e = getattr(e, "cause", None) or e.__cause__
    return None


def normalize_placement(placement, cluster: Cluster) -> list[list[int]]:
    """Placement as one device-id list per rank.

    Accepts ``[0, 1]`` (one device per rank) or ``[[0, 1], [2, 3]]`` (several per rank), or an
    int ``n`` (ranks on devices ``0..n-1``).

    Raises:
        ValueError: empty placement, an unknown device id, or a rank spanning two nodes.
    """
    if isinstance(placement, int):
        placement = list(range(placement))
    ranks = [[p] if isinstance(p, int) else list(p) for p in placement]
    if not ranks or any(not r for r in ranks):
        raise ValueError(f"placement {placement!r} is empty; give one device id per rank")
    for r in ranks:
        nodes = {cluster.device(d).node_id for d in r}
        if len(nodes) > 1:
            raise ValueError(f"placement rank {r} spans several nodes; a rank lives on one node")
    return ranks


class WorkerGroup:
    """The ranks of one worker type. Create with ``WorkerClass.launch(...)``."""

    def __init__(
        self,
        name: str,
        worker_cls: type,
        actors: list,
        placement: list[list[int]],
        cluster: Cluster,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self.name = name
        self.worker_cls = worker_cls
        self.actors = actors
        self.placement = placement
        self.cluster = cluster
        self._ranks = list(range(len(actors))) if ranks is None else list(ranks)
        self._methods = declared_methods(worker_cls)  # name -> collection
        self._epochs: dict[str, int] = defaultdict(int)  # channel -> calls given it so far

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def device_ids(self) -> list[int]:
        """Every device the group uses, sorted."""
        return sorted({d for r in self.placement for d in r})

    def node_of(self, rank: int) -> str:
        """Address of the node rank ``rank`` runs on."""
        dev = self.cluster.device(self.placement[rank][0])
        return self.cluster.nodes[dev.node_index].address

    def on(self, ranks: int | Sequence[int]) -> WorkerGroup:
        """A view of this group that dispatches to ``ranks`` only."""
        ranks = [ranks] if isinstance(ranks, int) else list(ranks)
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"group '{self.name}' has ranks 0..{self.world_size - 1}, not {bad}")
        view = WorkerGroup(
            self.name, self.worker_cls, self.actors, self.placement, self.cluster, ranks
        )
        view._epochs = self._epochs
        return view

    def __getattr__(self, method: str):
        methods = self.__dict__.get("_methods")
        if methods is None or method not in methods:
            raise undeclared(self.__dict__.get("worker_cls", type(self)), method)
        return _GroupMethod(self, method)

    def call(self, method: str, *args, **kwargs) -> GroupCall:
        """Dispatch the group method ``method(*args, **kwargs)`` to the selected ranks, with the
        call's context (channel epochs, participants, planned granularity;
        :mod:`m2flow.core.calls`).

        Raises:
            AttributeError: ``method`` is not declared with :func:`m2flow.group_method`.
        """
        if method not in self._methods:
            raise undeclared(self.worker_cls, method)
        if getattr(getattr(self.worker_cls, method, None), "_m2flow_control", False):
            return self._call_control(method, args, kwargs)
        return self._dispatch(method, args, kwargs, self._methods[method])

    def runtime_call(self, method: str, *args, **kwargs) -> GroupCall:
        """Dispatch one of the runtime's own calls
        (:data:`m2flow.core.methods.RUNTIME_CALLS`: weight sync, IPC release, link close) to the
        selected ranks; ``.wait()`` gives every rank's result. Not for user methods (:meth:`call`).

        Raises:
            ValueError: ``method`` is not a runtime call.
        """
        if method not in RUNTIME_CALLS:
            raise ValueError(
                f"{method!r} is not a runtime call ({', '.join(sorted(RUNTIME_CALLS))}); "
                "call a group method as group.<name>(...)"
            )
        return self._dispatch(method, args, kwargs, "all")

    def _dispatch(self, method: str, args: tuple, kwargs: dict, mode: str) -> GroupCall:
        # pipelined steps (trainer.max_staleness >= 1): this group's calls in step order, so
        # a channel epoch stays a step (m2flow.core.ordering)
        with ordering.turn(f"group:{self.name}"):
            ctx = CallContext(participants=len(self._ranks), granularity=self._granularity())
            for ch in channels_in((*args, *kwargs.values())):
                self._epochs[ch.name] += 1
                ctx.channels[ch.name] = (ch, self._epochs[ch.name])
                ch._hand_off()  # items the caller read ahead go back, for the call's consumers
            # One argument, so channel handles among args and in ctx are pickled once.
            call = (args, kwargs, ctx)
            refs = [self.actors[r]._m2flow_call.remote(method, call) for r in self._ranks]
        handle = GroupCall(self, method, self._ranks, refs, mode)
        self.cluster.calls.add(handle)
        return handle

    def _call_control(self, method: str, args: tuple, kwargs: dict) -> GroupCall:
        """A :func:`~m2flow.core.methods.control_method` call: beside the call each rank runs.

        Raises:
            ValueError: a channel among the arguments (a control call has no stream to end).
        """
        if channels_in((*args, *kwargs.values())):
            raise ValueError(f"{method}() is a control method: it takes no channels")
        refs = [self.actors[r]._m2flow_call_control.remote(method, (args, kwargs, None))
                for r in self._ranks]  # fmt: skip
        handle = GroupCall(self, method, self._ranks, refs, self._methods[method])
        self.cluster.calls.add(handle)
        return handle

    def _granularity(self) -> int | None:
        placement = self.cluster.placement
        return None if placement is None else placement.granularity_for(self.name, None, None)

    def load_stats(self) -> list[dict]:
        """Per rank ``{"loaded", "onloads", "offloads", "onload_s", "offload_s",
        "peak_memory_bytes"}``: context switches so far, their seconds, peak memory."""
        return ray.get([a._m2flow_load_stats.remote() for a in self.actors], timeout=60)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Kill every rank and wait until their names are free (a group of the same name can
        then be launched again). The ranks are unregistered first, so stopping them is not
        reported as a death (:mod:`m2flow.core.liveness`)."""
        session = current_session()
        if session is not None and session.trace is not None and not session.trace.closed:
            drain_groups(session.trace, [self])
        keys = [actor_name(self.name, r) for r in range(self.world_size)]
        ids = [a._actor_id.hex() for a in self.actors]
        ray.get(self.cluster.lock_service.unregister.remote(keys, ids), timeout=timeout)
        for call in list(self.cluster.calls):  # their failures are this group's, now handled
            if call.group.name == self.name:
                self.cluster.calls.discard(call)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        for key in keys:
            wait_name_free(key, timeout)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, {self.worker_cls.__name__}, placement={self.placement})"


class _GroupMethod:
    def __init__(self, group: WorkerGroup, method: str) -> None:
        self._group, self._method = group, method

    def __call__(self, *args, **kwargs) -> GroupCall:
        return self._group.call(self._method, *args, **kwargs)


@dataclass
class GroupResult:
    """Per-rank results and timings of one group call. Durations in seconds."""

    results: list[Any]
    stats: list[CallStats]
    collect: str = "all"  # how the method declares its results collected (m2flow.core.methods)

    @property
    def value(self) -> Any:
        """The results collected as the method declares: the list (``all``), rank 0's
        (``rank0``), or their sum (``sum``)."""
        return collect(self.collect, self.results)

    @property
    def durations(self) -> list[float]:
        return [s.duration for s in self.stats]

    def time(self, reduce: str = "max", busy: bool = False) -> float:
        """The call's duration across ranks: ``"max"`` (default), ``"mean"`` or ``"min"``.

        With ``busy=True``, each rank's working time (duration less lock and data waits).
        """
        fn = {"max": max, "min": min, "mean": statistics.fmean}[reduce]
        return float(fn([s.busy for s in self.stats] if busy else self.durations))


class GroupCall:
    """Handle of a dispatched group call; ``collect``: how its results are collected."""

    def __init__(
        self, group: WorkerGroup, method: str, ranks: list[int], refs: list, collect: str = "all"
    ) -> None:
        self.group, self.method, self.ranks, self.refs = group, method, ranks, refs
        self.collect = collect
        self._result: GroupResult | None = None
        self._ok: set = set()  # refs seen finished without error (not fetched again)
        self.t0 = time.time()  # dispatch: a death after it concerns this call

    def done(self) -> bool:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def wait_result(self, timeout: float | None = None) -> GroupResult:
        """Wait for every rank; results and timings.

        Raises:
            WorkerError: a rank raised or died, or any worker of the run died, or another
                call of the run failed (fail fast: raised within about a second of the
                failure, naming the worker that failed first).
            TimeoutError: not all ranks finished within ``timeout`` seconds (default
                ``M2FLOW_WAIT_TIMEOUT``).
        """
        if self._result is not None:
            return self._result
        flush_puts()
        timeout = wait_timeout() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        rank_of = {ref: r for ref, r in zip(self.refs, self.ranks)}
        pending, values = list(self.refs), {}
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    late = sorted(rank_of[p] for p in pending)
                    raise TimeoutError(
                        f"worker group '{self.group.name}' {self.method}(): ranks {late} did "
                        f"not finish in {timeout:.0f} s"
                    )
                ready, pending = ray.wait(
                    pending, num_returns=1, timeout=min(left, liveness.POLL_S)
                )
                for ref in ready:
                    values[ref] = self._get(ref, rank_of[ref])
                if pending and not ready:
                    self._check_run()
        finally:  # done, or failed and reported: no other wait should report it again
            self.group.cluster.calls.discard(self)
        pairs = [values[ref] for ref in self.refs]
        self._result = GroupResult([p[0] for p in pairs], [p[1] for p in pairs], self.collect)
        session = current_session()
        if session is not None:
            r = self._result
            session.record_call(self.group.name, self.method, r.time(busy=True), r.time())
            if session.trace is not None:
                for rank, stats in zip(self.ranks, r.stats):
                    session.trace.add(self.group.name, rank, stats.events)
        return self._result

    def _get(self, ref, rank: int):
        try:
            return ray.get(ref)
        except ray.exceptions.GetTimeoutError:
            raise
        except ray.exceptions.RayError as e:
            raise _as_worker_error(self.group, rank, self.method, e) from None

    def _check_run(self) -> None:
        """Fail fast: another call of the run that failed, or a dead worker, ends this wait."""
        for other in list(self.group.cluster.calls):
            if other is self:
                continue
            done, _ = ray.wait(other.refs, num_returns=len(other.refs), timeout=0)
            for ref in done:
                if ref in other._ok:
                    continue
                rank = other.ranks[other.refs.index(ref)]
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    self.group.cluster.calls.discard(other)  # reported here, once
                    raise _as_worker_error(other.group, rank, other.method, e) from None
                other._ok.add(ref)
        try:
            liveness.check("the driver", since=self.t0)
        except liveness.WorkerDied as e:
            d = e.death
            raise WorkerError(d.group, d.rank, self.method, d.cause, d.node, True) from None

    def wait(self, timeout: float | None = None) -> Any:
        """The return values collected as the method declares: the per-rank list in rank order
        (``collect="all"``), the first called rank's (``"rank0"``) or their sum (``"sum"``).
        :meth:`wait_result` keeps every rank's. Errors: see :meth:`wait_result`."""
        return self.wait_result(timeout).value

    def time(self, reduce: str = "max", busy: bool = False) -> float:
        """Duration in seconds reduced across ranks (waits for the call first)."""
        return self.wait_result().time(reduce, busy)


def _check_plan_options(worker_cls: type, name: str, kwargs: dict, options: dict) -> None:
    """Refuse, in the driver, plan options the worker's ``__init__`` does not take (a plan made
    for another runner, or before a role's options were typed): a ``TypeError`` inside the
    actor would name neither the plan nor the fix.

    Raises:
        PlacementError: an option names no parameter of ``worker_cls.__init__``.
    """
    params = inspect.signature(worker_cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(k for k in options if k not in params)
    if unknown:
        raise PlacementError(
            f"plan option {name}.{unknown[0]}: {worker_cls.__name__} takes no argument "
            f"{unknown[0]!r} (it takes {', '.join(k for k in params if k != 'self')}); the plan "
            "was made for another workflow or an earlier version: re-plan it"
        )


def launch(
    worker_cls: type,
    cluster: Cluster,
    placement,
    *,
    name: str | None = None,
    num_cpus: float = 0.0,
    lock: bool = True,
    **init_kwargs,
) -> WorkerGroup:
    """Start ``worker_cls`` as a group; see :meth:`Worker.launch`."""
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        raise TypeError(f"{worker_cls!r} is not a subclass of m2flow.Worker")
    name = name or worker_cls.__name__
    if cluster.placement is not None and name in cluster.placement.options:
        init_kwargs = merge_options(init_kwargs, cluster.placement.options[name])
        _check_plan_options(worker_cls, name, init_kwargs, cluster.placement.options[name])
    if placement is None:
        devices = cluster.devices_for(name)
        placement = devices if worker_cls.data_parallel else [devices]
    ranks = normalize_placement(placement, cluster)
    launch_index = next(_launch_counter)
    session = current_session()
    trace = session is not None and session.trace is not None
    actor_cls = ray.remote(concurrency_groups={IO_GROUP: 8, WATCH_GROUP: 1, CONTROL_GROUP: 1})(
        _actor_class(worker_cls)
    )
    actors = []
    for rank, devices in enumerate(ranks):
        aname = actor_name(name, rank)
        try:
            ray.get_actor(aname, namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise ValueError(f"a worker group named '{name}' is already running; pick another name")
        devs = [cluster.device(d) for d in devices]
        cpus = sum(cluster.cpus_per_device(d) for d in devs)
        node = cluster.nodes[devs[0].node_index].address
        ctx = WorkerContext(
            name, rank, len(ranks), devs, cluster.lock_service, lock, launch_index, cpus, node
        )
        ctx.trace = trace
        actors.append(
            actor_cls.options(
                name=aname,
                namespace=NAMESPACE,
                num_cpus=num_cpus,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(devs[0].node_id, soft=False),
            ).remote(ctx, init_kwargs)
        )
    group = WorkerGroup(name, worker_cls, actors, ranks, cluster)
    cluster.groups.append(group)
    if session is not None:
        session.groups[name] = ranks
    # Surface constructor failures here, with the rank, rather than at the first call.
    ready = [a.__ray_ready__.remote() for a in actors]
    for rank, ref in enumerate(ready):
        try:
            ray.get(ref, timeout=wait_timeout())
        except ray.exceptions.GetTimeoutError:  # alive but slow: not a death
            group.shutdown()
            slow = TimeoutError(
                f"__init__() did not finish within {wait_timeout():.0f} s (a loaded host or a "
                "large model); raise M2FLOW_WAIT_TIMEOUT (seconds) to wait longer"
            )
            raise WorkerError(name, rank, "__init__", slow, group.node_of(rank)) from None
        except ray.exceptions.RayError as e:
            group.shutdown()
            raise _as_worker_error(group, rank, "__init__", e) from None
    return group


def _actor_class(worker_cls: type) -> type:
    """A subclass that binds the rank's context before the user's ``__init__`` runs."""

    class _Actor(worker_cls):
        def __init__(self, ctx: WorkerContext, init_kwargs: dict) -> None:
            self._m2flow_bind(ctx)
            worker_cls.__init__(self, **init_kwargs)

    _Actor.__name__ = _Actor.__qualname__ = worker_cls.__name__
    return _Actor
