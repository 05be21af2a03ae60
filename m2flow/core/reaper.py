"""End process trees with the process that started them, even when that one is SIGKILLed.

``atexit`` and signal handlers cover a normal exit, an error, SIGINT and SIGTERM; nothing runs
in a process killed with SIGKILL (the OOM killer's signal, ``kill -9``). A :class:`Reaper` is
a small watchdog process that holds the read end of a pipe from its owner. The owner writes
the PIDs to watch; when the pipe reaches end-of-file without an ``exit`` line (the owner is
gone, however it died), the watchdog kills every watched tree and exits.

Used by :class:`~m2flow.core.spot.LocalSpotCluster`, whose ``ray start`` nodes run in sessions of
their own and outlive a killed driver otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process descending from it (read from ``/proc``): Ray's
    workers leave the node's process group, so a group kill would miss them."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Reaper:
    """The owner's side: start the watchdog, tell it which trees to end with this process.

    A watchdog that is itself gone (killed by hand) is not an error for the owner: it loses
    only this protection, never the run.
    """

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "m2flow.core.reaper"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            text=True, start_new_session=True,  # a terminal's Ctrl-C must not end it first
        )  # fmt: skip

    def watch(self, pid: int) -> None:
        """Kill the tree of ``pid`` if this process dies before :meth:`forget` or :meth:`close`."""
        self._send(f"+{pid}")

    def remove(self, path: str) -> None:
        """Remove ``path`` (a link or file; a directory with what it holds) if this process
        dies before :meth:`close`: scratch that would otherwise outlive it."""
        self._send(f"r{path}")

    def forget(self, pid: int) -> None:
        """Stop watching ``pid`` (its owner ended it: its number may be reused)."""
        self._send(f"-{pid}")

    def close(self, timeout: float = 10.0) -> None:
        """End the watchdog without killing anything (again is a no-op)."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._send("exit")
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the watchdog is gone, or closed
            pass


def main() -> None:
    """The watchdog: read ``+PID`` / ``-PID`` / ``rPATH`` / ``exit`` lines until end-of-file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watched: set[int] = set()
    paths: list[str] = []
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line == "exit":
            return
        if line[:1] in "+-" and line[1:].isdigit():
            (watched.add if line[0] == "+" else watched.discard)(int(line[1:]))
        elif line[:1] == "r" and len(line) > 1:
            paths.append(line[1:])
    for pid in watched:  # end-of-file without "exit": the owner died
        kill_tree(pid)
    for path in paths:  # after the processes that write there
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
