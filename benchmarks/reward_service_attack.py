"""Attack benchmark of the reward service: hostile tenants, one live service.

Starts the service on loopback as ``python -m m2flow.reward_service.cli`` in a
subprocess (so what is measured is the service and its workers, not this script's clients)
with two tenants, ``alice`` and ``bob``. Each row runs one attack from one tenant while the
other tenant's correct submissions (known rewards: 1.0, 0.5, and programs that sleep so they
are running during the attack) go through the same pools concurrently; the attacking tenant
alternates. The input attacks (lone surrogates, bad numbers, queued
memory, disk fill, huge values, task-name squatting) are in
``benchmarks/reward_service_attack_input.py``. Then one row runs every attack from both
tenants at once; one row floods a service of its own with idle connections, no token needed
(``benchmarks/reward_service_attack_flood.py``); and the last rows stop a service with a
sandbox still running: SIGTERM of the CLI process, then an in-process BackgroundServer
leaving its context (the app's lifespan shutdown).

A row of its own holds slow bodies (one tenant's connections with complete headers and a body
that trickles in, a byte every 5 s, more of them than the service's connection cap) while the
other tenant's requests and ``/healthz`` are timed (``reward_service_attack_slowbody.py``;
``--only slow-body`` runs it alone and puts it into the results file).

Per row: contained? (the attack's own check -- see each attack's function -- the other
tenant intact, nothing left behind; for the huge announcement alone, the other tenant's batch
within 5 s and every scaling decision under 1 s, under 2 s with every attack at once), the
best reward the attacker got, the other tenant's results intact? (every reward and status as
expected), the service's memory peak (RSS of the service process plus its worker processes,
sampled every 20 ms, bytes; psutil if installed, else /proc), the service process's open file
descriptors (peak), sandbox processes left after (processes whose working directory is in
the service's scratch space), scratch directories left after (sandbox directories, plus
worker directories of workers no longer alive). Writes
benchmarks/results/reward_service_attack.json.

    python benchmarks/reward_service_attack.py
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import reward_service_attack_input
from m2flow.reward_service.app import BackgroundServer
from m2flow.reward_service.client import AsyncRewardClient, RewardServiceError
from m2flow.reward_service.sandbox import isolation
from m2flow.reward_service.schemas import ServiceConfig
from reward_service_attack_flood import flood_row
from reward_service_attack_measure import (
    Memory,
    Service,
    rss,
    settle,
    wait_for_sandbox,
    workers,
)
from reward_service_attack_slowbody import slow_body_row

TOKENS = {"alice": "alice-attack-bench", "bob": "bob-attack-bench"}
SANDBOX = {"wall_s": 4.0, "cpu_s": 2, "memory_bytes": 256 * 2**20}
TESTS = ["assert f(2) == 4", "assert f(3) == 9"]
JSON = {"content-type": "application/json"}
WORKER_HWM_BOUND = 150 * 2**20  # one worker process, bytes
SERVICE_GROWTH_BOUND = 100 * 2**20  # the service process during one row, bytes
OUT = Path("benchmarks/results/reward_service_attack.json")


def config(scratch: str, port: int = 0) -> ServiceConfig:
    code = {
        "check": {"timeout_s": 10, "max_workers": 2},
        "execute": {"timeout_s": 8, "max_workers": 4, "options": {"sandbox": SANDBOX}},
    }
    short = {  # the stage timeout kills the worker while its sandbox still sleeps
        "check": {"timeout_s": 10, "max_workers": 1},
        "execute": {"timeout_s": 1.5, "max_workers": 2, "options": {"sandbox": {"wall_s": 30}}},
    }
    return ServiceConfig.model_validate(
        {
            "port": port,
            "tenants": {n: {"token": t} for n, t in TOKENS.items()},
            "default_delay_bound_s": 1.0,
            "scratch_dir": scratch,
            "max_queued_bytes": 160 * 2**20,
            "max_queued_bytes_per_tenant": 64 * 2**20,
            "pipelines": {
                "code": {"kind": "code", "penalty": -1.0, "stages": code},
                "code_short": {"kind": "code", "penalty": -1.0, "stages": short},
            },
        }
    )


# ---- the other tenant's correct submissions ------------------------------------------------
SLOW = (
    "import time\nopen('secret', 'w').write('private')\ntime.sleep(0.8)\n"
    "def f(x):\n    return x * x\n"
)
CORRECT = {
    "square": ("def f(x):\n    return x * x\n", 1.0),
    "half": ("def f(x):\n    return 4\n", 0.5),
    "slow-0": (SLOW, 1.0),  # running (and holding a file) while the attack runs
    "slow-1": (SLOW, 1.0),
}


async def correct_batch(c: AsyncRewardClient, task: str) -> bool:
    """Submit the correct programs; True if every reward and status is as expected."""
    await c.register(task, "code")
    b = await c.announce(task, len(CORRECT))
    for rid, (code, _) in CORRECT.items():
        await c.submit(task, b, {"code": code, "tests": TESTS}, id=rid)
    got = {r["id"]: r for r in await c.results(task, b, timeout_s=120)}
    return all(got[k]["status"] == "ok" and got[k]["reward"] == v for k, (_, v) in CORRECT.items())


# ---- attacks: each returns (contained by its own check, best attacker reward, note) ----------
FORGED = '{"module_error": null, "passed": 1000, "errors": []}'
FORGERIES = {
    "stdout": f"import os, sys\nsys.__stdout__.write({FORGED!r})\nsys.__stdout__.flush()\n"
    "os._exit(0)\n",
    "os-write": f"import os\nos.write(1, {FORGED!r}.encode())\nos._exit(0)\n",
    "every-fd": "import os\nfor fd in range(256):\n    try:\n"
    f"        os.write(fd, {FORGED!r}.encode())\n    except OSError:\n        pass\nos._exit(0)\n",
    "value-pipe": "import os\nos.write(3, b'{\"v\": [1000, 1000]}')\nos._exit(0)\n",
    "patch-builtins": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
    "builtins.eval = lambda *a, **k: 1000\ndef f(x):\n    return 0\n",
    "always-equal": "class A:\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = object.__hash__\ndef f(x):\n    return A()\n",
    "int-subclass": "class I(int):\n    def __eq__(self, o):\n        return True\n"
    "    __hash__ = int.__hash__\ndef f(x):\n    return I(0)\n",
}
KILLER = r"""
import ctypes, glob, os, signal, time
hits = []
libc = ctypes.CDLL(None, use_errno=True)
root = os.path.dirname(os.path.dirname(os.getcwd()))
end, n = time.time() + 3.0, 0
while time.time() < end:
    try:
        os.kill(-1, signal.SIGKILL)
        hits.append('kill -1')
    except OSError:
        pass
    for p in os.listdir('/proc'):
        if p.isdigit() and int(p) not in (1, os.getpid()):
            try:
                os.kill(int(p), signal.SIGKILL)
                hits.append('kill')
            except OSError:
                pass
            if libc.ptrace(16, int(p), 0, 0) == 0:
                hits.append('ptrace')
    if n % 20 == 0:
        for pat in ('/tmp/*/secret', '/tmp/*/*/secret', root + '/*/*/secret'):  # others' files
            for path in glob.glob(pat):
                try:
                    open(path).read(1)
                    hits.append('read ' + path)
                except OSError:
                    pass
    n += 1
    time.sleep(0.01)
def f(x):
    return hits
"""
FLOOD = "import os\nwhile True:\n    for fd in (1, 2, 3):\n        os.write(fd, b'x' * 65536)\n"
SLEEPER = "import time\ntime.sleep(60)\n"


async def _one_batch(c, task, pipeline, payloads: dict, go: asyncio.Event | None = None):
    await c.register(task, pipeline)
    b = await c.announce(task, len(payloads))
    for rid, p in payloads.items():
        await c.submit(task, b, p, id=rid)
    if go is not None:
        go.set()
    return b, {r["id"]: r for r in await c.results(task, b, timeout_s=120)}


async def forgery(c, tag, go, ctx):
    payloads = {k: {"code": v, "tests": [*TESTS, "assert False"]} for k, v in FORGERIES.items()}
    _, got = await _one_batch(c, f"forge-{tag}", "code", payloads, go)
    best = max(r["reward"] for r in got.values())
    return best <= 0.0, best, f"{len(FORGERIES)} forgeries, none scored"


async def cross_kill(c, tag, go, ctx):
    task = f"kill-{tag}"
    await c.register(task, "code")
    b = await c.announce(task, 1)
    await c.submit(task, b, {"code": KILLER, "tests": ["assert len(f(0)) > 0"]}, id="k")
    end = time.monotonic() + 30
    while (await c.status(task, b))["stages"]["execute"]["running"] < 1:  # attack is live
        if time.monotonic() > end:
            break
        await asyncio.sleep(0.05)
    go.set()  # the other tenant's programs run while the attack loops
    (r,) = await c.results(task, b, timeout_s=120)
    return r["reward"] == 0.0 and r["status"] == "ok", r["reward"], "kill/ptrace/read found nothing"


async def limit_escape(c, tag, go, ctx):
    task = f"limits-{tag}"
    await c.register(task, "code")
    b = await c.announce(task, 1)
    go.set()
    refused, url = 0, f"/v1/tasks/{task}/batches/{b}/requests"
    bad = [-1, 0, "abc", 1e30, math.nan, True, 2 * SANDBOX["memory_bytes"]]
    for v in bad:  # json.dumps writes NaN, as JSON parsers read it
        body = {"payload": {"code": "x = 1", "tests": TESTS, "limits": {"memory_bytes": v}}}
        refused += (
            await c.http.post(url, content=json.dumps(body), headers=JSON)
        ).status_code == 422
    alloc = "x = bytearray(1 << 30)\ndef f(x):\n    return x * x\n"
    await c.submit(task, b, {"code": alloc, "tests": TESTS}, id="alloc")
    (r,) = await c.results(task, b, timeout_s=120)
    ok = refused == len(bad) and r["reward"] == -1.0 and "MemoryError" in r["detail"]
    return (
        ok,
        r["reward"],
        f"{refused}/{len(bad)} loosening limits refused (422); 1 GiB alloc fails",
    )


async def output_flood(c, tag, go, ctx):
    payloads = {f"flood-{i}": {"code": FLOOD, "tests": TESTS} for i in range(2)}
    _, got = await _one_batch(c, f"flood-{tag}", "code", payloads, go)
    best = max(r["reward"] for r in got.values())
    mem = ctx["mem"]
    # alone, the service must not grow; with every attack at once, queued memory grows it
    # (bounded there by its own check)
    alone = ctx["attackers"] == 1
    ok = mem.worker_hwm < WORKER_HWM_BOUND and (
        mem.service_growth < SERVICE_GROWTH_BOUND or not alone
    )
    return ok and best <= 0.0, best, f"worker peak {ctx['mem'].worker_hwm / 2**20:.0f} MiB"


async def huge_source(c, tag, go, ctx):
    task = f"huge-{tag}"
    await c.register(task, "code")
    b = await c.announce(task, 1)
    go.set()
    big = json.dumps({"payload": {"code": "#" * (16 * 2**20), "tests": TESTS}}).encode()
    url = f"/v1/tasks/{task}/batches/{b}/requests"
    s1 = (await c.http.post(url, content=big, headers=JSON)).status_code

    async def chunks():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    s2 = (await c.http.post(url, content=chunks(), headers=JSON)).status_code
    code = "x=1;" * (6 * 2**20 // 4)  # 6 MiB: inside the body limit, ~3.6 GB to parse
    await c.submit(task, b, {"code": code, "tests": TESTS}, id="src")
    (r,) = await c.results(task, b, timeout_s=120)
    ok = (s1, s2) == (413, 413) and r["stage"] == "check" and "over the limit" in r["detail"]
    ok = ok and ctx["mem"].worker_hwm < WORKER_HWM_BOUND
    return ok, r["reward"], f"16 MiB body {s1}, chunked {s2}; 6 MiB source refused at check"


async def sleeping_orphan(c, tag, go, ctx):
    payloads = {"sleep": {"code": SLEEPER, "tests": TESTS}}
    _, got = await _one_batch(c, f"orphan-{tag}", "code_short", payloads, go)
    r = got["sleep"]
    return r["status"] == "timeout", r["reward"], "stage timeout (1.5 s) kills worker + sandbox"


async def huge_announce(c, tag, go, ctx):
    task = f"announce-{tag}"
    await _one_batch(c, task, "code", {"0": {"code": CORRECT["square"][0], "tests": TESTS}})
    try:
        await c.announce(task, 10**7)
        refused = False
    except RewardServiceError as e:
        refused = e.status == 422
    big = ctx["max_batch_size"]
    await c.announce(task, big)
    await c.announce(task, big)
    go.set()
    return refused, 0.0, f"10^7 refused (422); 2 x {big} announced"


ATTACKS = {
    "forged verdicts": forgery,
    "cross-tenant kill": cross_kill,
    "limit escape": limit_escape,
    "output flood": output_flood,
    "huge source / body": huge_source,
    "sleeping orphan": sleeping_orphan,
    "huge announce": huge_announce,
    **reward_service_attack_input.ATTACKS,
}


# ---- rows -------------------------------------------------------------------------------
async def run_row(svc: Service, name: str, attacks: list[tuple[str, str]], ctx: dict) -> dict:
    """``attacks``: (attack name, attacking tenant) pairs, run at once, each alongside the
    other tenant's correct batch."""
    mem = Memory(svc.proc.pid)
    cfg = config(svc.scratch)
    ctx.update(mem=mem, max_batch_size=cfg.max_batch_size, config=cfg, url=svc.url,
               scratch_root=svc.root, attackers=len(attacks))  # fmt: skip
    tag = uuid.uuid4().hex[:6]
    clients = {n: AsyncRewardClient(svc.url, t, timeout_s=120) for n, t in TOKENS.items()}
    t0 = time.monotonic()
    try:

        async def pair(i: int, attack: str, who: str):
            victim = next(n for n in TOKENS if n != who)
            go = asyncio.Event()
            own = {**ctx, "victim_task": f"ok-{tag}{i}"}  # the name the victim will use
            att = asyncio.create_task(ATTACKS[attack](clients[who], f"{tag}{i}", go, own))
            await go.wait()
            started = time.monotonic()
            intact = await correct_batch(clients[victim], f"ok-{tag}{i}")
            victim_s = time.monotonic() - started
            contained, reward, note = await att
            return contained, reward, note, intact, victim_s

        res = await asyncio.gather(*(pair(i, a, w) for i, (a, w) in enumerate(attacks)))
    finally:
        for c in clients.values():
            await c.close()
    mem.stop()
    procs, dirs = settle(svc.root, svc.live_workers)
    intact = all(r[3] for r in res)
    victim_s = max(r[4] for r in res)
    contained = all(r[0] for r in res) and intact and (procs, dirs) == (0, 0)
    notes = "; ".join(sorted({r[2] for r in res}))
    notes += f"; other tenant's batch {victim_s:.2f} s"
    if "huge announce" in [a for a, _ in attacks]:
        # alone: the other tenant's batch does not wait on scaling, and a decision takes < 1 s;
        # with every attack at once on 2 shared cores, decisions stay bounded (< 2 s)
        longest = svc.metrics()["decision_s_max"]
        alone = len(attacks) == 1
        contained = contained and longest < (1.0 if alone else 2.0)
        contained = contained and (victim_s < 5.0 or not alone)
        notes += f", longest scaling decision {longest:.3f} s"
    return {
        "attack": name,
        "attackers": sorted({w for _, w in attacks}),
        "contained": contained,
        "attacker_reward": max(r[1] for r in res),
        "other_intact": intact,
        "other_batch_s": victim_s,
        "service_mem_peak_bytes": mem.peak,
        "worker_peak_rss_bytes": mem.worker_hwm,
        "service_fds_peak": mem.fds_peak,
        "procs_left": procs,
        "scratch_left": dirs,
        "seconds": time.monotonic() - t0,
        "note": notes,
    }


def _sleeper(url: str, task: str) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        c.headers["Authorization"] = f"Bearer {TOKENS['alice']}"
        c.post("/v1/tasks", json={"task": task, "pipeline": "code"}).raise_for_status()
        b = c.post(f"/v1/tasks/{task}/batches", json={"size": 1}).json()["batch"]
        payload = {"code": SLEEPER, "tests": TESTS}
        c.post(f"/v1/tasks/{task}/batches/{b}/requests", json={"payload": payload})


def _stop_row(name: str, procs: int, dirs: int, root_left: bool, peak, secs, note) -> dict:
    row = dict.fromkeys(["attacker_reward", "other_intact", "other_batch_s"])
    return row | {
        "attack": name,
        "attackers": ["alice"],
        "contained": (procs, dirs, root_left) == (0, 0, False),
        "service_mem_peak_bytes": peak,
        "worker_peak_rss_bytes": None,
        "service_fds_peak": None,
        "procs_left": procs,
        "scratch_left": dirs + root_left,
        "seconds": secs,
        "note": note,
    }


def sigterm_row(svc: Service) -> dict:
    """A sandbox sleeping, then SIGTERM to the service process."""
    t0 = time.monotonic()
    _sleeper(svc.url, "last")
    wait_for_sandbox(svc.root)
    peak = rss(svc.proc.pid)[0] + sum(rss(w)[0] for w in workers(svc.proc.pid))
    rc = svc.sigterm()
    procs, dirs = settle(svc.root, lambda: 0)
    note = f"exit {rc} (uvicorn re-raises the signal after its graceful shutdown); " + (
        "scratch root left" if os.path.exists(svc.root) else "scratch root removed"
    )
    name = "SIGTERM to the CLI, sandbox sleeping"
    return _stop_row(name, procs, dirs, os.path.exists(svc.root), peak, time.monotonic() - t0, note)


def lifespan_row(scratch: str) -> dict:
    """The in-process server (BackgroundServer) leaving its context with a sandbox sleeping."""
    t0 = time.monotonic()
    server = BackgroundServer(config(scratch))
    with server:
        root = server.service.scratch.path
        _sleeper(server.url, "last")
        wait_for_sandbox(root)
    procs, dirs = settle(root, lambda: 0)
    name = "lifespan shutdown, sandbox sleeping"
    left = os.path.exists(root)
    note = "scratch root left" if left else "scratch root removed"
    return _stop_row(name, procs, dirs, left, None, time.monotonic() - t0, note)


def only_slow_body() -> None:
    """``--only slow-body``: run that row alone and put it into the results file in place of
    the row of the same attack (the other rows as they were)."""
    scratch = tempfile.mkdtemp(prefix="reward-attack-")
    row = slow_body_row(scratch, config, TOKENS, correct_batch)
    out = json.loads(OUT.read_text())
    rows = [r for r in out["rows"] if r["attack"] != row["attack"]]
    at = next((i for i, r in enumerate(rows) if r["attack"].startswith("lifespan")), len(rows))
    rows.insert(at, row)
    out.update(rows=rows, all_contained=all(r["contained"] for r in rows))
    OUT.write_text(json.dumps(out, indent=1))
    print_table([row])
    sys.exit(0 if row["contained"] else 1)


def main() -> None:
    if sys.argv[1:] == ["--only", "slow-body"]:
        return only_slow_body()
    scratch = tempfile.mkdtemp(prefix="reward-attack-")
    rows: list[dict] = []
    t0 = time.monotonic()
    svc = Service(scratch, config, TOKENS["alice"])
    try:
        ctx: dict = {}
        names = list(ATTACKS)
        for i, name in enumerate(names):
            who = ["bob", "alice"][i % 2]
            rows.append(asyncio.run(run_row(svc, name, [(name, who)], ctx)))
            print(f"  {name}: done ({rows[-1]['seconds']:.1f} s)", flush=True)
        together = [(n, w) for n in names for w in TOKENS]
        rows.append(asyncio.run(run_row(svc, "all at once, both tenants", together, ctx)))
        print(f"  all at once: done ({rows[-1]['seconds']:.1f} s)", flush=True)
        rows.append(sigterm_row(svc))
        rows.append(flood_row(scratch, config, TOKENS, correct_batch))
        print(f"  idle-connection flood: done ({rows[-1]['seconds']:.1f} s)", flush=True)
        rows.append(slow_body_row(scratch, config, TOKENS, correct_batch))
        print(f"  slow bodies: done ({rows[-1]['seconds']:.1f} s)", flush=True)
    finally:
        if svc.proc.poll() is None:
            svc.proc.kill()
    rows.append(lifespan_row(scratch))
    wall = time.monotonic() - t0
    print_table(rows)
    ok = all(r["contained"] for r in rows)
    print(f"\nsandbox isolation: {isolation()}; {len(rows)} rows in {wall:.1f} s; "
          f"all contained: {'yes' if ok else 'NO'}")  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    out = {"isolation": isolation(), "wall_s": wall, "all_contained": ok, "rows": rows}
    OUT.write_text(json.dumps(out, indent=1))
    os.remove(os.path.join(scratch, "service.json"))
    if not os.listdir(scratch):
        os.rmdir(scratch)
    sys.exit(0 if ok else 1)


def print_table(rows: list[dict]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE, title="reward service under attack")
    for h in ("attack", "by", "contained?", "attacker reward", "other intact?",
              "service mem peak (B)", "fds peak", "procs left", "scratch left"):  # fmt: skip
        table.add_column(h, overflow="fold")
    yn = {True: "yes", False: "no", None: "-"}
    for r in rows:
        reward, mem = r["attacker_reward"], r["service_mem_peak_bytes"]
        table.add_row(
            r["attack"],
            "+".join(r["attackers"]),
            yn[r["contained"]],
            "-" if reward is None else f"{reward:g}",
            yn[r["other_intact"]],
            "-" if mem is None else f"{mem:,}",
            "-" if r["service_fds_peak"] is None else str(r["service_fds_peak"]),
            str(r["procs_left"]),
            str(r["scratch_left"]),
        )
    Console(width=160).print(table)
    print("notes:")
    for r in rows:
        print(f"  {r['attack']}: {r['note']}")


if __name__ == "__main__":
    main()
