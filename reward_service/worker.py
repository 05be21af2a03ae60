"""A reward worker process: serves one request at a time for one stage.

Started by the service as ``python -m m2flow.reward_service.worker KIND STAGE OPTIONS``
(``OPTIONS``: JSON; the service adds ``parent_pid``, ``memory_bytes`` and ``scratch_dir``).
It first makes sure it cannot outlive the service (``PR_SET_PDEATHSIG``: SIGKILL when the
service's thread that started it ends) and limits its own address space to ``memory_bytes``
(``RLIMIT_AS``: what it parses -- a program's source, a math answer -- cannot take the
machine's memory; a ``MemoryError`` fails the request). Then it imports the stage function
(the cold start), prints ``{"ready": true}``, reads one JSON request per line on stdin
(``{"payload", "carry"}``) and answers one JSON line on stdout. A stage function that raises
fails the request (``ok = False``); the process stays up. The service kills the process (its
whole group, sandboxes included) when a request passes its timeout, and removes
``scratch_dir`` after.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import traceback


def _die_with_parent(parent_pid: int | None) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)  # the service died before the signal was armed


def main(argv: list[str]) -> None:
    kind, stage, options = argv[0], argv[1], json.loads(argv[2])
    _die_with_parent(options.get("parent_pid"))
    if options.get("memory_bytes"):
        m = int(options["memory_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (m, m))
    from .pipelines import stage_function

    fn = stage_function(kind, stage)
    if kind == "math":
        import math_verify  # noqa: F401  (pay the import at start, not on the first request)
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not break the protocol
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        try:
            res = fn(msg["payload"], msg.get("carry") or {}, options)
        except Exception as e:  # a bad payload must fail the request, not the worker
            res = {"ok": False, "reward": None, "carry": {}, "detail": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
        out.write(json.dumps(res) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
