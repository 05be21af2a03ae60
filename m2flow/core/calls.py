"""What the driver tells a worker about one group call: channel epochs and chunk size.

A runner never computes chunk counts (RLinf section 3.3, elastic pipelining, is the runtime's
job). For that the driver stamps each group call with a :class:`CallContext`:

- **epochs**: for every channel the call receives as an argument (directly, in a container, or
  inside a :class:`~m2flow.core.channel.Fanout`), its *epoch*: the number of calls of this group
  that received that channel so far. The ``n``-th call of a producer that is given a channel
  and the ``n``-th call of a consumer given the same channel share epoch ``n``: they are the
  same step of the stream. A producer's puts carry the epoch; when its call returns, the
  runtime puts an *end-of-step* marker on each of its channels (an *abort* marker if it
  raised). A consumer reading with :meth:`~m2flow.core.channel.Channel.stream` gets items of its
  epoch until every producer group of that epoch has ended on all ranks of the call.
- **participants**: how many ranks the call was dispatched to (a producer group's end needs
  that many markers).
- **granularity**: items per chunk for the group's outputs under the run's plan (``None``: no
  plan, the producer coalesces its whole share).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CallContext:
    """Per-call runtime context (see the module docstring).

    Attributes:
        channels: channel name -> ``(Channel handle, epoch)``.
        participants: ranks the call runs on.
        granularity: items per output chunk from the plan, or ``None``.
    """

    channels: dict[str, tuple[Any, int]] = field(default_factory=dict)
    participants: int = 1
    granularity: int | None = None

    def epoch(self, channel: str) -> int | None:
        entry = self.channels.get(channel)
        return None if entry is None else entry[1]


def channels_in(values: Iterable[Any], depth: int = 3) -> list:
    """Channels found in ``values``: channels themselves, members of a ``Fanout``, and channels
    inside lists, tuples, sets and dict values (``depth`` levels deep). Order of first
    appearance, no duplicates by name."""
    from .channel import Channel, Fanout

    found: dict[str, Any] = {}

    def visit(v: Any, d: int) -> None:
        if isinstance(v, Channel):
            found.setdefault(v.name, v)
        elif isinstance(v, Fanout):
            for ch in v.channels:
                found.setdefault(ch.name, ch)
        elif d > 0 and isinstance(v, (list, tuple, set, frozenset)):
            for x in v:
                visit(x, d - 1)
        elif d > 0 and isinstance(v, dict):
            for x in v.values():
                visit(x, d - 1)

    for v in values:
        visit(v, depth)
    return list(found.values())
