"""Agent rollouts: the planner's predicted rollout seconds per step against the emulated engine's,
for a few tool latencies (issue 33 item 5; docs/results/planning.md, "Agents").

A simulation, deterministic by seed: no Ray, no sleeping, every time modelled seconds
(:func:`m2flow.workers.rollout.emulated_rollout.agent_finish_times`). The workload, a calculator
/ code-tool agent at cluster scale: Qwen3-8B on TP-2 engines (2 x H100 each; a *device* of the
profile is one engine), 64 prompts x 8 episodes a step, turns per episode {1: 0.2, 2: 0.4,
3: 0.3, 4: 0.1}, each turn's response lognormal (median 300 tokens, sigma 0.6, cap 2048),
300-token prompts, 50 observation tokens per tool call, at most 256 running requests per
engine, 32-token blocks.

1. **Profile** (``--profile-out``): the rollout's points are the emulated step with tools
   answering at once (median over ``--repeats`` seeds) on 1, 2, 4, 8 engines; the actor's are
   modelled, 10 P T FLOPs at MFU 0.4 (T: the step's tokens, prompts + turns + observations).
   ``benchmarks/profiles/agent_calculator.yaml`` is this file with the sandbox tool latency.
2. **Predicted vs emulated**: per tool-latency setting (``SETTINGS``) and engine count, the
   planner's rollout seconds (:class:`m2flow.scheduler.plan.agent.AgentRolloutTime` over the
   profile's fit) and the emulated step's over ``--repeats`` seeds, settings interleaved within
   each repeat: mean, median, min and max (the spread is the draws': the times are noise-free).
3. **Plans**: ``m2flow plan`` and ``--staleness`` on ``--devices`` devices per setting: the
   chosen plan, its predicted step, and the chosen K.

    python benchmarks/agent_plan.py                 # ~1-2 min on one core
    python benchmarks/agent_plan.py --repeats 3 --engines 2 --out /tmp/a.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml
from m2flow.scheduler.plan.agent import AgentRolloutTime, agent_from_dict, tool_wait_s
from m2flow.scheduler.plan.profile import profile_from_dict
from m2flow.workers.rollout.emulated import ResponseLengths, throughput_preset
from m2flow.workers.rollout.emulated_rollout import agent_finish_times

ROOT = Path(__file__).resolve().parent
PROMPTS, GROUP = 64, 8
TURNS = {1: 0.2, 2: 0.4, 3: 0.3, 4: 0.1}
LENGTHS = ResponseLengths(median=300, sigma=0.6, cap=2048)
PROMPT_TOKENS, OBS_TOKENS, MAX_BATCH, BLOCK = 300, 50, 256, 32
PROFILE_ENGINES = (1, 2, 4, 8)
MFU, GPUS_PER_DEVICE, BF16 = 0.4, 2, 989.4e12
# name -> tool_latency_s of the agent: block (None: tools answer at once)
SETTINGS = {
    "none": None,
    "calculator (in process)": {"median": 0.05, "p90": 0.2},
    "code sandbox": {"median": 2.0, "p90": 6.0},
    "remote API": {"median": 10.0, "p90": 30.0},
}
SANDBOX = "code sandbox"


def agent_block(latency) -> dict:
    block = {"component": "rollout", "episodes_per_item": GROUP, "turns": dict(TURNS),
             "observation_tokens": OBS_TOKENS}  # fmt: skip
    if latency is not None:
        block["tool_latency_s"] = dict(latency)
    return block


def emulate(latency, engines: int, seed: int):
    """One emulated step (an :class:`AgentRollout`) of the workload at ``seed``."""
    model = throughput_preset("qwen3-8b")
    keys = [(seed, p, s) for p in range(PROMPTS) for s in range(GROUP)]
    return agent_finish_times(model, LENGTHS, agent_from_dict(agent_block(latency)), keys,
                              engines, seed=seed, max_batch=MAX_BATCH, block=BLOCK,
                              prompt_tokens=PROMPT_TOKENS)  # fmt: skip


def build_profile(repeats: int) -> dict:
    """The profile document (module docstring, 1), with the sandbox latency."""
    points, tokens = [], []
    for n in PROFILE_ENGINES:
        runs = [emulate(None, n, seed) for seed in range(repeats)]
        points.append({"devices": n, "seconds": round(statistics.median(r.step_s for r in runs), 3),
                       "memory_bytes": 0})  # fmt: skip
        for r in runs:  # prompt once, each turn's tokens, an observation per tool call
            tokens.append(
                float(np.sum(PROMPT_TOKENS + r.model_tokens + OBS_TOKENS * (r.turns - 1)))
            )
    params = throughput_preset("qwen3-8b").params
    train_1 = 10 * params * statistics.mean(tokens) / (GPUS_PER_DEVICE * BF16 * MFU)
    actor = [{"devices": n, "seconds": round(train_1 / n, 3), "memory_bytes": 0}
             for n in PROFILE_ENGINES]  # fmt: skip
    comp = {"min_devices": 1, "max_devices": None, "switch_s": 0.0, "chunk_overhead_s": 0.0}
    return {
        "workflow": "agent calculator (emulated)",
        "batch_size": PROMPTS,
        "item": "prompt",
        "device_memory_bytes": None,
        "step_overhead_s": 0.0,
        "edges": [{"src": "rollout", "dst": "actor", "items_per_step": PROMPTS}],
        "components": {"rollout": {**comp, "points": points}, "actor": {**comp, "points": actor}},
        "agent": agent_block(SETTINGS[SANDBOX]),
    }


def with_latency(prof, latency):
    """``prof`` with the agent's tool latency replaced."""
    return replace(prof, agent=agent_from_dict(agent_block(latency), prof.components))


def plans(prof, devices: int) -> dict:
    """The chosen plan and K for ``prof`` on ``devices`` devices (``m2flow plan`` and
    ``--staleness``'s choices)."""
    from m2flow.run.planning import plan_from_profile, staleness_from_profile

    result, placement = plan_from_profile(prof, devices, None, runner_ups=True)
    sp = staleness_from_profile(prof, devices, None)
    by_k = {}
    for r in sp.rows:
        if r.k not in by_k or r.items_per_s > by_k[r.k]["items_per_s"]:
            by_k[r.k] = {"placement": r.placement, "step_s": r.step_s, "items_per_s": r.items_per_s}
    return {
        "plan": result.plan.shape(),
        "kind": result.plan.kind(),
        "step_s": placement.predicted_step_s,
        "chosen_k": sp.chosen.k,
        "chosen_placement": sp.chosen.placement,
        "chosen_step_s": sp.chosen.step_s,
        "best_per_k": by_k,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10, help="seeds per setting (and per point)")
    ap.add_argument("--engines", type=int, nargs="+", default=[1, 2, 8], help="engine counts")
    ap.add_argument("--devices", type=int, default=8, help="devices for the plan choice")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "agent_plan.json")
    ap.add_argument(
        "--profile-out", type=Path, default=ROOT / "results" / "agent_plan_profile.yaml"
    )
    args = ap.parse_args()
    t0 = time.time()
    doc = build_profile(args.repeats)
    args.profile_out.write_text(
        "# benchmarks/agent_plan.py --profile-out: rollout emulated with tools answering at once,\n"
        "# actor modelled (10 P T FLOPs, MFU 0.4); a device is one TP-2 engine (2 x H100).\n"
        + yaml.safe_dump(doc, sort_keys=False)
    )
    prof = profile_from_dict(doc)
    fit = prof.components["rollout"].time_fit()
    episodes = PROMPTS * GROUP
    emulated: dict[tuple[str, int], list[float]] = {}
    for seed in range(1000, 1000 + args.repeats):  # repeats outside: settings interleaved
        for name, latency in SETTINGS.items():
            for n in args.engines:
                emulated.setdefault((name, n), []).append(emulate(latency, n, seed).step_s)
    rows = []
    for name, latency in SETTINGS.items():
        agent = agent_from_dict(agent_block(latency))
        for n in args.engines:
            got = emulated[(name, n)]
            model_s = float(fit(n))
            pred = AgentRolloutTime(fit, agent, episodes)(n) if latency else model_s
            mean = statistics.mean(got)
            rows.append({
                "setting": name, "tool_latency_s": latency, "engines": n, "model_s": model_s,
                "predicted_s": float(pred), "tool_share": (pred - model_s) / pred,
                "tau_s": tool_wait_s(agent, episodes), "emulated_mean_s": mean,
                "emulated_median_s": statistics.median(got), "emulated_min_s": min(got),
                "emulated_max_s": max(got), "emulated_s": got,
                "error_of_mean": pred / mean - 1.0,
            })  # fmt: skip
    print(f"{episodes} episodes per step, {args.repeats} seeds per cell (modelled seconds)")
    head = ("setting", "engines", "model s", "predicted s", "tool share", "emulated mean",
            "median", "[min, max]", "pred/mean")  # fmt: skip
    print(" | ".join(head))
    for r in rows:
        print(f"{r['setting']} | {r['engines']} | {r['model_s']:.1f} | {r['predicted_s']:.1f} | "
              f"{100 * r['tool_share']:.0f}% | {r['emulated_mean_s']:.1f} | "
              f"{r['emulated_median_s']:.1f} | [{r['emulated_min_s']:.1f}, "
              f"{r['emulated_max_s']:.1f}] | {1 + r['error_of_mean']:.2f}")  # fmt: skip
    choice = {}
    for name, latency in SETTINGS.items():
        choice[name] = plans(with_latency(prof, latency), args.devices)
        c = choice[name]
        print(
            f"{name}: plan {c['plan']} ({c['kind']}) {c['step_s']:.1f} s; staleness K="
            f"{c['chosen_k']} on {c['chosen_placement']} {c['chosen_step_s']:.1f} s"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "workload": {"prompts": PROMPTS, "episodes_per_prompt": GROUP, "turns": TURNS,
                     "lengths": vars(LENGTHS), "prompt_tokens": PROMPT_TOKENS,
                     "observation_tokens": OBS_TOKENS, "max_batch": MAX_BATCH, "block": BLOCK,
                     "model": "qwen3-8b"},
        "repeats": args.repeats, "profile": doc, "rows": rows, "plans": choice,
        "devices": args.devices, "wall_s": time.time() - t0,
    }, indent=1, default=str))  # fmt: skip
    print(f"wrote {args.out} and {args.profile_out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
