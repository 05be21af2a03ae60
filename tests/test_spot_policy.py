"""RLBoost spot-pool policies (pure): Algorithm 1 seeding, Algorithm 2 balancing, profile, traces.

Numbers are small and hand-checkable; the comment above each assertion shows the arithmetic.
Paper lines refer to shared/papers/000_8942f305fc039a41.txt.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from m2flow.scheduler.spot import (
    SEGMENTS,
    Move,
    SeedingPolicy,
    StepStats,
    ThroughputProfile,
    TraceError,
    batching_plateau,
    events,
    generate_segment,
    instances_at,
    load_trace,
    rebalance,
    save_trace,
    seconds_outside,
    select_instance,
    time_scale,
    trace_stats,
)


def stats(n_bar=2.0, n_hat=2, wait=0.0, rwait=0.0, train=40.0, remote=30.0) -> StepStats:
    return StepStats(n_bar, n_hat, wait, rwait, train, remote)


# --- Algorithm 1 (section 4.1) -----------------------------------------------------------------


def test_initial_schedule_lines_2_3():
    p = SeedingPolicy(n_resv=4, eta=2.0, t_init=10.0)
    assert (p.t_seed, p.n_prem, p.memory) == (10.0, 4, {})
    # line 3 starts N_prem at N_resv, within the clamp
    assert SeedingPolicy(n_resv=4, eta=2.0, t_init=10.0, n_prem_max=3).n_prem == 3


def test_line9_arithmetic():
    p = SeedingPolicy(n_resv=4, eta=4.0, t_init=10.0, use_memory=False)
    # 10 + (6 - 2) / 4 = 11
    t_seed, _ = p.update(stats(wait=6.0, rwait=2.0))
    assert t_seed == 11.0 == p.t_seed
    # 11 + (1 - 9) / 4 = 9: remote instances waited longer -> shorter window
    assert p.update(stats(wait=1.0, rwait=9.0))[0] == 9.0


def test_t_seed_clamped():
    p = SeedingPolicy(n_resv=4, eta=2.0, t_init=1.0, use_memory=False)
    # 1 + (0 - 20) / 2 = -9 -> 0 (t_seed_min default)
    assert p.update(stats(rwait=20.0))[0] == 0.0
    p = SeedingPolicy(n_resv=4, eta=2.0, t_init=1.0, t_seed_min=0.5, t_seed_max=5.0)
    assert p.update(stats(n_bar=1.5, rwait=20.0))[0] == 0.5
    # 0.5 + 100 / 2 = 50.5 -> 5
    assert p.update(stats(n_bar=1.5, wait=100.0))[0] == 5.0


def test_line10_formula_rounds_up():
    p = SeedingPolicy(n_resv=4, eta=4.0, t_init=10.0, use_memory=False)
    # line 9: T_seed = 11; line 10: (30 * 2 + 11 * 4) / 40 = 104 / 40 = 2.6 -> 3
    assert p.update(stats(wait=6.0, rwait=2.0)) == (11.0, 3)
    assert p.n_prem_raw == pytest.approx(2.6)


def test_line10_exact_integer_and_float_noise_do_not_round_up():
    p = SeedingPolicy(n_resv=3, eta=1.0, t_init=10.0, use_memory=False)
    # (20 * 3 + 10 * 3) / 30 = 3.0 exactly -> 3, not 4
    assert p.update(stats(n_bar=3.0, n_hat=3, train=30.0, remote=20.0))[1] == 3
    p = SeedingPolicy(n_resv=0, eta=1.0, t_init=0.0, use_memory=False)
    # 0.1 * 3 / 0.3 = 1.0000000000000002 in floats -> 1
    assert p.update(stats(n_bar=3.0, n_hat=3, train=0.3, remote=0.1))[1] == 1
    assert p.n_prem_raw > 1.0
    # 0.101 * 3 / 0.3 = 1.01 -> 2
    assert p.update(stats(n_bar=3.0, n_hat=3, train=0.3, remote=0.101))[1] == 2


def test_line10_clamps():
    p = SeedingPolicy(n_resv=4, eta=4.0, t_init=10.0, n_prem_max=2, use_memory=False)
    assert p.update(stats(wait=6.0, rwait=2.0))[1] == 2  # 3 -> 2
    p = SeedingPolicy(n_resv=0, eta=1.0, t_init=0.0, n_prem_min=1, use_memory=False)
    assert p.update(stats(n_bar=0.0, n_hat=0, remote=0.0))[1] == 1  # 0 -> 1


def test_line10_seed_work_updated_or_executed():
    kw = {"n_resv": 4, "eta": 4.0, "t_init": 10.0, "use_memory": False}
    s = stats(n_bar=2.0, wait=6.0, rwait=2.0, train=50.0, remote=29.0)
    # pseudocode order, line 9's T_seed = 11: (29 * 2 + 11 * 4) / 50 = 2.04 -> 3
    assert SeedingPolicy(**kw).update(s)[1] == 3
    # the window the step ran with, 10: (58 + 40) / 50 = 1.96 -> 2
    assert SeedingPolicy(**kw, seed_work="executed").update(s)[1] == 2


def test_memory_written_only_when_n_bar_equals_n_hat():
    p = SeedingPolicy(n_resv=4, eta=4.0, t_init=10.0)
    p.update(stats(n_bar=2.5, n_hat=3, wait=4.0))  # the count changed during the step
    assert p.memory == {}
    p.update(stats(n_bar=3.0, n_hat=3, wait=4.0))  # 11 + 1 = 12, constant count -> M[3] = 12
    assert p.memory == {3: 12.0}
    p.update(stats(n_bar=3.0 + 1e-9, n_hat=3, wait=4.0))  # float noise of a time average: equal
    assert p.memory == {3: 13.0}
    p.update(stats(n_bar=3.001, n_hat=3, wait=4.0))  # a real change, however small: not equal
    assert p.memory == {3: 13.0} and p.t_seed == 13.0  # line 14 still retrieves M[3]
    strict = SeedingPolicy(n_resv=4, eta=4.0, t_init=10.0, equal_tol=0.0)
    strict.update(stats(n_bar=3.0 + 1e-9, n_hat=3))
    assert strict.memory == {}


def test_memory_reused_when_n_hat_recurs():
    p = SeedingPolicy(n_resv=4, eta=2.0, t_init=10.0)
    # steady at 2 instances: 10 + 4 / 2 = 12 -> M[2] = 12
    assert p.update(stats(n_bar=2.0, n_hat=2, wait=4.0))[0] == 12.0
    # 4 instances joined during the step: nothing memorised, M has no 4 -> line 9's value
    assert p.update(stats(n_bar=3.2, n_hat=4, rwait=10.0))[0] == 7.0  # 12 - 10 / 2
    # steady at 4: 7 - 2 / 2 = 6 -> M[4] = 6
    assert p.update(stats(n_bar=4.0, n_hat=4, rwait=2.0))[0] == 6.0
    # back to 2 (a preemption mid-step): line 9 gives 6 + 6 / 2 = 9, line 14 replaces it by M[2]
    assert p.update(stats(n_bar=3.1, n_hat=2, wait=6.0))[0] == 12.0
    assert p.memory == {2: 12.0, 4: 6.0}


def test_without_memory_ablation():
    p = SeedingPolicy(n_resv=4, eta=2.0, t_init=10.0, use_memory=False)
    p.update(stats(n_bar=2.0, n_hat=2, wait=4.0))  # 12
    p.update(stats(n_bar=3.2, n_hat=4, rwait=10.0))  # 7
    assert p.update(stats(n_bar=3.1, n_hat=2, wait=6.0))[0] == 10.0  # 7 + 3, no retrieval
    assert p.memory == {}


def test_line9_converges_to_the_balanced_window():
    # toy step: the trainer waits X - T when T < X, the remote pool waits T - X when T > X
    x, p = 25.0, SeedingPolicy(n_resv=4, eta=2.0, t_init=5.0, use_memory=False)
    for _ in range(20):
        gap = x - p.t_seed
        p.update(stats(wait=max(gap, 0.0), rwait=max(-gap, 0.0)))
    # the gap halves every step: 20 / 2**20
    assert p.t_seed == pytest.approx(x, abs=1e-4)


def test_seeding_errors():
    with pytest.raises(ValueError, match="t_train"):
        SeedingPolicy(n_resv=4, eta=2.0, t_init=1.0).update(stats(train=0.0))
    with pytest.raises(ValueError, match="t_remote_wait"):
        stats(rwait=-1.0)
    with pytest.raises(ValueError, match="n_hat"):
        StepStats(2.0, 2.5, 0.0, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="eta"):
        SeedingPolicy(n_resv=4, eta=0.0, t_init=1.0)
    with pytest.raises(ValueError, match="t_init"):
        SeedingPolicy(n_resv=4, eta=1.0, t_init=10.0, t_seed_max=5.0)
    with pytest.raises(ValueError, match="seed_work"):
        SeedingPolicy(n_resv=4, eta=1.0, t_init=1.0, seed_work="later")


# --- Algorithm 2 SELECTINSTANCE ----------------------------------------------------------------


def test_select_instance_shortest_queue_under_theta():
    assert select_instance({"a": 3, "b": 1, "c": 2}, theta=4) == "b"
    # a has 4 = theta: not a candidate (line 6 is m < theta)
    assert select_instance({"a": 4, "b": 3}, theta=4) == "b"


def test_select_instance_delayed_dispatch():
    assert select_instance({"a": 4, "b": 5}, theta=4) is None  # every queue full: wait (line 12)
    assert select_instance({"a": 4, "b": 5}, theta=5) == "a"
    assert select_instance({}, theta=4) is None


def test_select_instance_ties_follow_iteration_order():
    assert select_instance({"b": 1, "a": 1, "c": 2}, theta=4) == "b"  # not sort order
    assert select_instance({2: 0, 1: 0}, theta=1) == 2


def test_select_instance_errors():
    with pytest.raises(ValueError, match="theta"):
        select_instance({"a": 0}, theta=0)
    with pytest.raises(ValueError, match="pending"):
        select_instance({"a": -1}, theta=2)


# --- Algorithm 2 CONTINUOUSLB ------------------------------------------------------------------


def test_rebalance_moves_one_pending_request_to_the_empty_queue():
    moves = rebalance({"a": 0, "b": 3, "c": 5}, {"a": 4, "b": 8, "c": 8}, plateau=None)
    assert moves == [Move("c", "a", 1, executing=False)]  # lines 18-20, even without a profile


def test_rebalance_several_empty_queues_pick_the_least_executing():
    moves = rebalance({"a": 0, "b": 0, "c": 2}, {"a": 5, "b": 1, "c": 8}, plateau=16)
    assert moves == [Move("c", "b", 1, executing=False)]


def test_rebalance_caller_loop_terminates():
    pending, executing = {"a": 0, "b": 0, "c": 6}, {"a": 9, "b": 9, "c": 9}
    for _ in range(10):
        moves = rebalance(pending, executing, plateau=4)
        if not moves:
            break
        (m,) = moves
        pending[m.src] -= m.count
        pending[m.dst] += m.count  # saturated destinations queue it
    assert pending == {"a": 1, "b": 1, "c": 4}  # every queue non-empty: nothing more to do


def test_rebalance_moves_executing_requests_above_the_plateau():
    moves = rebalance({"a": 0, "b": 0, "c": 0}, {"a": 0, "b": 40, "c": 10}, plateau=16)
    assert moves == [Move("b", "a", 24, executing=True)]  # r = max(40 - 16, 0), line 25


def test_rebalance_no_executing_move_at_or_below_plateau():
    assert rebalance({"a": 0, "b": 0}, {"a": 0, "b": 16}, plateau=16) == []  # r = 0
    assert rebalance({"a": 0, "b": 0}, {"a": 0, "b": 12}, plateau=16) == []
    assert rebalance({"a": 0, "b": 0}, {"a": 0, "b": 0}, plateau=1) == []


def test_rebalance_without_profile_moves_no_executing_requests():
    # first step: no P yet (paper:251)
    assert rebalance({"a": 0, "b": 0}, {"a": 0, "b": 40}, plateau=None) == []


def test_rebalance_all_queues_busy_moves_nothing():
    # reading of line 22 with paper:251: executing moves only when no instance has a queue
    assert rebalance({"a": 2, "b": 1}, {"a": 0, "b": 40}, plateau=8) == []


def test_rebalance_errors():
    with pytest.raises(ValueError, match="same instances"):
        rebalance({"a": 0}, {"b": 0}, plateau=4)
    with pytest.raises(ValueError, match="plateau"):
        rebalance({"a": 0}, {"a": 0}, plateau=0)


# --- the batching profile P --------------------------------------------------------------------


def test_batching_plateau_hand_table():
    table = [(16, 400.0), (1, 100.0), (4, 300.0), (2, 180.0), (8, 380.0)]
    assert batching_plateau(table) == 8  # 0.9 * 400 = 360 <= 380
    assert batching_plateau(table, tolerance=0.0) == 16
    assert batching_plateau(table, tolerance=0.5) == 4  # 200 <= 300, 180 < 200
    assert batching_plateau([]) is None
    with pytest.raises(ValueError, match="tolerance"):
        batching_plateau(table, tolerance=1.0)


def saturating(b: int, a: float = 1000.0, k: float = 8.0) -> float:
    return a * b / (b + k)


def test_profile_plateau_on_exact_saturating_curve():
    p = ThroughputProfile()
    for b in range(1, 129):
        p.record(b, saturating(b) * 2.0, 2.0)
    # 0.9 * 1000 * 128 / 136 = 847.06; b / (b + 8) >= 0.84706 first at b = 45
    assert p.plateau() == 45 == batching_plateau([(b, saturating(b)) for b in range(1, 129)])


def test_profile_plateau_on_noisy_saturating_curve():
    rng = np.random.default_rng(0)
    p = ThroughputProfile()
    for b in range(1, 129):
        for _ in range(20):
            s = rng.uniform(0.5, 2.0)
            p.record(b, saturating(b) * s * (1 + rng.normal(0, 0.05)), s)
    b = p.plateau()
    # 5% noise per record: the answer's true throughput is within 3% of the 90% line
    assert abs(saturating(b) / (0.9 * saturating(128)) - 1) < 0.03
    assert 35 <= b <= 60


def test_profile_table_bins_by_batch_size():
    p = ThroughputProfile(bin_width=4)
    p.record(1, 10.0, 1.0)
    p.record(3, 60.0, 3.0)  # bin (0, 4]: batch (1*1 + 3*3) / 4 = 2.5 -> 2; 70 / 4 = 17.5
    p.record(8, 90.0, 1.0)  # bin (4, 8]
    assert p.table() == [(2, 17.5), (8, 90.0)]


def test_profile_window_and_min_steps():
    p = ThroughputProfile(window_steps=2, min_steps=1)
    p.record(4, 100.0, 1.0)
    assert p.plateau() is None  # P exists only after the first step (paper:251)
    p.new_step()
    assert p.plateau() == 4
    p.record(8, 400.0, 1.0)
    assert p.table() == [(4, 100.0), (8, 400.0)]
    p.new_step()  # the first step falls out of the 2-step window
    assert p.table() == [(8, 400.0)]
    assert ThroughputProfile().plateau() is None and ThroughputProfile().table() == []
    q = ThroughputProfile(max_records=2)
    for b in (1, 2, 3):
        q.record(b, 10.0 * b, 1.0)
    assert q.table() == [(2, 20.0), (3, 30.0)]  # the oldest record dropped


# decode iteration time tau(b, L) = alpha + beta*b + gamma*b*L: at context L the curve is
# b / (alpha + b*(beta + gamma*L)), saturating earlier for longer contexts
ALPHA, BETA, GAMMA = 0.01, 0.0005, 5e-7


def decode_profile(with_context: bool, noise: float = 0.0, seed: int = 0) -> ThroughputProfile:
    """A decode: the batch shrinks from 128 to 1 as the context grows from 200 to 5280."""
    rng = np.random.default_rng(seed)
    p = ThroughputProfile()
    for b in range(1, 129):
        ctx = 200.0 + (128 - b) * 40.0
        for _ in range(3):
            secs = 10 * (ALPHA + BETA * b + GAMMA * b * ctx) * (1 + rng.normal(0, noise))
            p.record(b, 10.0 * b, secs, ctx if with_context else None)
    return p


def true_plateau(ctx: float) -> int:
    return batching_plateau([(b, b / (ALPHA + BETA * b + GAMMA * b * ctx)) for b in range(1, 129)])


def test_profile_calibration_to_context_length():
    p = decode_profile(with_context=True)
    assert p.context_model() == pytest.approx((ALPHA, BETA, GAMMA), rel=1e-6)
    for ctx in (500.0, 2000.0, 5000.0):
        table = dict(p.table(context_len=ctx))
        assert table[10] == pytest.approx(10 / (ALPHA + BETA * 10 + GAMMA * 10 * ctx), rel=1e-9)
        assert p.plateau(context_len=ctx) == true_plateau(ctx)
    assert (true_plateau(500.0), true_plateau(2000.0), true_plateau(5000.0)) == (59, 40, 24)
    # default reference: the open step's token-weighted mean context
    assert p.plateau() == true_plateau(p.reference_context())
    # without contexts large batches (short contexts) look far better than small ones (long)
    assert decode_profile(with_context=False).plateau() == 125


def test_profile_calibration_with_noise():
    p = decode_profile(with_context=True, noise=0.03, seed=1)
    assert abs(p.plateau(context_len=2000.0) - true_plateau(2000.0)) <= 4


def test_profile_no_calibration_without_spread_in_context():
    p = ThroughputProfile()
    for b in range(1, 20):
        p.record(b, 10.0 * b, 0.1 + 0.01 * b, context_len=1000.0)
    assert p.context_model() is None  # b and b*L are collinear
    assert p.table(context_len=50.0)[0] == (1, 10.0 / 0.11)  # unscaled


def test_profile_record_errors():
    p = ThroughputProfile()
    for args in [(0, 1.0, 1.0), (1, -1.0, 1.0), (1, 1.0, 0.0), (1, 1.0, 1.0, -5.0)]:
        with pytest.raises(ValueError, match="bad record"):
            p.record(*args)


# --- traces ------------------------------------------------------------------------------------


def write(tmp_path, text: str, name: str = "trace.csv"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_load_trace_good(tmp_path):
    text = "\ufeff t_s , instances\n# segment A\n0,4\n\n 120.5 , 3.0\n300,0\n"
    assert load_trace(write(tmp_path, text)) == [(0.0, 4), (120.5, 3), (300.0, 0)]


@pytest.mark.parametrize(
    "text, line, fragment",
    [
        ("", 1, "empty"),
        ("\n\n", 1, "empty"),
        ("time,n\n0,1\n", 1, "header"),
        ("t_s,instances\n", 1, "no rows"),
        ("t_s,instances\n0,1\n5\n", 3, "1 columns"),
        ("t_s,instances\n0,1,2\n", 2, "3 columns"),
        ("t_s,instances\n0,abc\n", 2, "non-numeric"),
        ("t_s,instances\n-1,2\n", 2, "negative"),
        ("t_s,instances\nnan,2\n", 2, "not finite"),
        ("t_s,instances\n0,-1\n", 2, "not an integer >= 0"),
        ("t_s,instances\n0,2.5\n", 2, "not an integer >= 0"),
        ("t_s,instances\n0,1\n10,2\n5,3\n", 4, "before the time on line 3"),
        ("t_s,instances\n0,1\n10,2\n10,3\n", 4, "repeats the time on line 3"),
        ("t_s,instances\n\n0,1\n\nx,2\n", 5, "non-numeric"),
    ],
)
def test_load_trace_errors(tmp_path, text, line, fragment):
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert msg.startswith(f"{path}, line {line}: ") and fragment in msg and "\n" not in msg
    assert "; " in msg  # the fix follows the problem


def test_load_trace_missing_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


def test_instances_at_events_stats_and_scale():
    trace = [(10.0, 3), (20.0, 5), (30.0, 5), (40.0, 2)]
    assert [instances_at(trace, t) for t in (0, 10, 19.9, 20, 45)] == [0, 3, 3, 5, 2]
    assert events(trace) == [(20.0, 2, 0), (40.0, 0, 3)]  # the first row is the initial state
    # over [0, 50): 0*10 + 3*10 + 5*20 + 2*10 = 150 -> 3.0
    assert trace_stats(trace, 50.0) == (3.0, 2, 3)
    assert trace_stats(trace, 30.0) == ((30 + 50) / 30, 2, 0)  # the leave at 40 is outside
    assert time_scale(trace, 0.5) == [(5.0, 3), (10.0, 5), (15.0, 5), (20.0, 2)]
    with pytest.raises(ValueError, match="factor"):
        time_scale(trace, 0.0)
    with pytest.raises(ValueError, match="merges"):
        time_scale([(0.0, 1), (1e-300, 2)], 1e-100)


@pytest.mark.parametrize("kind", ["A", "B", "C"])
def test_generate_segment_matches_table5(kind, tmp_path):
    avg, joins, leaves = SEGMENTS[kind]
    for seed in range(10):
        trace = generate_segment(kind, seed=seed)
        got = trace_stats(trace, 7200.0)
        # 6.53 * 7200 s = 47016 instance-seconds: integer times hit it exactly
        assert math.isclose(got.avg_instances, avg, abs_tol=1e-9)
        assert (got.allocations, got.preemptions) == (joins, leaves)
        assert len(trace) == 1 + joins + leaves and trace[0][0] == 0.0
        times = [t for t, _ in trace]
        assert times == sorted(set(times)) and times[-1] < 7200
        assert min(n for _, n in trace) >= 0
        assert generate_segment(kind, seed=seed) == trace  # seeded
    assert generate_segment(kind, seed=0) != generate_segment(kind, seed=1)
    path = tmp_path / f"{kind}.csv"
    save_trace(path, trace)
    assert load_trace(path) == trace


def test_generate_segment_other_durations_and_errors():
    trace = generate_segment("B", duration_s=3600, seed=3)
    got = trace_stats(trace, 3600.0)
    assert math.isclose(got.avg_instances, 4.58, abs_tol=1 / 3600) and got[1:] == (8, 9)
    with pytest.raises(ValueError, match="kind"):
        generate_segment("D")


def test_seconds_outside_clips_and_cuts_overlapping_spans():
    """The trainer's wait [0, 10] counts after the seeding window (lo = 2) and outside the
    reserved ranks' generation [1, 3], [2.5, 4] and [6, 7] (overlapping spans cut once),
    up to hi = 9: 7 s less [2, 4] and [6, 7]."""
    assert seconds_outside(0, 10, 2, 9, [(6, 7), (1, 3), (2.5, 4)]) == pytest.approx(4.0)
    assert seconds_outside(0, 1, 2, 9, []) == 0.0  # before the window ended
    assert seconds_outside(3, 5, 0, 9, [(0, 9)]) == 0.0  # the devices rolled out throughout
