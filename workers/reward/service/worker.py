"""A reward worker process: serves one request at a time for one stage.

Started by the service as ``python -m m2flow.workers.reward.service.worker KIND STAGE OPTIONS``
(``OPTIONS``: JSON). It imports the stage function (the cold start), prints ``{"ready": true}``,
then reads one JSON request per line on stdin (``{"payload", "carry"}``) and answers one JSON
line on stdout. A stage function that raises fails the request (``ok = False``); the process
stays up. The service kills the process (its whole group) when a request passes its timeout.
"""

from __future__ import annotations

import json
import sys
import traceback


def main(argv: list[str]) -> None:
    from .pipelines import stage_function

    kind, stage, options = argv[0], argv[1], json.loads(argv[2])
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
