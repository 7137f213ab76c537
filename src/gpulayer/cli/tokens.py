"""``gpulayer token``: make, list and revoke a server's tokens."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from .root import main

if TYPE_CHECKING:
    from ..transport.http import HttpTransport


@main.group()
def token() -> None:
    """Manage API tokens (needs an admin token)."""


def _admin_transport(ctx: click.Context) -> HttpTransport:
    from ..transport.http import HttpTransport

    if not ctx.obj["server"]:
        raise click.UsageError("tokens belong to a server: --server URL or GPULAYER_SERVER")
    transport = HttpTransport(ctx.obj["server"], token=ctx.obj["token"], ca_file=ctx.obj["ca_file"])
    ctx.call_on_close(transport.close)
    return transport


def _duration(value: str | None) -> float | None:
    """Seconds in ``90m``, ``12h``, ``30d``, ``2w`` or ``3600``."""
    from ..durations import parse_duration

    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--expires-in") from None


@token.command("create")
@click.option("--role", type=click.Choice(["worker", "user", "admin"]), required=True)
@click.option("--name", help="What the token is for.")
@click.option(
    "--user",
    help="The user it acts as: whose jobs it submits and sees (needed for --role user; "
    "an admin token may have one; a worker token has none).",
)
@click.option(
    "--expires-in",
    metavar="DURATION",
    help="Refuse it after this long (90m, 12h, 30d, 2w; default: valid until revoked).",
)
@click.pass_context
def token_create(
    ctx: click.Context, role: str, name: str | None, user: str | None, expires_in: str | None
) -> None:
    """Make a token and print it (it is shown only this once)."""
    seconds = _duration(expires_in)
    if role == "user" and user is None:
        raise click.UsageError(
            "a user token needs --user NAME: the user whose jobs it submits and sees"
        )
    click.echo(_admin_transport(ctx).create_token(role, name, user=user, expires_in=seconds))


@token.command("list")
@click.pass_context
def token_list(ctx: click.Context) -> None:
    """List the server's tokens, oldest first: id, role, user, name, when
    made, when it expires."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    def when(at: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))

    table = Table("ID", "ROLE", "USER", "NAME", "CREATED", "EXPIRES", box=None)
    now = time.time()
    for made in _admin_transport(ctx).list_tokens():
        if made.expires is None:
            expires = "never"
        else:
            expires = when(made.expires) + (" (expired)" if made.expires <= now else "")
        name = escape(made.name) if made.name else "-"
        user = escape(made.user) if made.user else "-"
        table.add_row(made.id, made.role, user, name, when(made.created), expires)
    Console().print(table)


@token.command("revoke")
@click.argument("token_id", metavar="ID")
@click.pass_context
def token_revoke(ctx: click.Context, token_id: str) -> None:
    """Revoke the token with this ID (as `token list` shows it): the server
    refuses it from its next request on."""
    _admin_transport(ctx).revoke_token(token_id)
    click.echo(f"token {token_id} revoked")
