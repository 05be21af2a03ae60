"""Channel throughput: m2flow Channel vs ray.util.queue.Queue, side by side in one Ray session.

Cases (each run on both queues, same items, same workers):
  small/driver    put N small items from the driver, then get them all (items/s)
  small/batched   the same in batches of 32 (put_many + get_batch; the Ray queue's
                  put_nowait_batch + get_nowait_batch)
  small/pipeline  producer worker -> consumer worker, N small items (items/s)
  tensor/driver   put + get of one large tensor from the driver, R round trips (MB/s)
  tensor/pipeline producer worker -> consumer worker, R large tensors (MB/s)

The pipelines use the same m2flow workers (devices 0 and 1, so no lock contention) for both
queues: only the queue differs. Repeats are interleaved (every case on both queues once per
round, the queue that goes first alternating), so drift on a shared machine hits both alike.
Reported per case and queue: the median over the rounds and the spread (lowest and highest
round); the ratio of the medians, and the ratio's range over the rounds (lowest m2flow round
over the highest Ray round, and the reverse): a claim of "k times" needs the lowest of those
above k.

    python benchmarks/channel.py [--items 2000] [--tensor-mb 64] [--round-trips 10] \\
        [--repeats 5] [--out benchmarks/results/channel.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# the workers unpickle this module's classes by reference: make it importable there
_here = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_here, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
)

import ray  # noqa: E402
from ray.util.queue import Queue  # noqa: E402

from m2flow import Channel, Cluster, Worker, group_method  # noqa: E402


def small_item(i: int) -> dict:
    return {"id": i, "prompt": f"p{i}", "reward": 0.5}


class Producer(Worker):
    @group_method
    def produce_small(self, q, kind: str, n: int):
        t0 = time.perf_counter()
        for i in range(n):
            q.put(small_item(i))
        return time.perf_counter() - t0

    @group_method
    def produce_tensor(self, q, kind: str, mb: int, rounds: int):
        import torch

        t = torch.ones(mb * 1024 * 1024 // 4)
        for _ in range(rounds):
            q.put(t)
        return rounds


class Consumer(Worker):
    @group_method
    def consume_small(self, q, kind: str, n: int):
        total = 0
        for _ in range(n):
            total += q.get(timeout=300)["id"]
        return total

    @group_method
    def consume_tensor(self, q, kind: str, rounds: int):
        s = 0.0
        for _ in range(rounds):
            t = q.get(timeout=300)
            s += float(t[-1])
        return s


def _timeit(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_small_driver(q, n: int) -> float:
    def run():
        for i in range(n):
            q.put(small_item(i))
        got = [q.get(timeout=300) for _ in range(n)]
        assert got[-1]["id"] == n - 1 and len(got) == n

    return n / _timeit(run)


def bench_small_driver_batched(q, n: int, batch: int = 32) -> float:
    """Put in batches of ``batch`` (a GRPO step's prompts) and take them back in batches:
    ``put_many``/``get_batch`` against the Ray queue's ``put_nowait_batch``/``get_nowait_batch``."""

    def run():
        for s in range(0, n, batch):
            items = [small_item(i) for i in range(s, min(s + batch, n))]
            if isinstance(q, Channel):
                q.put_many(items)
                got = q.get_batch(len(items), max_items=len(items), timeout=300)
            else:
                q.put_nowait_batch(items)
                got = q.get_nowait_batch(len(items))
            assert [g["id"] for g in got] == [it["id"] for it in items]

    return n / _timeit(run)


def bench_small_pipeline(q, kind: str, prod, cons, n: int) -> float:
    def run():
        c = cons.consume_small(q, kind, n)
        p = prod.produce_small(q, kind, n)
        p.wait(timeout=600)
        assert c.wait(timeout=600) == [n * (n - 1) // 2]

    return n / _timeit(run)


def bench_tensor_driver(q, mb: int, rounds: int) -> float:
    import torch

    t = torch.ones(mb * 1024 * 1024 // 4)

    def run():
        for _ in range(rounds):
            q.put(t)
            out = q.get(timeout=300)
            assert out.numel() == t.numel()

    return mb * rounds / _timeit(run)


def bench_tensor_pipeline(q, kind: str, prod, cons, mb: int, rounds: int) -> float:
    def run():
        c = cons.consume_tensor(q, kind, rounds)
        p = prod.produce_tensor(q, kind, mb, rounds)
        p.wait(timeout=600)
        assert c.wait(timeout=600) == [float(rounds)]

    return mb * rounds / _timeit(run)


def _row(case: str, rounds: dict[str, list[float]]) -> dict:
    """Medians, spreads and the ratio's range over the rounds (module docstring)."""
    row: dict = {"case": case, "rounds": rounds}
    for kind, xs in rounds.items():
        row[kind] = statistics.median(xs)
        row[f"{kind}_low"], row[f"{kind}_high"] = min(xs), max(xs)
    row["ratio"] = row["m2flow"] / row["ray"]
    row["ratio_low"] = row["m2flow_low"] / row["ray_high"]
    row["ratio_high"] = row["m2flow_high"] / row["ray_low"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=2000, help="small items per case")
    ap.add_argument("--tensor-mb", type=int, default=64, help="tensor size in MB")
    ap.add_argument("--round-trips", type=int, default=10, help="tensor round trips per case")
    ap.add_argument("--repeats", type=int, default=5, help="rounds, interleaved")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "channel.json"))
    args = ap.parse_args(argv)

    run_dir = tempfile.mkdtemp(prefix="m2bench-")
    cluster = Cluster(run_dir=run_dir, virtual_devices_per_node=2, num_cpus=2)
    try:
        prod = Producer.launch(cluster, placement=[0], name="bench_producer")
        cons = Consumer.launch(cluster, placement=[1], name="bench_consumer")
        ch = Channel.create("bench")
        rq = Queue(actor_options={"num_cpus": 0})
        queues = {"m2flow": ch, "ray": rq}
        n, mb, r = args.items, args.tensor_mb, args.round_trips
        cases = {
            "small/driver (items/s)": lambda q, k: bench_small_driver(q, n),
            "small/driver, batches of 32 (items/s)": lambda q, k: bench_small_driver_batched(q, n),
            "small/pipeline (items/s)": lambda q, k: bench_small_pipeline(q, k, prod, cons, n),
            "tensor/driver (MB/s)": lambda q, k: bench_tensor_driver(q, mb, r),
            "tensor/pipeline (MB/s)": lambda q, k: bench_tensor_pipeline(q, k, prod, cons, mb, r),
        }
        # warm up both queues and both workers
        for kind, q in queues.items():
            bench_small_driver(q, 50)
            bench_small_pipeline(q, kind, prod, cons, 50)
            bench_tensor_pipeline(q, kind, prod, cons, 1, 2)
        rounds: dict[str, dict[str, list[float]]] = {c: {k: [] for k in queues} for c in cases}
        for rep in range(args.repeats):
            order = list(queues) if rep % 2 == 0 else list(reversed(queues))
            for case, fn in cases.items():
                for kind in order:
                    rounds[case][kind].append(fn(queues[kind], kind))
            print(f"round {rep + 1}/{args.repeats} done", flush=True)
        results = [_row(case, rounds[case]) for case in cases]
        for row in results:
            print(
                f"{row['case']:38s} m2flow {row['m2flow']:10.1f}  ray Queue {row['ray']:10.1f}  "
                f"ratio {row['ratio']:.2f} ({row['ratio_low']:.2f}-{row['ratio_high']:.2f})",
                flush=True,
            )
    finally:
        cluster.shutdown()

    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"m2flow Channel vs ray.util.queue.Queue ({n} small items, {mb} MB x {r} "
            f"tensors; medians of {args.repeats} interleaved rounds, [lowest, highest])"
        )
        for col in ("case", "m2flow", "ray Queue", "m2flow / ray"):
            table.add_column(col, justify="left" if col == "case" else "right")
        for row in results:
            table.add_row(
                row["case"],
                f"{row['m2flow']:,.1f} [{row['m2flow_low']:,.0f}, {row['m2flow_high']:,.0f}]",
                f"{row['ray']:,.1f} [{row['ray_low']:,.0f}, {row['ray_high']:,.0f}]",
                f"{row['ratio']:.2f}x [{row['ratio_low']:.2f}, {row['ratio_high']:.2f}]",
            )
        Console().print(table)
    except ImportError:
        pass

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "channel",
                "config": {"items": n, "tensor_mb": mb, "round_trips": r, "repeats": args.repeats},
                "load_avg_1m": os.getloadavg()[0],
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": sys.version.split()[0],
                    "ray": ray.__version__,
                    "platform": platform.platform(),
                },
                "results": results,
                "unit": {"small": "items/s", "tensor": "MB/s"},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
