"""One worker per GPU on a machine, whoever started it.

Workers started together (one client's local workers) split the GPUs
between them. Workers started apart (two ``gpulayer worker start``, two
clients) know nothing of each other, so each takes a machine-wide claim on
the GPUs it offers: an exclusive ``flock`` on a file per GPU (``nvidia-0.lock``)
in a directory every user can write: ``GPULAYER_GPU_LOCKS``, else
``gpulayer-gpu-locks`` in the system's temporary directory. The kernel drops
a claim when its holder exits, however it ends, so a killed worker never
leaves a GPU claimed. Who holds a claim is read from ``/proc/locks``.

The directory may be shared with other users, so nothing here follows a
symbolic link, opens anything but a regular file, or writes to a file: a
name another user planted can make a claim fail, never clobber a file.
Only the worker holds its claims: the descriptors are closed on exec and in
a child forked without exec, so a task, or a pool the user forks, does not
keep them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from ..errors import WorkerError
from .gpus import Gpu

ENV = "GPULAYER_GPU_LOCKS"
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link; a FIFO cannot block
_HELD: set[int] = set()  # every claim's descriptor in this process


def _forget_in_child() -> None:
    """A child forked without exec does not hold its parent's claims: its
    copies of their descriptors are closed (which leaves the parent's lock)."""
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def lock_dir() -> Path:
    configured = os.environ.get(ENV)
    if configured:
        return Path(configured)
    import tempfile  # here: only a worker that offers GPUs needs it

    return Path(tempfile.gettempdir()) / "gpulayer-gpu-locks"


def _name(gpu: Gpu) -> str:
    # Vendor and index, as every detection tool numbers them; not the UUID,
    # which one tool reports and another (rocm-smi) does not.
    return f"{gpu.vendor}-{gpu.index}.lock"


def describe(gpu: Gpu) -> str:
    return f"{gpu.vendor} GPU {gpu.index}"


def _refuse(directory: Path, why: str) -> WorkerError:
    return WorkerError(
        f"cannot keep GPU claims in {directory}: {why}; set {ENV} to a directory "
        "that every worker on this machine can write and no other user owns"
    )


class _Directory:
    """The claims' directory, opened without following a link, and checked:
    ours or root's, or sticky (as ``/tmp``), so no other user can swap our
    files."""

    def __init__(self) -> None:
        self.path = path = lock_dir()
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)  # opened up below, once known to be ours
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _refuse(path, exc.strerror or str(exc)) from None
        try:
            st = os.fstat(self.fd)
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o1777:
                os.fchmod(self.fd, 0o1777)  # every user's workers claim GPUs here
            elif st.st_uid not in (0, os.getuid()) and not st.st_mode & stat.S_ISVTX:
                raise _refuse(path, f"it belongs to user {st.st_uid} and is not sticky")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        os.close(self.fd)

    def open(self, gpu: Gpu) -> int:
        """A descriptor of ``gpu``'s lock file, made if missing."""
        name = _name(gpu)
        # Read-only: a lock needs no more, and nothing here writes.
        try:
            try:
                fd = os.open(
                    name, os.O_RDONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o644, dir_fd=self.fd
                )
                made = True
            except FileExistsError:
                fd, made = os.open(name, os.O_RDONLY | _OPEN, dir_fd=self.fd), False
        except OSError as exc:
            reason = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
            raise _refuse(self.path, f"{name}: {reason or exc}") from None
        if made:
            # Whatever the umask: others must open it too. Only a file made
            # just now: an old one may be a hard link to a private file.
            os.fchmod(fd, 0o644)
        elif not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _refuse(self.path, f"{name} is not a regular file")
        return fd

    def same_file(self, gpu: Gpu, fd: int) -> bool:
        """Whether ``gpu``'s name still leads to ``fd`` (not deleted or replaced
        since it was opened): a lock on a file no longer there claims nothing."""
        try:
            named = os.stat(_name(gpu), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    def holder(self, gpu: Gpu) -> str | None:
        """Who holds ``gpu``'s claim, as ``pid N``; None if no one does (its
        file is missing, or not locked). ``another process`` where
        ``/proc/locks`` does not say."""
        try:
            st = os.stat(_name(gpu), dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        try:
            with open("/proc/locks", encoding="ascii", errors="replace") as locks:
                table = locks.read()
        except OSError:  # no /proc/locks here: a look with a shared lock tells
            fd = self.open(gpu)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return "another process"
            finally:
                os.close(fd)
            return None
        inode = f":{st.st_ino}"
        for line in table.splitlines():
            # "1: FLOCK  ADVISORY  WRITE 12464 fe:00:2679792 0 EOF". By inode
            # alone: on overlayfs the device differs from the one stat shows.
            parts = line.split()
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[-3].endswith(inode):
                return f"pid {parts[-4]}"
        return None


class GpuClaim:
    """Claims on some GPUs, held until :meth:`release` (or the process ends)."""

    def __init__(self) -> None:
        self.gpus: list[Gpu] = []
        self.taken: list[str] = []  # those it could not claim, and who holds them
        self._fds: list[int] = []

    def _take(self, gpu: Gpu, directory: _Directory) -> str | None:
        """Claim ``gpu``; None once claimed, else who holds it."""
        for _ in range(3):  # its file replaced meanwhile: once more
            fd = directory.open(gpu)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise _refuse(directory.path, f"{_name(gpu)}: {exc.strerror}") from None
                return directory.holder(gpu) or "another process"
            if directory.same_file(gpu, fd):
                self._fds.append(fd)
                _HELD.add(fd)
                self.gpus.append(gpu)
                return None
            os.close(fd)
        raise _refuse(directory.path, f"{_name(gpu)} keeps being replaced")

    def release(self) -> None:
        fds, self._fds, self.gpus = self._fds, [], []
        for fd in fds:
            _HELD.discard(fd)
            os.close(fd)  # the lock goes with the last descriptor of its file

    def __del__(self) -> None:
        self.release()


def claim_gpus(gpus: Sequence[Gpu], *, all_of_them: bool = True) -> GpuClaim:
    """Claim ``gpus``: every one of them, or none (WorkerError naming those
    that other workers hold, and by whom); or, not ``all_of_them``, those
    no one holds, in one pass (WorkerError only if that is none of them)."""
    claim = GpuClaim()
    if not gpus:
        return claim
    directory = _Directory()
    taken = []
    try:
        for gpu in gpus:
            holder = claim._take(gpu, directory)
            if holder is not None:
                taken.append(f"{describe(gpu)} ({holder})")
    except BaseException:
        claim.release()
        raise
    finally:
        directory.close()
    if taken and (all_of_them or not claim.gpus):
        claim.release()
        if all_of_them:
            raise WorkerError(
                f"another GPUlayer worker on this machine offers {', '.join(taken)}; "
                "a GPU is offered by one worker at a time"
            )
        raise WorkerError(
            "another GPUlayer worker on this machine offers every GPU this one would: "
            f"{', '.join(taken)}; --gpus none makes a worker of CPU slots"
        )
    claim.taken = taken
    return claim


def unclaimed(gpus: Sequence[Gpu]) -> list[Gpu]:
    """Those of ``gpus`` that no worker claims now, read from ``/proc/locks``
    without taking any lock (a look never makes a claim fail). A GPU may be
    claimed right after: :func:`claim_gpus` is the check that counts."""
    if not gpus:
        return []
    directory = _Directory()
    try:
        return [g for g in gpus if directory.holder(g) is None]
    finally:
        directory.close()
