"""Profiler: measure a workflow runner to plan it (RLinf section 3.4, "Profiler").

``m2flow profile WORKFLOW.py [overrides] -o profile.yaml`` runs the unchanged runner a few
steps at a time under temporal placements on ``n = 1, 2, 4, ...`` devices (every group on
devices ``0..n-1``, so each group's busy time is measured alone on ``n`` devices) and once more
pipelined in chunks, to measure what each extra chunk costs. From the session's records
(:mod:`m2flow.run.session`) it writes, per worker group:

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

For every two-member cycle of the traced graph (env <-> policy) it also measures what the
cycle's cost model (:mod:`m2flow.scheduler.plan.cycle`) needs, profile key ``cycles``:

- ``round_trips`` R: items per step the leader puts on the cycle (the 1-device run, one rank);
  the leader is the member whose worker says how many items its share holds
  (``share_items()``, the env: it splits them into sub-batches), else the first by name;
- ``batch``: that ``share_items()`` (1 when no member says: no sub-batching);
- ``shared_gap_s``: per round trip, the cycle's wall time in the 1-device run (the leader's
  call) less both members' busy times: the device-lock hand-offs and channel latency of
  time-sharing. It is no longer part of ``step_overhead_s``;
- ``split_gap_s`` and ``split_scale``: from a run with the leader on device 0, the follower
  on device 1 (other groups on device 2, or 0 with two devices), one sub-batch. When its cycle
  wall time is above both 1-device busy times, the excess per round trip is ``split_gap_s``
  (``split_scale`` 1); when it is below (the time-shared busy times hold the lock's grace
  waits, which a split overlaps), ``split_scale`` is the ratio (``split_gap_s`` 0). Either way
  the model reproduces that run;
- ``sub_batch_overhead_s``: from one more split run in ``k`` sub-batches (the largest divisor
  of ``batch`` up to ``chunks``): the per-member cost of each extra sub-batch per round trip
  that makes the model's split time equal the measured one (both members charged alike).
  The split runs need 2 devices; with one, the cycle keeps ``split_gap_s = shared_gap_s`` and
  no sub-batch overhead (it cannot split there anyway).

Only the first run starts the runner from scratch (its warm start included): a runner that
resumes (a ``resume`` key, ``trainer.run_dir`` and ``trainer.save_every``, as the shipped
ones) checkpoints at its last measured step, and every later run resumes a copy of that
checkpoint, so the warm start runs once. Each run uses a run directory of its own under a
temporary one (the user's ``trainer.run_dir`` is left alone). With ``save``, the profile
measured so far is written after every run: an interrupted profile keeps its finished runs.

Schema: :mod:`m2flow.scheduler.plan.profile`.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import networkx as nx

from ..core.placement import Placement
from ..scheduler.plan.cost import divisors
from ..scheduler.plan.cycle import CycleCost
from ..scheduler.plan.profile import ComponentProfile, Edge, Point, Profile
from .measured import load_1m, machine
from .program import prepare, run_prepared


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
        ``busy`` (group -> median busy seconds over the measured steps), ``wall`` (group ->
        median seconds per step its calls took, waits included), ``step_s`` (median step
        wall seconds), ``stats`` (group -> per-rank load stats), ``edges`` (``(src, dst,
        items)`` traced, driver included), ``steps`` (steps measured), ``num_devices``,
        ``memory_capacity`` (bytes per device), ``data_parallel`` (group -> bool),
        ``share_items`` (group -> items of a rank's share, for groups whose worker says).
    """
    from .trace import workflow_graph

    module, cfg = prepare(workflow, overrides, config_files)
    session = run_prepared(module, cfg, placement, max_steps=warmup + steps, keep_cluster=True)
    cluster = session.cluster
    if cluster is None:
        raise RuntimeError(f"{workflow}: the runner never built an m2flow Cluster")
    try:
        busy = session.busy_per_step()[warmup:]
        step_s = session.step_times()[warmup:]
        if not busy:
            raise RuntimeError(
                f"{workflow}: the runner logged fewer than {warmup + 1} steps; profile "
                "needs a runner that logs each step with m2flow.run.runlog.RunLog"
            )
        groups = {g.name: g for g in cluster.groups}
        wall = _wall_per_step(session)[warmup:]
        return {
            "busy": {n: _median([b.get(n, 0.0) for b in busy]) for n in groups},
            "wall": {n: _median([w.get(n, 0.0) for w in wall]) for n in groups},
            "share_items": _share_items(groups),
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


def _wall_per_step(session) -> list[dict[str, float]]:
    """Per logged step >= 1: each group's call durations (max over ranks, waits included),
    summed over the calls waited during the step (as ``Session.busy_per_step`` for busy)."""
    per: list[dict[str, float]] = [defaultdict(float) for _ in session.marks]
    for c in session.calls:
        if c.step < len(session.marks):
            per[c.step][c.group] += c.duration
    return [dict(p) for (step, _), p in zip(session.marks, per) if step >= 1]


def _share_items(groups: dict) -> dict[str, int]:
    """Group -> ``share_items()`` of its first rank, for workers that declare it."""
    out = {}
    for name, g in groups.items():
        if "share_items" in g.worker_cls.group_methods():
            out[name] = int(g.on(0).share_items().wait_result().results[0])
    return out


def _cycles(first: dict[str, Any]) -> list[tuple[str, str]]:
    """Two-member cycles of the traced graph, ``(leader, follower)`` (module docstring)."""
    g = nx.DiGraph((s, d) for s, d, _ in first["edges"] if "driver" not in (s, d) and s != d)
    out = []
    for comp in nx.strongly_connected_components(g):
        if len(comp) == 2:
            a, b = sorted(comp)
            shares = first["share_items"]
            out.append((b, a) if b in shares and a not in shares else (a, b))
    return sorted(out)


def _round_trips(first: dict[str, Any], leader: str, follower: str, per_step: int) -> float:
    items = sum(i for s, d, i in first["edges"] if (s, d) == (leader, follower))
    return max(1.0, items / per_step)


def _fit_overhead(cycle: CycleCost, t_a: float, t_b: float, k: int, measured: float) -> float:
    """The per-sub-batch overhead that makes :meth:`CycleCost.split_time` in ``k``
    sub-batches equal ``measured`` (it grows with the overhead; 0 when even none is above)."""

    def at(o: float) -> float:
        c = CycleCost(
            cycle.members, cycle.round_trips, cycle.batch, 0.0, cycle.split_gap_s, o,
            cycle.split_scale,
        )  # fmt: skip
        return float(c.split_time(t_a, t_b, k))

    if at(0.0) >= measured:
        return 0.0
    lo, hi = 0.0, max(measured / cycle.round_trips, 1e-9)
    while at(hi) < measured:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(mid) < measured else (lo, mid)
    return hi


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
    save: Callable[[Profile], None] | None = None,
) -> Profile:
    """Profile ``workflow`` (see the module docstring); the planner's
    :class:`~m2flow.scheduler.plan.profile.Profile`.

    Args:
        device_counts: device counts to measure (default ``1, 2, 4, ...`` up to the cluster's).
        steps, warmup: measured steps per run and steps discarded before them.
        chunks: chunks per batch in the chunk-overhead run (1 skips it).
        save: called with the profile measured so far after every run.

    Raises:
        RuntimeError: the runner logs no steps or builds no Cluster.
    """
    overrides, config_files = list(overrides or []), list(config_files or [])
    scratch = Path(tempfile.mkdtemp(prefix="m2flow-profile-"))
    try:
        return _profile(
            workflow, overrides, config_files, device_counts, steps, warmup, chunks, log, save,
            _RunDirs(workflow, overrides, config_files, scratch, warmup + steps),
        )  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class _RunDirs:
    """Overrides giving each profiling run a run directory of its own; for a runner that
    resumes, the first run checkpoints at its last measured step and later runs resume copies
    of that checkpoint (no second warm start)."""

    def __init__(self, workflow, overrides, config_files, scratch: Path, per_run: int) -> None:
        _, cfg = prepare(workflow, overrides, config_files, validate=False)
        tr = getattr(cfg, "trainer", None)
        keys = ("run_dir", "save_every", "steps")
        self.resumes = "resume" in cfg and tr is not None and all(k in tr for k in keys)
        self.has_run_dir = tr is not None and "run_dir" in tr
        self.scratch, self.per_run, self.count = scratch, per_run, 0
        # room for the first run and one resumed run (one step more), the end beyond both
        self.steps = max(int(tr.steps), 2 * per_run + 2) if self.resumes else None

    def overrides(self) -> list[str]:
        self.count += 1
        run_dir = self.scratch / f"run{self.count}"
        if not self.resumes:
            return [f"trainer.run_dir={run_dir}"] if self.has_run_dir else []
        out = [f"trainer.run_dir={run_dir}", f"trainer.steps={self.steps}"]
        first = self.scratch / "run1"
        if self.count == 1:
            return out + [f"trainer.save_every={self.per_run}"]
        shutil.copytree(first / "checkpoints", run_dir / "checkpoints")
        return out + ["resume=true", f"trainer.save_every={10 * self.steps}"]


def _profile(workflow, overrides, config_files, device_counts, steps, warmup, chunks, log, save,
             dirs: _RunDirs) -> Profile:  # fmt: skip
    # loads: the machine's load around each run (measured_on.load_1m)
    measured: dict[str, Any] = {"runs": {}, "chunked": None, "k": 1, "cycles": [], "loads": []}

    def run(placement: Placement, what: str) -> dict:
        extra = dirs.overrides()
        resumed = "resume=true" in extra  # its first step also restores: never measured
        log(
            f"profiling {what}" + (" (from the first run's checkpoint)" if resumed else "") + " ..."
        )
        skip = max(warmup, 1) if resumed else warmup
        measured["loads"].append(load_1m())
        res = run_steps(workflow, overrides + extra, config_files, placement, steps, skip)
        measured["loads"].append(load_1m())
        shown = ", ".join(f"{g} {t:.3f} s" for g, t in res["busy"].items())
        log(f"  {what}: step {res['step_s']:.3f} s; busy {shown}")
        return res

    def saved(res: dict, n: int | None = None) -> dict:
        if n is not None:
            measured["runs"][n] = res
        if save is not None:
            save(_assemble(workflow, first, measured, steps, warmup))
        return res

    first = run(Placement(mode="temporal", default_devices=[0]), "1 device")
    saved(first, 1)
    n_max = first["num_devices"]
    counts = device_counts or [n for n in (2**i for i in range(12)) if n <= n_max]
    bad = [n for n in counts if not 1 <= n <= n_max]
    if bad:
        raise ValueError(f"device counts {bad} are not in 1..{n_max} (the cluster's devices)")
    runs = measured["runs"]
    for n in counts:
        if n not in runs:
            placement = Placement(mode="temporal", default_devices=list(range(n)))
            saved(run(placement, f"{n} devices"), n)

    per_step = first["steps"] or 1
    batch = _batch(first, warmup)
    if chunks > 1 and batch >= chunks:
        m = math.ceil(batch / chunks)
        measured["chunked"] = run(_chunked_placement(first, n_max, m), f"pipelined, chunks of {m}")
        measured["k"] = math.ceil(batch / m)
        saved(measured["chunked"])

    for leader, follower in _cycles(first):
        measured["cycles"].append(
            _profile_cycle(run, first, leader, follower, n_max, per_step + warmup, chunks, log)
        )
        saved(first)
    return _assemble(workflow, first, measured, steps, warmup)


def _batch(first: dict[str, Any], warmup: int) -> int:
    """Items the driver puts into the workflow per step (the first run's traced edges)."""
    driver_items = [i for s, d, i in first["edges"] if s == "driver" and d != "driver"]
    return max(1, round(sum(driver_items) / ((first["steps"] or 1) + warmup)))


def _assemble(workflow: str, first: dict, measured: dict, steps: int, warmup: int) -> Profile:
    """The profile from the runs measured so far (``measured``: ``runs`` by device count,
    ``chunked`` and its chunk count ``k``, ``cycles``)."""
    runs, chunked, k, cycles = (measured[x] for x in ("runs", "chunked", "k", "cycles"))
    per_step = first["steps"] or 1
    batch = _batch(first, warmup)
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
    unattributed -= sum(c.round_trips * c.shared_gap_s for c in cycles)  # now modelled
    return Profile(
        batch_size=batch,
        components=components,
        edges=[
            Edge(s, d, round(i / (per_step + warmup), 3)) for (s, d), i in sorted(edges.items())
        ],
        workflow=Path(workflow).stem,
        device_memory_bytes=first["memory_capacity"],
        step_overhead_s=round(max(unattributed, 0.0), 6),
        cycles=cycles,
        measured_on=machine(_median(measured["loads"])),
    )


def _profile_cycle(run, first, leader, follower, n_max, per_step, chunks, log) -> CycleCost:
    """Measure one cycle's constants (module docstring)."""
    r = _round_trips(first, leader, follower, per_step)
    batch = int(first["share_items"].get(leader, 1))
    t_a, t_b = first["busy"][leader], first["busy"][follower]
    shared = max(0.0, (first["wall"][leader] - t_a - t_b) / r)
    cyc = CycleCost((leader, follower), round(r, 3), batch, round(shared, 6), round(shared, 6))
    if n_max < 2:
        return cyc
    others = [2] if n_max >= 3 else [0]
    split = {leader: [0], follower: [1]}

    def split_run(size: int | None, what: str) -> dict:
        placement = Placement(
            mode="hybrid", groups=dict(split), default_devices=others,
            sub_batches={leader: size, follower: size},
        )  # fmt: skip
        return run(placement, f"cycle {leader} <-> {follower} split, {what}")

    one = split_run(None, "one sub-batch")
    wall = one["wall"][leader]
    gap = max(0.0, (wall - t_a - t_b) / r)
    scale = min(1.0, wall / (t_a + t_b)) if t_a + t_b > 0 else 1.0
    cyc = CycleCost(
        cyc.members, cyc.round_trips, batch, cyc.shared_gap_s, round(gap, 6), 0.0,
        max(round(scale, 6), 1e-6),
    )  # fmt: skip
    k = max(d for d in divisors(batch) if d <= max(chunks, 1))
    if k > 1:
        many = split_run(batch // k, f"{k} sub-batches")
        o = _fit_overhead(cyc, t_a, t_b, k, many["wall"][leader])
        cyc = CycleCost(
            cyc.members, cyc.round_trips, batch, cyc.shared_gap_s, cyc.split_gap_s, round(o, 6),
            cyc.split_scale,
        )  # fmt: skip
    log(
        f"  cycle {leader} <-> {follower}: {cyc.round_trips:g} round trips, batch {batch}, "
        f"gap {cyc.shared_gap_s * 1e3:.2f} ms time-shared / {cyc.split_gap_s * 1e3:.2f} ms "
        f"split (x{cyc.split_scale:.3f} busy), {cyc.sub_batch_overhead_s * 1e3:.3f} ms per extra "
        "sub-batch"
    )
    return cyc
