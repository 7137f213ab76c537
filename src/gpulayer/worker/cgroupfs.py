"""The cgroup v2 files a worker's containment reads and writes, and acting
on the processes of a cgroup: listing them, signalling them through pidfds
(never a pid reused since it was listed), waiting for a cgroup to empty,
removing cgroups, and ending what dead workers left (see cgroups.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from .containment import Unavailable, proc_stat
from .process import KILL_WAIT_S

log = logging.getLogger(__name__)


def kill_all(cgroup: Path, hierarchy: str, *, has_kill: bool) -> None:
    """SIGKILL to everything in ``cgroup`` (``hierarchy``: its path as
    ``/proc/<pid>/cgroup`` says), at once where the kernel can (5.14 and
    later), else to each process until none is left: each through a pidfd,
    once it is known to be in it still (never a pid reused since the
    listing)."""
    if has_kill:
        with contextlib.suppress(OSError):  # gone, or being removed: nothing to kill
            _write(cgroup / "cgroup.kill", "1")
        return
    for _ in range(100):  # each round kills all there are; forks race it
        pids = _pids(cgroup)
        if not pids:
            return
        for pid in pids:
            fd = _pidfd_of_member(pid, hierarchy, None, 0, under=True)
            if fd is not None:
                _signal_pidfds([fd], signal.SIGKILL)
                os.close(fd)


def _pidfd_of_member(
    pid: int, cgroup: str, not_session: int | None, since: int, *, under: bool = False
) -> int | None:
    """A pidfd for ``pid`` if, read once it is taken (it then holds the
    process ``/proc`` shows), the pid names a process in cgroup ``cgroup``
    (its hierarchy path; or one under it, with ``under``), not in session
    ``not_session``, started at or after ``since`` (clock ticks after
    boot); else None. The caller closes it."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone (ESRCH): nothing is ever acted on by number
        return None
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as file:
            lines = file.read().splitlines()
        where = next((line[3:].decode() for line in lines if line.startswith(b"0::")), None)
        inside = where == cgroup or (under and where is not None and where.startswith(cgroup + "/"))
        st = proc_stat(pid)
        if inside and st.session != not_session and st.start >= since:
            return fd
    except (OSError, ValueError):  # reaped meanwhile
        pass
    os.close(fd)
    return None


def _signal_pidfds(fds: Sequence[int], sig: signal.Signals) -> None:
    for fd in fds:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            signal.pidfd_send_signal(fd, sig)


def _signal_member(pid: int, sig: signal.Signals, cgroup: str, skip_groups: frozenset[int]) -> bool:
    """Signal ``pid``, listed in ``cgroup`` (its hierarchy path), if it is
    still there: through a pidfd taken first, so that a pid reused since the
    listing is never signalled."""
    try:
        if skip_groups and os.getpgid(pid) in skip_groups:
            return False
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as file:
            if f"0::{cgroup}\n".encode() not in file.read():
                return False  # not the process listed: another has its pid now
        signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, FileNotFoundError):
        return False
    finally:
        os.close(fd)


def _write(path: Path | str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: Path | str) -> bytes:
    """A small cgroup file, whole (no Python file object: read per task)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def _pids_here(cgroup: Path) -> list[int]:
    """The processes in ``cgroup`` itself."""
    chunks = []
    try:
        fd = os.open(f"{cgroup}/cgroup.procs", os.O_RDONLY | os.O_CLOEXEC)
        try:
            while chunk := os.read(fd, 65536):  # a cgroup of many processes takes more reads
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError:  # gone (ENOENT), or being removed (ENODEV): nothing in it
        return []
    return [int(pid) for pid in b"".join(chunks).split()]


def _pids(cgroup: Path) -> list[int]:
    """The processes in ``cgroup`` and in any cgroup under it (a job that
    runs as the worker's user could make some)."""
    found: list[int] = []
    for top, _dirs, _files in os.walk(cgroup):
        found.extend(_pids_here(Path(top)))
    return found


def _populated(cgroup: Path) -> bool:
    try:
        return b"populated 1" in _read(f"{cgroup}/cgroup.events")
    except OSError:  # gone, or being removed
        return False


def _wait_empty(cgroup: Path, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``cgroup`` to hold no process; whether it
    does. A change of ``cgroup.events`` wakes a poll: nothing is polled on a
    timer."""
    try:
        fd = os.open(cgroup / "cgroup.events", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # gone, or being removed
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if b"populated 0" in os.pread(fd, 4096, 0):
                    return True
            except OSError:  # removed meanwhile: empty, then
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            poller.poll(remaining * 1000 + 1)
    finally:
        os.close(fd)


def _wait_left(cgroup: Path, pids: set[int], timeout: float) -> bool:
    """Wait up to ``timeout`` s for processes ``pids`` to leave ``cgroup``
    (their exit changes ``cgroup.events`` only once the last one left)."""
    deadline = time.monotonic() + timeout
    while pids & set(_pids_here(cgroup)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)  # polled with a deadline: a warden exits within milliseconds
    return True


def _remove(cgroup: Path, *, quiet: bool = False) -> None:
    """Remove an empty cgroup and the empty ones under it. ``quiet``: one
    still in use (by a warden at work) is for it to remove."""
    for top, _dirs, _files in os.walk(cgroup, topdown=False):
        try:
            os.rmdir(top)
        except (FileNotFoundError, ProcessLookupError):
            pass  # removed meanwhile (by the warden, or the worker)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                continue  # being removed by another
            if not quiet:
                log.warning("cannot remove cgroup %s: %s", top, exc.strerror)
            return


def _own_cgroup() -> tuple[str, str | None]:
    """This process's cgroup v2 path, and its v1 memory one (if any)."""
    unified, memory = "", None
    with open("/proc/self/cgroup") as file:
        for line in file:
            number, controllers, path = line.rstrip("\n").split(":", 2)
            if number == "0" and not controllers:
                unified = path
            elif "memory" in controllers.split(","):
                memory = path
    if not unified:
        raise Unavailable("this process is in no cgroup v2 hierarchy")
    return unified, memory


def _mount_of(fstype: str, path: str, option: str | None = None) -> Path | None:
    """The directory of cgroup ``path`` where its hierarchy (of ``fstype``,
    with super option ``option``) is mounted; None if it is not."""
    with open("/proc/self/mountinfo") as file:
        for line in file:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) < 5 or len(rest) < 3 or rest[0] != fstype:
                continue
            if option is not None and option not in rest[2].split(","):
                continue
            root, point = fields[3], fields[4]
            if root == "/":
                inside = path
            elif path == root or path.startswith(root + "/"):
                inside = path[len(root) :]
            else:
                continue
            return Path(point + inside.rstrip("/")) if inside.strip("/") else Path(point)
    return None


def _v1_memory(name: str) -> Path | None:
    """A cgroup of v1's memory controller for the tasks' peak memory, where
    v2 has none and the worker may make one; None if not."""
    try:
        _, path = _own_cgroup()
        base = None if path is None else _mount_of("cgroup", path, "memory")
        if base is None:
            return None
        _sweep_stale(base, path or "", v1=True)
        root = base / name
        root.mkdir()
    except (OSError, Unavailable, ValueError):
        return None
    return root


def _owner_alive(name: str) -> bool | None:
    """Whether the worker process a ``gpulayer-<pid>-<start>[-<n>]`` cgroup
    is named for still runs; None if the name is not one of ours."""
    try:
        _, pid, start, *again = name.split("-")
        if len(again) > 1 or (again and not again[0].isdigit()):
            return None
        started = int(start)
        return proc_stat(int(pid)).start == started
    except ValueError:
        return None
    except (FileNotFoundError, ProcessLookupError):
        return False


def _sweep_stale(base: Path, hierarchy: str, *, v1: bool = False) -> None:
    """Remove what dead worker processes left in ``base`` (cgroup
    ``hierarchy``, as ``/proc/<pid>/cgroup`` names it): their tasks'
    cgroups (ending what is still in them) and their own. One whose
    ``worker/`` still holds a process is left: its warden is at work."""
    try:
        entries = [e for e in base.iterdir() if e.name.startswith("gpulayer-") and e.is_dir()]
    except OSError:
        return
    for entry in entries:
        if _owner_alive(entry.name) is not False:
            continue
        if not v1:
            if _populated(entry / "worker"):
                continue
            for task in entry.iterdir():
                if task.is_dir() and task.name != "worker" and _populated(task):
                    log.warning("ending the processes a dead worker's task left in %s", task)
                    at = f"{hierarchy.rstrip('/')}/{entry.name}/{task.name}"
                    kill_all(task, at, has_kill=(task / "cgroup.kill").exists())
                    _wait_empty(task, KILL_WAIT_S)
        _remove(entry)
