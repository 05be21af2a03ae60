"""From a workflow to the placement it runs under: profile, plan, report.

Glue between the runtime and the pure planner (:mod:`m2flow.scheduler`): ``plan=...`` of
``m2flow run`` becomes a :class:`~m2flow.core.placement.Placement` here, and after the run
:func:`report` compares the plan's predicted step time with the measured one (RLinf section
5.2, Figure 16(a), reports the same comparison).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..core.config import ConfigError
from ..core.placement import Placement, from_plan, temporal
from ..scheduler.plan.planner import MODES
from .session import Session, median


def profile_to_file(
    workflow: str,
    overrides: list[str],
    config_files: list[str],
    output: Path,
    device_counts: list[int] | None = None,
    steps: int = 10,
    warmup: int = 2,
    chunks: int = 4,
    log: Callable = print,
):
    """Profile ``workflow`` (see :mod:`m2flow.run.profiler`) and write the profile YAML, rewritten
    after every measured run (an interrupted profile keeps what it measured); returns the
    :class:`~m2flow.scheduler.plan.profile.Profile`.

    Raises:
        ConfigError: ``output`` cannot be written (a directory, or its parent is not an
            existing directory: a typo would otherwise make a tree), before anything runs.
    """
    output = Path(output)
    check_profile_output(output)
    from ..scheduler.plan.profile import save_profile
    from .profiler import profile

    kept = []

    def save(prof) -> None:
        save_profile(prof, output)
        kept.append(1)

    try:
        prof = profile(
            workflow, overrides, config_files, device_counts, steps, warmup, chunks, log, save
        )
    except KeyboardInterrupt:
        if kept:
            log(f"interrupted: {output} keeps the runs measured so far")
        raise
    save_profile(prof, output)
    log(f"profile written to {output}")
    return prof


def check_profile_output(output: Path) -> None:
    """Raises ConfigError when the profile cannot be written to ``output``: a directory, or a
    parent that is not an existing directory (a typo would otherwise make a tree)."""
    if output.is_dir():
        raise ConfigError(f"cannot write the profile to {output}: it is a directory")
    if not output.parent.is_dir():
        raise ConfigError(
            f"cannot write the profile to {output}: {output.parent} is not a directory "
            "(create it first)"
        )


def load_profile(path: str | Path):
    """The profile at ``path`` (:class:`~m2flow.scheduler.plan.profile.Profile`).

    Raises:
        ConfigError: a missing or invalid profile (the message says what is wrong).
    """
    from ..scheduler.plan.profile import load_profile as load

    try:
        return load(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"profile {str(path)!r}: {e}") from None


def plan_from_profile(
    prof, num_devices: int, capacity: float | None, mode: str = "auto", **options
):
    """Plan the profiled workflow on ``num_devices`` devices of ``capacity`` bytes (``None``:
    unbounded): the one planning path of ``m2flow run plan=...``, ``m2flow plan`` and the
    benchmarks.

    Args:
        options: the planner's (``runner_ups``, ``allow_idle``, ``slack``; see
            :func:`m2flow.scheduler.plan.planner.plan_workflow`).

    Returns:
        ``(plan, placement)``: the planner's tree (a ``PlanResult`` with the runner-ups when
        ``runner_ups=True``) and the placement the runtime applies; the placement's predicted
        step time includes the profile's ``step_overhead_s``.

    Raises:
        ConfigError: the planner found no feasible plan (its message names the problem).
    """
    from ..scheduler.plan.planner import PlanError, plan_workflow
    from ..scheduler.plan.profile import to_workflow

    wf = to_workflow(prof)
    try:
        out = plan_workflow(
            wf, num_devices, capacity=capacity if capacity else float("inf"), mode=mode,
            **options,
        )  # fmt: skip
    except PlanError as e:
        raise ConfigError(f"no {mode} plan on {num_devices} devices: {e}") from None
    plan = out.plan if options.get("runner_ups") else out
    placement = from_plan(plan, list(wf.edges), wf.batch_size, num_devices)
    overhead = float(getattr(prof, "step_overhead_s", 0.0) or 0.0)
    placement.predicted_step_s = float(plan.time) + overhead
    placement.plan = {
        "tree": plan.to_dict(),
        "switch_s": {n: c.switch_s for n, c in prof.components.items()},
        "chunk_overhead_s": {n: c.chunk_overhead_s for n, c in prof.components.items()},
        "step_overhead_s": overhead,
        "profiled_devices": {n: [p.devices for p in c.points] for n, c in prof.components.items()},
        "measured_on": prof.measured_on,
    }
    return out, placement


def plan_with_remote(
    prof,
    num_devices: int,
    capacity: float | None,
    mode: str = "auto",
    objective: str = "time",
    expected_instances: float | None = None,
    prices=None,
    **options,
):
    """Plan the reserved devices and the nodes off them: a ``reward_service:`` component
    leaves the reserved plan and adds the service's delay (:mod:`m2flow.scheduler.
    reward_remote`), and with a ``spot:`` pool the plan says where rollout runs
    (:func:`m2flow.scheduler.spot.plan.plan_rollout`: reserved only, spot, or seeded).

    Args:
        expected_instances: overrides the profile's ``spot.expected_instances`` (a trace's
            mean, ``m2flow plan --spot-trace``).
        prices: a :class:`~m2flow.scheduler.spot.plan.Prices` overriding the profile's.
        options: the planner's, as for :func:`plan_from_profile`.

    Returns:
        ``(plan, placement, spot_plan)``: the reserved planner's result, the placement the
        run applies, and the :class:`~m2flow.scheduler.spot.plan.SpotPlan` (``None`` without
        a pool). With rollout on the pool, the placement is the plan of the other components
        with rollout on every reserved device (it seeds between steps' training, time-shared
        under the device locks), ``options`` turn the spot pool on with the chosen
        ``t_seed_init`` and ``n_prem_max``, and ``predicted_step_s`` is the spot model's.

    Raises:
        ConfigError: no feasible plan, a remote component on a cycle, or bad spot input.
    """
    from dataclasses import replace

    from ..scheduler.spot.plan import Prices, SpotPlanError, plan_rollout

    for section, node in (("spot", prof.spot), ("reward_service", prof.reward_service)):
        if node is not None and any(node.component in c.members for c in prof.cycles):
            raise ConfigError(
                f"{section}.component {node.component!r} is on a cycle; only a feed-forward "
                f"stage can run off the reserved devices: drop the {section} section"
            )
    svc, added = prof.reward_service, 0.0
    if svc is not None:
        prof = _sub_profile(prof, set(prof.components) - {svc.component}, keep_spot=True)
        added = svc.added_s
    out, placement = plan_from_profile(prof, num_devices, capacity, mode, **options)
    if svc is not None:
        placement.predicted_step_s += added
        placement.predicted[svc.component] = added
        placement.remote = {"reward_service": asdict(svc)}
        placement.tree = (
            f"{svc.component}: reward service (off the reserved devices), tail "
            f"{svc.tail_s:.3f} s + extra delay {svc.extra_delay_s:.3f} s per step\n"
            + placement.tree
        )
    pool = prof.spot
    if pool is None:
        return out, placement, None
    comp = pool.component
    try:
        if expected_instances is not None:
            pool = replace(pool, expected_instances=expected_instances)
        prices = prices or prof.prices or Prices()
    except SpotPlanError as e:
        raise ConfigError(str(e)) from None
    plain = {k: v for k, v in options.items() if k != "runner_ups"}
    alone = _sub_profile(prof, {comp})
    rollout_s = plan_from_profile(alone, num_devices, capacity, "auto", **plain)[0].time
    rest = _sub_profile(prof, set(prof.components) - {comp})
    overhead = float(prof.step_overhead_s or 0.0)
    train_plan, train_placement = None, None
    train_s = overhead
    if rest.components:
        train_plan, train_placement = plan_from_profile(rest, num_devices, capacity, mode, **plain)
        train_s = train_placement.predicted_step_s
    try:
        sp = plan_rollout(
            prof.batch_size, placement.predicted_step_s, rollout_s, train_s, num_devices, pool,
            prices, objective, added,
        )  # fmt: skip
    except SpotPlanError as e:
        raise ConfigError(str(e)) from None
    placement.remote["spot"] = sp.to_dict()
    best = sp.best
    if best.mode == "reserved":
        return out, placement, sp
    spot_placement = train_placement or Placement(mode="temporal", tree="")
    if svc is not None:
        spot_placement.predicted[svc.component] = added
    spot_placement.groups[comp] = list(range(num_devices))
    # The plan's T_seed and N_prem are Algorithm 1's starting point; it adapts both each
    # step ("spot" mode starts at T_seed = 0, and line 9 may still open a window).
    # the rollout role's options (RolloutOptions.spot), merged field by field at launch
    spot_placement.options = {
        comp: {"options": {"spot": {"enabled": True, "t_seed_init": float(best.t_seed or 0.0),
                                    "n_prem_init": best.n_prem}}}
    }  # fmt: skip
    spot_placement.remote = placement.remote
    spot_placement.predicted_step_s = best.step_s
    spot_placement.tree = (
        f"{comp}: {best.mode} -- reserved devices [0, {num_devices}) for T_seed "
        f"{best.t_seed or 0.0:.3f} s, then up to {best.n_prem} spot instances\n"
        + spot_placement.tree
    )
    return out, spot_placement, sp


def _sub_profile(prof, names: set[str], keep_spot: bool = False):
    """``prof`` restricted to the components ``names``: the edges of a dropped component are
    bridged (:func:`~m2flow.scheduler.reward.remote.bridge`), the cycles among ``names`` kept;
    no remote nodes unless ``keep_spot``."""
    from dataclasses import replace

    from ..scheduler.plan.profile import Edge
    from ..scheduler.reward.remote import bridge

    items = {(e.src, e.dst): e.items_per_step for e in prof.edges}
    pairs = list(items)
    for gone in set(prof.components) - names:
        pairs = bridge(pairs, gone)
    return replace(
        prof,
        components={n: c for n, c in prof.components.items() if n in names},
        edges=[Edge(s, d, items.get((s, d), prof.batch_size)) for s, d in pairs],
        cycles=[c for c in prof.cycles if set(c.members) <= names],
        spot=prof.spot if keep_spot else None,
        reward_service=None,
    )


def _agent_tail(prof, num_devices, capacity, mode, tail, note, options):
    """The staleness model's tail ``u`` with an ``agent:`` block's tool waits counted idle
    (:func:`~m2flow.scheduler.plan.agent.idle_share`), at the rollout's device count in the
    synchronous plan; ``(tail, note)``, unchanged when the tool wait is 0 there."""
    from ..scheduler.plan.agent import idle_share

    plain = {k: v for k, v in options.items() if k != "runner_ups"}
    plan = plan_from_profile(prof, num_devices, capacity, mode, **plain)[0]
    used = {c: u for lf in plan.leaves() for c, u in zip(lf.components, lf.component_devices)}
    n = used.get(prof.agent.component, 1)
    model, rollout = prof.agent_rollout_s(n)
    if rollout <= model:  # no tool wait on the critical path: nothing to add
        return tail, note
    u = idle_share(model, rollout, tail)
    return u, (
        f"{note}; agent tool waits: {rollout - model:.3f} s of the rollout's {rollout:.3f} s on "
        f"{n} devices, counted idle (partial rollouts fill them): u = {u:.3f}"
    )


def placement_for(
    spec: str,
    workflow: str,
    overrides: list[str],
    config_files: list[str],
    profile_file: Path | None,
    log: Callable = print,
) -> Placement | Callable:
    """What ``plan=spec`` means for this run.

    ``temporal`` without a profile: every group on every device. A YAML path: that placement
    file. ``auto|spatial|hybrid`` (or ``temporal`` with a profile, for its prediction): plan
    from ``profile_file`` (or profile now and save the profile in the working directory for
    reuse) once the cluster's device count is known.

    Raises:
        ConfigError: an unknown spec or a bad profile/plan file.
    """
    if spec == "temporal" and profile_file is None:
        return temporal()  # nothing to choose: no profile needed
    if spec not in MODES:
        if spec.endswith((".yaml", ".yml")) or Path(spec).is_file():
            return Placement.load(spec)
        raise ConfigError(
            f"plan={spec!r}: give one of {', '.join(MODES)} or the path of a plan YAML file"
        )
    if profile_file is None:
        profile_file = Path(f"m2flow-profile-{Path(workflow).stem}.yaml")
        log(f"plan={spec}: no --profile given; profiling the workflow first")
        profile_to_file(workflow, overrides, config_files, profile_file, log=log)
        log(f"reuse it with --profile {profile_file}")
    prof = load_profile(profile_file)

    auto_k = any(o.replace(" ", "") == "trainer.max_staleness=auto" for o in overrides)

    def resolve(cluster) -> Placement:
        capacity = min(d.memory_bytes for d in cluster.devices)
        plan, placement, spot = plan_with_remote(prof, cluster.num_devices, capacity, spec)
        if auto_k:  # the bound K and the placement of the best asynchronous pipeline
            placement = _with_staleness(prof, cluster.num_devices, capacity, spec, spot,
                                        placement, log)  # fmt: skip
        log(f"plan={spec} on {cluster.num_devices} devices:\n{placement.tree}")
        if spot is not None:
            b = spot.best
            log(f"rollout: {b.mode}, predicted {b.step_s:.4f} s/step, ${b.cost_per_step:.4f}/step")
        return placement

    return resolve


def _with_staleness(prof, n: int, capacity, spec: str, spot, placement: Placement, log):
    """``trainer.max_staleness=auto``: the placement of the chosen (K, placement) row of
    :func:`staleness_from_profile` with its K (``placement.max_staleness``). A chosen pipeline
    without a planner tree (a ``split`` of rollout from the rest, the spot pool) keeps the
    planner's placement, said in the log."""
    from ..scheduler.plan.staleness import pipeline_for

    choice = staleness_from_profile(prof, n, capacity, spec, spot)
    row, pipe = choice.chosen, pipeline_for(choice)
    if pipe is not None and pipe.plan is not None:
        workflow_edges = [(e.src, e.dst) for e in prof.edges]
        chosen = from_plan(pipe.plan, workflow_edges, prof.batch_size, n)
        chosen.predicted_step_s, chosen.plan = row.step_s, placement.plan
        placement = chosen
    elif row.k > 0:
        log(f"trainer.max_staleness=auto: the {row.placement} pipeline has no plan tree; "
            f"K={row.k} on the planner's {placement.mode} placement")  # fmt: skip
    placement.max_staleness = row.k
    log(
        f"trainer.max_staleness=auto: K={row.k} ({row.placement}, predicted {row.step_s:.4f} "
        f"s/step, {row.items_per_s:.2f} items/s; m2flow plan --staleness lists the others)"
    )
    return placement


def report(session: Session, log: Callable = print, skip: int = 2) -> dict[str, Any] | None:
    """Predicted vs measured step time of the run's placement (median over the steps after
    the first ``skip``); written to ``<run_dir>/plan_report.json`` when the cluster has a run
    directory. Returns the report (``None`` without a planned placement or steps).

    With a trace (:mod:`m2flow.core.tracefile`) it also names what the profile did not price
    (``unpriced``: lock waits, hand-offs, offload + onload against ``switch_s``;
    :func:`m2flow.run.measured.unpriced`), and it warns when the plan's profile was measured
    elsewhere (``warnings``: :func:`m2flow.run.measured.provenance_warnings`). ``plan`` keeps what
    ``m2flow timeline`` draws the predicted step from."""
    placement = session.placement
    steps = session.step_times()[skip:]
    if not isinstance(placement, Placement) or not steps:
        return None
    measured = median(steps)
    busy = session.busy_per_step()[skip:]
    out: dict[str, Any] = {
        "mode": placement.mode,
        "measured_step_s": measured,
        "steps": len(steps),
        "measured_busy_s": {
            g: median([b.get(g, 0.0) for b in busy]) for g in sorted({k for b in busy for k in b})
        },
        "predicted_step_s": placement.predicted_step_s,
        "predicted_busy_s": placement.predicted,
    }
    line = f"plan {placement.mode}: measured {measured:.4f} s/step (median of {len(steps)})"
    if placement.predicted_step_s:
        err = (measured - placement.predicted_step_s) / measured
        out["error"] = err
        line += f", predicted {placement.predicted_step_s:.4f} s/step, error {err:+.1%}"
    log(line)
    for line in _trace_report(session, placement, out, skip):
        log(line)
    cluster = session.cluster
    if cluster is not None and cluster.run_dir is not None:
        cluster.run_dir.mkdir(parents=True, exist_ok=True)
        (cluster.run_dir / "plan_report.json").write_text(json.dumps(out, indent=2))
    return out


def _trace_report(session: Session, placement: Placement, out: dict, skip: int) -> list[str]:
    """Add ``plan``, ``unpriced`` and ``warnings`` to ``out``; the lines to print."""
    from .measured import machine, provenance_warnings, unpriced, unpriced_line

    lines = []
    out["plan"] = placement.plan
    marks = session.marks
    steps = [s for (_, _), (s, _) in zip(marks, marks[1:]) if s >= 1][skip:]
    if session.trace is not None:
        out["unpriced"] = unpriced(session.trace.totals, steps, placement.plan)
        if out["unpriced"] and placement.plan:  # priced by a profile: say what it missed
            lines.append(unpriced_line(out["unpriced"]))
    cluster = session.cluster
    n = None if cluster is None else cluster.num_devices
    out["machine"] = machine()
    out["warnings"] = provenance_warnings(placement.plan, n, out["machine"])
    lines += [f"warning: {w}" for w in out["warnings"]]
    return lines


def staleness_from_profile(
    prof,
    num_devices: int,
    capacity: float | None,
    mode: str = "auto",
    spot=None,
    *,
    max_staleness: int | None = None,
    staleness_slack: float | None = None,
    sync_s: float = 0.0,
    lengths=None,
    length_source: str = "",
    **options,
):
    """Issue 32 item 4: the asynchronous pipeline's rows per (K, placement) and the chosen one
    (:func:`m2flow.scheduler.plan.staleness.plan_staleness`) for a profile.

    Args:
        spot: the :class:`~m2flow.scheduler.spot.plan.SpotPlan` of :func:`plan_with_remote`
            (adds a ``spot`` row: the pool rolls out, the reserved devices train).
        max_staleness / staleness_slack: ``plan.max_staleness`` (default 4) and
            ``plan.staleness_slack`` (default 0.05).
        sync_s: seconds per weight update across devices (the profile measures none).
        lengths: response lengths (tokens) for the tail share; ``None``: no tail (``u = 0``).
        options: the planner's ``allow_idle`` and ``slack``.

    Raises:
        ConfigError: no feasible plan or a bad argument (the message says which).
    """
    from ..scheduler.plan.planner import PlanError
    from ..scheduler.plan.profile import to_workflow
    from ..scheduler.plan.staleness import (
        DEFAULT_MAX_STALENESS,
        DEFAULT_STALENESS_SLACK,
        SpotPipeline,
        plan_staleness,
        tail_share,
    )

    overhead = float(prof.step_overhead_s or 0.0)
    svc = prof.reward_service
    if svc is not None:
        prof = _sub_profile(prof, set(prof.components) - {svc.component}, keep_spot=True)
        overhead += svc.added_s
    tail = tail_share(lengths) if lengths is not None else 0.0
    note = (
        f"tail share u = {tail:.3f} of the rollout ({length_source})"
        if lengths is not None
        else "the profile has no response-length distribution: rollout time as measured, "
        "no tail to fill (u = 0; --lengths sets one)"
    )
    if prof.agent is not None and prof.agent.component in prof.components:
        tail, note = _agent_tail(prof, num_devices, capacity, mode, tail, note, options)
    pool_row = None
    if spot is not None and prof.spot is not None:
        choice = next((c for c in (spot.best, *spot.runner_ups) if c.mode != "reserved"), None)
        rest = _sub_profile(prof, set(prof.components) - {prof.spot.component})
        if choice is not None and choice.instances > 0 and rest.components:
            plain = {k: v for k, v in options.items() if k != "runner_ups"}
            train = plan_from_profile(rest, num_devices, capacity, mode, **plain)[1]
            alone = _sub_profile(prof, {prof.spot.component})
            r_all = plan_from_profile(alone, num_devices, capacity, "auto", **plain)[0].time
            rate = choice.instances * prof.spot.instance_items_per_s
            pool_row = SpotPipeline(choice.step_s, prof.batch_size / rate,
                                    train.predicted_step_s, prof.spot.weight_sync_s,
                                    r_all)  # fmt: skip
    try:
        return plan_staleness(
            to_workflow(prof), num_devices, capacity if capacity else float("inf"),
            max_staleness=DEFAULT_MAX_STALENESS if max_staleness is None else max_staleness,
            slack=DEFAULT_STALENESS_SLACK if staleness_slack is None else staleness_slack,
            tail=tail, sync_s=sync_s, overhead_s=overhead, spot=pool_row,
            allow_idle=options.get("allow_idle", True), plan_slack=options.get("slack", 0.01),
            mode=mode, note=note,
        )  # fmt: skip
    except (PlanError, ValueError) as e:
        raise ConfigError(f"staleness plan on {num_devices} devices: {e}") from None
