"""``gpulayer dashboard``: the web dashboard of an embedded home, on this machine only.

In order:

1. open the home as every command does (the store, the artifacts; what
   processes that died left is marked lost); no worker starts, so nothing
   runs here: the pages show the jobs every process on the home submits;
2. listen on a loopback address (a free port unless ``--port``);
3. print a sign-in link once: its secret signs in one browser, once;
4. serve the dashboard's pages (not the API) until Ctrl-C or SIGTERM, then
   release the home and exit 0.

Why a one-time secret and not a token stored in the home: other users of
the machine reach its loopback ports, so the pages need a sign-in, and an
embedded home has no tokens. A token minted into the home would outlive
this process if it were killed, and be valid on a server later started on
the same home. The secret lives only in this process's memory (its
sha256), and once used it is spent: the browser's history, which keeps the
link, keeps nothing that still works.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import signal
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import click

from .root import main

if TYPE_CHECKING:
    from ..embedded import Embedded

HOST = "127.0.0.1"
_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@main.command()
@click.option(
    "--host",
    default=HOST,
    show_default=True,
    help="Loopback address to listen on (127.0.0.1, ::1); no other is taken.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="Port to listen on; 0: a free one.",
)
@click.pass_context
def dashboard(ctx: click.Context, host: str, port: int) -> None:
    """Serve the web dashboard of the embedded home on this machine, until Ctrl-C.

    Prints a link that signs one browser in, once; start the command again
    for another. Against a server, open the server's own address instead.
    """
    if ctx.obj["server"]:
        raise click.UsageError(
            "gpulayer dashboard shows an embedded home; a server serves its dashboard "
            f"itself: open {ctx.obj['server'].rstrip('/')}/ in a browser"
        )
    if not _is_loopback(host):
        raise click.BadParameter(
            f"{host!r} is not a loopback address: the dashboard of an embedded home listens "
            "on this machine only (127.0.0.1 or ::1); to share one, run `gpulayer server start`",
            param_hint="--host",
        )
    from ..embedded import Embedded
    from ..home import resolve_home

    sock = _listen(host, port)  # before the home is opened: a port taken changes nothing
    try:
        embedded = Embedded(resolve_home(ctx.obj["home"]))
        try:
            _serve(embedded, sock)
        finally:
            embedded.close()
    finally:
        sock.close()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name could resolve elsewhere later: addresses only


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host} port {port}: {exc}") from None


def _serve(embedded: Embedded, sock: socket.socket) -> None:
    import uvicorn

    from ..http import auth
    from ..http.app import Api
    from ..http.dashboard import routes
    from ..http.routing import App

    secret = secrets.token_urlsafe(32)
    api = Api(embedded.plane, embedded.artifacts, auth_enabled=True)
    # The pages alone: no API, so no job is submitted here. The secret's
    # sha256 only is kept, never the secret.
    app = App(routes(api, sign_in_once=auth.digest(secret), detached=True))

    host, port = sock.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    click.echo(f"gpulayer: dashboard of the home {embedded.home.path} at {url}/", err=True)
    click.echo("gpulayer: open this link to sign in; it works once (Ctrl-C stops):", err=True)
    click.echo(f"{url}/signin?token={secret}")  # the one place the secret is ever written
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,  # no request lines: the link is never logged
        lifespan="off",
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=3,
    )

    class Uvicorn(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn raises a signal again once it stopped for it (SIGTERM
            # then ends the process by the signal, SIGINT as an interrupt):
            # stopping is what was asked, so the command ends with 0. SIGHUP
            # too: a closed terminal stops it as Ctrl-C does.
            before = {sig: signal.signal(sig, self.handle_exit) for sig in _STOPS}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    Uvicorn(config).run(sockets=[sock])
