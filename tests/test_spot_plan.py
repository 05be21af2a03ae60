"""Plans that place rollout on a spot pool (m2flow.scheduler.spot.plan, m2flow.run.planning,
``m2flow plan --spot-trace/--price/--objective``): the model's optimum, the reserved-only
fallback, moving a rollout-bound workflow to a cheap pool, YAML round trips, clear errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from m2flow.scheduler.plan.profile import (
    ProfileError,
    load_profile,
    profile_from_dict,
    save_profile,
)
from m2flow.scheduler.spot.plan import Prices, SpotPlanError, SpotPool, plan_rollout, tail_term
from m2flow.workers.rollout.config import RolloutOptions
from m2flow.workers.rollout.spot.config import SpotPoolConfig
from typer.testing import CliRunner

from m2flow.core.config import ConfigError
from m2flow.core.placement import Placement, PlacementError, merge_options
from m2flow.run.cli import app
from m2flow.run.planning import plan_from_profile, plan_with_remote

GiB = 1 << 30
B, N = 128, 8


def _doc(spot: dict | None = None, rollout_s: float = 120.0, actor_s: float = 60.0) -> dict:
    """A GRPO-shaped profile (rollout -> actor) measured on 1 and 8 devices."""
    comp = lambda s: {"points": [{"devices": 1, "seconds": 7 * s, "memory_bytes": 4e10},  # noqa: E731
                                 {"devices": 8, "seconds": s, "memory_bytes": 2e10}]}  # fmt: skip
    doc = {
        "workflow": "grpo",
        "batch_size": B,
        "item": "prompt",
        "edges": [{"src": "rollout", "dst": "actor", "items_per_step": B}],
        "components": {"rollout": comp(rollout_s), "actor": comp(actor_s)},
        "prices": {"reserved": 10.47, "spot": 2.66},
    }
    if spot is not None:
        doc["spot"] = spot
    return doc


def _plan(doc: dict, **kw):
    return plan_with_remote(profile_from_dict(doc), N, 80 * GiB, "auto", **kw)


POOL = {"instance_items_per_s": 0.3, "devices_per_instance": 2, "expected_instances": 6.53,
        "weight_sync_s": 2.0}  # fmt: skip


@pytest.mark.parametrize(
    "rate,n_bar,sync,train",
    [(0.3, 6.53, 2.0, 60.0), (0.05, 4.58, 10.0, 30.0), (1.0, 6.06, 0.0, 90.0), (0.1, 2.0, 5, 5)],
)
def test_window_and_cap_are_the_optimum_of_the_model(rate, n_bar, sync, train):
    """The closed-form T* (and the searched N_prem) match a brute force over a fine grid of
    windows and every cap, evaluating the model's step directly."""
    R, reserved = 120.0, 175.0
    pool = SpotPool(instance_items_per_s=rate, expected_instances=n_bar, weight_sync_s=sync,
                    devices_per_instance=2)  # fmt: skip
    sp = plan_rollout(B, reserved, R, train, N, pool, Prices(10.47, 2.66), "time")
    best = reserved
    for n_prem in range(1, math.ceil(n_bar) + 1):
        held = min(n_prem, n_bar)
        t = np.linspace(0.0, R, 200_001)[:-1]  # T < R: a spot choice
        steps = np.maximum(t + train, sync + B * (1 - t / R) / (held * rate))
        best = min(best, float(steps.min()))
    assert sp.best.step_s == pytest.approx(best, rel=1e-5)
    assert sp.best.step_s <= min(c.step_s for c in sp.runner_ups) + 1e-9


def test_tail_term_is_the_streaming_trainers_end():
    """tail_term's end equals a step-by-step simulation of a trainer taking complete groups
    as they come (each t_train / B), and the floor it gives bounds the spot step."""
    rng = np.random.default_rng(0)
    ends = list(rng.lognormal(4.0, 1.0, B))
    train = 90.0
    tail, f = tail_term(ends, train)
    clock = 0.0
    for g in sorted(ends):  # one trainer: starts a group when it is complete and it is free
        clock = max(clock, g) + train / B
    assert tail == max(ends)
    assert tail + f * train == pytest.approx(clock, rel=1e-12)
    assert 1 / B - 1e-12 <= f <= 1
    # all groups complete at once: the whole training waits for them
    assert tail_term([5.0] * B, train) == (5.0, pytest.approx(1.0))
    pool = SpotPool(instance_items_per_s=100.0, expected_instances=8, tail_s=tail,
                    tail_train_fraction=f)  # fmt: skip
    fast = plan_rollout(B, 1e4, 120.0, train, N, pool, Prices(), "time").best
    assert fast.mode != "reserved" and fast.step_s == pytest.approx(tail + f * train)
    with pytest.raises(SpotPlanError, match="at least one group"):
        tail_term([], train)


def test_zero_expected_instances_gives_the_reserved_only_plan():
    doc = _doc({**POOL, "expected_instances": 0})
    _, placement, sp = _plan(doc)
    _, reserved = plan_from_profile(profile_from_dict(_doc()), N, 80 * GiB, "auto")
    assert sp.best.mode == "reserved" and sp.runner_ups == ()
    assert placement.options == {}
    assert {**placement.to_dict(), "remote": {}} == reserved.to_dict()


def test_cheap_available_pool_takes_rollout_of_a_rollout_bound_workflow():
    doc = _doc({**POOL, "instance_items_per_s": 1.0, "expected_instances": 8},
               rollout_s=200.0, actor_s=20.0)  # fmt: skip
    doc["prices"] = {"reserved": 10.47, "spot": 0.01}
    for objective in ("time", "cost", "tokens_per_dollar"):
        result, placement, sp = _plan(doc, objective=objective)
        assert sp.best.mode in ("spot", "seeded"), (objective, sp)
        reserved = next(c for c in sp.runner_ups if c.mode == "reserved")
        assert sp.best.step_s < result.time and sp.best.cost_per_step < reserved.cost_per_step
        opts = placement.options["rollout"]["options"]["spot"]
        assert opts["enabled"] and opts["n_prem_init"] == sp.best.n_prem >= 1
        assert "seeding" not in opts and "n_prem_max" not in opts  # Algorithm 1 adapts both
        assert opts["t_seed_init"] == pytest.approx(sp.best.t_seed)
        assert placement.groups["rollout"] == list(range(N))  # seeds on every reserved device
        assert placement.predicted_step_s == pytest.approx(sp.best.step_s)
    # A slow, dear pool: the cost objective keeps rollout reserved.
    doc["spot"] = {**POOL, "instance_items_per_s": 0.01}
    doc["prices"] = {"reserved": 10.47, "spot": 50.0}
    _, placement, sp = _plan(doc, objective="cost")
    assert sp.best.mode == "reserved" and placement.options == {}


def test_seeding_pays_where_the_weight_push_would_idle_the_trainer():
    """A pool as fast as training but with a long weight push: seeding fills the push."""
    doc = _doc({**POOL, "instance_items_per_s": 0.5, "weight_sync_s": 30.0})
    _, _, sp = _plan(doc)
    assert sp.best.mode == "seeded" and 0 < sp.best.t_seed < 120
    no_seed = next(c for c in sp.runner_ups if c.mode == "spot")
    assert sp.best.step_s < no_seed.step_s


def test_plan_and_profile_round_trip_to_yaml(tmp_path):
    prof = profile_from_dict(_doc(POOL))
    save_profile(prof, tmp_path / "p.yaml")
    again = load_profile(tmp_path / "p.yaml")
    assert again.spot == prof.spot and again.prices == prof.prices
    _, placement, sp = plan_with_remote(again, N, 80 * GiB, "auto")
    placement.save(tmp_path / "plan.yaml")
    loaded = Placement.load(tmp_path / "plan.yaml")
    assert loaded.to_dict() == placement.to_dict()
    assert loaded.remote["spot"]["best"]["mode"] == sp.best.mode != "reserved"


def _cli(*args):
    return CliRunner().invoke(app, ["plan", *map(str, args)], env={"COLUMNS": "220"})


def test_cli_prints_the_choice_and_saves_the_spot_options(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(_doc(POOL)))
    trace = tmp_path / "t.csv"
    trace.write_text("t_s,instances\n0,2\n100,4\n200,4\n")  # mean 3 over [0, 200]
    r = _cli(prof, "-n", N, "--memory-gb", 80, "--spot-trace", trace, "--price",
             "reserved=10,spot=1", "--objective", "cost", "--json")  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    best = doc["spot"]["best"]
    assert best["instances"] <= 3.0 and doc["spot"]["objective"] == "cost"
    assert {c["mode"] for c in doc["spot"]["runner_ups"]} >= {"reserved"}
    assert doc["predicted_step_s"] == pytest.approx(best["step_s"])
    r = _cli(prof, "-n", N, "--memory-gb", 80, "--save", tmp_path / "plan.yaml")
    assert r.exit_code == 0, r.output
    assert "rollout: reserved or spot" in r.output and "runner-up" in r.output
    saved = Placement.load(tmp_path / "plan.yaml")
    assert saved.options["rollout"]["options"]["spot"]["enabled"] is True


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--price", "reserved=cheap"], "--price"),
        (["--price", "gold=1"], "--price"),
        (["--objective", "speed"], "--objective"),
        (["--spot-trace", "/nonexistent.csv"], "--spot-trace"),
    ],
)
def test_bad_cli_spot_input_exits_2_naming_it(tmp_path, args, needle):
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(_doc(POOL)))
    r = _cli(prof, "-n", N, *args)
    assert r.exit_code == 2 and needle in r.output, r.output


PROFILED = Path(__file__).resolve().parent / "profiles" / "grpo_flat_rollout.yaml"


def test_spot_plan_from_a_profiler_written_profile(tmp_path):
    """A profile as ``m2flow profile`` writes it (no ``spot:`` section) plans spot rollout:
    instances assumed like one reserved device at the rollout's measured 1-device rate, said
    on stderr; ``--gantt`` draws the chosen spot plan, its spot row included."""
    from m2flow.run.plan_gantt import chart_rows, spot_parts
    from m2flow.run.planning import load_profile

    trace = tmp_path / "t.csv"
    trace.write_text("t_s,instances\n0,8\n100,8\n")
    png = tmp_path / "step.png"
    r = _cli(PROFILED, "-n", 2, "--spot-trace", trace, "--gantt", png, "--json")
    assert r.exit_code == 0, r.output
    assert "has no spot: section; assumed instances like one reserved device" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["spot"]["best"]["mode"] != "reserved" and png.stat().st_size > 0
    prof = load_profile(PROFILED)
    rate = prof.batch_size / prof.components["rollout"].time_fit()(1)
    pool = SpotPool(instance_items_per_s=rate, expected_instances=8.0)
    prof = replace(prof, spot=pool)
    result, _, sp = plan_with_remote(prof, 2, None, "auto", runner_ups=True)
    rows, bars, end, _ = chart_rows(result, prof, sp, spot_parts(prof, 2, math.inf, "auto"))
    assert any("spot instance" in row for row in rows) and "sync" in {b[1] for b in bars}
    assert "rollout" not in {
        b[2]
        for b in bars
        if b[0] >= rows.index(next(r for r in rows if r.startswith(("actor", "reward"))))
    }  # rollout left the devices
    assert end == pytest.approx(sp.best.step_s, rel=0.05)


def test_spot_options_without_a_rollout_component_name_the_keys(tmp_path):
    doc = _doc()
    doc["components"] = {
        "generate": doc["components"]["rollout"],
        "actor": doc["components"]["actor"],
    }
    doc["edges"] = [{"src": "generate", "dst": "actor", "items_per_step": B}]
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump(doc))
    r = _cli(prof, "-n", N, "--objective", "cost")
    assert r.exit_code == 2 and "spot: {component: <the rollout group>" in r.output, r.output
    assert "instance_items_per_s" in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "spot,needle",
    [
        ({"instance_items_per_s": 0}, "instance_items_per_s"),
        ({"instance_items_per_s": 1, "component": "critic"}, "not a profiled component"),
        ({"instance_items_per_s": 1, "devices_per_instance": 0}, "devices_per_instance"),
        ({"instance_items_per_s": 1, "expected_instances": -1}, "expected_instances"),
        ({"instance_items_per_s": 1, "max_instances": 2.5}, "max_instances"),
        ({"instance_items_per_s": 1, "tail_train_fraction": 1.5}, "tail_train_fraction"),
        ({"instance_items_per_s": 1, "tail_s": -1}, "tail_s"),
        ({"expected_instances": 3}, "missing"),
    ],
)
def test_bad_spot_section_is_a_profile_error(spot, needle):
    with pytest.raises(ProfileError, match=needle):
        profile_from_dict(_doc(spot))


def test_pool_on_a_cycle_is_refused():
    doc = _doc(POOL)
    doc["edges"].append({"src": "actor", "dst": "rollout", "items_per_step": B})
    doc["cycles"] = [{"members": ["rollout", "actor"], "round_trips": 1}]
    with pytest.raises(ConfigError, match="on a cycle"):
        _plan(doc)


def test_bad_prices_and_objective():
    with pytest.raises(SpotPlanError, match="price spot"):
        Prices(reserved=1.0, spot=-1.0)
    with pytest.raises(SpotPlanError, match="objective"):
        plan_rollout(B, 1.0, 1.0, 1.0, N, SpotPool(), Prices(), "fastest")  # type: ignore


def test_plan_options_merge_into_the_runner_kwargs():
    runner = {"n_samples": 8, "spot": {"enabled": False, "theta": 8}}
    merged = merge_options(runner, {"spot": {"enabled": True, "t_seed_init": 3.0}})
    assert merged == {"n_samples": 8, "spot": {"enabled": True, "theta": 8, "t_seed_init": 3.0}}
    assert runner["spot"] == {"enabled": False, "theta": 8}  # not modified
    with pytest.raises(PlacementError, match="another workflow"):
        merge_options({"spot": 1}, {"spot": {"enabled": True}})
    # a role's typed options: the plan's dict reaches into its fields (nested records too)
    runner = {"options": RolloutOptions(n_samples=8, spot={"theta": 4})}
    plan = {"options": {"spot": {"enabled": True, "t_seed_init": 3.0}}}
    merged = merge_options(runner, plan)["options"]
    assert isinstance(merged, RolloutOptions) and isinstance(merged.spot, SpotPoolConfig)
    assert (merged.n_samples, merged.spot.enabled, merged.spot.theta) == (8, True, 4)
    assert merged.spot.t_seed_init == 3.0 and not runner["options"].spot.enabled  # a copy
    with pytest.raises(PlacementError, match="options.spots: the runner's options"):
        merge_options(runner, {"options": {"spots": {"enabled": True}}})
    with pytest.raises(PlacementError, match="another workflow"):
        merge_options(runner, {"options": 1})


def _service_doc(**svc) -> dict:
    doc = _doc(POOL)
    doc["components"]["reward"] = {"points": [{"devices": 1, "seconds": 30.0,
                                               "memory_bytes": 1e9}]}  # fmt: skip
    doc["edges"] = [{"src": "rollout", "dst": "reward", "items_per_step": B},
                    {"src": "reward", "dst": "actor", "items_per_step": B}]  # fmt: skip
    doc["reward_service"] = {"component": "reward", **svc}
    return doc


def test_reward_service_component_leaves_the_reserved_plan_and_adds_its_delay():
    doc = _service_doc(extra_delay_s=0.62, tail_s=0.05)
    del doc["spot"]
    result, placement, sp = _plan(doc)
    assert sp is None and "reward" not in placement.groups
    assert all("reward" not in leaf.components for leaf in result.leaves())
    # The same plan as rollout -> actor alone (the edge bridged), plus the service's seconds.
    bridged = _doc()
    del bridged["prices"]
    _, alone = plan_from_profile(profile_from_dict(bridged), N, 80 * GiB, "auto")
    assert placement.groups == alone.groups and placement.granularity == alone.granularity
    assert placement.predicted_step_s == pytest.approx(alone.predicted_step_s + 0.67)
    assert placement.remote["reward_service"]["extra_delay_s"] == 0.62
    # With a spot pool as well, every choice pays the service's seconds.
    _, with_spot, sp = _plan(_service_doc(extra_delay_s=0.62, tail_s=0.05))
    assert with_spot.remote["reward_service"] and sp.best.mode != "reserved"
    assert with_spot.predicted_step_s == pytest.approx(sp.best.step_s)
    assert sp.best.step_s > 0.67


@pytest.mark.parametrize(
    "svc,needle",
    [
        ({"component": "critic"}, "not a profiled component"),
        ({"component": "rollout"}, "both 'rollout'"),
        ({"extra_delay_s": -1}, "extra_delay_s"),
        ({"latency": 1}, "unknown keys"),
    ],
)
def test_bad_reward_service_section_is_a_profile_error(svc, needle):
    doc = _service_doc()
    doc["reward_service"] = {"component": "reward", **svc}
    with pytest.raises(ProfileError, match=needle):
        profile_from_dict(doc)


def test_a_plan_option_the_worker_does_not_take_is_refused_in_the_driver():
    """A plan saved before the rollout's options were typed (``rollout: {spot: ...}``) names
    the option and the fix before any actor starts, not as a TypeError inside one."""
    from m2flow.workers.rollout.worker import RolloutWorker

    from m2flow.core.group import _check_plan_options

    kwargs = {"options": RolloutOptions(), "spot": {"enabled": True}}
    with pytest.raises(PlacementError, match=r"rollout\.spot: RolloutWorker takes no .*re-plan"):
        _check_plan_options(RolloutWorker, "rollout", kwargs, {"spot": {"enabled": True}})
    _check_plan_options(RolloutWorker, "rollout", kwargs, {"options": {"spot": {}}})  # taken
