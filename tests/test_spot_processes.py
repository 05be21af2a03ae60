"""Every process a local spot cluster starts (``m2flow.spot.LocalSpotCluster``: the head and
spot nodes run as ``ray start`` in sessions of their own, so a terminal's signals miss them)
ends with the driver: on a normal exit without ``shutdown``, on an error, on SIGINT, on
SIGTERM and on SIGKILL (when nothing of the driver runs: ``m2flow.reaper``), while a trace
flaps a node every 0.3 s (a node may be starting at that moment).

Processes are counted by a marker in their environment, which every process the driver
starts (and theirs) inherits: other Ray sessions on the machine do not count.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.e2e

DRIVER = """
import sys, time
from m2flow.spot import LocalSpotCluster

local = LocalSpotCluster(1, {"m2flow_virtual_device": 1}, spot_cpus=1)
local.add_spot(1)
local.replay([(0.3 * k, k % 2) for k in range(1, 400)])  # flaps every 0.3 s
print("ready", flush=True)
time.sleep(1.0)
if sys.argv[1] == "exit":
    sys.exit(0)  # no shutdown() call
if sys.argv[1] == "error":
    raise RuntimeError("the driver failed")
time.sleep(300)  # until the test's signal
"""


def marked(mark: str) -> list[int]:
    """PIDs of live processes whose environment holds ``mark``."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if mark.encode() in f.read():
                    pids.append(int(d))
        except OSError:  # gone, a zombie, or not ours
            continue
    return pids


# "error" and SIGINT (KeyboardInterrupt) end the interpreter by the same atexit path as "exit"
# (pass them here to check them too; each case starts a cluster, ~5 s on an idle machine).
@pytest.mark.parametrize("end", ["exit", "SIGTERM", "SIGKILL"])
def test_spot_cluster_processes_end_with_the_driver(end, tmp_path):
    mark = f"m2flow-leak-{uuid.uuid4().hex}"
    env = {**os.environ, "M2FLOW_LEAK_MARK": mark, "RAY_USAGE_STATS_ENABLED": "0"}
    assert marked(mark) == []  # before
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, end], env=env, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        during = len(marked(mark))
        assert during >= 4  # the driver, the head's ray start, GCS, raylet, a spot node, ...
        if end.startswith("SIG"):
            time.sleep(1.5)  # mid-flap
            proc.send_signal(getattr(signal, end))
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = marked(mark)
    deadline = time.monotonic() + 20
    while left and time.monotonic() < deadline:  # SIGKILLed trees need a moment to go
        time.sleep(0.5)
        left = marked(mark)
    stderr = proc.stderr.read()
    assert left == [], (end, code, [open(f"/proc/{p}/cmdline").read()[:200] for p in left])
    if end in ("exit", "SIGTERM"):  # no thread died (the trace replay's included)
        assert "Traceback" not in stderr, stderr[-3000:]
    expected = {
        "exit": (0,),
        "error": (1,),
        "SIGINT": (1, -2, 130),
        "SIGTERM": (15, 143),
        "SIGKILL": (-9,),
    }[end]
    assert code in expected, (code, stderr[-2000:])
