"""Channel: a named FIFO queue between workers (RLinf section 4.2, data channel).

``Channel.create("rollout")`` starts a channel actor; the returned handle can be passed to
workers as an argument. ``put(item, weight=1, key=None)`` and ``get(key=None)`` /
``get_batch(target_weight, ...)`` block (with a timeout) or, with ``async_op=True``, return a
:class:`~m2flow.work.Work`. ``stream()`` reads a producer's step until its end-of-step signal.

- Items that hold tensors or arrays go into the Ray object store at ``put``; the channel actor
  queues only the reference, so tensors never pass through its mailbox. Plain Python values
  travel inline (cheaper than an object-store round trip).
- Weights balance load: among consumers waiting on the same key, the one that has taken the
  least weight so far is served first; which items it gets is the balance policy's choice
  (:mod:`m2flow.scheduler.balance`; FIFO by default, or the consumer's own callable).
- End of step: a producer's group call ends with an end-of-step marker on every channel it was
  given (an abort marker if it raised); :meth:`Channel.stream` reads until every producer group
  of the consumer's epoch has ended (:mod:`m2flow.calls`), so a consumer never needs to know
  how many chunks a producer splits its batch into.
- A worker blocked in ``get`` yields its devices (:mod:`m2flow.residency`), so a producer on
  the same devices can run: collocated producer/consumer pairs do not deadlock.
- Every get records the edge producer group -> consumer group: the workflow graph the planner
  reads (:mod:`m2flow.trace`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ray

from m2flow.scheduler.balance import QueuedItem, fifo, fifo_count, serve_order

from ._env import wait_timeout
from .cluster import NAMESPACE
from .lock import LOCK_SERVICE_NAME
from .work import Work

DRIVER = "driver"
_created: dict[str, Channel] = {}  # channels this process created, for the trace
_EPOCHS_KEPT = 64  # end-of-step records kept per channel (older epochs are forgotten)


class ClientId(NamedTuple):
    """Who operates on a channel: ``group`` (a worker group, or ``driver``) and ``name``, unique
    per process (``group:rank`` or ``driver#pid``)."""

    group: str
    name: str


class StreamAborted(RuntimeError):
    """A producer of the step being streamed raised: no end of step will come."""


@dataclass
class _Entry:
    payload: tuple  # ("ref", [ObjectRef]) or ("value", obj)
    weight: float
    producer: str
    seq: int
    epoch: int | None


@dataclass
class _Waiter:
    consumer: ClientId
    target_weight: float | None
    policy: Callable | None  # None: FIFO (fast path)
    future: asyncio.Future
    seq: int
    max_items: int | None = None
    epoch: int | None = None  # set for stream reads: only items of this epoch, then the end


@dataclass
class _KeyState:
    items: deque = field(default_factory=deque)
    waiters: list = field(default_factory=list)


@dataclass
class _EpochState:
    """End-of-step bookkeeping of one epoch: groups that put items, ranks that ended."""

    producers: set[str] = field(default_factory=set)
    ended: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    participants: dict[str, int] = field(default_factory=dict)
    aborted: str | None = None

    def done(self) -> bool:
        return bool(self.producers) and all(
            g in self.participants and len(self.ended[g]) >= self.participants[g]
            for g in self.producers
        )


@ray.remote(num_cpus=0)
class ChannelActor:
    """Holds the queues of one channel. All methods are coroutines.

    Ray does not run an async actor's calls in submission order, so every client numbers its
    operations on the channel and the actor applies each client's operations in that order
    (program order per client: FIFO per producer, own puts visible to own gets, a producer's
    end-of-step after its puts).
    """

    def __init__(self, name: str, maxsize: int) -> None:
        self.name, self.maxsize = name, maxsize
        self.keys: dict[Any, _KeyState] = defaultdict(_KeyState)
        self.load: Counter = Counter()  # consumer -> weight taken so far
        self.edges: Counter = Counter()  # (producer, consumer) -> items
        self.epochs: dict[int, _EpochState] = {}
        self.seq = itertools.count()
        self.space = asyncio.Condition()
        self.size = 0
        self.next_op: Counter = Counter()  # client -> next operation number to apply
        self.turns: dict[tuple[str, int], asyncio.Future] = {}

    async def config(self) -> dict:
        return {"maxsize": self.maxsize}

    async def _turn(self, client: ClientId, op: int) -> None:
        if self.next_op[client.name] != op:
            fut = asyncio.get_running_loop().create_future()
            self.turns[(client.name, op)] = fut
            await fut

    def _next_turn(self, client: ClientId) -> None:
        self.next_op[client.name] += 1
        fut = self.turns.pop((client.name, self.next_op[client.name]), None)
        if fut is not None:
            fut.set_result(None)

    def _epoch(self, epoch: int) -> _EpochState:
        if epoch not in self.epochs:
            self.epochs[epoch] = _EpochState()
            while len(self.epochs) > _EPOCHS_KEPT:
                del self.epochs[min(self.epochs)]
        return self.epochs[epoch]

    async def put(self, args: tuple) -> None:
        """Queue items in order: ``args`` is ``(client, op, [(payload, weight)], key, epoch,
        timeout)``. A bounded channel waits for room before each item."""
        client, op, entries, key, epoch, timeout = args
        await self._turn(client, op)
        try:
            if epoch is not None:
                self._epoch(epoch).producers.add(client.group)
            for done, (payload, weight) in enumerate(entries):
                if self.maxsize:
                    await self._wait_for_room(timeout, done, len(entries))
                self.keys[key].items.append(
                    _Entry(payload, float(weight), client.group, next(self.seq), epoch)
                )
                self.size += 1
                self._dispatch(key)
        finally:
            self._next_turn(client)

    async def end(self, args: tuple) -> None:
        """A rank's group call ended: ``(client, op, rank, participants, epoch, abort)``.
        ``abort`` (the error text) fails every stream read of the epoch at once."""
        client, op, rank, participants, epoch, abort = args
        await self._turn(client, op)
        try:
            st = self._epoch(epoch)
            st.ended[client.group].add(rank)
            st.participants[client.group] = participants
            if abort is not None and st.aborted is None:
                st.aborted = f"{client.name} raised: {abort}"
            for key in list(self.keys):
                self._dispatch(key)
        finally:
            self._next_turn(client)

    async def _wait_for_room(self, timeout: float, done: int, total: int) -> None:
        async with self.space:
            try:
                await asyncio.wait_for(
                    self.space.wait_for(lambda: self.size < self.maxsize), timeout
                )
            except TimeoutError:
                queued = f"; the first {done} of these {total} items are queued" if done else ""
                raise TimeoutError(
                    f"channel '{self.name}' stayed full ({self.maxsize} items) for "
                    f"{timeout:.0f} s: no consumer is taking items{queued}"
                ) from None

    async def get(self, args: tuple):
        """Items for one consumer: a list of ``(payload, weight)``; for a stream read whose
        epoch has ended and holds no more items, ``None``.

        ``args``: ``(client, op, key, target_weight, policy, timeout, max_items, epoch)``.
        """
        client, op, key, target_weight, policy, timeout, max_items, epoch = args
        await self._turn(client, op)
        state = self.keys[key]
        waiter = _Waiter(
            client,
            target_weight,
            policy,
            asyncio.get_running_loop().create_future(),
            next(self.seq),
            max_items,
            epoch,
        )
        state.waiters.append(waiter)
        self._dispatch(key)
        self._next_turn(client)  # registered: the client's next operation may proceed
        if not waiter.future.done():
            try:
                await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
            except TimeoutError:
                if not waiter.future.done():
                    state.waiters.remove(waiter)
                    what = f"the end of step {epoch}" if epoch is not None else "items"
                    raise TimeoutError(
                        f"channel '{self.name}': {client.name} waited {timeout:.0f} s for "
                        f"{what} on key {key!r} (target weight {target_weight}); "
                        f"{len(state.items)} items queued with weight "
                        f"{sum(e.weight for e in state.items):g}. Is the producer running "
                        "and putting to this key?"
                    ) from None
        if self.maxsize:
            async with self.space:
                self.space.notify_all()
        return waiter.future.result()

    def _candidates(self, state: _KeyState, waiter: _Waiter) -> list[int] | None:
        """Indices of the queued items ``waiter`` may take (``None``: all of them)."""
        if waiter.epoch is None:
            return None
        return [i for i, e in enumerate(state.items) if e.epoch == waiter.epoch]

    def _pick(self, state: _KeyState, waiter: _Waiter) -> list[int]:
        cand = self._candidates(state, waiter)
        items = state.items if cand is None else [state.items[i] for i in cand]
        if waiter.policy is None:  # FIFO without building a view: O(items taken)
            picked = list(range(fifo_count((e.weight for e in items), waiter.target_weight)))
        else:
            view = [QueuedItem(e.weight, e.seq, e.producer) for e in items]
            picked = sorted(waiter.policy(view, waiter.target_weight))
        if waiter.max_items is not None:
            picked = picked[: waiter.max_items]
        return picked if cand is None else [cand[i] for i in picked]

    def _end_of_stream(self, state: _KeyState, waiter: _Waiter) -> bool:
        """For a stream read: its epoch ended and nothing of it is left (raises if it was
        aborted)."""
        if waiter.epoch is None:
            return False
        st = self.epochs.get(waiter.epoch)
        if st is None:
            return False
        if st.aborted is not None:
            waiter.future.set_exception(
                StreamAborted(
                    f"channel '{self.name}', step {waiter.epoch}: {st.aborted} (no end of "
                    "step will come)"
                )
            )
            return True
        if st.done() and not any(e.epoch == waiter.epoch for e in state.items):
            waiter.future.set_result(None)
            return True
        return False

    def _dispatch(self, key: Any) -> None:
        state = self.keys[key]
        for waiter in [w for w in state.waiters if self._end_of_stream(state, w)]:
            state.waiters.remove(waiter)
        while state.items and state.waiters:
            # Least-loaded consumer first: weights balance work across consumers.
            order = serve_order([(self.load[w.consumer.name], w.seq) for w in state.waiters])
            for i in order:
                waiter = state.waiters[i]
                picked = self._pick(state, waiter)
                if picked:
                    break
            else:
                return
            if picked == list(range(len(picked))):
                taken = [state.items.popleft() for _ in picked]
            else:
                chosen = set(picked)
                taken = [e for i, e in enumerate(state.items) if i in chosen]
                state.items = deque(e for i, e in enumerate(state.items) if i not in chosen)
            self.size -= len(taken)
            for e in taken:
                self.load[waiter.consumer.name] += e.weight
                edge = (e.producer, waiter.consumer.group)
                if edge not in self.edges:
                    self._report_dependency(*edge)
                self.edges[edge] += 1
            state.waiters.remove(waiter)
            waiter.future.set_result([(e.payload, e.weight) for e in taken])
            for w in [w for w in state.waiters if self._end_of_stream(state, w)]:
                state.waiters.remove(w)

    def _report_dependency(self, producer: str, consumer: str) -> None:
        """Tell the device locks that ``producer`` feeds ``consumer`` (fire and forget)."""
        if DRIVER in (producer, consumer):
            return
        try:
            locks = ray.get_actor(LOCK_SERVICE_NAME, namespace=NAMESPACE)
        except ValueError:  # no cluster runs locks: nothing to tell
            return
        locks.add_dependency.remote(producer, consumer)

    async def qsize(self, key: Any = None) -> int:
        return len(self.keys[key].items) if key in self.keys else 0

    async def graph_edges(self) -> list[tuple[str, str, int]]:
        """``(producer group, consumer group, items)`` seen so far."""
        return [(p, c, n) for (p, c), n in self.edges.items()]


def _needs_object_store(item: Any) -> bool:
    """True if ``item`` holds tensors/arrays (shallowly): those go by reference."""
    kind = type(item).__module__.split(".")[0]
    if kind in ("torch", "numpy", "tensordict"):
        return True
    if isinstance(item, dict):
        return any(_needs_object_store(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return any(_needs_object_store(v) for v in item[:8])
    return False


def _identity() -> ClientId:
    """This process as a channel client."""
    from .worker import current_worker

    w = current_worker()
    if w is not None:
        return ClientId(w.group_name, w.worker_key)
    return ClientId(DRIVER, f"{DRIVER}#{os.getpid()}")


def _call_epoch(channel: str) -> int | None:
    """The epoch of ``channel`` in the group call this worker runs now (``None``: not in a
    group call, or the channel was not among its arguments)."""
    from .worker import current_worker

    w = current_worker()
    ctx = None if w is None else w._m2flow_call_ctx
    return None if ctx is None else ctx.epoch(channel)


_op_counters: dict[str, itertools.count] = {}
_op_guard = threading.Lock()


def _resolve(pairs: list[tuple[tuple, float]] | None) -> list[Any] | None:
    if pairs is None:  # end of a stream
        return None
    refs = [p[1][0] for p, _ in pairs if p[0] == "ref"]
    fetched = iter(ray.get(refs)) if refs else iter(())
    return [next(fetched) if p[0] == "ref" else p[1] for p, _ in pairs]


class Channel:
    """Client handle of a channel; picklable, so it can be passed to workers."""

    def __init__(self, name: str, actor) -> None:
        self.name = name
        self._actor = actor

    @classmethod
    def create(cls, name: str, maxsize: int = 0) -> Channel:
        """Create the channel ``name`` (or connect to it if it exists with the same
        ``maxsize``).

        Args:
            maxsize: items the channel holds before ``put`` waits (0 = unbounded).

        Raises:
            ValueError: ``maxsize`` is negative or not an integer, or a channel of that name
                exists with another ``maxsize``.
        """
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(
                f"channel '{name}': maxsize={maxsize!r}; give an int >= 0 (0 = unbounded)"
            )
        actor = ChannelActor.options(
            name=f"channel:{name}", namespace=NAMESPACE, get_if_exists=True
        ).remote(name, maxsize)
        existing = ray.get(actor.config.remote(), timeout=wait_timeout())["maxsize"]
        if existing != maxsize:
            raise ValueError(
                f"channel '{name}' already exists with maxsize={existing}, not {maxsize}: "
                "close it first (Channel.close) or use another name"
            )
        ch = cls(name, actor)
        _created[name] = ch
        return ch

    def __reduce__(self):
        return (Channel, (self.name, self._actor))

    def _submit(self, method: str, *args):
        """Submit one operation numbered in this client's program order (see ChannelActor)."""
        client = _identity()
        with _op_guard:  # number and submit atomically: numbers follow submission order
            counter = _op_counters.setdefault(self._actor._actor_id.hex(), itertools.count())
            return getattr(self._actor, method).remote((client, next(counter), *args))

    # -- put --------------------------------------------------------------------------------

    def put(
        self,
        item: Any,
        weight: float = 1.0,
        key: Any = None,
        async_op: bool = False,
        timeout: float | None = None,
    ):
        """Queue ``item`` under ``key`` with a load ``weight`` (e.g. its token count).

        Raises:
            TimeoutError: a bounded channel stayed full for ``timeout`` seconds.
        """
        return self.put_many([item], [weight], key, async_op, timeout)

    def put_many(
        self,
        items: list[Any],
        weights: list[float] | None = None,
        key: Any = None,
        async_op: bool = False,
        timeout: float | None = None,
    ):
        """Queue ``items`` under ``key`` in order, in one round trip to the channel: the same
        as ``put`` for each item. ``weights``: one per item (default 1 each).

        Raises:
            ValueError: a negative weight, or not one weight per item.
            TimeoutError: a bounded channel stayed full for ``timeout`` seconds.
        """
        weights = [1.0] * len(items) if weights is None else list(weights)
        if len(weights) != len(items):
            raise ValueError(
                f"channel '{self.name}': {len(items)} items but {len(weights)} weights; "
                "pass one weight per item"
            )
        bad = [w for w in weights if not w >= 0]
        if bad:
            raise ValueError(f"channel '{self.name}': weight must be >= 0, got {bad[0]}")
        entries = [
            (("ref", [ray.put(it)]) if _needs_object_store(it) else ("value", it), float(w))
            for it, w in zip(items, weights)
        ]
        epoch = _call_epoch(self.name)
        timeout = wait_timeout() if timeout is None else timeout
        work = Work(self._submit("put", entries, key, epoch, timeout))
        return work if async_op else work.wait()

    def _end(self, rank: int, participants: int, epoch: int, abort: str | None):
        """The runtime's end-of-step (or abort) marker of one rank's call (async)."""
        return Work(self._submit("end", rank, participants, epoch, abort))

    # -- get --------------------------------------------------------------------------------

    def get(self, key: Any = None, timeout: float | None = None, async_op: bool = False):
        """The oldest item under ``key`` (blocking).

        Raises:
            TimeoutError: nothing arrived within ``timeout`` s (default M2FLOW_WAIT_TIMEOUT).
        """
        out = self._get(key, None, None, timeout, async_op, 1, None)
        return Work(None, run=lambda: out.wait()[0]) if async_op else out[0]

    def get_batch(
        self,
        target_weight: float,
        key: Any = None,
        balance: Callable | None = None,
        timeout: float | None = None,
        async_op: bool = False,
        max_items: int | None = None,
    ) -> list[Any]:
        """Items under ``key`` whose weights add up to at least ``target_weight``.

        ``balance`` is a policy ``(items, target_weight) -> indices`` choosing which queued
        items to take (default :func:`m2flow.scheduler.balance.fifo`); see that module.

        Raises:
            TimeoutError: the target was not met within ``timeout`` seconds.
        """
        return self._get(key, target_weight, balance, timeout, async_op, max_items, None)

    def stream(
        self,
        key: Any = None,
        balance: Callable | None = None,
        target_weight: float | None = None,
        max_items: int | None = None,
        timeout: float | None = None,
    ) -> Iterator[list[Any]]:
        """Read this step's items in batches until the producers' end of step.

        Yields lists of items (as :meth:`get_batch` picks them: ``target_weight`` and
        ``balance``; default one item at a time) until every producer group of this call's
        epoch of the channel has ended on all its ranks and no item of the epoch is left.
        Several consumer ranks may stream the same channel: each item goes to one of them.

        Raises:
            RuntimeError: not called inside a group call that received this channel.
            StreamAborted: a producer of the step raised.
            TimeoutError: nothing arrived, and the step did not end, within ``timeout``
                seconds (default ``M2FLOW_WAIT_TIMEOUT``).
        """
        epoch = _call_epoch(self.name)
        if epoch is None:
            raise RuntimeError(
                f"channel '{self.name}': stream() reads one step of a producer group; call it "
                "inside a group call that was given this channel as an argument"
            )
        while True:
            items = self._get(key, target_weight, balance, timeout, False, max_items, epoch)
            if items is None:
                return
            yield items

    def _get(self, key, target, policy, timeout, async_op, max_items, epoch):
        timeout = wait_timeout() if timeout is None else timeout
        policy = None if policy is fifo else policy
        ref = self._submit("get", key, target, policy, timeout, max_items, epoch)
        work = Work(ref, then=_resolve, yields=True)
        if async_op:
            return work
        # Work.wait yields the worker's devices if the items are not there at once, so a
        # producer on the same devices can run meanwhile.
        return work.wait(timeout + 30)

    def qsize(self, key: Any = None) -> int:
        """Items queued under ``key``."""
        return ray.get(self._actor.qsize.remote(key), timeout=60)

    def graph_edges(self) -> list[tuple[str, str, int]]:
        """``(producer group, consumer group, items)`` recorded so far."""
        return ray.get(self._actor.graph_edges.remote(), timeout=60)

    def close(self) -> None:
        """Kill the channel actor (queued items are lost); its name is free on return."""
        from .cluster import wait_name_free

        ray.kill(self._actor, no_restart=True)
        _created.pop(self.name, None)
        wait_name_free(f"channel:{self.name}")

    @staticmethod
    def fanout(*channels: Channel) -> Fanout:
        """One producer feeding several channels: see :class:`Fanout`."""
        return Fanout(*channels)

    def __repr__(self) -> str:
        return f"Channel({self.name!r})"


class Fanout:
    """Several channels behind one ``put``: each item goes into every channel (one producer,
    several consumer groups; each channel records its own edge and end of step).

    ``rollout.generate(prompts, Channel.fanout(a, b, c), ...)`` feeds three groups at once.

    Raises:
        ValueError: no channel given.
    """

    def __init__(self, *channels: Channel) -> None:
        if not channels:
            raise ValueError("Fanout needs at least one channel")
        self.channels = channels

    def put(self, item: Any, weight: float = 1.0, key: Any = None) -> None:
        for work in [ch.put(item, weight, key, async_op=True) for ch in self.channels]:
            work.wait()

    def put_many(self, items: list[Any], weights: list[float] | None = None, key=None) -> None:
        works = [ch.put_many(items, weights, key, async_op=True) for ch in self.channels]
        for work in works:
            work.wait()


def created_channels() -> dict[str, Channel]:
    """Channels this process created, by name."""
    return dict(_created)


def forget_channels() -> None:
    """Drop this process's channel registry (their Ray session is gone)."""
    _created.clear()
