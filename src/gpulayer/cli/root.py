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


# The options every command takes, before its name or after it (`gpulayer
# --server URL jobs` and `gpulayer jobs --server URL`): where they are
# typed depends on the habit of the one typing.
GLOBAL_OPTIONS = ("home", "server", "token", "token_file", "ca_file")


def _global_option_params() -> list[click.Option]:
    return [
        click.Option(
            ["--home"],
            envvar="GPULAYER_HOME",
            type=click.Path(file_okay=False),
            help="GPUlayer home (embedded mode) [env: GPULAYER_HOME].",
        ),
        click.Option(
            ["--server"],
            envvar="GPULAYER_SERVER",
            help="Control-plane URL (server mode) [env: GPULAYER_SERVER].",
        ),
        click.Option(
            ["--token"],
            help="API token for the server; visible to local users in `ps`: prefer "
            "$GPULAYER_TOKEN or --token-file.",
        ),
        click.Option(
            ["--token-file"],
            type=click.Path(dir_okay=False),
            help="A file holding the API token, readable by its owner only "
            "(default: $GPULAYER_TOKEN, else $GPULAYER_TOKEN_FILE).",
        ),
        click.Option(
            ["--ca-file"],
            envvar="GPULAYER_CA_FILE",
            type=click.Path(dir_okay=False, exists=True),
            help="CA certificate(s) to trust for an https server (default: the system's) "
            "[env: GPULAYER_CA_FILE].",
        ),
    ]


def _given_after(ctx: click.Context, param: click.Parameter, value: object) -> None:
    """A global option given after a command's name: as if given before it.
    Given in both places with different values, it is refused."""
    name = param.name
    if value is None or name is None:
        return
    if ctx.get_parameter_source(name) != click.core.ParameterSource.COMMANDLINE:
        return  # its default or variable: the group has it already
    root = ctx.find_root()
    flag = "--" + name.replace("_", "-")
    if (
        root.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
        and root.params[name] != value
    ):
        raise click.UsageError(
            f"{flag} is given twice, before and after `{ctx.command_path.split()[-1]}`, "
            "with different values: give it once"
        )
    obj = root.obj
    if name in ("token", "token_file"):
        from ..credentials import ON_COMMAND_LINE, find_token

        if name == "token":
            click.echo(f"gpulayer: warning: {ON_COMMAND_LINE}", err=True)
        if obj.get("token_given_as") not in (None, name):
            raise click.UsageError("give --token or --token-file, not both")
        obj["token"] = find_token(
            token=str(value) if name == "token" else None,
            token_file=str(value) if name == "token_file" else None,
        )
        obj["token_on_command_line"] = True
        obj["token_given_as"] = name
    else:
        obj[name] = value


class _Group(click.Group):
    """A group whose every command also takes the global options (those it
    does not define itself), and whose groups do the same."""

    group_class = type  # subgroups made with @group.group() are _Group too

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if not isinstance(cmd, click.Group):
            own = {p.name for p in cmd.params}
            for param in _global_option_params():
                if param.name not in own:
                    param.expose_value = False
                    param.callback = _given_after
                    cmd.params.append(param)
        super().add_command(cmd, name)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--home",
    envvar="GPULAYER_HOME",
    type=click.Path(file_okay=False),
    help="GPUlayer home (embedded mode) [env: GPULAYER_HOME; default: ~/.gpulayer].",
)
@click.option(
    "--server",
    envvar="GPULAYER_SERVER",
    help="Control-plane URL (server mode) [env: GPULAYER_SERVER].",
)
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
    ctx.obj["token_given_as"] = (
        "token" if token is not None else "token_file" if token_file is not None else None
    )
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
