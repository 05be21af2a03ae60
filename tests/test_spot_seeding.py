"""The rollout manager's seeding and Algorithm 1 inputs (RLBoost section 4.1, Algorithm 1;
section 4.2.1, Algorithm 2's plateau; m2flow issue 34): the real :class:`RolloutManager` with
its background loops in this process's event loop, the test playing the reserved ranks and the
spot instances as tests/test_spot_manager.py does, plus the pure policies they use.

- a seeding reserved rank holds at most its share of the step's requests, so spot instances
  that become current during seeding still get fresh requests, though ``max_batch x N_resv``
  covers the batch; with no spot instance (or none ready when the window ends) the reserved
  ranks take everything (colocated fallback);
- ``t_remote`` counts the busy time of an instance preempted during the step;
- the plateau ``B`` changes within a step as the running requests' context grows;
- ``N_prem`` never exceeds the step's request count;
- the no-seeding ablation keeps line 10 (``N_prem`` moves, ``T_seed`` stays 0).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from m2flow.scheduler.spot import (
    SeedingPolicy,
    StepStats,
    ThroughputProfile,
    rebalance,
    seeding_share,
)
from m2flow.workers.rollout.spot.manager import RolloutManager
from test_spot_manager import advance, manager, requests, run, three_spot_instances_take_a_step

VIRTUAL_DEVICES = 1
e2e = pytest.mark.e2e


async def seed_blocks(m: RolloutManager, iid: str, held: list, blocks: int, max_batch: int):
    """A reserved rank's seeding loop (``pool.seed``) for ``blocks`` blocks: lease up to
    ``max_batch - held``, report two tokens on everything held. Returns what it holds."""
    for _ in range(blocks):
        held = held + await m.lease(iid, m.version, max_batch - len(held))
        if held:
            drop = await m.report(iid, advance(held, 2, False), 0.0, len(held), 2 * len(held))
            held = [r for r in advance(held, 2, False) if r.id not in drop]
        await asyncio.sleep(0.02)  # the dispatch loop hands out the queue meanwhile
    return held


async def lease_all(m: RolloutManager, iid: str, tries: int = 5) -> list:
    """What instance ``iid`` leases in ``tries`` leases (on the current weights)."""
    got = []
    for _ in range(tries):
        got += await m.lease(iid, m.version, 64)
        await asyncio.sleep(0.02)
    return got


# -- 1. the seeding share ------------------------------------------------------------------------


@e2e
@pytest.mark.parametrize("share", ["fair", "all"])
def test_spot_instances_current_during_seeding_get_fresh_requests(cluster, share):
    """Two reserved ranks with ``max_batch`` 64 each and 16 requests (``max_batch x N_resv >=
    batch``), two spot instances pulling the weights at the step's start. With the share rule
    (``ceil(16 / (2 + 2))`` = 4 per rank) the ranks seed 8 and the instances, current during
    the 600 s window, get the other 8 fresh (no tokens). The old rule (``seed_share="all"``)
    leaves them nothing."""

    async def scenario():
        m = RolloutManager(
            {"enabled": True, "max_batch": 64, "theta": 8, "t_seed_init": 600.0,
             "n_prem_init": 2, "rebalance": False, "seed_share": share},
            n_reserved=2, instance_args={},
        )  # fmt: skip
        try:
            for k in range(2):
                await m.register(f"s{k}", "spot")  # before the weights: still pulling them
            await m.stage(0, [])
            await m.submit(1, 0, requests(1, 8))
            await m.submit(1, 1, [replace(r, id="b" + r.id, owner=1) for r in requests(1, 8)])
            held = {}
            for k in range(2):
                await m.register(f"reserved:{k}")
            for k in range(2):
                held[k] = await seed_blocks(m, f"reserved:{k}", [], 8, 64)
            queued = len(m.queue)
            spot = [[], []]
            for _ in range(5):  # both pull the weights and lease: now current
                for k in range(2):
                    spot[k] += await m.lease(f"s{k}", m.version, 64)
                await asyncio.sleep(0.02)
            held = {k: await seed_blocks(m, f"reserved:{k}", held[k], 2, 64) for k in range(2)}
            return held, queued, spot, dict(m.stats)
        finally:
            await m.shutdown()

    held, queued, spot, stats = run(scenario())
    got = [r for s in spot for r in s]
    if share == "fair":
        assert [len(h) for h in held.values()] == [4, 4], held
        assert queued == 8
        assert len(got) == 8 and all(len(s) == 4 for s in spot), spot
        assert all(r.tokens == [] for r in got), got  # fresh, not seeds
        assert all(len(r.tokens) > 0 for h in held.values() for r in h)  # the seeds
    else:  # the ablation: the reserved ranks took the whole batch at the step's start
        assert sum(len(h) for h in held.values()) == 16 and queued == 0 and got == []
    assert stats["spot_tokens"] == 0


@e2e
def test_no_spot_instance_the_reserved_rank_takes_the_whole_queue(cluster):
    """No spot instance held or starting (no free node): the share is the whole queue, the
    reserved rank finishes the rollout (colocated fallback, RLBoost 4.1: no stall)."""

    async def scenario():
        m = manager(max_batch=64, t_seed_init=30.0, rebalance=False)
        try:
            await m.stage(0, [])
            await m.submit(1, 0, requests(1, 16))
            await m.register("reserved:0")
            return await seed_blocks(m, "reserved:0", [], 8, 64), len(m.queue)
        finally:
            await m.shutdown()

    held, queued = run(scenario())
    assert len(held) == 16 and queued == 0


@e2e
@pytest.mark.parametrize("rejoin", [False, True])
def test_window_over_with_no_ready_instance_the_share_grows_to_the_whole_queue(cluster, rejoin):
    """A spot instance held but never current: the reserved rank holds its share
    (``ceil(16 / 2)``) during its window, and takes the rest once the window is over with no
    instance ready (colocated fallback), also when it left and came back for the fallback
    (``pool.seed(0.0)``: no second window)."""

    async def scenario():
        m = manager(max_batch=64, t_seed_init=600.0, rebalance=False)
        try:
            await m.register("s", "spot")  # never pulls the weights
            await m.stage(0, [])
            await m.submit(1, 0, requests(1, 16))
            await m.register("reserved:0")
            held = await seed_blocks(m, "reserved:0", [], 5, 64)
            during = len(held)
            # the window ends: the step's T_seed as if it had passed (no race with the clock)
            m.cur.t_seed = 0.0
            m._changed()
            if rejoin:  # it handed its seeds back, then the fallback registers it again
                await m.leave("reserved:0")
                await m.register("reserved:0")
                held = []
            held = await seed_blocks(m, "reserved:0", held, 5, 64)
            return during, len(held), len(m.queue)
        finally:
            await m.shutdown()

    during, after, queued = run(scenario())
    assert during == 8 and after == 16 and queued == 0


def test_seeding_share_rule():
    """``ceil(requests / (N_resv + expected))``; ``None`` (no bound) when no instance is
    expected, or the window is over and none is ready."""
    assert seeding_share(16, 1, 1, ready=0, window_over=False) == 8
    assert seeding_share(1024, 4, 12, ready=3, window_over=False) == 64
    assert seeding_share(17, 2, 2, ready=2, window_over=True) == 5  # window over, ready: share
    assert seeding_share(16, 1, 0, ready=0, window_over=False) is None  # none expected
    assert seeding_share(16, 1, 3, ready=0, window_over=True) is None  # none ready in time
    with pytest.raises(ValueError, match="counts"):
        seeding_share(-1, 1, 1, ready=0, window_over=False)


def test_rebalance_respects_room():
    """A reserved rank at its share (room 0) is no destination; an executing move is cut to
    the destination's room."""
    assert rebalance({"a": 3, "r": 0}, {"a": 4, "r": 4}, None, {"r": 0}) == []
    assert rebalance({"a": 3, "r": 0}, {"a": 4, "r": 4}, None, {"r": 1})[0].dst == "r"
    (move,) = rebalance({"a": 0, "r": 0}, {"a": 20, "r": 0}, 4, {"r": 5})
    assert (move.src, move.dst, move.count, move.executing) == ("a", "r", 5, True)
    (move,) = rebalance({"a": 0, "r": 0}, {"a": 20, "r": 0}, 4, {"r": None})
    assert move.count == 16


# -- 2. t_remote with a preempted instance -----------------------------------------------------


@e2e
def test_t_remote_counts_a_preempted_instances_busy_time(cluster):
    """Three instances each busy 1 s; one is preempted during the step (``_gone(inst, True,
    ...)``, as the lifecycle does). ``t_remote * n_bar`` is the pool's 3 busy instance-seconds
    (2 before: the preempted instance's second was forgotten)."""

    async def scenario():
        m = manager(t_seed_init=0.0, rebalance=False)
        try:
            await three_spot_instances_take_a_step(m)
            leased = {}
            for k in range(3):
                leased[k] = await m.lease(f"s{k}", 0, 1)
                await m.report(f"s{k}", advance(leased[k], 2, False), 1.0, 1, 2)
            m._gone(m.instances["s2"], True, "s2: node preempted (test)")
            await asyncio.sleep(0.05)
            for k in range(2):  # finish: no more busy time
                await m.report(f"s{k}", advance(advance(leased[k], 2, False), 2, True), 0.0, 1, 2)
            got = await m.lease("s0", 0, 1)  # the migrated request, with its tokens
            await m.report("s0", advance(got, 2, True), 0.0, 1, 2)
            assert len(await m.collect(0, 3, 5.0)) == 3
            await m.stage(1, [])
            return m.history[-1], got
        finally:
            await m.shutdown()

    rec, got = run(scenario())
    assert rec["preemptions"] == 1 and len(got) == 1 and len(got[0].tokens) == 2
    assert rec["remote_busy_s"] == pytest.approx(3.0)
    assert rec["t_remote"] * rec["n_bar"] == pytest.approx(3.0, rel=1e-9), rec


# -- 3. the plateau as the context grows -------------------------------------------------------

ALPHA, BETA, GAMMA = 0.01, 1e-3, 1e-6  # decode iteration: tau(b, L) = a + b*b + g*b*L seconds
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)


def tau(b: int, ctx: float) -> float:
    return ALPHA + BETA * b + GAMMA * b * ctx


def true_plateau(ctx: float) -> int:
    tput = {b: b / tau(b, ctx) for b in BATCHES}
    return min(b for b, t in tput.items() if t >= 0.9 * max(tput.values()))


@e2e
def test_plateau_changes_within_a_step_as_the_context_grows(cluster):
    """Step 1 profiles decode at several batch sizes and contexts; in step 2 the plateau ``B``
    follows the running requests' context: the true plateau at a 2-token context, then at
    ~8000 tokens once the instance has reported them (RLBoost paper:251, "continuously
    calibrated to account for the current average context length")."""
    assert true_plateau(2) == 64 and true_plateau(8002) == 16  # the scenario's premise

    async def scenario():
        m = manager(theta=64, max_batch=64, t_seed_init=0.0)
        try:
            await m.stage(0, [])
            await m.register("a", "spot")
            await m.submit(1, 0, [])
            for b in BATCHES:
                for ctx in (100.0, 2000.0, 8000.0):
                    await m.report("a", [], 20 * tau(b, ctx), b, 20 * b, context=ctx)
            await m.submit(2, 0, requests(2, 4))  # closes step 1: P from it
            at_end = m.plateau
            await m.register("reserved:0")
            await m.leave("reserved:0")
            await asyncio.sleep(0.05)
            leased = await lease_all(m, "a", 2)
            # an instance reports its running requests' mean length with every block (as
            # SpotInstance.run does); these two make no profile record (0 busy seconds)
            await m.report("a", advance(leased, 0, False), 0.0, 4, 0, context=2.0)
            await asyncio.sleep(0.25)  # rebalance ticks at the 2-token context
            short = m.plateau
            await m.report("a", advance(leased, 8000, False), 0.0, 4, 0, context=8002.0)
            await asyncio.sleep(0.25)
            return at_end, short, m.plateau, len(leased)
        finally:
            await m.shutdown()

    at_end, short, long, n = run(scenario())
    assert n == 4
    assert (short, long) == (64, 16), (at_end, short, long)


def test_profile_plateau_follows_the_context():
    """The pure profile: ``plateau(context_len=L)`` is the true plateau of ``tau`` at ``L``."""
    p = ThroughputProfile()
    for b in BATCHES:
        for ctx in (100.0, 2000.0, 8000.0):
            p.record(b, 20 * b, 20 * tau(b, ctx), context_len=ctx)
    for ctx in (2.0, 1000.0, 4000.0, 8002.0, 16000.0):
        assert p.plateau(context_len=ctx) == true_plateau(ctx), ctx


# -- 4. N_prem capped at the step's requests; 5. no-seeding keeps line 10 ----------------------


async def busy_step(m: RolloutManager, n: int, busy_s: float, train_s: float) -> dict:
    """A step of ``n`` requests on one spot instance busy ``busy_s`` seconds, then ``train_s``
    seconds of training before the next weights. Returns the step's record."""
    await m.stage(0, [])
    await m.register("s", "spot")
    await m.submit(1, 0, requests(1, n))
    await m.register("reserved:0")
    await m.leave("reserved:0")
    await asyncio.sleep(0.05)
    leased = await lease_all(m, "s", 3)
    await m.report("s", advance(leased, 2, True), busy_s, len(leased), 2 * len(leased))
    assert len(await m.collect(0, n, 5.0)) == n
    await asyncio.sleep(train_s)
    await m.stage(1, [])
    return m.history[-1]


@e2e
def test_n_prem_never_exceeds_the_steps_request_count(cluster):
    """Line 10 with 5,000 busy instance-seconds over ~0.1 s of training (under 50 s on any
    machine) asks for over a hundred instances; a step of 4 requests caps ``N_prem`` at 4."""

    async def scenario():
        m = manager(t_seed_init=0.0, rebalance=False)
        try:
            rec = await busy_step(m, 4, 5000.0, 0.1)
            return rec, m.policy.n_prem, m.policy.n_prem_raw
        finally:
            await m.shutdown()

    rec, n_prem, raw = run(scenario())
    assert raw > 100 and n_prem == 4 and rec["requests"] == 4, (rec, n_prem, raw)


def test_n_prem_cap_in_the_policy():
    s = StepStats(n_bar=1.0, n_hat=1, t_train_wait=0.0, t_remote_wait=0.0, t_train=1.0,
                  t_remote=140.0)  # fmt: skip
    p = SeedingPolicy(n_resv=1, eta=1.0, t_init=0.0, n_prem_min=1)
    assert p.update(s)[1] == 140
    assert p.update(s, n_requests=16)[1] == 16
    assert p.update(s, n_requests=0)[1] == 1  # n_prem_min wins
    with pytest.raises(ValueError, match="n_requests"):
        p.update(s, n_requests=-1)


@e2e
def test_no_seeding_ablation_keeps_line_10(cluster):
    """``seeding=False``: ``T_seed`` stays 0, and line 10 (with no local work) still sets
    ``N_prem`` from the step, as the simulator's ablation does."""

    async def scenario():
        m = manager(t_seed_init=1.0, seeding=False, rebalance=False, n_prem_init=1)
        try:
            assert m.policy.t_seed == 0.0
            rec = await busy_step(m, 8, 150.0, 0.5)  # line 10 > 1 below 75 s
            return rec, m.policy.t_seed, m.policy.n_prem
        finally:
            await m.shutdown()

    rec, t_seed, n_prem = run(scenario())
    line10 = math.ceil(rec["t_remote"] * rec["n_bar"] / rec["t_train"] - 1e-9)
    assert t_seed == 0.0 and rec["t_seed"] == 0.0
    assert n_prem == max(1, min(line10, 8)) and n_prem > 1, (rec, n_prem)


def test_no_seeding_in_the_policy():
    s = StepStats(n_bar=2.0, n_hat=2, t_train_wait=5.0, t_remote_wait=0.0, t_train=1.0,
                  t_remote=1.2)  # fmt: skip
    p = SeedingPolicy(n_resv=4, eta=1.0, t_init=0.0)
    assert p.update(s, seeding=False) == (0.0, 3)  # ceil(1.2 * 2 / 1), no T_seed * N_resv
    assert p.memory == {}
