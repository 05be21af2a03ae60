"""DistRS policies (pure): simulator, EBF, Algorithm 1 / 2, timeout-aware check, replay."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from m2flow.scheduler.reward.replay import TenantTrace, replay
from m2flow.scheduler.reward.scaling import (
    BatchView,
    DistRSPolicy,
    estimate_jobs,
    single_task_workers,
)
from m2flow.scheduler.reward.sim import (
    RequestRecord,
    SimJob,
    earliest_completion,
    peak_concurrency,
    simulate,
)

R = RequestRecord

# Figure 9 of DistRS, in small numbers: one stage (timeout 6.5 s), D = 1 s; three requests
# arrive at once, one long (6 s) and two short (1 s). T = 6, so the batch must end by 7.
FIG9 = [R(0.0, (6.0,)), R(0.0, (1.0,)), R(0.0, (1.0,))]


def test_figure9_history_says_two_timeout_check_says_three():
    jobs = [SimJob("b", r.offset_s, 0, r.stage_s) for r in FIG9]
    two = simulate(jobs, [2], [6.5])
    # 2 workers: long 0-6, short 0-1, the other short waits and runs 1-2 -> ends at 6, d = 0
    assert two.completion_s["b"] == 6.0
    # ...but the queued short request started at ts = 1 and could run to its timeout:
    # LT = 1 + 6.5 = 7.5 > T + D = 7
    assert two.latest_s["b"] == 7.5
    one = simulate(jobs, [1], [6.5])
    assert one.completion_s["b"] == 8.0  # 1 worker: 6 + 1 + 1 > 7, infeasible from history
    assert single_task_workers(FIG9, [6.5], 1.0, timeout_check=False).workers == [2]
    assert single_task_workers(FIG9, [6.5], 1.0, timeout_check=True).workers == [3]
    # a looser bound (T + D = 8.5 >= 7.5) lets the timeout-aware check accept 2 as well
    assert single_task_workers(FIG9, [6.5], 2.5, timeout_check=True).workers == [2]


def test_ebf_serves_earliest_batch_first_and_fcfs_within_a_batch():
    # one worker busy 0-2 with x; meanwhile "late" (T = 100) queues at 0.5 and 0.7, and
    # "early" (T = 10) at 1.0 and 1.2.
    jobs = [
        SimJob("x", 0.0, 0, (2.0,)),
        SimJob("late", 0.5, 0, (1.0,)),
        SimJob("late", 0.7, 0, (1.0,)),
        SimJob("early", 1.2, 0, (1.0,)),
        SimJob("early", 1.0, 0, (1.0,)),
    ]
    ebf = simulate(jobs, [1], [10.0], priority={"x": 0.0, "late": 100.0, "early": 10.0})
    assert ebf.finish_s == [2.0, 5.0, 6.0, 4.0, 3.0]
    fcfs = simulate(jobs, [1], [10.0], priority=None)
    assert fcfs.finish_s == [2.0, 3.0, 4.0, 6.0, 5.0]


def test_stages_form_a_tandem_and_failures_skip_later_stages():
    jobs = [SimJob("b", 0.0, 0, (1.0, 3.0)), SimJob("b", 0.0, 0, (2.0,))]  # 2nd failed at 0
    res = simulate(jobs, [1, 1], [5.0, 5.0])
    assert res.finish_s == [4.0, 3.0]
    assert res.busy_s == [3.0, 3.0]
    assert peak_concurrency(jobs, 2) == [2, 1]


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match=">= 0"):
        R(-1.0, (1.0,))
    with pytest.raises(ValueError, match="workers"):
        simulate([SimJob("b", 0.0, 0, (1.0,))], [0], [1.0])
    with pytest.raises(ValueError, match="timeouts"):
        DistRSPolicy([0.0])


def test_more_slack_never_needs_more_workers():
    rng = random.Random(3)
    hist = [R(rng.uniform(0, 50), (rng.uniform(0.5, 2), rng.uniform(5, 15))) for _ in range(300)]
    counts = [single_task_workers(hist, [10, 30], d).workers for d in (0.0, 5.0, 30.0, 200.0)]
    for a, b in zip(counts, counts[1:]):
        assert all(x >= y for x, y in zip(a, b)), counts
    assert counts[-1][1] < counts[0][1]


def test_algorithm2_estimates_future_queued_and_running_from_history():
    hist = [R(float(i), (1.0, float(10 + i))) for i in range(10)]  # r_i = i, s_i1 = 10 + i
    view = BatchView(
        "b",
        start_s=100.0,
        size=10,
        history=hist,
        delay_bound_s=1.0,
        arrived=6,
        queued=[(0, 5, 105.0)],
        running=[(1, 13.5, 0)],
    )
    jobs = estimate_jobs(view, 106.0, [5.0, 30.0], rng=np.random.default_rng(0))
    # Future: history requests with AT + r_i > cur_ts (r_i = 7, 8, 9), at AT + r_i
    assert sorted(j.arrival_s for j in jobs if j.arrival_s > 106.0) == [107.0, 108.0, 109.0]
    # the rest arrive at cur_ts: one overdue (history had 7 by now, 6 came: r_i = 6's times),
    # the queued one (stage 0 on), the running one
    now = [j for j in jobs if j.arrival_s == 106.0]
    assert len(now) == 3
    assert [j.times_s for j in now if not j.running and j.first_stage == 0][0] == (1.0, 16.0)
    (run,) = [j for j in now if j.running]
    # running 13.5 s at stage 1: sampled from history stage-1 times > 13.5 (14..19)
    assert run.first_stage == 1 and len(run.times_s) == 1
    assert 0.5 <= run.times_s[0] <= 5.5 and (run.times_s[0] + 13.5) % 1 == 0


def test_multi_tenant_decision_covers_every_active_batch():
    hist = [R(0.0, (1.0, 4.0))] * 8
    views = [BatchView(("a", 0), 0.0, 8, hist, 0.0), BatchView(("b", 0), 0.0, 8, hist, 0.0)]
    dec = DistRSPolicy([5.0, 5.0]).decide(views, 0.0)
    assert dec.feasible and dec.workers == [16, 16]  # D = 0: zero queueing for both batches
    loose = [BatchView(k.key, 0.0, 8, hist, 100.0) for k in views]
    assert DistRSPolicy([5.0, 5.0], timeout_check=False).decide(loose, 0.0).workers == [1, 1]
    # a batch without history (first batch) gets the cold provision on top
    cold = BatchView(("c", 0), 0.0, 8, [], 1.0)
    dec = DistRSPolicy([5.0, 5.0], caps=[40, 40], cold_workers=[3, 3]).decide([views[0], cold], 0.0)
    assert dec.workers == [11, 11]


def test_zero_queue_helpers():
    assert peak_concurrency([SimJob("b", r.offset_s, 0, r.stage_s) for r in FIG9], 1) == [3]
    assert earliest_completion(10.0, FIG9) == 16.0


def _static_zq(batches: list[list[RequestRecord]]) -> int:
    """Most execute workers any of the batches has in service at once (zero queueing)."""
    jobs = [[SimJob(0, r.offset_s, 0, r.stage_s) for r in b] for b in batches]
    return max(peak_concurrency(j, 2)[1] for j in jobs)


def _trace(seed: int, n: int) -> list[RequestRecord]:
    rng = random.Random(seed)
    return [
        R(rng.expovariate(1 / 20), (rng.uniform(0.2, 1.0), rng.uniform(2, 8))) for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(5))
def test_replay_ideal_keeps_every_batch_within_the_bound_and_loses_nothing(seed):
    # With perfect knowledge and no cold start, the policy's simulation predicts the service
    # exactly: every batch must end within T + D (a mismatch between the two shows up here).
    rng = random.Random(seed)
    tenants = [
        TenantTrace(
            f"t{i}",
            rng.uniform(0, 30) * i,
            [_trace(seed * 100 + 10 * i + b, 100) for b in range(3)],
            _trace(999 + i + seed, 100),
            5.0,
            2.0,
        )
        for i in range(3)
    ]
    policy = DistRSPolicy([5.0, 10.0], timeout_check=False)
    res = replay(tenants, [5.0, 10.0], policy.decide, ebf=True, oracle=True)
    assert res.requests_done == 3 * 3 * 100
    assert len(res.batches) == 9
    assert max(b.extra_delay_s for b in res.batches) <= 2.0 + 1e-6
    # elastic: far less than every tenant's zero-queue peak held for the whole run
    zq = sum(_static_zq(t.batches) for t in tenants) * res.end_s
    assert res.worker_s[1] < 0.5 * zq
    assert res.busy_s[1] <= res.worker_s[1] + 1e-6


def test_replay_distrs_from_history_stays_close_to_the_bound():
    tenants = [
        TenantTrace(
            f"t{i}",
            10.0 * i,
            [_trace(7 * i + b, 150) for b in range(3)],
            _trace(50 + i, 150),
            3.0,
            3.0,
        )
        for i in range(2)
    ]
    res = replay(tenants, [5.0, 10.0], DistRSPolicy([5.0, 10.0]).decide, ebf=True)
    assert res.requests_done == 2 * 3 * 150
    delays = [b.extra_delay_s for b in res.batches]
    assert sum(delays) / len(delays) < 3.0


def test_a_huge_announced_batch_is_decided_in_bounded_time():
    # one tenant announces a million requests after a one-request batch: without a bound the
    # decision simulates a million jobs (~30 s here); with max_jobs it simulates a sample
    import time

    huge = BatchView("huge", 0.0, 1_000_000, [R(0.0, (0.1, 0.2))], 1.0)
    small = BatchView("small", 0.0, 4, [R(0.0, (0.1, 0.2))] * 4, 1.0)
    t0 = time.process_time()  # this process's CPU: other jobs on the machine do not count
    dec = DistRSPolicy([5.0, 5.0], caps=[8, 8], max_jobs=2048).decide([huge, small], 0.0)
    assert time.process_time() - t0 < 1.0
    assert dec.workers == [8, 8]  # a million requests at once: every worker there is
    with pytest.raises(ValueError, match="max_jobs"):
        DistRSPolicy([5.0], max_jobs=0)


@pytest.mark.parametrize("seed", range(2))
def test_a_sampled_decision_stays_within_its_granularity_of_the_full_one(seed):
    rng = random.Random(seed)
    hist = [
        R(rng.expovariate(1 / 60), (rng.uniform(0.2, 1), rng.uniform(2, 8))) for _ in range(4000)
    ]
    queued = [(0, i, 1.0) for i in range(300)]
    running = [(1, 1.0, i) for i in range(40)]
    views = [
        BatchView(("a", 0), 0.0, 4000, hist, 5.0, 1000, queued, running),
        BatchView(("b", 0), 0.0, 3000, hist[:3000], 5.0),
    ]
    total = 3000 + 300 + 40 + 3000
    full = DistRSPolicy([5, 10], caps=[64, 256]).decide(views, 30.0)
    sampled = DistRSPolicy([5, 10], caps=[64, 256], max_jobs=1000).decide(views, 30.0)
    step = math.ceil(total / 1000) + 1  # one sampled worker stands for ~total/max_jobs
    assert all(abs(s - f) <= step for s, f in zip(sampled.workers, full.workers)), (sampled, full)
    assert sampled.probes <= full.probes + 2
