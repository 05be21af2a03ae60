"""Declared group methods: which methods of a worker a group exposes, and how each call's
per-rank results are collected (veRL's ``@register(dispatch_mode=...)``, RLinf's worker API).

A worker class declares its group methods with :func:`group_method`::

    class Actor(m2flow.Worker):
        @m2flow.group_method(collect="rank0")  # every rank returns the same reduced metrics
        def train(self, batch) -> dict: ...

``group.train(batch).wait()`` then returns rank 0's dict, not a list. A public method that is
not declared is not a group method: ``group.helper(...)`` raises ``AttributeError`` naming the
decorator. A subclass that overrides a declared method keeps its declaration (and may redeclare
it with another collection).

The runtime's own calls (weight sync, IPC release, link close) are not in this set: they take
:meth:`~m2flow.core.group.WorkerGroup.runtime_call`, which accepts only :data:`RUNTIME_CALLS`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

#: How a call's per-rank results become what ``GroupCall.wait()`` returns:
#: ``all``: the list, in rank order; ``rank0``: the first called rank's result (rank 0 unless
#: the group was narrowed with ``.on(...)``); ``sum``: the ranks' results added with ``+``.
COLLECT = ("all", "rank0", "sum")

#: The runtime's calls into a rank (methods of :class:`~m2flow.core.weights.Weights`), dispatched by
#: :meth:`~m2flow.core.group.WorkerGroup.runtime_call` only.
RUNTIME_CALLS = frozenset(
    {
        "_m2flow_send_weights",
        "_m2flow_recv_weights",
        "_m2flow_release_ipc",
        "_m2flow_close_weight_links",
    }
)

_ATTR = "_m2flow_collect"


def group_method(method: Callable | None = None, *, collect: str = "all"):
    """Declare a worker method a group method, collected as ``collect`` (see :data:`COLLECT`).

    Use bare (``@group_method``: ``collect="all"``) or with the keyword
    (``@group_method(collect="rank0")``).

    Raises:
        ValueError: ``collect`` is not one of :data:`COLLECT`.
    """
    if collect not in COLLECT:
        raise ValueError(f"group_method(collect={collect!r}): pick one of {', '.join(COLLECT)}")

    def mark(fn: Callable) -> Callable:
        setattr(fn, _ATTR, collect)
        return fn

    return mark if method is None else mark(method)


def no_device_lock(method):
    """Mark a group method as not touching device memory: its calls skip the device lock.

    Use it for bookkeeping methods (metrics, checkpoint paths) so they can run while another
    worker holds the device. It does not declare the method: add :func:`group_method` too.
    """
    method._m2flow_no_device_lock = True
    return method


def control_method(method: Callable | None = None, *, collect: str = "all"):
    """Declare a group method a control request: its calls run while the rank's other group
    calls run (a Ray concurrency group of their own, one thread), in arrival order among
    themselves, without device locks. The method must be thread-safe against the call it
    controls (e.g. set an event that call waits on) and takes no channels.
    """

    def mark(fn: Callable) -> Callable:
        fn._m2flow_control = True
        fn._m2flow_no_device_lock = True
        return group_method(fn, collect=collect)

    return mark if method is None else mark(method)


@functools.cache
def declared_methods(cls: type) -> dict[str, str]:
    """Group method name -> collection mode, for ``cls``: every public name whose most derived
    declaration (along the MRO) carries :func:`group_method`."""
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        for klass in cls.__mro__:
            fn = klass.__dict__.get(name)
            if fn is not None and hasattr(fn, _ATTR):
                out[name] = getattr(fn, _ATTR)
                break
    return dict(sorted(out.items()))


def collect(mode: str, results: list[Any]) -> Any:
    """``results`` (per called rank, in rank order) collected as ``mode`` (:data:`COLLECT`)."""
    if mode == "all":
        return results
    if mode == "rank0":
        return results[0]
    return functools.reduce(operator.add, results)


def undeclared(cls: type, method: str) -> AttributeError:
    """The error for ``group.<method>`` when ``method`` is not a declared group method."""
    name = cls.__name__
    if method.startswith("_") or not callable(getattr(cls, method, None)):
        return AttributeError(f"{name} has no group method '{method}'")
    return AttributeError(
        f"{name}.{method} is not a group method: declare it with "
        f"@m2flow.group_method(collect='all'|'rank0'|'sum') in {name}"
    )
