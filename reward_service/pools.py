"""Worker processes, the elastic pool of one pipeline stage, and the scratch space they use.

Each worker (:mod:`.worker`) is its own process group: killing the group takes the worker and
any sandbox it is running (a sandbox is in its worker's group, and its PID namespace dies
with its init). Each worker gets a scratch directory of its own under the service's
:class:`ScratchRoot`; :meth:`Proc.stop` kills the group, waits for the worker and removes that
directory, so a worker killed mid-run (stage timeout, scale-down, shutdown) leaves nothing.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid

_ROOT_NAME = re.compile(r"^m2flow-reward-(\d+)-[0-9a-f]{8}$")


def remove_tree(path: str, tries: int = 10) -> bool:
    """Remove ``path``; retries while processes being killed may still create files there.
    Returns whether it is gone."""
    for i in range(tries):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return True
        time.sleep(0.05 * (i + 1))
    return not os.path.exists(path)


class ScratchRoot:
    """``<parent>/m2flow-reward-<service pid>-<random>``: the scratch space of one service.

    On creation it also removes the roots of services that died without cleaning up (their
    pid no longer exists). Directories are ``0711``: each sandbox's own is ``0700`` under
    its uid, so sandboxes cannot list or read each other's.
    """

    def __init__(self, parent: str | None = None) -> None:
        parent = parent or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self.swept = self._sweep(parent)
        self.path = os.path.join(parent, f"m2flow-reward-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.path, mode=0o711)
        os.chmod(self.path, 0o711)

    @staticmethod
    def _sweep(parent: str) -> int:
        n = 0
        for name in os.listdir(parent):
            m = _ROOT_NAME.match(name)
            if m and int(m.group(1)) != os.getpid() and not os.path.exists(f"/proc/{m.group(1)}"):
                n += remove_tree(os.path.join(parent, name), tries=2)
        return n

    def worker_dir(self) -> str:
        d = tempfile.mkdtemp(prefix="w-", dir=self.path)
        os.chmod(d, 0o711)
        return d

    def close(self) -> bool:
        """Remove the whole root (after every worker is stopped)."""
        return remove_tree(self.path)


class Proc:
    """One worker process (its own process group, so a kill takes its sandbox children)."""

    def __init__(self, proc: asyncio.subprocess.Process, scratch: str) -> None:
        self.proc = proc
        self.scratch = scratch
        self.retire = False

    @classmethod
    async def start(
        cls, kind: str, stage: str, options: dict, scratch: str, memory_bytes: int | None
    ) -> Proc:
        """Start a worker and wait for its ``ready`` line.

        Raises:
            RuntimeError: it exited or answered something else.
        """
        opts = {
            **options,
            "parent_pid": os.getpid(),
            "scratch_dir": scratch,
            "memory_bytes": memory_bytes,
        }
        try:
            p = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "m2flow.reward_service.worker",
                kind,
                stage,
                json.dumps(opts),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except BaseException:
            await asyncio.to_thread(remove_tree, scratch)
            raise
        self = cls(p, scratch)
        try:
            line = await p.stdout.readline()
            ready = json.loads(line).get("ready") if line else False
        except BaseException:  # garbage, or cancelled (shutdown): no half-started worker
            self.kill()
            raise
        if not ready:
            await self.stop()
            raise RuntimeError(f"worker for {kind}.{stage} failed to start")
        return self

    async def call(self, payload: dict, carry: dict) -> dict:
        self.proc.stdin.write((json.dumps({"payload": payload, "carry": carry}) + "\n").encode())
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited (code {self.proc.returncode})")
        return json.loads(line)

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and its sandbox)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def stop(self, wait_s: float = 10.0) -> None:
        """Kill, wait for the worker to exit, remove its scratch directory. (Call
        :meth:`kill` first where the task might be cancelled before it runs.)"""
        self.kill()
        try:
            await asyncio.wait_for(self.proc.wait(), wait_s)
        except TimeoutError:
            pass
        await asyncio.to_thread(remove_tree, self.scratch)


class Pool:
    """The elastic worker pool and EBF queue of one pipeline stage."""

    def __init__(
        self,
        kind: str,
        stage: str,
        index: int,
        timeout_s: float,
        options: dict,
        memory_bytes: int | None = None,
    ) -> None:
        self.kind, self.stage, self.index = kind, stage, index
        self.timeout_s, self.options = timeout_s, options
        self.memory_bytes = memory_bytes
        self.idle: list[Proc] = []
        self.busy: set[Proc] = set()
        self.starting = 0
        self.target = 0
        self.queue: list = []
        self.seq = itertools.count()
        self.worker_s = 0.0
        self.busy_s = 0.0
        self._t = time.monotonic()
        self.timeline: collections.deque = collections.deque(maxlen=10000)  # (t_s, target)

    @property
    def alive(self) -> int:
        return len(self.idle) + len([p for p in self.busy if not p.retire]) + self.starting

    def account(self) -> None:
        now = time.monotonic()
        self.worker_s += (len(self.idle) + len(self.busy) + self.starting) * (now - self._t)
        self._t = now
