"""The process context: what this process is within a run, read by every runtime module.

Names a module needs to find the run's actors (:data:`NAMESPACE`, :data:`LOCK_SERVICE_NAME`,
:func:`here`, :func:`wait_name_free`) and what this process hosts (:func:`current_worker`, set
once by the worker; :func:`current_session`, set by ``with Session(...)``). They live here,
below every other runtime module and importing none, so that the runtime's import graph has no
loop: a channel or a lock asks "which worker am I" here, not of :mod:`m2flow.core.worker`, which
imports them. The public paths stay: ``m2flow.core.cluster.NAMESPACE``,
``m2flow.core.lock.LOCK_SERVICE_NAME``, ``m2flow.core.worker.current_worker``,
``m2flow.run.session.current_session``, ``m2flow.core.spot.here``.
"""

from __future__ import annotations

import threading
from typing import Any

NAMESPACE = "m2flow"  # the Ray namespace of every named actor of a run
LOCK_SERVICE_NAME = "m2flow:locks"  # the run's LockService (device locks and death records)

_worker: Any = None  # the m2flow.core.worker.Worker this process hosts, if any
_session: Any = None  # the open m2flow.run.session.Session, if any
_session_guard = threading.Lock()


def current_worker():
    """The :class:`~m2flow.core.worker.Worker` this process hosts, or ``None`` in the driver."""
    return _worker


def set_current_worker(worker) -> None:
    """Called once by a worker actor when it binds (``Worker._m2flow_bind``)."""
    global _worker
    _worker = worker


def current_session():
    """The open :class:`~m2flow.run.session.Session` of this process, if any."""
    return _session


def open_session(session) -> None:
    """Make ``session`` this process's session.

    Raises:
        RuntimeError: a session is already open (sessions do not nest).
    """
    global _session
    with _session_guard:
        if _session is not None:
            raise RuntimeError("an m2flow session is already open in this process")
        _session = session


def close_session() -> None:
    global _session
    with _session_guard:
        _session = None


def here():
    """A scheduling strategy pinning an actor to this process's node. The runtime's own actors
    (lock service, channels, the rollout manager) are created from reserved nodes and must stay
    there: a 0-CPU actor could otherwise land on a preemptible node and die with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def wait_name_free(name: str, timeout: float = 30.0) -> None:
    """Wait until no live actor is named ``name`` in :data:`NAMESPACE` (after a kill), so it
    can be reused; returns after ``timeout`` seconds either way."""
    import time

    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)
