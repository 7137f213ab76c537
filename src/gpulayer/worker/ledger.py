"""What a worker process runs, on disk, for the next worker on the same home.

A task's processes run in their own sessions, so they outlive a worker that
is killed (SIGKILL, OOM killer, a crash). Left alone they would hold their
GPUs while the server retries the job elsewhere. So a worker keeps a ledger::

    <work dir>/live/<pid>-<random>/
      lock          flock-held for the worker process's life
      worker-id     the id the server gave it
      tasks/<n>     one running task: a line per process, "<pid> <start time>"
      results/<job id>-<attempt>-<node>
                    a task's result the server has not taken yet, with its
                    last log lines not delivered either (JSON)
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

A result waits in a worker's outbox while the server is away. It is written
under ``results/`` when it is queued, and removed once the server has taken
it (or refused it). The next worker process on the home moves a dead one's
results into its own ledger and delivers them before it registers, so a task
that ended while the server was away keeps its outcome even if its worker
was killed before the server came back. Nothing is written while the server
answers: a result delivered at once never touches the disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from pathlib import Path

import msgspec

from ..home import take_lock
from ..jobs import LogLine, TaskResult
from .process import end_orphans

log = logging.getLogger(__name__)


_GENERATION = "generation"  # of the worker's registration
_WARDEN_TIME = "warden-time"  # the longest its warden may take, once the worker died
_WARDEN_TIME_UNSAID = 30.0  # for a ledger that does not say
_LOCK_POLL_S = 0.05  # how often a dead worker's ledger lock is tried while its warden works
_LATE_S = 1.0  # how long past its own deadline a warden is waited for


class Kept(msgspec.Struct):
    """A task's result waiting for the server, and its lines still undelivered."""

    result: TaskResult
    lines: list[LogLine] = []


# The ledgers are the worker's alone: a result kept there carries its task's
# last log lines, and a job run as another user (--run-as) may list and read
# nothing of the worker's. Set by chmod: mkdir's mode is masked by the umask.
_DIR_MODE = 0o700


class Ledger:
    def __init__(self, work_dir: Path) -> None:
        self.root = work_dir / "live"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, _DIR_MODE)  # one made by an older version too
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        # Locked before it has its name: no one can see it unlocked.
        new = self.root / f".new-{name}"
        for folder in (new, new / "tasks", new / "results"):
            folder.mkdir(mode=_DIR_MODE)
            os.chmod(folder, _DIR_MODE)
        fd = take_lock(new / "lock", create=True)
        assert fd is not None  # a name no one else has
        self._fd = fd
        # Held by the worker process alone (its warden does not keep it):
        # free while "lock" is held, the worker is dead and its warden at work.
        alive = take_lock(new / "alive", create=True)
        assert alive is not None
        self._alive = alive
        self.dir = new.rename(self.root / name)
        self._tasks = f"{self.dir}/tasks/"
        self._results = self.dir / "results"
        self._kept: set[str] = set()  # the results under results/, by file name
        self._lock = threading.Lock()
        self._free: list[_Record] = []  # blank record files, for the next tasks
        self._used: dict[str, _Record] = {}  # by task
        self._made = 0

    def recover(self, *, grace: float) -> str | None:
        """End what dead workers left running, take over the results they had
        not delivered (see :meth:`kept`); return one dead worker's id."""
        adopted: str | None = None
        for other in sorted(self.root.iterdir()):
            if other == self.dir or other.name.startswith("."):
                continue
            fd = take_lock(other / "lock", create=False)
            if fd is None and _warden_at_work(other):
                # Its worker is dead, and its warden (warden.py) is ending
                # what it left, or saying goodbye. Skipped, its results and
                # its id would wait for a later worker process: waited for.
                fd = _lock_when_free(other, _warden_time(other))
            if fd is None:
                continue  # a live worker's (another worker process on this home)
            try:
                ended = end_listed(other, grace=grace)
                if ended:
                    log.warning("ended %d process tree(s) a dead worker left running", ended)
                moved = sorted((other / "results").glob("[!.]*"))
                for result in moved:
                    os.replace(result, self._results / result.name)
                    self._kept.add(result.name)
                if moved:
                    _sync_dir(self._results)
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

    @property
    def lock_fd(self) -> int:
        """The descriptor whose lock says this ledger is in use: its worker
        alive, or its warden at work."""
        return self._fd

    def set_warden_time(self, seconds: float) -> None:
        """A warden watches this ledger's worker, and may take this long once
        it died (a next worker on the home waits that long for it at most)."""
        _replace(self.dir / _WARDEN_TIME, repr(seconds))

    def set_worker_id(self, worker_id: str, generation: str | None = None) -> None:
        """The worker's id; and, once registered, the registration's number
        (for its warden's goodbye), if the control plane gave one. Each is
        replaced whole: a reader never sees one cut short. While the worker
        registers again the old number stays: a goodbye naming it is then
        ignored (the heartbeat timeout acts), not taken for the next
        worker's, which would remove that one."""
        _replace(self.dir / "worker-id", worker_id)
        if generation:
            _replace(self.dir / _GENERATION, generation)

    def keep(self, result: TaskResult, lines: list[LogLine] | None = None) -> None:
        """Write ``result`` down, with the task's ``lines`` not delivered yet,
        until :meth:`drop`: it waits for the server."""
        name = _result_name(result)
        temporary = self._results / f".{name}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as file:  # private: a result carries the task's last stderr lines
            file.write(msgspec.json.encode(Kept(result, lines or [])))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self._results / name)
        _sync_dir(self._results)  # the rename too survives a power cut
        with self._lock:
            self._kept.add(name)
        log.warning(
            "kept the result of job %s (attempt %d) on disk until the server takes it",
            result.job_id,
            result.attempt,
        )

    def drop(self, result: TaskResult) -> None:
        """The server took ``result`` (or refused it): it is kept no longer."""
        name = _result_name(result)
        with self._lock:
            if name not in self._kept:  # the usual case: it was never written
                return
            self._kept.discard(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._results / name)

    def kept(self) -> list[Kept]:
        """The results kept here, a dead worker's taken over included."""
        with self._lock:
            names = sorted(self._kept)
        found = []
        for name in names:
            try:
                raw = (self._results / name).read_bytes()
                try:
                    kept = msgspec.json.decode(raw, type=Kept)
                except msgspec.DecodeError:  # as kept before its lines were kept too
                    kept = Kept(msgspec.json.decode(raw, type=TaskResult))
                if _result_name(kept.result) == name:
                    found.append(kept)
                    continue
            except (OSError, msgspec.DecodeError):  # cut short by a full disk, say
                pass
            log.warning("a kept result (%s) could not be read; dropping it", name)
            with self._lock:
                self._kept.discard(name)
            with contextlib.suppress(OSError):
                os.unlink(self._results / name)
        return found

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

    def holds_results(self) -> bool:
        with self._lock:
            return bool(self._kept)

    def close(self) -> None:
        """The worker stops with its tasks ended. Unless it holds results the
        server has not taken, nothing of its is left to recover."""
        with self._lock:
            if self._fd < 0:
                return  # closed already
            records, self._free, self._used = [*self._free, *self._used.values()], [], {}
            kept = bool(self._kept)
            fd, self._fd = self._fd, -1
        for record in records:
            os.close(record.fd)
        if kept:
            log.warning("leaving undelivered results in %s for the next worker", self._results)
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._alive)
        os.close(fd)


class _Record:
    """One record file, kept open; its content is rewritten whole, in place."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.size = 0  # the file's length: what each write covers

    def write(self, text: bytes) -> None:
        # One write at offset 0: a reader sees the old record or the new one.
        self.size = max(self.size, len(text))
        os.pwrite(self.fd, text.ljust(self.size), 0)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}")
    temporary.write_text(text)
    os.replace(temporary, path)


def _warden_at_work(ledger_dir: Path) -> bool:
    """Whether a locked ledger's worker is dead (its "alive" lock is free),
    so that its warden holds the lock. A ledger of a version without that
    lock reads as a live worker's."""
    fd = take_lock(ledger_dir / "alive", create=False)
    if fd is None:
        return False
    os.close(fd)
    return True


def _warden_time(ledger_dir: Path) -> float:
    """The longest the ledger's warden said it may take, once its worker died."""
    try:
        return float((ledger_dir / _WARDEN_TIME).read_text())
    except (OSError, ValueError):
        return _WARDEN_TIME_UNSAID


def _lock_when_free(ledger_dir: Path, within: float) -> int | None:
    """The ledger's lock, once its warden lets it go, within ``within`` s;
    None if not by then, or if another worker took the ledger over first."""
    log.info("waiting for the warden of dead worker %s to finish", ledger_dir.name)
    deadline = time.monotonic() + within + _LATE_S
    while True:
        fd = take_lock(ledger_dir / "lock", create=False)
        if fd is not None:
            return fd
        if not (ledger_dir / "lock").exists():
            return None  # another worker process took it over, and removed it
        if time.monotonic() >= deadline:
            log.warning("the warden of dead worker %s did not finish in time", ledger_dir.name)
            return None
        time.sleep(_LOCK_POLL_S)  # flock has no timeout: polled


def end_listed(ledger_dir: Path, *, grace: float) -> int:
    """End the process trees a dead worker's ledger lists as running (each
    still the same process: pid and start time agree); how many there were."""
    listed = listed_tasks(ledger_dir)
    return end_orphans(listed, grace=grace) if listed else 0


def listed_tasks(ledger_dir: Path) -> list[tuple[int, float]]:
    """The processes a ledger lists as running: (pid, start time) each."""
    return [entry for record in (ledger_dir / "tasks").glob("*") for entry in _read(record)]


def _result_name(result: TaskResult) -> str:
    return f"{result.job_id}-{result.attempt}-{result.node}"


def _read(record: Path) -> list[tuple[int, float]]:
    found = []
    with contextlib.suppress(OSError):
        for line in record.read_text().splitlines():
            with contextlib.suppress(ValueError):
                pid, created = line.split()
                found.append((int(pid), float(created)))
    return found
