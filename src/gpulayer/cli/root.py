"""The ``gpulayer`` group: its global options, and the client every verb uses."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click

from ..client import Client
from ..errors import GPUlayerError


@contextmanager
def _progress_bar(total: int, label: str) -> Iterator[Callable[[int], None]]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _client(ctx: click.Context) -> Client:
    opts = ctx.obj
    if "client" not in opts:
        client = Client(
            opts["server"],
            token=opts["token"],
            home=opts["home"],
            progress=_progress_bar,
            ca_file=opts["ca_file"],
        )
        ctx.call_on_close(client.close)
        opts["client"] = client
    return opts["client"]  # type: ignore[no-any-return]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--home",
    envvar="GPULAYER_HOME",
    type=click.Path(file_okay=False),
    help="GPUlayer home (embedded mode).",
)
@click.option("--server", envvar="GPULAYER_SERVER", help="Control-plane URL (server mode).")
@click.option(
    "--token",
    help="API token for the server; visible to local users in `ps`: prefer $GPULAYER_TOKEN "
    "or --token-file.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="A file holding the API token, readable by its owner only "
    "(default: $GPULAYER_TOKEN, else $GPULAYER_TOKEN_FILE).",
)
@click.option(
    "--ca-file",
    envvar="GPULAYER_CA_FILE",
    type=click.Path(dir_okay=False, exists=True),
    help="CA certificate(s) to trust for an https server (default: the system's).",
)
@click.option("-v", "--verbose", is_flag=True, help="Say more about what happens.")
@click.version_option(package_name="gpulayer")
@click.pass_context
def main(
    ctx: click.Context,
    home: str | None,
    server: str | None,
    token: str | None,
    token_file: str | None,
    ca_file: str | None,
    verbose: bool,
) -> None:
    """Run ML jobs on the GPU machines you already own."""
    from ..credentials import ON_COMMAND_LINE, find_token, keep_memory_private

    # Before a token is read: no other process of this user (a job, also one
    # of the local workers `run --workers` starts) can read this one's
    # environment or memory from here on (credentials.py).
    keep_memory_private()
    if token is not None:
        click.echo(f"gpulayer: warning: {ON_COMMAND_LINE}", err=True)
    # A worker's jobs inherit its environment: its token leaves it.
    worker = ctx.invoked_subcommand == "worker"
    found = find_token(token=token, token_file=token_file, forget=worker)
    ctx.obj = {"home": home, "server": server, "token": found, "ca_file": ca_file}
    ctx.obj["token_on_command_line"] = token is not None or token_file is not None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("gpulayer: %(message)s"))
    root = logging.getLogger("gpulayer")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def _main() -> None:
    try:
        main(standalone_mode=True)
    except GPUlayerError as exc:
        click.echo(f"gpulayer: error: {exc}", err=True)
        sys.exit(2)
