"""Cache integrity: a job never changes bytes another job will read.

Bundle files and inputs of 1 MiB and more were hard links to the worker's
cached blobs, read-only but owned by the job's user: a job could ``chmod u+w``
one and edit it in place, and every later job with that digest read the
edited bytes. The attack here does exactly that to a bundled file, a file
input and a file of a folder input; the next job must read the originals,
and the cache's blobs must still hold their digests.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import gpulayer
from gpulayer import bundle, defaults
from gpulayer.artifacts import ArtifactStore, clone_file, sha256_file
from gpulayer.jobs import RunTask
from gpulayer.spec import ArtifactRef, JobSpec
from gpulayer.worker import workspace

TAMPER = """
import os
inputs = os.environ["GPULAYER_INPUTS"]
for path in ("weights.bin", os.path.join(inputs, "data"), os.path.join(inputs, "ds", "shard.bin")):
    os.chmod(path, 0o644)  # its own file: the mode stops nobody
    with open(path, "r+b") as f:
        f.write(b"TAMPERED")
    print("tampered", path)
"""

READ = """
import hashlib, json, os
inputs = os.environ["GPULAYER_INPUTS"]
paths = ("weights.bin", os.path.join(inputs, "data"), os.path.join(inputs, "ds", "shard.bin"))
print(json.dumps([hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]))
"""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_job_editing_large_files_in_place_changes_no_later_jobs_bytes(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    size = defaults.LINK_MIN_BYTES
    project = tmp_path / "project"
    project.mkdir()
    weights = os.urandom(2 * size)
    (project / "weights.bin").write_bytes(weights)
    (project / "tamper.py").write_text(TAMPER)
    (project / "read.py").write_text(READ)
    data, shard = os.urandom(3 * size), os.urandom(size)
    (tmp_path / "data.bin").write_bytes(data)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "shard.bin").write_bytes(shard)
    inputs = {"data": tmp_path / "data.bin", "ds": tmp_path / "ds"}

    attack = client.submit(str(project / "tamper.py"), inputs=inputs)
    assert attack.wait(timeout=60) == "succeeded", attack.logs()
    assert attack.logs().count("tampered ") == 3  # it did edit the files it was given
    later = client.submit(str(project / "read.py"), inputs=inputs)
    assert later.wait(timeout=60) == "succeeded", later.logs()
    assert later.info.spec.bundle == attack.info.spec.bundle  # the same blobs, from the cache
    assert json.loads(later.logs()) == [_sha(weights), _sha(data), _sha(shard)]
    store = ArtifactStore(client.home / "artifacts")
    for digest in (_sha(weights), _sha(data), _sha(shard)):
        assert sha256_file(store.path(digest)) == digest


class _CacheHit:
    def download_blob(self, digest: str, cache: ArtifactStore) -> Path:
        return cache.path(digest)


def test_prepare_links_blobs_only_when_the_job_cannot_write_them(tmp_path: Path) -> None:
    """``link_blobs`` is for a job run as another Unix user than the cache's
    owner: the only case where a hard link to a blob is safe (and free)."""
    cache = ArtifactStore(tmp_path / "cache")
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(defaults.LINK_MIN_BYTES))
    (src / "small.py").write_bytes(b"print('hi')\n")
    data = cache.put_bytes(os.urandom(defaults.LINK_MIN_BYTES))
    spec = JobSpec(
        command=["true"],
        bundle=bundle.store(src, bundle.scan(src), cache),
        inputs={"data": ArtifactRef(kind="file", digest=data, size=defaults.LINK_MIN_BYTES)},
    )
    task = RunTask(job_id="j", attempt=1, spec=spec, slots=[0], gpus=[])
    blobs = {p.stat().st_ino for p in (cache.root / "sha256").glob("*/*")}

    def shared(link_blobs: bool) -> set[str]:
        task_dir = workspace.make_spare(tmp_path / f"task-{link_blobs}")
        hit: Any = _CacheHit()  # the one call prepare() makes of its transport
        workspace.prepare(task, task_dir, hit, cache, link_blobs=link_blobs)
        files = [p for p in task_dir.rglob("*") if p.is_file() and not p.is_symlink()]
        assert len(files) == 3
        return {p.name for p in files if p.stat().st_ino in blobs}

    assert shared(False) == set()
    can_clone = clone_file(src / "small.py", tmp_path / "probe", 0o644)
    assert shared(True) == (set() if can_clone else {"big.bin", "data"})
