"""``m2flow plan``: print the plan the planner picks for a profile (or a workflow, profiled
first), with the runner-ups, and optionally a Gantt chart of one predicted step.

    m2flow plan grpo_profile.yaml --devices 64
    m2flow plan workflows/grpo.py --devices 8 cluster.devices_per_node=2
    m2flow plan benchmarks/profiles/ppo_4_1_1_1_1.yaml --devices 1024 --nodes 128 --json
    m2flow plan benchmarks/profiles/synthetic_chain3.yaml -n 16 --mode hybrid --gantt step.png

Output: the composition tree, a table of components (device range, device count, nodes,
granularity of outgoing edges, predicted seconds, predicted peak memory), the profile's fits,
the predicted step time and throughput, and the runner-up plans (the best plan of each other
mode and of each other top-level split) with their predicted times. ``--json`` prints one JSON
document instead (for tools). The tree and the tables are drawn by :mod:`.plan_tables`.

Idle devices: by default a component given n devices may use fewer when it is no faster on more
(a small model whose profile slows down past one device), so the plan may leave devices idle;
they are printed under the tree (``idle: [5, 8)``) and listed as ``idle_devices`` in the JSON.
A component also uses the fewest devices whose predicted time is within ``--slack`` (a
fraction, default 0.01) of its fastest: a nearly flat fit would otherwise take every spare
device for a fraction of a percent. ``--slack 0`` plans the exact minimum; ``--no-idle`` plans
as RLinf does, every device used.

``--nodes K``: ``--devices N`` counts all devices, ``N / K`` per node, numbered node-major (as
the cluster numbers them). Each rank of a group holds one device, so no rank ever spans nodes
and the planner's split needs no node constraint; the profile's times already include the
communication they measured (the planner models no separate inter-node cost). So ``K`` is
checked (``N % K == 0``) and reported: each component's node range.

``--save`` and ``--gantt`` write into an existing directory (a missing one is refused).

Spot rollout (RLBoost): when the profile has a ``spot:`` pool (:mod:`m2flow.scheduler.plan.profile`)
the plan also says where rollout runs -- reserved only, spot, or seeded (reserved for
``T_seed``, then spot) -- with ``T_seed``, the cap ``N_prem``, the predicted step time and the
cost per step, and the runner-ups (reserved-only, spot without seeding) with theirs
(:mod:`m2flow.scheduler.spot.plan` states the model). ``--spot-trace trace.csv`` sets the
expected instances to the trace's time-weighted mean, ``--price reserved=10.47,spot=2.66``
the $ per device-hour, ``--objective time|cost|tokens_per_dollar`` what the choice optimises.

    m2flow plan benchmarks/profiles/spot_rlboost_8b.yaml -n 8 --spot-trace a.csv --objective cost

Bounded staleness (issue 32 item 4): ``--staleness`` adds one row per ``(K, placement)`` for
K in ``0..--max-staleness`` (default 4): the asynchronous pipeline's predicted step time,
throughput and mean staleness (versions over trained tokens), the choice marked: the smallest
K within ``--staleness-slack`` (default 0.05) of the best throughput
(:mod:`m2flow.scheduler.plan.staleness` states the model). ``--sync-s`` is the weight update's
seconds across devices (default 0, as the synchronous plan assumes); ``--lengths
lognormal:MEDIAN,SIGMA,CAP`` (tokens) or ``--lengths FILE`` (one length a line) gives the
response-length tail partial rollouts can fill (without it: none). ``--gantt`` with
``--staleness`` draws two consecutive steady-state steps of the chosen pipeline instead of the
synchronous step.

    m2flow plan benchmarks/profiles/ppo_4_1_1_1_1.yaml -n 64 --staleness \\
        --lengths lognormal:2000,1,16384

Agents (issue 33 item 5): a profile with an ``agent:`` block (turns per episode, tool latency;
:mod:`m2flow.scheduler.plan.agent` states the model) prices its rollout with the tool wait, and
the output says how much of the rollout stage is tool time (JSON: ``agent``).

Bad input (a missing or invalid profile, a component missing from it, memory infeasible at
every split, fewer devices than a component's minimum, more than ``MAX_DEVICES`` (65,536)
devices, a bad mode or node count, a ``--save``/``--gantt`` path that cannot be written)
prints one line on stderr and exits 2. A profile at ``seconds: 0`` everywhere plans (a
component that costs nothing); a 0 s predicted step prints its throughput as unbounded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from ..core.cluster import GiB
from .plan_staleness import print_staleness, staleness_rows
from .plan_tables import components_table, fits_table, gib, plan_tree, runner_ups_table, spot_table

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _is_workflow(target: str) -> bool:
    return target.endswith(".py") or not (target.endswith((".yaml", ".yml", ".json")))


def _prices(text: str | None):
    """``reserved=10.47,spot=2.66`` -> :class:`~m2flow.scheduler.spot.plan.Prices` (None: the
    profile's)."""
    from ..core.config import ConfigError
    from ..scheduler.spot.plan import Prices, SpotPlanError

    if text is None:
        return None
    try:
        pairs = dict(kv.split("=", 1) for kv in text.split(","))
        return Prices(**{k.strip(): float(v) for k, v in pairs.items()})
    except (ValueError, TypeError, SpotPlanError) as e:
        raise ConfigError(
            f"--price {text!r}: write reserved=<$ per device-hour>,spot=<$ per device-hour> ({e})"
        ) from None


def _plan(target, devices, nodes, mode, memory_gb, overrides, allow_idle=True, slack=None,
          trace=None, prices=None, objective="time"):  # fmt: skip
    """``(profile, PlanResult, Placement, SpotPlan | None)``; raises ConfigError/ValueError on
    bad input."""
    from ..core.config import ConfigError
    from ..scheduler.plan.planner import MAX_DEVICES, MODES
    from ..scheduler.plan.profile import ProfileError, load_profile
    from ..scheduler.spot.plan import OBJECTIVES, expected_instances
    from ..scheduler.spot.trace import TraceError, load_trace
    from .planning import plan_with_remote, profile_to_file
    from .program import resolve_workflow

    if mode not in MODES:
        raise ConfigError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
    if devices < 1:
        raise ConfigError(f"--devices {devices}: give at least 1 device")
    if devices > MAX_DEVICES:
        raise ConfigError(
            f"--devices {devices}: at most {MAX_DEVICES} (MAX_DEVICES: the planner keeps a "
            "table over every device count 0..N, so its memory and time grow with N)"
        )
    if nodes < 1 or devices % nodes:
        raise ConfigError(
            f"--devices {devices} must split evenly over --nodes {nodes} (devices per node = "
            "devices / nodes)"
        )
    if slack is not None and not 0.0 <= slack < 1.0:
        raise ConfigError(
            f"--slack {slack}: give a fraction in [0, 1) of the fastest time, e.g. 0.01"
        )
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    if memory_gb is not None and not memory_gb > 0:
        raise ConfigError(f"--memory-gb {memory_gb}: give a positive capacity (GiB per device)")
    path = Path(target)
    expected = "a workflow (.py file or built-in name, profiled first) or a profile file " \
        "(.yaml, .yml, .json)"  # fmt: skip
    if path.is_dir():
        raise ConfigError(f"{target} is a directory: m2flow plan takes {expected}")
    if _is_workflow(target):
        try:
            resolve_workflow(target)
        except ConfigError:
            raise ConfigError(f"{target!r} is not a file: m2flow plan takes {expected}") from None
        path = Path(f"m2flow-profile-{Path(target).stem}.yaml")
        err.print(f"profiling {target} first (saved to {path}; plan it again from there)")
        profile_to_file(target, overrides, [], path, log=err.print)
    elif overrides:
        raise ConfigError(f"overrides {overrides} apply to a workflow, not to a profile file")
    try:
        prof = load_profile(path)
    except ProfileError as e:
        msg = str(e) if str(path) in str(e) else f"profile {str(path)!r}: {e}"
        raise ConfigError(msg) from None
    capacity = memory_gb * GiB if memory_gb else (prof.device_memory_bytes or math.inf)
    options = {"runner_ups": True, "allow_idle": allow_idle}
    if slack is not None:
        options["slack"] = slack
    n_bar = None
    if trace is not None or prices is not None or objective != "time":
        if prof.spot is None:
            prof = _with_default_spot(prof, path)
        if trace is not None:
            try:
                n_bar = expected_instances(load_trace(trace))
            except (TraceError, OSError) as e:
                raise ConfigError(f"--spot-trace {str(trace)!r}: {e}") from None
    result, placement, spot = plan_with_remote(
        prof, devices, capacity, mode, objective, n_bar, _prices(prices), **options
    )
    return prof, result, placement, spot


def _with_default_spot(prof, path: Path):
    """``prof`` with a ``spot:`` pool assumed from its own measurements, for a profile that
    has none (a profiler-written one): instances like one reserved device, each running the
    ``rollout`` component at its measured 1-device rate, weights synced for free. Says so on
    stderr.

    Raises:
        ConfigError: no ``rollout`` component to take the pool's rate from (the keys to add
            are named).
    """
    from dataclasses import replace

    from ..core.config import ConfigError
    from ..scheduler.spot.plan import SpotPool

    comp = prof.components.get("rollout")
    one = comp.time_fit()(1) if comp is not None else 0.0
    if not one > 0:
        raise ConfigError(
            f"--spot-trace/--price/--objective need a spot pool: add to profile {str(path)!r} "
            "spot: {component: <the rollout group>, instance_items_per_s: <one instance's "
            "items/s>} (optional: devices_per_instance, weight_sync_s; "
            "m2flow.scheduler.plan.profile)"
        )
    rate = prof.batch_size / one
    err.print(
        f"spot: profile {escape(str(path))} has no spot: section; assumed instances like one "
        f"reserved device: rollout at its measured 1-device rate, {rate:.3g} {prof.item}s/s "
        "each, weight sync 0 s (write a spot: section to set them; m2flow.scheduler.plan.profile)",
        highlight=False,
    )
    return replace(prof, spot=SpotPool(component="rollout", instance_items_per_s=rate))


def _nodes(devs: range, per_node: int) -> str:
    a, b = devs.start // per_node, (devs.stop - 1) // per_node
    return str(a) if a == b else f"{a}-{b}"


def components(result, per_node: int) -> dict[str, dict]:
    """Per component of the best plan: devices, nodes, outgoing granularity, seconds, bytes."""
    plan = result.plan
    mem, times, gran = plan.memory(), plan.breakdown(), result.edge_granularity()
    used = {c: u for lf in plan.leaves() for c, u in zip(lf.components, lf.component_devices)}
    out_doc = {}
    for name, rng in plan.placement().items():
        out_doc[name] = {
            "devices": [rng.start, rng.stop],
            "num_devices": len(rng),
            "devices_used": used.get(name, len(rng)),
            "nodes": _nodes(rng, per_node),
            "granularity_out": {d: m for (s, d), m in gran.items() if s == name},
            "time_s": times[name],
            "memory_bytes": mem.get(name),
        }
    return out_doc


def _fits(prof) -> dict[str, dict]:
    """Per component: the time and memory fits, the device counts measured and the held-out
    error (leave-one-out, from 3 device counts on; ``None`` below: an exact fit of two
    points checks nothing)."""
    from ..scheduler.plan.profile import fits

    doc = {}
    for name, (tf, mf) in fits(prof).items():
        counts = sorted({int(n) for n, _ in tf.points})
        doc[name] = {
            "time": {"model": tf.model, "formula": tf.formula(), "error": tf.error},
            "memory": {"model": mf.model, "formula": mf.formula(), "error": mf.error},
            "note": tf.note,
            "error_kind": tf.error_kind,
            "device_counts": counts,
            "held_out_error": tf.error if tf.error_kind == "loo" else None,
        }
    return doc


def extrapolation_warning(fit_doc: dict, devices: int) -> str:
    """A warning when ``devices`` lies beyond the device counts the profile measured (the
    fits extrapolate there, unchecked); ``""`` within them."""
    top = min((max(f["device_counts"]) for f in fit_doc.values()), default=devices)
    if devices <= top:
        return ""
    return (
        f"warning: planning {devices} devices from a profile measured on at most {top}: the "
        "fits extrapolate beyond that, unchecked; profile more device counts (m2flow profile "
        f"... --devices 1 --devices 2 --devices 4 ... on a cluster of up to {devices})"
    )


def _ranges(rs) -> str:
    return ", ".join(f"[{r.start}, {r.stop})" for r in rs)


def _idle_line(result) -> str:
    idle = result.idle()
    if not idle:
        return ""
    count = sum(len(r) for r in idle)
    why = "predicted faster" if result.slack == 0 else f"more than {result.slack:.0%} faster"
    return (
        f"idle: {_ranges(idle)} ({count} of {result.num_devices} devices): no component is "
        f"{why} on more of them (--no-idle uses every device)"
    )


def _write(path: Path, write) -> None:
    """``write(path)``; a path that cannot be written (a missing parent directory: a typo
    would otherwise create a tree; a parent that is a file; no permission) prints one line and
    exits 2."""
    try:
        if not path.parent.is_dir():
            raise OSError(f"{path.parent} is not a directory: create it first")
        write(path)
    except (OSError, ValueError) as e:
        err.print(f"[bold red]error:[/] cannot write {escape(str(path))}: {escape(str(e))}",
                  highlight=False)  # fmt: skip
        raise typer.Exit(2) from None


def _throughput(prof, step: float) -> str:
    """Items per second, or why there is none: a profile measured at ``seconds: 0`` (below the
    profiler's 1 us resolution) can predict a 0 s step, which bounds nothing."""
    if step > 0:
        return f"throughput {prof.batch_size / step:.3f} {prof.item}s/s"
    return "throughput unbounded: the profile predicts 0 s for this plan's components"


def plan(
    target: str = typer.Argument(..., help="profile YAML, or a workflow (profiled first)"),
    overrides: Optional[list[str]] = typer.Argument(None, help="workflow overrides key=value"),
    devices: int = typer.Option(..., "--devices", "-n", help="devices to plan for (all nodes)"),
    nodes: int = typer.Option(1, "--nodes", help="nodes the devices are spread over evenly"),
    mode: str = typer.Option("auto", "--mode", help="auto|temporal|spatial|hybrid"),
    memory_gb: Optional[float] = typer.Option(
        None, "--memory-gb", help="memory per device, GiB (default: the profile's)"
    ),
    gantt_png: Optional[Path] = typer.Option(None, "--gantt", help="draw one predicted step"),
    save: Optional[Path] = typer.Option(
        None, "--save", help="write a plan file for plan=FILE (into an existing directory)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
    idle: bool = typer.Option(
        True, "--idle/--no-idle", help="let a component use fewer devices when that is faster"
    ),
    slack: Optional[float] = typer.Option(
        None,
        "--slack",
        help="use the fewest devices within this fraction of a component's fastest time "
        "(default 0.01; 0: exact)",
    ),
    spot_trace: Optional[Path] = typer.Option(
        None, "--spot-trace", help="spot availability CSV (t_s,instances): expected instances"
    ),
    price: Optional[str] = typer.Option(
        None, "--price", help="$ per device-hour: reserved=10.47,spot=2.66 (default: profile's)"
    ),
    objective: str = typer.Option(
        "time", "--objective", help="spot choice optimises: time|cost|tokens_per_dollar"
    ),
    staleness: bool = typer.Option(
        False, "--staleness", help="rows per (K, placement) of the asynchronous pipeline"
    ),
    max_staleness: int = typer.Option(4, "--max-staleness", help="largest K (versions)"),
    staleness_slack: float = typer.Option(
        0.05, "--staleness-slack", help="smallest K within this fraction of the best items/s"
    ),
    sync_s: float = typer.Option(
        0.0, "--sync-s", help="seconds per weight update across devices (with --staleness)"
    ),
    lengths: Optional[str] = typer.Option(
        None, "--lengths", help="response lengths: lognormal:MEDIAN,SIGMA,CAP or a file"
    ),
) -> None:
    """Print the plan for N devices: tree, components, prediction, runner-ups."""
    from ..core.config import ConfigError

    global out, err
    # Fresh consoles per call: one built at import fixes its width from COLUMNS as it was then.
    out, err = Console(soft_wrap=True), Console(stderr=True, soft_wrap=True)
    try:
        prof, result, placement, spot = _plan(
            target, devices, nodes, mode, memory_gb, overrides or [], idle, slack, spot_trace,
            price, objective,
        )  # fmt: skip
        stale = None
        if staleness:
            stale = staleness_rows(prof, devices, result.capacity, mode, spot, idle, slack,
                               max_staleness, staleness_slack, sync_s, lengths)  # fmt: skip
    except (ConfigError, ValueError) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    overhead = float(prof.step_overhead_s or 0.0)
    step = placement.predicted_step_s
    per_node = devices // nodes
    comps = components(result, per_node)
    fit_doc = _fits(prof)
    warning = extrapolation_warning(fit_doc, devices)
    if warning:
        err.print(f"[yellow]{escape(warning)}[/]", highlight=False)
    if save is not None:
        _write(save, placement.save)
    if gantt_png is not None:
        from .plan_gantt import gantt, spot_parts

        parts = None
        if spot is not None and spot.best.mode != "reserved":
            opts = {"allow_idle": idle, **({} if slack is None else {"slack": slack})}
            parts = spot_parts(prof, devices, result.capacity, mode, **opts)
        if stale is not None:
            from .plan_gantt import async_gantt

            _write(gantt_png, lambda path: async_gantt(stale, prof, path))
        else:
            _write(gantt_png, lambda path: gantt(result, prof, path, spot, parts))
    if as_json:
        doc = result.to_dict()
        doc.update(
            workflow=prof.workflow,
            item=prof.item,
            nodes=nodes,
            devices_per_node=per_node,
            step_overhead_s=overhead,
            predicted_step_s=step,
            throughput_items_per_s=prof.batch_size / step if step > 0 else None,
            components=comps,
            fits=fit_doc,
            warnings=[warning] if warning else [],
            spot=None if spot is None else spot.to_dict(),
        )
        if prof.agent is not None:
            doc["agent"] = agent_doc(prof, comps)
        if stale is not None:
            doc["staleness"] = stale.to_dict()
        print(json.dumps(doc, indent=2))
        return
    out.print(
        f"[bold]{prof.workflow}[/]: {devices} devices"
        + (f" on {nodes} nodes ({per_node} per node)" if nodes > 1 else "")
        + f", mode {mode}, batch {prof.batch_size} {prof.item}s per step, "
        + f"memory {gib(result.capacity) if math.isfinite(result.capacity) else 'unlimited'}"
        + (" GiB per device" if math.isfinite(result.capacity) else ""),
        highlight=False,
    )
    out.print(plan_tree(result.plan, f"plan ({result.plan.kind()}): {result.plan.shape()}"))
    if _idle_line(result):
        out.print(_idle_line(result), highlight=False)
    out.print(components_table(comps, nodes))
    out.print(fits_table(fit_doc))
    extra = f" + unattributed {overhead:.4f} s" if overhead else ""
    reserved_step = result.time + overhead
    svc = placement.remote.get("reward_service")
    if svc:
        reserved_step += svc["tail_s"] + svc["extra_delay_s"]
        extra += f" + reward service {svc['tail_s'] + svc['extra_delay_s']:.4f} s"
    out.print(
        f"predicted step: [bold]{reserved_step:.4f} s[/] (plan {result.time:.4f} s{extra}); "
        + _throughput(prof, reserved_step),
        highlight=False,
    )
    if prof.agent is not None:
        out.print(agent_line(agent_doc(prof, comps)), highlight=False)
    if result.runner_ups:
        out.print(runner_ups_table(result, overhead))
    if svc:
        out.print(
            f"{svc['component']}: on the reward service, off the reserved devices (tail "
            f"{svc['tail_s']:.3f} s + extra delay {svc['extra_delay_s']:.3f} s per step, included "
            "in the prediction)",
            highlight=False,
        )
    if spot is not None:
        out.print(spot_table(spot, prof))
        if spot.best.mode != "reserved":
            out.print(
                f"predicted step with spot rollout: [bold]{step:.4f} s[/] "
                f"(the tree above is the reserved-only plan; {placement.tree.splitlines()[0]})",
                highlight=False,
            )
    if stale is not None:
        print_staleness(out, stale, prof)
    if gantt_png is not None:
        extra = " (two steady-state steps of the chosen K)" if stale is not None else ""
        out.print(f"Gantt chart: {gantt_png}{extra}", highlight=False)
    if save is not None:
        out.print(f"plan file: {save} (run it with plan={save})", highlight=False)


def agent_doc(prof, comps: dict) -> dict:
    """The ``agent:`` block's rollout on the plan's devices for it: model seconds (the
    profile's fit), rollout seconds with the tool wait (:class:`~m2flow.scheduler.plan.agent.
    AgentRolloutTime`), the tool wait and its share of the rollout stage."""
    agent = prof.agent
    c = comps.get(agent.component)
    n = c["devices_used"] if c else 1
    model, rollout = prof.agent_rollout_s(n)
    lat = agent.tool_latency
    law = "answering at once"
    if lat.samples:
        law = f"{len(lat.samples)} samples"
    elif lat.median_s is not None:
        law = f"lognormal median {lat.median_s:g} s, p90 {lat.p90_s:g} s"
    return {
        "component": agent.component,
        "devices": n,
        "episodes": prof.batch_size * agent.episodes_per_item,
        "mean_turns": agent.mean_turns(),
        "tool_latency": law,
        "model_s": model,
        "rollout_s": rollout,
        "tool_wait_s": rollout - model,
        "tool_share": (rollout - model) / rollout if rollout > 0 else 0.0,
    }


def agent_line(d: dict) -> str:
    """``m2flow plan``'s line for an agent profile."""
    return (
        f"agent rollout ({d['component']} on {d['devices']} devices, {d['episodes']} episodes, "
        f"{d['mean_turns']:.2f} turns each on average, tool calls {d['tool_latency']}): "
        f"{d['rollout_s']:.4f} s = model {d['model_s']:.4f} s + tool wait "
        f"{d['tool_wait_s']:.4f} s; tool share of the rollout stage {100 * d['tool_share']:.1f}%"
    )


def register(app: typer.Typer) -> None:
    """Add ``plan`` to the ``m2flow`` Typer app."""
    app.command("plan")(plan)
