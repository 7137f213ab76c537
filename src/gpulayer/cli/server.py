"""``gpulayer server start``."""

from __future__ import annotations

import click

from .root import main


@main.group()
def server() -> None:
    """Run the control plane as an HTTP server."""


@server.command("start")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8585, show_default=True)
@click.option("--no-auth", is_flag=True, help="No tokens (only allowed on a loopback address).")
@click.option(
    "--tls-cert", type=click.Path(dir_okay=False, exists=True), help="TLS certificate (PEM)."
)
@click.option(
    "--tls-key", type=click.Path(dir_okay=False, exists=True), help="TLS private key (PEM)."
)
@click.option(
    "--heartbeat-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds of silence before a worker is declared lost.",
)
@click.option(
    "--fair-share-half-life",
    metavar="DURATION",
    default="1d",
    show_default=True,
    envvar="GPULAYER_FAIR_SHARE_HALF_LIFE",
    help="How fast a project's past GPU use is forgotten in fair share (90m, 12h, 1d, 2w).",
)
@click.pass_context
def server_start(
    ctx: click.Context,
    host: str,
    port: int,
    no_auth: bool,
    tls_cert: str | None,
    tls_key: str | None,
    heartbeat_timeout: float,
    fair_share_half_life: str,
) -> None:
    """Serve the API; state lives in the GPUlayer home."""
    from ..durations import parse_duration
    from ..home import resolve_home
    from ..http.server import Server

    try:
        half_life = parse_duration(fair_share_half_life)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--fair-share-half-life") from None

    srv = Server(
        resolve_home(ctx.obj["home"]),
        host=host,
        port=port,
        auth_enabled=not no_auth,
        tls_cert=tls_cert,
        tls_key=tls_key,
        heartbeat_timeout=heartbeat_timeout,
        fair_share_half_life=half_life,
    )
    sock = srv.bind()
    # Said once it listens: whoever started it may connect as soon as it reads this.
    click.echo(f"gpulayer: serving {srv.url} (home {srv.home.path})", err=True)
    if srv.admin_token:
        click.echo(
            f"gpulayer: admin token (shown once; also in {srv.home.path / 'admin-token'}):",
            err=True,
        )
        click.echo(srv.admin_token)
    srv.serve(sock)
