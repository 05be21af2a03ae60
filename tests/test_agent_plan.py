"""Agent rollouts in the planner and the emulator (issue 33 item 5): the profile's ``agent:``
block (scheduler/plan/agent.py), the tool wait in the planner's rollout time, ``m2flow plan``'s
tool share, and the emulated engine's agent episodes (workers/rollout/emulated_rollout.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import typer
import yaml
from m2flow.scheduler.plan.agent import agent_from_dict, tool_wait_s
from m2flow.scheduler.plan.profile import ProfileError, load_profile, profile_from_dict
from m2flow.workers.rollout.emulated import EmulatedEngine, ResponseLengths, throughput_preset
from m2flow.workers.rollout.emulated_rollout import (
    agent_draws,
    agent_finish_times,
    rollout_finish_times,
)
from m2flow.workers.rollout.exact import GenRequest
from typer.testing import CliRunner

from m2flow.run.plan_cli import register
from m2flow.run.planning import plan_from_profile, staleness_from_profile

PROFILES = Path(__file__).resolve().parents[1] / "benchmarks" / "profiles"
GRPO = PROFILES / "grpo_2cpu.yaml"
AGENT = PROFILES / "agent_calculator.yaml"


def _doc(agent: dict | None, path: Path = GRPO) -> dict:
    doc = yaml.safe_load(path.read_text())
    doc.pop("agent", None)
    if agent is not None:
        doc["agent"] = agent
    return doc


@pytest.fixture(scope="module")
def app():
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)

    @app.command()
    def other() -> None:  # keeps `plan` a subcommand, as in m2flow's app
        pass

    return app


def _plan_json(app, tmp_path, doc: dict, *args) -> dict:
    path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    res = CliRunner().invoke(app, ["plan", str(path), "--json", *args], env={"COLUMNS": "220"})
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize(
    "agent, match",
    [
        ({"turns": {1: 0.5, 2: 0.4}}, r"agent\.turns: the shares sum to 0\.9, not 1"),
        ({"turns": {0: 1.0}}, r"agent\.turns key 0 = 0: give a number >= 1"),
        ({"turns": 2.5}, r"agent\.turns = 2\.5: give a whole number"),
        ({"tool_latency_s": {"median": 3, "p90": 1}}, r"p90 = 1 s < median = 3 s"),
        ({"tool_latency_s": {"p90": 1}}, r"tool_latency_s: missing median; add median"),
        ({"tool_latency_s": {"median": 1, "samples": [1]}}, r"either samples or median/p90"),
        ({"tool_latency_s": {"samples": []}}, r"samples: give a non-empty list"),
        ({"tool_latency_s": 2.0}, r"give \{median: <s>, p90: <s>\}"),
        ({"tool_latency_s": {"median": -1}}, r"tool_latency_s\.median = -1"),
        ({"tool_timeout_s": 0}, r"agent\.tool_timeout_s = 0: give a number > 0"),
        ({"observation_tokens": -5}, r"agent\.observation_tokens = -5"),
        ({"episodes_per_item": 0}, r"agent\.episodes_per_item = 0"),
        ({"component": "policy"}, r"agent\.component 'policy' is not a profiled component"),
        ({"turn": 2}, r"agent: unknown keys \['turn'\]; known keys"),
        ([1, 2], r"agent: expected a mapping"),
    ],
)
def test_bad_agent_block_names_the_key_and_the_fix(agent, match):
    with pytest.raises(ProfileError, match=match):
        profile_from_dict(_doc(agent))


def test_agent_block_round_trips(tmp_path):
    prof = load_profile(AGENT)
    assert prof.agent is not None and prof.agent.component == "rollout"
    again = profile_from_dict(yaml.safe_load(yaml.safe_dump(prof.to_dict())))
    assert again.agent == prof.agent
    for law in (None, {"samples": [0.5, 2.0]}):
        block = prof.agent.to_dict() | {"tool_latency_s": law, "tool_timeout_s": 3.0}
        agent = agent_from_dict(block)
        assert agent_from_dict(agent.to_dict()) == agent


def test_tool_wait_adds_the_formula_to_the_rollout_time():
    # Every call takes 3 s; half the episodes answer at once (1 turn), half call two tools (3
    # turns). E = 2 x 1 episodes. A turn lasts d = model / T_max, and the slowest episode's
    # path is 6 + 3d when one of the two has 3 turns (p = 3/4), else d:
    # rollout = max(model, 3/4 (6 + 3d) + 1/4 d).
    agent = {"turns": {1: 0.5, 3: 0.5}, "tool_latency_s": {"samples": [3.0]}}
    doc = _doc(agent)
    doc["batch_size"] = 2
    prof = profile_from_dict(doc)
    model = prof.components["rollout"].time_fit()
    from m2flow.scheduler.plan.profile import to_workflow

    comps = {c.name: c for c in to_workflow(prof).components}
    for n in (1, 2, 4):
        m = float(model(n))
        d = m / 3
        want = max(m, 0.75 * (6 + 3 * d) + 0.25 * d)
        assert float(comps["rollout"].time(n)) == pytest.approx(want, rel=1e-9)
        assert prof.agent_rollout_s(n) == pytest.approx((m, want), rel=1e-9)
    # tau = E[max_i S_i] = 3/4 * 6 over the step's 2 episodes; a pipelined chunk's fixed cost
    # grows by one item's (1 episode): E[S] = 1/2 * 6
    base = prof.components["rollout"].chunk_overhead_s
    assert tool_wait_s(prof.agent, 2) == pytest.approx(4.5, rel=1e-9)
    assert comps["rollout"].chunk_overhead == pytest.approx(base + 3.0, rel=1e-9)
    # a one-device temporal plan: the step grows by exactly the tool wait
    plain = profile_from_dict(_doc(None) | {"batch_size": 2})
    with_tools = plan_from_profile(prof, 1, None)[1].predicted_step_s
    without = plan_from_profile(plain, 1, None)[1].predicted_step_s
    m1 = float(model(1))
    assert with_tools - without == pytest.approx(0.75 * (6 + m1) + 0.25 * m1 / 3 - m1, rel=1e-9)


def test_tool_wait_grows_with_latency_and_episodes():
    def tau(median, episodes):
        a = agent_from_dict({"turns": {1: 0.2, 2: 0.5, 3: 0.3},
                             "tool_latency_s": {"median": median, "p90": 3 * median}})  # fmt: skip
        return tool_wait_s(a, episodes)

    assert 0 < tau(1, 8) < tau(1, 64) < tau(1, 512) < tau(4, 512)
    assert tau(4, 512) == pytest.approx(4 * tau(1, 512), rel=1e-6)  # seconds scale linearly
    capped = agent_from_dict({"turns": 3, "tool_latency_s": {"median": 5, "p90": 50},
                              "tool_timeout_s": 2.0})  # fmt: skip
    assert tool_wait_s(capped, 4096) <= 4.0 + 1e-9  # two calls, each cut at 2 s


@pytest.mark.parametrize(
    "agent",
    [
        {"turns": 1, "tool_latency_s": {"median": 5.0, "p90": 20.0}},  # one turn: no tool call
        {"turns": {1: 0.3, 4: 0.7}, "observation_tokens": 100},  # tools answer at once
        {"turns": {2: 1.0}, "tool_latency_s": {"samples": [0.0, 0.0]}},
    ],
)
def test_zero_tool_time_plans_exactly_as_today(app, tmp_path, agent):
    for args in (("--devices", "2"), ("--devices", "2", "--staleness")):
        today = _plan_json(app, tmp_path, _doc(None), *args)
        with_agent = _plan_json(app, tmp_path, _doc(agent), *args)
        assert with_agent.pop("agent")["tool_wait_s"] == 0.0
        assert with_agent == today


def test_plan_prints_the_tool_share(app):
    res = CliRunner().invoke(app, ["plan", str(AGENT), "--devices", "8"], env={"COLUMNS": "220"})
    assert res.exit_code == 0, res.stderr
    assert "agent rollout (rollout on" in res.stdout
    assert "tool share of the rollout stage" in res.stdout
    res = CliRunner().invoke(app, ["plan", str(AGENT), "--devices", "8", "--json"])
    doc = json.loads(res.stdout)["agent"]
    assert 0 < doc["tool_share"] < 1
    assert doc["rollout_s"] == pytest.approx(doc["model_s"] + doc["tool_wait_s"])
    assert doc["tool_share"] == pytest.approx(doc["tool_wait_s"] / doc["rollout_s"])


def test_long_tool_latency_raises_the_chosen_staleness():
    prof = load_profile(AGENT)
    ks = []
    for median in (0.0, 0.05, 2.0, 10.0):
        lat = {"median": median, "p90": 3 * median} if median else None
        block = prof.agent.to_dict() | {"tool_latency_s": lat}
        p = profile_from_dict(_doc(block, AGENT))
        ks.append(staleness_from_profile(p, 8, None).chosen.k)
    assert ks == sorted(ks) and ks[0] < ks[-1], ks


# -- the emulator ------------------------------------------------------------------------------

MODEL = throughput_preset("qwen3-8b")
SHORT = ResponseLengths(median=40, sigma=0.5, cap=256)


def test_turn_counts_follow_the_distribution_and_the_seed():
    agent = agent_from_dict({"turns": {1: 0.1, 2: 0.5, 4: 0.4},
                             "tool_latency_s": {"median": 1.0, "p90": 2.0}})  # fmt: skip
    keys = [(0, p, s) for p in range(500) for s in range(8)]
    turns, lat = agent_draws(agent, keys, seed=7)
    counts = np.bincount(turns, minlength=5)
    n = len(keys)
    for t, share in ((1, 0.1), (2, 0.5), (4, 0.4)):
        assert abs(counts[t] - share * n) < 4 * np.sqrt(n * share * (1 - share)), counts
    assert counts[0] == counts[3] == 0
    assert lat.shape == (n, 3) and np.median(lat) == pytest.approx(1.0, rel=0.1)
    again, _ = agent_draws(agent, keys, seed=7)
    other, _ = agent_draws(agent, keys, seed=8)
    assert np.array_equal(turns, again) and not np.array_equal(turns, other)


def test_emulated_episodes_take_their_turns_and_wait_their_tools():
    agent = agent_from_dict({"turns": {1: 0.25, 2: 0.25, 3: 0.5}, "observation_tokens": 20,
                             "tool_latency_s": {"median": 0.5, "p90": 2.0}})  # fmt: skip
    keys = [(3, p, s) for p in range(16) for s in range(4)]
    out = agent_finish_times(MODEL, SHORT, agent, keys, 2, seed=1, max_batch=16, block=16)
    turns, lat = agent_draws(agent, keys, seed=1)
    assert np.array_equal(out.turns, turns)
    calls = np.arange(2)[None, :] < (turns - 1)[:, None]
    assert np.allclose(out.tool_s, (lat * calls).sum(axis=1))
    assert np.all(out.finish_s >= out.tool_s) and np.all(np.isfinite(out.finish_s))
    assert np.all(out.model_tokens >= turns)  # at least one token per turn
    # the engines' busy time is device work only: the step outlasts it by the tool waits
    assert out.step_s > out.busy_s.max()
    slow = agent_from_dict(agent.to_dict() | {"tool_latency_s": {"median": 5.0, "p90": 20.0}})
    later = agent_finish_times(MODEL, SHORT, slow, keys, 2, seed=1, max_batch=16, block=16)
    assert later.step_s > out.step_s


def test_one_turn_emulates_exactly_the_single_turn_rollout():
    agent = agent_from_dict({"turns": 1, "tool_latency_s": {"median": 3.0, "p90": 9.0}})
    keys = [(0, p, s) for p in range(24) for s in range(4)]
    out = agent_finish_times(MODEL, SHORT, agent, keys, 3, seed=2, max_batch=8, block=16)
    finish, tokens = rollout_finish_times(MODEL, SHORT, keys, 3, seed=2, max_batch=8, block=16)
    assert np.array_equal(out.finish_s, finish)
    assert np.array_equal(out.model_tokens, tokens)


def test_prefix_cache_prefills_only_the_new_tokens():
    times: list[float] = []
    eng = EmulatedEngine(MODEL, ResponseLengths(median=30, sigma=0.0, cap=64), 1, 2,
                         sleep=times.append, prefix_cache=True)  # fmt: skip
    first = GenRequest("ep", [0] * 500, (0, 0, 0), 64)
    eng.step([first], 64, 0)
    cached = 500 + len(first.tokens)
    assert eng.cached == {"ep": cached}  # kept after the turn ended
    nxt = GenRequest("ep", [0] * (cached + 40), (0, 0, 1 << 20), 64)  # + a 40-token observation
    before = eng.emulated_s
    eng.step([nxt], 1, 0)
    want = MODEL.prefill_s([40], [cached]) + MODEL.decode_step_s(1, cached + 40)
    assert eng.emulated_s - before == pytest.approx(want, rel=1e-12)
    plain = EmulatedEngine(MODEL, ResponseLengths(median=30, sigma=0.0, cap=64), 1, 2,
                           sleep=times.append)  # fmt: skip
    plain.step([GenRequest("ep", [0] * 500, (0, 0, 0), 64)], 64, 0)
    assert plain.cached == {}  # off: a finished request keeps nothing
