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
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import ray

from m2flow.scheduler.balance import QueuedItem, fifo
from ._env import wait_timeout
from .cluster import NAMESPACE
from .worker import Work, current_worker

DRIVER = "driver"
_created: dict[str, "Channel"] = {}  # channels this process created, for the trace


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
    policy: Callable
    future: asyncio.Future
    seq: int
    max_items: int | None = None


@dataclass
class _KeyState:
    items: deque = field(default_factory=deque)
    waiters: list = field(default_factory=list)


@ray.remote(num_cpus=0)
class ChannelActor:
    """Holds the queues of one channel. All methods are coroutines."""

    def __init__(self, name: str, maxsize: int) -> None:
        self.name, self.maxsize = name, maxsize
        self.keys: dict[Any, _KeyState] = defaultdict(_KeyState)
        self.load: Counter = Counter()  # consumer -> weight taken so far
        self.edges: Counter = Counter()  # (producer, consumer) -> items
        self.seq = itertools.count()
        self.space = asyncio.Condition()
        self.size = 0

    async def put(self, payload: tuple, weight: float, key: Any, producer: str,
                  timeout: float) -> None:
        if self.maxsize:
            async with self.space:
                try:
                    await asyncio.wait_for(
                        self.space.wait_for(lambda: self.size < self.maxsize), timeout)
                except asyncio.TimeoutError:
                    raise TimeoutError(
                        f"channel '{self.name}' stayed full ({self.maxsize} items) for "
                        f"{timeout:.0f} s: no consumer is taking items") from None
        self.keys[key].items.append(_Entry(payload, float(weight), producer, next(self.seq)))
        self.size += 1
        self._dispatch(key)

    async def get(self, key: Any, target_weight: float | None, policy: Callable | None,
                  consumer: str, timeout: float, nowait: bool, max_items: int | None = None):
        """Items for one consumer: a list of ``(payload, weight)``; ``None`` if ``nowait``
        and nothing can be handed over now."""
        state = self.keys[key]
        loop = asyncio.get_running_loop()
        waiter = _Waiter(consumer, target_weight, policy or fifo, loop.create_future(),
                         next(self.seq), max_items)
        state.waiters.append(waiter)
        self._dispatch(key)
        if nowait and not waiter.future.done():
            state.waiters.remove(waiter)
            return None
        try:
            taken = await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except asyncio.TimeoutError:
            if waiter.future.done():  # handed over just as the wait expired: keep the items
                taken = waiter.future.result()
            else:
                state.waiters.remove(waiter)
                raise TimeoutError(
                    f"channel '{self.name}': {consumer} waited {timeout:.0f} s on key {key!r} "
                    f"(target weight {target_weight}); {len(state.items)} items queued with "
                    f"weight {sum(e.weight for e in state.items):g}. Is the producer running "
                    "and putting to this key?") from None
        if self.maxsize:
            async with self.space:
                self.space.notify_all()
        return taken

    def _dispatch(self, key: Any) -> None:
        state = self.keys[key]
        progress = True
        while progress and state.items and state.waiters:
            progress = False
            # Least-loaded consumer first: weights balance work across consumers.
            for waiter in sorted(state.waiters, key=lambda w: (self.load[w.consumer], w.seq)):
                view = [QueuedItem(e.weight, e.seq, e.producer) for e in state.items]
                picked = waiter.policy(view, waiter.target_weight)
                if waiter.max_items is not None:
                    picked = picked[: waiter.max_items]
                if not picked:
                    continue
                chosen = set(picked)
                taken = [e for i, e in enumerate(state.items) if i in chosen]
                state.items = deque(e for i, e in enumerate(state.items) if i not in chosen)
                self.size -= len(taken)
                for e in taken:
                    self.load[waiter.consumer] += e.weight
                    self.edges[(e.producer, waiter.consumer.split(":")[0])] += 1
                state.waiters.remove(waiter)
                waiter.future.set_result([(e.payload, e.weight) for e in taken])
                progress = True
                break

    async def qsize(self, key: Any = None) -> int:
        return len(self.keys[key].items) if key in self.keys else 0

    async def total_size(self) -> int:
        return self.size

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
    w = current_worker()
    return w.worker_key if w is not None else DRIVER


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
    def create(cls, name: str, maxsize: int = 0) -> "Channel":
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
    def connect(cls, name: str) -> "Channel":
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

    # -- put --------------------------------------------------------------------------------

    def put(self, item: Any, weight: float = 1.0, key: Any = None, async_op: bool = False,
            timeout: float | None = None):
        """Queue ``item`` under ``key`` with a load ``weight`` (e.g. its token count).

        Raises:
            TimeoutError: a bounded channel stayed full for ``timeout`` seconds.
        """
        if weight < 0:
            raise ValueError(f"channel '{self.name}': weight must be >= 0, got {weight}")
        payload = ("ref", [ray.put(item)]) if _needs_object_store(item) else ("value", item)
        producer = _identity().split(":")[0]
        ref = self._actor.put.remote(payload, weight, key, producer,
                                     wait_timeout() if timeout is None else timeout)
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

    def get_batch(self, target_weight: float, key: Any = None,
                  balance: Callable | None = None, timeout: float | None = None,
                  async_op: bool = False, max_items: int | None = None) -> list[Any]:
        """Items under ``key`` whose weights add up to at least ``target_weight``.

        ``balance`` is a policy ``(items, target_weight) -> indices`` choosing which queued
        items to take (default :func:`m2flow.scheduler.balance.fifo`); see that module.

        Raises:
            TimeoutError: the target was not met within ``timeout`` seconds.
        """
        return self._get(key, target_weight, balance, timeout, async_op, max_items)

    def _get(self, key, target, policy, timeout, async_op, max_items):
        timeout = wait_timeout() if timeout is None else timeout
        consumer = _identity()
        if async_op:
            ref = self._actor.get.remote(key, target, policy, consumer, timeout, False, max_items)
            return Work(ref, then=_resolve, yields=True)
        pairs = ray.get(self._actor.get.remote(key, target, policy, consumer, timeout, True,
                                               max_items))
        if pairs is None:  # must wait: let a producer on our devices run meanwhile
            worker = current_worker()
            ref = self._actor.get.remote(key, target, policy, consumer, timeout, False, max_items)
            if worker is not None:
                with worker._m2flow_yield_devices():
                    pairs = ray.get(ref, timeout=timeout + 30)
            else:
                pairs = ray.get(ref, timeout=timeout + 30)
        return _resolve(pairs)

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
