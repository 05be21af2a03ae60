"""The reward service under hostile *input*: text that
cannot be encoded (lone surrogates) from the sandbox or the request, numbers JSON has not
(NaN, Infinity, 1e400), booleans for numbers, values too large to print, task names that
tenants share. Every answer must be a 2xx or a 4xx with a JSON body, never a 500; results must
stay readable; one tenant's names mean nothing to another. One live service for the module."""

from __future__ import annotations

import json

import httpx
import pytest
from m2flow.reward_service.app import BackgroundServer
from m2flow.reward_service.client import RewardClient, RewardServiceError
from test_reward_service_hardening import SQUARE, TESTS, TOKENS, _batch, _config


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = BackgroundServer(_config(str(tmp_path_factory.mktemp("reward-input"))))
    with srv:
        yield srv


@pytest.fixture(scope="module")
def alice(server):
    with RewardClient(server.url, TOKENS["alice"], timeout_s=60, retry_s=5) as c:
        yield c


@pytest.fixture(scope="module")
def mallory(server):
    with RewardClient(server.url, TOKENS["mallory"], timeout_s=60, retry_s=5) as c:
        yield c


def _readable(r: httpx.Response) -> object:
    """The body of a non-500 answer, parsed as strict UTF-8 JSON (no NaN/Infinity)."""
    assert r.status_code < 500, (r.status_code, r.text[:300])

    def no_constants(name):
        raise AssertionError(f"non-JSON number {name} in the answer")

    return json.loads(r.content.decode("utf-8"), parse_constant=no_constants)


# ---- item 1: lone surrogates ----------------------------------------------------------------
SURROGATE_AT_TOP = "raise ValueError('\\ud800')\n"  # the source is ASCII; the string is not
SURROGATE_IN_TEST = (
    "def f(x):\n    if x == 3:\n        raise ValueError('\\udfff' + chr(0xD800))\n"
    "    return x * x\n"
)
SURROGATE_TYPE = "def f(x):\n    return type('\\ud800', (), {})()\n"


def test_a_lone_surrogate_from_the_sandbox_leaves_the_results_readable(server, alice, mallory):
    payloads = {
        "top": {"code": SURROGATE_AT_TOP, "tests": TESTS},
        "test": {"code": SURROGATE_IN_TEST, "tests": TESTS},
        "type": {"code": SURROGATE_TYPE, "tests": TESTS},
    }
    b = _batch(mallory, "surrogates", "code", payloads)
    a = _batch(alice, "next-door", "code", {"square": SQUARE})
    got = {r["id"]: r for r in mallory.results("surrogates", b, timeout_s=60)}  # no 500
    assert got["top"]["reward"] == -1.0 and "\\ud800" in got["top"]["detail"], got["top"]
    assert got["test"]["reward"] == 0.5 and "\\udfff\\ud800" in got["test"]["detail"]
    assert got["type"]["reward"] == 0.0 and "\\ud800" in got["type"]["detail"]
    for r in got.values():
        r["detail"].encode("utf-8")  # plain text: every character encodable
    # every view of the batch reads: page, status, stream; and it does so again later
    http = mallory.http
    for _ in range(2):
        _readable(http.get(f"/v1/tasks/surrogates/batches/{b}/results"))
        assert _readable(http.get(f"/v1/tasks/surrogates/batches/{b}"))["complete"]
        lines = http.get(f"/v1/tasks/surrogates/batches/{b}/stream").content.decode("utf-8")
        assert len([json.loads(ln) for ln in lines.splitlines()]) == 3
    assert alice.rewards("next-door", a, timeout_s=60) == {"square": 1.0}


# ---- hostile strings and numbers at every endpoint ------------------------------------------
DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE_BODIES = {  # (method, path, raw body); "B" is a batch of task "hostile"
    "task surrogate": ("POST", "/v1/tasks", '{"task": "\\ud800", "pipeline": "code"}'),
    "pipeline surrogate": ("POST", "/v1/tasks", '{"task": "h2", "pipeline": "\\udc00"}'),
    "delay NaN": ("POST", "/v1/tasks", '{"task": "h3", "pipeline": "code", "delay_bound_s": NaN}'),
    "delay 1e400": (
        "POST", "/v1/tasks", '{"task": "h3", "pipeline": "code", "delay_bound_s": 1e400}'
    ),
    "invalid utf-8": ("POST", "/v1/tasks", b'{"task": "\xff\xfe", "pipeline": "code"}'),
    "size 1e400": ("POST", "/v1/tasks/hostile/batches", '{"size": 1e400}'),
    "size -1e400": ("POST", "/v1/tasks/hostile/batches", '{"size": -1e400}'),
    "size NaN": ("POST", "/v1/tasks/hostile/batches", '{"size": NaN}'),
    "size Infinity": ("POST", "/v1/tasks/hostile/batches", '{"size": Infinity}'),
    "size true": ("POST", "/v1/tasks/hostile/batches", '{"size": true}'),
    "size 5000 digits": ("POST", "/v1/tasks/hostile/batches", '{"size": 1' + "0" * 5000 + "}"),
    "size 4000 digits": ("POST", "/v1/tasks/hostile/batches", '{"size": 1' + "0" * 4000 + "}"),
    "batch surrogate": ("POST", "/v1/tasks/hostile/batches", '{"size": 1, "batch": "\\ud800"}'),
    "scored id surrogate": (
        "POST", "/v1/tasks/hostile/batches",
        '{"size": 2, "batch": "s1", "scored": [{"id": "\\ud800", "reward": 1}]}',
    ),
    "scored reward true": (
        "POST", "/v1/tasks/hostile/batches",
        '{"size": 2, "batch": "s2", "scored": [{"id": "a", "reward": true}]}',
    ),
    "id surrogate": (
        "POST", "/v1/tasks/hostile/batches/B/requests",
        '{"payload": {"code": "x = 1", "tests": ["assert 1"]}, "id": "\\ud800"}',
    ),
    "bulk id surrogate": (
        "POST", "/v1/tasks/hostile/batches/B/requests:bulk",
        '{"requests": [{"payload": {"code": "x", "tests": ["1"]}, "id": "ok\\udbff"}]}',
    ),
    "payload NaN": (
        "POST", "/v1/tasks/hostile/batches/B/requests",
        '{"payload": {"code": "x = 1", "tests": ["assert 1"], "extra": [1, NaN]}, "id": "n1"}',
    ),
    "payload -Infinity": (
        "POST", "/v1/tasks/hostile/batches/B/requests",
        '{"payload": {"code": "x = 1", "tests": ["assert 1"], "e": {"v": -Infinity}}, "id": "n2"}',
    ),
    "payload 1e400": (
        "POST", "/v1/tasks/hostile/batches/B/requests",
        '{"payload": {"code": "x = 1", "tests": ["assert 1"], "e": 1e400}, "id": "n3"}',
    ),
    "payload deep": (
        "POST", "/v1/tasks/hostile/batches/B/requests",
        '{"payload": {"code": "x", "tests": ["1"], "e": ' + DEEP + '}, "id": "n4"}',
    ),
    "payload 500 deep": (
        "POST", "/v1/tasks/hostile/batches/B/requests",
        '{"payload": {"code": "x", "tests": ["1"], "e": ' + DEEP[99_500:100_500] + '}, "id": "n5"}',
    ),
    "payload not an object": (
        "POST", "/v1/tasks/hostile/batches/B/requests", '{"payload": "\\ud800", "id": "n6"}'
    ),
    "limits surrogate key": (
        "POST", "/v1/tasks/hostile/batches/B/requests",
        '{"payload": {"code": "x", "tests": ["1"], "limits": {"\\ud800": 1}}, "id": "n7"}',
    ),
}  # fmt: skip
HOSTILE_QUERIES = {  # raw query strings ("B": a batch of task "hostile")
    "offset 1e400": "/v1/tasks/hostile/batches/B/results?offset=1e400",
    "offset surrogate": "/v1/tasks/hostile/batches/B/results?offset=%ED%B3%BF",
    "offset huge": "/v1/tasks/hostile/batches/B/results?offset=1" + "0" * 5000,
    "wait_s nan": "/v1/tasks/hostile/batches/B/results?wait_s=nan",
    "wait_s inf": "/v1/tasks/hostile/batches/B/results?wait_s=inf",
    "wait_s invalid utf-8": "/v1/tasks/hostile/batches/B/results?wait_s=%FF%FE",
    "stream timeout inf": "/v1/tasks/hostile/batches/B/stream?timeout_s=inf",
    "unknown batch surrogate": "/v1/tasks/hostile/batches/%ED%A0%80",
    "unknown task surrogate": "/v1/tasks/%ED%A0%80/batches/B/results",
}


@pytest.fixture(scope="module")
def hostile_batch(mallory):
    mallory.register("hostile", "code")
    return mallory.announce("hostile", 4, batch="hb")


@pytest.mark.parametrize("case", sorted(HOSTILE_BODIES))
def test_hostile_bodies_get_4xx_never_500(server, mallory, hostile_batch, case):
    method, path, raw = HOSTILE_BODIES[case]
    headers = {"Authorization": f"Bearer {TOKENS['mallory']}", "content-type": "application/json"}
    body = raw if isinstance(raw, bytes) else raw.encode()
    before = mallory.status("hostile", hostile_batch)["submitted"]
    r = httpx.request(
        method, server.url + path.replace("/B/", f"/{hostile_batch}/"), content=body,
        headers=headers, timeout=30,
    )  # fmt: skip
    detail = _readable(r)["detail"]
    assert 400 <= r.status_code < 500, (case, r.status_code, detail)
    if case == "payload 500 deep":  # deep, yet parsed by JSON: refused by name
        assert "deep" in str(detail), detail
    if case.startswith("payload") and "deep" not in case and "object" not in case:
        assert r.status_code == 422 and "NaN or Infinity" in str(detail), detail
    assert mallory.status("hostile", hostile_batch)["submitted"] == before
    assert httpx.get(f"{server.url}/healthz", timeout=10).json() == {"ok": True}


@pytest.mark.parametrize("case", sorted(HOSTILE_QUERIES))
def test_hostile_queries_get_4xx_never_500(server, hostile_batch, case):
    url = server.url + HOSTILE_QUERIES[case].replace("/B", f"/{hostile_batch}")
    headers = {"Authorization": f"Bearer {TOKENS['mallory']}"}
    r = httpx.get(httpx.URL(url), headers=headers, timeout=30)
    _readable(r)
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text[:300])


def test_a_hostile_token_gets_401(server):
    for token in (b"Bearer \xff\xfe", b"Bearer " + b"x" * 8000, b"\xc3\x28"):
        r = httpx.post(
            f"{server.url}/v1/tasks", json={"task": "t", "pipeline": "code"},
            headers={"Authorization": token}, timeout=10,
        )  # fmt: skip
        assert r.status_code in (401, 431), r.status_code
        _readable(r)


def test_bad_numbers_are_refused_by_name(mallory, hostile_batch):
    for raw in ('{"size": true}', '{"size": 1e400}', '{"size": 2.0}'):
        r = mallory.http.post(
            "/v1/tasks/hostile/batches", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 422 and "body.size" in _readable(r)["detail"], r.text
    with pytest.raises(RewardServiceError) as e:
        mallory.announce("hostile", 10**400)  # too large to print as an int in a message?
    assert e.value.status == 422 and "max_batch_size" in str(e.value)


# ---- item 5: values too large to print ------------------------------------------------------
BIG = "def f(x):\n    return x * x if x == 2 else 16**20000\n"
BIG_IN_LIST = "def f(x):\n    return [16**20000, x] if x == 3 else x * x\n"
BIG_TESTS = ["assert f(2) == 4", "assert f(3) == 9", "assert f(3) == 16**20000"]


def test_values_too_large_to_print_do_not_change_the_verdict(mallory):
    b = _batch(
        mallory, "bigint", "code",
        {"big": {"code": BIG, "tests": BIG_TESTS}, "list": {"code": BIG_IN_LIST, "tests": TESTS}},
    )  # fmt: skip
    got = {r["id"]: r for r in mallory.results("bigint", b, timeout_s=60)}
    # f(2) == 4 passes, f(3) == 9 fails (its value shown without printing 24,000 digits),
    # f(3) == 16**20000 passes (both sides come from the sandbox: unsealed)
    assert got["big"]["status"] == "ok" and got["big"]["reward"] == pytest.approx(2 / 3)
    assert "int of 80001 bits" in got["big"]["detail"], got["big"]["detail"]
    assert got["list"]["status"] == "ok" and got["list"]["reward"] == 0.5, got["list"]


# ---- item 6: task names are per tenant -------------------------------------------------------
def test_task_names_are_per_tenant(server, alice, mallory):
    mallory.register("shared-name", "code")  # squats first: alice must not notice
    mb = mallory.announce("shared-name", 1, batch="same-batch")
    alice.register("shared-name", "code")  # 409 before
    ab = alice.announce("shared-name", 1, batch="same-batch")
    alice.submit("shared-name", ab, SQUARE, id="0")
    mallory.submit("shared-name", mb, {"code": "def f(x):\n    return 4\n", "tests": TESTS}, id="0")
    assert alice.rewards("shared-name", ab, timeout_s=60) == {"0": 1.0}
    assert mallory.rewards("shared-name", mb, timeout_s=60) == {"0": 0.5}
    assert alice.metrics()["tasks"]["shared-name"]["batches"] == 1
    assert mallory.metrics()["tasks"]["shared-name"]["batches"] == 1
    # an unknown name is the same 404 whether another tenant uses it or not
    with pytest.raises(RewardServiceError) as used:
        alice.status("mallory-only", "x")
    mallory.register("mallory-only", "code")
    with pytest.raises(RewardServiceError) as unused:
        alice.status("mallory-only", "x")
    assert used.value.status == unused.value.status == 404
    assert str(used.value) == str(unused.value)
    operator = server.service.metrics()["tasks"]  # in-process view: every tenant's tasks
    assert {"alice/shared-name", "mallory/shared-name"} <= set(operator)
