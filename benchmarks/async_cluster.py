"""Asynchronous training at cluster scale (issue 32, "Measure", first bullet): samples/s at
bounded staleness K with partial rollouts on and off, against the best synchronous plan, on
64-512 emulated H100s, each measurement next to the planner's prediction
(:mod:`m2flow.scheduler.plan.staleness`).

    python benchmarks/async_cluster.py             # 64-512 devices, both workloads (~26 min)
    python benchmarks/async_cluster.py --quick     # 64 devices, long-tail, K <= 2 (~2.5 min)
    python benchmarks/async_cluster.py --markdown  # docs/results/async.md's tables from the JSON
    python benchmarks/async_cluster.py --devices 64 128 --ks 0 1 2 4 8

**What runs.** The real runtime: a local Ray session, real WorkerGroups and Channels, real
``sync_weights``, and for K >= 1 :class:`m2flow.run.pipeline.StepPipeline` (K = 0: the plain
sequential loop). Only the GPU work is emulated (``benchmarks/async_cluster_workers.py``): a
rollout group of two ranks, each running one :class:`~m2flow.workers.rollout.emulated.
EmulatedEngine` (a TP-2 Qwen3 engine on 2 x H100, the H100 throughput model) that stands for
half the rollout's engines, and a trainer rank that sleeps the modelled training time and
the weight transfer. Time is compressed: ``time_scale`` modelled seconds per real second,
chosen per workload so a synchronous step takes ~``--step-wall`` real seconds. Samples/s are
per modelled second, measured from real time (wall x time_scale: :func:`trained_period`, the
slope of the trainer's step ends over 6+ steps after a warm-up of K + 2), so the runtime's own
overheads count (reported: ``overhead``, measured minus modelled step at K = 0).

**Workloads** (a step is 128 prompts x 8 samples per 8 GPUs, RLBoost section 6.1, so the
batch grows with the cluster):

- ``long-tail``: Qwen3-8B, response lengths capped lognormal (median 3,000, sigma 1.0, cap
  16,384: RLBoost's, as ``docs/results/emulation.md`` calibrates them), every placement.
- ``short``: Qwen3-8B, short near-uniform responses (lognormal median 512, sigma 0.05, cap
  1,024), colocated (``mode=temporal``): where asynchrony should not pay.

**Training time** (``async_cluster_workers.train_seconds``): ``10 P T / (G x 989.4 TFLOP/s x
0.4)`` for ``T`` tokens on ``G`` GPUs, and a weight update ``2 s + 2P bytes / 200 GB/s``: the
RLBoost emulation's ``TrainModel`` (``benchmarks/spot_cluster_model.py``; the MFU and the
transfer are chosen numbers there).

**The planner's side.** A planner device is one TP-2 pair (2 GPUs). The profile of the
workload: the rollout's seconds on ``d`` pairs (one engine's time for its ``B / d`` responses,
:func:`~m2flow.workers.rollout.emulated_rollout.rollout_finish_times`: the same loop the
ranks run, without sleeping; exact at grid points, linear in between) and the trainer's
(``train_seconds``, exact). :func:`~m2flow.scheduler.plan.staleness.plan_staleness` gives the
rows per (K, placement) and the choice; the tail share ``u`` is given two ways:
``u_len = tail_share(lengths)`` (what ``m2flow plan --staleness --lengths`` uses) and
``u_time``, the share of one engine's rollout time a continuously refilled engine saves
(``1 - f(4n) / 4 f(n)``, ``f(n)``: seconds for ``n`` responses), the module docstring's own
definition measured on the engine. Each measured placement is the best split (or colocated
plan) the planner finds for that K under ``u_time``; its prediction under both is printed.

Writes ``benchmarks/results/async_cluster.json``; figures in ``docs/results/async.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION", "0.05")

from async_cluster_report import goals, markdown, rescore, trained_period  # noqa: E402
from async_cluster_workers import (  # noqa: E402
    SAMPLES,
    EmuRollout,
    EmuTrainer,
    sync_seconds,
    train_seconds,
)
from m2flow.scheduler.plan.planner import Component, Workflow  # noqa: E402
from m2flow.scheduler.plan.staleness import (  # noqa: E402
    Pipeline,
    Stage,
    capped_lognormal,
    mean_staleness,
    period,
    plan_staleness,
    tail_share,
)
from m2flow.workers.rollout.emulated import ResponseLengths, throughput_preset  # noqa: E402
from m2flow.workers.rollout.emulated_rollout import rollout_finish_times  # noqa: E402

OUT = HERE / "results" / "async_cluster.json"
MAX_BATCH, BLOCK, SEED = 256, 256, 0
RANKS = 2  # rollout ranks (each stands for half the rollout's engines)


@dataclass(frozen=True)
class Workload:
    name: str
    median: float
    sigma: float
    cap: int
    mode: str = "auto"  # the planner's placements: auto (all) or temporal (colocated only)
    preset: str = "qwen3-8b"
    prompt_tokens: int = 200
    per_pair: int = 256  # responses per TP-2 pair per step (128 x 8 per 8 GPUs)

    @property
    def lengths(self) -> tuple:
        return (self.median, self.sigma, self.cap)


LONG = Workload("long-tail", 3000.0, 1.0, 16384)
SHORT = Workload("short", 512.0, 0.05, 1024, mode="temporal")


# -- the profile (one engine's rollout time, the trainer's) ----------------------------------


PROFILE_STEP0 = 1000  # the profile averages the draws of steps 1000, 1001, ... (never run)


PROFILE = {"steps": 3}  # draws the profile averages (--quick: 1)


def engine_s(wl: Workload, prompts: int) -> tuple[float, float]:
    return _engine_s(wl, prompts, PROFILE["steps"])


@cache
def _engine_s(wl: Workload, prompts: int, profile_steps: int) -> tuple[float, float]:
    """(seconds, mean response tokens) of the rollout group when each of its :data:`RANKS`
    engines takes ``prompts`` x 8 responses: the slowest engine's time, averaged over
    ``profile_steps`` draws (modelled; the ranks' loop without sleeping), as ``m2flow
    profile`` measures the rollout group."""
    ends, toks = [], []
    for step in range(PROFILE_STEP0, PROFILE_STEP0 + profile_steps):
        worst = 0.0
        for r in range(RANKS):
            keys = [(step, r * prompts + p, s) for p in range(prompts) for s in range(SAMPLES)]
            fin, tok = rollout_finish_times(
                throughput_preset(wl.preset), ResponseLengths(*wl.lengths), keys, 1, SEED,
                MAX_BATCH, BLOCK, wl.prompt_tokens, wl.cap,
            )  # fmt: skip
            worst = max(worst, float(fin.max()))
            toks.append(float(tok.mean()))
        ends.append(worst)
    return float(np.mean(ends)), float(np.mean(toks))


def share(wl: Workload, devices: int, pairs: int) -> int:
    """Prompts per engine per step when ``pairs`` of the cluster's pairs roll out."""
    return math.ceil(wl.per_pair * (devices // 2) / pairs / SAMPLES)


GRID = (32, 40, 48, 56, 64, 80, 96, 128, 192, 256)  # prompts per engine (profiled)


def rollout_s(wl: Workload, prompts: float) -> float:
    """Seconds of one engine for ``prompts`` prompts: profiled at :data:`GRID` points,
    linear in between, proportional beyond (a full engine's steady rate)."""
    xs = [g for g in GRID]
    ys = [engine_s(wl, g)[0] for g in xs]
    if prompts >= xs[-1]:
        return ys[-1] * prompts / xs[-1]
    if prompts <= xs[0]:
        return ys[0]
    return float(np.interp(prompts, xs, ys))


def mean_tokens(wl: Workload) -> float:
    return engine_s(wl, 128)[1] + wl.prompt_tokens


def params(wl: Workload) -> float:
    return float(throughput_preset(wl.preset).params)


def workflow(wl: Workload, devices: int) -> Workflow:
    """The planner's workflow on ``devices // 2`` pairs; one item per step (no chunking: a
    long-tail rollout's chunk costs its longest response whatever its size)."""
    pairs, batch = devices // 2, wl.per_pair * (devices // 2)
    tokens = batch * mean_tokens(wl)
    roll = Component("rollout", lambda d: rollout_s(wl, wl.per_pair * pairs / d / SAMPLES),
                     lambda d: 0.0)  # fmt: skip
    train = Component("actor", lambda d: train_seconds(params(wl), tokens, 2 * d), lambda d: 0.0)
    return Workflow([roll, train], [("rollout", "actor")], 1)


def tails(wl: Workload) -> dict:
    """``u_len`` (lengths) and ``u_time`` (engine time, continuously refilled) of the rollout
    at one pair's share."""
    n = wl.per_pair // SAMPLES
    u_time = 1.0 - engine_s(wl, 4 * n)[0] / (4 * engine_s(wl, n)[0])
    return {"u_len": tail_share(capped_lognormal(*wl.lengths)), "u_time": max(u_time, 0.0)}


def plan(wl: Workload, devices: int, tail: float, max_k: int):
    s = sync_seconds(params(wl))
    return plan_staleness(
        workflow(wl, devices), devices // 2, max_staleness=max_k, tail=tail, sync_s=s,
        colocated_sync_s=s, rollout=["rollout"], mode=wl.mode,
    )  # fmt: skip


def split_of(label: str) -> tuple[int, int] | None:
    """``split a+b`` -> (a, b); colocated plans -> None."""
    if label.startswith("split "):
        a, b = label[6:].split("+")
        return int(a), int(b)
    return None


def predict(wl: Workload, devices: int, placement: str, k: int, tail: float,
            overhead: float = 0.0) -> dict:  # fmt: skip
    """The planner's period and samples/s for ``placement`` (``colocated`` or ``split a+b``)
    at bound ``k``, tail share ``tail`` and step overhead ``overhead`` (s; the profile's
    ``step_overhead_s``): :func:`period` on the pipeline the planner builds for it."""
    pairs, batch, s = devices // 2, wl.per_pair * (devices // 2), sync_seconds(params(wl))
    tokens = batch * mean_tokens(wl)
    sp = split_of(placement)
    if sp is None:
        r = rollout_s(wl, wl.per_pair / SAMPLES)
        t = train_seconds(params(wl), tokens, 2 * pairs)
        pipe = Pipeline("colocated", r + t + s, (Stage("colocated", r + t, r),), s, overhead, r)
    else:
        a, b = sp
        r = rollout_s(wl, batch / a / SAMPLES)
        t = train_seconds(params(wl), tokens, 2 * b)
        pipe = Pipeline(placement, r + t + s, (Stage("rollout", r, r), Stage("rest", t)), s,
                        overhead, r, True)  # fmt: skip
    step = period(pipe, k, tail)
    return {"step_s": step, "samples_per_s": batch / step,
            "staleness_mean": mean_staleness(pipe, k, tail)}  # fmt: skip


# -- one measured configuration ----------------------------------------------------------------


@dataclass
class Groups:
    """The groups and channels every run shares (launched once): the rollout on devices 0 and
    1, a trainer on both (colocated) and one on device 2 (disaggregated)."""

    rollout: object
    colocated: object
    split: object
    prompts: object
    results: object

    @classmethod
    def launch(cls, cluster, colocated: bool = True, ranks: int = RANKS) -> Groups:
        """Needs 3 devices; ``colocated=False``: no colocated trainer (disaggregated runs
        only); ``ranks``: rollout ranks (1 or 2)."""
        from m2flow import Channel

        return cls(EmuRollout.launch(cluster, [[0], [1]][:ranks], name="rollout"),
                   EmuTrainer.launch(cluster, [[0, 1]], name="trainer_colocated")
                   if colocated else None,
                   EmuTrainer.launch(cluster, [[2]], name="trainer_split"),
                   Channel.create("prompts"), Channel.create("results"))  # fmt: skip

    def shutdown(self) -> None:
        for g in (self.rollout, self.colocated, self.split):
            if g is not None:
                g.shutdown()
        self.prompts.close()
        self.results.close()


def run_config(groups: Groups, wl: Workload, devices: int, placement: str, k: int,
               partial: bool, steps: int, time_scale: float, tag: str) -> dict:  # fmt: skip
    """Run ``steps`` measured steps (after K + 2 warm-up, then K more) of ``placement`` at
    bound ``k``; the period is :func:`trained_period` (real s x time_scale). ``steps`` is
    rounded up to a multiple of K + 1."""
    from m2flow import sync_weights

    pairs = devices // 2
    sp = split_of(placement)
    roll_pairs, train_pairs = sp if sp else (pairs, pairs)
    p_share = share(wl, devices, roll_pairs)
    rollout, prompts, results = groups.rollout, groups.prompts, groups.results
    trainer = groups.colocated if sp is None else groups.split
    ranks = rollout.world_size
    rollout.configure(tag, wl.preset, wl.lengths, p_share, roll_pairs / ranks, partial,
                      time_scale, SEED, MAX_BATCH, BLOCK, wl.prompt_tokens).wait()  # fmt: skip
    trainer.configure(tag, params(wl), 2 * train_pairs, sync_seconds(params(wl)),
                      time_scale).wait()  # fmt: skip
    steps = -(-steps // (k + 1)) * (k + 1)
    # warm-up: the pipeline fills (K + 1 steps) and carried requests settle; after the
    # measured steps, K more keep the pipeline full until the last measured one ends
    warm = k + 2
    total = warm + steps + k
    marks: dict[int, float] = {}
    recs: dict[int, dict] = {}

    def step(n: int) -> dict:
        for r in range(ranks):
            prompts.put_many(list(range(p_share)), key=(tag, n, r))
        gen = rollout.generate(prompts, results, n)
        upd = trainer.train(results, n, ranks)
        g, u = gen.wait(), upd.wait()
        version = sync_weights(trainer, rollout)
        return {"gen": g, "train": u, "version": version}

    def done(n: int, rec: dict) -> None:
        marks[n] = time.time()
        recs[n] = rec

    t0 = time.time()
    try:
        if k == 0:
            for n in range(total):
                done(n, step(n))
        else:
            from m2flow.run.pipeline import StepPipeline

            StepPipeline(max_staleness=k, partial=partial).run(range(total), step, done)
    finally:
        wall = time.time() - t0
    measured = range(warm, warm + steps)
    per_wall = trained_period({n: recs[n]["train"]["t1"] for n in recs}, warm, steps)
    samples = recs[warm]["train"]["samples"]
    step_s = per_wall * time_scale
    crit = [max(x["modelled_s"] for x in recs[n]["gen"]) + recs[n]["train"]["train_s"]
            + sync_seconds(params(wl)) for n in measured]  # fmt: skip
    return {
        "placement": placement, "k": k, "partial": partial, "steps": steps, "warmup": warm,
        "time_scale": time_scale, "wall_s": wall, "samples_per_step": samples,
        "step_s": step_s, "samples_per_s": samples / step_s,
        "rollout_modelled_s": float(np.mean([max(x["modelled_s"] for x in recs[n]["gen"])
                                             for n in measured])),
        "train_modelled_s": float(np.mean([recs[n]["train"]["train_s"] for n in measured])),
        "sync_critical_path_s": float(np.mean(crit)),
        "staleness_mean": float(np.mean([recs[n]["train"]["staleness_mean"] for n in measured])),
        "staleness_max": int(max(recs[n]["train"]["staleness_max"] for n in measured)),
        "carried_in": float(np.mean([sum(x["carried_in"] for x in recs[n]["gen"])
                                     for n in measured])),
        "spans": {n: {"gen": [(x["t0"] - t0, x["t1"] - t0) for x in recs[n]["gen"]],
                      "train": (recs[n]["train"]["t0"] - t0, recs[n]["train"]["t1"] - t0),
                      "done": marks[n] - t0} for n in recs},
    }  # fmt: skip


# -- the experiment ---------------------------------------------------------------------------


def placement_of(row) -> str:
    """A planner row as a placement the runner measures: ``colocated`` or ``split a+b``."""
    if row.placement.startswith("split "):
        return row.placement
    if row.placement in ("temporal", "single"):
        return "colocated"
    raise ValueError(f"placement {row.placement!r} is not measured here")


def best(sp, k: int):
    return max((r for r in sp.rows if r.k == k), key=lambda r: r.items_per_s)


def best_split(sp, k: int):
    return max((r for r in sp.rows if r.k == k and r.placement.startswith("split ")),
               key=lambda r: r.items_per_s, default=None)  # fmt: skip


def configs(wl: Workload, devices: int, ks: list[int], extras: bool = True) -> tuple[list, dict]:
    """What to measure on ``devices``, ``(placement, K, partial)``, and the plans behind it:
    the best synchronous plan (the planner's best K = 0 row); colocated-only workloads: every
    K with partial rollouts; otherwise the planner's best disaggregated split per K (under
    ``u_time`` with partial rollouts, without a tail without them), the K = 1 split also
    synchronously (what the overlap buys on the same devices), the colocated plan at K = 2
    with partial rollouts, and the choice of the planner fed ``u_len`` (what ``m2flow plan
    --staleness --lengths`` would run)."""
    u = tails(wl)
    max_k = max(max(ks), 3)
    pt, pl, p0 = (plan(wl, devices, t, max_k) for t in (u["u_time"], u["u_len"], 0.0))
    runs = [(placement_of(best(pt, 0)), 0, False)]
    if wl.mode == "temporal":  # colocated only: every K with partial rollouts
        runs += [("colocated", k, True) for k in ks if k > 0]
    else:
        sp = best_split(pt, 1)
        if extras:
            runs.append((sp.placement, 0, False))  # the same devices, synchronous
        for k in ks:
            if k == 0:
                continue
            runs.append((best_split(pt, k).placement, k, True))
            if k < 8:  # (K = 8: the reference for K <= 2's share of the gain)
                runs.append((best_split(p0, k).placement, k, False))
        if extras and 2 in ks:  # the tail filled on the colocated plan
            runs.append(("colocated", 2, True))
        if extras:
            runs.append((placement_of(pl.chosen), pl.chosen.k, pl.chosen.k > 0))
    runs = list(dict.fromkeys(runs))
    info = {
        "tails": u,
        "plans": {
            n: {
                "chosen": _row(p.chosen),
                "best_per_k": [_row(best(p, k)) for k in range(max_k + 1)],
            }
            for n, p in (("u_time", pt), ("u_len", pl), ("no_tail", p0))
        },
    }
    return runs, info


def _row(r) -> dict:
    return {"k": r.k, "placement": r.placement, "step_s": r.step_s,
            "items_per_s": r.items_per_s, "mean_staleness": r.mean_staleness}  # fmt: skip


def measure(groups: Groups, wl: Workload, devices: int, ks: list[int], steps: int,
            step_wall: float, extras: bool = True) -> dict:  # fmt: skip
    """Every configuration of :func:`configs` on ``devices``, each with its predictions. The
    first (the best synchronous plan) also measures the runtime's step overhead ``o``
    (measured step less its modelled critical path, modelled seconds), which the predictions
    then carry as the profile's ``step_overhead_s``."""
    runs, info = configs(wl, devices, ks, extras)
    u = info["tails"]
    ts = predict(wl, devices, runs[0][0], 0, 0.0)["step_s"] / step_wall
    out, o = [], 0.0
    for i, (placement, k, partial) in enumerate(runs):
        tag = f"{wl.name}_{devices}_{i}".replace("-", "")
        res = run_config(groups, wl, devices, placement, k, partial, steps, ts, tag)
        if i == 0:
            o = max(res["step_s"] - res["sync_critical_path_s"], 0.0)
        for name in ("u_time", "u_len"):
            p = predict(wl, devices, placement, k, u[name] if partial else 0.0, o)
            res[f"pred_{name}"] = p
            res[f"ratio_{name}"] = p["samples_per_s"] / res["samples_per_s"]
        res["pred_no_overhead"] = predict(wl, devices, placement, k,
                                          u["u_time"] if partial else 0.0)  # fmt: skip
        out.append(res)
        print_row(wl, devices, res, out[0]["samples_per_s"])
    return {
        "devices": devices,
        "batch": wl.per_pair * (devices // 2),
        "overhead_s": o,
        "time_scale": ts,
        **info,
        "runs": out,
    }


HEADER = (f"{'workload':10} {'dev':>4} {'placement':>12} {'K':>2} {'part':>4} {'samples/s':>10} "
          f"{'vs sync':>7} {'pred(u_t)':>10} {'ratio':>6} {'pred(u_l)':>10} {'ratio':>6} "
          f"{'stale':>9} {'wall s':>6}")  # fmt: skip


def print_row(wl: Workload, devices: int, r: dict, sync: float) -> None:
    st = f"{r['staleness_mean']:.2f}/{r['pred_u_time']['staleness_mean']:.2f}"
    print(f"{wl.name:10} {devices:>4} {r['placement']:>12} {r['k']:>2} "
          f"{'on' if r['partial'] else 'off':>4} {r['samples_per_s']:>10.2f} "
          f"{r['samples_per_s'] / sync:>6.2f}x {r['pred_u_time']['samples_per_s']:>10.2f} "
          f"{r['ratio_u_time']:>6.3f} {r['pred_u_len']['samples_per_s']:>10.2f} "
          f"{r['ratio_u_len']:>6.3f} {st:>9} {r['wall_s']:>6.1f}", flush=True)  # fmt: skip


def profile_doc(wl: Workload, devices: int) -> dict:
    """The workload's profile document (:mod:`m2flow.scheduler.plan.profile`; a device is a
    TP-2 pair, one item a step) at every eighth of ``devices // 2`` pairs, for ``m2flow plan
    PROFILE -n PAIRS --staleness``; memory is not modelled (0)."""
    pairs, batch = devices // 2, wl.per_pair * (devices // 2)
    tokens = batch * mean_tokens(wl)
    ds = sorted({max(1, round(pairs * i / 8)) for i in range(1, 9)})

    def comp(seconds) -> dict:
        return {"min_devices": 1, "max_devices": None, "switch_s": 0.0, "chunk_overhead_s": 0.0,
                "points": [{"devices": d, "seconds": round(float(seconds(d)), 3),
                            "memory_bytes": 0} for d in ds]}  # fmt: skip

    return {"workflow": f"async_cluster {wl.name}", "batch_size": 1, "item": "step",
            "device_memory_bytes": None, "step_overhead_s": 0.0,
            "edges": [{"src": "rollout", "dst": "actor", "items_per_step": 1.0}],
            "components": {
                "rollout": comp(lambda d: rollout_s(wl, batch / d / SAMPLES)),
                "actor": comp(lambda d: train_seconds(params(wl), tokens, 2 * d))}}  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="64 devices, long-tail, K = 0, 1, 2, 3 steps, 0.8 s steps, no extra rows",
    )
    ap.add_argument("--devices", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=6, help="measured steps per configuration")
    ap.add_argument(
        "--step-wall",
        type=float,
        default=1.5,
        help="real seconds of a synchronous step (sets the time scale)",
    )
    ap.add_argument("--workloads", nargs="+", default=["long-tail", "short"])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--markdown", action="store_true", help="print --out's tables and exit")
    ap.add_argument(
        "--rescore",
        action="store_true",
        help="recompute --out's samples/s from its spans (trained_period) and exit",
    )
    ap.add_argument(
        "--profile-out",
        type=Path,
        help="write the long-tail profile at the first "
        "--devices (devices = TP-2 pairs) for m2flow plan, and exit",
    )
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown(json.loads(a.out.read_text())))
        return {}
    if a.rescore:
        doc = rescore(json.loads(a.out.read_text()))
        a.out.write_text(json.dumps(doc, indent=1, default=float))
        print(json.dumps(doc["goals"], indent=1, default=float))
        return doc
    if a.profile_out:
        import yaml

        a.profile_out.write_text(yaml.safe_dump(profile_doc(LONG, a.devices[0]), sort_keys=False))
        print(f"wrote {a.profile_out}")
        return {}
    if a.quick:
        a.devices, a.ks, a.steps, a.step_wall = [64], [0, 1, 2], 3, 0.8
        a.workloads, PROFILE["steps"] = ["long-tail"], 1
    import m2flow

    run_dir = Path(tempfile.mkdtemp(prefix="m2async-", dir="/tmp"))
    cluster = m2flow.Cluster(run_dir=run_dir, virtual_devices_per_node=3, num_cpus=2)
    t0 = time.time()
    groups = Groups.launch(cluster)
    print(HEADER)
    res: dict = {"long-tail": [], "short": []}
    doc: dict = {}

    def save() -> None:
        doc.update({
            "command": " ".join(["python benchmarks/async_cluster.py", *(argv or sys.argv[1:])]),
            "workloads": {w.name: asdict(w) for w in (LONG, SHORT)},
            "profile_steps": PROFILE["steps"], "wall_s": time.time() - t0, "results": res,
            "goals": goals(res["long-tail"], res["short"]),
        })  # fmt: skip
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1, default=float))

    try:
        for wl in (LONG, SHORT):
            if wl.name not in a.workloads:
                continue
            ks = a.ks if wl.mode == "auto" else [k for k in a.ks if k <= 4]
            for n in a.devices:
                res[wl.name].append(
                    measure(groups, wl, n, ks, a.steps, a.step_wall, extras=not a.quick)
                )
                save()
    finally:
        cluster.shutdown()
    save()
    print(json.dumps(doc["goals"], indent=1, default=float))
    print(f"wrote {a.out} ({doc['wall_s']:.0f} s)")
    return doc


if __name__ == "__main__":
    main()
