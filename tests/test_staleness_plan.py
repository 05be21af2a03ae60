"""The planner picks the staleness (issue 32 item 4): the asynchronous pipeline's cost model
(scheduler/plan/staleness.py), its choice against an exhaustive search of its own, and
``m2flow plan --staleness``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import typer
from m2flow.scheduler.plan.cost import divisors, flow_shop_time
from m2flow.scheduler.plan.planner import Component, PlanError, Workflow, plan_workflow
from m2flow.scheduler.plan.profile import load_profile, to_workflow
from m2flow.scheduler.plan.staleness import (
    Pipeline,
    Stage,
    capped_lognormal,
    period,
    pipeline_of,
    plan_staleness,
    tail_share,
)
from typer.testing import CliRunner

from m2flow.run.plan_cli import register

PROFILES = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles"
PPO = PROFILES / "ppo_4_1_1_1_1.yaml"
CHAIN = PROFILES / "synthetic_chain3.yaml"
GiB = 2**30


def _comp(name, a, b, mem_fixed=0.0, mem_shard=0.0, switch=0.0, chunk=0.0):
    return Component(
        name,
        time=lambda n, a=a, b=b: a + b / n,
        memory=lambda n, f=mem_fixed, s=mem_shard: f + s / n,
        switch_cost=switch,
        chunk_overhead=chunk,
    )


def two_stage(a_r=0.1, b_r=8.0, a_t=0.2, b_t=6.0, switch=0.0, chunk=0.0, batch=8):
    comps = [_comp("rollout", a_r, b_r, switch=switch, chunk=chunk),
             _comp("train", a_t, b_t, 2 * GiB, 24 * GiB, switch=switch, chunk=chunk)]  # fmt: skip
    return Workflow(comps, [("rollout", "train")], batch)


def _sub(wf: Workflow, keep: set[str]) -> Workflow:
    comps = [c for c in wf.components if c.name in keep]
    return Workflow(comps, [(s, d) for s, d in wf.edges if s in keep and d in keep], wf.batch_size)


def brute_force(wf, n, cap, max_k, tail, sync, slack, overhead=0.0):
    """Every (K, placement) of the search space, costed one by one: the planner's best plan of
    each mode, and rollout on every device count 1..n-1 with the rest on the others (each
    planned alone, every chunk count tried). Returns (k, items/s) of the choice and the best
    items/s per K."""
    names = {c.name for c in wf.components}
    rest = names - {"rollout"}
    pipes = []
    for mode in ("temporal", "spatial", "hybrid", "auto"):
        try:
            plan = plan_workflow(wf, n, cap, mode=mode)
        except PlanError:
            continue
        pipes.append(("mode", pipeline_of(plan, {"rollout"}, sync, 0.0, overhead)))
    o_r = sum(c.chunk_overhead for c in wf.components if c.name == "rollout")
    o_t = sum(c.chunk_overhead for c in wf.components if c.name in rest)
    splits = []
    for n_r in range(1, n):
        try:
            r = plan_workflow(_sub(wf, {"rollout"}), n_r, cap).time
            t = plan_workflow(_sub(wf, rest), n - n_r, cap).time
        except PlanError:
            continue
        lat = min(flow_shop_time([r, t], [o_r, o_t], k) for k in divisors(wf.batch_size))
        splits.append((r, t, lat))
    rows = []
    for k in range(max_k + 1):
        for _, pipe in pipes:
            rows.append((k, wf.batch_size / period(pipe, k, tail)))
        u = 0.0 if k == 0 else min(tail, k / (k + 1))
        for r, t, lat in splits:  # the model, written out: latency bound, then each stage
            step = overhead + min(lat + sync, max((lat + sync) / (k + 1), r * (1 - u) + sync,
                                                  t + sync))  # fmt: skip
            rows.append((k, wf.batch_size / step))
    best = max(x for _, x in rows)
    k_star = min(k for k, x in rows if x >= (1 - slack) * best)
    per_k = {k: max(x for kk, x in rows if kk == k) for k in range(max_k + 1)}
    return k_star, per_k[k_star], per_k


CASES = [
    (two_stage(), 2), (two_stage(), 5), (two_stage(switch=0.3, chunk=0.05), 8),
    (two_stage(b_r=30.0, b_t=2.0), 12), (two_stage(a_r=1.0, b_r=1.0, batch=12), 16),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(CASES) + 3))
@pytest.mark.parametrize("tail", [0.0, 0.35, 0.8])
@pytest.mark.parametrize("sync", [0.0, 0.3])
def test_choice_equals_exhaustive_search(case, tail, sync):
    if case < len(CASES):
        wf, n = CASES[case]
        cap = 64 * GiB
    else:  # the shipped 3-stage chain on 4, 8 and 16 devices
        prof = load_profile(CHAIN)
        wf, n, cap = to_workflow(prof), (4, 8, 16)[case - len(CASES)], prof.device_memory_bytes
    for max_k in (0, 1, 3):
        for slack in (0.0, 0.05):
            sp = plan_staleness(wf, n, cap, max_staleness=max_k, slack=slack, tail=tail,
                                sync_s=sync)  # fmt: skip
            k, x, per_k = brute_force(wf, n, cap, max_k, tail, sync, slack)
            assert sp.chosen.k == k
            assert sp.chosen.items_per_s == pytest.approx(x, rel=1e-9)
            for kk, best in per_k.items():
                mine = max(r.items_per_s for r in sp.rows if r.k == kk)
                assert mine == pytest.approx(best, rel=1e-9)


def test_asynchrony_does_not_pay_collocated_short_uniform():
    # Rollout and training scale perfectly: collocated uses every device for each in turn, a
    # split can at best tie it and pays the weight sync on top; uniform responses: no tail.
    comps = [_comp("rollout", 0.0, 8.0), _comp("train", 0.0, 8.0)]
    wf = Workflow(comps, [("rollout", "train")], 16)
    sp = plan_staleness(wf, 8, max_staleness=4, tail=tail_share([256] * 64), sync_s=0.5)
    assert sp.chosen.k == 0 and sp.chosen.placement == "temporal"
    temporal = [r for r in sp.rows if r.placement == "temporal"]
    assert len(temporal) == 5
    assert {r.step_s for r in temporal} == {temporal[0].step_s}  # nothing to overlap
    assert all(r.mean_staleness == 0 for r in temporal)


def test_long_tail_disaggregated_pays():
    wf = two_stage(b_r=8.0, b_t=6.0)
    tail = tail_share(capped_lognormal(1000, 1.0, 8192))
    assert 0.5 < tail < 1
    sp = plan_staleness(wf, 8, 64 * GiB, tail=tail, sync_s=0.1)
    sync_best = max(r.items_per_s for r in sp.rows if r.k == 0)
    assert sp.chosen.k >= 1
    assert sp.chosen.items_per_s > 1.2 * sync_best


def test_k0_rows_are_todays_predictions_and_k_only_helps():
    prof = load_profile(PPO)
    wf = to_workflow(prof)
    sp = plan_staleness(wf, 64, prof.device_memory_bytes, tail=0.4, sync_s=0.0)
    for mode in ("temporal", "spatial", "hybrid"):
        row = next(r for r in sp.rows if r.k == 0 and r.placement == mode)
        assert row.step_s == pytest.approx(plan_workflow(wf, 64, prof.device_memory_bytes,
                                                         mode=mode).time, rel=1e-12)  # fmt: skip
    labels = {r.placement for r in sp.rows if not r.placement.startswith("split")}
    for label in labels:  # one placement: the step never grows with K
        steps = [r.step_s for r in sp.rows if r.placement == label]
        assert all(b <= a + 1e-12 for a, b in zip(steps, steps[1:]))
    best = [min(r.step_s for r in sp.rows if r.k == k) for k in range(5)]
    assert all(b <= a + 1e-12 for a, b in zip(best, best[1:]))
    for r in sp.rows:
        assert 0 <= r.mean_staleness <= r.k
        assert (r.mean_staleness == 0) == (r.k == 0) or r.placement == "temporal"


def test_period_formula_by_hand():
    pipe = Pipeline("p", 10.0 + 1.0, (Stage("r", 6.0, 6.0), Stage("t", 5.0)), 1.0, 0.5, 6.0, True)
    assert period(pipe, 0) == pytest.approx(0.5 + 11.0)
    assert period(pipe, 1) == pytest.approx(0.5 + max(5.5, 7.0, 6.0))
    # tail 0.5: K=1 can fill at most half; K=3 all of it, then the trainer binds.
    assert period(pipe, 1, 0.5) == pytest.approx(0.5 + max(5.5, 6.0 - 3.0 + 1.0, 6.0))
    assert period(pipe, 3, 0.5) == pytest.approx(0.5 + 6.0)
    with pytest.raises(ValueError, match="tail"):
        period(pipe, 1, 1.0)


def test_bad_input():
    wf = two_stage()
    with pytest.raises(PlanError, match="max_staleness"):
        plan_staleness(wf, 4, max_staleness=-1)
    with pytest.raises(PlanError, match="rollout components"):
        plan_staleness(wf, 4, rollout=["generator"])
    two_sources = Workflow([_comp("a", 0, 1), _comp("b", 0, 1), _comp("c", 0, 1)],
                           [("a", "c"), ("b", "c")], 4)  # fmt: skip
    with pytest.raises(PlanError, match="name the rollout"):
        plan_staleness(two_sources, 4)
    assert tail_share([]) == 0.0 and tail_share([5, 5, 5]) == 0.0


@pytest.fixture(scope="module")
def app():
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)

    @app.command()
    def other() -> None:
        pass

    return app


def run(app, *args):
    return CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "220"})


def test_cli_prints_a_row_per_k_and_placement_and_marks_one(app):
    res = run(app, str(PPO), "-n", "64", "--staleness")
    assert res.exit_code == 0, res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("│") and "│ " in ln]
    rows = [[c.strip() for c in ln.strip("│").split("│")] for ln in lines]
    stale = [r for r in rows if len(r) == 7 and r[1].isdigit()]
    for k in range(5):  # every placement at every K (the split's device counts vary with K)
        kinds = [r[2].split()[0] for r in stale if r[1] == str(k)]
        assert kinds == ["temporal", "spatial", "hybrid", "split"]
    chosen = [r for r in stale if r[0] == "chosen"]
    assert len(chosen) == 1
    assert "no response-length distribution" in res.stdout
    assert f"staleness: K={chosen[0][1]} on {chosen[0][2]}" in res.stdout
    plain = run(app, str(PPO), "-n", "64")
    assert "bounded staleness" not in plain.stdout


def test_cli_json_and_lengths(app, tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [100] * 60 + [4000] * 4))
    res = run(app, str(CHAIN), "-n", "16", "--staleness", "--max-staleness", "2", "--json",
              "--lengths", str(lengths), "--sync-s", "0.05")  # fmt: skip
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)["staleness"]
    assert {r["k"] for r in doc["rows"]} == {0, 1, 2}
    assert doc["tail_share"] == pytest.approx(1 - (60 * 100 + 4 * 4000) / 64 / 4000)
    assert doc["chosen"] in doc["rows"]
    assert math.isfinite(doc["chosen"]["items_per_s"])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--max-staleness", "-1"], "--max-staleness -1"),
        (["--staleness-slack", "1.5"], "--staleness-slack 1.5"),
        (["--lengths", "lognormal:1,2"], "--lengths"),
    ],
)
def test_cli_bad_staleness_input_is_one_line_exit_2(app, args, words):
    res = run(app, str(CHAIN), "-n", "8", "--staleness", *args)
    assert res.exit_code == 2
    assert words in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_two_steady_state_steps_drawn(app, tmp_path):
    from m2flow.run.plan_gantt import async_chart_rows

    prof = load_profile(PPO)
    sp = plan_staleness(to_workflow(prof), 64, prof.device_memory_bytes, tail=0.6, sync_s=0.5)
    rows, bars, end, title = async_chart_rows(sp)
    pipe = sp.pipelines[(sp.chosen.k, sp.chosen.placement)]
    assert rows == [st.name for st in pipe.stages] and f"K={sp.chosen.k}" in title
    assert end == pytest.approx(2 * sp.chosen.step_s)  # two periods (no overhead here)
    for i in range(len(rows)):  # a stage never works on two batches at once
        spans = sorted((a, z) for r, kind, _, a, z in bars if r == i)
        assert all(z1 <= a2 + 1e-9 for (_, z1), (a2, _) in zip(spans, spans[1:]))
        assert sum(z - a for a, z in spans) <= end + 1e-9
    png = tmp_path / "async.png"
    res = run(app, str(CHAIN), "-n", "16", "--staleness", "--gantt", str(png))
    assert res.exit_code == 0, res.stderr
    assert png.stat().st_size > 0 and "two steady-state steps" in res.stdout


def test_spot_pool_row(app, tmp_path):
    import yaml

    comp = lambda s: {"points": [{"devices": 1, "seconds": 7 * s, "memory_bytes": 4e10},  # noqa: E731
                                 {"devices": 8, "seconds": s, "memory_bytes": 2e10}]}  # fmt: skip
    doc = {
        "workflow": "grpo", "batch_size": 128, "item": "prompt",
        "edges": [{"src": "rollout", "dst": "actor", "items_per_step": 128}],
        "components": {"rollout": comp(120.0), "actor": comp(60.0)},
        "spot": {"instance_items_per_s": 0.3, "devices_per_instance": 2,
                 "expected_instances": 6.53, "weight_sync_s": 2.0},
    }  # fmt: skip
    path = tmp_path / "spot.yaml"
    path.write_text(yaml.safe_dump(doc))
    rows = {}
    for lengths in ([], ["--lengths", "lognormal:500,1,4096"]):
        res = run(app, str(path), "-n", "8", "--memory-gb", "80", "--staleness", "--json",
                  *lengths)  # fmt: skip
        assert res.exit_code == 0, res.stderr
        out = json.loads(res.stdout)
        assert out["spot"]["best"]["mode"] != "reserved"
        spot = [r for r in out["staleness"]["rows"] if r["placement"] == "spot"]
        assert [r["k"] for r in spot] == [0, 1, 2, 3, 4]
        assert spot[0]["step_s"] == pytest.approx(out["spot"]["best"]["step_s"])  # the spot model
        assert all(b["step_s"] <= a["step_s"] + 1e-12 for a, b in zip(spot, spot[1:]))
        rows[bool(lengths)] = spot
    # The spot model already streams rollout into training: without a tail, asynchrony has
    # nothing left to overlap; with one, partial rollouts fill it.
    assert rows[False][4]["step_s"] == pytest.approx(rows[False][0]["step_s"])
    assert rows[True][2]["step_s"] < 0.97 * rows[True][0]["step_s"]
