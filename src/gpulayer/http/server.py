"""``gpulayer server start``: the control plane as a long-running HTTP server.

Start-up, in order:

1. open the home (the store, the artifacts) and claim a fresh instance id;
2. recover what the previous server process left: queued jobs queue again;
   running jobs stay running, since their workers outlive the server, and
   their workers get the heartbeat timeout to reconnect and say so;
3. make the admin token on first start (printed once, kept 0600 in the home);
4. serve the API under uvicorn; a background task declares silent workers lost.

SIGTERM or Ctrl-C stop it gracefully: it stops listening, open long polls
(a worker's acquire, a client's wait or log follow) and any request arriving
meanwhile are answered 503 with ``Retry-After`` at once (their callers try
again, and find the server started again), other requests in flight finish,
the store closes. A restart loses nothing: every step of a job was committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import math
import os
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from .. import defaults
from ..artifacts import ArtifactStore
from ..errors import GPUlayerError, StoreError
from ..home import Home
from ..ids import new_id
from ..service import ControlPlane
from ..store.sqlite import SqliteStore
from . import auth

_BACKLOG = 4096  # connections the kernel holds while the server is busy
_REFUSED_LOG_EVERY_S = 60.0

if TYPE_CHECKING:
    from .handling import Closing
    from .routing import App

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only loopback addresses. An empty host is not
    one: the server binds it as every interface."""
    if not host.strip():
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(
                ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None)
            )
        except OSError:
            return False


async def _tend_garbage() -> None:
    """Keep the cyclic garbage collector from stalling the event loop.

    Ten thousand waiting workers are over a million long-lived objects; a
    full collection walks all of them (about half a second on the 2-core
    development machine) and every request waits meanwhile. Objects that
    survive a while are frozen out of the collector's view (refcounting
    still frees them); a real full collection runs rarely, on a timer, so
    cyclic garbage cannot pile up.
    """
    since_full = 0.0
    while True:
        await asyncio.sleep(defaults.GC_FREEZE_INTERVAL_S)
        since_full += defaults.GC_FREEZE_INTERVAL_S
        if since_full >= defaults.GC_FULL_INTERVAL_S:
            since_full = 0.0
            gc.unfreeze()
            gc.collect()
        gc.freeze()


class Server:
    def __init__(
        self,
        home: Path,
        *,
        host: str = "127.0.0.1",
        port: int = defaults.SERVER_PORT,
        auth_enabled: bool = True,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        heartbeat_timeout: float = defaults.HEARTBEAT_TIMEOUT_S,
        fair_share_half_life: float = defaults.FAIR_SHARE_HALF_LIFE_S,
    ) -> None:
        if not host.strip():
            raise GPUlayerError(
                f"--host {host!r} is empty, which would listen on every interface; name the "
                "address to listen on (127.0.0.1 for this machine only, 0.0.0.0 for every IPv4 one)"
            )
        if not auth_enabled and not is_loopback(host):
            raise GPUlayerError(
                f"refusing to listen on {host} without auth: anyone who reaches it could run code; "
                "drop --no-auth, or listen on 127.0.0.1"
            )
        if (tls_cert is None) != (tls_key is None):
            raise GPUlayerError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        self.host, self.port = host, port
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.auth_enabled = auth_enabled
        self.heartbeat_timeout = heartbeat_timeout
        self.home = Home(home)
        self._server_lock = self.home.claim_server()
        self.instance_id = new_id()
        self.home.claim_instance(self.instance_id)
        self.store = SqliteStore(self.home.db, exclusive=True)
        self.artifacts = ArtifactStore(self.home.artifacts)
        self.plane = ControlPlane(
            self.store, instance_id=self.instance_id, fair_share_half_life=fair_share_half_life
        )
        recovered = self._recover()
        if recovered:
            log.info("took over %d job(s) from the previous server process", len(recovered))
        self.admin_token = self._admin_token()

    def _recover(self) -> list[str]:
        recovered: list[str] = []
        for owner in sorted(self.store.owners() - {self.instance_id}):
            fd = self.home.lock_if_dead(owner)
            if fd is None:
                raise GPUlayerError(
                    f"another GPUlayer process (instance {owner}) is using the home {self.home.path}; "
                    "stop it first, or give this server its own --home"
                )
            try:
                recovered += self.plane.recover(owner, workers_outlive=True)
            finally:
                self.home.forget_instance(owner, fd)
        return recovered

    def _admin_token(self) -> str | None:
        """A new admin token on first start (None after: it is shown only once)."""
        if not self.auth_enabled or self.store.count_tokens(auth.ADMIN):
            return None
        token = auth.create_token(self.store, auth.ADMIN, "first admin")
        path = self.home.path / "admin-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token

    @property
    def url(self) -> str:
        scheme = "https" if self.tls_cert else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def app(self) -> App:
        from .app import create_app

        app = create_app(self.plane, self.artifacts, auth_enabled=self.auth_enabled)
        server = self

        @contextlib.asynccontextmanager
        async def lifespan(_app: object) -> AsyncIterator[None]:
            tasks = [
                asyncio.create_task(server._reap_forever()),
                asyncio.create_task(_tend_garbage()),
            ]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                server.close()

        app.lifespan = lifespan
        return app

    async def _reap_forever(self) -> None:
        interval = max(0.05, self.heartbeat_timeout / 4)
        said: dict[str, float] = {}  # worker id -> when its refused loss was last logged
        refused_now: set[str] = set()

        def refused(worker_id: str, exc: StoreError) -> None:
            # The reaper tries again every turn while the disk stays full:
            # one line a minute for each worker, not one a turn.
            refused_now.add(worker_id)
            now = time.monotonic()
            if now - said.get(worker_id, -math.inf) >= _REFUSED_LOG_EVERY_S:
                said[worker_id] = now
                log.error(
                    "worker %s stopped heartbeating, but declaring it lost failed: %s; "
                    "trying again every %g s",
                    worker_id,
                    exc,
                    interval,
                )

        while True:
            await asyncio.sleep(interval)  # a timer, not a wait on the job path
            refused_now.clear()
            try:
                lost = self.plane.reap(self.heartbeat_timeout, on_refused=refused)
            except Exception:
                log.exception("checking worker heartbeats failed")
                continue
            for worker_id in said.keys() - refused_now:  # lost now, or back: forgotten
                del said[worker_id]
            for worker_id in lost:
                log.warning("worker %s stopped heartbeating: declared lost", worker_id)

    def close(self) -> None:
        self.plane.close_workers()
        self.store.close()
        self.home.release_instance(self.instance_id)
        os.close(self._server_lock)

    def bind(self) -> socket.socket:
        """The listening socket, before the server runs: once this returns,
        connections are accepted (and answered when :meth:`serve` starts)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(_BACKLOG)
        except OSError as exc:
            sock.close()
            raise GPUlayerError(f"cannot listen on {self.host}:{self.port}: {exc}") from None
        return sock

    def serve(self, sock: socket.socket | None = None) -> None:
        import uvicorn

        from .protocol import Protocol

        app = self.app()
        closing: Closing = app.state["api"].closing

        class Uvicorn(uvicorn.Server):
            async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
                # Before uvicorn waits for the requests in flight: the long
                # polls among them would otherwise outlast its grace and be
                # cancelled, which it answers with a 500 (and a traceback).
                closing.begin()
                await super().shutdown(sockets)

        config = uvicorn.Config(
            app,
            http=Protocol,  # httptools, each reply's head and body in one write
            host=self.host,
            port=self.port,
            ssl_certfile=self.tls_cert,
            ssl_keyfile=self.tls_key,
            log_level="warning",
            access_log=False,  # no request lines (and never a header) in the logs
            timeout_graceful_shutdown=5,
            backlog=_BACKLOG,
            # Longer than the heartbeat interval, so a worker's connection
            # is not closed between two of its heartbeats.
            timeout_keep_alive=75,
            limit_concurrency=None,
            # Nothing reads the client's address, so X-Forwarded-* headers
            # need no parsing on every request; and no "server: uvicorn"
            # line for every client to parse on every reply.
            proxy_headers=False,
            server_header=False,
        )
        Uvicorn(config).run(sockets=[sock] if sock is not None else None)
