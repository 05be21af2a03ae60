"""A user's reward function (``reward.function=path.py:fn``) run where it can be abandoned: one
long-lived child process per :class:`IsolatedFunction` (:mod:`.child`; the file is imported
once in it), samples sent to it, one result back per sample.

- A call that takes longer than ``timeout_s`` gets the child killed (its whole process group,
  so what the function started goes too); the sample is an error ("timed out after N s") and
  the next sample starts a new child. A child that dies (``os._exit``, a segfault, the OOM
  killer) is the same kind of error ("exited with code N"): never a hang, never a silent 0.
- What the function prints (stdout and stderr, Python's or a C library's: the child's file
  descriptors 1 and 2 are a pipe) is read here and forwarded to this process's stderr (a Ray
  worker's goes to the driver's console and the run's logs), capped: the first
  :data:`CALL_OUTPUT_BYTES` of each call and :data:`PROCESS_OUTPUT_BYTES` in all per process;
  the cut is said once.
- Every ``note_every_s`` spent scoring (counted across calls, so that many short chunks count
  too), a note says which function, how many samples of the current chunk are done and how
  long it has taken (a warning on this process's log: a Ray worker's reaches the console).

The child is a plain ``python -m`` subprocess, not a ``multiprocessing`` spawn or forkserver
child: those re-run the parent's ``__main__`` in the child, in a Ray worker Ray's
``default_worker.py`` (Ray imported again per child) and in the driver the CLI.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

log = logging.getLogger(__name__)

#: bytes of one call's output forwarded (the rest is dropped, and the cut said once)
CALL_OUTPUT_BYTES = 4096
#: bytes of reward-function output one process forwards in all
PROCESS_OUTPUT_BYTES = 64 * 1024

#: ``("ok", score, {metric: value})`` or ``("error", what)``: one sample's outcome
Outcome = tuple


class LoadError(RuntimeError):
    """The reward file could not be imported in its process.

    Attributes:
        kind: ``"missing"`` (no file, or no callable of that name), ``"raised"`` (the import
            raised; ``detail`` is ``"Type: message"``), ``"exited"`` (the process ended while
            importing; ``detail``: how) or ``"timeout"`` (still importing after
            ``import_timeout_s``; ``detail``: the seconds).
        detail: see ``kind``.
    """

    def __init__(self, kind: str, detail: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.detail = kind, detail


class _Budget:
    """This process's allowance of forwarded reward-function output."""

    def __init__(self, total: int) -> None:
        self.left, self.said, self.lock = total, False, threading.Lock()

    def take(self, n: int) -> int:
        with self.lock:
            n = min(n, self.left)
            self.left -= n
            return n

    def first_cut(self) -> bool:
        """True once: the first time output is dropped."""
        with self.lock:
            said, self.said = self.said, True
            return not said


_BUDGET = _Budget(PROCESS_OUTPUT_BYTES)


class _OutputPump(threading.Thread):
    """Reads the child's output pipe to its end; forwards the head of each call's output (the
    parts between markers) to this process's stderr within the caps, and drops the rest
    (still reading it, so the child never blocks on a full pipe)."""

    def __init__(self, fd: int, marker: bytes, forward: bool, name: str) -> None:
        super().__init__(name="m2flow-reward-output", daemon=True)
        self.fd, self.marker, self.forward, self.function = fd, marker, forward, name
        self.kept, self.dropped = bytearray(), 0

    def _take(self, data: bytes) -> None:
        if not data:
            return
        room = max(0, CALL_OUTPUT_BYTES - len(self.kept))
        n = _BUDGET.take(min(room, len(data))) if self.forward else 0
        self.kept += data[:n]
        self.dropped += len(data) - n

    def _end_call(self) -> None:
        kept, dropped = bytes(self.kept), self.dropped
        self.kept, self.dropped = bytearray(), 0
        if not self.forward or not (kept or dropped):
            return
        text = kept.decode("utf-8", errors="replace")
        if text and not text.endswith("\n"):
            text += "\n"
        if dropped and _BUDGET.first_cut():
            text += (
                f"[m2flow] reward function {self.function!r}: output truncated (the first "
                f"{CALL_OUTPUT_BYTES} bytes of each call's output are shown, "
                f"{PROCESS_OUTPUT_BYTES} bytes in all per process; said once)\n"
            )
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except Exception:  # a closed sink: nothing more to show
            pass

    def run(self) -> None:
        keep = len(self.marker) - 1  # a marker may straddle two reads
        buf = b""
        try:
            while chunk := os.read(self.fd, 1 << 16):
                buf += chunk
                while (i := buf.find(self.marker)) >= 0:
                    self._take(buf[:i])
                    self._end_call()
                    buf = buf[i + len(self.marker) :]
                if len(buf) > keep:
                    self._take(buf[:-keep])
                    buf = buf[-keep:]
        except OSError:
            pass
        finally:
            self._take(buf)
            self._end_call()
            os.close(self.fd)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            return f"exited with code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (what the function started goes too) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it to the OS
        pass


class IsolatedFunction:
    """A reward file's function in a child process of this one (module docstring).

    Args:
        function: ``/abs/path/file.py:fn``.
        timeout_s: the longest one sample's call may take, in seconds.
        import_timeout_s: the longest the file's import may take, in seconds.
        note_every_s: seconds spent scoring (across calls) between notes.
        forward_output: forward the function's output (capped) to this process's stderr;
            False: drop it.

    Not thread-safe: one :meth:`map` at a time.
    """

    def __init__(
        self,
        function: str,
        timeout_s: float = 60.0,
        import_timeout_s: float = 60.0,
        note_every_s: float = 30.0,
        forward_output: bool = True,
    ) -> None:
        self.function, self.timeout_s = function, float(timeout_s)
        self.import_timeout_s, self.note_every_s = float(import_timeout_s), float(note_every_s)
        self.forward_output = forward_output
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._pump: _OutputPump | None = None
        self._finalizer = None
        self._unnoted = 0.0  # seconds spent in map() since the last note
        self._noted = False

    @property
    def pid(self) -> int | None:
        """The child's process id, or ``None`` while none runs."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Start the child and import the file in it (a no-op while one runs).

        Raises:
            LoadError: the file is missing or lacks the function, its import raised (any
                ``BaseException``: ``sys.exit`` too), ended the process, or took longer than
                ``import_timeout_s``.
        """
        if self._proc is not None:
            return
        path, _, name = self.function.rpartition(":")
        if not Path(path).is_file():
            raise LoadError("missing", "", f"{path} does not exist")
        ours, theirs = socket.socketpair()
        read_fd, write_fd = os.pipe()
        marker = b"\x00m2flow-end-of-call-" + secrets.token_hex(8).encode() + b"\x00"
        try:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "m2flow.workers.scoring.child",
                 str(theirs.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=write_fd, stderr=subprocess.STDOUT,
                pass_fds=[theirs.fileno()], start_new_session=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )  # fmt: skip
        except BaseException:
            ours.close()
            os.close(read_fd)
            raise
        finally:
            theirs.close()
            os.close(write_fd)
        self._proc, self._conn = proc, Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _kill, proc)
        self._pump = _OutputPump(read_fd, marker, self.forward_output, self.function)
        self._pump.start()
        try:
            self._conn.send({"function": self.function, "marker": marker, "sys_path": sys.path})
        except OSError:  # a child dead at start: its exit shows in the wait below
            pass
        reply = self._wait(self.import_timeout_s)
        if reply is None or reply[0] != "ready":
            self.close()
            if reply is None:
                raise LoadError(
                    "timeout", f"{self.import_timeout_s:g}",
                    f"importing {path} did not finish within {self.import_timeout_s:g} s",
                )  # fmt: skip
            if reply[0] == "missing":
                raise LoadError("missing", name, f"{path} defines no function {name!r}")
            if reply[0] == "raised":
                raise LoadError("raised", reply[1], f"importing {path} raised {reply[1]}")
            raise LoadError("exited", reply[1], f"importing {path}: its process {reply[1]}")

    def _wait(self, timeout_s: float) -> tuple | None:
        """The child's next message; ``("exited", how)`` if it died; ``None`` on timeout."""
        assert self._conn is not None and self._proc is not None
        if not self._conn.poll(timeout_s):
            return None
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            try:
                code = self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                code = None
            return ("exited", _exit_text(code))

    def close(self) -> None:
        """Stop the child (killed: it may hang) and wait for its output to be forwarded."""
        proc, pump, conn = self._proc, self._pump, self._conn
        self._proc = self._pump = self._conn = None
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps
            self._finalizer = None
        if conn is not None:
            conn.close()
        if pump is not None:
            pump.join(timeout=30)
        del proc

    def map(self, samples: Sequence[tuple]) -> Iterator[Outcome]:
        """Score ``samples`` (each ``(data_source, solution_str, ground_truth, extra_info)``);
        yields one outcome per sample, in order: ``("ok", score, metrics)`` or ``("error",
        what)`` (the function raised or returned no finite number, timed out, or its process
        died; after the last two a new process scores the rest). Stopping early (closing the
        iterator) kills the child, whose work on the rest is then of no use.

        Raises:
            LoadError: a (new) child could not import the file.
        """
        i, done = 0, False
        t0 = time.monotonic()
        mark = t0 - self._unnoted  # busy time counts across calls until a note says it
        try:
            while i < len(samples):
                self.start()
                assert self._conn is not None
                try:
                    self._conn.send(("score", list(samples[i:])))
                except OSError:  # a dead child: its exit shows at the next receive
                    pass
                while i < len(samples):
                    deadline = time.monotonic() + self.timeout_s
                    reply = None
                    while reply is None:
                        now = time.monotonic()
                        if now >= deadline:
                            break
                        reply = self._wait(min(deadline, mark + self.note_every_s) - now)
                        now = time.monotonic()
                        if reply is None and now >= mark + self.note_every_s:
                            self._note(now - mark, i, len(samples), now - t0)
                            mark = now
                    if reply is None:
                        self.close()
                        reply = ("error", f"timed out after {self.timeout_s:g} s "
                                 "(reward.timeout_s; its process was killed)")  # fmt: skip
                    elif reply[0] == "exited":
                        self.close()
                        reply = ("error", f"its process {reply[1]}")
                    i += 1
                    yield reply
                    if self._proc is None:
                        break  # a new child takes the rest
            done = True
        finally:
            self._unnoted = time.monotonic() - mark
            if not done:
                self.close()

    def _note(self, busy: float, done: int, total: int, seconds: float) -> None:
        log.warning(
            "reward function %r is slow: %.0f s spent scoring since %s; this chunk: %d of %d "
            "samples scored in %.0f s (reward.timeout_s=%g per sample)", self.function, busy,
            "the last such note" if self._noted else "its start", done, total, seconds,
            self.timeout_s,
        )  # fmt: skip
        self._noted = True
