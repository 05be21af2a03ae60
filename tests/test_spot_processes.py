"""Every process a local spot cluster starts (``m2flow.core.spot.LocalSpotCluster``: the head and
spot nodes run as ``ray start`` in sessions of their own, so a terminal's signals miss them)
ends with the driver: on a normal exit without ``shutdown``, on an error, on SIGINT, on
SIGTERM and on SIGKILL (when nothing of the driver runs: ``m2flow.core.reaper``), while a trace
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
from m2flow.core.spot import LocalSpotCluster

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


HANDOFF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workflows", "handoff.py")


def _tree(root: str) -> dict[str, str]:
    """Every path under ``root`` -> what it holds (a file's text, a link's target, "dir")."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                with open(path, errors="replace") as f:
                    out[rel] = f.read()
    return out


@pytest.mark.parametrize("depth", ["short", "deep"])
def test_a_spot_run_touches_nothing_outside_its_run_directory(tmp_path, depth):
    """A spot run (``cluster.spot.nodes=1``, one step) keeps its Ray session in
    ``<run_dir>/ray`` and leaves the machine's Ray temp dir as it was: the current-cluster
    pointer there (which ``ray.init(address="auto")`` reads) still names what it named. The
    run's ``TMPDIR`` (so Ray's machine-wide temp dir is ``$TMPDIR/ray``) is a directory of the
    test's own. A deep run directory (Ray's socket paths must stay under 107 bytes) gets a
    short link to its ``ray/`` while the run lasts; the link is gone after it."""
    import shutil
    import tempfile

    machine = tempfile.mkdtemp(prefix="m2t-")  # short: the link fits in it
    short = tempfile.mkdtemp(prefix="m2r-")
    try:
        pointer = os.path.join(machine, "ray", "ray_current_cluster")
        os.makedirs(os.path.dirname(pointer))
        with open(pointer, "w") as f:
            f.write("127.0.0.1:6379")  # another Ray user's cluster on this machine
        before = _tree(machine)
        run_dir = os.path.join(short, "r") if depth == "short" else str(tmp_path / ("d" * 60))
        env = {**os.environ, "TMPDIR": machine, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_TMPDIR", None)
        proc = subprocess.run(
            [sys.executable, "-m", "m2flow.run.cli", "run", HANDOFF, "cluster.spot.nodes=1",
             "trainer.steps=1", f"trainer.run_dir={run_dir}"],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _tree(machine) == before  # nothing created, the pointer unchanged
        ray_dir = os.path.join(run_dir, "ray")
        sessions = [d for d in os.listdir(ray_dir) if d.startswith("session_2")]
        assert len(sessions) == 1, os.listdir(ray_dir)
        with open(os.path.join(ray_dir, "ray_current_cluster")) as f:
            assert f.read().startswith("127.0.0.2:")  # ray start's pointer, in the run dir
        assert os.path.isdir(os.path.join(ray_dir, sessions[0], "logs"))
    finally:
        shutil.rmtree(machine, ignore_errors=True)
        shutil.rmtree(short, ignore_errors=True)
