"""From a workflow to the placement it runs under: profile, plan, report.

Glue between the runtime and the pure planner (:mod:`m2flow.scheduler`): ``plan=...`` of
``m2flow run`` becomes a :class:`~m2flow.placement.Placement` here, and after the run
:func:`report` compares the plan's predicted step time with the measured one (RLinf section
7 reports the same comparison).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ConfigError
from .placement import Placement, from_plan, temporal
from .scheduler.planner import MODES
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
    """Profile ``workflow`` (see :mod:`m2flow.profiler`) and write the profile YAML; returns
    the :class:`~m2flow.scheduler.profile.Profile`."""
    from .profiler import profile
    from .scheduler.profile import save_profile

    prof = profile(workflow, overrides, config_files, device_counts, steps, warmup, chunks, log)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_profile(prof, output)
    log(f"profile written to {output}")
    return prof


def load_profile(path: str | Path):
    """The profile at ``path`` (:class:`~m2flow.scheduler.profile.Profile`).

    Raises:
        ConfigError: a missing or invalid profile (the message says what is wrong).
    """
    from .scheduler.profile import load_profile as load

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
            :func:`m2flow.scheduler.planner.plan_workflow`).

    Returns:
        ``(plan, placement)``: the planner's tree (a ``PlanResult`` with the runner-ups when
        ``runner_ups=True``) and the placement the runtime applies; the placement's predicted
        step time includes the profile's ``step_overhead_s``.

    Raises:
        ConfigError: the planner found no feasible plan (its message names the problem).
    """
    from .scheduler.planner import PlanError, plan_workflow
    from .scheduler.profile import to_workflow

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
    return out, placement


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

    def resolve(cluster) -> Placement:
        capacity = min(d.memory_bytes for d in cluster.devices)
        plan, placement = plan_from_profile(prof, cluster.num_devices, capacity, spec)
        log(f"plan={spec} on {cluster.num_devices} devices:\n{placement.tree}")
        return placement

    return resolve


def report(session: Session, log: Callable = print, skip: int = 2) -> dict[str, Any] | None:
    """Predicted vs measured step time of the run's placement (median over the steps after
    the first ``skip``); written to ``<run_dir>/plan_report.json`` when the cluster has a run
    directory. Returns the report (``None`` without a planned placement or steps)."""
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
    cluster = session.cluster
    if cluster is not None and cluster.run_dir is not None:
        cluster.run_dir.mkdir(parents=True, exist_ok=True)
        (cluster.run_dir / "plan_report.json").write_text(json.dumps(out, indent=2))
    return out
