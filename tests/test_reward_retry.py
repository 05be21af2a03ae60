"""Idempotent submission and retries across restarts of the reward service, without Ray: a
request id is scored once per batch (a retry is a no-op, another payload under the same id is
refused), ids live inside a tenant's own task (another tenant can neither read nor overwrite
them), results scored by an earlier instance carry over a restart (``scored``), and the
clients ride out a restart (the plain client's retries, :class:`RewardStream`'s recovery)."""

from __future__ import annotations

import inspect
import threading
import time

import httpx
import pytest
from m2flow.reward_service.app import INSTANCE_HEADER, BackgroundServer
from m2flow.reward_service.client import (
    AsyncRewardClient,
    Call,
    RewardClient,
    RewardServiceError,
    _Spec,
)
from m2flow.reward_service.stream import RewardStream
from test_reward_service import TOKENS, _config

RIGHT = {"response": "\\boxed{4}", "answer": "4"}
WRONG = {"response": "\\boxed{3}", "answer": "4"}


def _status(e) -> int:
    return e.value.status


@pytest.fixture
def server():
    with BackgroundServer(_config()) as srv_url:
        yield srv_url


def _restartable():
    """A service whose ``restart()`` stops it and starts another instance on the same port."""
    box = {"srv": BackgroundServer(_config())}
    box["srv"].__enter__()

    def restart(down_s: float = 0.0) -> BackgroundServer:
        port = box["srv"].config.port
        box["srv"].__exit__(None, None, None)
        time.sleep(down_s)
        box["srv"] = BackgroundServer(_config().model_copy(update={"port": port}))
        box["srv"].__enter__()
        return box["srv"]

    return box, restart


def test_both_clients_share_one_spec_and_only_ids_make_a_submission_repeatable():
    """The sans-I/O spec drives both clients: the same methods and signatures (awaitable in the
    async one); the calls a method needs, and how it reads their answers, without a server."""
    names = [n for n, f in vars(_Spec).items() if inspect.isfunction(f)]
    assert "submit" in names and "rewards" in names
    for name in names:
        sync, aio = getattr(RewardClient, name), getattr(AsyncRewardClient, name)
        assert inspect.signature(sync) == inspect.signature(aio), name
        assert inspect.iscoroutinefunction(aio) and not inspect.iscoroutinefunction(sync), name
    path = "/v1/tasks/t/batches/b/requests"
    call = next(_Spec.submit(None, "t", "b", RIGHT))
    assert call == Call("POST", path, idempotent=False, kw={"json": {"payload": RIGHT, "id": None}})
    assert next(_Spec.submit(None, "t", "b", RIGHT, id="x")).idempotent
    # rewards: long-polls pages from the offset reached until the batch is complete
    op = _Spec.rewards(None, "t", "b", timeout_s=60.0)
    first = next(op)
    assert first.path == "/v1/tasks/t/batches/b/results" and first.kw["params"]["offset"] == 0
    page = {"results": [{"id": "x", "reward": 1.0}], "complete": False}
    assert op.send((page, "inst")).kw["params"]["offset"] == 1
    with pytest.raises(StopIteration) as done:
        op.send(({"results": [{"id": "y", "reward": 0.0}], "complete": True}, "inst"))
    assert done.value.value == {"x": 1.0, "y": 0.0}


def test_a_retried_request_is_scored_once_and_ids_stay_in_the_tenants_task(server):
    with RewardClient(server, TOKENS["alice"]) as alice, RewardClient(server, TOKENS["bob"]) as bob:
        alice.register("idem", "math")
        assert alice.announce("idem", 3, batch="b1") == "b1"
        assert alice.announce("idem", 3, batch="b1") == "b1"  # a retried announcement
        with pytest.raises(RewardServiceError) as e:
            alice.announce("idem", 4, batch="b1")
        assert _status(e) == 409 and "size 3" in str(e.value)
        assert alice.submit("idem", "b1", RIGHT, id="x") == "x"
        assert alice.submit("idem", "b1", RIGHT, id="x") == "x"  # a retry: no-op
        assert alice.submit_many("idem", "b1", {"x": RIGHT, "y": WRONG}) == ["x", "y"]
        with pytest.raises(RewardServiceError) as e:  # the same id, another payload
            alice.submit("idem", "b1", WRONG, id="x")
        assert _status(e) == 409 and "another payload" in str(e.value)
        st = alice.status("idem", "b1")
        assert st["submitted"] == 2 and st["size"] == 3 and not st["complete"]
        # Another tenant can neither see, read nor write alice's batch, even by its ids.
        for call in (
            lambda: bob.submit("idem", "b1", WRONG, id="x"),
            lambda: bob.results("idem", "b1", timeout_s=5),
            lambda: bob.announce("idem", 3, batch="b1", scored={"x": 0.0}),
            lambda: bob.status("idem", "b1"),
        ):
            with pytest.raises(RewardServiceError) as e:
                call()
            assert _status(e) == 404
        # The same task name, batch and ids in bob's own task are bob's own requests.
        bob.register("idem-bob", "math")
        bob.announce("idem-bob", 1, batch="b1")
        bob.submit("idem-bob", "b1", WRONG, id="x")
        assert bob.rewards("idem-bob", "b1", timeout_s=60) == {"x": 0.0}
        alice.submit("idem", "b1", RIGHT, id="z")
        res = alice.results("idem", "b1", timeout_s=60)
        assert sorted(r["id"] for r in res) == ["x", "y", "z"]
        assert {r["id"]: r["reward"] for r in res} == {"x": 1.0, "y": 0.0, "z": 1.0}
        # After completion a retry is still a no-op, and a new id finds the batch full.
        assert alice.submit("idem", "b1", RIGHT, id="x") == "x"
        with pytest.raises(RewardServiceError) as e:
            alice.submit("idem", "b1", RIGHT, id="w")
        assert _status(e) == 409 and "already holds" in str(e.value)
        assert len(alice.results("idem", "b1", timeout_s=5)) == 3
        done = alice.metrics()["tasks"]
        assert set(done) == {"idem"}  # bob's task is not in alice's view


def test_results_scored_before_a_restart_carry_over_and_are_clamped(server):
    with RewardClient(server, TOKENS["alice"]) as alice:
        alice.register("carry", "math")
        scored = {"a": 1.0, "z": 7.5}  # 7.5: out of the math range, clamped to 1.0
        alice.announce("carry", 4, batch="b", scored=scored)
        alice.announce("carry", 4, batch="b", scored={"a": 1.0})  # repeated: no-op
        assert alice.submit("carry", "b", RIGHT, id="a") == "a"  # settled: not scored again
        alice.submit_many("carry", "b", {"c": RIGHT, "d": WRONG})
        res = {r["id"]: r for r in alice.results("carry", "b", timeout_s=60)}
        assert {i: r["reward"] for i, r in res.items()} == {"a": 1.0, "z": 1.0, "c": 1.0, "d": 0.0}
        assert res["a"]["status"] == res["z"]["status"] == "settled"
        st = alice.status("carry", "b")
        assert st["complete"] and st["settled"] == 2 and st["submitted"] == 2
        assert st["failed"] == 0
        with pytest.raises(RewardServiceError) as e:  # more scored than the size
            alice.announce("carry", 2, batch="b2", scored={"p": 0, "q": 0, "r": 0})
        assert _status(e) == 422
        r = httpx.post(
            f"{server}/v1/tasks/carry/batches",
            content=b'{"size": 2, "batch": "b3", "scored": [{"id": "p", "reward": NaN}]}',
            headers={"Authorization": f"Bearer {TOKENS['alice']}"},
        )
        assert r.status_code == 422 and r.headers[INSTANCE_HEADER]


def test_the_client_retries_while_the_service_restarts():
    box, restart = _restartable()
    try:
        url = box["srv"].url
        with RewardClient(url, TOKENS["alice"], retry_s=20) as alice:
            _, first = alice.call("POST", "/v1/tasks", json={"task": "r", "pipeline": "math"})
            t = threading.Thread(target=restart, args=(1.5,))
            t0 = time.monotonic()
            box["srv"].__exit__(None, None, None)  # down now; restart() finds it stopped
            t.start()
            _, second = alice.call("POST", "/v1/tasks", json={"task": "r", "pipeline": "math"})
            waited = time.monotonic() - t0
            t.join(30)
            assert second != first and second == box["srv"].service.instance
            assert waited >= 1.4, waited  # it retried through the downtime
            # With its retries spent, the error names the service as unreachable (503).
            box["srv"].__exit__(None, None, None)
            with RewardClient(url, TOKENS["alice"], retry_s=0.5) as short:
                with pytest.raises(RewardServiceError) as e:
                    short.register("r", "math")
                assert _status(e) == 503 and "unreachable" in str(e.value)
    finally:
        box["srv"].__exit__(None, None, None)


def test_a_stream_rides_out_restarts_and_each_request_is_scored_once():
    box, restart = _restartable()
    stream = None
    try:
        first = box["srv"]
        stream = RewardStream(first.url, TOKENS["alice"], "st", "math", timeout_s=60)
        got = stream.submit("B", 6, {"a": RIGHT, "b": WRONG}).result(60)
        assert got == {"a": 1.0, "b": 0.0}
        b1 = first.service.tasks[("alice", "st")].batches["B"]
        assert b1.size == 6 and not b1.done and b1.submitted == 2
        second = restart()
        got = stream.submit("B", 6, {"c": RIGHT}).result(60)
        assert got == {"c": 1.0} and stream.restarts == 1
        b2 = second.service.tasks[("alice", "st")].batches["B"]
        assert b2.settled == {"a", "b"} and list(b2.digests) == ["c"]
        # Down while a submission waits: it retries until the next instance is up.
        box["srv"].__exit__(None, None, None)
        fut = stream.submit("B", 6, {"d": WRONG, "e": RIGHT, "f": RIGHT})
        time.sleep(1.0)
        assert not fut.done()
        third = restart()
        assert fut.result(60) == {"d": 0.0, "e": 1.0, "f": 1.0}
        b3 = third.service.tasks[("alice", "st")].batches["B"]
        assert b3.done and b3.settled == {"a", "b", "c"}
        assert sorted(b3.digests) == ["d", "e", "f"]  # each scored once, here
        assert third.service.requests_done == 3 and stream.restarts == 2
        # A resubmission of a scored id returns its reward without scoring it again.
        assert stream.submit("B", 6, {"e": RIGHT}).result(30) == {"e": 1.0}
        assert third.service.requests_done == 3
        with pytest.raises(ValueError, match="size 6"):
            stream.submit("B", 7, {"g": RIGHT}).result(30)
        # A batch that will not get all its announced requests (a failed step) is closed, so
        # it does not stay active on the service.
        assert stream.submit("C", 5, {"x": RIGHT}).result(30) == {"x": 1.0}
        c = third.service.tasks[("alice", "st")].batches["C"]
        assert not c.done and third.service._active("math") == [c]
        st = stream.close_batch("C").result(30)
        assert st["complete"] and st["size"] == 1 and c.done
        assert third.service._active("math") == []
    finally:
        if stream is not None:
            stream.close()
        box["srv"].__exit__(None, None, None)


def test_results_nobody_read_survive_a_restart_through_the_journal(tmp_path):
    """With ``state_dir``, what an instance scored but no client read before it went down is
    journaled: the next instance answers the resubmission from the journal (each request is
    scored once over both), refuses another payload under a journaled id, and a second
    service on the same ``state_dir`` is refused."""
    cfg = _config().model_copy(update={"state_dir": str(tmp_path / "state")})
    payloads = {"r0": RIGHT, "r1": WRONG, "r2": RIGHT, "r3": WRONG}
    first = BackgroundServer(cfg)
    url = first.__enter__()
    try:
        with RewardClient(url, TOKENS["alice"]) as alice:
            alice.register("j", "math")
            alice.announce("j", 4, batch="b")
            alice.submit_many("j", "b", {k: payloads[k] for k in ("r0", "r1")})
            b1 = first.service.tasks[("alice", "j")].batches["b"]
            deadline = time.monotonic() + 30
            while len(b1.results) < 2:  # scored on the service; the client reads nothing
                assert time.monotonic() < deadline, "the first instance did not score r0, r1"
                time.sleep(0.05)
            scored_first = {r["id"]: r["reward"] for r in b1.results}
    finally:
        first.__exit__(None, None, None)
    second = BackgroundServer(cfg.model_copy(update={"port": first.config.port}))
    url = second.__enter__()
    try:
        with RewardClient(url, TOKENS["alice"]) as alice:
            alice.register("j", "math")
            alice.announce("j", 4, batch="b")  # no rewards seen: the client read none
            alice.submit_many("j", "b", payloads)  # all four again, as a client would
            res = {r["id"]: r["reward"] for r in alice.results("j", "b", timeout_s=60)}
            assert res == {"r0": 1.0, "r1": 0.0, "r2": 1.0, "r3": 0.0}
            assert {k: res[k] for k in scored_first} == scored_first
            assert second.service.requests_done == 2  # r2, r3 only: r0, r1 not scored again
            with pytest.raises(RewardServiceError) as e:
                alice.submit("j", "b", RIGHT, id="r1")  # r1 was scored with WRONG
            assert _status(e) == 409
            # Another tenant cannot reach alice's journaled batch.
            with RewardClient(url, TOKENS["bob"]) as bob:
                with pytest.raises(RewardServiceError) as e:
                    bob.results("j", "b", timeout_s=5)
                assert _status(e) == 404
        with pytest.raises(RuntimeError, match="another reward service uses state_dir"):
            BackgroundServer(cfg.model_copy(update={"port": 0})).__enter__()
    finally:
        second.__exit__(None, None, None)
