"""The spot pool's rollout manager driven directly (RLBoost section 4.1 Algorithm 1, section
4.2.1 Algorithm 2; docs/results/spot.md): the real :class:`RolloutManager` with its background
loops, in this process's event loop, the test playing the reserved rank, the spot instances
(register, lease, report, as :mod:`~m2flow.workers.rollout.spot.instance` does) and the trainer.
No spot node is needed: the Ray session only answers the pool loop's node listing.

Each test checks what Algorithm 1 or 2 does with the numbers the manager measures itself, not
the policy fed by hand: the scheduler memory firing, rebalanced requests reaching the idle
instance, the trainer's idle time, and a plan's values as Algorithm 1's starting point.
"""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from m2flow.workers.rollout.exact import GenRequest
from m2flow.workers.rollout.spot.manager import RolloutManager
from test_spot_plan import POOL, _doc, _plan

pytestmark = pytest.mark.e2e
VIRTUAL_DEVICES = 1


def manager(**cfg) -> RolloutManager:
    return RolloutManager({"enabled": True, **cfg}, n_reserved=1, instance_args={})


def requests(step: int, prompts: int, samples: int = 1) -> list[GenRequest]:
    return [GenRequest(f"{step}:{p}:{j}", [1, 2], (step, p, j), 8, owner=0)
            for p in range(prompts) for j in range(samples)]  # fmt: skip


def advance(leased: list[GenRequest], tokens: int, done: bool) -> list[GenRequest]:
    """What an instance reports after a block: copies (as over Ray) with ``tokens`` more."""
    out = []
    for r in leased:
        r = copy.deepcopy(r)
        r.tokens += [3] * tokens
        r.logprobs += [-0.5] * tokens
        r.done = done
        out.append(r)
    return out


async def finish(m: RolloutManager, iid: str, n: int) -> list[str]:
    """Instance ``iid`` leases up to ``n`` requests and finishes them in one block."""
    leased = await m.lease(iid, m.version, n)
    await m.report(iid, advance(leased, 2, True), 0.01, len(leased), 2 * len(leased))
    return [r.id for r in leased]


async def three_spot_instances_take_a_step(m: RolloutManager) -> None:
    """Spot instances ``s0..s2`` on version 0; step 1's 3 requests, seeded with ``T_seed`` 0
    (the reserved rank registers and leaves at once), handed out by the dispatch loop."""
    await m.stage(0, [])
    for k in range(3):
        await m.register(f"s{k}", "spot")
    await m.submit(1, 0, requests(1, 3))
    await m.register("reserved:0")
    await m.leave("reserved:0")
    await asyncio.sleep(0.05)  # the dispatch loop hands out the queue


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_scheduler_memory_fires_when_the_instance_count_held_all_step(cluster):
    """Algorithm 1 lines 11-12: three instances held for a whole step give ``n_bar`` exactly 3
    (the integral runs to the step's end, not to the pool loop's last 0.5 s tick), so
    ``M[3]`` is written."""

    async def scenario():
        m = manager(t_seed_init=0.0)
        try:
            await three_spot_instances_take_a_step(m)
            for k in range(3):
                await finish(m, f"s{k}", 8)
            await asyncio.sleep(1.3)  # past two pool-loop ticks, off their phase
            assert len(await m.collect(0, 3, 5.0)) == 3
            await m.stage(1, [])  # the step ends: Algorithm 1 runs
            return m.history[-1], dict(m.policy.memory)
        finally:
            await m.shutdown()

    rec, memory = run(scenario())
    assert rec["n_hat"] == 3 and rec["n_bar"] == pytest.approx(3, abs=1e-6), rec
    assert 3 in memory, (rec, memory)


def test_rebalancing_moves_executing_requests_to_the_idle_instance(cluster):
    """Algorithm 2 lines 22-27: with every queue empty, the busiest instance's executing
    requests beyond the plateau B go to the idle instance (``MIGRATEREQS(j -> i, r)``), all of
    them, with their tokens; none back to the busy one or to the global queue."""

    async def scenario():
        m = manager(theta=64, max_batch=64, t_seed_init=0.0)
        try:
            await m.stage(0, [])
            await m.register("a", "spot")
            # step 1: an online profile P whose throughput plateaus at batch 4
            await m.submit(1, 0, [])
            for b in (1, 2, 4, 8, 16):
                for _ in range(3):
                    await m.report("a", [], 1.0, b, 100 * min(b, 4))
            await m.submit(2, 0, requests(2, 16))  # closes step 1: B from P
            assert m.plateau == 4
            await m.register("reserved:0")
            await m.leave("reserved:0")
            await asyncio.sleep(0.05)
            leased = await m.lease("a", m.version, 64)
            assert len(leased) == 16
            await m.register("b", "spot")  # an idle instance joins
            deadline = time.monotonic() + 5
            while len(m.instances["a"].revoke) < 12 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            drop = await m.report("a", advance(leased, 2, False), 0.01, 16, 32)
            got = await m.lease("b", m.version, 64)  # b takes what was moved to it
            a, b = m.instances["a"], m.instances["b"]
            return drop, [r.id for r in got], {*a.pending, *a.executing}, list(m.queue), got
        finally:
            await m.shutdown()

    drop, got_b, on_a, queue, got = run(scenario())
    assert len(drop) == 12, drop  # r = m_exec - B = 16 - 4
    assert sorted(got_b) == sorted(drop), (got_b, drop)
    assert not set(drop) & on_a and not queue
    assert all(len(r.tokens) == 2 for r in got)  # continued from their tokens


def test_trainer_idle_time_is_the_trainers_wait_not_the_rollout_ranks(cluster):
    """Algorithm 1 line 7, ``t_train^wait``: the trainer's wait for micro-batches. The rollout
    rank's collect wait is not it: on the same devices the trainer trains meanwhile. Here the
    trainer trains the first group for ~1 s while the rank waits for the second; the trainer's
    waits during the seeding window (the devices roll out then) do not count either."""

    async def scenario():
        m = manager(t_seed_init=0.3)
        try:
            await m.stage(0, [])
            await m.register("s", "spot")
            await m.submit(1, 0, requests(1, 2))
            handed: asyncio.Queue = asyncio.Queue()  # the rollout channel, rank -> trainer
            waits: list[list[float]] = []

            async def trainer():
                for _ in range(2):
                    t0 = time.time()
                    await handed.get()
                    waits.append([t0, time.time()])
                    await asyncio.sleep(1.0)  # trains the micro-batch
                waits.append([time.time(), time.time()])  # the end of the step

            async def instance():
                await asyncio.sleep(0.4)
                await finish(m, "s", 1)  # group 0
                await asyncio.sleep(1.1)  # group 1 takes longer
                await finish(m, "s", 1)

            tasks = [asyncio.ensure_future(trainer()), asyncio.ensure_future(instance())]
            await m.register("reserved:0")
            await asyncio.sleep(0.3)  # the seeding window
            seed_end = time.time()
            await m.leave("reserved:0")
            rank_wait = 0.0
            for _ in range(2):  # the rank collects and hands each group over
                t0 = time.monotonic()
                await handed.put(await m.collect(0, 1, 5.0))
                rank_wait += time.monotonic() - t0
            await asyncio.gather(*tasks)
            await m.trainer_waits([waits])
            await m.stage(1, [])
            return m.history[-1], waits, seed_end, rank_wait
        finally:
            await m.shutdown()

    rec, waits, seed_end, rank_wait = run(scenario())
    idle = sum(max(0.0, b - max(a, seed_end)) for a, b in waits)
    assert waits[0][0] < seed_end  # it waited through the seeding window too
    assert rec["t_train_wait"] == pytest.approx(idle, abs=0.02), (rec, waits)
    assert rec["t_train_wait"] < rank_wait / 2, (rec["t_train_wait"], rank_wait)


def test_a_plans_values_start_algorithm_1_which_keeps_adapting(cluster):
    """``plan=auto`` picks where rollout runs and a ``T_seed`` / ``N_prem``; the manager starts
    Algorithm 1 there (not at ``T_init`` / ``N_resv``) and adapts both after each step, in the
    plan's ``spot`` mode too (no seeding switch-off, no cap at the plan's ``N_prem``)."""
    doc = _doc({**POOL, "instance_items_per_s": 1.0, "expected_instances": 8, "weight_sync_s": 0},
               rollout_s=200.0, actor_s=20.0)  # fmt: skip
    doc["prices"] = {"reserved": 10.47, "spot": 0.01}
    _, placement, sp = _plan(doc, objective="time")
    assert sp.best.mode == "spot", sp.best
    opts = placement.options["rollout"]["options"]["spot"]

    async def scenario():
        m = RolloutManager(opts, n_reserved=1, instance_args={})
        start = (m.policy.t_seed, m.policy.n_prem)
        # the plan's values, not T_init = 1 s and line 3's N_resv = 1
        assert start == (0.0, sp.best.n_prem) and sp.best.n_prem > 1, (start, sp.best)
        try:
            await m.stage(0, [])
            await m.register("s", "spot")
            await m.submit(1, 0, requests(1, 2))
            await m.register("reserved:0")
            await m.leave("reserved:0")
            await asyncio.sleep(0.05)
            t0 = time.time()
            await finish(m, "s", 2)
            await m.collect(0, 2, 5.0)
            await asyncio.sleep(0.3)
            await m.trainer_waits([[[t0, t0 + 0.2]]])  # it waited 0.2 s for responses
            await m.stage(1, [])
            return start, (m.policy.t_seed, m.policy.n_prem), m.history[-1]
        finally:
            await m.shutdown()

    start, after, rec = run(scenario())
    # line 9 with t_remote_wait ~0.3: T_seed stays at 0 or grows, but line 10 sets N_prem
    assert after[1] != sp.best.n_prem and after[1] >= 1, (start, after, rec)
    assert rec["t_train_wait"] == pytest.approx(0.2, abs=0.02)


def test_the_trainers_waits_reach_algorithm_1_as_a_run_event(cluster):
    """``t_train^wait`` from the run event the actor publishes at the end of its update
    (``m2flow.core.events.TRAINER_WAITS``; no runner call): the manager reads it when the weights
    end the step. A value published before the pool opened the bus belongs to no step of it."""
    from m2flow.core import events

    async def scenario():
        events.open_bus()
        stale = {"group": "actor", "rank": 0, "waits": [[time.time() - 9.0, time.time()]]}
        assert events.publish(events.TRAINER_WAITS, stale)  # before this pool's start
        m = manager(t_seed_init=0.0)
        try:
            await m.stage(0, [])
            await m.register("s", "spot")
            await m.submit(1, 0, requests(1, 2))
            await m.register("reserved:0")
            await m.leave("reserved:0")
            await asyncio.sleep(0.05)
            t0 = time.time()
            await finish(m, "s", 2)
            await m.collect(0, 2, 5.0)
            await asyncio.sleep(0.3)  # (a wait is counted up to the step's end)
            wait = {"group": "actor", "rank": 0, "waits": [[t0, t0 + 0.2]]}
            assert events.publish(events.TRAINER_WAITS, wait)  # what ActorWorker.train does
            await m.stage(1, [])
            return m.history[-1]
        finally:
            await m.shutdown()

    rec = run(scenario())
    assert rec["t_train_wait"] == pytest.approx(0.2, abs=0.02), rec


def test_a_pause_holds_spot_instances_and_their_requests_keep_tokens_and_versions(cluster):
    """The pool paused (``SpotPoolEngine.pause``): a spot instance gets no lease, and its
    executing requests come back at its next report with their tokens, logprobs and per-token
    versions; after new weights and the resume they continue from there, on the new version."""

    def block(leased, version: int) -> list[GenRequest]:
        out = advance(leased, 2, False)
        for r in out:
            r.versions += [version] * 2
            r.weight_version = version
        return out

    async def scenario():
        m = manager(theta=64, max_batch=64, t_seed_init=0.0, rebalance=False)
        try:
            await m.stage(0, [])
            await m.register("a", "spot")
            await m.submit(1, 0, requests(1, 4))
            await m.register("reserved:0")
            await m.leave("reserved:0")
            leased = []
            while len(leased) < 4:  # lease waits for the dispatch loop's hand-out
                leased += await m.lease("a", 0, 64 - len(leased))
            await m.pause()
            held = await m.lease("a", 0, 64)
            drop = await m.report("a", block(leased, 0), 0.01, 4, 8)
            queued = set(m.queue)
            await m.stage(1, [])  # new weights while paused (the step is not over)
            await m.resume()
            got = []
            while len(got) < 4:  # the instance pulled version 1
                got += await m.lease("a", 1, 64 - len(got))
            return {r.id for r in leased}, held, set(drop), queued, got, m.stats
        finally:
            await m.shutdown()

    ids, held, drop, queued, got, stats = run(scenario())
    assert held == [] and drop == ids and ids <= queued
    assert {r.id for r in got} == ids
    assert all(r.tokens == [3, 3] and r.versions == [0, 0] for r in got)
    assert stats["migrated_samples"] == 0  # a pause is not a migration
