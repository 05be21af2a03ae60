"""Run untrusted generated Python against test cases; the verdict is decided outside it.
:func:`run_code` runs a program alone in the same sandbox and returns what it prints (the
tool API's ``python`` tool, :mod:`.tools`).

Trust model (docs/concepts/design.md, "Reward service trust model"; DistRS section 2.2's code
rewards, Figure 4). Submitted programs are hostile. What is guaranteed, when the service runs as
root with ``unshare`` (the deployment this is built and tested for; :func:`isolation` says
``namespaces``):

- **The reward cannot be forged.** The program never runs in a process that can reach the
  verdict. Each test runs in its own child, forked by a trusted harness (:mod:`.harness`,
  which never runs submitted code); the child has only /dev/null and a value pipe. For every
  top-level ``assert`` of a test the child sends back the *values* of the program-dependent
  sub-expressions; the constants, comparisons and verdict stay in the worker
  (:mod:`.verdict`), and the sandbox never receives the constants. Forging the value pipe
  (``os.write`` to any fd, ``os._exit(0)``, patched builtins, a replaced ``AssertionError``)
  is worth exactly what an honest program returning the forged values would get; an object
  whose ``__eq__`` always returns True is a non-built-in value and passes nothing. The reward
  is the share of tests passed, in [0, 1] by construction (and clamped again by the service).
  Residual: a test with no top-level ``assert`` (e.g. ``check(f)``) is self-reported by the
  child and so forgeable; :attr:`RunResult.sealed` counts the tests that are not.
- **Sandboxes cannot touch each other, the service or the host's files.** Each run has its
  own PID namespace (the harness is its init: when it dies, the kernel kills everything in
  it), network namespace (no interfaces) and mount namespace with a root file system of its
  own (a tmpfs with read-only binds of /usr, /bin, /lib..., /dev/null, a /proc that shows only
  the run, and /scratch, the only writable place: a tmpfs of ``scratch_bytes`` and
  ``scratch_files``, the run's disk quota, ``0700`` under its uid): host configs (the
  service's tokens), repositories, home directories and other sandboxes do not exist there.
  Each child runs under a uid of its own (``100000 + 8 * worker pid + n``), so it can
  signal, ptrace or read the files of no other process.
- **Limits** are set in the child before the program runs: ``RLIMIT_CPU`` (CPU seconds per
  test), ``RLIMIT_AS`` (bytes), ``RLIMIT_FSIZE`` (bytes), ``RLIMIT_NOFILE`` (files),
  ``RLIMIT_NPROC = 0`` (no fork: its uid already has a process) and a wall-clock budget for
  the whole run (the harness kills the child at the deadline; the worker kills the harness's
  namespace a little later if the harness itself hangs).
- **Bounded reads.** The worker reads at most ``output_bytes`` (+ a small envelope) of the
  harness's report and 16 KiB of its stderr; the program's own stdout/stderr go to /dev/null.
- **Nothing outlives a run.** The sandbox is in the worker's process group and dies with the
  worker (``setpriv --pdeathsig``, ``unshare --kill-child``), and its scratch directory is
  removed by the worker, or by the service when it kills the worker (a per-worker scratch
  root, see :mod:`.pools`).

Weaker modes: without root, ``unshare -r`` gives a user namespace in which the child keeps the
namespace's root (no per-sandbox uid; it could undo the read-only mounts); without
``unshare``, only the rlimits, the per-sandbox uid (as root) and an in-child patch of
:mod:`socket` (``rlimits+socket-patch``) remain: no PID or mount isolation, the host's
world-readable files are readable, a child that leaves its session can outlive a killed
worker, and the scratch quota is counted by the harness every 10 ms (a child past it is
stopped; it may overshoot by what it writes meanwhile).
"""

from __future__ import annotations

import base64
import codecs
import itertools
import json
import math
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from .verdict import TestFailed, decide, decode, plan

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
#: first uid handed to sandboxes (each worker process owns 8 consecutive uids from here)
UID_BASE = 100000
_STDERR_CAP = 16 * 2**10
_GRACE_S = 3.0  # the harness enforces wall_s itself; the worker only backs it up


@dataclass(frozen=True)
class Limits:
    """Sandbox limits.

    Attributes:
        wall_s: wall-clock budget of the whole run (all tests), seconds.
        cpu_s: CPU seconds per test (``RLIMIT_CPU``).
        memory_bytes: address space per test (``RLIMIT_AS``), bytes.
        file_bytes: largest file the program may write (``RLIMIT_FSIZE``), bytes.
        open_files: most open files (``RLIMIT_NOFILE``).
        output_bytes: most bytes read back from the sandbox per run (the values of all
            tests; per test at most 64 KiB), bytes.
        scratch_bytes: the run's quota of bytes in its /scratch (all files together; a
            size-limited tmpfs, so a write past it fails with ``ENOSPC``), bytes.
        scratch_files: most files and directories in its /scratch (the tmpfs's inodes).

    Raises:
        ValueError: a limit that is not a positive number (or not an integer where the
            kernel takes one).
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 1 * 2**20
    open_files: int = 64
    output_bytes: int = 1 * 2**20
    scratch_bytes: int = 16 * 2**20
    scratch_files: int = 4096

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            check_limit(name, value)


#: the integer limits (rlimits and byte counts); ``wall_s`` may be fractional
_INT_LIMITS = {
    "cpu_s", "memory_bytes", "file_bytes", "open_files", "output_bytes", "scratch_bytes",
    "scratch_files",
}  # fmt: skip
#: below these nothing can run
_MIN_LIMITS = {"open_files": 8, "output_bytes": 1024, "scratch_bytes": 2**16, "scratch_files": 16}


def check_limit(name: str, value) -> None:
    """Raise ValueError unless ``value`` is a valid ``name`` limit: a finite positive number
    (not a bool), an integer for the integer limits, within 2**62 (no overflow into
    RLIM_INFINITY)."""
    if name not in _INT_LIMITS and name != "wall_s":
        known = sorted(_INT_LIMITS | {"wall_s"})
        raise ValueError(f"unknown sandbox limit {name!r}: known {known}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"sandbox limit {name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0 or value > 2**62:
        raise ValueError(f"sandbox limit {name} must be > 0 and finite, got {value!r}")
    if name in _INT_LIMITS and value != int(value):
        raise ValueError(f"sandbox limit {name} must be an integer, got {value!r}")
    if value < _MIN_LIMITS.get(name, 0):
        raise ValueError(f"sandbox limit {name} must be >= {_MIN_LIMITS[name]}, got {value!r}")


@dataclass
class RunResult:
    """Outcome of one sandboxed run.

    Attributes:
        status: ``ok`` (ran; see ``passed``), ``module_error`` (the code raised at top level),
            ``timeout`` (wall clock), ``killed`` (a signal, e.g. SIGXCPU from limits),
            ``crashed`` (no result from the harness).
        passed: tests passed; total: tests given.
        detail: short reason.
        seconds: wall time.
        sealed: tests whose pass the sandbox cannot forge (:mod:`.verdict`).
    """

    status: str
    passed: int
    total: int
    detail: str
    seconds: float
    sealed: int = 0


_ISOLATION: str | None = None
_SEQ = itertools.count()


def isolation() -> str:
    """``namespaces`` when ``unshare`` gives PID + mount + network namespaces here, else
    ``rlimits+socket-patch``."""
    global _ISOLATION
    if _ISOLATION is None:
        ok = False
        if shutil.which("unshare") and shutil.which("mount"):
            try:
                probe = "mount -o remount,bind,ro / && true"
                ok = subprocess.run(
                    [*_unshare(), "sh", "-c", probe], capture_output=True, timeout=10
                ).returncode == 0  # fmt: skip
            except (OSError, subprocess.SubprocessError):
                ok = False
        _ISOLATION = "namespaces" if ok else "rlimits+socket-patch"
    return _ISOLATION


def _unshare() -> list[str]:
    # real root needs no user namespace (and must keep real uids to drop to per-run uids)
    user = [] if os.geteuid() == 0 else ["-r"]
    return ["unshare", *user, "-p", "-f", "--kill-child", "--mount-proc", "-m", "-n"]


def sandbox_uid() -> int | None:
    """A uid no other live sandbox uses (``None`` unless root): 8 per worker pid."""
    if os.geteuid() != 0:
        return None
    return UID_BASE + 8 * os.getpid() + next(_SEQ) % 8


def run_tests(
    code: str, tests: list[str], limits: Limits = Limits(), scratch_root: str | None = None
) -> RunResult:
    """Run ``code`` against each test snippet (e.g. ``"assert f(2) == 4"``) in a sandbox.

    Args:
        scratch_root: where the run's scratch directory goes (default: the temp dir); the
            service gives each worker its own, so it can remove what a killed worker left.

    Returns:
        :class:`RunResult`; never raises for anything the code does.

    Raises:
        SyntaxError: a test does not parse (the check stage catches that first).
    """
    t0 = time.perf_counter()
    plans = [plan(t) for t in tests]
    spec = {
        "code": code,
        "tests": [p.steps for p in plans],
        "value_bytes": min(64 * 2**10, limits.output_bytes),
        "output_bytes": limits.output_bytes,
    }
    out, err, rc, timed_out = _launch(spec, limits, scratch_root)
    dt = time.perf_counter() - t0
    if timed_out:
        return RunResult("timeout", 0, len(tests), "wall-clock limit", dt)
    try:
        report = json.loads(out)["tests"]
    except (ValueError, KeyError, TypeError):
        tail = err.decode(errors="replace")[-200:]
        return RunResult("crashed", 0, len(tests), f"harness exit {rc}: {tail}", dt)
    return _score(plans, report, len(tests), dt)


def _launch(spec: dict, limits: Limits, scratch_root: str | None):
    """Run the harness on ``spec`` (the run's own fields: ``code``, ``tests``, ``mode``...;
    the limits, uid and confinement are added here) in a fresh sandbox with a scratch
    directory of its own, removed after. Returns :func:`_exchange`'s (out, err, rc,
    timed_out)."""
    uid = sandbox_uid()
    scratch = tempfile.mkdtemp(prefix="sbx-" if scratch_root else "m2flow-sbx-", dir=scratch_root)
    try:
        if uid is not None:
            os.chown(scratch, uid, uid)
        os.chmod(scratch, 0o700)
        ns = isolation() == "namespaces"
        mnt = scratch + ".root"  # the mount point of the run's own root file system
        os.mkdir(mnt, 0o700)
        py, prefix = _python()
        spec = {
            **spec,
            "limits": {k: int(v) for k, v in asdict(limits).items() if k != "wall_s"},
            "uid": uid,
            "wall_s": limits.wall_s,
            "patch_socket": not ns,
            "confine": {"mnt": mnt, "prefix": prefix, "uid": uid} if ns else None,
            # namespaces: /scratch is a tmpfs of this size (the kernel enforces it); else the
            # harness counts what the test child wrote here and stops it past the quota
            "scratch": {"bytes": limits.scratch_bytes, "files": limits.scratch_files},
        }
        cmd = [*(_unshare() if ns else []), py, "-I", "-S", _HARNESS]
        if shutil.which("setpriv"):  # the sandbox dies with this worker, however it dies
            cmd = ["setpriv", "--pdeathsig", "KILL", *cmd]
        return _exchange(cmd, scratch, json.dumps(spec).encode(), limits.wall_s + _GRACE_S, limits)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(scratch + ".root", ignore_errors=True)


def _score(plans: list, report: list, total: int, dt: float) -> RunResult:
    passed, errors = 0, []
    for p, res in zip(plans, report):
        if res["timeout"]:
            return RunResult("timeout", 0, total, "wall-clock limit", dt)
        if res["signal"]:
            return RunResult("killed", 0, total, f"killed by {res['signal']}", dt)
        if res["status"] in (97, 98) and not res["out"]:
            return RunResult("crashed", 0, total, "sandbox set-up failed", dt)
        if res.get("quota"):  # counted (no namespaces): the child was stopped past it
            return RunResult("killed", 0, total, "over its scratch quota", dt)
        try:
            if res["overflow"]:
                raise TestFailed("values over the sandbox's output limit")
            if not res["out"]:
                raise TestFailed(f"no result (exit {res['status']})")
            rep = decode(res["out"])
            if "m" in rep:
                return RunResult("module_error", 0, total, str(rep["m"])[:300], dt)
            decide(p, rep)
            passed += 1
        except TestFailed as e:
            errors.append(str(e))
        except Exception as e:  # a flaw of the verdict code fails this test, not the run
            errors.append(f"verdict failed: {type(e).__name__}")
    errors += ["not run"] * (total - len(report))
    sealed = sum(p.sealed for p in plans)
    detail = "; ".join(errors[:3])
    return RunResult("ok", min(passed, total), total, detail, dt, sealed)


@dataclass
class CodeResult:
    """Outcome of one tool run (:func:`run_code`).

    Attributes:
        status: ``ok`` (the code ran to its end), ``error`` (it raised, or exited with a
            non-zero status), ``timeout`` (wall clock), ``killed`` (a signal, e.g. SIGXCPU
            at the CPU limit, or over its scratch quota), ``crashed`` (no report from the
            sandbox: its set-up failed).
        output: what the code wrote to stdout and stderr (UTF-8, undecodable bytes replaced),
            at most ``max_output_bytes`` bytes of it.
        error: why it is not ``ok`` (for ``error``: the traceback's end); empty when ok.
        seconds: wall time of the run.
        truncated: the code wrote more than ``max_output_bytes`` (the rest was dropped).
    """

    status: str
    output: str
    error: str
    seconds: float
    truncated: bool = False


#: hints appended to a signal's name in a tool run's error
_SIGNAL_HINTS = {
    "SIGXCPU": "its CPU-time limit of {cpu_s} s",
    "SIGKILL": "its CPU-time limit of {cpu_s} s, or out of memory",
    "SIGXFSZ": "its file-size limit",
}


def run_code(
    code: str,
    limits: Limits = Limits(),
    scratch_root: str | None = None,
    max_output_bytes: int = 4096,
) -> CodeResult:
    """Run ``code`` as a script (``__main__``) in a sandbox of the same isolation and limits
    as :func:`run_tests` (``limits``; ``output_bytes`` is replaced by ``max_output_bytes``),
    capturing its stdout and stderr (the first ``max_output_bytes`` bytes). The tool
    pipeline's stage (:mod:`.pipelines`).

    Returns:
        :class:`CodeResult`; never raises for anything the code does.
    """
    t0 = time.perf_counter()
    cap = max(1, int(max_output_bytes))
    run_limits = replace(limits, output_bytes=max(cap, _MIN_LIMITS["output_bytes"]))
    spec = {"mode": "tool", "code": code, "tests": [], "output_bytes": cap}
    out, err, rc, timed_out = _launch(spec, run_limits, scratch_root)
    dt = time.perf_counter() - t0
    limit = f"its {limits.wall_s:g} s wall-clock limit"
    if timed_out:
        return CodeResult("timeout", "", f"timeout: stopped at {limit}", dt)
    try:
        rep = json.loads(out)["tool"]
        data = base64.b64decode(rep["out"])
        report = base64.b64decode(rep["report"])
    except (ValueError, KeyError, TypeError):
        tail = err.decode(errors="replace")[-200:]
        return CodeResult("crashed", "", f"sandbox failed: harness exit {rc}: {tail}", dt)
    truncated = rep["total"] > len(data)
    # a cut may split a character: the incomplete tail is dropped, not replaced
    output = codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=not truncated)
    if rep["timeout"]:
        return CodeResult("timeout", output, f"timeout: stopped at {limit}", dt, truncated)
    if rep["quota"]:
        return CodeResult("killed", output, "killed: over its scratch quota", dt, truncated)
    if rep["signal"]:
        hint = _SIGNAL_HINTS.get(rep["signal"], "").format(cpu_s=limits.cpu_s)
        what = f"killed by {rep['signal']}" + (f" ({hint})" if hint else "")
        return CodeResult("killed", output, what, dt, truncated)
    if rep["status"] in (97, 98) and not report:
        return CodeResult("crashed", output, "sandbox set-up failed", dt, truncated)
    try:
        error = str(json.loads(report).get("e") or "") if report else ""
    except (ValueError, AttributeError):
        error = "the code's report is unreadable (it wrote to the sandbox's report pipe)"
    if not error and rep["status"] not in (0, None):
        error = f"exited with status {rep['status']}"
    return CodeResult("error" if error else "ok", output, error, dt, truncated)


def _exchange(cmd: list[str], cwd: str, data: bytes, wait_s: float, limits: Limits):
    """Start ``cmd``, feed it ``data``, read its stdout (capped at ``output_bytes`` plus the
    report's envelope) and stderr (16 KiB); whatever is over a cap is read and discarded.
    Kills it (and so its namespace) after ``wait_s``. Returns (out, err, returncode,
    timed_out)."""
    # the report is base64 (4/3) of at most output_bytes, plus ~150 bytes per test
    out_cap = limits.output_bytes * 2 + 64 * 2**10 + 200 * data.count(b'"check"')
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
    )
    deadline = time.monotonic() + wait_s
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    caps = {proc.stdout: out_cap, proc.stderr: _STDERR_CAP}
    sel = selectors.DefaultSelector()
    os.set_blocking(proc.stdin.fileno(), False)
    sel.register(proc.stdin, selectors.EVENT_WRITE)
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    view, timed_out = memoryview(data), False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        view = view[os.write(f.fileno(), view[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # it exited early: its report says why
                        view = view[:0]
                    if not view:
                        sel.unregister(f)
                        f.close()
                    continue
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    sel.unregister(f)
                    continue
                room = caps[f] - len(bufs[f])
                if room > 0:
                    bufs[f] += chunk[:room]
        if not timed_out:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        if proc.poll() is None:
            proc.kill()  # unshare: --kill-child takes the harness, and its namespace with it
            proc.wait()
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), proc.returncode, timed_out


def _python() -> tuple[str, str]:
    """The interpreter for the harness and its prefix (what the sandbox's root file system
    must show): this one, unless it sits where a sandbox uid cannot read (e.g. under /root:
    the test children import modules as that uid); then the system ``python3``."""
    exe = os.path.realpath(sys.executable)
    if os.geteuid() != 0 or _world_readable(sys.base_prefix):
        return exe, os.path.realpath(sys.base_prefix)
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand) and _world_readable(os.path.dirname(os.path.realpath(cand))):
            return os.path.realpath(cand), "/usr"
    return exe, os.path.realpath(sys.base_prefix)


def _world_readable(path: str) -> bool:
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & 0o005:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent
