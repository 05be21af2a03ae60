"""Request-in, batch-out for real (DistRS sections 3.2 and 5.2): the reward worker streams a
step's responses to a live reward service as the rollout produces them, in one batch announced
with the step's size, and rides out a service restart in the middle of that batch.

Real pieces throughout: a live service on loopback, the tiny GRPO rollout and the
RewardWorker in Ray, pipelined (rollout on device 0, reward on device 1, chunks of 2 prompts).
The test paces the rollout by putting a chunk's prompts at a time, so it knows when each
chunk's responses finished."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from m2flow.reward_service.app import BackgroundServer
from m2flow.reward_service.client import RewardClient
from m2flow.reward_service.pipelines import math_extract, math_verify
from m2flow.workers.llm import build_char_tokenizer
from m2flow.workers.llm.tokenizer import decode_responses
from m2flow.workers.reward.worker import RewardWorker
from m2flow.workers.rollout.config import RolloutOptions
from m2flow.workers.rollout.worker import RolloutWorker
from m2flow.workers.tasks import TaskDataset
from prompts import task_prompts
from test_reward_service import TOKENS, _config
from test_workflow import ALPHABET, TASK, TINY_MODEL, TOKENIZER

from m2flow import Channel
from m2flow.core.placement import Placement

pytestmark = pytest.mark.e2e

VIRTUAL_DEVICES = 2
PROMPTS, SAMPLES, PER_CHUNK = 12, 4, 2  # 6 chunks of 8 responses; the step has 48
CHUNKS, CHUNK, STEP = PROMPTS // PER_CHUNK, PER_CHUNK * SAMPLES, PROMPTS * SAMPLES
# Another tenant's requests ahead of chunk 2 in the restart test: enough that chunk 2 is still
# queued when the service goes down (3,000 were all scored first once, on a quiet machine).
FLOOD = 20_000


def _wait(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < end, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.005)
    return value


def _reference(texts: list[str], answers: list[str]) -> list[float]:
    """The math pipeline's own stages, run here in process (penalty 0.0, as configured)."""
    out = []
    for t, a in zip(texts, answers):
        payload = {"response": t, "answer": a}
        ex = math_extract(payload, {}, {})
        out.append(math_verify(payload, ex["carry"], {})["reward"] if ex["ok"] else 0.0)
    return out


def _check_rewards(scored: list[dict]) -> None:
    tok = build_char_tokenizer(ALPHABET)
    for c in scored:
        b = c.batch
        texts = decode_responses(tok, b["response_ids"], b["response_mask"])
        answers = [e["ground_truth"] for e in c.row_entries()]
        assert b["rewards"].tolist() == _reference(texts, answers)


@pytest.fixture(scope="module")
def rig(cluster):
    """The rollout (device 0) and the reward (device 1, through the service on one port); the
    test restarts the service on that port as it needs (``rig.serve()``)."""
    rig = SimpleNamespace(server=None)

    def serve() -> BackgroundServer:
        port = rig.server.config.port if rig.server else 0
        stop()
        rig.server = BackgroundServer(_config().model_copy(update={"port": port}))
        rig.url = rig.server.__enter__()
        return rig.server

    def stop() -> None:
        if rig.server is not None and rig.server.thread.is_alive():
            rig.server.__exit__(None, None, None)

    rig.serve, rig.stop = serve, stop
    serve()
    service = {"url": rig.url, "token": TOKENS["alice"], "task": "stream", "pipeline": "math",
               "timeout_s": 60.0}  # fmt: skip
    cluster.placement = Placement(default_granularity=PER_CHUNK)  # read at every call
    try:
        rig.rollout = RolloutWorker.launch(
            cluster, [0], name="s_rollout", model=TINY_MODEL, tokenizer=TOKENIZER,
            options=RolloutOptions(n_samples=SAMPLES, max_new_tokens=4, temperature=1.0,
                                   threads=1),
        )  # fmt: skip
        rig.reward = RewardWorker.launch(
            cluster, [1], name="s_reward", tokenizer=TOKENIZER, service=service
        )
        yield rig
        rig.rollout.shutdown()
        rig.reward.shutdown()
    finally:
        cluster.placement = None
        stop()


def _start_step(rig, name: str, step: int):
    """Start one step: the rollout waits for prompts, the reward streams its chunks. Returns
    the prompts, a function that puts the next chunk's prompts, and the calls."""
    prompts, rollouts, scored = (Channel.create(f"{name}_{n}") for n in ("p", "r", "s"))
    train = TaskDataset(TASK["name"], TASK["config"], seed=1, size=32)
    items = task_prompts(train, build_char_tokenizer(ALPHABET), PROMPTS, seed=0, step=step)
    gen = rig.rollout.generate(prompts, rollouts, PROMPTS)
    rew = rig.reward.score(rollouts, scored)
    put_at: list[float] = []

    def next_chunk() -> None:
        k = len(put_at)
        prompts.put_many(items[k * PER_CHUNK : (k + 1) * PER_CHUNK])
        put_at.append(time.monotonic())

    return next_chunk, put_at, gen, rew, scored


def _the_batch(server: BackgroundServer):
    """The step's batch at ``server`` (``None`` until the reward worker announced it)."""
    task = server.service.tasks.get(("alice", "stream"))
    return next(iter(task.batches.values()), None) if task else None


def test_requests_arrive_as_the_rollout_streams_and_scaling_follows(rig):
    """Request-in, batch-out by order, not by a clock: the test puts a chunk's prompts only
    once the previous chunk's requests have reached the service and been scored, so a reward
    worker that held responses until the rollout's end, or a service that scored only whole
    batches, would time out here."""
    srv = rig.server
    next_chunk, put_at, gen, rew, out = _start_step(rig, "s1", step=7)
    for k in range(CHUNKS):
        next_chunk()
        b = _wait(lambda: _the_batch(srv), 60, "the step's batch")
        _wait(lambda: b.submitted == (k + 1) * CHUNK, 60, f"chunk {k}'s requests")  # noqa: B023
        _wait(lambda: len(b.results) >= (k + 1) * CHUNK, 60, f"chunk {k}'s rewards")  # noqa: B023
    gen.wait(60)
    (stats,) = rew.wait(60)
    scored = [out.get(timeout=30) for _ in range(CHUNKS)]
    rig.stop()
    service = srv.service
    decisions = [d for d in service.decisions if d["pipeline"] == "math"]

    assert stats["samples"] == STEP
    _check_rewards(scored)
    # One batch for the step, announced with the step's size when its first chunk came.
    (b,) = service.tasks[("alice", "stream")].batches.values()
    assert b.size == STEP and b.done and len(b.results) == STEP
    assert put_at[0] < b.start < put_at[1]
    # Each chunk's requests arrived after its prompts were put and before the next chunk's
    # (one clock: the service runs in this process).
    arrivals = sorted(b.start + r.offset_s for r in b.records)
    for k in range(CHUNKS):
        got = arrivals[k * CHUNK : (k + 1) * CHUNK]
        assert put_at[k] < got[0] and (k + 1 == CHUNKS or got[-1] < put_at[k + 1]), (k, got)
    # The service scaled on the hint before the second chunk's requests came, kept its
    # workers through the step (one batch: no scale-down, no cold start between chunks), and
    # scaled down once the batch was out.
    t0 = service.t0
    assert [d["why"] for d in decisions] == ["announce", "complete"], decisions
    assert min(decisions[0]["workers"]) >= 1 and t0 + decisions[0]["t_s"] < arrivals[CHUNK]
    done_at = [b.start + r.offset_s + res["latency_s"] for r, res in zip(b.records, b.results)]
    assert decisions[1]["workers"] == [0, 0] and t0 + decisions[1]["t_s"] >= max(done_at) - 0.01
    for pool in service.pools["math"]:
        during = [n for t, n in pool.timeline if b.start - t0 <= t < decisions[1]["t_s"]]
        assert during and min(during) >= 1, pool.timeline
    print(
        f"rollout {put_at[-1] - put_at[0]:.2f} s, first reward {min(done_at) - b.start:.2f} s "
        f"after the announcement, decisions "
        f"{[(d['why'], d['workers'], round(t0 + d['t_s'] - b.start, 2)) for d in decisions]}"
    )


def test_a_service_restart_mid_batch_loses_no_request_and_scores_each_once(rig):
    first = rig.serve()  # a fresh instance: the task has no history there
    next_chunk, _, gen, rew, out = _start_step(rig, "s2", step=8)
    next_chunk()  # chunk 1: scored by the first instance
    task = _wait(lambda: first.service.tasks.get(("alice", "stream")), 30, "the task")
    b1 = _wait(lambda: next(iter(task.batches.values()), None), 30, "the batch")
    _wait(lambda: len(b1.results) == CHUNK, 30, "chunk 1's rewards")
    time.sleep(0.3)  # the reward worker's long poll hands them over at once (asserted below)
    # Another tenant floods the math pool, so chunk 2 waits behind it (FCFS between batches
    # without history) and is in flight when the service goes down.
    with RewardClient(rig.url, TOKENS["bob"]) as bob:
        bob.register("flood", "math")
        f = bob.announce("flood", FLOOD)
        bob.submit_many("flood", f, {str(i): {"response": "1", "answer": "1"}
                                     for i in range(FLOOD)})  # fmt: skip
    next_chunk()
    _wait(lambda: b1.submitted == 2 * CHUNK, 30, "chunk 2's requests")
    in_flight = set(b1.live)
    second = rig.serve()  # stops the first (gracefully: in-flight requests are lost)
    # What the first instance scored before it went down (a request of chunk 2 may still have
    # slipped through the flood), and what it left unscored.
    scored_first = {r["id"] for r in b1.results}
    in_flight -= scored_first
    for _ in range(CHUNKS - 2):
        next_chunk()
        time.sleep(0.1)
    gen.wait(60)
    (stats,) = rew.wait(90)
    scored = [out.get(timeout=30) for _ in range(CHUNKS)]
    (b2,) = second.service.tasks[("alice", "stream")].batches.values()
    metrics = second.service.metrics()

    assert stats["samples"] == STEP
    _check_rewards(scored)
    assert in_flight, "the flood let every request of chunk 2 through: nothing was lost"
    # The second instance holds the same batch, re-announced with the results the reward
    # worker read from the first one (kept as ``settled`` results: they count toward the size
    # and are not sent again), and every other request once: the lost ones resubmitted, the
    # later chunks as they came. Only a result the first instance produced but nobody read
    # before it went down may be scored again (none, unless the machine is very slow: the
    # worker's long poll hands results over at once).
    settled = b2.settled
    ids2 = [r["id"] for r in b2.results if r["status"] != "settled"]
    assert b2.id == b1.id and b2.size == STEP and b2.done and len(b2.results) == STEP
    assert settled and settled <= scored_first, (settled, scored_first)
    assert {r["id"] for r in b2.results if r["status"] == "settled"} == settled
    assert len(ids2) == len(set(ids2)) == STEP - len(settled)
    assert in_flight <= set(ids2) and settled.isdisjoint(ids2)
    ids1 = [r["id"] for r in b1.results]
    assert len(ids1) == len(set(ids1)) and set(ids1) & set(ids2) == scored_first - settled
    assert metrics["requests_done"] == STEP - len(settled)
    assert metrics["instance"] != first.service.instance
    print(
        f"restart: {len(settled)} results carried over, {len(in_flight)} in flight "
        f"resubmitted, {len(scored_first - settled)} scored again, "
        f"{len(ids2)} scored by the second instance"
    )
