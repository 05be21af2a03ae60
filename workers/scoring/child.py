"""The isolated reward process: imports a user's reward file once and scores samples sent by its
parent (:class:`~.isolated.IsolatedFunction`), one reply per sample, in order.

Run as ``python -m m2flow.workers.scoring.child SOCKET_FD PARENT_PID``: ``SOCKET_FD`` is a
connected socket (pickled messages, :class:`multiprocessing.connection.Connection`); stdout and
stderr are the parent's capture pipe. Messages:

- parent -> child, first: ``{"function": "/abs/file.py:fn", "marker": bytes, "sys_path": [...]}``;
  child -> parent: ``("ready",)``, ``("missing",)`` (no callable ``fn``) or
  ``("raised", "Type: message")`` (the import raised, ``SystemExit`` included).
- parent -> child: ``("score", [(data_source, solution_str, ground_truth, extra_info), ...])``;
  child -> parent, per sample: ``("ok", score, {metric: value})`` or ``("error", what)``.
  After each call the child flushes its output and writes ``marker`` to stdout, so the parent
  can tell one call's output from the next one's.

The child exits when its connection closes, and (a watchdog thread) when its parent is gone,
even while the user's function hangs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from .returns import BadReturn, as_score


def describe(err: BaseException) -> str:
    """``"Type: message"`` of an exception raised by the user's code (``sys.exit`` named)."""
    if isinstance(err, SystemExit):
        return f"SystemExit: {err.code!r} (sys.exit was called)"
    try:
        text = str(err)
    except Exception:  # an exception whose str() raises
        text = ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(70)  # orphaned: nobody reads our results
        threading.Event().wait(1.0)


def _import(function: str):
    path, _, name = function.rpartition(":")
    module_name = "m2flow_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, Path(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return getattr(module, name, None)


def _end_of_call(marker: bytes) -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # the user's code may have replaced or closed them
            pass
    try:
        os.write(1, marker)
    except OSError:
        pass


def _score(fn, args) -> tuple:
    try:
        score, extra = as_score(fn(*args))
    except BadReturn as e:
        return ("error", str(e))
    except BaseException as e:  # the user's code: SystemExit and KeyboardInterrupt too
        return ("error", describe(e))
    return ("ok", score, extra)


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    threading.Thread(target=_watch_parent, args=(int(sys.argv[2]),), daemon=True).start()
    init = conn.recv()
    sys.path[:] = init["sys_path"]
    marker = init["marker"]
    try:
        fn = _import(init["function"])
    except BaseException as e:  # SystemExit and KeyboardInterrupt at import are errors too
        _end_of_call(marker)
        conn.send(("raised", describe(e)))
        return
    _end_of_call(marker)
    if not callable(fn):
        conn.send(("missing",))
        return
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "score":
            return
        for args in msg[1]:
            reply = _score(fn, args)
            _end_of_call(marker)
            conn.send(reply)


if __name__ == "__main__":
    main()
