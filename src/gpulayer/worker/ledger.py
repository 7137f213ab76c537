"""What a worker process runs, on disk, for the next worker on the same home.

A task's processes run in their own sessions, so they outlive a worker that
is killed (SIGKILL, OOM killer, a crash). Left alone they would hold their
GPUs while the server retries the job elsewhere. So a worker keeps a ledger::

    <work dir>/live/<pid>-<random>/
      lock          flock-held for the worker process's life
      worker-id     the id the server gave it
      tasks/<n>     one running task: a line per process, "<pid> <start time>"
    <work dir>/<worker id>/     its task folders (removed with its ledger)

The record files are made once and written in place: a task's record
overwrites a free one (padded with spaces to the file's length), and its end
blanks it. Creating and deleting a file per task cost about five times as
much (file-system metadata, measured in a stream of short jobs).

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
import threading
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
        self._lock = threading.Lock()
        self._free: list[_Record] = []  # blank record files, for the next tasks
        self._used: dict[str, _Record] = {}  # by task
        self._made = 0

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

    def record(self, key: str, procs: list[tuple[int, float]]) -> None:
        """Note the processes of task ``key`` (its pids and start times)."""
        text = "".join(f"{pid} {at!r}\n" for pid, at in procs).encode()
        with self._lock:
            record = self._used.get(key) or (self._free.pop() if self._free else self._new_record())
            self._used[key] = record
        record.write(text)

    def forget(self, key: str) -> None:
        """Task ``key`` has ended: its record is blanked, free for another."""
        with self._lock:
            record = self._used.pop(key, None)
        if record is None:
            return
        record.write(b"")
        with self._lock:
            self._free.append(record)

    def _new_record(self) -> _Record:
        self._made += 1
        name = f"{self._tasks}{self._made}"
        return _Record(os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))

    def close(self) -> None:
        """The worker stops cleanly: nothing of its is left to recover."""
        with self._lock:
            records, self._free, self._used = [*self._free, *self._used.values()], [], {}
        for record in records:
            os.close(record.fd)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._fd)


class _Record:
    """One record file, kept open; its content is rewritten whole, in place."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0  # the file's length: what each write covers

    def write(self, text: bytes) -> None:
        # One write at offset 0: a reader sees the old record or the new one.
        self.size = max(self.size, len(text))
        os.pwrite(self.fd, text.ljust(self.size), 0)


def _read(record: Path) -> list[tuple[int, float]]:
    found = []
    with contextlib.suppress(OSError):
        for line in record.read_text().splitlines():
            with contextlib.suppress(ValueError):
                pid, created = line.split()
                found.append((int(pid), float(created)))
    return found
