"""Loading and running workflow programs: the one entry point behind ``m2flow run``, the
profiler, the benchmarks and the tests.

A workflow program (``workflows/grpo.py``) provides:

- ``Config``: a dataclass of defaults (nested dataclasses per section);
- ``main(cfg)``: the runner;
- optionally ``validate(cfg)``: raises :class:`~m2flow.config.ConfigError` for bad values
  (checked before anything starts);
- optionally ``RENAMED``: ``{old key: new key}`` of keys an earlier version had, so that an
  override with an old key names the new one.

    session = run_workflow("workflows/grpo.py", ["trainer.steps=5"], plan="temporal")
    session.result        # what main(cfg) returned
    session.step_times()  # measured seconds per logged step
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from .config import ConfigError, load_config
from .placement import Placement
from .session import Session, StopRun


def resolve_workflow(spec: str | Path) -> Path:
    """A workflow path, or a built-in workflow's file by name (``grpo``).

    Raises:
        ConfigError: neither a file nor a built-in name.
    """
    path = Path(spec)
    if path.is_file():
        return path.resolve()
    import m2flow.workflows as builtin

    candidate = Path(builtin.__file__).parent / f"{path.stem}.py"
    if candidate.is_file() and path.suffix in ("", ".py"):
        return candidate
    raise ConfigError(f"workflow {str(spec)!r} is neither a file nor a built-in workflow name")


def load_workflow(path: Path) -> ModuleType:
    """Import a workflow program by path; its classes pickle by value for Ray workers.

    Raises:
        ConfigError: the file does not parse or fails at import (the line and the error), or
            defines no ``Config`` / ``main``.
    """
    name = f"m2flow_workflow_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        del sys.modules[name]
        raise ConfigError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except ImportError as e:
        del sys.modules[name]
        raise ConfigError(f"{path}: cannot import {e.name or ''}: {e}") from None
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(module)
    for attr in ("Config", "main"):
        if not hasattr(module, attr):
            raise ConfigError(f"{path} is not a workflow: it defines no '{attr}'")
    return module


def prepare(
    workflow: str | Path,
    overrides: Sequence[str] = (),
    config_files: Sequence[str] = (),
    *,
    validate: bool = True,
) -> tuple[ModuleType, Any]:
    """Load the workflow and build its configuration (keys and types checked), and with
    ``validate`` run the workflow's value checks (``validate(cfg)``, which may read files and
    the run directory; ``--show-config`` skips them and touches nothing).

    Raises:
        ConfigError: a bad workflow, key or value.
    """
    module = load_workflow(resolve_workflow(workflow))
    renamed = getattr(module, "RENAMED", {})
    for o in overrides:
        key = o.split("=", 1)[0]
        if key in renamed:
            raise ConfigError(f"{key} is now {renamed[key]}: write {renamed[key]}=...")
    cfg = load_config(module.Config, list(overrides), list(config_files))
    if validate and hasattr(module, "validate"):
        module.validate(cfg)
    return module, cfg


def split_plan(overrides: Sequence[str]) -> tuple[str, list[str]]:
    """``plan=...`` is the runtime's, not the workflow's: take it out of the overrides.

    Raises:
        ConfigError: ``plan=`` given more than once.
    """
    plans = [o.split("=", 1)[1] for o in overrides if o.startswith("plan=")]
    rest = [o for o in overrides if not o.startswith("plan=")]
    if len(plans) > 1:
        raise ConfigError(f"plan= given {len(plans)} times; give it once")
    return (plans[0] if plans else "temporal"), rest


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
    """Run a workflow program under a plan and return its :class:`~m2flow.session.Session`.

    Args:
        workflow: a path or a built-in name (``grpo``).
        overrides: ``key=value`` config overrides (a ``plan=`` among them is taken as
            ``plan``).
        plan: ``temporal`` | ``auto`` | ``spatial`` | ``hybrid`` | a plan YAML path | a
            :class:`~m2flow.placement.Placement` (or a callable ``cluster -> Placement``) |
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
        ConfigError: bad workflow, overrides, plan or profile (nothing has started).
        WorkerError: a worker failed or died during the run.
    """
    from .planning import placement_for

    if any(o.startswith("plan=") for o in overrides):
        plan, overrides = split_plan(overrides)
    module, cfg = prepare(workflow, overrides, config_files)
    if isinstance(plan, str):
        plan = placement_for(plan, str(workflow), list(overrides), list(config_files), profile, log)
    with Session(placement=plan, max_steps=max_steps) as session:
        try:
            session.result = module.main(cfg)
        except StopRun:
            pass
        finally:
            if not keep_cluster and session.cluster is not None:
                session.cluster.shutdown()
    return session
