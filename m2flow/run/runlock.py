"""One run per run directory: ``<run_dir>/.lock``, held for the run's life.

Two runs on one ``trainer.run_dir`` would interleave their metrics and race for the same
checkpoint names. :func:`hold_run_dir` takes an exclusive ``fcntl.flock`` on
``<run_dir>/.lock`` and records the holder's PID and command in it; a second run is refused at
once with :class:`RunDirBusy` naming that PID. The kernel releases a ``flock`` when its holder's
last descriptor closes, so a run killed with ``kill -9`` leaves no stale lock. The lock file
itself stays (removing it would let a third run lock a new file while a second holds the old
one); it is emptied on release.

The descriptor is close-on-exec and closed in forked children (``os.register_at_fork``), so
only the run's own process holds the lock: the Ray processes it starts do not. The lock is
re-entrant within one process (the planner's profiling runs and the run itself nest).
Advisory, like every ``flock``: it orders m2flow runs, not other programs. On a filesystem
without ``flock`` (some network or FUSE mounts) the run goes on with a warning, unlocked.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..core.config import ConfigError

LOCK_FILE = ".lock"

_held: dict[Path, list[int]] = {}  # run dir (resolved) -> [descriptor, depth]
_mutex = threading.Lock()


class RunDirBusy(ConfigError):
    """Another live run holds the run directory (one line naming its PID)."""


def _close_in_child() -> None:
    for fd, _ in _held.values():
        try:
            os.close(fd)  # the parent's descriptor keeps the lock
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _busy(run_dir: Path, fd: int, key: str) -> RunDirBusy:
    """The refusal, naming the holder recorded in the lock file (read through ``fd``)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        who = f"PID {int(info['pid'])}: {str(info.get('command', ''))[:200]}"
    except (OSError, ValueError, KeyError, TypeError):
        who = "its PID not yet recorded"  # it took the lock a moment ago
    return RunDirBusy(
        f"{key}={run_dir} is in use by another run ({who}): wait for it to end, or set {key} "
        "to another directory"
    )


def check_free(run_dir: str | Path, key: str = "trainer.run_dir") -> None:
    """Raise :class:`RunDirBusy` if another process holds ``run_dir``'s lock (this process's
    own hold, and a directory or lock file that does not exist yet, pass). Takes nothing.

    Raises:
        RunDirBusy: the run directory is in use (the message names the holder's PID).
    """
    lock = Path(run_dir) / LOCK_FILE
    if not lock.is_file():
        return
    with _mutex:
        if Path(run_dir).resolve() in _held:
            return
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(Path(run_dir), fd, key) from None
    except OSError:
        pass  # a filesystem without flock: hold_run_dir says so
    finally:
        os.close(fd)  # releases the probe's shared lock, if taken


@contextmanager
def hold_run_dir(run_dir: str | Path, key: str = "trainer.run_dir") -> Iterator[Path]:
    """Hold ``run_dir``'s lock (the directory is created) for the ``with`` block.

    Yields:
        the lock file's path.

    Raises:
        RunDirBusy: another process holds it (names the holder's PID); nothing is taken.
    """
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory.resolve()
    with _mutex:
        if path in _held:
            _held[path][1] += 1
        else:
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                err = _busy(directory, fd, key)
                os.close(fd)
                raise err from None
            except OSError as e:  # a filesystem without flock (some network/FUSE mounts)
                warnings.warn(
                    f"{key}={run_dir}: cannot lock it ({e.strerror}); another run on the same "
                    "directory would not be refused",
                    stacklevel=3,
                )
            record = {"pid": os.getpid(), "command": " ".join(_command())}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            _held[path] = [fd, 1]
    try:
        yield path / LOCK_FILE
    finally:
        with _mutex:
            entry = _held[path]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[path]
                os.ftruncate(entry[0], 0)  # no stale holder for the next reader
                os.close(entry[0])  # releases the lock


def _command() -> list[str]:
    """This process's command line, the program by its name."""
    argv = list(sys.argv) or ["python"]
    return [Path(argv[0]).name, *argv[1:]]
