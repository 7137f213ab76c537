"""The GPUlayer home: where an embedded control plane keeps its state.

Layout::

    <home>/
      .gpulayer-home        marker: bundles never ship a home
      gpulayer.db           the job store (SQLite, WAL)
      secrets.key           seals jobs' secrets in the store (0600; made at the first secret)
      artifacts/            content-addressed blobs (bundles, inputs, outputs)
      instances/<id>.lock   one per live control plane, flock-held for its life
      workers/<id>/         per-worker task directories
      gc.lock               flock-held while `gpulayer gc` cleans the home

Liveness is an advisory lock (``flock``) on the instance's lock file: the
kernel drops it when the process dies, however it dies, so a later start can
tell a crashed control plane from a live one without trusting pids.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Mapping
from pathlib import Path

from . import defaults
from .errors import GPUlayerError


def take_lock(path: Path, *, create: bool) -> int | None:
    """``flock`` the file at ``path`` unless a live process holds it; the fd.

    None when another process holds it (it is alive), or, without
    ``create``, when the file is not there (being made or removed).
    """
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    except FileNotFoundError:
        if create:
            raise
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def resolve_home(
    home: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """Argument, then $GPULAYER_HOME, then ~/.gpulayer."""
    env = os.environ if env is None else env
    if home is not None:
        return Path(home).expanduser().resolve()
    if env.get(defaults.HOME_ENV):
        return Path(env[defaults.HOME_ENV]).expanduser().resolve()
    return (Path.home() / defaults.HOME_DIRNAME).resolve()


class Home:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        marker = path / defaults.HOME_MARKER
        if not marker.exists():
            marker.write_text("This directory is a GPUlayer home.\n")
        self.instances = path / "instances"
        self.instances.mkdir(exist_ok=True)
        self._lock_fd: int | None = None

    @property
    def db(self) -> Path:
        return self.path / defaults.DB_FILENAME

    @property
    def artifacts(self) -> Path:
        return self.path / "artifacts"

    def worker_dir(self, worker_id: str) -> Path:
        return self.path / "workers" / worker_id

    @property
    def server_lock(self) -> Path:
        return self.path / "server.lock"

    def claim_server(self) -> int:
        """Mark this home as a server's, for good, and hold it while serving.

        A second server on the same home is refused; so is an embedded
        control plane (see :meth:`check_not_server`), whose recovery would end
        the jobs that the server's remote workers are still running.
        """
        fd = os.open(self.server_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GPUlayerError(
                f"another GPUlayer server is serving the home {self.path}; "
                "stop it first, or give this server its own --home"
            ) from None
        return fd

    def check_not_server(self) -> None:
        if self.server_lock.exists():
            raise GPUlayerError(
                f"{self.path} is a GPUlayer server's home: reach it through the server "
                "(--server URL or GPULAYER_SERVER), not embedded, which would end its remote jobs"
            )

    def claim_gc(self) -> int:
        """Hold the home's clean-up lock (``gpulayer gc``) until the fd is
        closed: two cleans at once would each count what the other removed."""
        fd = take_lock(self.path / "gc.lock", create=True)
        if fd is None:
            raise GPUlayerError(
                f"another `gpulayer gc` is cleaning the home {self.path}; let it finish"
            )
        return fd

    def claim_instance(self, instance_id: str) -> None:
        """Hold this instance's lock for as long as the process lives."""
        fd = os.open(self.instances / f"{instance_id}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release_instance(self, instance_id: str) -> None:
        if self._lock_fd is not None:
            (self.instances / f"{instance_id}.lock").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def lock_if_dead(self, instance_id: str) -> int | None:
        """Take a dead instance's lock (to recover its jobs) and return its fd.

        None means the instance is alive. Holding the lock while recovering
        keeps two processes from recovering the same instance at once.
        """
        return take_lock(self.instances / f"{instance_id}.lock", create=True)

    def is_alive(self, instance_id: str) -> bool:
        fd = self.lock_if_dead(instance_id)
        if fd is None:
            return True
        self.forget_instance(instance_id, fd)
        return False

    def forget_instance(self, instance_id: str, fd: int) -> None:
        (self.instances / f"{instance_id}.lock").unlink(missing_ok=True)
        os.close(fd)
