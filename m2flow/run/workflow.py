"""Running a workflow program under a plan: the one entry point behind ``m2flow run``, the
benchmarks and the tests.

A workflow program (``workflows/grpo.py``) provides ``Config``, ``main(cfg)`` and optionally
``validate(cfg)`` (:mod:`m2flow.run.program` loads it). A plan name (``auto``, ``spatial``, ...)
becomes a placement through :mod:`m2flow.run.planning`, which may profile the program first.

    session = run_workflow("workflows/grpo.py", ["trainer.steps=5"], plan="temporal")
    session.result        # what main(cfg) returned
    session.step_times()  # measured seconds per logged step
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..core.placement import Placement
from .program import (  # noqa: F401 (public paths: m2flow.run.workflow.prepare, ...)
    hold_run_dir_of,
    load_workflow,
    prepare,
    resolve_workflow,
    run_prepared,
    split_plan,
)
from .session import Session


def run_workflow(
    workflow: str | Path,
    overrides: Sequence[str] = (),
    *,
    plan: str | Placement | Callable | None = "temporal",
    config_files: Sequence[str] = (),
    profile: str | Path | None = None,
    max_steps: int | None = None,
    keep_cluster: bool = False,
    log: Callable = print,
) -> Session:
    """Run a workflow program under a plan and return its :class:`~m2flow.run.session.Session`.

    Args:
        workflow: a path or a built-in name (``grpo``).
        overrides: ``key=value`` config overrides (a ``plan=`` among them is taken as
            ``plan``).
        plan: ``temporal`` | ``auto`` | ``spatial`` | ``hybrid`` | a plan YAML path | a
            :class:`~m2flow.core.placement.Placement` (or a callable ``cluster -> Placement``) |
            ``None`` (the runner's own defaults).
        config_files: YAML files merged before the overrides.
        profile: the profile ``auto|spatial|hybrid`` plan from (default: profile now).
        max_steps: stop after this many logged steps (profiling); ``None``: run to the end.
        keep_cluster: leave the run's cluster up on return (``session.cluster``; the caller
            shuts it down), e.g. to read worker statistics after ``max_steps``.
        log: where progress lines go.

    Returns:
        the session: ``result`` (what ``main`` returned; ``None`` if stopped at
        ``max_steps``), step and call records, the placement and the cluster.

    Raises:
        ConfigError: bad workflow, overrides, plan or profile (nothing has started); or
            ``RunDirBusy``: another live run holds ``trainer.run_dir``.
        WorkerError: a worker failed or died during the run.
    """
    if any(o.startswith("plan=") for o in overrides):
        plan, overrides = split_plan(overrides)
    module, cfg = prepare(workflow, overrides, config_files)
    from .planning import placement_for  # after: the planner's imports cost 0.2-2 s

    with hold_run_dir_of(cfg):  # before profiling for a plan: a second run is refused at once
        if isinstance(plan, str):
            plan = placement_for(
                plan, str(workflow), list(overrides), list(config_files), profile, log
            )
        if isinstance(plan, Placement):
            _check_devices(plan, cfg)
        return run_prepared(module, cfg, plan, max_steps=max_steps, keep_cluster=keep_cluster)


def _check_devices(plan: Placement, cfg) -> None:
    """A plan naming a device the embedded cluster will not have is refused before Ray
    starts. The count is the GPUs of this machine, else ``cluster.devices_per_node`` virtual
    devices; a joined cluster (``cluster.address``, or a Ray session this process already
    runs, which the run's Cluster joins) is checked once it is up.

    Raises:
        PlacementError: a device id beyond the cluster's.
    """
    cluster = getattr(cfg, "cluster", None)
    if cluster is None or getattr(cluster, "address", None) is not None:
        return
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return
    named = [d for ids in plan.groups.values() for d in ids] + list(plan.default_devices or [])
    n = int(getattr(cluster, "devices_per_node", 1))
    if named and max(named) >= n:  # more than the virtual devices: GPUs may have them
        import torch

        n = torch.cuda.device_count() or n
    plan.check_count(n)
