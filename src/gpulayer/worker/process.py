"""Start a task's process and end its whole tree, grandchildren included.

A task runs as the leader of its own session and process group, so one
``killpg`` reaches everything it starts. Descendants that left the group
(``setsid()``, daemons) are found through the process tree, which is why the
tree is read *before* any signal: once a parent dies its children are
reparented and no longer point back at the task.

Ending a tree: SIGTERM, a grace period, SIGKILL for whatever is left. Every
process gets exactly one SIGTERM, so a job's own shutdown handler runs once.

A job that outlives all of that (a daemon that double-forked and left its
session) is the containment's to end (``containment.py``): this module is
what the worker uses where the kernel gives no more, and where it ends what
a dead worker's ledger lists.

psutil is imported inside the functions that use it: it is not needed to
start a process, only to end one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import select
import signal
import stat
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

from ..errors import WorkerError

if TYPE_CHECKING:
    import psutil

logger = logging.getLogger(__name__)


class TaskProcess(Protocol):
    """What the worker keeps of a task's process: a ``Popen`` (a cold
    start), or a fork of a ready interpreter (``warm.WarmProcess``)."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    @property
    def returncode(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


class Starter(Protocol):
    """How a task's process is started: :func:`spawn`, or a zygote's."""

    def __call__(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[bytes, bytes],
        run_as: RunAs | None = None,
    ) -> TaskProcess: ...


_DEVNULL: int | None = None


def _devnull() -> int:
    """Every task's stdin, opened once, at the first spawn rather than at
    import (close-on-exec here; the child gets it as its fd 0)."""
    global _DEVNULL
    fd = _DEVNULL
    if fd is None:
        fd = _DEVNULL = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    return fd


# How long to wait for processes to vanish after SIGKILL. They cannot refuse;
# only one stuck in the kernel (e.g. a wedged GPU driver) takes longer.
KILL_WAIT_S = 2.0
# A task's start time is the worker's clock read just before the spawn (see
# spawn()). psutil's reading, which it is checked against, adds the process's
# start in clock ticks to the boot time in whole seconds, so it can come out
# up to a second earlier. A reused pid starts much later.
CREATE_TIME_TOLERANCE_S = 2.0


@dataclass(frozen=True)
class RunAs:
    """The Unix user a worker runs its jobs as (``--run-as``): its uid, its
    primary group and its own supplementary groups (never the worker's)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def lookup(cls, user: str) -> RunAs:
        """The user named ``user`` (or with that uid); WorkerError, in plain
        words, if the worker cannot run jobs as it."""
        if os.geteuid() != 0:
            raise WorkerError(
                f"--run-as {user}: only a worker started as root can run jobs as another "
                f"user; this one runs as uid {os.geteuid()}"
            )
        try:
            pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
        except KeyError:
            raise WorkerError(
                f"--run-as {user}: there is no such Unix user on this machine"
            ) from None
        if pw.pw_uid == 0:
            raise WorkerError(
                f"--run-as {user}: that is root, whose jobs could do anything the worker can; "
                "name an unprivileged user"
            )
        groups = tuple(os.getgrouplist(pw.pw_name, pw.pw_gid))
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)

    @classmethod
    def for_slots(cls, users: str, slots: int) -> tuple[RunAs, ...]:
        """The user of each of a worker's ``slots`` slots, from ``--run-as``:
        one user for all of them, or a comma-separated list of one per slot,
        so that jobs running at the same time never share a uid (a job can
        read the environment and files of another of its uid). WorkerError,
        naming what is wrong, if the worker cannot."""
        names = [name.strip() for name in users.split(",")]
        if not all(names):
            raise WorkerError(f"--run-as {users}: a user name is empty; separate names by commas")
        if len(names) == 1:
            return (cls.lookup(names[0]),) * slots
        if len(names) != slots:
            raise WorkerError(
                f"--run-as {users}: {len(names)} users for a worker of {slots} slots; name "
                f"one user per slot ({slots}), or a single user for all of them"
            )
        found = [cls.lookup(name) for name in names]
        seen: dict[int, str] = {}
        for name, user in zip(names, found, strict=True):
            if user.uid in seen:
                raise WorkerError(
                    f"--run-as {users}: {seen[user.uid]} and {name} are the same user "
                    f"(uid {user.uid}); each slot needs a user of its own"
                )
            seen[user.uid] = name
        return tuple(found)

    def env(self) -> dict[bytes, bytes]:
        """Who the job is, as its environment says (the worker's says root)."""
        return {
            b"HOME": os.fsencode(self.home),
            b"USER": os.fsencode(self.name),
            b"LOGNAME": os.fsencode(self.name),
        }

    def can_reach(self, path: Path) -> str | None:
        """None if the user may go down to ``path`` (each folder above it
        searchable by it); else the first folder that stops it, and its mode."""
        here = Path("/")
        for part in path.resolve().parts[1:]:
            st = os.stat(here)
            if st.st_uid == self.uid:
                bit = stat.S_IXUSR
            elif st.st_gid in self.groups:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not st.st_mode & bit:
                return f"{here} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid})"
            here = here / part
        return None

    def give(self, workspace: Path, *folders: Path, inputs: Path | None = None) -> None:
        """Make a task's workspace the user's, once laid out, so the job can
        write there; and new ``folders`` for it (torchrun's logs). Not the
        task's folder, whose entries the worker reads and removes later, nor
        what is linked from the worker's cache (a file with more than one
        link): those stay the worker's, the blobs read-only to the job.

        ``inputs`` (the task's inputs folder, the worker's) becomes the
        user's alone to go through (0500): the job of another slot's user,
        which can learn its path (from a command line in ``ps``), cannot."""
        if inputs is not None:
            os.chown(inputs, self.uid, self.gid, follow_symlinks=False)
            os.chmod(inputs, 0o500, follow_symlinks=False)
        for folder in folders:
            folder.mkdir()
            os.chown(folder, self.uid, self.gid, follow_symlinks=False)
        for top, _dirs, files in os.walk(workspace):
            os.chown(top, self.uid, self.gid, follow_symlinks=False)
            for name in files:
                path = os.path.join(top, name)
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                    os.chown(path, self.uid, self.gid, follow_symlinks=False)


def spawn(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str] | Mapping[bytes, bytes],
    run_as: RunAs | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new session and process group.

    stdin is ``/dev/null``; stdout and stderr are pipes for the caller to
    drain, as unbuffered ``proc.stdout`` and ``proc.stderr``. No
    ``preexec_fn``: it would cost CPython its fast ``vfork()`` path;
    ``start_new_session`` does not. The pipes are made here and ``/dev/null``
    is opened once, not by ``Popen`` for each task: a sixth of its cost.

    Its start time, for telling it from a later process on the same pid, is
    ``time.time()`` read just before this call (for each process: ranks of a
    node start one after another). Reading ``/proc/<pid>/stat``
    instead blocks until the child has finished loading its program: about
    3 ms of the launching thread and 0.1 ms of its CPU per task, measured.

    ``run_as``: the process is that user's. CPython then forks rather than
    vforks (it must change ids between the two): about 1 ms more of the
    launching thread per task, measured with a worker's memory.
    """
    fds: list[int] = []
    try:
        fds.extend(os.pipe())
        fds.extend(os.pipe())
        out_read, out_write, err_read, err_write = fds
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=env,
            stdin=_devnull(),
            stdout=out_write,
            stderr=err_write,
            start_new_session=True,
            close_fds=True,
            user=None if run_as is None else run_as.uid,
            group=None if run_as is None else run_as.gid,
            extra_groups=None if run_as is None else list(run_as.groups),
        )
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    os.close(out_write)
    os.close(err_write)
    proc.stdout = open(out_read, "rb", buffering=0)  # noqa: SIM115 - the caller closes it
    proc.stderr = open(err_read, "rb", buffering=0)  # noqa: SIM115
    return proc


class Ends(Protocol):
    """What keeps all of a task's processes (a containment's box)."""

    def end(self, grace: float) -> None: ...


def terminate_tree(
    proc: TaskProcess | int, *, grace: float = 10.0, box: Ends | None = None
) -> None:
    """End ``proc`` and every descendant: SIGTERM, up to ``grace`` s, then SIGKILL.

    Safe on processes that already exited. A ``Popen`` is also reaped, so its
    ``returncode`` is set on return (``-SIGTERM`` or ``-SIGKILL`` unless the
    process chose its own exit status). With a bare pid the caller vouches
    that it is the process it means; :func:`kill_orphans` checks that first.
    With ``box``, the box that holds ``proc`` is what is ended: every process
    the task started, wherever it went.
    """
    popen = None if isinstance(proc, int) else proc
    if box is not None:
        box.end(grace)
    elif popen is not None:
        terminate_trees([popen], grace=grace)
        return
    else:
        assert isinstance(proc, int)
        _terminate_pid(proc, grace)
    if popen is not None:
        _reap(popen)


def terminate_trees(procs: Sequence[TaskProcess], *, grace: float, sigterm: bool = True) -> None:
    """:func:`terminate_tree` for several of our own children at once (one
    grace for all), reaping each. ``sigterm=False``: they were sent it
    already, and only get the rest of the grace, then SIGKILL."""
    import psutil

    trees: list[tuple[psutil.Process | None, int | None]] = []
    for popen in procs:
        root: psutil.Process | None = None
        if popen.returncode is None:  # once reaped, the pid may be anyone's
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(popen.pid)
        # spawn() makes the task lead a group whose id is its pid. After the
        # leader is reaped that id stays reserved while any member lives, and
        # pids are handed out cyclically, so for our own child it is still ours.
        trees.append((root, _own_group(popen.pid, root, trusted=True)))
    _terminate_all(trees, grace, sigterm=sigterm)
    for popen in procs:
        _reap(popen)


def _terminate_pid(pid: int, grace: float) -> None:
    import psutil

    root: psutil.Process | None = None
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
    # For a bare pid that is gone we cannot tell whose its group is now, and
    # leave the group alone.
    _terminate_all([(root, _own_group(pid, root, trusted=False))], grace)


def kill_orphans(pid: int, create_time: float, *, grace: float) -> bool:
    """End the tree of a task left running by a worker that died.

    ``pid`` and ``create_time`` were recorded when the task started (the
    worker's clock just before :func:`spawn`). Returns True if that very process was
    still there (a different process on a reused pid does not count) and its
    tree has now been ended; False if it was gone.
    """
    return end_orphans([(pid, create_time)], grace=grace) == 1


def end_orphans(listed: Sequence[tuple[int, float]], *, grace: float) -> int:
    """:func:`kill_orphans` for several trees at once: each gets SIGTERM
    together, then the one ``grace``, then SIGKILL; one in turn after the
    other would give the last SIGTERM only after the others' graces. How
    many were still there."""
    import psutil

    trees: list[tuple[psutil.Process, int | None]] = []
    for pid, create_time in listed:
        try:
            root = psutil.Process(pid)
            started = root.create_time()
        except psutil.NoSuchProcess:
            continue
        except psutil.AccessDenied:
            logger.warning("cannot inspect pid %d (another user's?); left alone", pid)
            continue
        if abs(started - create_time) > CREATE_TIME_TOLERANCE_S:
            logger.debug(
                "pid %d was reused (started %.3f, expected %.3f)", pid, started, create_time
            )
            continue
        trees.append((root, _own_group(pid, root, trusted=False)))
    if trees:
        _terminate_all(trees, grace)
    return len(trees)


def _own_group(pid: int, root: psutil.Process | None, *, trusted: bool) -> int | None:
    """The process group that ``pid`` leads, if it is safe to signal."""
    if root is not None:
        try:
            leads = os.getpgid(pid) == pid
        except ProcessLookupError:
            leads = trusted
    else:
        leads = trusted
    if not leads or pid == os.getpgrp():  # never the worker's own group
        return None
    return pid


def _terminate_all(
    trees: Sequence[tuple[psutil.Process | None, int | None]], grace: float, sigterm: bool = True
) -> None:
    """SIGTERM, wait up to ``grace``, SIGKILL, for several trees at once (one
    grace for all); each tree's root and group (pgid) may be gone."""
    groups = {pgid for _, pgid in trees if pgid is not None}
    roots = [root for root, _ in trees if root is not None]
    # 1. Read the trees before any signal changes them: the roots, the
    # members of their groups and sessions (orphans whose parent already left
    # included) and all their descendants, wherever they moved.
    procs = _with_descendants(roots + _group_members(groups))
    # 2. One SIGTERM each: the groups at once, then those that left them.
    if sigterm:
        signalled = {pgid for pgid in groups if _signal_group(pgid, signal.SIGTERM)}
        _signal_each(procs, signal.SIGTERM, skip_groups=signalled)
    # 3. Let them shut down.
    alive = wait_exited(procs, grace)
    # 4. SIGKILL what is left, including processes born during the grace
    # period (found again in the groups and under the survivors).
    alive = _with_descendants(alive + _group_members(groups))
    for pgid in groups:
        _signal_group(pgid, signal.SIGKILL)
    _signal_each(alive, signal.SIGKILL, skip_groups=set())
    stuck = wait_exited(alive, KILL_WAIT_S)
    if stuck:
        logger.warning("processes survived SIGKILL: %s", sorted(p.pid for p in stuck))


def _group_members(pgids: set[int]) -> list[psutil.Process]:
    """The members of these process groups, and of the sessions of the same
    ids (a task leads both; one that left its group may still be in its
    session). An id stays reserved while any member lives: not reused."""
    import psutil

    if not pgids:
        return []
    members = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) not in pgids and os.getsid(pid) not in pgids:
                continue
            proc = psutil.Process(pid)
            # The pid may have been reused between the two calls.
            if os.getpgid(pid) in pgids or os.getsid(pid) in pgids:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def _with_descendants(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    import psutil

    found: dict[int, psutil.Process] = {}
    for proc in procs:
        found[proc.pid] = proc
        try:
            children = proc.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        found.update((child.pid, child) for child in children)
    return list(found.values())


def _signal_group(pgid: int | None, sig: signal.Signals) -> bool:
    """Signal a process group; False if there is none."""
    if pgid is None:
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_each(
    procs: Iterable[psutil.Process], sig: signal.Signals, skip_groups: set[int]
) -> None:
    """Signal each process, skipping members of ``skip_groups`` (already signalled)."""
    import psutil

    for proc in procs:
        try:
            if skip_groups and os.getpgid(proc.pid) in skip_groups:
                continue
            # psutil checks the start time first, so a reused pid is left alone.
            proc.send_signal(sig)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
        except psutil.AccessDenied:
            logger.warning("not allowed to signal pid %d", proc.pid)


def wait_exited(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` s for the processes to exit; return those still running.

    A zombie counts as exited: it is no longer running, and whoever reaps it
    (its parent, or init for an orphan) may take its time. On Linux this
    blocks on pidfds; elsewhere it falls back to checking every few ms.
    """
    pidfds: dict[int, psutil.Process] = {}
    try:
        for proc in procs:
            try:
                fd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                continue
            except (AttributeError, OSError):  # not Linux, or kernel < 5.3
                return _poll_exited(procs, timeout)
            pidfds[fd] = proc
            # The pid could have been reused before pidfd_open; is_running()
            # compares start times, so the fd is known to be this process.
            if not proc.is_running():
                del pidfds[fd]
                os.close(fd)
        poller = select.poll()
        for fd in pidfds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while pidfds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for fd, _ in poller.poll(remaining * 1000):
                poller.unregister(fd)
                del pidfds[fd]
                os.close(fd)
        return list(pidfds.values())
    finally:
        for fd in pidfds:
            os.close(fd)


def _poll_exited(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        alive = [p for p in procs if _running(p)]
        remaining = deadline - time.monotonic()
        if not alive or remaining <= 0:
            return alive
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)


def _running(proc: psutil.Process) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _reap(popen: TaskProcess) -> None:
    """Collect the child's exit status (another thread may be waiting on it too)."""
    try:
        popen.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        logger.warning("pid %d did not exit after SIGKILL", popen.pid)
