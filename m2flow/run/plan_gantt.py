"""The Gantt chart of ``m2flow plan --gantt``: one predicted step of the chosen plan.

Reserved devices get one row per device range (:func:`m2flow.scheduler.plan.timeline.step_timeline`:
compute, switches, per-chunk overheads, one bar per pipelined chunk). When the plan puts
rollout on spot instances (:mod:`m2flow.scheduler.spot.plan`), the chart draws that plan, not
the reserved-only one: the reserved devices seed rollout for ``T_seed`` seconds (seeded
mode), then run the other components' own plan; the spot instances sync weights, then roll out
what the seeding left, at ``instances x instance_items_per_s`` items per second.
"""

from __future__ import annotations

import math
from pathlib import Path

PALETTE = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
]  # fmt: skip
STYLE = {
    "switch": {"facecolor": "#dddddd", "hatch": "///", "edgecolor": "#888888"},
    "overhead": {"facecolor": "#444444"},
    "sync": {"facecolor": "#ffffff", "hatch": "...", "edgecolor": "#555555"},
}


def spot_parts(prof, num_devices: int, capacity: float, mode: str, **options):
    """What the spot model composes, as :func:`m2flow.run.planning.plan_with_remote` computes
    it: ``(train, rollout_s)``, the reserved plan of the components other than the pool's
    (and a reward service's; ``None`` when none is left) and rollout's time alone on all
    reserved devices.

    Raises:
        ConfigError: no feasible plan.
    """
    from .planning import _sub_profile, plan_from_profile

    comp = prof.spot.component
    plain = {k: v for k, v in options.items() if k != "runner_ups"}
    alone = _sub_profile(prof, {comp})
    rollout_s = plan_from_profile(alone, num_devices, capacity, "auto", **plain)[0].time
    gone = {comp} | ({prof.reward_service.component} if prof.reward_service else set())
    rest = _sub_profile(prof, set(prof.components) - gone)
    train = None
    if rest.components:
        train = plan_from_profile(rest, num_devices, capacity, mode, **plain)[0]
    return train, rollout_s


def chart_rows(result, prof, spot=None, parts=None):
    """What :func:`gantt` draws: ``(rows, bars, end, title)``; ``rows`` top to bottom,
    ``bars`` as ``(row, kind, component, start, end)`` seconds within the step (kinds of
    :mod:`m2flow.scheduler.plan.timeline`, plus ``sync``: the weight push to spot instances).

    Args:
        result: the reserved planner's result (drawn when rollout stays reserved).
        spot: the :class:`~m2flow.scheduler.spot.plan.SpotPlan`, if the profile has a pool.
        parts: with a spot choice other than reserved, :func:`spot_parts`'s result.
    """
    from ..scheduler.plan.timeline import step_timeline

    switch = {n: c.switch_s for n, c in prof.components.items()}
    overhead = {n: c.chunk_overhead_s for n, c in prof.components.items()}
    rows: list[str] = []
    bars: list[tuple[int, str, str, float, float]] = []
    n = result.num_devices
    offset, end, title = 0.0, 0.0, result.plan.shape()
    plan = result.plan
    if spot is not None and spot.best.mode != "reserved":
        best, pool = spot.best, prof.spot
        comp, (plan, rollout_all) = pool.component, parts
        t_seed = float(best.t_seed or 0.0)
        if t_seed > 0:
            rows.append(f"{comp} seeding  [0, {n})")
            bars.append((0, "compute", comp, 0.0, t_seed))
        left = prof.batch_size * (1 - t_seed / rollout_all) if rollout_all > 0 else 0.0
        rate = best.instances * pool.instance_items_per_s
        rows.append(f"{comp} on {best.n_prem} spot instance(s)")
        spot_end = pool.weight_sync_s + (left / rate if rate > 0 else 0.0)
        bars.append((len(rows) - 1, "sync", comp, 0.0, pool.weight_sync_s))
        bars.append((len(rows) - 1, "compute", comp, pool.weight_sync_s, spot_end))
        offset, end = t_seed, max(spot_end, best.step_s)
        title = f"{comp} on spot ({best.mode})" + (f" + {plan.shape()}" if plan else "")
    if plan is not None:
        tl = step_timeline(plan, switch, overhead)
        base = len(rows)
        rows += [f"{name}  [{r.start}, {r.stop})" for name, r in tl.rows]
        bars += [(base + b.row, b.kind, b.component, offset + b.start, offset + b.end)
                 for b in tl.bars]  # fmt: skip
        end = max(end, offset + tl.end)
    return rows, bars, end, title


def async_chart_rows(sp, steps: int = 2):
    """Two consecutive steady-state steps of the chosen asynchronous pipeline
    (:class:`~m2flow.scheduler.plan.staleness.StalenessPlan`), as :func:`chart_rows` returns
    them: one row per stage; stage i works on batch j from ``c_i + j P`` for its compute
    (``T_i - u_K R_i``), then the weight sync (``S``), ``c_i`` the previous stages' compute
    (a stage takes a batch once the one before finished it, unchunked), ``P`` the period
    without the unattributed overhead. Bars carry the batch index as their component
    (``b3``)."""
    from ..scheduler.plan.staleness import period, stage_busy

    c = sp.chosen
    pipe = sp.pipelines[(c.k, c.placement)]
    busy = stage_busy(pipe, c.k, sp.tail)
    p = period(pipe, c.k, sp.tail) - pipe.overhead_s
    end = steps * p
    rows = [st.name for st in pipe.stages]
    bars: list[tuple[int, str, str, float, float]] = []
    start = 0.0
    for i, b in enumerate(busy):
        first = math.floor(-start / p) - 1 if p > 0 else 0
        for j in range(first, first + steps + 3):
            t0 = start + j * p
            for kind, a, z in (("compute", t0, t0 + b), ("sync", t0 + b, t0 + b + pipe.sync_s)):
                a, z = max(a, 0.0), min(z, end)
                if z > a:
                    bars.append((i, kind, f"b{j}", a, z))
        start += b
    title = f"K={c.k} on {c.placement}, steady state"
    return rows, bars, end, title


def async_gantt(sp, prof, path: Path) -> None:
    """Draw :func:`async_chart_rows` into ``path`` (PNG by the suffix)."""
    rows, bars, end, title = async_chart_rows(sp)
    batches = {b for _, kind, b, _, _ in bars if kind == "compute"}
    batches = sorted(batches, key=lambda x: int(x[1:]))
    color = {b: PALETTE[i % len(PALETTE)] for i, b in enumerate(batches)}
    _draw(
        rows,
        bars,
        end,
        title,
        color,
        path,
        "seconds, two consecutive steps",
        f"{end / 2:.4g} s per step (bN: batch N)",
        sync_label="weight sync",
        plan_kinds=False,
    )


def gantt(result, prof, path: Path, spot=None, parts=None) -> None:
    """Draw one predicted step (:func:`chart_rows`) into ``path`` (matplotlib, Agg; PNG by
    the suffix)."""
    rows, bars, end, title = chart_rows(result, prof, spot, parts)
    names = list(prof.components)
    color = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}
    _draw(
        rows,
        bars,
        end,
        title,
        color,
        path,
        "seconds within one predicted step",
        f"{end:.4g} s per step on {result.num_devices} reserved devices",
    )


def _draw(rows, bars, end, title, color, path, xlabel, subtitle,
          sync_label="weight sync to spot", plan_kinds=True):  # fmt: skip
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    names = list(color)
    fig = Figure(figsize=(11, 1.4 + 0.55 * len(rows)))
    ax = fig.add_subplot()
    groups: dict[tuple, list] = {}
    for row, kind, comp, start, stop in bars:
        groups.setdefault((row, kind, comp), []).append((start, stop - start))
    for (row, kind, comp), spans in groups.items():
        y = len(rows) - 1 - row
        kw = STYLE.get(kind, {"facecolor": color.get(comp, PALETTE[0]), "edgecolor": "white"})
        ax.broken_barh(spans, (y - 0.4, 0.8), linewidth=0.3, **kw)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(list(reversed(rows)))
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, end * 1.01 or 1.0)  # a 0 s step (profile at seconds: 0) still draws
    ax.set_title(f"{title}: {subtitle}")
    used = {c for _, _, c, _, _ in bars}
    kinds = {k for _, k, _, _, _ in bars}
    handles = [Patch(facecolor=color[c], label=c) for c in names if c in used]
    if plan_kinds:
        handles += [Patch(label="switch (offload+onload)", **STYLE["switch"])]
        handles += [Patch(label="per-chunk overhead", **STYLE["overhead"])]
    if "sync" in kinds:
        handles += [Patch(label=sync_label, **STYLE["sync"])]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
