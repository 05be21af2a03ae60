"""Profiler: measure a workflow runner to plan it (RLinf section 5, "profiling").

``m2flow profile WORKFLOW.py [overrides] -o profile.yaml`` runs the unchanged runner a few
steps at a time under temporal placements on ``n = 1, 2, 4, ...`` devices (every group on
devices ``0..n-1``, so each group's busy time is measured alone on ``n`` devices) and once more
pipelined in chunks, to measure what each extra chunk costs. From the session's records
(:mod:`m2flow.session`) it writes, per worker group:

- ``points``: devices -> median busy seconds per step and peak memory bytes per device;
- ``switch_s``: one offload plus one onload (seconds), what time-sharing costs per step;
- ``chunk_overhead_s``: extra seconds per additional chunk when the batch is split and
  pipelined: ``(busy pipelined in k chunks - busy on 1 device) / (k - 1)``. The pipelined run
  puts the source groups (fed by the driver only, the rollout) on device 0 and the others on
  device 1, time-shared, so consumers get chunks one at a time as a spatial plan feeds them.
  The overhead then holds everything pipelining costs a group: its fixed cost per chunk (or
  per training part), the lock hand-offs of groups sharing a stage, and the slowdown of
  running at the same time as the other stage (on virtual devices the cores share caches,
  memory bandwidth and Ray's own processes). One chunk costs exactly the 1-device time, as a
  stage that is not pipelined runs alone. With one device, or no source group to split off,
  the chunked run stays temporal on one device: it measures the producer's cost per chunk
  only (a consumer there trains queued chunks together);

and for the workflow: the traced graph (channel edges with items per step), the batch size
``M`` (items the runner puts into the workflow per step: the driver's edges) and
``step_overhead_s``, the seconds of a step no group accounts for (the runner's own work and
the runtime's hand-offs), which the planner's predictions add.

Schema: :mod:`m2flow.scheduler.profile`.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from .placement import Placement
from .scheduler.profile import ComponentProfile, Edge, Point, Profile


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def run_steps(
    workflow: str,
    overrides: list[str],
    config_files: list[str],
    placement: Placement,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """Run the workflow under ``placement`` for ``warmup + steps`` steps; measurements.

    Returns:
        ``busy`` (group -> median busy seconds over the measured steps), ``step_s`` (median
        step wall seconds), ``stats`` (group -> per-rank load stats), ``edges`` (``(src, dst,
        items)`` traced, driver included), ``steps`` (steps measured), ``num_devices``,
        ``memory_capacity`` (bytes per device), ``data_parallel`` (group -> bool).
    """
    from .trace import workflow_graph
    from .workflow import run_workflow

    session = run_workflow(
        workflow,
        overrides,
        plan=placement,
        config_files=config_files,
        max_steps=warmup + steps,
        keep_cluster=True,
    )
    cluster = session.cluster
    if cluster is None:
        raise RuntimeError(f"{workflow}: the runner never built an m2flow Cluster")
    try:
        busy = session.busy_per_step()[warmup:]
        step_s = session.step_times()[warmup:]
        if not busy:
            raise RuntimeError(
                f"{workflow}: the runner logged fewer than {warmup + 1} steps; profile "
                "needs a runner that logs each step with m2flow.runlog.RunLog"
            )
        groups = {g.name: g for g in cluster.groups}
        return {
            "busy": {n: _median([b.get(n, 0.0) for b in busy]) for n in groups},
            "step_s": _median(step_s),
            "stats": {n: g.load_stats() for n, g in groups.items()},
            "data_parallel": {n: g.worker_cls.data_parallel for n, g in groups.items()},
            "edges": [(e.src, e.dst, e.items) for e in workflow_graph(include_driver=True)],
            "steps": len(busy),
            "num_devices": cluster.num_devices,
            "memory_capacity": min(d.memory_bytes for d in cluster.devices),
        }
    finally:
        cluster.shutdown()


def _switch_s(stats: list[dict]) -> float:
    """Seconds of one offload plus one onload, the slowest rank."""
    per_rank = [
        s["onload_s"] / max(s["onloads"], 1) + s["offload_s"] / max(s["offloads"], 1) for s in stats
    ]
    return max(per_rank, default=0.0)


def _chunked_placement(first: dict[str, Any], num_devices: int, m: int) -> Placement:
    """Placement of the chunk-overhead run (module docstring): source groups on device 0, the
    rest time-shared on device 1, chunks of ``m`` items; temporal on device 0 when the cluster
    has one device or the graph no source group to split off."""
    groups = set(first["busy"])
    fed = {d for s, d, _ in first["edges"] if s != "driver" and s != d}
    sources = sorted(g for g in groups if g not in fed)
    if num_devices < 2 or not sources or len(sources) == len(groups):
        return Placement(mode="temporal", default_devices=[0], default_granularity=m)
    return Placement(
        mode="hybrid",
        groups={g: [0] for g in sources},
        default_devices=[1],
        default_granularity=m,
    )


def profile(
    workflow: str,
    overrides: list[str] | None = None,
    config_files: list[str] | None = None,
    device_counts: list[int] | None = None,
    steps: int = 10,
    warmup: int = 2,
    chunks: int = 4,
    log=print,
) -> Profile:
    """Profile ``workflow`` (see the module docstring); the planner's
    :class:`~m2flow.scheduler.profile.Profile`.

    Args:
        device_counts: device counts to measure (default ``1, 2, 4, ...`` up to the cluster's).
        steps, warmup: measured steps per run and steps discarded before them.
        chunks: chunks per batch in the chunk-overhead run (1 skips it).

    Raises:
        RuntimeError: the runner logs no steps or builds no Cluster.
    """
    overrides, config_files = list(overrides or []), list(config_files or [])

    def run(placement: Placement, what: str) -> dict:
        log(f"profiling {what} ...")
        res = run_steps(workflow, overrides, config_files, placement, steps, warmup)
        shown = ", ".join(f"{g} {t:.3f} s" for g, t in res["busy"].items())
        log(f"  {what}: step {res['step_s']:.3f} s; busy {shown}")
        return res

    first = run(Placement(mode="temporal", default_devices=[0]), "1 device")
    n_max = first["num_devices"]
    counts = device_counts or [n for n in (2**i for i in range(12)) if n <= n_max]
    bad = [n for n in counts if not 1 <= n <= n_max]
    if bad:
        raise ValueError(f"device counts {bad} are not in 1..{n_max} (the cluster's devices)")
    runs = {1: first}
    for n in counts:
        if n not in runs:
            placement = Placement(mode="temporal", default_devices=list(range(n)))
            runs[n] = run(placement, f"{n} devices")

    per_step = first["steps"] or 1
    driver_items = [i for s, d, i in first["edges"] if s == "driver" and d != "driver"]
    batch = max(1, round(sum(driver_items) / (per_step + warmup)))
    chunked = None
    if chunks > 1 and batch >= chunks:
        m = math.ceil(batch / chunks)
        chunked = run(_chunked_placement(first, n_max, m), f"pipelined, chunks of {m}")
        k = math.ceil(batch / m)

    edges: dict[tuple[str, str], int] = defaultdict(int)
    for s, d, items in first["edges"]:
        if "driver" not in (s, d):
            edges[(s, d)] += items
    components = {}
    for g in first["busy"]:
        overhead = 0.0
        if chunked is not None:
            overhead = max(0.0, (chunked["busy"][g] - first["busy"][g]) / (k - 1))
        points = [
            Point(n, round(r["busy"][g], 6), max(s["peak_memory_bytes"] for s in r["stats"][g]))
            for n, r in sorted(runs.items())
        ]
        components[g] = ComponentProfile(
            points,
            switch_s=round(_switch_s(first["stats"][g]), 6),
            chunk_overhead_s=round(overhead, 6),
        )
    unattributed = first["step_s"] - sum(first["busy"].values())
    unattributed -= sum(c.switch_s for c in components.values())
    return Profile(
        batch_size=batch,
        components=components,
        edges=[
            Edge(s, d, round(i / (per_step + warmup), 3)) for (s, d), i in sorted(edges.items())
        ],
        workflow=Path(workflow).stem,
        device_memory_bytes=first["memory_capacity"],
        step_overhead_s=round(max(unattributed, 0.0), 6),
    )
