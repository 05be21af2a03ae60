"""Channel: a named FIFO queue between workers (RLinf section 4.2, data channel).

``Channel.create("rollout")`` starts a channel actor; the returned handle can be passed to
workers as an argument. ``put(item, weight=1, key=None)`` and ``get(key=None)`` /
``get_batch(target_weight, ...)`` block (with a timeout) or, with ``async_op=True``, return a
:class:`~m2flow.worker.Work`.

- Items that hold tensors or arrays go into the Ray object store at ``put``; the channel actor
  queues only the reference, so tensors never pass through its mailbox. Plain Python values
  travel inline (cheaper than an object-store round trip).
- Weights balance load: among consumers waiting on the same key, the one that has taken the
  least weight so far is served first; which items it gets is the balance policy's choice
  (:mod:`m2flow.scheduler.balance`; FIFO by default, or the consumer's own callable).
- A worker blocked in ``get`` yields its devices (:mod:`m2flow.worker`), so a producer on the
  same devices can run: collocated producer/consumer pairs do not deadlock.
- Every get records the edge producer group -> consumer group: the workflow graph the planner
  reads (:mod:`m2flow.trace`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from m2flow.scheduler.balance import QueuedItem, fifo

from ._env import wait_timeout
from .cluster import NAMESPACE
from .lock import LOCK_SERVICE_NAME
from .worker import Work, current_worker

DRIVER = "driver"
_created: dict[str, Channel] = {}  # channels this process created, for the trace


@dataclass
class _Entry:
    payload: tuple  # ("ref", [ObjectRef]) or ("value", obj)
    weight: float
    producer: str
    seq: int


@dataclass
class _Waiter:
    consumer: str
    target_weight: float | None
    policy: Callable | None  # None: FIFO (fast path)
    future: asyncio.Future
    seq: int
    max_items: int | None = None


@dataclass
class _KeyState:
    items: deque = field(default_factory=deque)
    waiters: list = field(default_factory=list)


@ray.remote(num_cpus=0)
class ChannelActor:
    """Holds the queues of one channel. All methods are coroutines.

    Ray does not run an async actor's calls in submission order, so every client numbers its
    operations on the channel and the actor applies each client's operations in that order
    (program order per client: FIFO per producer, own puts visible to own gets).
    """

    def __init__(self, name: str, maxsize: int) -> None:
        self.name, self.maxsize = name, maxsize
        self.keys: dict[Any, _KeyState] = defaultdict(_KeyState)
        self.load: Counter = Counter()  # consumer -> weight taken so far
        self.edges: Counter = Counter()  # (producer, consumer) -> items
        self.seq = itertools.count()
        self.space = asyncio.Condition()
        self.size = 0
        self.next_op: Counter = Counter()  # client -> next operation number to apply
        self.turns: dict[tuple[str, int], asyncio.Future] = {}

    async def _turn(self, client: str, op: int) -> None:
        if self.next_op[client] != op:
            fut = asyncio.get_running_loop().create_future()
            self.turns[(client, op)] = fut
            await fut

    def _next_turn(self, client: str) -> None:
        self.next_op[client] += 1
        fut = self.turns.pop((client, self.next_op[client]), None)
        if fut is not None:
            fut.set_result(None)

    async def put(self, args: tuple) -> None:
        """Queue items in order: ``args`` is ``(client, op, [(payload, weight)], key,
        producer, timeout)``. A bounded channel waits for room before each item."""
        client, op, entries, key, producer, timeout = args
        await self._turn(client, op)
        try:
            for done, (payload, weight) in enumerate(entries):
                if self.maxsize:
                    await self._wait_for_room(timeout, done, len(entries))
                self.keys[key].items.append(
                    _Entry(payload, float(weight), producer, next(self.seq))
                )
                self.size += 1
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
        """Items for one consumer: a list of ``(payload, weight)``."""
        client, op, key, target_weight, policy, timeout, max_items = args
        await self._turn(client, op)
        state = self.keys[key]
        waiter = _Waiter(
            client,
            target_weight,
            policy,
            asyncio.get_running_loop().create_future(),
            next(self.seq),
            max_items,
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
                    raise TimeoutError(
                        f"channel '{self.name}': {client} waited {timeout:.0f} s on key "
                        f"{key!r} (target weight {target_weight}); {len(state.items)} items "
                        f"queued with weight {sum(e.weight for e in state.items):g}. Is the "
                        "producer running and putting to this key?"
                    ) from None
        if self.maxsize:
            async with self.space:
                self.space.notify_all()
        return waiter.future.result()

    def _pick(self, state: _KeyState, waiter: _Waiter) -> list[int]:
        if waiter.policy is None:  # FIFO without building a view: O(items taken)
            if waiter.target_weight is None:
                return [0]
            total = 0.0
            for i, e in enumerate(state.items):
                total += e.weight
                if total >= waiter.target_weight:
                    return list(range(i + 1))
            return []
        view = [QueuedItem(e.weight, e.seq, e.producer) for e in state.items]
        return sorted(waiter.policy(view, waiter.target_weight))

    def _dispatch(self, key: Any) -> None:
        state = self.keys[key]
        while state.items and state.waiters:
            # Least-loaded consumer first: weights balance work across consumers.
            order = sorted(state.waiters, key=lambda w: (self.load[w.consumer], w.seq))
            for waiter in order:
                picked = self._pick(state, waiter)
                if waiter.max_items is not None:
                    picked = picked[: waiter.max_items]
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
            consumer_group = waiter.consumer.split(":")[0].split("#")[0]
            for e in taken:
                self.load[waiter.consumer] += e.weight
                edge = (e.producer, consumer_group)
                if edge not in self.edges:
                    self._report_dependency(*edge)
                self.edges[edge] += 1
            state.waiters.remove(waiter)
            waiter.future.set_result([(e.payload, e.weight) for e in taken])

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


def _identity() -> str:
    """This process as a channel client: the worker key, or ``driver#pid``."""
    w = current_worker()
    return w.worker_key if w is not None else f"{DRIVER}#{os.getpid()}"


_op_counters: dict[str, itertools.count] = {}
_op_guard = threading.Lock()


def _resolve(pairs: list[tuple[tuple, float]]) -> list[Any]:
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
        """Create the channel ``name`` (or connect to it if it exists).

        Args:
            maxsize: items the channel holds before ``put`` waits (0 = unbounded).
        """
        actor = ChannelActor.options(
            name=f"channel:{name}", namespace=NAMESPACE, get_if_exists=True
        ).remote(name, maxsize)
        ch = cls(name, actor)
        _created[name] = ch
        return ch

    @classmethod
    def connect(cls, name: str) -> Channel:
        """Handle of an existing channel.

        Raises:
            ValueError: no channel of that name exists.
        """
        try:
            actor = ray.get_actor(f"channel:{name}", namespace=NAMESPACE)
        except ValueError:
            raise ValueError(f"no channel named '{name}'; create it with Channel.create") from None
        return cls(name, actor)

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
        as ``put`` for each item (a driver filling a step's prompts pays one call, not one
        per prompt). ``weights``: one per item (default 1 each).

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
        bad = [w for w in weights if w < 0]
        if bad:
            raise ValueError(f"channel '{self.name}': weight must be >= 0, got {bad[0]}")
        entries = [
            (("ref", [ray.put(it)]) if _needs_object_store(it) else ("value", it), float(w))
            for it, w in zip(items, weights)
        ]
        producer = _identity().split(":")[0].split("#")[0]
        ref = self._submit(
            "put", entries, key, producer, wait_timeout() if timeout is None else timeout
        )
        work = Work(ref)
        return work if async_op else work.wait()

    # -- get --------------------------------------------------------------------------------

    def get(self, key: Any = None, timeout: float | None = None, async_op: bool = False):
        """The oldest item under ``key`` (blocking).

        Raises:
            TimeoutError: nothing arrived within ``timeout`` s (default M2FLOW_WAIT_TIMEOUT).
        """
        out = self._get(key, None, None, timeout, async_op, max_items=1)
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
        return self._get(key, target_weight, balance, timeout, async_op, max_items)

    def _get(self, key, target, policy, timeout, async_op, max_items):
        timeout = wait_timeout() if timeout is None else timeout
        policy = None if policy is fifo else policy
        ref = self._submit("get", key, target, policy, timeout, max_items)
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

    def __repr__(self) -> str:
        return f"Channel({self.name!r})"


def created_channels() -> dict[str, Channel]:
    """Channels this process created, by name."""
    return dict(_created)


def forget_channels() -> None:
    """Drop this process's channel registry (their Ray session is gone)."""
    _created.clear()
