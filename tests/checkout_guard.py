"""Tests never read or write the checkout's ``runs/`` and never write into the checkout.

README's first command (``m2flow run workflows/grpo.py``) writes checkpoints to ``runs/grpo``
under the cwd: every workflow's ``trainer.run_dir`` default is relative (``runs/grpo``,
``runs/ppo``, ``runs/embodied``). Tests that validated a config with that default from the
checkout met the user's checkpoints (``runs/grpo already holds checkpoints``) instead of the
error they tested. Two layers keep the whole class out (wired in ``conftest.py``):

- the test session runs with its cwd in a temporary directory, so every relative default
  resolves there: in this process, in subprocesses (the ``m2flow`` CLI tests), in Ray processes;
- :class:`CheckoutGuard`, a ``sys.addaudithook`` hook of the test process, records each file
  event (open, scandir/listdir, mkdir, rename, remove, ...) on a path under ``<checkout>/runs``
  and each write elsewhere in the checkout (caches excepted); the test that made one fails.
  Subprocesses and Ray workers are not audited: they get the temporary cwd, and paths the test
  process gives them (which it made, and so was audited for).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent
CHECKOUT_RUNS = CHECKOUT / "runs"

#: audit event -> positions of its path arguments that it reads / writes (Python 3.11 events:
#: https://docs.python.org/3/library/audit_events.html); "open" writes when its flags say so.
_READS = {
    "open": (0,),
    "os.listdir": (0,),
    "os.scandir": (0,),
    "glob.glob": (0,),
    "os.chdir": (0,),
    "shutil.copyfile": (0,),
    "shutil.copytree": (0,),
    "shutil.copymode": (0,),
    "shutil.copystat": (0,),
}
_WRITES = {
    "os.mkdir": (0,),
    "os.rename": (0, 1),  # also os.replace
    "os.remove": (0,),  # also os.unlink
    "os.rmdir": (0,),
    "os.truncate": (0,),
    "os.symlink": (1,),
    "os.link": (1,),
    "os.chmod": (0,),
    "os.utime": (0,),
    "shutil.rmtree": (0,),
    "shutil.move": (0, 1),
    "shutil.copyfile": (1,),
    "shutil.copytree": (1,),
    "shutil.copymode": (1,),
    "shutil.copystat": (1,),
}
_WATCHED = frozenset(_READS) | frozenset(_WRITES)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: written by Python, pytest and ruff themselves (the checkout's ``.venv*`` are skipped too)
_CACHES = {"__pycache__", ".pytest_cache", ".ruff_cache"}


class CheckoutGuard:
    """Records this process's file events that touch ``<checkout>/runs`` (any) or write into
    the checkout (outside ``__pycache__``, ``.pytest_cache``, ``.venv*`` and ``allowed``
    directories), while :attr:`active`.

    Args:
        checkout: the checkout's root (absolute, resolved).
        allowed: directories tests may write to (the ``--basetemp``, the ``TMPDIR``); only
            those inside the checkout count: one that holds the checkout (a clone under
            ``/tmp``) exempts nothing, or every write into that checkout would pass.
    """

    def __init__(self, checkout: Path = CHECKOUT, allowed: tuple[Path, ...] = ()) -> None:
        self.checkout = str(checkout)
        self.runs = str(checkout / "runs")
        self.allowed = tuple(
            str(a) for a in allowed if _under(str(a), self.checkout) and str(a) != self.checkout
        )
        self.active = False
        self.events: list[tuple[str, str]] = []  # (audit event, absolute path)

    def install(self) -> CheckoutGuard:
        """Add the audit hook (once per process: hooks cannot be removed)."""
        sys.addaudithook(self._hook)
        return self

    def take(self) -> list[tuple[str, str]]:
        """The recorded events since the last call, cleared."""
        events, self.events = self.events, []
        return events

    def _hook(self, event: str, args: tuple) -> None:
        # Runs on every audit event of the process (builtins.id, imports, ...): the event
        # check first, no audited call inside, and never an exception (it would surface in
        # the audited operation).
        if event not in _WATCHED or not self.active:
            return
        try:
            writes = _WRITES.get(event, ())
            if event == "open" and len(args) > 2 and isinstance(args[2], int):
                writes = (0,) if args[2] & _WRITE_FLAGS else ()
            for i in set(_READS.get(event, ())) | set(writes):
                path = self._absolute(args[i]) if i < len(args) else None
                if path is not None and self._violates(path, i in writes):
                    self.events.append((event, path))
        except Exception:  # noqa: BLE001 (a hook that raises breaks the audited call)
            pass

    @staticmethod
    def _absolute(arg) -> str | None:
        if arg is None or isinstance(arg, int):  # a file descriptor, or no path
            return None
        try:
            path = os.fsdecode(arg)
        except TypeError:
            return None
        return os.path.normpath(os.path.join(os.getcwd(), path))

    def _violates(self, path: str, write: bool) -> bool:
        if _under(path, self.runs):
            return True
        if not write or not _under(path, self.checkout):
            return False
        parts = Path(os.path.relpath(path, self.checkout)).parts
        if _CACHES.intersection(parts) or parts[0].startswith(".venv"):
            return False
        return not any(_under(path, a) for a in self.allowed)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)
