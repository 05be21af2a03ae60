"""The trusted harness inside a sandbox: one child per test, values back on a private pipe.

Started by :mod:`.sandbox` as ``python -I -S harness.py``: PID 1 of a fresh PID, mount and
network namespace and still root (or, without namespaces, a plain child of the worker). With
``confine`` it first moves into a root file system of its own (:func:`_confine`). It reads the
spec as JSON on stdin -- ``{"code", "tests": [[step, ...], ...], "limits", "uid",
"value_bytes", "output_bytes", "wall_s", "patch_socket", "confine", "scratch"}``, each step
``["exec", source]`` or ``["check", [expression, ...]]`` -- and, for each test, forks a child
that

1. points fds 0-2 at /dev/null, moves its value pipe to fd 3 and closes every other fd (so
   it cannot reach the harness's stdout, the verdict channel);
2. sets ``RLIMIT_CPU``/``AS``/``FSIZE``/``NOFILE``/``CORE`` and ``RLIMIT_NPROC = 0`` (no
   fork), then drops to ``uid`` (a uid of its own, so it can signal, ptrace or read nothing
   of any other sandbox or of this harness);
3. runs the program, then the test's steps: ``exec`` runs a statement, ``check`` evaluates
   the expressions of one ``assert`` and records their *values* as tagged JSON (never the
   verdict: the comparisons are made outside, by :mod:`.verdict`);
4. writes ``{"v": [...]}`` (or ``{"m": error}`` for a program that raises at top level, or
   ``{"e": error, "v": [...]}`` for a step that raises) to fd 3 and exits.

The harness reads at most ``value_bytes`` per test (and ``output_bytes`` per run) from the
pipe, waits for the child's exit (pidfd) until the run's wall-clock deadline, kills it then,
and writes one report to its stdout: ``{"tests": [{"out": base64, "status": int | None,
"signal": str | None, "timeout": bool, "overflow": bool, "quota": bool}, ...]}``. It never
interprets what a child wrote (nothing in the harness depends on it). The run's /scratch
quota (``scratch``: bytes, files) is a size-limited tmpfs with ``confine``; without, the
harness counts the scratch directory while a child runs and stops it past the quota
(``quota``). Stdlib only: it runs under the system python with ``-I -S``.

A tool run (``"mode": "tool"``, :func:`~.sandbox.run_code`) has no tests: one child, confined
and limited the same way, runs ``code`` as ``__main__`` with fds 1 and 2 on an output pipe
(the harness keeps its first ``output_bytes`` bytes and drops the rest), and writes ``{}`` or
``{"e": traceback}`` to fd 3; the report is ``{"tool": {"out": base64, "total": bytes
written, "report": base64, "status", "signal", "timeout", "quota"}}``. A tool's output is
the program's own word (no verdict hangs on it), so nothing of it is checked here.
"""

import base64
import json
import os
import resource
import select
import signal
import sys
import time


def _setlimit(res: int, value: int) -> None:
    """Set ``res`` to ``value`` (soft = hard), or to the current hard limit if that is lower;
    exits the child (status 97) if neither works, so no run goes unlimited."""
    try:
        resource.setrlimit(res, (value, value))
    except (ValueError, OSError):
        hard = resource.getrlimit(res)[1]
        low = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(res, (low, low))
        except (ValueError, OSError):
            os._exit(97)


def _fmt(e: BaseException) -> str:
    try:
        return (type(e).__name__ + ": " + str(e))[:300]
    except BaseException:
        return type(e).__name__


def _enc(v, depth=0):
    """Plain data as tagged JSON; subclasses of built-in types as their built-in value (so an
    overridden ``__eq__`` is lost); anything else as an opaque marker that equals nothing."""
    if depth > 64:
        raise ValueError("value nested too deep")
    t = type(v)
    if v is None or t is bool or t is str or t is float:
        return v
    if t is int:
        return v if -(2**63) <= v < 2**63 else {"i": hex(v)}
    d = depth + 1
    if t is list:
        return [_enc(x, d) for x in v]
    if t is tuple:
        return {"t": [_enc(x, d) for x in v]}
    if t is dict:
        return {"d": [[_enc(k, d), _enc(x, d)] for k, x in v.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "f": [_enc(x, d) for x in v]}
    if t is bytes:
        return {"b": v.hex()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    # subclasses: their built-in value, read through the base type's own slots
    if isinstance(v, bool):
        return bool(int.__index__(v))
    if isinstance(v, int):
        return _enc(int.__index__(v), depth)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, tuple):
        return {"t": [_enc(x, d) for x in tuple.__iter__(v)]}
    if isinstance(v, list):
        return [_enc(x, d) for x in list.__iter__(v)]
    if isinstance(v, dict):
        return {"d": [[_enc(k, d), _enc(x, d)] for k, x in dict.items(v)]}
    return {"o": t.__name__[:64]}


def _enter(spec: dict, wfd: int, ofd=None) -> None:
    """The child's confinement: fds 0-2 at /dev/null (1 and 2 at ``ofd`` when given: a tool
    run's output pipe), the value pipe at fd 3, every other fd closed, the limits, the uid."""
    pipe = os.dup(wfd)
    out = None if ofd is None else os.dup(ofd)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    for fd in (1, 2):
        os.dup2(null if out is None else out, fd)
    os.dup2(pipe, 3)
    os.closerange(4, 1 << 16)
    lim = spec["limits"]
    _setlimit(resource.RLIMIT_CPU, lim["cpu_s"])
    _setlimit(resource.RLIMIT_AS, lim["memory_bytes"])
    _setlimit(resource.RLIMIT_FSIZE, lim["file_bytes"])
    _setlimit(resource.RLIMIT_NOFILE, lim["open_files"])
    _setlimit(resource.RLIMIT_CORE, 0)
    _setlimit(resource.RLIMIT_NPROC, 0)
    if spec["uid"] is not None:  # the uid has no other process, so NPROC = 0 bites
        os.setgroups([])
        os.setgid(spec["uid"])
        os.setuid(spec["uid"])
    os.umask(0o077)
    if spec["patch_socket"]:
        import socket

        class _NoNet(socket.socket):
            def __init__(self, *a, **k):
                raise PermissionError("network access is disabled in the sandbox")

        socket.socket = _NoNet
        socket.create_connection = lambda *a, **k: _NoNet()


def _child(spec: dict, steps: list, wfd: int) -> None:
    """Runs in the forked child; never returns."""
    try:
        _enter(spec, wfd)
    except BaseException:
        os._exit(98)
    report = _run(spec["code"], steps)
    try:
        data = json.dumps(report).encode()
    except BaseException as e:
        data = json.dumps({"e": "value not serialisable: " + _fmt(e), "v": []}).encode()
    if len(data) > spec["value_bytes"]:
        data = json.dumps({"e": f"values over {spec['value_bytes']} bytes", "v": []}).encode()
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(3, view) :]
    except OSError:
        pass
    os._exit(0)


def _run(code: str, steps: list) -> dict:
    env = {"__name__": "__main__"}
    try:
        exec(compile(code, "<solution>", "exec"), env)
    except BaseException as e:
        return {"m": _fmt(e)}
    values = []
    for kind, body in steps:
        try:
            if kind == "exec":
                exec(compile(body, "<test>", "exec"), env)
                continue
            for expr in body:
                try:
                    values.append(_enc(eval(compile(expr, "<test>", "eval"), env)))
                except BaseException as e:
                    values.append({"x": _fmt(e)})
        except BaseException as e:
            return {"e": _fmt(e), "v": values}
    return {"v": values}


def _usage(path: str, stop_at: tuple[int, int]) -> tuple[int, int]:
    """(bytes, files and directories) under ``path``; stops counting past ``stop_at``."""
    size = files = 0
    stack = [path]
    while stack and size <= stop_at[0] and files <= stop_at[1]:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            files += 1
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    size += e.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
    return size, files


def _one(spec: dict, steps: list, deadline: float, cap: int) -> dict:
    """Run one test's child; its output (at most ``cap`` bytes), exit and timing."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(spec, steps, w)
    os.close(w)
    pidfd = os.pidfd_open(pid)
    buf, eof, exited, timeout, overflow = bytearray(), False, False, False, False
    # without namespaces no tmpfs bounds /scratch: count it every 50 ms (the child can write
    # at most ~50 ms of disk bandwidth past the quota before it is stopped)
    quota = None if spec.get("confine") else (spec["scratch"]["bytes"], spec["scratch"]["files"])
    over = False
    while not (eof and exited):
        left = deadline - time.monotonic()
        if left <= 0:
            timeout = True
            break
        if quota is not None:
            used = _usage(".", quota)
            if used[0] > quota[0] or used[1] > quota[1]:
                over = True
                break
        watch = ([] if eof else [r]) + ([] if exited else [pidfd])
        wait = left if quota is None else min(left, 0.01)
        ready, _, _ = select.select(watch, [], [], wait)
        if pidfd in ready:
            exited = True
        if r in ready:
            chunk = os.read(r, 65536)
            if not chunk:
                eof = True
            elif len(buf) + len(chunk) > cap:
                overflow = True  # a flood: stop it here, the test fails
                break
            else:
                buf += chunk
    if not exited:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    os.close(r)
    os.close(pidfd)
    sig = None
    if os.WIFSIGNALED(status) and not (timeout or overflow or over):
        sig = signal.Signals(os.WTERMSIG(status)).name
    return {
        "quota": over,
        "out": base64.b64encode(bytes(buf)).decode(),
        "module_error": buf.startswith(b'{"m"'),
        "status": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": sig,
        "timeout": timeout,
        "overflow": overflow,
        "bytes": len(buf),
    }


#: most bytes a tool run's report (its error text) may take on the value pipe
_TOOL_REPORT_BYTES = 16 * 2**10
#: most characters of a tool run's error text (the end of a traceback is kept)
_TOOL_ERROR_CHARS = 2000


def _tool_child(spec: dict, wfd: int, ofd: int) -> None:
    """A tool run's child (``mode: tool``): runs ``code`` as ``__main__`` with its stdout and
    stderr on the output pipe; writes ``{}`` or ``{"e": traceback}`` to fd 3. Never returns."""
    try:
        import io
        import linecache
        import traceback

        _enter(spec, wfd, ofd)
        stream = io.TextIOWrapper(
            io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
            write_through=True,
        )  # fmt: skip
        sys.stdout = sys.stderr = stream
    except BaseException:
        os._exit(98)
    code = spec["code"]
    report = {}
    try:
        linecache.cache["<tool>"] = (len(code), None, code.splitlines(True), "<tool>")
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        if e.code not in (None, 0):
            report = {"e": "SystemExit: " + str(e.code)[:200]}
    except BaseException as e:
        try:
            tb = e.__traceback__.tb_next if e.__traceback__ else None  # drop the harness frame
            text = "".join(traceback.format_exception(type(e), e, tb)).rstrip()
        except BaseException:
            text = _fmt(e)
        if len(text) > _TOOL_ERROR_CHARS:
            text = "..." + text[-_TOOL_ERROR_CHARS:]
        report = {"e": text}
    try:
        stream.flush()
    except BaseException:
        pass
    try:
        data = json.dumps(report).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(3, view) :]
    except BaseException:
        pass
    os._exit(0)


def _tool(spec: dict, deadline: float) -> dict:
    """One tool run: the child's output (the first ``output_bytes`` bytes kept, the rest read
    and dropped, ``total`` counts all), its report, exit and timing."""
    r, w = os.pipe()
    ro, wo = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(ro)
        _tool_child(spec, w, wo)
    os.close(w)
    os.close(wo)
    pidfd = os.pidfd_open(pid)
    cap = spec["output_bytes"]
    out, report, total = bytearray(), bytearray(), 0
    quota = None if spec.get("confine") else (spec["scratch"]["bytes"], spec["scratch"]["files"])
    open_fds, exited, timeout, over = {r, ro}, False, False, False
    while open_fds or not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            timeout = True
            break
        if quota is not None:
            used = _usage(".", quota)
            if used[0] > quota[0] or used[1] > quota[1]:
                over = True
                break
        watch = list(open_fds) + ([] if exited else [pidfd])
        ready, _, _ = select.select(watch, [], [], left if quota is None else min(left, 0.01))
        if pidfd in ready:
            exited = True
        for fd in (r, ro):
            if fd not in ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
            elif fd == ro:
                total += len(chunk)
                out += chunk[: max(0, cap - len(out))]
            elif len(report) + len(chunk) <= _TOOL_REPORT_BYTES:
                report += chunk
    if not exited:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    for fd in (r, ro, pidfd):
        os.close(fd)
    sig = None
    if os.WIFSIGNALED(status) and not (timeout or over):
        sig = signal.Signals(os.WTERMSIG(status)).name
    return {
        "out": base64.b64encode(bytes(out)).decode(),
        "total": total,
        "report": base64.b64encode(bytes(report)).decode(),
        "status": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": sig,
        "timeout": timeout,
        "quota": over,
    }


_MS = {"RDONLY": 1, "NOSUID": 2, "NODEV": 4, "NOEXEC": 8, "REMOUNT": 32, "BIND": 4096, "REC": 16384}


def _confine(mnt: str, prefix: str, uid, scratch: dict) -> None:
    """Build the run's own root file system on a tmpfs at ``mnt`` and chroot into it (as
    root, in the run's fresh mount namespace): read-only binds of /usr, /bin, /lib... and of
    the interpreter's ``prefix``; /dev/{null,zero,urandom}; a /proc of this PID namespace; an
    empty read-only /tmp; /scratch, the only writable place: a tmpfs of ``scratch["bytes"]``
    bytes and ``scratch["files"]`` inodes, mode 0700, owned by ``uid`` (the run's quota: a
    write past it fails with ENOSPC; it lives in memory and goes with the namespace). Nothing
    else of the host (configs, repositories, home directories, other sandboxes) exists in
    it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(src, dst: str, fstype, flags: int, data=None) -> None:
        args = [x.encode() if isinstance(x, str) else x for x in (src, dst, fstype)]
        if libc.mount(*args, flags, data.encode() if data else None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), dst)

    bind, ro = _MS["BIND"], _MS["RDONLY"] | _MS["NOSUID"] | _MS["NODEV"]
    mount("m2flow-sandbox", mnt, "tmpfs", _MS["NOSUID"] | _MS["NODEV"], "size=1m,mode=755")
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", prefix):
        target = mnt + d
        if os.path.lexists(target) or not os.path.lexists(d):
            continue
        if os.path.islink(d):
            os.symlink(os.readlink(d), target)
        elif os.path.isdir(d):
            os.makedirs(target)
            mount(d, target, None, bind | _MS["REC"])
            mount(None, target, None, _MS["REMOUNT"] | bind | ro)
    for d in ("dev", "proc", "tmp", "scratch"):
        os.makedirs(os.path.join(mnt, d), exist_ok=True)
    for n in ("null", "zero", "urandom"):
        open(os.path.join(mnt, "dev", n), "w").close()
        mount("/dev/" + n, os.path.join(mnt, "dev", n), None, bind)
    mount("proc", mnt + "/proc", "proc", _MS["NOSUID"] | _MS["NODEV"] | _MS["NOEXEC"])
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    quota = f"size={scratch['bytes']},nr_inodes={scratch['files']},mode=700{owner}"
    mount("m2flow-scratch", mnt + "/scratch", "tmpfs", _MS["NOSUID"] | _MS["NODEV"], quota)
    mount(None, mnt, None, _MS["REMOUNT"] | ro)
    os.chroot(mnt)
    os.chdir("/scratch")


def main() -> None:
    spec = json.loads(sys.stdin.buffer.read())
    if spec.get("confine"):
        _confine(**spec["confine"], scratch=spec["scratch"])
    deadline = time.monotonic() + spec["wall_s"]
    if spec.get("mode") == "tool":
        sys.stdout.write(json.dumps({"tool": _tool(spec, deadline)}))
        sys.stdout.flush()
        return
    budget = spec["output_bytes"]
    results = []
    for steps in spec["tests"]:
        res = _one(spec, steps, deadline, max(0, min(spec["value_bytes"], budget)))
        budget -= res.pop("bytes")
        results.append(res)
        # later tests cannot change the outcome of a run that timed out, was killed by a
        # limit, or whose program raised at top level (the same program runs every time)
        if res.pop("module_error") or res["timeout"] or res["signal"] or res["quota"]:
            break
    sys.stdout.write(json.dumps({"tests": results}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
