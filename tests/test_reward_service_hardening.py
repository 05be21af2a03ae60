"""The reward service under hostile tenants: forged rewards, cross-tenant kills,
limits loosened by a request, unbounded memory, orphaned sandboxes, stalled scaling, leaked
metrics. One live service for the module; ``mallory`` attacks, ``alice`` must not notice."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from m2flow.reward_service.app import BackgroundServer
from m2flow.reward_service.client import RewardClient, RewardServiceError
from m2flow.reward_service.sandbox import isolation
from m2flow.reward_service.schemas import ServiceConfig
from pydantic import ValidationError

TOKENS = {"alice": "alice-token-hard-1", "mallory": "mallory-token-hard-2"}
SANDBOX = {"wall_s": 4.0, "cpu_s": 2, "memory_bytes": 256 * 2**20}
LONG_SANDBOX = {"wall_s": 30.0, "cpu_s": 20, "memory_bytes": 256 * 2**20}
MAX_BODY = 1 * 2**20
MAX_SOURCE = 64 * 2**10
MAX_BATCH = 100_000
TESTS = ["assert f(2) == 4", "assert f(3) == 9"]
SQUARE = {"code": "def f(x):\n    return x * x\n", "tests": TESTS}
namespaces = pytest.mark.skipif(isolation() != "namespaces", reason="needs unshare as root")


def _config(scratch: str, **over) -> ServiceConfig:
    code = {
        "check": {"timeout_s": 10, "max_workers": 2, "options": {"max_source_bytes": MAX_SOURCE}},
        "execute": {"timeout_s": 8, "max_workers": 3, "options": {"sandbox": SANDBOX}},
    }
    short = {  # the stage timeout kills the worker while its sandbox still sleeps
        "check": {"timeout_s": 10, "max_workers": 1},
        "execute": {"timeout_s": 3.0, "max_workers": 1, "options": {"sandbox": {"wall_s": 20}}},
    }
    long = {  # the isolation test's attack runs until the test releases it (seconds)
        "check": {"timeout_s": 10, "max_workers": 1},
        "execute": {"timeout_s": 40, "max_workers": 1, "options": {"sandbox": LONG_SANDBOX}},
    }
    cfg = {
        "host": "127.0.0.1",
        "port": 0,
        "tenants": {n: {"token": t} for n, t in TOKENS.items()},
        "default_delay_bound_s": 1.0,
        "max_body_bytes": MAX_BODY,
        "max_batch_size": MAX_BATCH,
        "scratch_dir": scratch,
        "pipelines": {
            "code": {"kind": "code", "penalty": -1.0, "stages": code},
            "code_short": {"kind": "code", "penalty": -1.0, "stages": short},
            "code_long": {"kind": "code", "penalty": -1.0, "stages": long},
        },
    }
    return ServiceConfig.model_validate({**cfg, **over})


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return str(tmp_path_factory.mktemp("reward-scratch"))


@pytest.fixture(scope="module")
def server(scratch):
    srv = BackgroundServer(_config(scratch))
    with srv:
        yield srv


@pytest.fixture(scope="module")
def alice(server):
    with RewardClient(server.url, TOKENS["alice"], timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def mallory(server):
    with RewardClient(server.url, TOKENS["mallory"], timeout_s=60) as c:
        yield c


def _batch(client, task: str, pipeline: str, payloads: dict) -> str:
    client.register(task, pipeline)
    b = client.announce(task, len(payloads))
    for rid, payload in payloads.items():
        client.submit(task, b, payload, id=rid)
    return b


# ---- 1. forged rewards -------------------------------------------------------------------
FORGED = '{"module_error": null, "passed": 1000, "errors": []}'
FORGERIES = {
    "stdout": f"import os, sys\nsys.__stdout__.write({FORGED!r})\nsys.__stdout__.flush()\n"
    "os._exit(0)\n",
    "every-fd": "import os\nfor fd in range(256):\n    try:\n"
    f"        os.write(fd, {FORGED!r}.encode())\n    except OSError:\n        pass\nos._exit(0)\n",
    "exit-0": "import os\nprint('all tests passed', flush=True)\nos._exit(0)\n",
    "patch-exec": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
    "builtins.compile = lambda *a, **k: None\ndef f(x):\n    return 0\n",
    "always-equal": "class A:\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = object.__hash__\ndef f(x):\n    return A()\n",
}


def test_forged_rewards_get_nothing_and_rewards_stay_in_range(alice, mallory):
    tests = [*TESTS, "assert False"]
    b = _batch(
        mallory, "forge", "code", {k: {"code": c, "tests": tests} for k, c in FORGERIES.items()}
    )
    a = _batch(alice, "honest", "code", {"square": {**SQUARE, "tests": tests}})
    got = {r["id"]: r for r in mallory.results("forge", b, timeout_s=60)}
    for name, r in got.items():
        assert r["status"] == "ok" and r["reward"] == 0.0, (name, r)
    assert alice.rewards("honest", a, timeout_s=60) == {"square": 2 / 3}


# ---- 2. tenants cannot kill, ptrace or read each other ----------------------------------
ATTACK = r"""
import ctypes, glob, os, signal, time
hits = []
libc = ctypes.CDLL(None, use_errno=True)
root = os.path.dirname(os.path.dirname(os.getcwd()))  # the service's scratch root, if any
open('started-TAG', 'w').close()  # the handshake: the test starts alice's programs on seeing it
end = time.time() + 25.0  # the test releases the attack long before (once alice is scored)
n = 0
while not os.path.exists('release-TAG'):
    if time.time() > end:
        hits.append('never released: the isolation was not tested')
        break
    try:
        os.kill(-1, signal.SIGKILL)  # every process this uid may signal
        hits.append('kill -1')
    except OSError:
        pass
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) not in (1, os.getpid()):
            try:
                os.kill(int(p), signal.SIGKILL)
                hits.append('kill ' + p)
            except OSError:
                pass
            if libc.ptrace(16, int(p), 0, 0) == 0:  # PTRACE_ATTACH
                hits.append('ptrace ' + p)
            try:
                open('/proc/%s/mem' % p, 'rb').read(1)
                hits.append('mem ' + p)
            except OSError:
                pass
    if n % 20 == 0:  # other sandboxes' files: next to this one's scratch dir, or in /tmp
        for pat in ('/tmp/*/secret-*', '/tmp/*/*/secret-*', root + '/*/*/secret-*'):
            for path in glob.glob(pat):
                try:
                    hits.append(open(path).read())
                except OSError:
                    pass
    n += 1
    time.sleep(0.01)
def f(x):
    return sorted(set(hits))
"""
VICTIM = """
import time
open('secret-{tag}', 'w').write('the secret of alice')
time.sleep(0.8)
def f(x):
    return x * x
"""


def _find(name: str) -> Path | None:
    """The file ``name`` in a running sandbox's /scratch (its own tmpfs, which the host sees
    only through the sandbox's processes: ``/proc/<pid>/root/scratch``), or ``None``."""
    for p in os.listdir("/proc"):
        if p.isdigit():
            path = Path(f"/proc/{p}/root/scratch/{name}")
            try:
                if path.exists():
                    return path
            except OSError:
                pass
    return None


@namespaces
def test_one_tenants_code_cannot_kill_or_read_anothers_sandbox(alice, mallory, scratch):
    tag = uuid.uuid4().hex[:8]
    attack = {"code": ATTACK.replace("TAG", tag), "tests": ["assert f(0) == []"]}
    m = _batch(mallory, "killer", "code_long", {"attack": attack})
    # Handshake: the attack writes started-TAG in its /scratch once it runs, and loops until
    # the test writes release-TAG there (through /proc/<pid>/root): it runs from before
    # alice's programs start until after they are scored.
    assert _wait_until(lambda: _find(f"started-{tag}") is not None, 60), "no attack"
    started = _find(f"started-{tag}")
    victim = {"code": VICTIM.format(tag=tag), "tests": TESTS}
    a = _batch(alice, "victim", "code", {f"v{i}": victim for i in range(2)})
    try:
        assert alice.rewards("victim", a, timeout_s=60) == {"v0": 1.0, "v1": 1.0}
    finally:
        (started.parent / f"release-{tag}").touch()
    (r,) = mallory.results("killer", m, timeout_s=60)
    # f() == []: no kill, ptrace, memory read or file read worked, and the attack was released
    assert r["reward"] == 1.0, r


# ---- 3. a request can only tighten its limits -------------------------------------------
@pytest.mark.parametrize(
    "limits",
    [
        {"memory_bytes": -1},
        {"memory_bytes": 0},
        {"memory_bytes": "abc"},
        {"memory_bytes": 1e30},
        {"cpu_s": math.nan},
        {"wall_s": True},
        {"memory_bytes": 2 * SANDBOX["memory_bytes"]},
        {"no_such_limit": 1},
        ["memory_bytes", 1],
    ],
    ids=repr,
)
def test_limits_that_would_loosen_the_sandbox_are_refused(mallory, limits):
    mallory.register("limits", "code")
    b = mallory.announce("limits", 2)

    def post(path: str, body: dict) -> httpx.Response:  # json.dumps writes NaN as JSON does
        return mallory.http.post(
            f"/v1/tasks/limits/batches/{b}/{path}",
            content=json.dumps(body),
            headers={"content-type": "application/json"},
        )

    r = post("requests", {"payload": {**SQUARE, "limits": limits}})
    assert r.status_code == 422 and "limit" in r.json()["detail"], r.text
    bulk = {"requests": [{"payload": SQUARE}, {"payload": {**SQUARE, "limits": limits}}]}
    assert post("requests:bulk", bulk).status_code == 422  # all or nothing
    assert mallory.status("limits", b)["submitted"] == 0


def test_tighter_limits_apply(mallory):
    alloc = {"code": "x = bytearray(160 * 2**20)\ndef f(x):\n    return x * x\n", "tests": TESTS}
    tight = {**alloc, "limits": {"memory_bytes": 64 * 2**20, "wall_s": 3.5}}
    b = _batch(mallory, "tight", "code", {"plain": alloc, "tight": tight})
    res = {r["id"]: r for r in mallory.results("tight", b, timeout_s=60)}
    assert res["plain"]["reward"] == 1.0
    assert res["tight"]["reward"] == -1.0 and "MemoryError" in res["tight"]["detail"]


# ---- 4. the service's own memory stays bounded ------------------------------------------
class WorkerPeak:
    """Samples the peak RSS (VmHWM) of this process's reward worker children."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in _children(os.getpid()):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if b"reward_service.worker" not in f.read():
                            continue
                    with open(f"/proc/{pid}/status") as f:
                        hwm = next(ln for ln in f if ln.startswith("VmHWM"))
                    self.peak = max(self.peak, int(hwm.split()[1]) * 1024)
                except (OSError, StopIteration):
                    pass
            self._stop.wait(0.02)

    def __enter__(self) -> WorkerPeak:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=5)


def _children(ppid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(p))
        except (OSError, ValueError, IndexError):
            pass
    return out


FLOOD = (
    "import os, sys\nwhile True:\n    os.write(2, b'x' * 65536)\n    os.write(1, b'y' * 65536)\n"
)


def test_output_floods_and_huge_sources_do_not_grow_the_workers(alice, mallory):
    huge = "x=1;" * 220_000  # fits in a body, not in the source limit (~500 MB to parse)
    with WorkerPeak() as mem:
        b = _batch(
            mallory,
            "flood",
            "code",
            {"flood": {"code": FLOOD, "tests": TESTS}, "huge": {"code": huge, "tests": TESTS}},
        )
        a = _batch(alice, "calm", "code", {"square": SQUARE})
        res = {r["id"]: r for r in mallory.results("flood", b, timeout_s=60)}
        assert alice.rewards("calm", a, timeout_s=60) == {"square": 1.0}
    assert 0 < mem.peak < 150 * 2**20, mem.peak  # idle worker ~20-60 MB; no buffered flood
    assert res["flood"]["reward"] == -1.0 and res["flood"]["stage"] == "execute"
    assert res["huge"]["stage"] == "check" and "over the limit" in res["huge"]["detail"]


def test_bodies_over_the_limit_get_413(server, mallory):
    mallory.register("bodies", "code")
    b = mallory.announce("bodies", 1)
    url = f"{server.url}/v1/tasks/bodies/batches/{b}/requests"
    big = json.dumps({"payload": {"code": "#" * (2 * MAX_BODY), "tests": TESTS}}).encode()
    headers = {"Authorization": f"Bearer {TOKENS['mallory']}"}
    r = httpx.post(url, content=big, headers=headers, timeout=30)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: counted as it streams
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = httpx.post(url, content=chunks(), headers=headers, timeout=30)
    assert r.status_code == 413
    assert mallory.status("bodies", b)["submitted"] == 0


# ---- 5. nothing outlives its run ---------------------------------------------------------
SLEEPER = "import time\nopen('marker-{tag}', 'w').write('x')\ntime.sleep(30)\n"


def _sandboxes(tag: str, roots: list[str]) -> tuple[int, int]:
    """(processes whose working directory holds marker-<tag>, host directories holding it)."""
    procs = 0
    for p in os.listdir("/proc"):
        try:  # /proc/<pid>/cwd reaches into the sandbox's own mount namespace
            if os.path.exists(f"/proc/{p}/cwd/marker-{tag}"):
                procs += 1
        except OSError:
            pass
    dirs = 0
    for root in roots:
        for _, _, files in os.walk(root):
            dirs += f"marker-{tag}" in files
    return procs, dirs


def _wait_until(cond, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def _roots(scratch: str) -> list[str]:
    """The service's scratch root (the test's own) and the sandbox directories a service
    without one makes in the temp dir (``m2flow-sbx-*``): never the rest of the shared temp
    dir (another checkout's ``runs/`` may lie there)."""
    import glob
    import tempfile

    return [scratch, *glob.glob(os.path.join(tempfile.gettempdir(), "m2flow-sbx-*"))]


def test_a_sandbox_killed_by_the_stage_timeout_leaves_nothing(mallory, scratch):
    tag = uuid.uuid4().hex[:8]
    b = _batch(
        mallory, "orphan", "code_short", {"s": {"code": SLEEPER.format(tag=tag), "tests": TESTS}}
    )
    assert _wait_until(lambda: _sandboxes(tag, _roots(scratch))[0] > 0, 10)  # it ran
    (r,) = mallory.results("orphan", b, timeout_s=60)
    assert r["status"] == "timeout" and r["reward"] == -1.0
    assert _wait_until(lambda: _sandboxes(tag, _roots(scratch)) == (0, 0), 10), _sandboxes(
        tag, _roots(scratch)
    )


def test_service_shutdown_stops_every_sandbox_and_removes_its_scratch(tmp_path):
    tag = uuid.uuid4().hex[:8]
    srv = BackgroundServer(_config(str(tmp_path)))
    with srv, RewardClient(srv.url, TOKENS["alice"]) as c:
        _batch(c, "t", "code", {"s": {"code": SLEEPER.format(tag=tag), "tests": TESTS}})
        assert _wait_until(lambda: _sandboxes(tag, _roots(str(tmp_path)))[0] > 0, 15)
    assert _wait_until(lambda: _sandboxes(tag, _roots(str(tmp_path))) == (0, 0), 10)
    assert not os.listdir(tmp_path)  # the scratch root is gone


def test_sigterm_of_the_cli_stops_every_sandbox(tmp_path):
    tag = uuid.uuid4().hex[:8]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "service.json"
    cfg.write_text(_config(str(tmp_path)).model_copy(update={"port": port}).model_dump_json())
    proc = subprocess.Popen(
        [sys.executable, "-m", "m2flow.reward_service.cli", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        assert _wait_until(lambda: _healthy(url), 30), "service did not start"
        with RewardClient(url, TOKENS["alice"]) as c:
            _batch(c, "t", "code", {"s": {"code": SLEEPER.format(tag=tag), "tests": TESTS}})
            assert _wait_until(lambda: _sandboxes(tag, _roots(str(tmp_path)))[0] > 0, 15)
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM), proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert _wait_until(lambda: _sandboxes(tag, _roots(str(tmp_path))) == (0, 0), 10)
    assert os.listdir(tmp_path) == ["service.json"]  # the scratch root is gone


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---- 6. a huge announcement does not stall another tenant ------------------------------
def test_a_huge_announcement_neither_stalls_others_nor_slows_decisions(server, alice, mallory):
    b = _batch(mallory, "huge", "code", {"0": SQUARE})  # a history, so decisions simulate it
    assert mallory.rewards("huge", b, timeout_s=60) == {"0": 1.0}
    with pytest.raises(RewardServiceError) as e:
        mallory.announce("huge", 1_000_000)
    assert e.value.status == 422 and "max_batch_size" in str(e.value)
    t0 = time.monotonic()
    mallory.announce("huge", MAX_BATCH)
    mallory.announce("huge", MAX_BATCH)
    a = _batch(alice, "small", "code", {"0": SQUARE})
    assert alice.rewards("small", a, timeout_s=60) == {"0": 1.0}
    assert time.monotonic() - t0 < 5.0  # it waited ~39 s before (a 35 s decision under a lock)
    assert server.service.decision_s_max < 2.0


# ---- 7. tenants see only their own tasks; a token names one tenant ------------------------
def test_metrics_show_only_the_callers_tasks(alice, mallory):
    alice.register("alice-private-task", "code")
    mallory.register("mallory-private-task", "code")
    seen = alice.metrics()
    assert "alice-private-task" in seen["tasks"]
    text = json.dumps(seen)
    assert "mallory" not in text, [k for k in seen["tasks"]]
    assert "alice" not in json.dumps(mallory.metrics())
    assert "code.execute" in seen["pools"]  # pool-level numbers are shared


def test_two_tenants_with_one_token_are_refused(scratch):
    cfg = _config(scratch).model_dump()
    cfg["tenants"]["eve"] = {"token": TOKENS["alice"]}
    with pytest.raises(ValidationError, match="'alice' and 'eve'"):
        ServiceConfig.model_validate(cfg)
