"""Bounded resources of the reward service: the memory
its queued requests hold (per tenant and in total; 429 while full, 413 for a request that can
never fit) and the disk a sandbox may fill (a size- and file-count-limited /scratch)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from m2flow.reward_service.app import BackgroundServer
from m2flow.reward_service.client import RewardClient
from test_reward_service_hardening import SQUARE, TESTS, TOKENS, _config, namespaces

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from reward_service_attack_input import FILL, INODES, HostDisk  # noqa: E402

PER_TENANT = 2 * 2**20
TOTAL = 3 * 2**20
PAD = 900_000  # characters of padding per request: two fit under PER_TENANT, three do not
SCRATCH_BYTES = 16 * 2**20  # the service's default quota of a sandbox's /scratch
SCRATCH_FILES = 4096  # and its default number of files there


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = _config(
        str(tmp_path_factory.mktemp("reward-quota")),
        max_body_bytes=4 * 2**20,
        max_queued_bytes=TOTAL,
        max_queued_bytes_per_tenant=PER_TENANT,
    )
    code = cfg.pipelines["code"].stages
    code["check"].max_workers = 1
    code["execute"].max_workers = 1
    srv = BackgroundServer(cfg)
    with srv:
        yield srv


def _post(url: str, who: str, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKENS[who]}", "content-type": "application/json"}
    return httpx.post(url + path, content=json.dumps(body), headers=headers, timeout=60)


def _queued(url: str, who: str) -> dict:
    with RewardClient(url, TOKENS[who]) as c:
        return c.metrics()["queued_bytes"]


SLEEP = "import time\ntime.sleep(3)\ndef f(x):\n    return x * x\n"


def test_queued_bytes_are_capped_per_tenant_and_in_total(server):
    url = server.url
    for who in ("mallory", "alice"):
        r = _post(url, who, "/v1/tasks", {"task": f"queue-{who}", "pipeline": "code"})
        assert r.status_code == 200, r.text
        r = _post(url, who, f"/v1/tasks/queue-{who}/batches", {"size": 8, "batch": "q"})
        assert r.status_code == 200, r.text

    def submit(who: str, body: dict) -> httpx.Response:
        return _post(url, who, f"/v1/tasks/queue-{who}/batches/q/requests", body)

    def pad(i: int) -> dict:
        return {"payload": {**SQUARE, "pad": "x" * PAD}, "id": f"pad-{i}"}

    # the sleeper holds the only execute worker, so what follows stays queued
    r = submit("mallory", {"payload": {"code": SLEEP, "tests": TESTS}, "id": "s"})
    assert r.status_code == 200, r.text
    assert submit("mallory", pad(0)).status_code == 200
    assert submit("mallory", pad(1)).status_code == 200
    r = submit("mallory", pad(2))  # mallory's own cap
    assert r.status_code == 429 and "max_queued_bytes_per_tenant" in r.json()["detail"], r.text
    assert r.headers.get("retry-after")
    assert submit("alice", pad(0)).status_code == 200  # alice is not mallory
    r = submit("alice", pad(1))  # the service's total cap
    assert r.status_code == 429 and "max_queued_bytes " in r.json()["detail"] + " ", r.text
    big = {"payload": {**SQUARE, "pad": "x" * (PER_TENANT + 1)}, "id": "big"}
    r = submit("alice", big)  # can never fit: 413, not 429
    assert r.status_code == 413 and "max_queued_bytes_per_tenant" in r.json()["detail"], r.text
    # a small request whose parsed form is far larger than its JSON is counted by memory
    tiny = {"payload": {**SQUARE, "pad": [{}] * 200_000}, "id": "amplified"}
    r = submit("alice", tiny)  # ~0.6 MB of JSON, ~14 MB as Python objects
    assert r.status_code == 413, r.text
    seen = _queued(url, "mallory")
    assert seen["tenant"] <= PER_TENANT and seen["total"] <= TOTAL, seen
    # the client waits for room (429 is retried): it gets in once the queue drains
    with RewardClient(url, TOKENS["mallory"], retry_s=60) as c:
        c.submit("queue-mallory", "q", pad(2)["payload"], id="pad-2")
        c.close_batch("queue-mallory", "q")
        got = {r["id"]: r["reward"] for r in c.results("queue-mallory", "q", timeout_s=60)}
    assert len(got) == 4 and got["pad-2"] == 1.0
    assert submit("alice", pad(1)).status_code == 200
    end = time.monotonic() + 60
    while _queued(url, "alice")["total"] and time.monotonic() < end:
        time.sleep(0.2)
    assert _queued(url, "alice") == {"tenant": 0, "total": 0}


# ---- item 4: a sandbox's disk (payloads and the host-side probe are the attack benchmark's)


@namespaces
def test_a_sandbox_cannot_fill_the_disk(server):
    scratch = server.service.scratch.path
    with RewardClient(server.url, TOKENS["mallory"]) as c, HostDisk(scratch) as disk:
        c.register("disk", "code")
        b = c.announce("disk", 2)
        fill = {"code": FILL, "tests": [f"assert f(0) <= {SCRATCH_BYTES >> 20}"]}
        c.submit("disk", b, fill, id="fill")
        inodes = {"code": INODES, "tests": [f"assert f(0) <= {SCRATCH_FILES}"]}
        c.submit("disk", b, inodes, id="inodes")
        got = {r["id"]: r for r in c.results("disk", b, timeout_s=60)}
    # within the quota: at most 16 files of 1 MiB, at most 4096 files; the host saw none of it
    assert got["fill"]["reward"] == 1.0, got["fill"]
    assert got["inodes"]["reward"] == 1.0, got["inodes"]
    assert disk.peak_bytes < 2**20, disk.peak_bytes


def test_without_namespaces_the_harness_counts_the_scratch_quota(tmp_path):
    """The fallback (no ``unshare``): no tmpfs, so the harness counts what the child wrote in
    its scratch directory every 10 ms and stops it past the quota."""
    import subprocess
    import sys

    from m2flow.reward_service import harness
    from m2flow.reward_service.verdict import plan

    fill = FILL.replace("range(300)", "range(3000)")
    spec = {
        "code": fill, "tests": [plan("assert f(0) <= 4").steps],
        "limits": {"cpu_s": 5, "memory_bytes": 512 * 2**20, "file_bytes": 2**20,
                   "open_files": 64, "output_bytes": 2**20},
        "uid": None, "value_bytes": 65536, "output_bytes": 2**20, "wall_s": 20,
        "patch_socket": True, "confine": None, "scratch": {"bytes": 4 * 2**20, "files": 100},
    }  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-I", "-S", harness.__file__], input=json.dumps(spec).encode(),
        cwd=tmp_path, capture_output=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    (test,) = json.loads(out)["tests"]
    assert test["quota"] and not test["out"], test  # stopped, no values: the test fails
    used = sum(f.stat().st_size for f in tmp_path.iterdir())
    assert used < 200 * 2**20, used  # 3000 MiB without it; the overshoot is the poll's
