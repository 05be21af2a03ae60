"""Device-lock grant order (RLinf section 3.3): which waiting worker takes its devices next.

Pure policy, called by the runtime's lock service (:mod:`m2flow.core.lock`) whenever a lock is
released or a worker starts waiting. Rules, in order:

1. Requests go by ``(priority, seq)``: the group's priority (the runtime gives its launch
   order), then arrival.
2. Data dependencies first: a request never precedes a waiting request of a group that feeds
   it, directly or not (``downstream`` is the producer -> consumers graph the channels
   report). A consumer granted before its producer would only wait for data while holding the
   device. Inside a cycle (each feeds the other) the order of rule 1 stands.
3. A request is granted when none of its devices is held and none is wanted by an earlier
   request that is still blocked (so a request for several devices is not starved by a stream
   of single-device requests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LockRequest:
    """One worker waiting for all of its devices.

    Attributes:
        key: the worker (``group:rank``).
        group: its worker group (what dependencies are recorded between).
        devices: global device ids it needs, all at once.
        priority: lower goes first (rule 1).
        seq: arrival number (ties).
    """

    key: str
    group: str
    devices: tuple[int, ...]
    priority: int
    seq: int


def reaches(downstream: Mapping[str, Iterable[str]], a: str, b: str) -> bool:
    """True if group ``a`` feeds group ``b`` through one or more edges of ``downstream``."""
    seen, stack = {a}, [a]
    while stack:
        for nxt in downstream.get(stack.pop(), ()):
            if nxt == b:
                return True
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def upstream_first(
    requests: Sequence[LockRequest], downstream: Mapping[str, Iterable[str]]
) -> list[LockRequest]:
    """``requests`` sorted by ``(priority, seq)``, then reordered so that no request precedes
    a request of a group that feeds it (rule 2; groups in a common cycle keep their order)."""
    rest = sorted(requests, key=lambda r: (r.priority, r.seq))
    out: list[LockRequest] = []
    while rest:
        pick = 0
        for i, r in enumerate(rest):
            if not any(
                reaches(downstream, o.group, r.group) and not reaches(downstream, r.group, o.group)
                for o in rest
                if o is not r
            ):
                pick = i
                break
        out.append(rest.pop(pick))
    return out


def grants(
    requests: Sequence[LockRequest],
    held: Iterable[int],
    downstream: Mapping[str, Iterable[str]],
) -> list[LockRequest]:
    """The requests to grant now, in grant order (rule 3 over the order of rules 1-2).

    Args:
        requests: the waiting requests.
        held: device ids held right now.
        downstream: group -> groups it feeds.
    """
    busy, blocked, out = set(held), set(), []
    for r in upstream_first(requests, downstream):
        if any(d in busy or d in blocked for d in r.devices):
            blocked.update(r.devices)
            continue
        busy.update(r.devices)
        out.append(r)
    return out
