"""Channel: a named FIFO queue between workers (RLinf section 3.5, data channel).

``Channel.create("rollout")`` starts a channel actor (:mod:`m2flow.core.channel_actor`); the
returned handle can be passed to workers as an argument. ``put(item, weight=1, key=None)`` and
``get(key=None)`` / ``get_batch(target_weight, ...)`` block (with a timeout) or, with
``async_op=True``, return a :class:`~m2flow.core.work.Work`. ``stream()`` reads a producer's step
until its end-of-step signal.

- Items that hold tensors or arrays go into the Ray object store at ``put``, as frames a reader
  on the same node maps without copying (:mod:`m2flow.core.channel_codec`); the channel actor queues
  only the reference. Plain Python values travel inline.
- A put on an unbounded channel does not wait for the channel's reply: every client numbers its
  operations and the channel applies them in that order, so the client's own later operations
  see the put anyway. Its error, if any (the channel is gone), is raised by the client's next
  blocking operation on the channel or at the end of its group call, which waits until the
  channel has applied the call's puts. So when a producer's group call returns, its items are
  in the channel. A put on a bounded channel (``maxsize``) waits for room, as before.
- A plain ``get()`` (and a one-item ``stream()``) may take up to :data:`READ_AHEAD` queued
  items in one round trip when its caller is the only consumer the key has had; the following
  gets are served from them. Items not used go back to the front of the queue at the caller's
  next other operation on the key (``get_batch``, ``qsize``, ...), at the end of its group call,
  or when the driver gives the channel to a group call. A worker in a group call that runs on
  several ranks never reads ahead (its ranks share the items).
- Weights balance load: among consumers waiting on the same key, the one that has taken the
  least weight so far is served first; which items it gets is the balance policy's choice
  (:mod:`m2flow.scheduler.runtime.balance`; FIFO by default, or the consumer's own callable).
- End of step: a producer's group call ends with an end-of-step marker on every channel it was
  given (an abort marker if it raised); :meth:`Channel.stream` reads until every producer group
  of the consumer's epoch has ended (:mod:`m2flow.core.calls`), so a consumer never needs to know
  how many chunks a producer splits its batch into.
- A worker blocked in ``get`` yields its devices (:mod:`m2flow.core.residency`), so a producer on
  the same devices can run: collocated producer/consumer pairs do not deadlock.
- Every get records the edge producer group -> consumer group: the workflow graph the planner
  reads (:mod:`m2flow.run.trace`).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import ray

from m2flow.scheduler.runtime.balance import fifo

from .._context import NAMESPACE, current_worker, here, wait_name_free
from .._env import wait_timeout
from . import ordering
from .channel_actor import DRIVER, ChannelActor, ClientId, StreamAborted
from .channel_codec import needs_object_store as _needs_object_store  # noqa: F401 (tests)
from .channel_codec import payload, resolve
from .work import Work

__all__ = ["DRIVER", "Channel", "ClientId", "Fanout", "StreamAborted"]

READ_AHEAD = 256  # items a plain get may take ahead for later gets of the same client
MAX_PENDING = 1024  # puts gathered before they are sent without waiting for an operation
LINGER_S = 0.001  # longest a gathered put waits for an operation to carry it
MAX_UNACKED = 64  # operations carrying puts a client may have in flight before it waits
_ALL = object()  # every key

_created: dict[str, Channel] = {}  # channels this process created, for the trace
_guard = threading.RLock()  # numbering + submission, read-ahead buffers


def _identity() -> ClientId:
    """This process as a channel client."""
    w = current_worker()
    if w is not None:
        return ClientId(w.group_name, w.worker_key)
    return ClientId(DRIVER, f"{DRIVER}#{os.getpid()}")


def _call_ctx():
    w = current_worker()
    return None if w is None else w._m2flow_call_ctx


def _call_epoch(channel: str) -> int | None:
    """The epoch of ``channel`` in the group call this worker runs now (``None``: not in a
    group call, or the channel was not among its arguments)."""
    ctx = _call_ctx()
    return None if ctx is None else ctx.epoch(channel)


def _may_read_ahead() -> bool:
    """The driver, or a worker in a group call that runs on one rank (see the module)."""
    if current_worker() is None:
        return True
    ctx = _call_ctx()
    return ctx is not None and ctx.participants == 1


class _Client:
    """This process's side of one channel: operation numbers, puts gathered but not sent,
    operations not yet acknowledged, read-ahead items per key. Guarded by ``_guard``."""

    def __init__(self, actor) -> None:
        self.actor = actor
        self.ops = itertools.count()
        self.pending: list[tuple[Any, int | None, list]] = []  # (key, epoch, entries) to send
        self.npending = 0  # items in ``pending``
        self.unacked: deque = deque()  # refs of operations that carried puts or hand-backs
        self.ahead: dict[Any, deque] = {}
        self.dirty = False  # put or handed back since the last end of a group call
        self.reading = False  # a reader (for read-ahead) until its end of call or hand-off

    def add(self, key: Any, epoch: int | None, entries: list) -> None:
        """Gather puts for the next operation (or the flusher: :data:`LINGER_S`)."""
        with _guard:
            last = self.pending[-1] if self.pending else None
            if last is not None and last[0] == key and last[1] == epoch:
                last[2].extend(entries)
            else:
                self.pending.append((key, epoch, list(entries)))
            self.npending += len(entries)
            if self.npending >= MAX_PENDING:
                self.flush()
            else:
                _flusher.wake()

    def submit(self, method: str, *args, track: bool = True):
        """Submit one operation numbered in this client's program order, carrying the puts
        gathered so far (the channel queues them first). ``track=False``: the caller waits
        for the reply itself, so a failure of the puts it carried is raised there."""
        with _guard:  # number and submit atomically: numbers follow submission order
            puts, op = self.pending, next(self.ops)
            try:
                ref = getattr(self.actor, method).remote((_identity(), op, puts, *args))
            except BaseException:  # not sent (the channel is gone): the puts stay gathered
                self.ops = itertools.count(op)
                raise
            self.pending, self.npending = [], 0
            if puts:
                self.dirty = True
                if track:
                    self.track(ref)
            return ref

    def flush(self):
        """Send the gathered puts now, as an operation of their own (its ref; ``None`` when
        there were none)."""
        with _guard:
            return self.submit("put", wait_timeout()) if self.pending else None

    def track(self, ref) -> None:
        """Remember an operation that queued items; past :data:`MAX_UNACKED` of them, wait
        for the oldest (a producer does not run ahead without bound)."""
        with _guard:
            self.unacked.append(ref)
            oldest = self.unacked.popleft() if len(self.unacked) > MAX_UNACKED else None
        if oldest is not None:
            ray.get(oldest, timeout=wait_timeout())

    def check(self) -> None:
        """Raise the error of the first acknowledged operation that failed (non-blocking)."""
        with _guard:
            sent = list(self.unacked)
        if not sent:
            return
        done = set(ray.wait(sent, num_returns=len(sent), timeout=0)[0])
        with _guard:
            while self.unacked and self.unacked[0] in done:
                ray.get(self.unacked.popleft())

    def take_ahead(self, key: Any, epoch: int | None) -> tuple | None:
        """The next read-ahead entry for a get of ``key`` (a stream read: of ``epoch``)."""
        with _guard:
            buf = self.ahead.get(key)
            if not buf:
                return None
            if epoch is None or buf[0][4] == epoch:
                return buf.popleft()
        self.hand_back(key)  # items of another step: back to the channel
        return None

    def hand_back(self, key: Any = _ALL) -> None:
        """Give read-ahead items of ``key`` (default: every key) back to the channel."""
        with _guard:
            keys = list(self.ahead) if key is _ALL else [key]
            for k in keys:
                entries = list(self.ahead.pop(k, ()))
                if entries:
                    self.track(self.submit("restore", k, entries))


_clients: dict[str, _Client] = {}  # by channel actor id


def flush_all(but: _Client | None = None) -> None:
    """Send every channel's gathered puts (but ``but``'s): this process is about to block."""
    with _guard:
        for client in _clients.values():
            if client is not but and client.pending:
                client.flush()


class _Flusher:
    """Sends gathered puts :data:`LINGER_S` after the first of them, for a producer that puts
    and then computes without another channel operation (one daemon thread per process)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="m2flow-flush", daemon=True)
            self._thread.start()
        self._event.set()

    def _run(self) -> None:
        while True:
            self._event.wait()
            time.sleep(LINGER_S)
            self._event.clear()  # puts gathered from here on wake the next round
            try:
                flush_all()
            except Exception:  # noqa: BLE001 (the channel's next operation raises it)
                pass


_flusher = _Flusher()


def finish_call(channels: dict, rank: int, participants: int, abort: str | None) -> None:
    """The end of this process's group call: read-ahead items go back, each channel of the
    call (``name -> (Channel, epoch)``) gets this rank's end-of-step marker (abort marker if
    ``abort``), and the call waits until every channel has queued this process's puts (and
    applied the markers of the channels it put to).

    Raises:
        RayError: a put or marker failed (e.g. the channel was closed); not with ``abort``.
    """
    waits: list = []
    errors: list[BaseException] = []
    with _guard:
        _finish(channels, rank, participants, abort, waits, errors)
    try:
        if waits:
            ray.get(waits, timeout=wait_timeout())
    except Exception as e:  # noqa: BLE001
        errors.append(e)
    if errors and abort is None:  # an aborting call keeps its own error
        raise errors[0]


def _finish(channels, rank, participants, abort, waits: list, errors: list) -> None:
    """Send what ends the call on every channel (each on its own: one gone channel must not
    keep the others' markers back); failures go to ``errors``."""

    def attempt(fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    clients = list(_clients.values())
    for client in clients:
        attempt(client.hand_back)
    for ch, epoch in channels.values():
        client = ch._client()
        # A marker counts for a group that put in the step. A lone rank that put nothing
        # knows its group did not: it sends none (a sibling rank might have put).
        put = client.dirty or bool(client.pending)
        if put or participants > 1 or abort is not None:
            client.reading = False  # the marker also ends its reading
            ref = attempt(client.submit, "end", rank, participants, epoch, abort)
            if ref is not None and put:  # a consumer's marker needs no wait
                waits.append(ref)
    for client in clients:
        if client.reading:  # no marker sent to it
            client.reading = False
            attempt(client.submit, "leave")
        attempt(client.flush)
        waits += client.unacked
        client.unacked.clear()
        client.dirty = False
        client.pending, client.npending = [], 0  # not sent by now: the channel is gone


class Channel:
    """Client handle of a channel; picklable, so it can be passed to workers."""

    def __init__(self, name: str, actor, maxsize: int | None = None) -> None:
        self.name = name
        self._actor = actor
        self._maxsize = maxsize  # None: unknown, so puts wait as on a bounded channel
        self._id = actor._actor_id.hex()

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
            name=f"channel:{name}", namespace=NAMESPACE, get_if_exists=True,
            scheduling_strategy=here(),
        ).remote(name, maxsize)  # fmt: skip
        existing = ray.get(actor.config.remote(), timeout=wait_timeout())["maxsize"]
        if existing != maxsize:
            raise ValueError(
                f"channel '{name}' already exists with maxsize={existing}, not {maxsize}: "
                "close it first (Channel.close) or use another name"
            )
        ch = cls(name, actor, maxsize)
        _created[name] = ch
        return ch

    def __reduce__(self):
        return (Channel, (self.name, self._actor, self._maxsize))

    def _client(self) -> _Client:
        client = _clients.get(self._id)
        if client is None:
            with _guard:
                client = _clients.setdefault(self._id, _Client(self._actor))
        return client

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

        On an unbounded channel this returns once the put is sent (see the module docstring
        for when its error surfaces); on a bounded one, once the item is queued.

        Raises:
            ValueError: a negative weight.
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
        """Queue ``items`` under ``key`` in order, in one operation: the same as ``put`` for
        each item. ``weights``: one per item (default 1 each).

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
        if current_worker() is None:  # the driver: pipelined steps put in step order
            with ordering.turn(f"channel:{self.name}"):
                return self._put_many(items, weights, key, async_op, timeout)
        return self._put_many(items, weights, key, async_op, timeout)

    def _put_many(self, items, weights, key, async_op, timeout):
        entries = [(payload(it), float(w)) for it, w in zip(items, weights)]
        client, epoch = self._client(), _call_epoch(self.name)
        if self._maxsize == 0 and not async_op:  # unbounded: nothing to wait for (module)
            client.add(key, epoch, entries)
            return None
        timeout = wait_timeout() if timeout is None else timeout
        with _guard:  # these items go in this operation, after the puts gathered before
            client.pending.append((key, epoch, entries))
            ref = client.submit("put", timeout, track=async_op)
        work = Work(ref, label=("channel_put", self.name))
        return work if async_op else work.wait()

    # -- get --------------------------------------------------------------------------------

    def get(self, key: Any = None, timeout: float | None = None, async_op: bool = False):
        """The oldest item under ``key`` (blocking).

        Raises:
            TimeoutError: nothing arrived within ``timeout`` s (default M2FLOW_WAIT_TIMEOUT).
        """
        entry = self._client().take_ahead(key, None)
        if entry is not None:
            item = resolve([entry[0]])[0]
            return Work(run=lambda: item) if async_op else item
        # An async get may be one of several outstanding: it takes exactly one item. A bounded
        # channel's bound holds items read ahead too: none there.
        prefetch = READ_AHEAD if self._reads_ahead() and not async_op else 0
        out = self._get(key, None, None, timeout, async_op, 1, None, prefetch)
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
        items to take (default :func:`m2flow.scheduler.runtime.balance.fifo`); see that module.

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
        one = target_weight is None and balance in (None, fifo) and max_items in (None, 1)
        prefetch = READ_AHEAD if one and self._reads_ahead() else 0
        client = self._client()
        while True:
            entry = client.take_ahead(key, epoch) if prefetch else None
            if entry is not None:
                yield resolve([entry[0]])
                continue
            items = self._get(
                key, target_weight, balance, timeout, False, max_items, epoch, prefetch
            )
            if items is None:
                return
            yield items

    def _reads_ahead(self) -> bool:
        return self._maxsize == 0 and _may_read_ahead()

    def _get(self, key, target, policy, timeout, async_op, max_items, epoch, prefetch=0):
        client = self._client()
        client.hand_back(key)  # this get must see them: it may want other items than they
        client.check()
        flush_all(but=client)  # this one's puts go with the get
        timeout = wait_timeout() if timeout is None else timeout
        policy = None if policy is fifo else policy
        args = (key, target, policy, timeout, max_items, epoch, prefetch)
        ref = client.submit("get", *args, track=async_op)
        client.reading = True
        then = functools.partial(self._received, key, prefetch)
        work = Work(ref, then=then, yields=True, label=("channel_get", self.name))
        if async_op:
            return work
        # Work.wait yields the worker's devices if the items are not there at once, so a
        # producer on the same devices can run meanwhile.
        return work.wait(timeout + 30)

    def _received(self, key: Any, prefetch: int, got: list[tuple] | None):
        if got is None:  # end of a stream
            return None
        if not prefetch:  # payloads
            return resolve(got)
        if len(got) > 1:  # entries, read ahead: the first is the one asked for
            with _guard:
                self._client().ahead.setdefault(key, deque()).extend(got[1:])
        return resolve([got[0][0]])

    # -- inspection and life cycle -----------------------------------------------------------

    def qsize(self, key: Any = None) -> int:
        """Items queued under ``key`` (this client's read-ahead items go back first)."""
        client = self._client()
        client.hand_back(key)
        client.check()
        return ray.get(client.submit("qsize", key, track=False), timeout=60)

    def graph_edges(self) -> list[tuple[str, str, int]]:
        """``(producer group, consumer group, items)`` recorded so far."""
        client = self._client()
        client.hand_back()
        return ray.get(client.submit("graph_edges", track=False), timeout=60)

    def _hand_off(self) -> None:
        """The driver gives this channel to a group call: its gathered puts go out, its
        read-ahead items go back, and it stops being a reader (the call's consumers may read
        ahead)."""
        client = _clients.get(self._id)
        if client is None:
            return
        with _guard:
            if client.reading:
                client.hand_back()
                client.submit("leave")
                client.reading = False
            client.flush()

    def close(self) -> None:
        """Kill the channel actor (queued items are lost); its name is free on return."""
        ray.kill(self._actor, no_restart=True)
        _created.pop(self.name, None)
        _clients.pop(self._id, None)
        wait_name_free(f"channel:{self.name}")

    @staticmethod
    def fanout(*channels: Channel) -> Fanout:
        """One producer feeding several channels: see :class:`Fanout`."""
        return Fanout(*channels)

    def __repr__(self) -> str:
        return f"Channel({self.name!r})"


class Fanout:
    """Several channels behind one ``put``: each item goes into every channel (one producer,
    several consumer groups; each channel records its own edge and end of step, and gets its
    own copy of the item).

    ``rollout.generate(prompts, Channel.fanout(a, b, c), ...)`` feeds three groups at once.

    Raises:
        ValueError: no channel given.
    """

    def __init__(self, *channels: Channel) -> None:
        if not channels:
            raise ValueError("Fanout needs at least one channel")
        self.channels = channels

    def put(self, item: Any, weight: float = 1.0, key: Any = None) -> None:
        self.put_many([item], [weight], key)

    def put_many(self, items: list[Any], weights: list[float] | None = None, key=None) -> None:
        works = [ch.put_many(items, weights, key, async_op=True) for ch in self.channels]
        for ch, work in zip(self.channels, works):
            if ch._maxsize != 0:  # bounded: wait for room, as each channel's put does
                work.wait()


def created_channels() -> dict[str, Channel]:
    """Channels this process created, by name."""
    return dict(_created)


def forget_channels() -> None:
    """Drop this process's channel registry (their Ray session is gone)."""
    _created.clear()
    _clients.clear()
