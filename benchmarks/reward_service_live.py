"""Live run of the reward service on this machine: two tenants, real code and math requests.

Starts the service on loopback (in this process, uvicorn in a thread; workers are real
processes, code runs in the sandbox). Tenant ``alice`` trains on code: each batch holds
generated Python functions (correct, wrong, syntax errors, infinite loops, slow ones) with
test cases. Tenant ``bob`` trains on math: each batch holds responses with boxed answers
(right or wrong) checked by math-verify. Each tenant announces a batch, submits its requests
as a rollout would finish them (long-tail delays), waits for the batch's rewards, "trains"
for a few seconds, and repeats. The pools scale on every announcement and completion.

Prints per-batch results, the worker counts over time (scale up and down), worker-seconds vs
busy-seconds per stage, and decision times; writes benchmarks/results/reward_service_live.json.

    flock scratch/cpu.lock python benchmarks/reward_service_live.py [--batches 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from pathlib import Path

from m2flow.reward_service.app import BackgroundServer
from m2flow.reward_service.client import AsyncRewardClient
from m2flow.reward_service.sandbox import isolation
from m2flow.reward_service.schemas import ServiceConfig

TOKENS = {"alice": "alice-live-token", "bob": "bob-live-token"}


def config(delay_bound: float) -> ServiceConfig:
    sandbox = {"wall_s": 3.0, "cpu_s": 1, "memory_bytes": 256 * 2**20}
    return ServiceConfig.model_validate(
        {
            "port": 0,
            "tenants": {n: {"token": t} for n, t in TOKENS.items()},
            "default_delay_bound_s": delay_bound,
            "pipelines": {
                "code": {
                    "kind": "code",
                    "penalty": -1.0,
                    "stages": {
                        "check": {"timeout_s": 5, "max_workers": 2},
                        "execute": {
                            "timeout_s": 2.5,
                            "max_workers": 6,
                            "initial_workers": 4,
                            "options": {"sandbox": sandbox},
                        },
                    },
                },
                "math": {
                    "kind": "math",
                    "penalty": 0.0,
                    "stages": {
                        "extract": {"timeout_s": 10, "max_workers": 2},
                        "verify": {"timeout_s": 10, "max_workers": 3},
                    },
                },
            },
        }
    )


def code_request(rng: random.Random, i: int) -> dict:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    tests = [f"assert add({a}, {b}) == {a + b}", "assert add(0, 0) == 0"]
    kind = rng.choices(["ok", "wrong", "syntax", "loop", "slow"], [55, 20, 10, 5, 10])[0]
    body = {
        "ok": "    return a + b",
        "wrong": "    return a - b",
        "syntax": "    return a +",
        "loop": "    while True:\n        pass",
        "slow": "    import time\n    time.sleep(0.6)\n    return a + b",
    }[kind]
    return {"code": f"def add(a, b):\n{body}\n", "tests": tests}


def math_request(rng: random.Random, i: int) -> dict:
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    got = a * b if rng.random() < 0.7 else a * b + rng.randint(1, 5)
    resp = f"We multiply {a} by {b}. The answer is \\boxed{{{got}}}."
    if rng.random() < 0.1:
        resp = "I am not sure."
    return {"response": resp, "answer": str(a * b)}


async def tenant(url, name, task, pipeline, make, size, n_batches, seed, log):
    rng = random.Random(seed)
    async with AsyncRewardClient(url, TOKENS[name]) as c:
        await c.register(task, pipeline)
        for bi in range(n_batches):
            t0 = time.monotonic()
            b = await c.announce(task, size, batch=f"step{bi}")

            async def one(i, b=b):
                # long-tail "generation time" before the response is ready
                await asyncio.sleep(min(8.0, 0.3 + rng.lognormvariate(0.0, 0.8)))
                await c.submit(task, b, make(rng, i), id=str(i))
                return time.monotonic()

            last = max(await asyncio.gather(*(one(i) for i in range(size))))
            results = await c.results(task, b, timeout_s=120)
            done = time.monotonic()
            rewards = [r["reward"] for r in results]
            statuses = {}
            for r in results:
                statuses[r["status"]] = statuses.get(r["status"], 0) + 1
            log.append(
                {
                    "tenant": name,
                    "task": task,
                    "batch": b,
                    "requests": len(results),
                    "reward_mean": sum(rewards) / len(rewards),
                    "statuses": statuses,
                    "batch_s": done - t0,
                    "after_last_submit_s": done - last,
                    "max_latency_s": max(r["latency_s"] for r in results),
                }
            )
            await asyncio.sleep(3.0)  # the trainer's update step


def sample(server: BackgroundServer, stop: threading.Event, out: list) -> None:
    t0 = time.monotonic()
    while not stop.is_set():
        m = server.service.metrics()
        out.append(
            {"t_s": time.monotonic() - t0}
            | {k: v["alive"] for k, v in m["pools"].items()}
            | {f"{k}.busy": v["busy"] for k, v in m["pools"].items()}
        )
        stop.wait(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--code-size", type=int, default=40)
    ap.add_argument("--math-size", type=int, default=60)
    ap.add_argument("--delay-bound", type=float, default=1.0)
    ap.add_argument("--out", default="benchmarks/results/reward_service_live.json")
    args = ap.parse_args()
    server = BackgroundServer(config(args.delay_bound))
    log: list[dict] = []
    timeline: list[dict] = []
    t0 = time.monotonic()
    with server as url:
        stop = threading.Event()
        th = threading.Thread(target=sample, args=(server, stop, timeline), daemon=True)
        th.start()

        async def run():
            await asyncio.gather(
                tenant(url, "alice", "code-rl", "code", code_request, args.code_size,
                       args.batches, 1, log),
                tenant(url, "bob", "math-rl", "math", math_request, args.math_size,
                       args.batches, 2, log),
            )  # fmt: skip

        asyncio.run(run())
        time.sleep(1.0)
        stop.set()
        th.join()
        metrics = server.service.metrics()
        decisions = list(server.service.decisions)
    wall = time.monotonic() - t0
    print(f"reward service live run: {wall:.1f} s, sandbox isolation: {isolation()}")
    print(f"{'tenant':6} {'batch':6} {'n':>4} {'reward':>7} {'batch s':>8} {'after last':>10}"
          "  statuses")  # fmt: skip
    for r in log:
        print(f"{r['tenant']:6} {r['batch']:6} {r['requests']:4d} {r['reward_mean']:7.3f} "
              f"{r['batch_s']:8.2f} {r['after_last_submit_s']:10.2f}  {r['statuses']}")  # fmt: skip
    print("\nworkers over time (alive per pool, every ~2 s):")
    keys = [k for k in metrics["pools"]]
    print("   t_s " + " ".join(f"{k:>14}" for k in keys))
    for row in timeline[::4]:
        print(f"{row['t_s']:6.1f} " + " ".join(f"{row.get(k, 0):14d}" for k in keys))
    print("\nper pool: worker-seconds held vs busy; peak workers")
    for k, p in metrics["pools"].items():
        peak = max((row.get(k, 0) for row in timeline), default=0)
        print(f"  {k:15} held {p['worker_s']:7.1f} s  busy {p['busy_s']:7.1f} s  peak {peak}")
    secs = [d["seconds"] for d in decisions]
    print(f"\n{len(decisions)} scaling decisions, max {max(secs):.4f} s; "
          f"requests done {metrics['requests_done']}")  # fmt: skip
    out = {
        "wall_s": wall,
        "isolation": isolation(),
        "args": vars(args),
        "batches": log,
        "pools": metrics["pools"],
        "decisions": decisions,
        "timeline": timeline,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
