"""DistRS at cluster scale: six GRPO tenants sharing one reward service while their rollouts run
on the emulated engine, against each tenant with a service of its own (docs/results/spot_cluster.md,
"DistRS at cluster scale"; DistRS = shared/papers/004_202a8381d4119568.txt).

A simulation, deterministic by seed: no Ray, no sleeping, nothing interleaved with other runs.
Every time is modelled seconds.

Rollout (request-in). Each tenant is a synchronous (colocated, veRL-like) GRPO run on one 8xH100
node: per step 128 prompts x 8 samples (RLBoost paper:301), rolled out by ``ENGINES = 4`` TP-2
emulated engines (paper:186; ``workers/rollout/emulated.py``: Qwen3 on 2 x H100, lognormal
response lengths median 3,000 tokens, sigma 1, cap 16,384, keyed by (seed, step, prompt,
sample)), each running at most ``MAX_BATCH = 256`` requests (PolyRL's
``--max-running-requests``) in blocks of ``--block`` (128) tokens, 200-token prompts.
:func:`m2flow.workers.rollout.emulated_rollout.rollout_finish_times` gives each response's
finish time (the end of the block it ended in); the response becomes a reward request at that
time, and the batch (1,024 requests) is announced to the service at the rollout's start.
Tenant ``i`` uses length seed ``1000 * seed + i``; batch ``b`` is step ``b + 1`` and the
warm-up batch (the first batch's history, DistRS Algorithm 2 needs one: a profiling step) is
step 0. Training between batches: ``TrainModel`` of ``benchmarks/spot_cluster_model.py`` (10 P T
FLOPs at MFU 0.4 on the 8 GPUs, plus the weight push ``sync_s``) over the step's prompt and
response tokens, averaged over the tenant's steps (``TenantTrace`` has one ``train_s``):
~127 s (8B) and ~230 s (14B).

Tenants (``TENANTS``): Qwen3-8B, -14B, -8B, -14B, -8B, -14B, one node (4 engines) each;
first rollouts staggered uniformly in ``[0, --window]`` = [0, 120] s (DistRS section 6.1:
"staggered within a short time window"; ``cuda_tenants``' window), ``--steps`` (5) measured
batches each.

Reward (batch-out). Stage times are the paper's CUDA workload
(:func:`m2flow.scheduler.reward.workload.cuda_batch`, the generator
``benchmarks/reward_service.py`` uses): ``compile`` on a CPU worker (~50 s, timeout 120 s),
``execute`` on a GPU worker (a few seconds, timeout 60 s), request states drifting with
training progress ``0.3 + 0.02 * step`` (as ``cuda_tenants``); only its arrival offsets are
replaced by the rollout's finish times (record ``i`` goes to response ``i``: stage times are
independent of response length). Delay bound ``D = --delay-bound`` (5 s), worker costs ``C =
(1, 10)`` (CPU, GPU; they order Algorithm 1's search), no worker cold start.

Arms (``m2flow.scheduler.reward.replay``; DistRS section 5):

- *Shared*: one service, DistRS policy (Algorithm 2's estimate + Algorithm 1's search, EBF,
  timeout-aware check) at every batch arrival and completion, all six tenants' batches;
- *Dedicated*: the same policy, one service per tenant (``replay`` per tenant, fresh policy);
- *ZQ-Dedicated*: per tenant, each stage at the zero-queue peak of the history estimate
  (section 6.1), as in ``benchmarks/reward_service.py``;
- with ``--diagnose``, each shared and dedicated: *Ideal* (section 6.1: the batches' true
  requests, no timeout-aware check) and *DistRS-oracle* (true requests, check on), which
  separate what the history estimate (Algorithm 2) and the timeout-aware check (section 5.1,
  ``LT = ts + sum_{j>=k} T_j <= T + D``) each cost the shared service.

Reported: GPU and CPU worker-seconds (allocated workers integrated over time, starting, idle
or busy), separately, as the paper does; dedicated/shared ratios; per batch the extra delay
``tail`` = last reward - last response's finish (the trainer's wait after its rollout) and the
paper's ``d`` = last reward - ``T`` (Eq. 1-2: the zero-queue completion), mean and p99 per
tenant and overall (p99 over 5-30 batches is about their maximum).

    python benchmarks/reward_cluster.py [--steps 5] [--seed 0] [--quick] [--diagnose]
        [--mode colocated|disaggregated] [--out benchmarks/results/reward_cluster.json]

``--quick``: 2 steps per tenant, 64 prompts x 8 (a smoke run, not comparable). Runtime on 2
shared cores: ~30 s (``--diagnose`` ~60 s, mostly the rollout traces; ``--quick`` ~10 s).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from m2flow.scheduler.reward.baselines import ZeroQueuePolicy, ideal_policy
from m2flow.scheduler.reward.replay import ReplayResult, TenantTrace, replay
from m2flow.scheduler.reward.scaling import DistRSPolicy
from m2flow.scheduler.reward.workload import COSTS, RESOURCES, TIMEOUTS_S, cuda_batch
from m2flow.workers.rollout.emulated import ResponseLengths, throughput_preset
from m2flow.workers.rollout.emulated_rollout import rollout_finish_times
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from spot_cluster_model import PROMPT_TOKENS, PROMPTS, SAMPLES, TrainModel  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "reward_cluster.json"
TENANTS = ("qwen3-8b", "qwen3-14b") * 3  # model preset per tenant
ENGINES = 4  # TP-2 engines per tenant: one 8xH100 node
MAX_BATCH = 256  # running requests per engine
CPU, GPU = 0, 1  # stage (resource) indices: compile on CPUs, execute on GPUs


@dataclass
class Tenant:
    """One GRPO tenant's trace and the rollout facts it came from (seconds, tokens)."""

    trace: TenantTrace
    model: str
    rollout_s: list[float]  # per measured batch: the last response's finish
    arrival_pcts: list[list[float]]  # per measured batch: finish-time 10/50/90 % quantiles
    step_tokens: list[int]  # per measured batch: prompt + response tokens


def make_tenants(
    seed: int = 0,
    steps: int = 5,
    prompts: int = PROMPTS,
    samples: int = SAMPLES,
    window_s: float = 120.0,
    delay_bound_s: float = 5.0,
    block: int = 128,
    models: tuple[str, ...] = TENANTS,
    mode: str = "colocated",
) -> list[Tenant]:
    """The tenants of the module docstring: rollout finish times from the emulated engine,
    stage times from the paper's CUDA workload. Deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    starts = rng.uniform(0.0, window_s, len(models))
    lengths = ResponseLengths(3000.0, 1.0, 16384)
    out = []
    for ti, name in enumerate(models):
        model = throughput_preset(name)
        trainer = TrainModel(model.params, gpus=8)
        batches, rollout, pcts, tokens = [], [], [], []
        for step in range(steps + 1):  # step 0: the warm-up (profiling) batch
            keys = [(step, p, j) for p in range(prompts) for j in range(samples)]
            fin, n = rollout_finish_times(
                model, lengths, keys, ENGINES, 1000 * seed + ti, MAX_BATCH, block, PROMPT_TOKENS
            )
            recs = cuda_batch(rng, len(keys), 0.3 + 0.02 * step)
            batches.append([replace(r, offset_s=float(f)) for r, f in zip(recs, fin)])
            rollout.append(float(fin.max()))
            pcts.append(np.percentile(fin, [10, 50, 90]).tolist())
            tokens.append(int(n.sum()) + len(keys) * PROMPT_TOKENS)
        train_s = float(np.mean([trainer.train_s(t) for t in tokens[1:]])) + trainer.sync_s
        trace = TenantTrace(
            f"t{ti}-{name.removeprefix('qwen3-')}",
            float(starts[ti]),
            batches[1:],
            batches[0],
            train_s,
            delay_bound_s,
            mode,
        )
        out.append(Tenant(trace, name, rollout[1:], pcts[1:], tokens[1:]))
    return out


def arms(seed: int = 0, diagnose: bool = False) -> dict[str, tuple]:
    """Arm name -> (policy factory, oracle, shared): the module docstring's three arms; with
    ``diagnose`` also Ideal (true requests, no timeout-aware check) and DistRS given the true
    requests (check on), each shared and dedicated, to split estimation error from the check.
    """

    def distrs():
        return DistRSPolicy(TIMEOUTS_S, costs=COSTS, seed=seed).decide

    def zq():
        return ZeroQueuePolicy(TIMEOUTS_S, COSTS, seed).decide

    def ideal():
        return ideal_policy(TIMEOUTS_S, COSTS).decide

    out = {
        "Shared": (distrs, False, True),
        "Dedicated": (distrs, False, False),
        "ZQ-Dedicated": (zq, False, False),
    }
    if diagnose:
        for name, make, oracle in (("Ideal", ideal, True), ("DistRS-oracle", distrs, True)):
            out[f"{name} shared"] = (make, oracle, True)
            out[f"{name} dedicated"] = (make, oracle, False)
    return out


def run_arms(tenants: list[Tenant], seed: int = 0, diagnose: bool = False) -> dict[str, tuple]:
    """Replays every arm (:func:`arms`): arm -> (result, tenant name -> that tenant's own
    pool's result; empty for a shared arm)."""
    traces = [t.trace for t in tenants]
    out: dict[str, tuple] = {}
    for arm, (make, oracle, shared) in arms(seed, diagnose).items():
        if shared:
            out[arm] = (replay(traces, TIMEOUTS_S, make(), oracle=oracle), {})
            continue
        total = ReplayResult(worker_s=[0.0, 0.0], busy_s=[0.0, 0.0], peak_workers=[0, 0])
        pools = {}
        for tr in traces:  # as replay_dedicated, keeping each tenant's pool
            pools[tr.name] = one = replay([tr], TIMEOUTS_S, make(), oracle=oracle)
            total.merge(one)
        out[arm] = (total, pools)
    return out


def delays(res: ReplayResult, tenants: list[Tenant]) -> dict[str, dict[str, list[float]]]:
    """Per tenant, per batch (in order): ``tail`` = last reward - last response's finish and
    ``d`` = last reward - ``T`` (seconds)."""
    by = {t.trace.name: t for t in tenants}
    out: dict[str, dict[str, list[float]]] = {n: {"tail": [], "d": []} for n in by}
    for b in sorted(res.batches, key=lambda b: (b.tenant, b.index)):
        last = b.start_s + by[b.tenant].rollout_s[b.index]
        out[b.tenant]["tail"].append(b.completion_s - last)
        out[b.tenant]["d"].append(max(b.extra_delay_s, 0.0))  # -1e-13: rounding
    return out


def _stats(x: list[float]) -> dict:
    a = np.asarray(x)
    return {"mean": float(a.mean()), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def summarise(res: dict[str, tuple[ReplayResult, dict]], tenants: list[Tenant]) -> dict:
    """The JSON numbers: worker-seconds per resource, ratios to Shared, delays."""
    out: dict = {}
    for arm, (r, pools) in res.items():
        dl = delays(r, tenants)
        s = {
            "worker_s": dict(zip(RESOURCES, r.worker_s)),
            "busy_s": dict(zip(RESOURCES, r.busy_s)),
            "peak_workers": dict(zip(RESOURCES, r.peak_workers)),
            "requests_done": r.requests_done,
            "batches": len(r.batches),
            "decisions": r.decisions,
            "decision_mean_s": float(np.mean(r.decision_s)) if r.decision_s else 0.0,
            "end_s": r.end_s,
            "per_tenant": {
                n: {k: _stats(v) | {"batches_s": v} for k, v in d.items()} for n, d in dl.items()
            },
            "overall": {k: _stats([x for d in dl.values() for x in d[k]]) for k in ("tail", "d")},
        }
        for n, one in pools.items():
            s["per_tenant"][n]["worker_s"] = dict(zip(RESOURCES, one.worker_s))
        out[arm] = s
    sh = out["Shared"]["worker_s"]
    for s in out.values():
        s["over_shared"] = {k: s["worker_s"][k] / sh[k] for k in RESOURCES}
        s["gpu_over_busy"] = s["worker_s"]["GPU"] / s["busy_s"]["GPU"]
    return out


def report(res: dict, tenants: list[Tenant], con: Console) -> None:
    t = Table(title="rollouts (emulated engine): per tenant, mean over measured steps")
    for col in ("tenant", "start s", "rollout s", "finish p10/p50/p90 s", "train s", "tokens"):
        t.add_column(col, justify="right")
    for x in tenants:
        p = np.mean(x.arrival_pcts, axis=0)
        t.add_row(
            x.trace.name,
            f"{x.trace.start_s:.0f}",
            f"{np.mean(x.rollout_s):.0f}",
            "/".join(f"{v:.0f}" for v in p),
            f"{x.trace.train_s:.0f}",
            f"{np.mean(x.step_tokens) / 1e6:.2f}M",
        )
    con.print(t)
    t = Table(title="reward service: worker-seconds and extra delay per batch (seconds)")
    for col in (
        "arm",
        "GPU worker-s",
        "x Shared",
        "CPU worker-s",
        "x Shared",
        "GPU/busy",
        "tail mean",
        "tail p99",
        "d mean",
        "d p99",
        "requests",
    ):
        t.add_column(col, justify="right")
    for arm, s in res.items():
        o = s["overall"]
        t.add_row(
            arm,
            f"{s['worker_s']['GPU']:,.0f}",
            f"{s['over_shared']['GPU']:.2f}x",
            f"{s['worker_s']['CPU']:,.0f}",
            f"{s['over_shared']['CPU']:.2f}x",
            f"{s['gpu_over_busy']:.2f}",
            f"{o['tail']['mean']:.1f}",
            f"{o['tail']['p99']:.1f}",
            f"{o['d']['mean']:.2f}",
            f"{o['d']['p99']:.2f}",
            str(s["requests_done"]),
        )
    con.print(t)
    for name in ("Ideal", "DistRS-oracle"):
        if f"{name} shared" in res:
            sh, de = res[f"{name} shared"]["worker_s"], res[f"{name} dedicated"]["worker_s"]
            con.print(
                f"  {name}: dedicated/shared GPU {de['GPU'] / sh['GPU']:.2f}x, "
                f"CPU {de['CPU'] / sh['CPU']:.2f}x"
            )
    main_arms = ("Shared", "Dedicated", "ZQ-Dedicated")
    t = Table(title="per tenant: tail / d mean and p99 (s); dedicated worker-s GPU / CPU")
    t.add_column("tenant")
    for arm in main_arms:
        t.add_column(f"{arm} tail mean/p99", justify="right")
        t.add_column(f"{arm} d mean/p99", justify="right")
    for arm in ("Dedicated", "ZQ-Dedicated"):
        t.add_column(f"{arm} GPU/CPU w-s", justify="right")
    for name in res["Shared"]["per_tenant"]:
        row = [name]
        for arm in main_arms:
            d = res[arm]["per_tenant"][name]
            row += [f"{d[k]['mean']:.1f}/{d[k]['p99']:.1f}" for k in ("tail", "d")]
        for arm in ("Dedicated", "ZQ-Dedicated"):
            w = res[arm]["per_tenant"][name]["worker_s"]
            row.append(f"{w['GPU']:,.0f}/{w['CPU']:,.0f}")
        t.add_row(*row)
    con.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="measured batches per tenant")
    ap.add_argument("--prompts", type=int, default=PROMPTS)
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--window", type=float, default=120.0, help="start stagger window, seconds")
    ap.add_argument("--delay-bound", type=float, default=5.0, help="D, seconds")
    ap.add_argument("--block", type=int, default=128, help="tokens per engine call")
    ap.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run (not comparable)")
    ap.add_argument("--diagnose", action="store_true", help="also Ideal and DistRS-oracle")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args()
    if a.quick:
        a.steps, a.prompts = 2, 64
    con = Console(width=200)
    t0 = time.perf_counter()
    tenants = make_tenants(
        a.seed, a.steps, a.prompts, a.samples, a.window, a.delay_bound, a.block, TENANTS, a.mode
    )
    t_roll = time.perf_counter() - t0
    res = summarise(run_arms(tenants, a.seed, a.diagnose), tenants)
    runtime = time.perf_counter() - t0
    report(res, tenants, con)
    con.print(f"runtime {runtime:.0f} s (rollout traces {t_roll:.0f} s)")
    out = {
        "config": vars(a)
        | {
            "tenants": list(TENANTS),
            "engines_per_tenant": ENGINES,
            "max_batch": MAX_BATCH,
            "prompt_tokens": PROMPT_TOKENS,
            "timeouts_s": TIMEOUTS_S,
            "costs": COSTS,
            "resources": RESOURCES,
        },
        "tenants": [
            {
                "name": x.trace.name,
                "model": x.model,
                "start_s": x.trace.start_s,
                "train_s": x.trace.train_s,
                "rollout_s": x.rollout_s,
                "finish_p10_p50_p90_s": x.arrival_pcts,
                "step_tokens": x.step_tokens,
            }
            for x in tenants
        ],
        "results": res,
        "runtime_s": runtime,
        "machine": platform.platform(),
        "python": platform.python_version(),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    con.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
