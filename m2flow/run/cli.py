"""The ``m2flow`` command line.

``m2flow run WORKFLOW [key=value ...] [plan=...]`` loads a workflow program (a path, or the name
of a built-in one such as ``grpo``), builds its configuration from the defaults it declares plus
the overrides, and runs ``main(cfg)`` under the plan (:func:`m2flow.run.workflow.run_workflow`).
``m2flow profile`` measures a workflow for the planner and ``m2flow plan`` prints the plan it
would run. Commands of other packages join through the ``m2flow.commands`` entry-point group
(the reward service's ``m2flow reward-service``), so the runtime imports none of them.

Exit codes: 0 done; 2 a user mistake (bad path, key, value, plan or profile: one line on
stderr, before anything starts); 1 a worker failed or died during the run (one paragraph: which
group, rank, node and why; the run's checkpoints are intact, and when there is one the
paragraph names it: ``--resume`` continues).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from ..core.config import ConfigError, to_yaml
from .workflow import prepare, run_workflow, split_plan

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="m2flow: write the RL workflow once; run it temporal, spatial or hybrid.",
)
err = Console(stderr=True, soft_wrap=True)


def fail_run(e, resume: str = "") -> None:
    """Print a run failure as one paragraph and exit 1: a
    :class:`~m2flow.core.group.WorkerError`, or a Ray error of the runtime's own actors (the lock
    service or a channel died). ``resume``: the paragraph's last line, what a rerun does
    (:func:`_resume_line`); ``""``: none (a profiling run has no checkpoints to continue)."""
    from ..core.group import WorkerError

    if isinstance(e, WorkerError):
        err.print(f"[bold red]run failed:[/] {escape(e.summary)}", highlight=False)
        if not e.died:  # an exception in the worker's own code: its traceback is the user's
            err.print(escape(str(e.cause)), style="dim", highlight=False)
    else:
        from ..core.liveness import death_cause

        err.print(
            f"[bold red]run failed:[/] a runtime process of m2flow (device locks or a channel) "
            f"died: {escape(death_cause(e))}",
            highlight=False,
        )
    if resume:
        err.print(resume, highlight=False)
    raise typer.Exit(1)


def _resume_line(workflow: str, overrides: list[str], config: list[str]) -> str:
    """After a failed run: "continue with --resume" naming the newest checkpoint when the
    run directory (``trainer.run_dir``) has one, else that a rerun starts over (a workflow
    without a run directory: nothing)."""
    from .recipe import Checkpoints

    try:  # the config as the run had it (no value checks, nothing touched)
        cfg = prepare(workflow, overrides, config, validate=False)[1]
        run_dir = cfg.trainer.run_dir
    except Exception:  # noqa: BLE001 (a workflow of another shape: no advice beats wrong advice)
        return ""
    latest = Checkpoints(run_dir).latest()
    if latest is None:
        return f"No checkpoint was written under {run_dir}: run it again to start over."
    return f"The checkpoint of step {latest[0]} ({latest[1]}) is intact: continue with --resume."


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
    overrides = list(overrides or []) + (["resume=true"] if resume else [])
    try:
        plan_spec, overrides = split_plan(overrides)
        if show_config:
            print(to_yaml(prepare(workflow, overrides, config or [], validate=False)[1]))
            return
        session = run_workflow(
            workflow,
            overrides,
            plan=plan_spec,
            config_files=config or [],
            profile=profile_file,
            log=err.print,
        )
        from .planning import report

        report(session, err.print)
    except ConfigError as e:
        err.print(f"[bold red]config error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    except Exception as e:  # noqa: BLE001 (worker and Ray failures: one paragraph, exit 1)
        if _is_worker_error(e) or _is_ray_error(e):
            fail_run(e, _resume_line(workflow, overrides, config or []))
        raise


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
    from .planning import check_profile_output, profile_to_file

    try:
        check_profile_output(output)  # before the workflow is even imported
        _, rest = split_plan(list(overrides or []))
        if steps < 1 or warmup < 0 or chunks < 1:
            raise ConfigError(
                f"--steps {steps} --warmup {warmup} --chunks {chunks}: measure at least one "
                "step (--steps >= 1), with --warmup >= 0 and --chunks >= 1"
            )
        if devices is not None and any(n < 1 for n in devices):
            raise ConfigError(f"--devices {devices}: every device count must be >= 1")
        # keys and types before any run starts; the values are checked by the first run,
        # whose run directory is the profiler's own (trainer.run_dir is not touched)
        prepare(workflow, rest, config or [], validate=False)
        profile_to_file(
            workflow, rest, config or [], output, devices, steps, warmup, chunks, log=err.print
        )
    except (ConfigError, ValueError) as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    except Exception as e:  # noqa: BLE001 (worker and Ray failures: one paragraph, exit 1)
        if _is_worker_error(e) or _is_ray_error(e):
            fail_run(e)
        raise


def _is_worker_error(e: BaseException) -> bool:
    # m2flow.core.group imports Ray (seconds): not before a bad value is refused; a WorkerError
    # exists only once it is imported
    group = sys.modules.get("m2flow.core.group")
    return group is not None and isinstance(e, group.WorkerError)


def _is_ray_error(e: BaseException) -> bool:
    return "ray" in sys.modules and isinstance(e, sys.modules["ray"].exceptions.RayError)


@app.command()
def version() -> None:
    """Print the m2flow version."""
    from .. import __version__

    print(__version__)


def _register_commands() -> None:
    """``m2flow plan`` (the runtime's), then every ``m2flow.commands`` entry point: a function
    ``register(app)`` adding its commands (their imports stay inside the commands)."""
    from importlib.metadata import entry_points

    from .plan_cli import register as register_plan
    from .timeline_cli import register as register_timeline

    register_plan(app)
    register_timeline(app)
    for ep in entry_points(group="m2flow.commands"):
        ep.load()(app)


_register_commands()


def main() -> None:
    app()


def run_as_script(file: str) -> None:
    """Entry point for ``python workflows/x.py key=value ...``: same as ``m2flow run``."""
    sys.argv = [sys.argv[0], "run", file, *sys.argv[1:]]
    app()


if __name__ == "__main__":
    main()
