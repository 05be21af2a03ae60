"""Run untrusted generated Python against test cases in a contained child process.

Containment, from strongest available:

- a fresh *user + mount + network namespace* (``unshare -rmn``, no root needed where the kernel
  allows unprivileged user namespaces): the network namespace has no interfaces up, so every
  connection fails; every mount is remounted read-only except a bind mount of the scratch
  directory, so the code can write nowhere else;
- resource limits set in the child before the code runs: ``RLIMIT_CPU`` (CPU seconds),
  ``RLIMIT_AS`` (address space, bytes), ``RLIMIT_FSIZE`` (largest file, bytes),
  ``RLIMIT_NOFILE`` (open files) and ``RLIMIT_NPROC = 0`` (no fork: the user already has
  a process, so any fork fails with EAGAIN). Real root ignores ``RLIMIT_NPROC``, so when the
  service runs as root the child drops to ``nobody`` (uid 65534) first, which also loses the
  capabilities that could undo the read-only remounts;
- the scratch directory (a fresh temp dir) as the working directory, an empty environment;
- a hard wall-clock timeout: the child's whole process group is killed (SIGKILL).

Without ``unshare`` (or where user namespaces are disabled), :func:`run_tests` falls back to
rlimits plus an in-child patch of :mod:`socket` that refuses to create sockets: a best-effort
block that determined code (e.g. ctypes) can get around, and writes outside the scratch dir
are then only size-limited, not prevented. :func:`isolation` reports which one is in use.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Runs inside the sandbox (stdlib only, python -I -S). Reads {"code", "tests", limits} on stdin.
_RUNNER = r"""
import json, os, resource, sys
spec = json.loads(sys.stdin.read())
lim = spec["limits"]
def setl(res, v):
    try:
        resource.setrlimit(res, (v, v))
    except (ValueError, OSError):
        pass
setl(resource.RLIMIT_CPU, lim["cpu_s"])
setl(resource.RLIMIT_AS, lim["memory_bytes"])
setl(resource.RLIMIT_FSIZE, lim["file_bytes"])
setl(resource.RLIMIT_NOFILE, lim["open_files"])
setl(resource.RLIMIT_NPROC, 0)
if spec["drop_to"] is not None:  # real root: RLIMIT_NPROC binds only unprivileged users
    os.setgroups([])
    os.setgid(spec["drop_to"])
    os.setuid(spec["drop_to"])
if spec["patch_socket"]:
    import socket
    class _NoNet(socket.socket):
        def __init__(self, *a, **k):
            raise PermissionError("network access is disabled in the sandbox")
    socket.socket = _NoNet
    socket.create_connection = lambda *a, **k: _NoNet()
out = sys.stdout
sys.stdout = sys.stderr = open(os.devnull, "w")
result = {"module_error": None, "passed": 0, "errors": []}
env = {"__name__": "__main__"}
try:
    exec(compile(spec["code"], "<solution>", "exec"), env)
except BaseException as e:
    result["module_error"] = type(e).__name__ + ": " + str(e)[:200]
if result["module_error"] is None:
    for t in spec["tests"]:
        try:
            exec(compile(t, "<test>", "exec"), dict(env))
            result["passed"] += 1
        except BaseException as e:
            result["errors"].append(type(e).__name__ + ": " + str(e)[:200])
out.write(json.dumps(result))
out.flush()
"""

# Inside the new namespaces: keep the scratch dir writable, make every other mount read-only.
_CONFINE = r"""
set -e
mount --bind "$1" "$1"
awk '{print $2}' /proc/self/mounts | while read -r m; do
  [ "$m" = "$1" ] && continue
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
cd "$1"
shift
exec "$@"
"""


@dataclass(frozen=True)
class Limits:
    """Sandbox limits: wall-clock and CPU seconds, address space / file size bytes, files."""

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 1 * 2**20
    open_files: int = 64


@dataclass
class RunResult:
    """Outcome of one sandboxed run.

    Attributes:
        status: ``ok`` (ran; see ``passed``), ``module_error`` (the code raised at top level),
            ``timeout`` (wall clock), ``killed`` (a signal, e.g. SIGXCPU/SIGKILL from limits),
            ``crashed`` (no result from the child).
        passed: tests passed; total: tests run.
        detail: short reason.
        seconds: wall time.
    """

    status: str
    passed: int
    total: int
    detail: str
    seconds: float


_ISOLATION: str | None = None
_NOBODY = 65534


def isolation() -> str:
    """``namespaces`` when ``unshare -rmn`` works here, else ``rlimits+socket-patch``."""
    global _ISOLATION
    if _ISOLATION is None:
        ok = False
        if shutil.which("unshare") and shutil.which("mount"):
            try:
                ok = (
                    subprocess.run(
                        ["unshare", "-rmn", "sh", "-c", "mount -o remount,bind,ro / && true"],
                        capture_output=True,
                        timeout=10,
                    ).returncode
                    == 0
                )
            except (OSError, subprocess.SubprocessError):
                ok = False
        _ISOLATION = "namespaces" if ok else "rlimits+socket-patch"
    return _ISOLATION


def run_tests(code: str, tests: list[str], limits: Limits = Limits()) -> RunResult:
    """Run ``code`` then each test snippet (e.g. ``"assert f(2) == 4"``) in a sandbox.

    Returns:
        :class:`RunResult`; never raises for anything the code does.
    """
    t0 = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="m2flow-sbx-")
    spec = {
        "code": code,
        "tests": list(tests),
        "limits": {
            "cpu_s": int(limits.cpu_s),
            "memory_bytes": int(limits.memory_bytes),
            "file_bytes": int(limits.file_bytes),
            "open_files": int(limits.open_files),
        },
        "patch_socket": isolation() != "namespaces",
        "drop_to": _NOBODY if os.geteuid() == 0 else None,
    }
    runner = os.path.join(scratch, ".runner.py")
    with open(runner, "w") as f:
        f.write(_RUNNER)
    py = [_python(), "-I", "-S", runner]
    if os.geteuid() == 0:
        os.chmod(scratch, 0o777)  # the code runs as nobody
    if isolation() == "namespaces":
        # real root needs no user namespace (and must keep real uids to drop to nobody)
        ns = "-mn" if os.geteuid() == 0 else "-rmn"
        cmd = ["unshare", ns, "sh", "-c", _CONFINE, "confine", scratch, *py]
    else:
        cmd = py
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=scratch,
        env=env,
        start_new_session=True,  # its own process group: the timeout kills everything in it
    )
    try:
        out, err = proc.communicate(json.dumps(spec).encode(), timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        shutil.rmtree(scratch, ignore_errors=True)
        return RunResult("timeout", 0, len(tests), "wall-clock limit", time.perf_counter() - t0)
    finally:
        _kill_group(proc)  # anything left in the group (should be nothing: no fork)
    shutil.rmtree(scratch, ignore_errors=True)
    dt = time.perf_counter() - t0
    if proc.returncode and proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        return RunResult("killed", 0, len(tests), f"killed by {sig}", dt)
    try:
        res = json.loads(out.decode() or "null")
    except ValueError:
        res = None
    if not isinstance(res, dict):
        tail = err.decode(errors="replace")[-200:]
        return RunResult("crashed", 0, len(tests), f"exit {proc.returncode}: {tail}", dt)
    if res["module_error"]:
        return RunResult("module_error", 0, len(tests), res["module_error"], dt)
    detail = "; ".join(res["errors"][:3])
    return RunResult("ok", res["passed"], len(tests), detail, dt)


def _python() -> str:
    """The interpreter for the child: this one, unless it sits where ``nobody`` cannot read
    (e.g. under /root) while the child drops to ``nobody``; then the system ``python3``."""
    exe = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or _world_readable(sys.base_prefix):
        return exe
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and _world_readable(os.path.dirname(os.path.realpath(cand))):
            return cand
    return exe


def _world_readable(path: str) -> bool:
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & 0o005:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
