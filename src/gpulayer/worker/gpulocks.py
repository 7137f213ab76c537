"""One worker per GPU on a machine, whoever started it.

Workers started together (one client's local workers) split the GPUs
between them. Workers started apart (two ``gpulayer worker start``, two
clients) know nothing of each other, so each takes a machine-wide claim on
the GPUs it offers: an exclusive ``flock`` on a file per GPU (``nvidia-0.lock``)
in one directory: ``GPULAYER_GPU_LOCKS``, else ``gpulayer-gpu-locks`` in the
system's temporary directory. The kernel drops a claim when its holder
exits, however it ends, so a killed worker never leaves a GPU claimed.

A look (:func:`unclaimed`) makes nothing, and takes a shared lock on each
existing file for an instant; a claim that meets only shared locks tries
again for up to a second, so a look never makes a claim fail. Who holds a
claim is read from ``/proc/locks``, for messages only: that table may not
show a holder (one in another PID namespace).

Claims coordinate GPUlayer workers; they are no barrier against another
user, who may delete a lock file in a shared directory. What they must
never do is harm a file: other users may write to the directory, so
nothing here follows a symbolic link, opens anything but a regular file,
writes to a file, or changes the mode of a file it did not just make. Only
the worker holds its claims: the descriptors are closed on exec and in a
child forked without exec.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import WorkerError
from .gpus import Gpu

ENV = "GPULAYER_GPU_LOCKS"
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO cannot block
_HELD: set[int] = set()  # every claim's descriptor in this process
# A claim that finds its GPU's file locked shared (by looks, which let go
# within microseconds, unless descheduled) tries again, this far apart, for
# this long; a claim that finds it locked exclusive has lost it to a worker.
_TRY_GAP_S, _TRY_FOR_S = 0.002, 1.0


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
        "that root or the worker's user owns (see docs/scheduling.md#gpu-claims-across-a-machine)"
    )


class _Directory:
    """The claims' directory, opened without following a link: one that root
    or this user owns, or a sticky one (as ``/tmp``: no user but its owner
    deletes another's files there). Made if missing, unless only to look."""

    def __init__(self, *, make: bool = True) -> None:
        self.path = path = lock_dir()
        try:
            made = False
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
                    made = True
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            reason = {errno.ELOOP: "it is a symbolic link", errno.ENOTDIR: "it is not a directory"}
            raise _refuse(path, reason.get(exc.errno or 0, exc.strerror or str(exc))) from None
        try:
            st = os.fstat(self.fd)
            sticky = bool(st.st_mode & stat.S_ISVTX)
            if made and st.st_uid == os.getuid():
                os.fchmod(self.fd, 0o1777)  # every user's workers claim GPUs here, as in /tmp
            elif st.st_uid not in (0, os.getuid()) and not sticky:
                raise _refuse(path, f"it belongs to another user ({st.st_uid}) and is not sticky")
            elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
                raise _refuse(path, "others may write to it and it is not sticky")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        os.close(self.fd)

    def open(self, gpu: Gpu, *, make: bool = True) -> int | None:
        """A descriptor of ``gpu``'s lock file (read-only: a lock needs no
        more), made if missing; None if missing and not ``make``."""
        name = _name(gpu)
        try:
            try:
                if not make:
                    raise FileExistsError
                fd = os.open(name, _OPEN | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=self.fd)
                made = True
            except FileExistsError:
                fd, made = os.open(name, _OPEN, dir_fd=self.fd), False
        except FileNotFoundError:
            if make:
                raise _refuse(self.path, f"{name} vanished as it was made") from None
            return None
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

    def holder(self, fd: int, kind: str = "WRITE") -> str:
        """Who holds the lock on ``fd``'s file (a claim, WRITE; a look, READ),
        for a message: ``pid N``, or ``another process`` where
        ``/proc/locks`` does not say."""
        st = os.fstat(fd)
        wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with (
            contextlib.suppress(OSError),
            open("/proc/locks", encoding="ascii", errors="replace") as locks,
        ):
            for line in locks:
                # "1: FLOCK  ADVISORY  WRITE 12464 fe:00:2679792 0 EOF" (a
                # claim; a look's lock is READ)
                parts = line.split()
                if len(parts) >= 6 and parts[1:4:2] == ["FLOCK", kind] and parts[-3] == wanted:
                    return f"pid {parts[-4]}"
        return "another process"


def _locked(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class GpuClaim:
    """Claims on some GPUs, held until :meth:`release` (or the process ends)."""

    def __init__(self) -> None:
        self.gpus: list[Gpu] = []
        self.taken: list[str] = []  # those it could not claim, and who holds them
        self._fds: list[int] = []
        self._pid = os.getpid()

    def _take(self, gpu: Gpu, directory: _Directory) -> tuple[bool, str] | None:
        """Claim ``gpu``. None once claimed; else whether looks (not a
        worker) held it all the while, and who: ``pid N``."""
        give_up = time.monotonic() + _TRY_FOR_S
        while True:
            fd = directory.open(gpu)
            assert fd is not None
            late = time.monotonic() > give_up
            if _locked(fd, fcntl.LOCK_EX):
                if directory.same_file(gpu, fd):
                    self._fds.append(fd)
                    _HELD.add(fd)
                    self.gpus.append(gpu)
                    return None
                os.close(fd)  # deleted or replaced since it was opened: once more
                if late:
                    raise _refuse(directory.path, f"{_name(gpu)} keeps being replaced")
            elif not _locked(fd, fcntl.LOCK_SH):
                holder = directory.holder(fd)  # a worker's claim
                os.close(fd)
                return False, holder
            elif late:  # looks held it all along: one stopped half-way, say
                fcntl.flock(fd, fcntl.LOCK_UN)  # not this one's own shared lock
                looker = directory.holder(fd, "READ")
                os.close(fd)
                return True, looker
            else:
                os.close(fd)  # only looks hold it; this lets go of the shared lock just taken
            time.sleep(_TRY_GAP_S)

    def release(self) -> None:
        fds, self._fds, self.gpus = self._fds, [], []
        if os.getpid() != self._pid:
            return  # a forked child's copies are closed already (see _forget_in_child)
        for fd in fds:
            _HELD.discard(fd)
            os.close(fd)  # the lock goes with the last descriptor of its file

    def __del__(self) -> None:
        self.release()


def claim_gpus(gpus: Sequence[Gpu], *, all_of_them: bool = True) -> GpuClaim:
    """Claim ``gpus``: every one of them, or none (WorkerError naming those
    that other workers hold, and by whom); or, not ``all_of_them``, those
    it can, in one pass (WorkerError only if that is none of them; the
    others, and why, in ``taken``)."""
    claim = GpuClaim()
    if not gpus:
        return claim
    directory = _Directory()
    held: list[tuple[Gpu, bool, str]] = []  # (GPU, looks held it, who)
    try:
        for gpu in gpus:
            refused = claim._take(gpu, directory)
            if refused is not None:
                held.append((gpu, *refused))
    except BaseException:
        claim.release()
        raise
    finally:
        directory.close()
    workers = [f"{describe(g)} ({who})" for g, looks, who in held if not looks]
    looked = [f"{describe(g)} ({who})" for g, looks, who in held if looks]
    reasons = []
    if workers:
        reasons.append(f"another GPUlayer worker on this machine offers {', '.join(workers)}")
    if looked:  # one stopped half-way through its look, say
        reasons.append(
            f"processes looking at the claims held the lock file of {', '.join(looked)} "
            f"for over {_TRY_FOR_S:g} s; try again"
        )
    if held and all_of_them:
        claim.release()
        tail = "" if looked else "; a GPU is offered by one worker at a time"
        raise WorkerError("; ".join(reasons) + tail)
    if held and not claim.gpus:
        why = "; ".join(reasons)
        if not looked:
            why = f"another GPUlayer worker on this machine offers every GPU this one would: {', '.join(workers)}"
        raise WorkerError(f"{why}; --gpus none makes a worker of CPU slots")
    claim.taken = [
        f"{describe(g)} ({who}): "
        + (
            f"looks held its lock file for over {_TRY_FOR_S:g} s"
            if looks
            else "another worker offers it"
        )
        for g, looks, who in held
    ]
    return claim


def unclaimed(gpus: Sequence[Gpu]) -> list[Gpu]:
    """Those of ``gpus`` that no worker claims now. It makes nothing (a GPU
    without a file is unclaimed), and locks each file shared for an instant
    (a claim that meets that tries again). A GPU may be claimed right after:
    :func:`claim_gpus` is the check that counts."""
    if not gpus:
        return []
    try:
        directory = _Directory(make=False)
    except WorkerError:
        if not os.path.lexists(lock_dir()):
            return list(gpus)  # no worker ever claimed one here
        raise
    free = []
    try:
        for gpu in gpus:
            fd = directory.open(gpu, make=False)
            if fd is None:
                free.append(gpu)
                continue
            try:
                if _locked(fd, fcntl.LOCK_SH):
                    free.append(gpu)
            finally:
                os.close(fd)
    finally:
        directory.close()
    return free
