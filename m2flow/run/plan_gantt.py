"""The Gantt chart of ``m2flow plan --gantt``: one predicted step of the chosen plan.

Reserved devices get one row per device range (:func:`m2flow.scheduler.plan.timeline.step_timeline`:
compute, switches, per-chunk overheads, one bar per pipelined chunk). When the plan puts
rollout on spot instances (:mod:`m2flow.scheduler.spot.plan`), the chart draws that plan, not
the reserved-only one: the reserved devices seed rollout for ``T_seed`` seconds (seeded
mode), then run the other components' own plan; the spot instances sync weights, then roll out
what the seeding left, at ``instances x instance_items_per_s`` items per second.
"""

from __future__ import annotations

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


def gantt(result, prof, path: Path, spot=None, parts=None) -> None:
    """Draw one predicted step (:func:`chart_rows`) into ``path`` (matplotlib, Agg; PNG by
    the suffix)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows, bars, end, title = chart_rows(result, prof, spot, parts)
    names = list(prof.components)
    color = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}
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
    ax.set_xlabel("seconds within one predicted step")
    ax.set_xlim(0, end * 1.01 or 1.0)  # a 0 s step (profile at seconds: 0) still draws
    ax.set_title(f"{title}: {end:.4g} s per step on {result.num_devices} reserved devices")
    used = {c for _, _, c, _, _ in bars}
    kinds = {k for _, k, _, _, _ in bars}
    handles = [Patch(facecolor=color[c], label=c) for c in names if c in used]
    handles += [Patch(label="switch (offload+onload)", **STYLE["switch"])]
    handles += [Patch(label="per-chunk overhead", **STYLE["overhead"])]
    if "sync" in kinds:
        handles += [Patch(label="weight sync to spot", **STYLE["sync"])]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
