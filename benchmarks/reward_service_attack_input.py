"""Input attacks for the reward service attack benchmark
(``benchmarks/reward_service_attack.py``): text that cannot be encoded, bodies with numbers
JSON has not, queued memory, a sandbox filling the disk, values too large to print, and task
names squatted before the other tenant uses them.

Each attack is ``async (client, tag, go, ctx) -> (contained, best attacker reward, note)``,
run next to the other tenant's correct batch (``go`` starts it). ``ctx``: ``mem`` (the row's
:class:`Memory`), ``url``, ``token`` (the attacker's), ``scratch_root`` (the service's
scratch root), ``victim_task`` (the task name the other tenant is about to use), ``config``
(the service's :class:`ServiceConfig`). "Attacker reward" is what the attack was worth to
it: 0 (or the penalty) when contained.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading

import httpx

TESTS = ["assert f(2) == 4", "assert f(3) == 9"]
JSON = {"content-type": "application/json"}


async def _batch(c, task: str, payloads: dict, go: asyncio.Event | None = None):
    await c.register(task, "code")
    b = await c.announce(task, len(payloads))
    for rid, p in payloads.items():
        await c.submit(task, b, p, id=rid)
    if go is not None:
        go.set()
    return b, {r["id"]: r for r in await c.results(task, b, timeout_s=120)}


def _strict_json(r: httpx.Response):
    """The answer parsed as strict JSON from UTF-8 (raises on NaN, Infinity, bad bytes)."""

    def refuse(name):
        raise ValueError(f"non-JSON number {name}")

    return json.loads(r.content.decode("utf-8"), parse_constant=refuse)


# ---- item 1: lone surrogates in what a sandbox reports, and in ids -------------------------
SURROGATES = {
    "top": "raise ValueError('\\ud800')\n",
    "test": "def f(x):\n    raise ValueError('\\udfff' + chr(0xD800))\n",
    "type": "def f(x):\n    return type('\\ud800', (), {})()\n",
}


async def lone_surrogates(c, tag, go, ctx):
    task = f"sur-{tag}"
    payloads = {k: {"code": v, "tests": TESTS} for k, v in SURROGATES.items()}
    b, got = await _batch(c, task, payloads, go)
    reads = []
    for _ in range(2):  # every view, and again later: nothing stored breaks a read
        for path in (f"/v1/tasks/{task}/batches/{b}/results", f"/v1/tasks/{task}/batches/{b}",
                     f"/v1/tasks/{task}/batches/{b}/stream"):  # fmt: skip
            r = await c.http.get(path)
            try:
                if path.endswith("stream"):
                    [json.loads(ln) for ln in r.content.decode("utf-8").splitlines()]
                else:
                    _strict_json(r)
                reads.append(r.status_code)
            except ValueError:
                reads.append(-r.status_code)
    body = '{"payload": {"code": "x = 1", "tests": ["assert 1"]}, "id": "\\ud800"}'
    await c.announce(task, 1, batch="ids")
    r = await c.http.post(f"/v1/tasks/{task}/batches/ids/requests", content=body, headers=JSON)
    escaped = all("\\u" in g["detail"] for g in got.values())
    ok = all(s == 200 for s in reads) and r.status_code == 422 and escaped
    best = max(g["reward"] for g in got.values())
    note = f"{len(reads)} reads of the batch all 200, details escaped; surrogate id {r.status_code}"
    return ok, best, note


# ---- item 7: numbers JSON has not, and other bad bodies at every endpoint -------------------
DEEP = "[" * 100_000 + "]" * 100_000


def _bad_bodies(task: str, batch: str) -> list[tuple[str, str]]:
    reg, ann = "/v1/tasks", f"/v1/tasks/{task}/batches"
    sub = f"{ann}/{batch}/requests"
    p = '{"payload": {"code": "x = 1", "tests": ["assert 1"], "e": %s}, "id": "%s"}'
    return [
        (reg, '{"task": "\\ud800", "pipeline": "code"}'),
        (reg, '{"task": "t", "pipeline": "code", "delay_bound_s": NaN}'),
        (reg, '{"task": "t", "pipeline": "code", "delay_bound_s": 1e400}'),
        (ann, '{"size": 1e400}'),
        (ann, '{"size": -1e400}'),
        (ann, '{"size": NaN}'),
        (ann, '{"size": Infinity}'),
        (ann, '{"size": true}'),
        (ann, '{"size": 2.0}'),
        (ann, '{"size": 1' + "0" * 5000 + "}"),
        (ann, '{"size": 2, "scored": [{"id": "a", "reward": NaN}]}'),
        (ann, '{"size": 2, "scored": [{"id": "a", "reward": true}]}'),
        (sub, p % ("NaN", "n1")),
        (sub, p % ("-Infinity", "n2")),
        (sub, p % ("1e400", "n3")),
        (sub, p % ("[1, [2, {\"x\": NaN}]]", "n4")),
        (sub, p % (DEEP, "n5")),
        (sub, p % ("[" * 500 + "]" * 500, "n6")),
        (sub, '{"payload": "\\ud800", "id": "n7"}'),
        (f"{sub}:bulk",
         '{"requests": [{"payload": {"code": "x", "tests": ["1"]}, "id": "\\udbff"}]}'),
    ]  # fmt: skip


async def bad_numbers(c, tag, go, ctx):
    task = f"num-{tag}"
    await c.register(task, "code")
    b = await c.announce(task, 4)
    go.set()
    statuses = []
    for path, body in _bad_bodies(task, b):
        r = await c.http.post(path, content=body.encode(), headers=JSON)
        try:
            _strict_json(r)
            statuses.append(r.status_code)
        except ValueError:
            statuses.append(-r.status_code)
    queries = [f"/v1/tasks/{task}/batches/{b}/results?offset=1e400",
               f"/v1/tasks/{task}/batches/{b}/results?wait_s=nan",
               f"/v1/tasks/{task}/batches/{b}/results?offset=%ED%B3%BF",
               f"/v1/tasks/{task}/batches/{b}/stream?timeout_s=inf"]  # fmt: skip
    for q in queries:
        statuses.append((await c.http.get(httpx.URL(ctx["url"] + q))).status_code)
    submitted = (await c.status(task, b))["submitted"]
    ok = all(400 <= s < 500 for s in statuses) and submitted == 0
    kinds = ", ".join(f"{s}x{statuses.count(s)}" for s in sorted(set(statuses)))
    return ok, 0.0, f"{len(statuses)} bad bodies and queries: {kinds}, none accepted"


# ---- item 3: queued memory -------------------------------------------------------------------
SLEEP1 = "import time\ntime.sleep(1)\ndef f(x):\n    return 0\n"
N_BIG = 60


async def queued_memory(c, tag, go, ctx):
    cfg = ctx["config"]
    task = f"mem-{tag}"
    await c.register(task, "code")
    b = await c.announce(task, N_BIG)
    go.set()
    pad = "x" * 7_500_000  # 60 of these took the service from 100 to 357 MB before
    path = f"/v1/tasks/{task}/batches/{b}/requests"
    sem = asyncio.Semaphore(8)

    async def post(i: int) -> int:
        body = json.dumps({"payload": {"code": SLEEP1, "tests": TESTS, "pad": pad}, "id": str(i)})
        async with sem:
            return (await c.http.post(path, content=body, headers=JSON)).status_code

    statuses = await asyncio.gather(*(post(i) for i in range(N_BIG)))
    amplified = json.dumps({"payload": {"code": "x", "tests": TESTS, "pad": [{}] * 1_000_000}})
    amp = (await c.http.post(path, content=amplified, headers=JSON)).status_code
    await c.close_batch(task, b)
    got = await c.results(task, b, timeout_s=180)
    accepted, refused = statuses.count(200), statuses.count(429)
    growth = ctx["mem"].service_growth
    # the caps bound the payloads held; on top come large bodies in flight (max_large_bodies
    # at a time, each read, parsed and fingerprinted: ~4 copies) and requests being handed to
    # a worker (one per worker process: its message as text and as bytes, 2 copies)
    workers = sum(s.max_workers for p in cfg.pipelines.values() for s in p.stages.values())
    bound = cfg.max_queued_bytes + (cfg.max_large_bodies * 4 + workers * 2) * cfg.max_body_bytes
    ok = refused > 0 and amp == 413 and growth < bound and len(got) == accepted
    best = max((r["reward"] for r in got), default=0.0)
    note = (f"{N_BIG} x 7.5 MB: {accepted} queued, {refused} refused (429); 3 MB of JSON "
            f"holding ~70 MB as objects: {amp}; service grew {growth / 2**20:.0f} MiB "
            f"(bound {bound >> 20} MiB: queue caps {cfg.max_queued_bytes_per_tenant >> 20}/"
            f"{cfg.max_queued_bytes >> 20} MiB + {cfg.max_large_bodies} large bodies in "
            f"flight + {workers} handed to workers)")  # fmt: skip
    return ok, best, note


# ---- item 4: a sandbox filling the disk ------------------------------------------------------
FILL = """
n = 0
try:
    for i in range(300):
        with open('big-%d' % i, 'wb') as fh:
            fh.write(b'x' * 2**20)
        n += 1
except OSError:
    pass
def f(x):
    return n
"""
INODES = """
import time
n, end = 0, time.time() + 2.0
try:
    while time.time() < end:
        open('e%d' % n, 'w').close()
        n += 1
except OSError:
    pass
def f(x):
    return n
"""


class HostDisk:
    """Peak bytes (allocated: ``st_blocks``) and files under a host directory, sampled every
    50 ms while it runs (``with HostDisk(root) as disk:``, or ``stop()``)."""

    def __init__(self, root: str) -> None:
        self.root, self.peak_bytes, self.peak_files = root, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            size = files = 0
            for d, _, names in os.walk(self.root):
                for n in names:
                    try:
                        size += os.lstat(os.path.join(d, n)).st_blocks * 512
                        files += 1
                    except OSError:
                        pass
            self.peak_bytes = max(self.peak_bytes, size)
            self.peak_files = max(self.peak_files, files)
            self._stop.wait(0.05)

    def stop(self) -> int:
        """Stop sampling; returns the peak bytes."""
        self._stop.set()
        self._t.join(timeout=10)
        return self.peak_bytes

    def __enter__(self) -> HostDisk:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


async def disk_fill(c, tag, go, ctx):
    disk = HostDisk(ctx["scratch_root"])
    # the attack's tests pass only if it wrote past the default quota (16 MiB, 4096 files)
    payloads = {"fill": {"code": FILL, "tests": ["assert f(0) > 16"]},
                "inodes": {"code": INODES, "tests": ["assert f(0) > 4096"]}}  # fmt: skip
    _, got = await _batch(c, f"disk-{tag}", payloads, go)
    host = disk.stop()
    best = max(r["reward"] for r in got.values())
    ok = best <= 0.0 and host < 2**20 and all(r["status"] == "ok" for r in got.values())
    wrote = {k: re.search(r"f\(0\) = (\d+)", r["detail"]) for k, r in got.items()}
    wrote = {k: int(m.group(1)) if m else None for k, m in wrote.items()}
    note = (f"wrote {wrote['fill']} files of 1 MiB (of 300) and {wrote['inodes']} empty "
            f"files; host scratch peak {host} B")  # fmt: skip
    return ok, best, note


# ---- item 5: values too large to print ---------------------------------------------------------
BIG = "def f(x):\n    return x * x if x == 2 else 16**20000\n"


async def huge_value(c, tag, go, ctx):
    payloads = {"big": {"code": BIG, "tests": TESTS}}
    _, got = await _batch(c, f"big-{tag}", payloads, go)
    r = got["big"]
    ok = r["status"] == "ok" and r["reward"] == 0.5 and "int of 80001 bits" in r["detail"]
    return ok, r["reward"], f"16**20000: {r['status']}, reward {r['reward']:g} (1 of 2 tests)"


# ---- item 6: task names squatted before the other tenant uses them ----------------------------
async def squat(c, tag, go, ctx):
    name = ctx["victim_task"]
    await c.register(name, "code")  # before the other tenant registers it
    b = await c.announce(name, 1, batch="shadow")
    go.set()
    await c.submit(name, b, {"code": "def f(x):\n    return 0\n", "tests": TESTS}, id="0")
    mine = await c.results(name, b, timeout_s=120)
    batches = (await c.metrics())["tasks"][name]["batches"]
    ok = [r["id"] for r in mine] == ["0"] and batches == 1
    return ok, max(r["reward"] for r in mine), f"squatted {name!r}: own task, 1 batch seen"


ATTACKS = {
    "lone surrogates": lone_surrogates,
    "bad numbers": bad_numbers,
    "queued memory": queued_memory,
    "disk fill": disk_fill,
    "huge value": huge_value,
    "task-name squatting": squat,
}
