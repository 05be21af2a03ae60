"""``m2flow reward-service``: run the reward service (FastAPI app under uvicorn).

It joins the ``m2flow`` CLI as an ``m2flow.commands`` entry point (``register``); standalone:
``python -m m2flow.reward_service.cli --config service.yaml [--port 8765]``.
"""

from __future__ import annotations

from typing import Optional

import typer

#: seconds open connections get on SIGTERM before the service shuts its workers down
GRACEFUL_S = 5


def serve(
    config: str = typer.Option(..., "--config", "-c", help="service config (YAML or JSON)"),
    port: Optional[int] = typer.Option(None, "--port", help="TCP port (default: the config's)"),
    host: Optional[str] = typer.Option(
        None, "--host", help="bind address (default: the config's, 127.0.0.1)"
    ),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level"),
) -> None:
    """Run the elastic multi-tenant reward service (DistRS) until interrupted (SIGINT or
    SIGTERM: every worker and sandbox is stopped and the scratch space removed)."""
    import socket

    from .schemas import ServiceConfig

    try:
        cfg = ServiceConfig.load(config, port=port, host=host)
    except ValueError as e:
        typer.echo(f"error: bad reward-service config {config}: {e}", err=True)
        raise typer.Exit(2) from None
    try:  # a port in use or a host not on this machine: say so before starting anything
        with socket.socket() as s:
            s.bind((cfg.host, cfg.port))
    except OSError as e:
        typer.echo(f"error: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", err=True)
        raise typer.Exit(2) from None
    import uvicorn

    from .app import create_app
    from .connections import max_connections, uvicorn_config
    from .sandbox import isolation
    from .shares import shares

    try:  # too few descriptors, an unusable scratch_dir/state_dir, a state_dir in use
        shares(cfg, max_connections(cfg))  # before create_app makes the scratch root
        app = create_app(cfg)
        # SIGTERM/SIGINT: uvicorn stops accepting, gives open requests (long polls) a few
        # seconds, then the app's lifespan stops every worker and sandbox and removes the
        # scratch root
        server = uvicorn.Server(
            uvicorn_config(app, cfg, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_S)
        )
    except (ValueError, RuntimeError) as e:  # ConfigError is a ValueError
        typer.echo(f"error: bad reward-service config {config}: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"reward service on http://{cfg.host}:{cfg.port} ({len(cfg.tenants)} tenants, "
        f"pipelines {sorted(cfg.pipelines)}, policy {cfg.policy}, sandbox {isolation()}, "
        f"at most {server.config.http.max_connections} connections)"
    )
    server.run()


def register(app: typer.Typer) -> None:
    """Add the ``reward-service`` command to the ``m2flow`` Typer app."""
    app.command("reward-service")(serve)


def main() -> None:
    cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    cli.command()(serve)
    cli()


if __name__ == "__main__":
    main()
