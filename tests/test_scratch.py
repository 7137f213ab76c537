"""$GPULAYER_SCRATCH: a job's folder that survives from one attempt to the
next (a retry, a preemption), on whichever worker the next one runs, and
only what its own worker stored."""

from __future__ import annotations

from pathlib import Path

import gpulayer
from gpulayer import bundle
from gpulayer.artifacts import ArtifactStore
from gpulayer.jobs import RunTask, TaskResult, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import ArtifactRef, parse_spec

SNAPSHOT = (
    "import os, pathlib, sys\n"
    "scratch = pathlib.Path(os.environ['GPULAYER_SCRATCH'])\n"
    "attempt = os.environ['GPULAYER_ATTEMPT']\n"
    "print('attempt', attempt, 'found', sorted(p.name for p in scratch.rglob('*')), flush=True)\n"
    "state = scratch / 'ckpt' / 'state.txt'\n"
    "if state.exists():\n"
    "    print('resumed from', state.read_text(), flush=True)\n"
    "    sys.exit(0)\n"
    "state.parent.mkdir()\n"
    "state.write_text('step 5')\n"
    "sys.exit(1)  # fails after its snapshot: the retry resumes\n"
)


def test_a_retry_finds_what_the_failed_attempt_left_in_its_scratch_folder(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    root = tmp_path / "project"
    root.mkdir()
    (root / "snap.py").write_text(SNAPSHOT)
    job = client.submit(root / "snap.py", source=root, max_retries=1, retry_delay=0)
    assert job.wait(timeout=60) == "succeeded"
    text = [line.text for line in job.stream_logs(follow=False)]
    assert "attempt 1 found []" in text
    assert "attempt 2 found ['ckpt', 'state.txt']" in text
    assert "resumed from step 5" in text
    assert job.info.attempt == 2


def test_each_job_has_its_own_scratch_and_a_new_job_starts_with_an_empty_one(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    root = tmp_path / "project"
    root.mkdir()
    (root / "snap.py").write_text(SNAPSHOT)
    first = client.submit(root / "snap.py", source=root)  # no retry: it just fails
    assert first.wait(timeout=60) == "failed"
    again = client.submit(root / "snap.py", source=root)
    assert again.wait(timeout=60) == "failed"
    assert "attempt 1 found []" in [line.text for line in again.stream_logs(follow=False)]


def _worker(plane: ControlPlane) -> str:
    return plane.register_worker(WorkerInfo(id="", name="w", host="w", slot_gpus=[None])).id


def _stored_folder(artifacts: ArtifactStore, tmp_path: Path) -> ArtifactRef:
    """A folder stored as a manifest with one file, as a worker uploads it."""
    folder = tmp_path / "someone-elses"
    folder.mkdir()
    (folder / "secret.txt").write_text("not yours")
    digest = bundle.store(folder, bundle.scan(folder), artifacts)
    return ArtifactRef(kind="dir", digest=digest)


def test_a_worker_cannot_name_blobs_it_did_not_upload_as_a_job_s_scratch(
    plane: ControlPlane, tmp_path: Path
) -> None:
    artifacts = ArtifactStore(tmp_path / "blobs")
    # A server with auth: this worker's results may name only what its
    # token uploaded ("~worker:w"), here nothing.
    plane.keep_blob_readers(artifacts, lambda worker_id: "~worker:w")
    stolen = _stored_folder(artifacts, tmp_path)
    w = _worker(plane)
    job = plane.submit(parse_spec({"command": ["x"], "max_retries": 2, "retry_delay": 0}))
    (task,) = plane.take_instructions(w)
    assert isinstance(task, RunTask) and task.scratch is None

    def fail_with(scratch: ArtifactRef, attempt: int) -> RunTask:
        plane.task_finished(
            TaskResult(
                job_id=job.id,
                attempt=attempt,
                worker_id=w,
                outcome="exited",
                exit_code=1,
                scratch=scratch,
            )
        )
        (nxt,) = plane.take_instructions(w)
        assert isinstance(nxt, RunTask)
        return nxt

    second = fail_with(stolen, 1)
    assert second.scratch is None  # refused: the next attempt gets nothing of it
    assert not plane.may_fetch(w, stolen.digest, artifacts)
    # Once its token holds every blob of it, the folder is the job's to keep.
    listed = [e.digest for e in bundle.load(artifacts, stolen.digest).entries if e.digest]
    plane.grant_to("~worker:w", [stolen.digest, *listed])
    third = fail_with(stolen, 2)
    assert third.scratch == stolen
    assert plane.may_fetch(w, stolen.digest, artifacts)


def test_what_an_attempt_kept_survives_a_restart_of_the_control_plane(tmp_path: Path) -> None:
    from gpulayer.store.sqlite import SqliteStore

    artifacts = ArtifactStore(tmp_path / "blobs")
    kept = _stored_folder(artifacts, tmp_path)
    path = tmp_path / "db.sqlite"
    store = SqliteStore(path)
    before = ControlPlane(store, instance_id="s1")
    w = _worker(before)
    job = before.submit(parse_spec({"command": ["x"], "max_retries": 1, "retry_delay": 0}))
    (task,) = before.take_instructions(w)
    assert isinstance(task, RunTask)
    before.unregister_worker(w, reason="gone")  # nothing to run the retry here
    store.close()
    # (Reopened, the job was requeued without a scratch: record one as the
    # ending attempt would, then restart.)
    store = SqliteStore(path)
    with store.transaction() as tx:
        tx.requeue(job.id, reason="retrying", owner="s1", scratch=kept)
    store.close()
    store = SqliteStore(path)
    try:
        after = ControlPlane(store, instance_id="s2")
        after.recover("s1", workers_outlive=True)
        w2 = _worker(after)
        (again,) = after.take_instructions(w2)
        assert isinstance(again, RunTask) and again.scratch == kept
        after.task_finished(
            TaskResult(
                job_id=job.id, attempt=again.attempt, worker_id=w2, outcome="exited", exit_code=0
            )
        )
        assert store.scratch_of(job.id) is None  # ended: nothing kept
    finally:
        store.close()
