"""The ``m2flow`` command line.

``m2flow run WORKFLOW [key=value ...]`` loads a workflow program (a path, or the name of a
built-in one such as ``grpo``), builds its configuration from the defaults it declares plus the
overrides, and calls its ``main(cfg)``. A workflow module provides:

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


@app.command(context_settings={"allow_extra_args": False})
def run(
    workflow: str = typer.Argument(..., help="workflow file (workflows/grpo.py) or built-in name"),
    overrides: Optional[list[str]] = typer.Argument(None, help="config overrides: key=value"),
    config: Optional[list[str]] = typer.Option(
        None, "--config", "-c", help="YAML file(s) merged before the overrides"
    ),
    show_config: bool = typer.Option(False, "--show-config", help="print the config and exit"),
    resume: bool = typer.Option(False, "--resume", help="continue from the last checkpoint"),
) -> None:
    """Run a workflow: m2flow run workflows/grpo.py trainer.steps=50 rollout.temperature=0.8"""
    overrides = list(overrides or []) + (["resume=true"] if resume else [])
    try:
        module, cfg = prepare(workflow, overrides, config or [])
        if show_config:
            print(to_yaml(cfg))
            return
        module.main(cfg)
    except ConfigError as e:
        err.print(f"[bold red]config error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None


@app.command()
def version() -> None:
    """Print the m2flow version."""
    from . import __version__

    print(__version__)


def main() -> None:
    app()


def run_as_script(file: str) -> None:
    """Entry point for ``python workflows/x.py key=value ...``: same as ``m2flow run``."""
    sys.argv = [sys.argv[0], "run", file, *sys.argv[1:]]
    app()


if __name__ == "__main__":
    main()
