"""A task's directory: its bundle and inputs laid out, its outputs collected.

::

    <task dir>/
      workspace/          the job's working directory: the bundle's files,
                          plus a symlink per input
      inputs/<name>       each input, as a file or a directory tree

Blobs come through the transport into the worker's cache; a cache hit copies
no bytes over the network, and large files are linked or cloned rather than
copied (see ``bundle.LINK_MIN_BYTES``).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from .. import bundle
from ..artifacts import ArtifactStore
from ..jobs import RunTask
from ..spec import ArtifactRef
from ..transport import Transport


@dataclass(frozen=True)
class Workspace:
    cwd: Path
    env: dict[str, str]


def prepare(task: RunTask, task_dir: Path, transport: Transport, cache: ArtifactStore) -> Workspace:
    """Lay out ``task_dir``, made by :func:`make_spare`, for ``task``."""
    spec = task.spec
    cwd = task_dir / "workspace"

    def blob(digest: str) -> Path:
        return transport.download_blob(digest, cache)

    if spec.bundle is not None:
        blob(spec.bundle)
        bundle.materialize(bundle.load(cache, spec.bundle), cwd, blob)
    env = {"GPULAYER_WORKSPACE": str(cwd)}
    if spec.inputs:
        inputs = task_dir / "inputs"
        inputs.mkdir()
        env["GPULAYER_INPUTS"] = str(inputs)
        for name, ref in spec.inputs.items():
            target = inputs / name
            blob(ref.digest)
            if ref.kind == "file":
                # Linked read-only from the cache: inputs are data, and a job
                # must write new files rather than edit an input in place.
                cache.materialize(ref.digest, target)
            else:
                bundle.materialize(bundle.load(cache, ref.digest), target, blob)
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


def collect_outputs(
    patterns: list[str], cwd: Path, transport: Transport
) -> tuple[dict[str, ArtifactRef], list[str]]:
    """Store each declared output (a file, a directory, or a glob of them)."""
    found: dict[str, ArtifactRef] = {}
    missing: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, root_dir=cwd, recursive=True))
        else:
            matches = [pattern] if os.path.lexists(cwd / pattern) else []
        if not matches:
            missing.append(pattern)
        for rel in matches:
            path = cwd / rel
            if path.is_dir():
                manifest = bundle.scan(path)
                for e in manifest.entries:
                    if e.kind == "file" and e.digest and transport.missing_blobs([e.digest]):
                        transport.upload_blob(path / e.path, e.digest)
                digest = transport.upload_bytes(msgspec.json.encode(manifest))
                found[rel] = ArtifactRef(kind="dir", digest=digest, size=manifest.total_size)
            elif path.is_file():
                size = path.stat().st_size
                found[rel] = ArtifactRef(kind="file", digest=transport.upload_blob(path), size=size)
            else:
                missing.append(rel)
    return found, missing
