"""RLBoost at cluster scale on one machine, driving the REAL rollout manager in real time
(time-compressed): the cross-check of the emulation that ``benchmarks/spot_cluster.py`` runs
for every figure (docs/results/spot_cluster.md). Its rows are ours, not the paper's baselines: its
"veRL" is RLBoost's own colocated fallback (JSQ, Θ, migration) and its "Disagg.BAL" is
RLBoost's pool with seeding off; real time on a shared machine is noisy (never one run's ratio).

Every configuration runs the real spot pool: the rollout manager
(``workers/rollout/spot/manager.py``, Algorithms 1 and 2), ``SpotInstance`` actors on spot
nodes that are real ``ray start`` processes (``m2flow.core.spot.LocalSpotCluster``) joining and
leaving as a trace of ``scheduler.spot.trace.generate_segment`` says, and emulated engines
(``workers/rollout/emulated.py``) on the instances and on the reserved cluster's rollout
engines. What this script adds is the reserved 8xH100 cluster's side, emulated:

- ``n_engines`` reserved rollout engines (TP 2: four per 8xH100 node), each running the
  reserved seeder's own loop (``workers/rollout/spot/pool.seed``: register, lease, one block,
  report; leave after ``T_seed`` once a spot instance is ready; the colocated fallback when
  none is);
- an emulated trainer (:class:`TrainModel`) that collects finished GRPO groups from the
  manager in dynamic micro-batches (``collect(owner, m_b)``, the call whose wait the manager
  counts as ``t_train_wait``) and sleeps each micro-batch's modelled training time, then the
  weight push, then stages the next weight version (the manager then runs Algorithm 1's
  update from the step's ``t_train``, ``t_train_wait``, ``t_remote_wait``...).

All times are emulated seconds = real seconds x ``time_scale``.

    python benchmarks/spot_cluster_live.py            # 8B; A/B/C; ablations (~25 min)
    python benchmarks/spot_cluster_live.py --quick    # 8B, segment A, RLBoost + veRL only
    python benchmarks/spot_cluster_live.py --models qwen3-8b qwen3-14b --segments A B C

Writes ``benchmarks/results/spot_cluster_live.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION", "0.05")

import numpy as np  # noqa: E402
import ray  # noqa: E402
from m2flow.scheduler.spot.plan import (  # noqa: E402
    Prices,
    SpotPool,
    expected_instances,
    plan_rollout,
    tail_term,
)
from m2flow.scheduler.spot.trace import generate_segment, instances_at  # noqa: E402
from m2flow.workers.rollout.emulated import (  # noqa: E402
    EmulatedEngine,
    ResponseLengths,
    throughput_preset,
)
from m2flow.workers.rollout.emulated_rollout import rollout_finish_times  # noqa: E402
from m2flow.workers.rollout.exact import GenRequest  # noqa: E402
from m2flow.workers.rollout.spot.config import SpotPoolConfig  # noqa: E402
from m2flow.workers.rollout.spot.manager import get_manager  # noqa: E402
from m2flow.workers.rollout.spot.pool import seed as seed_loop  # noqa: E402

from m2flow.core.spot import LocalSpotCluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "spot_cluster_live.json"

# RLBoost Table 2 (paper:283-288) and Appendix A: $ per hour
RESERVED_NODE_PER_H = 83.79  # 8 x H100 on demand
SPOT_INSTANCE_PER_H = 5.32  # 2 x H100 spot
RESERVED_GPU_PER_H = RESERVED_NODE_PER_H / 8

PROMPTS, SAMPLES = 128, 8  # paper:301 (global batch 128 prompts, GRPO group 8)
LENGTHS = ResponseLengths(3000.0, 1.0, 14336)  # cap: paper:301 (14K); median, sigma: chosen
PROMPT_TOKENS = 200  # modelled prompt length (OpenR1-Math prompts; docs/results/emulation.md)
EOS, FILL = 1, 2


@dataclass(frozen=True)
class TrainModel:
    """The reserved cluster's training time (emulated seconds).

    A micro-batch of ``T`` tokens (prompt + response) costs ``flops_per_param_token * P * T /
    (gpus * 989.4e12 * mfu * scale_eff)``: ``flops_per_param_token = 10`` is the actor update
    (6 P T: forward + backward) plus GRPO's two extra forwards, the old-policy log-probs and
    the reference policy's (2 P T each, as veRL computes ``old_log_prob`` and ``ref_log_prob``);
    attention FLOPs are left out (at ~4.5K-token responses they add ~8 % for 8B). ``mfu = 0.4``
    is **chosen**: FSDP/Megatron BF16 training of 8-32B dense models on H100 is commonly
    reported at 35-45 % MFU; ``scale_eff`` (0.9 for two nodes, **chosen**) stands for FSDP
    across two 8xH100 nodes, which the paper says costs veRL.2x "additional overheads"
    (paper:331). After the last micro-batch the new weights go to the reserved rollout engines
    (colocated resharding): ``sync_s`` (2 s fixed + weight bytes at 200 GB/s, **chosen**); spot
    instances pull their copy while the next step starts (the engines' modelled pull).
    """

    params: float
    gpus: int = 8
    mfu: float = 0.4
    scale_eff: float = 1.0
    flops_per_param_token: float = 10.0
    peak_flops: float = 989.4e12  # H100 SXM BF16 dense

    def train_s(self, tokens: int) -> float:
        flops = self.flops_per_param_token * self.params * tokens
        return flops / (self.gpus * self.peak_flops * self.mfu * self.scale_eff)

    @property
    def sync_s(self) -> float:
        return 2.0 + 2 * self.params / 200e9


# ---------------------------------------------------------------------------------------------
# one configuration


@dataclass
class Config:
    name: str
    model: str = "qwen3-8b"
    segment: str | None = "A"  # trace segment; None: fixed instances (disagg) or none
    reserved_nodes: int = 1  # 8xH100 training nodes
    fixed_instances: int = 0  # always-on rollout instances (disagg), priced reserved
    spot: dict | None = None  # SpotPoolConfig overrides (ablations)
    steps: int = 8
    warmup: int = 2
    scale_eff: float = 1.0


def _requests(step: int) -> list[GenRequest]:
    return [
        GenRequest(f"{step}:{p}:{j}", [3], (step, p, j), 14336, owner=0)
        for p in range(PROMPTS)
        for j in range(SAMPLES)
    ]


class Replay:
    """Follows a trace on a LocalSpotCluster (its own thread and stop event, so one cluster
    serves every configuration)."""

    def __init__(self, local: LocalSpotCluster, trace, time_scale: float, seed: int) -> None:
        import random

        self.local, self.trace, self.ts = local, trace, time_scale
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        t0 = time.monotonic()

        def run() -> None:
            for t_s, count in self.trace[1:]:
                if self.stop.wait(max(0.0, t0 + t_s / self.ts - time.monotonic())):
                    return
                have = self.local.spot_nodes
                if count > have:
                    self.local.add_spot(count - have)
                elif count < have:
                    self.local.remove_spot(have - count, self.rng)

        self.thread = threading.Thread(target=run, daemon=True, name="trace")
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=120)


def run_config(local: LocalSpotCluster, cfg: Config, ts: float, seed: int,
               pool_over: dict) -> dict:  # fmt: skip
    """Runs ``cfg.steps`` steps; returns per-step records (emulated seconds, $)."""
    preset = throughput_preset(cfg.model)
    n_engines = 4 * cfg.reserved_nodes  # TP-2 engines of the training cluster (paper:186)
    trainer = TrainModel(preset.params, gpus=8 * cfg.reserved_nodes, scale_eff=cfg.scale_eff)
    emu = {"model": cfg.model, "time_scale": ts, "length_median": 3000.0, "length_sigma": 1.0,
           "length_cap": 14336, "prompt_tokens": PROMPT_TOKENS, "mem_util": 0.0}  # fmt: skip
    spot = {"enabled": True, "engine": "emulated", "emulated": emu, **pool_over,
            **(cfg.spot or {})}  # fmt: skip
    if cfg.fixed_instances:  # disaggregated: no seeding, a fixed pool
        spot.update(seeding=False, n_prem_min=cfg.fixed_instances,
                    n_prem_max=cfg.fixed_instances)  # fmt: skip
    pc = SpotPoolConfig(**spot)
    pc.check()
    args = {"engine": "emulated", "emulated": asdict(pc.emulated), "eos_id": EOS,
            "filler_id": FILL, "seed": seed, "min_new_tokens": 0}  # fmt: skip
    mgr = get_manager(asdict(pc), n_engines, args)
    engines = [EmulatedEngine.from_config(args["emulated"], EOS, FILL, seed, version=0)
               for _ in range(n_engines)]  # fmt: skip
    trace = generate_segment(cfg.segment, seed=seed) if cfg.segment else None
    replay = None
    records: list[dict] = []
    try:
        # the instances present at t = 0 (or the fixed pool) start before the clock does
        first = trace[0][1] if trace else cfg.fixed_instances
        if first:
            local.add_spot(first)
        version = 0
        ray.get(mgr.stage.remote(version, [ray.put(b"w")]), timeout=120)
        n_prem0 = ray.get(mgr.metrics.remote(), timeout=60)["n_prem"]
        want = min(first, n_prem0)
        deadline = time.monotonic() + 300
        while want and ray.get(mgr.spot_ready.remote()) < want:  # instances up, weights pulled
            if time.monotonic() > deadline:
                raise TimeoutError("spot instances did not start in 300 s")
            time.sleep(0.5)
        if trace:
            replay = Replay(local, trace, ts, seed)
            replay.start()
        t_run0 = time.monotonic()

        def seed_all(t_seed: float) -> None:
            threads = [threading.Thread(target=seed_loop, args=(mgr, engines[i], f"reserved:{i}",
                                                           t_seed, pc.max_batch,
                                                           pc.block_tokens))
                       for i in range(n_engines)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for step in range(cfg.steps):
            t0 = time.monotonic()
            t_seed = ray.get(mgr.submit.remote(step, 0, _requests(step)), timeout=120)
            seed_all(t_seed)
            t_seed_end = time.monotonic()
            got = tokens = 0
            train_busy = fallback = 0.0
            micro = 0
            while got < PROMPTS:
                groups = ray.get(mgr.collect.remote(0, pc.micro_batch_prompts, 1.0),
                                 timeout=120)  # fmt: skip
                if not groups:
                    if ray.get(mgr.spot_ready.remote()) == 0:  # colocated fallback
                        f0 = time.monotonic()
                        seed_all(0.0)
                        fallback += time.monotonic() - f0
                    continue
                got += len(groups)
                n_tok = sum(PROMPT_TOKENS + len(r.tokens) for g in groups for r in g)
                tokens += n_tok
                dt = trainer.train_s(n_tok) / ts
                time.sleep(dt)
                train_busy += dt
                micro += 1
            time.sleep(trainer.sync_s / ts)
            version += 1
            for e in engines:  # the reserved side: weights arrive locally (no modelled pull)
                e.update_weights(version, {})
            ray.get(mgr.stage.remote(version, [ray.put(b"w")]), timeout=120)  # ends the step
            t1 = time.monotonic()
            hist = ray.get(mgr.metrics.remote(), timeout=60)["steps"]
            h = hist[-1] if hist else {}
            step_s = (t1 - t0) * ts
            spot_inst_s = h.get("n_bar", 0.0) * h.get("step_s", 0.0) * ts
            if cfg.fixed_instances:  # always-on, reserved-priced instances
                cost = (
                    step_s
                    / 3600
                    * (
                        cfg.reserved_nodes * RESERVED_NODE_PER_H
                        + cfg.fixed_instances * 2 * RESERVED_GPU_PER_H
                    )
                )
                spot_cost = 0.0
            else:
                spot_cost = spot_inst_s / 3600 * SPOT_INSTANCE_PER_H
                cost = step_s / 3600 * cfg.reserved_nodes * RESERVED_NODE_PER_H + spot_cost
            t_emul = (t0 - t_run0) * ts
            rec = {
                "step": step, "step_s": step_s, "tokens": tokens, "cost": cost,
                "spot_cost": spot_cost, "spot_instance_s": spot_inst_s,
                "seed_s": (t_seed_end - t0) * ts, "train_s": train_busy * ts,
                "fallback_s": fallback * ts, "micro_batches": micro,
                "t_seed": t_seed * ts, "n_prem": h.get("n_prem"), "n_bar": h.get("n_bar"),
                "available": instances_at(trace, t_emul) if trace else cfg.fixed_instances,
                "t_train_wait": h.get("t_train_wait", 0.0) * ts,
                "t_remote_wait": h.get("t_remote_wait", 0.0) * ts,
                "reserved_tokens": h.get("reserved_tokens"), "spot_tokens": h.get("spot_tokens"),
                "preemptions": h.get("preemptions"), "migrated_samples": h.get("migrated_samples"),
                "rebalanced_samples": h.get("rebalanced_samples"),
                "failed_starts": h.get("failed_starts"), "t_start": t_emul,
            }  # fmt: skip
            records.append(rec)
            print(f"  {cfg.name} step {step}: {step_s:7.1f} s  {tokens / step_s:8.0f} tok/s  "
                  f"${cost:6.3f}  T_seed {rec['t_seed']:6.1f}  N_prem {rec['n_prem']}  "
                  f"n_bar {rec['n_bar'] or 0:.2f}  avail {rec['available']}  "
                  f"wait {rec['t_train_wait']:.0f}/{rec['t_remote_wait']:.0f}  "
                  f"pre {rec['preemptions']}", flush=True)  # fmt: skip
    finally:
        if replay is not None:
            replay.close()
        try:
            ray.get(mgr.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001
            pass
        ray.kill(mgr, no_restart=True)
        local.remove_spot(local.spot_nodes)
        # the next configuration's manager must not see these nodes as alive (GCS marks a
        # killed raylet dead only after missed heartbeats)
        from m2flow.core.spot import alive_spot_nodes

        deadline = time.monotonic() + 90
        while alive_spot_nodes() and time.monotonic() < deadline:
            time.sleep(1.0)
    return {"config": asdict(cfg), "records": records, **summarise(records, cfg.warmup)}


def summarise(records: list[dict], warmup: int) -> dict:
    rec = records[warmup:] or records
    time_s = sum(r["step_s"] for r in rec)
    tokens = sum(r["tokens"] for r in rec)
    cost = sum(r["cost"] for r in rec)
    return {
        "measured_steps": len(rec),
        "throughput": tokens / time_s,  # tokens trained per emulated second
        "tokens_per_dollar": tokens / cost,
        "step_s": time_s / len(rec),
        "cost_per_step": cost / len(rec),
        "spot_share": sum(r["spot_tokens"] or 0 for r in rec)
        / max(sum((r["spot_tokens"] or 0) + (r["reserved_tokens"] or 0) for r in rec), 1),
        "avg_available": statistics.fmean(r["available"] for r in rec),
        "avg_held": statistics.fmean(r["n_bar"] or 0.0 for r in rec),
        "preemptions": sum(r["preemptions"] or 0 for r in rec),
    }


# ---------------------------------------------------------------------------------------------
# offline model (no sleeping): rollout times for the planner and the disaggregated sizing


def finish_times(model: str, n_engines: int, seed: int, step: int, block: int,
                 max_batch: int) -> np.ndarray:  # fmt: skip
    """Modelled seconds from the step's start until each of step ``step``'s 1024 responses
    ends on ``n_engines`` engines sharing its queue (``rollout_finish_times``), in
    ``_requests`` order (prompt-major: a group's samples are contiguous)."""
    keys = [r.key for r in _requests(step)]
    fin, _ = rollout_finish_times(throughput_preset(model), LENGTHS, keys, n_engines, seed,
                                  max_batch, block, PROMPT_TOKENS)  # fmt: skip
    return fin


def offline_rollout_s(model: str, n_engines: int, seed: int, step: int, block: int,
                      max_batch: int) -> float:  # fmt: skip
    """Modelled seconds for ``n_engines`` engines to roll out step ``step``: its last
    response's end (:func:`finish_times`)."""
    return float(finish_times(model, n_engines, seed, step, block, max_batch).max())


def step_tokens(seed: int, step: int) -> int:
    lengths = LENGTHS.lengths(seed, [r.key for r in _requests(step)])
    return int(lengths.sum()) + PROMPTS * SAMPLES * PROMPT_TOKENS


def plan_for(model: str, segment: str, seed: int, reserved_nodes: int, block: int,
             max_batch: int, steps: range, n_bar: float | None = None) -> dict:  # fmt: skip
    """scheduler.spot.plan's choice from the emulator's own model: ``R`` and one instance's
    items/s from the offline engine model, ``t_train`` from :class:`TrainModel`, the expected
    instances from the segment's trace (or ``n_bar``), the paper's prices."""
    preset = throughput_preset(model)
    n_eng = 4 * reserved_nodes
    trainer = TrainModel(preset.params, gpus=8 * reserved_nodes)
    rs = [offline_rollout_s(model, n_eng, seed, s, block, max_batch) for s in steps]
    R = statistics.fmean(rs)
    t_train = statistics.fmean(trainer.train_s(step_tokens(seed, s)) for s in steps)
    t_train += trainer.sync_s
    if n_bar is None:
        n_bar = expected_instances(generate_segment(segment, seed=seed))
    # one instance's items/s when the batch is spread over ~n_bar instances
    n = max(1, round(n_bar))
    one = offline_rollout_s(model, n, seed, steps[0], block, max_batch)
    r_items = PROMPTS / n / one
    # the long responses' term: when each GRPO group is complete on those n engines
    ends = [group_end_s(model, n, seed, s, block, max_batch) for s in steps]
    tails = [tail_term(g, t_train) for g in ends]
    pool = SpotPool(
        instance_items_per_s=r_items,
        devices_per_instance=2,
        expected_instances=n_bar,
        weight_sync_s=preset.weight_transfer_s(),
        tail_s=statistics.fmean(t for t, _ in tails),
        tail_train_fraction=statistics.fmean(f for _, f in tails),
    )
    prices = Prices(reserved=RESERVED_GPU_PER_H, spot=SPOT_INSTANCE_PER_H / 2)
    plan = plan_rollout(PROMPTS, R + t_train, R, t_train, 8 * reserved_nodes, pool, prices,
                        objective="time")  # fmt: skip
    return {"R": R, "t_train": t_train, "instance_items_per_s": r_items, "n_bar": n_bar,
            "weight_sync_s": pool.weight_sync_s, "tail_s": pool.tail_s,
            "tail_train_fraction": pool.tail_train_fraction, "plan": plan.to_dict()}  # fmt: skip


def group_end_s(model: str, n_engines: int, seed: int, step: int, block: int,
                max_batch: int) -> list[float]:  # fmt: skip
    """Emulated seconds from the step's start until each GRPO group's last sample ends
    (:func:`finish_times`)."""
    fin = finish_times(model, n_engines, seed, step, block, max_batch)
    return [float(g.max()) for g in fin.reshape(PROMPTS, SAMPLES)]


def replan(path: str) -> None:
    """Recompute the planner's choices (pure, from the emulator's models) and the derived table
    of an earlier run's results, keeping its measured rows; for a planner change."""
    results = json.loads(Path(path).read_text())
    st = results["settings"]
    for key in results["plans"]:
        model, seg = key.split("/")
        nodes = 2 if model == "qwen3-32b" else 1
        results["plans"][key] = plan_for(model, seg, st["seed"], nodes, st["block"], 256,
                                         range(st["warmup"], st["steps"]))  # fmt: skip
    results["replanned"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results["derived"] = derived(results)
    Path(path).write_text(json.dumps(results, indent=2, default=float) + "\n")
    _report(results, path)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8B, segment A, RLBoost + veRL only")
    ap.add_argument("--models", nargs="+", default=["qwen3-8b"])
    ap.add_argument("--segments", nargs="+", default=["A", "B", "C"])
    ap.add_argument("--steps", type=int, default=8, help="steps per RLBoost run (spot)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--baseline-steps", type=int, default=3)
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--block", type=int, default=512, help="tokens per report")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--replan", metavar="JSON", help="recompute the planner rows of a results "
                    "file (its measured rows kept) and exit")  # fmt: skip
    a = ap.parse_args()
    if a.replan:
        return replan(a.replan)
    if a.quick:
        a.models, a.segments, a.steps, a.warmup, a.baseline_steps = ["qwen3-8b"], ["A"], 5, 1, 2
        a.no_ablations = True
    pool_over = {"block_tokens": a.block, "max_batch": 256, "micro_batch_prompts": 8,
                 "theta": 64, "t_seed_init": 0.0, "timeout_s": 3600.0}  # fmt: skip
    import signal

    def _stop(signum, frame):  # clean up the local cluster on SIGTERM/SIGINT too
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    wall0 = time.time()
    results: dict = {"settings": {**vars(a), "pool": pool_over}, "runs": {}, "plans": {}}
    local = LocalSpotCluster(2, {}, spot_cpus=1)
    try:
        for model in a.models:
            nodes = 2 if model == "qwen3-32b" else 1
            preset = throughput_preset(model)
            trainer = TrainModel(preset.params, gpus=8 * nodes)
            # Disagg.BAL sizing: reserved 2xH100 instances whose rollout time matches training
            # (StreamRL's balance; paper:335), from the offline model of step 0
            r4 = offline_rollout_s(model, 4 * nodes, a.seed, 0, a.block, 256)
            t_tr = trainer.train_s(step_tokens(a.seed, 0)) + trainer.sync_s
            k = max(1, math.ceil(4 * nodes * r4 / t_tr))
            plans = {}
            for seg in a.segments:
                plans[seg] = plan_for(model, seg, a.seed, nodes, a.block, 256,
                                      range(a.warmup, a.steps))  # fmt: skip
                results["plans"][f"{model}/{seg}"] = plans[seg]
            configs = [Config("veRL", model, None, nodes, steps=a.baseline_steps, warmup=1)]
            for seg in a.segments:
                t_init = plans[seg]["plan"]["best"].get("t_seed") or 0.0
                configs.append(Config(f"RLBoost/{seg}", model, seg, nodes, steps=a.steps,
                                      warmup=a.warmup,
                                      spot={"t_seed_init": t_init / a.time_scale}))  # fmt: skip
            if not a.quick:
                if model != "qwen3-32b":
                    configs.append(
                        Config(
                            "veRL.2x",
                            model,
                            None,
                            2 * nodes,
                            steps=a.baseline_steps,
                            warmup=1,
                            scale_eff=0.9,
                        )
                    )
                configs.append(Config("Disagg.BAL", model, None, nodes, fixed_instances=k,
                                      steps=a.baseline_steps + 1, warmup=1))  # fmt: skip
            if not a.no_ablations and model == a.models[0]:
                seg = a.segments[0]
                for name, over in (("no seeding", {"seeding": False}),
                                   ("no memory", {"memory": False}),
                                   ("round robin", {"dispatch": "round_robin"}),
                                   ("no rebalance", {"rebalance": False})):  # fmt: skip
                    t_init = plans[seg]["plan"]["best"].get("t_seed") or 0.0
                    configs.append(
                        Config(
                            f"ablation {name}/{seg}",
                            model,
                            seg,
                            nodes,
                            steps=a.steps,
                            warmup=a.warmup,
                            spot={"t_seed_init": t_init / a.time_scale, **over},
                        )
                    )
            for cfg in configs:
                t0 = time.time()
                print(f"{model} {cfg.name} ...", flush=True)
                res = run_config(local, cfg, a.time_scale, a.seed, pool_over)
                res["wall_s"] = time.time() - t0
                results["runs"][f"{model}/{cfg.name}"] = res
                _save(results, a.out, wall0)
    finally:
        ray.shutdown()
        local.shutdown()
    results["wall_s"] = time.time() - wall0
    _save(results, a.out, wall0)
    _report(results, a.out)


def _report(results: dict, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from spot_cluster_report import live_plot as plot
    from spot_cluster_report import live_table

    live_table(results)
    try:
        plot(results, Path(out).with_suffix(".png"))
    except Exception as e:  # noqa: BLE001
        print(f"no plot: {e}")


def derived(results: dict) -> dict:
    """Ratios against veRL, and the planner's error, per model."""
    out = {}
    runs = results["runs"]
    for key, r in runs.items():
        model, name = key.split("/", 1)
        base = runs.get(f"{model}/veRL")
        row = {"throughput": r["throughput"], "tokens_per_dollar": r["tokens_per_dollar"],
               "step_s": r["step_s"], "cost_per_step": r["cost_per_step"],
               "avg_available": r["avg_available"], "avg_held": r["avg_held"],
               "spot_share": r["spot_share"], "preemptions": r["preemptions"]}  # fmt: skip
        if base:
            row["x_throughput"] = r["throughput"] / base["throughput"]
            row["x_tokens_per_dollar"] = r["tokens_per_dollar"] / base["tokens_per_dollar"]
        if name.startswith("RLBoost/"):
            p = results["plans"].get(f"{model}/{name.split('/')[1]}")
            if p:
                best = p["plan"]["best"]
                row["planner"] = {
                    "mode": best["mode"], "step_s": best["step_s"],
                    "cost_per_step": best["cost_per_step"], "n_prem": best["n_prem"],
                    "t_seed": best["t_seed"],
                    "step_error": best["step_s"] / r["step_s"] - 1,
                    "cost_error": best["cost_per_step"] / r["cost_per_step"] - 1,
                }  # fmt: skip
                # the same plan at the availability the run actually saw (its trace window)
                st = results["settings"]
                c = r["config"]
                w = plan_for(model, c["segment"], st["seed"], c["reserved_nodes"], st["block"],
                             256, range(c["warmup"], c["steps"]),
                             n_bar=r["avg_available"])["plan"]["best"]  # fmt: skip
                row["planner_window"] = {
                    "n_bar": r["avg_available"], "step_s": w["step_s"],
                    "cost_per_step": w["cost_per_step"], "n_prem": w["n_prem"],
                    "step_error": w["step_s"] / r["step_s"] - 1,
                    "cost_error": w["cost_per_step"] / r["cost_per_step"] - 1,
                }  # fmt: skip
        out[key] = row
    return out


def _save(results: dict, out: str, wall0: float) -> None:
    results["derived"] = derived(results)
    results["wall_s"] = time.time() - wall0
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(results, indent=2, default=float) + "\n")


if __name__ == "__main__":
    main()
