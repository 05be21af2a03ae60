"""DistRS policies on a DistRS-shaped multi-tenant workload (trace replay, simulated time).

Six tenants (training tasks) with staggered starts share one two-stage reward service:

- stage ``check`` (CPU; a few seconds, timeout 60 s; some requests fail fast, some hang),
- stage ``execute`` (the expensive stage; ~50 s, timeout 120 s; a share of timeouts).

Each batch holds 2048 requests whose arrival offsets have a long tail over a ~15 min rollout
(response lengths are long-tailed); the trainer trains ``train_s`` after its batch's last
reward, then announces the next batch. Stage times and the arrival spread drift from batch to
batch, so the previous batch (the history the policy plans from) is never exact.

Policies replayed (:mod:`m2flow.scheduler.reward_replay`), all with the same ``D``:

- ZQ-Dedicated: each tenant's own pool sized for zero queueing, held for its whole run;
- Ideal: shared, EBF, perfect knowledge of every batch (the true requests, not history);
- DistRS: shared, EBF, history + Algorithm 2 + Algorithm 1 + the timeout-aware check;
- History-only: DistRS without the timeout-aware check;
- FCFS: DistRS with FCFS queues (in the service and in its simulation).

Reported per policy: worker-hours per stage, mean / max extra delay per batch ``d = completion
- T`` (T: the batch's zero-queue completion), batches over ``D``, decision time. Then the
decision time of one scaling decision over 16,000 outstanding requests (paper: ~2 s).

    python benchmarks/reward_service.py [--tenants 6] [--batches 4] [--batch-size 2048]
        [--delay-bound 5] [--out benchmarks/results/reward_service.json]

Paper (DistRS, NSDI '26) for comparison: 3.79x less GPU time than ZQ-Dedicated at 0.62 s mean
extra delay; EBF needs 1.5x fewer GPUs than FCFS for the same delay.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from m2flow.scheduler.reward_replay import TenantTrace, replay
from m2flow.scheduler.reward_scaling import (
    BatchView,
    DistRSPolicy,
    zq_dedicated_workers,
)
from m2flow.scheduler.reward_sim import RequestRecord
from rich.console import Console
from rich.table import Table

STAGES = ("check", "execute")
TIMEOUTS = (60.0, 120.0)


def make_batch(rng: random.Random, size: int, drift: float, spread: float) -> list[RequestRecord]:
    """One batch: long-tail arrivals over the rollout, two stages with fails and timeouts.

    ``drift`` scales stage times and ``spread`` the arrival offsets (batch-to-batch change).
    """
    out = []
    for _ in range(size):
        # generation time of a response: long tail (lognormal), capped at the rollout's end
        r = min(900.0, spread * (20.0 + 110.0 * rng.lognormvariate(0.0, 0.85)))
        u = rng.random()
        if u < 0.01:  # the checker hangs: killed at its timeout, execute skipped
            out.append(RequestRecord(r, (TIMEOUTS[0],), True))
            continue
        check = min(TIMEOUTS[0], drift * rng.lognormvariate(1.0, 0.4))  # ~3 s
        if u < 0.06:  # syntax error: fails fast, execute skipped (penalty reward)
            out.append(RequestRecord(r, (check,), True))
            continue
        if u < 0.09:  # an infinite loop in the tests: killed at 120 s
            out.append(RequestRecord(r, (check, TIMEOUTS[1]), True))
            continue
        ex = drift * rng.lognormvariate(3.78, 0.45)  # median ~44 s, mean ~48 s
        out.append(RequestRecord(r, (check, min(ex, TIMEOUTS[1])), ex >= TIMEOUTS[1]))
    return out


def make_tenants(
    n_tenants: int, n_batches: int, size: int, delay_bound: float, seed: int
) -> list[TenantTrace]:
    rng = random.Random(seed)
    tenants = []
    for ti in range(n_tenants):
        batches = [
            make_batch(rng, size, rng.uniform(0.85, 1.15), rng.uniform(0.9, 1.1))
            for _ in range(n_batches + 1)
        ]
        tenants.append(
            TenantTrace(
                name=f"task{ti}",
                start_s=ti * 420.0,  # staggered starts
                batches=batches[1:],
                warmup=batches[0],  # a profiling batch: the first batch's history
                train_s=rng.uniform(240.0, 360.0),
                delay_bound_s=delay_bound,
            )
        )
    return tenants


def zq_dedicated(tenants: list[TenantTrace]) -> dict:
    """Each tenant holds its zero-queue peak per stage for its whole (undelayed) run."""
    worker_s = [0.0] * len(STAGES)
    for t in tenants:
        counts = zq_dedicated_workers(t.batches, len(STAGES))
        span = sum(max(r.zq_finish_s for r in b) for b in t.batches)
        span += t.train_s * (len(t.batches) - 1)
        worker_s = [w + c * span for w, c in zip(worker_s, counts)]
    return {"worker_s": worker_s, "mean_delay_s": 0.0, "max_delay_s": 0.0, "over_bound": 0}


def run_policy(tenants, name: str, cold_start: float) -> dict:
    ebf = name != "FCFS"
    policy = DistRSPolicy(TIMEOUTS, ebf=ebf, timeout_check=name in ("DistRS", "FCFS"))
    t0 = time.perf_counter()
    res = replay(tenants, TIMEOUTS, policy.decide, ebf, name == "Ideal", cold_start)
    delays = [b.extra_delay_s for b in res.batches]
    bound = tenants[0].delay_bound_s
    return {
        "worker_s": res.worker_s,
        "busy_s": res.busy_s,
        "mean_delay_s": sum(delays) / len(delays),
        "max_delay_s": max(delays),
        "over_bound": sum(d > bound + 1e-6 for d in delays),
        "batches": len(delays),
        "requests": res.requests_done,
        "peak_workers": res.peak_workers,
        "decisions": res.decisions,
        "decision_mean_s": sum(res.decision_s) / max(len(res.decision_s), 1),
        "decision_max_s": max(res.decision_s, default=0.0),
        "replay_s": time.perf_counter() - t0,
    }


def decision_time(n_requests: int, n_batches: int, delay_bound: float, seed: int) -> dict:
    """One Algorithm 2 + 1 decision with ``n_requests`` outstanding over ``n_batches``
    batches that just started (all requests still to come)."""
    rng = random.Random(seed)
    per = n_requests // n_batches
    views = [
        BatchView(("t", i), 0.0, per, make_batch(rng, per, 1.0, 1.0), delay_bound)
        for i in range(n_batches)
    ]
    dec = DistRSPolicy(TIMEOUTS).decide(views, 0.0)
    return {
        "requests": per * n_batches,
        "batches": n_batches,
        "seconds": dec.seconds,
        "probes": dec.probes,
        "workers": dec.workers,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--batches", type=int, default=4, help="batches per tenant")
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--delay-bound", type=float, default=5.0, help="D, seconds")
    ap.add_argument("--cold-start", type=float, default=2.0, help="worker start, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/reward_service.json")
    args = ap.parse_args()
    tenants = make_tenants(args.tenants, args.batches, args.batch_size, args.delay_bound, args.seed)
    results = {"ZQ-Dedicated": zq_dedicated(tenants)}
    for name in ("Ideal", "DistRS", "History-only", "FCFS"):
        results[name] = run_policy(tenants, name, args.cold_start)
    dt = decision_time(16000, 8, args.delay_bound, args.seed + 1)

    con = Console(width=160)
    table = Table(
        title=f"reward service replay: {args.tenants} tenants x {args.batches} "
        f"batches x {args.batch_size} requests, D = {args.delay_bound:g} s"
    )
    for col in (
        "policy",
        *(f"{s} worker-h" for s in STAGES),
        "total worker-h",
        "vs ZQ",
        "mean d (s)",
        "max d (s)",
        "batches > D",
        "decision (s) mean/max",
    ):
        table.add_column(col, justify="right")
    zq_total = sum(results["ZQ-Dedicated"]["worker_s"])
    for name, r in results.items():
        total = sum(r["worker_s"])
        r["total_worker_s"] = total
        r["saving_vs_zq"] = zq_total / total
        dec = (
            f"{r['decision_mean_s']:.3f}/{r['decision_max_s']:.3f}"
            if "decision_mean_s" in r
            else "-"
        )
        table.add_row(
            name,
            *(f"{w / 3600:.1f}" for w in r["worker_s"]),
            f"{total / 3600:.1f}",
            f"{zq_total / total:.2f}x",
            f"{r['mean_delay_s']:.2f}",
            f"{r['max_delay_s']:.2f}",
            str(r["over_bound"]),
            dec,
        )
    con.print(table)
    ebf_vs_fcfs = {
        s: results["FCFS"]["worker_s"][k] / results["DistRS"]["worker_s"][k]
        for k, s in enumerate(STAGES)
    }
    con.print(
        "FCFS / EBF worker-time: "
        + ", ".join(f"{s} {v:.2f}x" for s, v in ebf_vs_fcfs.items())
        + " (paper: EBF needs 1.5x fewer GPUs than FCFS)"
    )
    con.print(
        f"scaling decision over {dt['requests']} requests in {dt['batches']} batches: "
        f"{dt['seconds']:.2f} s ({dt['probes']} simulations; paper ~2 s)"
    )
    out = {
        "config": vars(args) | {"stages": STAGES, "timeouts_s": TIMEOUTS},
        "machine": platform.platform(),
        "python": platform.python_version(),
        "policies": results,
        "fcfs_over_ebf_worker_time": ebf_vs_fcfs,
        "decision_16k": dt,
        "paper": {
            "saving_vs_zq": 3.79,
            "mean_extra_delay_s": 0.62,
            "fcfs_over_ebf_gpus": 1.5,
            "decision_s": 2.0,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    con.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
