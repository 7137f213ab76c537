"""A task's directory: its bundle and inputs laid out (its outputs are
collected by ``collect.py``).

::

    <task dir>/
      workspace/          the job's working directory: the bundle's files,
                          plus a symlink per input
      inputs/<name>       each input, as a file or a directory tree

Blobs come through the transport into the worker's cache; a cache hit copies
no bytes over the network. Every file the job gets is its own (a copy, or a
clone where the filesystem can): a job that edits one in place never changes
a cached blob another job will read. Hard links to the blobs are only for a
job that cannot write them (run as another Unix user; see ``link_blobs``).

"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import bundle
from ..artifacts import ArtifactStore
from ..jobs import RunTask
from ..transport import Transport


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
    env = {"GPULAYER_WORKSPACE": str(cwd)}
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
    return task_dir


def reuse_if_empty(task_dir: Path) -> Path | None:
    """``task_dir`` again when its task left it as it was made (nothing written)."""
    try:
        if os.listdir(task_dir) == ["workspace"] and not os.listdir(task_dir / "workspace"):
            return task_dir
    except OSError:
        pass
    return None
