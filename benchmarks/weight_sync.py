"""Weight sync: seconds per ``m2flow.sync_weights`` and bytes/s, object store vs collective.

The source rank holds a random state dict with the names and shapes of a Qwen2 model of about
100M parameters (fp32, ~390 MB; no download: shapes from a Qwen2-like config), its
``get_weights`` returns it as is (CPU tensors, as an actor's does), and every destination
rank's ``load_weights`` copies it into its own preallocated tensors (what ``load_state_dict``
does). Cases: 1 source rank to 1 and to 2 destination ranks, each over both transports
(``object_store``, ``collective``: gloo on CPU). Each case is synced once as a warm-up (the
collective link is built then; that first sync is reported separately), then the cases run
interleaved, round after round, the order reversed every other round, so drift on a shared
machine hits them alike. Reported per case: the median seconds per sync over the rounds and
the spread (lowest..highest), and bytes/s (model bytes / seconds: the rate each destination
receives at; "aggregate" multiplies by the destinations).

    python benchmarks/weight_sync.py [--repeats 7] [--quick] [--out PATH.json]
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
import torch  # noqa: E402

from m2flow import Cluster, Worker, group_method, sync_weights  # noqa: E402
from m2flow.core.weight_transport import BUCKET_BYTES  # noqa: E402

# ~98M parameters: Qwen2 layout (GQA, biased q/k/v, SwiGLU MLP, untied lm_head off).
FULL = {"vocab": 32000, "hidden": 768, "intermediate": 2048, "layers": 12, "heads": 12, "kv": 2}
QUICK = {"vocab": 1000, "hidden": 128, "intermediate": 256, "layers": 2, "heads": 4, "kv": 2}
TRANSPORTS = ("object_store", "collective")


def qwen2_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a Qwen2 causal LM with config ``c`` (tied embeddings)."""
    h, kv = c["hidden"], c["hidden"] // c["heads"] * c["kv"]
    shapes = {"model.embed_tokens.weight": (c["vocab"], h)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (c["intermediate"], h),
            p + "mlp.up_proj.weight": (c["intermediate"], h),
            p + "mlp.down_proj.weight": (h, c["intermediate"]),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes["model.norm.weight"] = (h,)
    return shapes


class Source(Worker):
    def __init__(self, config: dict) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = {n: torch.randn(s, generator=g) for n, s in qwen2_shapes(config).items()}
        self.weight_version = 0

    def get_weights(self) -> dict:
        return self.weights

    @group_method
    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.weights.values()))


class Dest(Worker):
    def __init__(self, config: dict) -> None:
        self.params = {n: torch.zeros(s) for n, s in qwen2_shapes(config).items()}

    def load_weights(self, weights: dict, version: int) -> None:
        for n, t in weights.items():
            self.params[n].copy_(t)

    @group_method
    def checksum(self) -> float:
        s = float(sum(t.double().sum() for t in self.params.values()))
        for t in self.params.values():  # the next sync must write them again
            t.zero_()
        return s


def _row(case: dict, seconds: list[float], nbytes: int, first: float) -> dict:
    med = statistics.median(seconds)
    return {
        **case,
        "seconds": seconds,
        "median_s": med,
        "min_s": min(seconds),
        "max_s": max(seconds),
        "first_sync_s": first,
        "bytes_per_s": nbytes / med,
        "bytes_per_s_low": nbytes / max(seconds),
        "bytes_per_s_high": nbytes / min(seconds),
        "aggregate_bytes_per_s": nbytes * case["destinations"] / med,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7, help="rounds, interleaved (>= 5)")
    ap.add_argument("--quick", action="store_true", help="a ~0.4M-parameter model (2 MiB)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    args = ap.parse_args(argv)
    config = QUICK if args.quick else FULL
    name = "weight_sync_quick" if args.quick else "weight_sync"
    out = Path(args.out or Path(__file__).parent / "results" / f"{name}.json")
    shapes = qwen2_shapes(config)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    nbytes = params * 4
    print(f"model: {params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB fp32", flush=True)

    run_dir = tempfile.mkdtemp(prefix="m2bench-")
    cluster = Cluster(run_dir=run_dir, virtual_devices_per_node=4, num_cpus=2)
    try:
        src = Source.launch(cluster, [0], name="ws_source", config=config)
        dsts = {
            1: Dest.launch(cluster, [1], name="ws_dst1", config=config),
            2: Dest.launch(cluster, [2, 3], name="ws_dst2", config=config),
        }
        expected = src.checksum().wait()[0]
        cases = [{"transport": t, "destinations": n} for n in dsts for t in TRANSPORTS]

        def sync(case: dict) -> float:
            dst = dsts[case["destinations"]]
            t0 = time.perf_counter()
            sync_weights(src, dst, transport=case["transport"])
            return time.perf_counter() - t0

        first = {}
        for i, case in enumerate(cases):  # warm-up; checks the delivery too
            first[i] = sync(case)
            got = dsts[case["destinations"]].checksum().wait()
            assert all(abs(g - expected) <= 1e-6 * max(1.0, abs(expected)) for g in got), got
        seconds: dict[int, list[float]] = {i: [] for i in range(len(cases))}
        for rep in range(args.repeats):
            order = list(range(len(cases)))
            for i in order if rep % 2 == 0 else reversed(order):
                seconds[i].append(sync(cases[i]))
            print(f"round {rep + 1}/{args.repeats} done", flush=True)
        results = [_row(c, seconds[i], nbytes, first[i]) for i, c in enumerate(cases)]
    finally:
        cluster.shutdown()

    print()
    print(
        f"sync_weights, {params / 1e6:.1f}M params ({nbytes / 2**20:.0f} MiB fp32), "
        f"1 source rank; median of {args.repeats} interleaved rounds [min..max]"
    )
    head = f"{'transport':13s} {'dst':>3s} {'s/sync':>8s} {'[min..max]':>16s} {'MB/s':>7s} "
    head += f"{'[low..high]':>14s} {'aggr MB/s':>9s} {'1st sync s':>10s}"
    print(head)
    for r in results:
        print(
            f"{r['transport']:13s} {r['destinations']:3d} {r['median_s']:8.3f} "
            f"[{r['min_s']:6.3f}..{r['max_s']:6.3f}] {r['bytes_per_s'] / 1e6:7.0f} "
            f"[{r['bytes_per_s_low'] / 1e6:5.0f}..{r['bytes_per_s_high'] / 1e6:5.0f}] "
            f"{r['aggregate_bytes_per_s'] / 1e6:9.0f} {r['first_sync_s']:10.3f}"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": name,
                "config": {
                    "model": config,
                    "parameters": params,
                    "bytes": nbytes,
                    "repeats": args.repeats,
                    "bucket_bytes": BUCKET_BYTES,
                },
                "load_avg_1m": os.getloadavg()[0],
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": sys.version.split()[0],
                    "ray": ray.__version__,
                    "torch": torch.__version__,
                    "platform": platform.platform(),
                },
                "results": results,
                "unit": {"seconds": "s per sync", "bytes_per_s": "model bytes / s per sync"},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
