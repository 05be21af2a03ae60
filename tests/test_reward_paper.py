"""DistRS as the paper defines it: one hand-checkable case per rule of section 5,
the baselines of section 6.1 and the workload of sections 3 and 6.1.

Paper: /work/shared/papers/004_202a8381d4119568.txt (DistRS, NSDI '26).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from m2flow.scheduler.reward.baselines import ZeroQueuePolicy, ideal_policy
from m2flow.scheduler.reward.replay import TenantTrace, replay, replay_dedicated
from m2flow.scheduler.reward.scaling import (
    BatchView,
    DistRSPolicy,
    estimate_jobs,
    search_workers,
)
from m2flow.scheduler.reward.sim import RequestRecord, SimJob, Workload, simulate
from m2flow.scheduler.reward.workload import COSTS, TIMEOUTS_S, cuda_batch, cuda_tenants

R = RequestRecord


# ---- Algorithm 1 (section 5.1) ---------------------------------------------------------------
def test_stages_are_searched_by_worker_cost_descending():
    # A = (4 s, 2 s) arrives at 0 s, B = (1 s, 2 s) at 2 s; T = 6, D = 1.5: end < 7.5.
    # GPU (stage 1, C = 10) first, the CPUs at B = 2: CPU ends A at 4, B at 3; one GPU runs
    # B 3-5, A 5-7: feasible. Then one CPU: A 0-4, B 4-5; GPU A 4-6, B 6-8: two CPUs.
    # [2, 1] costs 2 + 10 = 12. CPU first (the old order: 5 s of work against 4 s) takes one
    # CPU (GPUs A 4-6, B 5-7), then one GPU ends at 8: [1, 2], cost 21.
    jobs = [SimJob("b", 0.0, 0, (4.0, 2.0)), SimJob("b", 2.0, 0, (1.0, 2.0))]
    bounds = {"b": (6.0, 1.5)}
    gpu_first = search_workers(jobs, bounds, [100.0, 100.0], None, False, costs=[1, 10])
    assert gpu_first.workers == [2, 1] and gpu_first.cost == 12 and gpu_first.feasible
    cpu_first = search_workers(jobs, bounds, [100.0, 100.0], None, False, costs=[10, 1])
    assert cpu_first.workers == [1, 2] and cpu_first.cost == 12


def test_stages_not_searched_yet_sit_at_n_high_b():
    # A = (2.5 s, 2 s) and B = (1 s, 1 s) arrive at 2 s; T = 6.5, D = 0.8: end < 7.3. CPU first
    # (C = 10), the GPUs at B = 2: one CPU (A 2-4.5, B 4.5-5.5; GPUs A 4.5-6.5, B 5.5-6.5) is
    # feasible; then one GPU ends B at 7.5: [1, 2]. The old search held the GPUs at their
    # zero-queue peak (1: B 3-4, A 4.5-6.5 do not overlap), so one CPU failed: [2, 1], cost 21.
    jobs = [SimJob("b", 2.0, 0, (2.5, 2.0)), SimJob("b", 2.0, 0, (1.0, 1.0))]
    dec = search_workers(jobs, {"b": (6.5, 0.8)}, [100.0, 100.0], None, False, costs=[10, 1])
    assert dec.workers == [1, 2] and dec.cost == 12


def test_the_delay_must_stay_strictly_below_d():
    # two 1 s requests at 0 s: T = 1. With D = 1, one worker ends at 2 = T + D: d = D is not
    # "below D", so it takes two (d <= D took one)
    jobs = [SimJob("b", 0.0, 0, (1.0,)), SimJob("b", 0.0, 0, (1.0,))]
    assert search_workers(jobs, {"b": (1.0, 1.0)}, [10.0], None, False).workers == [2]
    assert search_workers(jobs, {"b": (1.0, 1.01)}, [10.0], None, False).workers == [1]


def test_every_stage_keeps_n_low_one_worker_while_a_batch_is_active():
    # the request stops at stage 0; stage 1's search still starts at N_low = 1 (it gave 0)
    jobs = [SimJob("b", 0.0, 0, (1.0,))]
    assert search_workers(jobs, {"b": (1.0, 1.0)}, [5.0, 5.0], None).workers == [1, 1]
    assert search_workers([], {}, [5.0, 5.0], None).workers == [0, 0]  # nothing active


def test_a_late_batch_is_held_to_its_zero_queue_completion():
    # Batch "late" should have ended by T + D = 10 but its request only comes at 50 (ends at 51
    # at best): d < D fails at every count, so Algorithm 1 as written ends at N = B = 5. Held to
    # its zero-queue completion it needs one worker, as does batch "ok" (T = 81, D = 5).
    jobs = [SimJob("late", 50.0, 0, (1.0,))] + [
        SimJob("ok", 50.0 + 10 * i, 0, (1.0,)) for i in range(4)
    ]
    prio = {"late": 5.0, "ok": 81.0}
    as_written = Workload(jobs, [10.0], prio, 50.0, {"late": 9.999, "ok": 85.999})
    assert not as_written.feasible([5])
    dec = search_workers(
        jobs, {"late": (5.0, 5.0), "ok": (81.0, 5.0)}, [10.0], prio, True, None, 50.0
    )
    assert dec.workers == [1] and dec.feasible


def test_galloping_finds_the_smaller_count_when_feasibility_is_not_monotone():
    # EBF, batch a before b. a1 = (1 s, 3 s) and a2 = (1 s, 1 s) arrive at 1 s, b1 = (3 s, 1 s)
    # at 0 s. a: T = 5, D = 2.5 (end < 7.5); b: T = 4, D = 0.5 (end < 4.5). GPUs first: 2.
    # CPUs, with 2 GPUs:
    #   1: b1 0-3, a1 3-4, a2 4-5; GPUs b1 3-4, a1 4-7, a2 5-6 -> a 7, b 4: feasible
    #   2: b1 0-3, a1 1-2, a2 2-3; GPUs a1 2-5, a2 3-4 (EBF: before b1), b1 4-5 -> b 5: not
    #   3: b1 0-3, a1 1-2, a2 1-2; GPUs a1 2-5, a2 2-3, b1 3-4 -> feasible
    # The binary search on [1, 3] probes 2, fails, ends at 3; galloping probes 1 first.
    jobs = [
        SimJob("a", 1.0, 0, (1.0, 3.0)),
        SimJob("a", 1.0, 0, (1.0, 1.0)),
        SimJob("b", 0.0, 0, (3.0, 1.0)),
    ]
    args = (jobs, {"a": (5.0, 2.5), "b": (4.0, 0.5)}, [100.0, 100.0], {"a": 0.0, "b": 1.0}, False)
    wl = Workload(jobs, [100.0, 100.0], {"a": 0.0, "b": 1.0}, 0.0, {"a": 7.4, "b": 4.4})
    assert [wl.feasible([c, 2]) for c in (1, 2, 3)] == [True, False, True]
    binary = search_workers(*args, costs=[1, 10], search="binary")
    gallop = search_workers(*args, costs=[1, 10], search="gallop")
    assert binary.workers == [3, 2] and gallop.workers == [1, 2] and gallop.feasible
    with pytest.raises(ValueError, match="search"):
        search_workers(*args, search="linear")


def test_a_stage_of_zero_seconds_needs_no_worker():
    # the paper records a skipped stage as 0 s: it must not wait for the busy worker
    jobs = [SimJob("b", 0.0, 0, (5.0,)), SimJob("b", 1.0, 0, (0.0,))]
    assert simulate(jobs, [1], [10.0]).finish_s == [5.0, 1.0]


@pytest.mark.parametrize("seed", range(20))
def test_cached_probes_agree_with_the_full_simulation(seed):
    rng = random.Random(seed)
    m, now = rng.choice([1, 2, 3]), rng.choice([0.0, 5.0])
    jobs = []
    for _ in range(rng.randint(1, 40)):
        first = rng.randrange(m)
        times = tuple(
            rng.choice([0.0, 0.5, 1.0, 2.5, 4.0]) for _ in range(rng.randint(1, m - first))
        )
        run = rng.random() < 0.15
        jobs.append(
            SimJob(rng.randrange(3), now if run else now + rng.uniform(0, 20), first, times, run)
        )
    timeouts = [rng.uniform(1, 10) for _ in range(m)]
    prio = {b: rng.uniform(0, 10) for b in range(3)} if seed % 2 else None
    lim = {b: rng.uniform(10, 40) for b in range(3)}
    lt = {b: lim[b] + rng.uniform(0, 10) for b in range(3)}
    wl = Workload(jobs, timeouts, prio, now, lim, lt)
    for _ in range(25):  # one workload, many probes: the caches must not leak between them
        counts = [rng.randint(1, 6) for _ in range(m)]
        res = simulate(jobs, counts, timeouts, prio, now)
        keys = {j.batch for j in jobs}
        ok = all(res.completion_s[b] <= lim[b] and res.latest_s[b] <= lt[b] for b in keys)
        assert wl.feasible(counts) == ok, counts


# ---- Algorithm 2 (section 5.2) ---------------------------------------------------------------
def test_queued_requests_enter_at_cur_ts():
    # Checked by hand. History: r = 10, s = (30, 5) and r = 20, s = (50, 10), so T = 120 + 80 =
    # 200; D = 20: T + D = 220. Timeouts 60 + 20: LT = ts + 80. Now = 150, one request has waited
    # at stage 0 since 100. Entering at 100, it waited in every simulation: LT >= 230 > 220 at
    # every count. Entering at cur_ts, one worker per stage serves it at once, done by 210.
    hist = [R(10.0, (30.0, 5.0)), R(20.0, (50.0, 10.0))]
    view = BatchView("b", 120.0, 2, hist, 20.0, arrived=2, queued=[(0, 1, 100.0)])
    jobs = estimate_jobs(view, 150.0, [60.0, 20.0], rng=np.random.default_rng(0))
    assert [j.arrival_s for j in jobs] == [150.0]
    dec = DistRSPolicy([60.0, 20.0]).decide([view], 150.0)
    assert dec.feasible and dec.workers == [1, 1]


def test_future_requests_are_the_history_requests_after_cur_ts():
    # history offsets 10, 20, 30, 40; the batch started at 100; now 125: AT + r_i > cur_ts for
    # r_i = 30, 40 (the old estimate drew size - arrived = 1 request)
    hist = [R(float(r), (1.0,)) for r in (10, 20, 30, 40)]
    ahead = BatchView("b", 100.0, 4, hist, 5.0, arrived=3)
    assert sorted(j.arrival_s for j in estimate_jobs(ahead, 125.0, [5.0])) == [130.0, 140.0]
    # behind its history (1 of the 2 due has come): the overdue one arrives at cur_ts
    behind = BatchView("b", 100.0, 4, hist, 5.0, arrived=1)
    got = sorted(j.arrival_s for j in estimate_jobs(behind, 125.0, [5.0]))
    assert got == [125.0, 130.0, 140.0]


def test_running_requests_keep_their_remainder_and_later_stages():
    # Running_k: sampled with s_i'k > e_ik, s_i'k - e_ik left at stage k, then its later stages
    hist = [R(0.0, (1.0, 5.0)), R(0.0, (3.0, 6.0)), R(0.0, (4.0, 7.0))]
    view = BatchView("b", 0.0, 3, hist, 5.0, arrived=3, running=[(0, 2.5, 0)])
    seen = set()
    for seed in range(30):
        (job,) = estimate_jobs(view, 10.0, [10.0, 10.0], rng=np.random.default_rng(seed))
        assert job.running and job.first_stage == 0 and job.arrival_s == 10.0
        seen.add(job.times_s)
    assert seen == {(0.5, 6.0), (1.5, 7.0)}  # never the 1 s request
    # longer than every history request (5 s > 4 s): done now, its later stage kept (was dropped)
    view.running = [(0, 5.0, 0)]
    (job,) = estimate_jobs(view, 10.0, [10.0, 10.0], rng=np.random.default_rng(0))
    assert job.times_s == (0.0, 7.0)


def test_sampling_is_random_with_a_seed_or_evenly_spaced_quantiles():
    hist = [R(0.0, (float(s),)) for s in range(1, 101)]  # stage times 1..100 s
    view = BatchView("b", 0.0, 100, hist, 5.0, arrived=100, queued=[(0, i, 1.0) for i in range(10)])

    def times(policy):
        return [j.times_s[0] for j in policy.estimate([view], 5.0)[0].to_jobs()]

    assert times(DistRSPolicy([200.0], seed=3)) == times(DistRSPolicy([200.0], seed=3))
    assert times(DistRSPolicy([200.0], seed=3)) != times(DistRSPolicy([200.0], seed=4))
    assert times(DistRSPolicy([200.0], sampling="quantile")) == [6.0 + 10 * i for i in range(10)]
    with pytest.raises(ValueError, match="sampling"):
        DistRSPolicy([1.0], sampling="median")


# ---- baselines (section 6.1) -----------------------------------------------------------------
def test_zq_dedicated_is_history_based_and_scaled_per_batch():
    # Warm-up: requests at 1 s and 20 s of 10 s (never two at once). Batch 0: at 1 s and 2 s
    # (two at once), batch 1 the same. ZQ sizes batch 0 from the warm-up: 1 worker, so its
    # second request waits 1 -> 11 (done at 21, T = 12: d = 9); none while training (5 s);
    # batch 1 from batch 0: 2 workers, no wait (done at 26 + 12 = 38). 21 + 2 * 12 = 45 worker-s.
    one = [R(1.0, (10.0,)), R(20.0, (10.0,))]
    two = [R(1.0, (10.0,)), R(2.0, (10.0,))]
    tenant = TenantTrace("t", 0.0, [two, list(two)], one, 5.0, 1.0)
    res = replay_dedicated([tenant], [30.0], lambda: ZeroQueuePolicy([30.0]).decide)
    assert [round(b.extra_delay_s, 6) for b in res.batches] == [9.0, 0.0]
    assert res.worker_s == [45.0]
    alone = replay([tenant], [30.0], ZeroQueuePolicy([30.0]).decide)
    assert alone.timeline == [(0.0, [1]), (21.0, [0]), (26.0, [2]), (38.0, [0])]
    # dedicated pools add up: two such tenants cost twice one
    two_tenants = [tenant, TenantTrace("u", 3.0, [two, list(two)], one, 5.0, 1.0)]
    assert replay_dedicated(
        two_tenants, [30.0], lambda: ZeroQueuePolicy([30.0]).decide
    ).worker_s == [90.0]


@pytest.mark.parametrize("seed", range(2))
def test_ideal_costs_no_more_than_distrs(seed):
    tenants = cuda_tenants(3, 2, 256, "colocated", 5.0, seed=seed)
    ideal = replay(tenants, TIMEOUTS_S, ideal_policy(TIMEOUTS_S, COSTS).decide, oracle=True)
    distrs = replay(tenants, TIMEOUTS_S, DistRSPolicy(TIMEOUTS_S, costs=COSTS).decide)
    assert np.dot(ideal.worker_s, COSTS) <= np.dot(distrs.worker_s, COSTS)
    assert all(i <= d for i, d in zip(ideal.worker_s, distrs.worker_s))  # CPU and GPU alike
    assert max(b.extra_delay_s for b in ideal.batches) < 5.0  # knowing the truth: d < D


# ---- workload and training architectures (sections 3, 6.1) -----------------------------------
def test_the_workload_has_the_papers_stage_times_and_timeouts():
    batch = cuda_batch(np.random.default_rng(0), 2048, progress=0.5)
    assert len(batch) == 2048 and TIMEOUTS_S == (120.0, 60.0)
    compile_s = np.array([r.stage_s[0] for r in batch if r.stage_s[0] > 0])
    execute_s = np.array([r.stage_s[1] for r in batch if len(r.stage_s) > 1])
    assert 45 <= np.median(compile_s) <= 55 and compile_s.max() <= 120.0  # ~50 s, timeout 120
    assert 2 <= np.median(execute_s) <= 6 and execute_s.max() <= 60.0  # a few s, timeout 60
    offsets = np.array([r.offset_s for r in batch])
    assert offsets.min() >= 25.0  # nothing at the start of the rollout
    per_10s = np.bincount((offsets // 10).astype(int))
    assert 150 <= per_10s.max() <= 260  # a peak of ~180-200 per 10 s, then a long tail
    assert np.percentile(offsets, 99) > 3 * np.median(offsets)


def test_disaggregated_batches_start_when_rollout_ends():
    # Requests at 0 s and 10 s of 5 s each, training 100 s. Colocated: batch 1 starts 100 s after
    # batch 0 ends (15 s). Disaggregated: when batch 0's rollout ends (10 s); batch 2 waits for
    # training on batch 0 (15 + 100 = 115) although batch 1's rollout ended at 20.
    b = [R(0.0, (5.0,)), R(10.0, (5.0,))]

    def starts(mode: str) -> list[float]:
        t = TenantTrace("t", 0.0, [b, list(b), list(b)], b, 100.0, 5.0, mode)
        res = replay([t], [10.0], ZeroQueuePolicy([10.0]).decide)
        return [o.start_s for o in sorted(res.batches, key=lambda o: o.index)]

    assert starts("colocated") == [0.0, 115.0, 230.0]
    assert starts("disaggregated") == [0.0, 10.0, 115.0]
    with pytest.raises(ValueError, match="mode"):
        TenantTrace("t", 0.0, [], [], 1.0, 1.0, "hybrid")
