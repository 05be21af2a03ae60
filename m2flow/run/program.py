"""Workflow programs: find one, load it, configure it, and run it under a given placement.

A workflow program (``workflows/grpo.py``) provides:

- ``Config``: a dataclass of defaults (nested dataclasses per section);
- ``main(cfg)``: the runner;
- optionally ``validate(cfg)``: raises :class:`~m2flow.core.config.ConfigError` for bad values
  (checked before anything starts);
- optionally ``RENAMED``: ``{old key: new key}`` of keys an earlier version had, so that an
  override with an old key names the new one.

This module runs a program under a placement it is given (the profiler's path);
:func:`m2flow.run.workflow.run_workflow` (``m2flow run``) also turns a plan name into a placement,
which may profile the program first, through this module.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

from ..core.config import ConfigError, load_config
from ..core.placement import Placement
from .runlock import hold_run_dir
from .session import Session, StopRun

#: keys of the runtime's sections that earlier versions had -> their names now
RENAMED = {"trainer.tensorboard": "trainer.logger"}


def resolve_workflow(spec: str | Path) -> Path:
    """A workflow path, or a built-in workflow's file by name (``grpo``).

    Raises:
        ConfigError: neither a file nor a built-in name.
    """
    path = Path(spec)
    if path.is_file():
        return path.resolve()
    # The built-in programs are package data of m2flow.workflows, located, not imported: the
    # runtime sits below the workflows (docs/concepts/design.md, "Layers").
    candidate = importlib.resources.files("m2flow.workflows") / f"{path.stem}.py"
    if candidate.is_file() and path.suffix in ("", ".py"):
        return Path(str(candidate))
    if path.is_dir():
        raise ConfigError(
            f"workflow {str(spec)!r} is a directory: give a workflow's .py file (e.g. "
            "workflows/grpo.py) or a built-in workflow's name (grpo)"
        )
    raise ConfigError(f"workflow {str(spec)!r} is neither a file nor a built-in workflow name")


def resolve_preset(spec: str | Path) -> Path:
    """A config file for ``-c``: a path, or a built-in preset's name (``smoke`` for
    ``workflows/presets/smoke.yaml``, shipped with the package).

    Raises:
        ConfigError: neither a file nor a built-in preset name (the names are listed).
    """
    path = Path(spec)
    if path.exists() or path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        return path  # load_config names a missing file, or a directory
    presets = importlib.resources.files("m2flow.workflows") / "presets"
    candidate = presets / f"{path.name}.yaml"
    if candidate.is_file():
        return Path(str(candidate))
    names = sorted(p.name[: -len(".yaml")] for p in presets.iterdir() if p.name.endswith(".yaml"))
    raise ConfigError(
        f"-c {str(spec)!r} is neither a file nor a built-in preset (presets: {', '.join(names)})"
    )


def load_workflow(path: Path, *, pickle_by_value: bool = True) -> ModuleType:
    """Import a workflow program by path; its classes pickle by value for Ray workers
    (with ``pickle_by_value=False``, not yet: :func:`prepare` leaves that to
    :func:`run_prepared`, so that checking a config imports no Ray, ~1 s).

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
    if pickle_by_value:
        _pickle_by_value(module)
    for attr in ("Config", "main"):
        if not hasattr(module, attr):
            raise ConfigError(f"{path} is not a workflow: it defines no '{attr}'")
    return module


def _pickle_by_value(module: ModuleType) -> None:
    import ray.cloudpickle  # heavy (~1 s): imported when the workflow runs

    ray.cloudpickle.register_pickle_by_value(module)


def prepare(
    workflow: str | Path,
    overrides: Sequence[str] = (),
    config_files: Sequence[str] = (),
    *,
    validate: bool = True,
) -> tuple[ModuleType, Any]:
    """Load the workflow and build its configuration (keys and types checked), and with
    ``validate`` run the workflow's value checks (``validate(cfg)``, which may read files and
    the run directory; ``--show-config`` skips them and touches nothing). A config file may be
    a built-in preset's name (:func:`resolve_preset`). An override of a key
    the workflow's ``RENAMED`` map lists (``{old key: new key}``) names the new key.

    Raises:
        ConfigError: a bad workflow, key or value.
    """
    path = resolve_workflow(workflow)
    files = [resolve_preset(f) for f in config_files]
    check_cluster_early(overrides, files)  # before the workflow's imports (seconds)
    module = load_workflow(path, pickle_by_value=False)
    renamed = {**RENAMED, **getattr(module, "RENAMED", {})}
    for o in overrides:
        key = o.split("=", 1)[0]
        if key in renamed:
            raise ConfigError(f"{key} is now {renamed[key]}: write {renamed[key]}=...")
    cfg = load_config(module.Config, list(overrides), files)
    if validate and hasattr(module, "validate"):
        module.validate(cfg)
    return module, cfg


def check_cluster_early(overrides: Sequence[str], files: Sequence[str | Path]) -> None:
    """The runtime's ``cluster`` section (:class:`m2flow.run.recipe.ClusterConfig`) as the
    ``cluster.*`` overrides and the config files' ``cluster:`` mappings set it, checked by
    :func:`m2flow.run.recipe.validate_cluster` before the workflow is imported: importing a
    workflow (torch, transformers, Ray, its tasks) takes 6-8 s on a quiet machine and 30-40 s
    on a loaded one, and an impossible cluster (``cluster.devices_per_node=100000000``) is
    refused at once. Keys or values this section does not know are left to the workflow's
    own schema (:func:`prepare` reports them).

    Raises:
        ConfigError: a cluster value :func:`~m2flow.run.recipe.validate_cluster` refuses.
    """
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .recipe import ClusterConfig, validate_cluster

    dotlist = [o[len("cluster.") :] for o in overrides if o.startswith("cluster.") and "=" in o]
    sections = []
    for f in files:
        try:
            data = yaml.safe_load(Path(f).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return  # load_config names the file and what is wrong with it
        if isinstance(data, dict) and isinstance(data.get("cluster"), dict):
            sections.append(data["cluster"])
    if not dotlist and not sections:
        return
    try:
        cfg = OmegaConf.structured(ClusterConfig)
        OmegaConf.set_struct(cfg, True)
        for section in sections:
            cfg = OmegaConf.merge(cfg, section)
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotlist))
    except OmegaConfBaseException:
        return
    validate_cluster(cfg)


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


def run_prepared(
    module: ModuleType,
    cfg: Any,
    placement: Placement | Callable | None,
    *,
    max_steps: int | None = None,
    keep_cluster: bool = False,
) -> Session:
    """Run ``module.main(cfg)`` (from :func:`prepare`) in a session under ``placement``.

    Args:
        placement: a :class:`~m2flow.core.placement.Placement`, a callable ``cluster ->
            Placement``, or ``None`` (the runner's own defaults).
        max_steps: stop after this many logged steps (profiling); ``None``: run to the end.
        keep_cluster: leave the run's cluster up on return (``session.cluster``; the caller
            shuts it down).

    Returns:
        the session (``result``: what ``main`` returned, ``None`` if stopped at
        ``max_steps``).

    Raises:
        RunDirBusy: another live run holds the run directory (``trainer.run_dir``), which
            this run holds until it returns (:mod:`m2flow.run.runlock`).
        WorkerError: a worker failed or died during the run.
    """
    _pickle_by_value(module)  # its classes travel to the Ray workers by value
    with hold_run_dir_of(cfg), Session(placement=placement, max_steps=max_steps) as session:
        try:
            session.result = module.main(cfg)
        except StopRun:
            pass
        finally:
            if not keep_cluster and session.cluster is not None:
                session.cluster.shutdown()
    return session


def hold_run_dir_of(cfg: Any) -> AbstractContextManager:
    """The run directory's lock (:func:`m2flow.run.runlock.hold_run_dir`) for ``cfg``'s
    ``trainer.run_dir``; nothing to hold for a workflow without one.

    Raises:
        RunDirBusy: another live run holds it.
    """
    run_dir = getattr(getattr(cfg, "trainer", None), "run_dir", None)
    return hold_run_dir(run_dir) if run_dir else nullcontext()
