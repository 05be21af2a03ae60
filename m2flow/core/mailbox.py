"""Point-to-point messages between workers: ``send``/``recv``/``broadcast`` (RLinf section 3.5).

An object goes into the Ray object store once; the receiver's inbox gets the reference, so
tensors never pass through actor mailboxes. Each sender numbers its messages per receiver and
the inbox hands them out in that order (deliveries run on several threads and may arrive out of
order).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import defaultdict

import ray

from .._context import NAMESPACE
from .._env import wait_timeout
from . import events
from .work import Work, flush_puts

IO_GROUP = "m2flow_io"  # Ray concurrency group for runtime traffic (deliveries, offload, ping)


def actor_name(group: str, rank: int) -> str:
    """The Ray actor name of a rank, unique within the m2flow namespace."""
    return f"{group}:{rank}"


class Inbox:
    """Objects from one sender, handed out in the sender's order."""

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


class Mailbox:
    """The send/recv part of :class:`~m2flow.core.worker.Worker` (mixed in; state set up by
    :meth:`_m2flow_init_mailbox`)."""

    def _m2flow_init_mailbox(self) -> None:
        self._m2flow_inbox: dict[tuple[str, int], Inbox] = defaultdict(Inbox)
        self._m2flow_inbox_guard = threading.Lock()
        self._m2flow_send_seq: dict[tuple[str, int], itertools.count] = defaultdict(itertools.count)
        self._m2flow_send_guard = threading.Lock()
        self._m2flow_peers: dict[tuple[str, int], object] = {}

    def _m2flow_peer(self, group: str, rank: int):
        key = (group, rank)
        if key not in self._m2flow_peers:
            self._m2flow_peers[key] = ray.get_actor(actor_name(group, rank), namespace=NAMESPACE)
        return self._m2flow_peers[key]

    def send(self, obj, dst_group: str, dst_rank: int = 0, async_op: bool = False):
        """Send ``obj`` to rank ``dst_rank`` of group ``dst_group``.

        With ``async_op=True`` returns a :class:`~m2flow.core.work.Work` whose ``wait()`` returns
        when the receiver's inbox holds the object.

        Raises:
            ValueError: no such group/rank is running.
        """
        work = self._m2flow_deliver_to(ray.put(obj), dst_group, dst_rank)
        return work if async_op else work.wait()

    def broadcast(self, obj, dst_group: str, dst_world_size: int) -> None:
        """Send ``obj`` to ranks ``0..dst_world_size-1`` of ``dst_group`` and wait until every
        inbox holds it: one object-store copy, the same reference for every receiver.

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
        worker's devices meanwhile. With ``async_op=True`` returns a
        :class:`~m2flow.core.work.Work` whose ``wait()`` does the receive.

        Raises:
            TimeoutError: nothing arrived in time.
            WorkerDied: a worker of the run died meanwhile.
        """
        if async_op:
            return Work(run=lambda: self.recv(src_group, src_rank, timeout=timeout))
        timeout = wait_timeout() if timeout is None else timeout
        return ray.get(self._m2flow_recv_ref(src_group, src_rank, timeout))

    def _m2flow_recv_ref(
        self, src_group: str, src_rank: int, timeout: float, yield_devices: bool = True
    ):
        """The object reference of the next object from ``src_group``/``src_rank`` (see
        :meth:`recv`, which fetches it). ``yield_devices=False``: keep the devices while
        waiting (a receive beside a running group call must not release that call's)."""
        from . import liveness

        with self._m2flow_inbox_guard:
            box = self._m2flow_inbox[(src_group, src_rank)]
        ref = box.take(0) if box.ready() else None
        if ref is None:
            flush_puts()
            since, since_ns = time.time(), events.now()
            held = self._m2flow_yield_devices() if yield_devices else contextlib.nullcontext()
            with held:
                left = timeout
                while ref is None and left > 0:
                    ref = box.take(min(left, liveness.POLL_S))
                    left -= liveness.POLL_S
                    if ref is None:
                        liveness.check(self.worker_key, since)
            events.record("recv", f"from {actor_name(src_group, src_rank)}", since_ns)
        if ref is None:
            raise TimeoutError(
                f"{self.worker_key}: nothing received from "
                f"{actor_name(src_group, src_rank)} in {timeout:.0f} s"
            )
        return ref[0]

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_deliver(self, src_group: str, src_rank: int, seq: int, ref: list) -> None:
        with self._m2flow_inbox_guard:
            box = self._m2flow_inbox[(src_group, src_rank)]
        box.deliver(seq, ref)
