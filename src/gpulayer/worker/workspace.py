"""A task's directory: its bundle and inputs laid out (its outputs are
collected by ``collect.py``).

::

    <task dir>/
      workspace/          the job's working directory: the bundle's files,
                          plus a symlink per input
      inputs/<name>       each input, as a file or a directory tree
      scratch/            $GPULAYER_SCRATCH: what the job's last attempt
                          left there (see ``SCRATCH``), kept for its next

Blobs come through the transport into the worker's cache; a cache hit copies
no bytes over the network. Every file the job gets is its own (a copy, or a
clone where the filesystem can): a job that edits one in place never changes
a cached blob another job will read. Hard links to the blobs are only for a
job that cannot write them (run as another Unix user; see ``link_blobs``).

"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .. import bundle
from ..artifacts import ArtifactStore
from ..errors import GPUlayerError, ServerUnreachable
from ..jobs import RunTask
from ..transport import Transport

# The task folder's scratch folder, $GPULAYER_SCRATCH. What node 0's task
# leaves there when its attempt does not succeed is stored (as an output
# is) and laid out in the next attempt's, on whichever worker that runs:
# a snapshot written there survives a retry, a preemption, a lost worker's
# replacement (the last stored one: a worker that vanished stored nothing).
SCRATCH = "scratch"


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Workspace:
    cwd: Path
    env: dict[str, str]


def prepare(
    task: RunTask,
    task_dir: Path,
    transport: Transport,
    cache: ArtifactStore,
    *,
    link_blobs: bool = False,
) -> Workspace:
    """Lay out ``task_dir``, made by :func:`make_spare`, for ``task``.

    ``link_blobs``: the job's Unix user cannot write the cache's blobs (it
    runs as another user than the worker's), so files of 1 MiB and more may
    be hard links to them where no clone is possible, instead of copies.
    """
    spec = task.spec
    cwd = task_dir / "workspace"

    def blob(digest: str) -> Path:
        return transport.download_blob(digest, cache)

    if spec.bundle is not None:
        blob(spec.bundle)
        bundle.materialize(bundle.load(cache, spec.bundle), cwd, blob, link_blobs=link_blobs)
    scratch = task_dir / SCRATCH
    if task.scratch is not None:
        try:
            blob(task.scratch.digest)
            manifest = bundle.load(cache, task.scratch.digest)
            # Copies (or clones), never links to the cache: the job rewrites
            # its snapshots in place, even run as another user.
            bundle.materialize(manifest, scratch, blob)
        except ServerUnreachable:
            raise  # (as for its bundle: the task fails to start, and says why)
        except GPUlayerError as exc:
            # The attempt runs, from an empty scratch folder, as its first did:
            # what the last one kept is lost, which a job that snapshots
            # must survive anyway (a worker that vanished kept nothing).
            log.warning("task %s: its scratch folder could not be laid out: %s", task.job_id, exc)
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir()
    env = {"GPULAYER_WORKSPACE": str(cwd), "GPULAYER_SCRATCH": str(scratch)}
    if spec.inputs:
        inputs = task_dir / "inputs"
        inputs.mkdir()
        # Whatever the worker's umask: a job run as another user (--run-as) must
        # reach its inputs, and no one may add to them.
        inputs.chmod(0o755)
        env["GPULAYER_INPUTS"] = str(inputs)
        for name, ref in spec.inputs.items():
            target = inputs / name
            blob(ref.digest)
            if ref.kind == "file":
                # Read-only: inputs are data (a job writes new files). The
                # mode is a hint, not a guard: the file is the job's own.
                cache.materialize(ref.digest, target, link=link_blobs)
            else:
                manifest = bundle.load(cache, ref.digest)
                bundle.materialize(manifest, target, blob, link_blobs=link_blobs)
            link = cwd / name
            if not os.path.lexists(link):  # a bundle file of that name wins
                link.symlink_to(target)
    return Workspace(cwd=cwd, env=env)


def make_spare(task_dir: Path) -> Path:
    """An empty task directory, made before it is needed.

    Creating directories costs a tenth of a millisecond or more on some
    filesystems; a worker keeps one ready per slot so a task's start does not
    wait for it.
    """
    (task_dir / "workspace").mkdir(parents=True)
    (task_dir / SCRATCH).mkdir()
    return task_dir


def reuse_if_empty(task_dir: Path) -> Path | None:
    """``task_dir`` again when its task left it as it was made (nothing written)."""
    try:
        if (
            sorted(os.listdir(task_dir)) == [SCRATCH, "workspace"]
            and not os.listdir(task_dir / "workspace")
            and not os.listdir(task_dir / SCRATCH)
        ):
            return task_dir
    except OSError:
        pass
    return None


class Remover:
    """Deletes finished task folders off the supervising thread, one at a
    time, on one thread made when there is work and ended when there is none.

    A big workspace takes seconds to delete; the thread that supervised its
    task goes on to the next one at once. :meth:`wait` returns when every
    folder handed over is gone (a worker that stops, and tests that count
    descriptors, wait for it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._queue: deque[Path] = deque()
        self._running = False
        self._thread: threading.Thread | None = None

    def remove(self, folder: Path) -> None:
        with self._lock:
            self._queue.append(folder)
            if self._running:
                return
            self._running = True
            self._thread = threading.Thread(target=self._run, name="gpulayer-remover", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """True when nothing handed over is left to delete, and the thread
        that deleted it has ended."""
        with self._lock:
            if not self._done.wait_for(lambda: not self._running, timeout):
                return False
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    self._done.notify_all()
                    return
                folder = self._queue.popleft()
            shutil.rmtree(folder, ignore_errors=True)
