"""The ``m2flow`` command line.

``m2flow run WORKFLOW [key=value ...] [plan=...]`` loads a workflow program (a path, or the name
of a built-in one such as ``grpo``), builds its configuration from the defaults it declares plus
the overrides, and calls its ``main(cfg)`` inside a run session that applies the plan
(:mod:`m2flow.session`). ``m2flow profile`` measures a workflow for the planner and ``m2flow
plan`` prints the plan it would run. A workflow module provides:

- ``Config``: a dataclass of defaults (nested dataclasses per section);
- ``main(cfg)``: the runner;
- optionally ``validate(cfg)``: raises :class:`~m2flow.config.ConfigError` for bad values.

User mistakes (a bad path, an unknown key, a bad value) print one clear line and exit 2.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

import typer
from rich.console import Console

from .config import ConfigError, load_config, to_yaml
from .session import Session

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="m2flow: write the RL workflow once; run it temporal, spatial or hybrid.",
)
err = Console(stderr=True, soft_wrap=True)


def resolve_workflow(spec: str) -> Path:
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
    raise ConfigError(f"workflow {spec!r} is neither a file nor a built-in workflow name")


def load_workflow(path: Path) -> ModuleType:
    """Import a workflow program by path; its classes pickle by value for Ray workers."""
    name = f"m2flow_workflow_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(module)
    for attr in ("Config", "main"):
        if not hasattr(module, attr):
            raise ConfigError(f"{path} is not a workflow: it defines no '{attr}'")
    return module


def prepare(workflow: str, overrides: list[str], config_files: list[str]):
    """Load the workflow and build its configuration (validated)."""
    module = load_workflow(resolve_workflow(workflow))
    cfg = load_config(module.Config, overrides, config_files)
    if hasattr(module, "validate"):
        module.validate(cfg)
    return module, cfg


def split_plan(overrides: list[str]) -> tuple[str, list[str]]:
    """``plan=...`` is the runtime's, not the workflow's: take it out of the overrides."""
    plans = [o.split("=", 1)[1] for o in overrides if o.startswith("plan=")]
    rest = [o for o in overrides if not o.startswith("plan=")]
    if len(plans) > 1:
        raise ConfigError(f"plan= given {len(plans)} times; give it once")
    return (plans[0] if plans else "temporal"), rest


@app.command(context_settings={"allow_extra_args": False})
def run(
    workflow: str = typer.Argument(..., help="workflow file (workflows/grpo.py) or built-in name"),
    overrides: Optional[list[str]] = typer.Argument(
        None, help="config overrides key=value; plan=temporal|auto|spatial|hybrid|PLAN.yaml"
    ),
    config: Optional[list[str]] = typer.Option(
        None, "--config", "-c", help="YAML file(s) merged before the overrides"
    ),
    profile_file: Optional[Path] = typer.Option(
        None, "--profile", help="profile for plan=auto|spatial|hybrid (default: profile now)"
    ),
    show_config: bool = typer.Option(False, "--show-config", help="print the config and exit"),
    resume: bool = typer.Option(False, "--resume", help="continue from the last checkpoint"),
) -> None:
    """Run a workflow: m2flow run workflows/grpo.py trainer.steps=50 plan=auto"""
    from .planning import placement_for, report

    overrides = list(overrides or []) + (["resume=true"] if resume else [])
    try:
        plan_spec, overrides = split_plan(overrides)
        module, cfg = prepare(workflow, overrides, config or [])
        if show_config:
            print(to_yaml(cfg))
            return
        placement = placement_for(
            plan_spec, workflow, overrides, config or [], profile_file, log=err.print
        )
        with Session(placement=placement) as session:
            module.main(cfg)
        report(session, err.print)
    except ConfigError as e:
        err.print(f"[bold red]config error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None


@app.command(context_settings={"allow_extra_args": False})
def profile(
    workflow: str = typer.Argument(..., help="workflow file (workflows/grpo.py) or built-in name"),
    overrides: Optional[list[str]] = typer.Argument(None, help="config overrides: key=value"),
    output: Path = typer.Option(Path("profile.yaml"), "--output", "-o", help="profile to write"),
    config: Optional[list[str]] = typer.Option(
        None, "--config", "-c", help="YAML file(s) merged before the overrides"
    ),
    devices: Optional[list[int]] = typer.Option(
        None, "--devices", help="device counts to measure (default 1, 2, 4, ... up to all)"
    ),
    steps: int = typer.Option(10, "--steps", help="measured steps per run (median)"),
    warmup: int = typer.Option(2, "--warmup", help="steps discarded before measuring"),
    chunks: int = typer.Option(4, "--chunks", help="chunks per batch in the overhead run"),
) -> None:
    """Measure a workflow for the planner: m2flow profile workflows/grpo.py -o profile.yaml"""
    from .planning import profile_to_file

    try:
        _, rest = split_plan(list(overrides or []))
        prepare(workflow, rest, config or [])  # config errors before any run starts
        profile_to_file(
            workflow, rest, config or [], output, devices, steps, warmup, chunks, log=err.print
        )
    except (ConfigError, ValueError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None


@app.command()
def version() -> None:
    """Print the m2flow version."""
    from . import __version__

    print(__version__)


def _register_commands() -> None:
    """Commands that live with their feature (imported lazily inside each command)."""
    from .plan_cli import register as register_plan
    from .workers.reward.service.cli import register as register_reward_service

    register_plan(app)
    register_reward_service(app)


_register_commands()


def main() -> None:
    app()


def run_as_script(file: str) -> None:
    """Entry point for ``python workflows/x.py key=value ...``: same as ``m2flow run``."""
    sys.argv = [sys.argv[0], "run", file, *sys.argv[1:]]
    app()


if __name__ == "__main__":
    main()
