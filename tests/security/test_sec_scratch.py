"""Scratch under --run-as (found by review): a big snapshot laid out for the
next attempt is the job's to overwrite, and the cache's blob stays as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpulayer import bundle
from gpulayer.artifacts import ArtifactStore
from gpulayer.jobs import RunTask
from gpulayer.spec import ArtifactRef, parse_spec
from gpulayer.worker.process import RunAs
from gpulayer.worker.workspace import SCRATCH, make_spare, prepare

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (run as nobody)")


class _Cache:
    def download_blob(self, digest: str, cache: ArtifactStore) -> Path:
        return cache.path(digest)


def test_a_job_run_as_another_user_can_overwrite_its_big_snapshot_in_scratch(
    tmp_path: Path,
) -> None:
    cache = ArtifactStore(tmp_path / "cache")
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "ckpt.pt").write_bytes(os.urandom(2 << 20))  # a 2 MiB checkpoint
    ref = ArtifactRef(kind="dir", digest=bundle.store(kept, bundle.scan(kept), cache))
    task = RunTask(
        job_id="j",
        attempt=2,
        spec=parse_spec({"command": ["x"], "max_retries": 1}),
        scratch=ref,
        slots=[0],
        gpus=[],
    )
    task_dir = make_spare(tmp_path / "task")
    os.chmod(tmp_path, 0o755)
    os.chmod(task_dir, 0o755)
    prepare(task, task_dir, _Cache(), cache, link_blobs=True)  # as TaskRun does under --run-as
    nobody = RunAs.lookup("nobody")
    nobody.give(task_dir / SCRATCH)
    ckpt = task_dir / SCRATCH / "ckpt.pt"
    for parent in tmp_path.parents:  # pytest's folders are 0700: let nobody reach it
        if str(parent).startswith("/tmp/pytest-of"):
            os.chmod(parent, 0o755)
    control = (
        "import os; os.setgid(65534); os.setgroups([]); os.setuid(65534);"
        f"open({str(ckpt.parent / 'new')!r}, 'wb').write(b'x')"
    )
    assert subprocess.run([sys.executable, "-c", control]).returncode == 0  # scratch is its own
    # The job saves its next snapshot over the last one, as torch.save does.
    code = (
        "import os, sys; os.setgid(65534); os.setgroups([]); os.setuid(65534);"
        f"open({str(ckpt)!r}, 'wb').write(b'new')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1]
    # And the worker's cached blob is unchanged either way.
    assert cache.path(ref.digest).exists()
