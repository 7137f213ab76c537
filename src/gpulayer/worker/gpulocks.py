"""One worker per GPU on a machine, whoever started it.

Workers started together (one client's local workers) split the GPUs
between them. Workers started apart (two ``gpulayer worker start``, two
clients) know nothing of each other, so each takes a machine-wide claim on
the GPUs it offers: an exclusive ``flock`` on a file per GPU, named by its
UUID, in a directory every user can write (``GPULAYER_GPU_LOCKS``, else
``gpulayer-gpu-locks`` in the system's temporary directory). The kernel
drops a claim when its holder exits, however it ends, so a killed worker
never leaves a GPU claimed. The holder writes its pid in the file, for the
message of a worker refused the GPU.

Only the worker holds its claims: the descriptors are not inherited, so a
task that outlives its worker does not keep them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ..errors import WorkerError
from .gpus import Gpu

ENV = "GPULAYER_GPU_LOCKS"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def lock_dir() -> Path:
    configured = os.environ.get(ENV)
    if configured:
        return Path(configured)
    import tempfile  # here: only a worker that offers GPUs needs it

    return Path(tempfile.gettempdir()) / "gpulayer-gpu-locks"


def _key(gpu: Gpu) -> str:
    return _UNSAFE.sub("_", gpu.uuid or f"{gpu.vendor}-{gpu.index}")


def describe(gpu: Gpu) -> str:
    return f"{gpu.vendor} GPU {gpu.index}"


class GpuClaim:
    """Claims on some GPUs, held until :meth:`release` (or the process ends)."""

    def __init__(self) -> None:
        self.gpus: list[Gpu] = []
        self._fds: list[int] = []

    def _take(self, gpu: Gpu, directory: Path) -> str | None:
        """Claim ``gpu``; None once claimed, else who holds it."""
        path = directory / f"{_key(gpu)}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except PermissionError:  # another user's file: a lock needs no write access
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            return f"pid {holder}" if holder.isdigit() else "another process"
        with contextlib.suppress(OSError):  # only a message needs it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fds.append(fd)
        self.gpus.append(gpu)
        return None

    def release(self) -> None:
        fds, self._fds, self.gpus = self._fds, [], []
        for fd in fds:
            os.close(fd)  # the lock goes with the last descriptor of its file

    def __del__(self) -> None:
        self.release()


def _directory() -> Path:
    directory = lock_dir()
    try:
        directory.mkdir(mode=0o777, exist_ok=True)
        if directory.stat().st_uid == os.getuid():
            # Every user's workers claim GPUs here; sticky, as /tmp is.
            os.chmod(directory, 0o1777)
    except OSError as exc:
        raise WorkerError(
            f"cannot use {directory} for GPU claims ({exc.strerror or exc}); "
            f"set {ENV} to a directory every worker on this machine can write"
        ) from None
    return directory


def claim_gpus(gpus: Sequence[Gpu]) -> GpuClaim:
    """Claim every one of ``gpus``, or none: WorkerError names those that
    other workers hold, and by whom."""
    claim = GpuClaim()
    if not gpus:
        return claim
    directory = _directory()
    taken = []
    try:
        for gpu in gpus:
            holder = claim._take(gpu, directory)
            if holder is not None:
                taken.append(f"{describe(gpu)} ({holder})")
    except BaseException:
        claim.release()
        raise
    if taken:
        claim.release()
        raise WorkerError(
            f"another GPUlayer worker on this machine offers {', '.join(taken)}; "
            "a GPU is offered by one worker at a time"
        )
    return claim


def unclaimed(gpus: Sequence[Gpu]) -> tuple[list[Gpu], list[str]]:
    """Those of ``gpus`` no worker claims now, and a description of each of
    the others (which GPU, and who holds it). A GPU may be claimed right
    after: :func:`claim_gpus` is the check that counts."""
    if not gpus:
        return [], []
    directory = _directory()
    free, taken = [], []
    for gpu in gpus:
        probe = GpuClaim()
        holder = probe._take(gpu, directory)
        probe.release()
        if holder is None:
            free.append(gpu)
        else:
            taken.append(f"{describe(gpu)} ({holder})")
    return free, taken
