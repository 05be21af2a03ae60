"""The channel actor: per-key queues, consumers' waits, end-of-step records.

:mod:`m2flow.core.channel` is its client.

Clients number their operations on a channel (Ray does not run an async actor's calls in
submission order) and the actor applies each client's operations in that order: FIFO per
producer, a client's own puts visible to its own later gets, a producer's end of step after its
puts. Because of that order a client need not wait for a put's reply before its next operation.

Items travel as entries ``(payload, weight, producer group, arrival number, epoch)``; the payload
is ``("value", obj)`` or ``("ref", [ObjectRef])``, never deserialised here.

Read-ahead: a plain FIFO get of one item may also take up to ``prefetch`` more queued items of
its kind (same key; for a stream read, same epoch) when its consumer is the key's only current
reader and no other get waits on it. A consumer is a reader of a key from its first get there
until its group call ends (its end-of-step marker) or, for the driver, until it gives the
channel to a group call (:meth:`ChannelActor.leave`). The client serves its next gets from the
items read ahead and hands back what it has not used (:meth:`ChannelActor.restore`): at its next
other operation on the key, at the end of its group call, or when the driver gives the channel
to a group call.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import ray

from m2flow.scheduler.runtime.balance import QueuedItem, fifo_count, serve_order

from .._context import LOCK_SERVICE_NAME, NAMESPACE

DRIVER = "driver"
_EPOCHS_KEPT = 64  # end-of-step records kept per channel (older epochs are forgotten)


class ClientId(NamedTuple):
    """Who operates on a channel: ``group`` (a worker group, or ``driver``) and ``name``, unique
    per process (``group:rank`` or ``driver#pid``)."""

    group: str
    name: str


class StreamAborted(RuntimeError):
    """A producer of the step being streamed raised: no end of step will come."""


class Entry(NamedTuple):
    """A queued item (see the module docstring)."""

    payload: tuple
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
    prefetch: int = 0  # read-ahead items the consumer accepts beyond its one item


@dataclass
class _KeyState:
    items: deque = field(default_factory=deque)
    waiters: list = field(default_factory=list)
    readers: set = field(default_factory=set)  # consumers that ever read this key


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
    """Holds the queues of one channel. All methods are coroutines. Every operation but
    :meth:`config` is ``(client, op, puts, ...)``: applied in the client's ``op`` order, after
    the puts it carries (``(key, epoch, [(payload, weight)])`` each, queued first: a client
    sends the puts it has gathered with its next operation)."""

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

    async def _begin(self, client: ClientId, op: int, puts: list) -> None:
        """Wait for ``op``'s turn in ``client``'s order, then queue the puts it carries."""
        if self.next_op[client.name] != op:
            fut = asyncio.get_running_loop().create_future()
            self.turns[(client.name, op)] = fut
            await fut
        try:
            await self._put(client, puts, None)
        except BaseException:
            self._next_turn(client)
            raise

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

    # -- producers --------------------------------------------------------------------------

    async def put(self, args: tuple) -> None:
        """Queue the puts the operation carries: ``(client, op, puts, timeout)``, ``puts`` a
        list of ``(key, epoch, [(payload, weight)])`` in order. A bounded channel waits for
        room before each item.

        Raises:
            TimeoutError: a bounded channel stayed full for ``timeout`` seconds.
        """
        client, op, puts, timeout = args
        await self._begin(client, op, [])
        try:
            await self._put(client, puts, timeout)
        finally:
            self._next_turn(client)

    async def _put(self, client: ClientId, puts: list, timeout: float | None) -> None:
        for key, epoch, entries in puts:
            if epoch is not None:
                self._epoch(epoch).producers.add(client.group)
            items = self.keys[key].items
            for done, (payload, weight) in enumerate(entries):
                if self.maxsize:
                    await self._wait_for_room(timeout, done, len(entries))
                items.append(Entry(payload, float(weight), client.group, next(self.seq), epoch))
                self.size += 1
                if self.maxsize:  # a waiting consumer makes room for the next item
                    self._dispatch(key)
            self._dispatch(key)

    async def end(self, args: tuple) -> None:
        """A rank's group call ended: ``(client, op, puts, rank, participants, epoch, abort)``.
        ``abort`` (the error text) fails every stream read of the epoch at once."""
        client, op, puts, rank, participants, epoch, abort = args
        await self._begin(client, op, puts)
        try:
            st = self._epoch(epoch)
            st.ended[client.group].add(rank)
            st.participants[client.group] = participants
            if abort is not None and st.aborted is None:
                st.aborted = f"{client.name} raised: {abort}"
            self._forget_reader(client)
            for key in list(self.keys):
                self._dispatch(key)
        finally:
            self._next_turn(client)

    async def leave(self, args: tuple) -> None:
        """A consumer stops reading for now (the driver gave the channel to a group call):
        ``(client, op, puts)``. It no longer counts as a reader for read-ahead."""
        client, op, puts = args
        await self._begin(client, op, puts)
        self._forget_reader(client)
        self._next_turn(client)

    def _forget_reader(self, client: ClientId) -> None:
        for state in self.keys.values():
            state.readers.discard(client.name)

    async def restore(self, args: tuple) -> None:
        """Take back read-ahead items a consumer did not use: ``(client, op, puts, key,
        entries)``; they go back to the front of the queue in their order, and the consumer's
        load and the traced edges forget them."""
        client, op, puts, key, entries = args
        await self._begin(client, op, puts)
        try:
            entries = [Entry(*e) for e in entries]
            self.keys[key].items.extendleft(reversed(entries))
            self.size += len(entries)
            for e in entries:
                self.load[client.name] -= e.weight
                self.edges[(e.producer, client.group)] -= 1
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

    # -- consumers --------------------------------------------------------------------------

    async def get(self, args: tuple) -> list[tuple] | None:
        """Payloads of the items for one consumer; with ``prefetch``, whole entries (the one
        asked for, then those read ahead). For a stream read whose epoch has ended and holds
        no more items, ``None``.

        ``args``: ``(client, op, puts, key, target_weight, policy, timeout, max_items, epoch,
        prefetch)``.

        Raises:
            TimeoutError: nothing (or not enough) arrived within ``timeout`` seconds.
            StreamAborted: a producer of the streamed epoch raised.
        """
        client, op, puts, key, target_weight, policy, timeout, max_items, epoch, prefetch = args
        await self._begin(client, op, puts)
        state = self.keys[key]
        state.readers.add(client.name)
        waiter = _Waiter(
            client,
            target_weight,
            policy,
            asyncio.get_running_loop().create_future(),
            next(self.seq),
            max_items,
            epoch,
            prefetch,
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
        if picked and self._may_read_ahead(state, waiter):
            picked = list(range(min(len(items), 1 + waiter.prefetch)))
        return picked if cand is None else [cand[i] for i in picked]

    def _may_read_ahead(self, state: _KeyState, waiter: _Waiter) -> bool:
        """Read-ahead (module docstring): a one-item FIFO get by the key's only reader, the
        only one waiting."""
        return (
            waiter.prefetch > 0
            and waiter.policy is None
            and waiter.target_weight is None
            and len(state.waiters) == 1
            and state.readers == {waiter.consumer.name}
        )

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
            # Whole entries only where the client may hand them back (read-ahead).
            full = waiter.prefetch > 0
            waiter.future.set_result([tuple(e) if full else e.payload for e in taken])
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

    # -- inspection -------------------------------------------------------------------------

    async def qsize(self, args: tuple) -> int:
        """Items queued under a key: ``(client, op, puts, key)``."""
        client, op, puts, key = args
        await self._begin(client, op, puts)
        self._next_turn(client)
        return len(self.keys[key].items) if key in self.keys else 0

    async def graph_edges(self, args: tuple) -> list[tuple[str, str, int]]:
        """``(producer group, consumer group, items)`` seen so far: ``(client, op, puts)``."""
        client, op, puts = args
        await self._begin(client, op, puts)
        self._next_turn(client)
        return [(p, c, n) for (p, c), n in self.edges.items() if n > 0]
