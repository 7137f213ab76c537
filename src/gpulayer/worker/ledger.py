"""What a worker process runs, on disk, for the next worker on the same home.

A task's processes run in their own sessions, so they outlive a worker that
is killed (SIGKILL, OOM killer, a crash). Left alone they would hold their
GPUs while the server retries the job elsewhere. So a worker keeps a ledger::

    <work dir>/live/<pid>-<random>/
      lock          flock-held for the worker process's life
      worker-id     the id the server gave it
      tasks/<job>-<attempt>   one line per process: "<pid> <start time>"
    <work dir>/<worker id>/     its task folders (removed with its ledger)

A worker that starts finds the ledgers whose lock it can take (their owner
is dead, however it died), ends every process they list that is still the
same process (pid and start time agree), and takes over one dead worker's
id: registering under it tells the server at once that the old tasks are
gone, rather than after the heartbeat timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
from pathlib import Path

from ..home import take_lock
from .process import kill_orphans

log = logging.getLogger(__name__)


class Ledger:
    def __init__(self, work_dir: Path) -> None:
        self.root = work_dir / "live"
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        # Locked before it has its name: no one can see it unlocked.
        new = self.root / f".new-{name}"
        (new / "tasks").mkdir(parents=True)
        fd = take_lock(new / "lock", create=True)
        assert fd is not None  # a name no one else has
        self._fd = fd
        self.dir = new.rename(self.root / name)
        self._tasks = f"{self.dir}/tasks/"

    def recover(self, *, grace: float) -> str | None:
        """End what dead workers left running; return one dead worker's id."""
        adopted: str | None = None
        for other in sorted(self.root.iterdir()):
            if other == self.dir or other.name.startswith("."):
                continue
            fd = take_lock(other / "lock", create=False)
            if fd is None:
                continue  # a live worker's (another worker process on this home)
            try:
                ended = 0
                for record in (other / "tasks").glob("*"):
                    for pid, created in _read(record):
                        ended += kill_orphans(pid, created, grace=grace)
                if ended:
                    log.warning("ended %d process tree(s) a dead worker left running", ended)
                worker_id = ""
                with contextlib.suppress(OSError):
                    worker_id = (other / "worker-id").read_text().strip()
                if worker_id:
                    # Its task folders: what its dead tasks left behind.
                    shutil.rmtree(self.root.parent / worker_id, ignore_errors=True)
                    adopted = adopted or worker_id
                shutil.rmtree(other, ignore_errors=True)
            finally:
                os.close(fd)
        return adopted

    def set_worker_id(self, worker_id: str) -> None:
        (self.dir / "worker-id").write_text(worker_id)

    def record(self, key: str, procs: list[tuple[int, float | None]]) -> None:
        # Plain os calls: this runs for every task, and pathlib's cost shows.
        lines = "".join(f"{pid} {created!r}\n" for pid, created in procs if created is not None)
        fd = os.open(self._tasks + key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)

    def forget(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tasks + key)

    def close(self) -> None:
        """The worker stops cleanly: nothing of its is left to recover."""
        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._fd)


def _read(record: Path) -> list[tuple[int, float]]:
    found = []
    with contextlib.suppress(OSError):
        for line in record.read_text().splitlines():
            with contextlib.suppress(ValueError):
                pid, created = line.split()
                found.append((int(pid), float(created)))
    return found
