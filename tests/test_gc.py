"""``gpulayer gc``: old jobs go with their logs and what only they named; nothing else.

Jobs are made old by writing their 'finished' mark in the store, and blobs by
setting their mtime back: the CLI runs in another process, whose clock the
test cannot set, and these are exactly what gc reads. In-process tests pass
``now`` instead.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpulayer
from gpulayer import gc
from gpulayer.artifacts import ArtifactStore
from gpulayer.durations import parse_duration
from gpulayer.home import Home
from gpulayer.jobs import JobInfo, LogLine
from gpulayer.spec import ArtifactRef, JobSpec
from gpulayer.store.sqlite import SqliteStore
from gpulayer.worker.ledger import Ledger

GPULAYER = [sys.executable, "-m", "gpulayer.cli"]
DAY = 86400.0


def gl(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPULAYER_HOME": str(home), "COLUMNS": "200"}
    env.pop("GPULAYER_SERVER", None)
    return subprocess.run([*GPULAYER, *args], capture_output=True, text=True, env=env, timeout=60)


def _end_long_ago(home: Path, job_id: str, days: float) -> None:
    with sqlite3.connect(home / "gpulayer.db") as db:
        db.execute(
            "UPDATE jobs SET marks=json_set(marks, '$.finished', ?) WHERE id=?",
            (time.time() - days * DAY, job_id),
        )


def _age_blobs(root: Path, days: float) -> None:
    then = time.time() - days * DAY
    for path in (root / "sha256").rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.utime(path, (then, then))


def _stored(home: Path, digest: str) -> bool:
    # Not ArtifactStore.has, which marks the blob used.
    return os.path.lexists(ArtifactStore(home / "artifacts").path(digest))


def _new_home(home: Path) -> SqliteStore:
    return SqliteStore(Home(home).db)


def test_gc_removes_old_jobs_and_only_what_they_alone_named(
    client: gpulayer.Client, home: Path, project: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data.txt"
    data.write_text("only the old job reads this")
    old = client.submit(project / "train.py", ["old"], inputs={"data": data}, outputs=["out"])
    assert old.wait(60) == "succeeded"
    kept = client.submit(project / "train.py", ["kept"])
    assert kept.wait(60) == "succeeded"
    old_only = {old.info.spec.inputs["data"].digest, old.info.outputs["out"].digest}
    bundle = kept.info.spec.bundle
    assert bundle is not None and bundle == old.info.spec.bundle  # shared: stays
    old_lines = len(gl("logs", old.id, home=home).stdout.splitlines())
    _end_long_ago(home, old.id, days=8)
    _age_blobs(home / "artifacts", days=3)
    leftover = home / "workers" / "w-gone" / "task-1" / "workspace"
    leftover.mkdir(parents=True)
    (leftover / "model.bin").write_bytes(b"x" * 5000)
    live_folders = [home / "workers" / w.id for w in client.workers()]
    assert live_folders and all(f.is_dir() for f in live_folders)

    dry = gl("gc", "--dry-run", home=home)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"would remove 1 job ({old_lines:,} log line")
    assert "1 task folder (5.0 kB)" in dry.stdout
    assert gl("show", old.id, home=home).returncode == 0  # nothing changed
    assert all(_stored(home, d) for d in old_only) and leftover.exists()

    done = gl("gc", home=home)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"removed 1 job ({old_lines:,} log line")
    assert "1 task folder (5.0 kB)" in done.stdout
    assert "no job" in gl("show", old.id, home=home).stderr
    assert not any(_stored(home, d) for d in old_only)
    assert not (home / "workers" / "w-gone").exists()
    assert all(f.is_dir() for f in live_folders)  # the live workers' folders stay
    # What the kept job names stays whole: it runs again, from the same blobs.
    assert _stored(home, bundle)
    assert gl("logs", kept.id, home=home).stdout == "hello kept\n"
    again = client.rerun(kept.id)
    assert again.wait(60) == "succeeded" and again.logs() == "hello kept\n"

    # Nothing of the old job's is left to remove.
    assert gl("gc", home=home).stdout.startswith("removed 0 jobs (0 log lines), 0 blobs (0 B)")


def test_gc_never_follows_a_link_out_of_the_home(home: Path, tmp_path: Path) -> None:
    _new_home(home).close()
    outside = tmp_path / "outside"
    (outside / "sha256" / "ab").mkdir(parents=True)
    precious = outside / "precious.txt"
    precious.write_text("keep me")
    foreign = outside / "sha256" / "ab" / ("ab" * 32)
    foreign.write_text("a blob of another store")
    then = time.time() - 3 * DAY
    for path in (precious, foreign):
        os.utime(path, (then, then))
    store = ArtifactStore(home / "artifacts")
    unnamed = store.put_bytes(b"no job names this")  # a real blob: removed
    _age_blobs(home / "artifacts", days=3)
    links = {
        store.path("cd" * 32): precious,  # a "blob" that is a link
        store.blob_dir / "ef": outside / "sha256" / "ab",  # a prefix folder that is one
        store.tmp_dir / "old.tmp": precious,
        store.tmp_dir / "gc-1-crashed": outside,
        home / "worker-cache": outside,  # a whole store
        home / "workers" / "evil": outside,  # a task folder
    }
    for link, target in links.items():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target)
        os.utime(link, (then, then), follow_symlinks=False)
    # A leftover task folder holding a job's link out: the folder goes, not its target.
    job_made = home / "workers" / "w-gone" / "task-1" / "workspace"
    job_made.mkdir(parents=True)
    (job_made / "data").symlink_to(outside)

    done = gl("gc", "--older-than", "0", home=home)
    assert done.returncode == 0, done.stderr
    assert "1 blob (" in done.stdout and "1 task folder" in done.stdout
    assert "worker-cache/ is a symbolic link: left alone" in done.stderr
    assert not _stored(home, unnamed) and not (home / "workers" / "w-gone").exists()
    assert all(link.is_symlink() for link in links)
    assert precious.read_text() == "keep me"
    assert foreign.read_text() == "a blob of another store"
    assert sorted(p.name for p in outside.rglob("*")) == sorted(
        ["precious.txt", "sha256", "ab", "ab" * 32]
    )


def test_a_blob_looked_up_as_gc_removes_it_is_kept_or_stored_again(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sqlite = _new_home(home)
    store = ArtifactStore(home / "artifacts")
    digest = store.put_bytes(b"a submit is about to name this")
    rename = os.rename
    seen: list[bool] = []

    def lookup_before(src: str, dst: str, **kw: int) -> None:
        if src == digest:  # a submit's missing_blobs, just before gc's rename
            seen.append(store.has(digest))
        rename(src, dst, **kw)

    def lookup_after(src: str, dst: str, **kw: int) -> None:
        rename(src, dst, **kw)
        if src == digest:  # just after it: the blob reads as missing
            seen.append(store.has(digest))

    try:
        _age_blobs(home / "artifacts", days=3)
        monkeypatch.setattr(os, "rename", lookup_before)
        report = gc.collect(home, sqlite, older_than=0)
        assert seen == [True] and report.blobs == 0 and _stored(home, digest)

        _age_blobs(home / "artifacts", days=3)
        monkeypatch.setattr(os, "rename", lookup_after)
        report = gc.collect(home, sqlite, older_than=0)
        assert seen == [True, False] and report.blobs == 1 and not _stored(home, digest)
        # So the submit stores it again, as missing_blobs told it to.
        assert store.put_bytes(b"a submit is about to name this") == digest
        assert _stored(home, digest)
    finally:
        sqlite.close()


def test_a_job_submitted_while_gc_runs_keeps_its_blobs(
    client: gpulayer.Client, home: Path, project: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data.txt"
    data.write_text("shared by the old job and the new one")
    old = client.submit(project / "train.py", ["old"], inputs={"data": data})
    assert old.wait(60) == "succeeded"
    _end_long_ago(home, old.id, days=8)
    _age_blobs(home / "artifacts", days=3)
    sqlite = SqliteStore(home / "gpulayer.db")
    try:
        found = gc.plan(home, sqlite, older_than=7 * DAY, dry_run=False, now=time.time())
        assert found.jobs == 1
        chosen = {b.name for b in found.blobs}
        named = {old.info.spec.inputs["data"].digest, old.info.spec.bundle}
        assert named <= chosen  # no job names them any more
        # A submit of the same files, after the plan and before it is applied.
        new = client.submit(project / "train.py", ["new"], inputs={"data": data})
        report = gc.apply(home, found, now=time.time())
    finally:
        sqlite.close()
    assert all(_stored(home, d) for d in named)
    assert report.blobs == 0
    assert new.wait(60) == "succeeded" and new.logs() == "hello new\n"


def _job(job_id: str, seq: int, state: str, finished: float | None, spec: JobSpec) -> JobInfo:
    marks = {"submitted": 1.0} if finished is None else {"submitted": 1.0, "finished": finished}
    return JobInfo(id=job_id, seq=seq, state=state, spec=spec, marks=marks)


def test_the_store_deletes_only_final_jobs_that_ended_before_the_cutoff(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    a, b, c = ("a" * 64, "b" * 64, "c" * 64)
    spec = JobSpec(command=["true"], bundle=a, inputs={"x": ArtifactRef(kind="file", digest=b)})
    other = JobSpec(command=["true"], inputs={"y": ArtifactRef(kind="dir", digest=c)})
    try:
        with store.transaction() as tx:
            tx.insert_job(_job("old-done", 1, "succeeded", 100.0, spec))
            tx.insert_job(_job("old-queued", 2, "queued", None, spec))
            tx.insert_job(_job("old-running", 3, "running", None, spec))
            tx.insert_job(_job("new-failed", 4, "failed", 5000.0, other))
            tx.insert_job(_job("old-lost'); DROP TABLE jobs; --", 5, "lost", 50.0, spec))
        lines = [LogLine(seq=i, ts=1.0, stream="stdout", text=f"l{i}") for i in (1, 2, 3)]
        store.append_logs("old-done", 1, lines[:2])
        store.append_logs("old-done", 2, lines)
        store.append_logs("new-failed", 1, lines)
        with store.transaction() as tx:
            assert tx.delete_jobs_ended_before(1000.0) == (2, 5)
            assert tx.artifact_refs() == {("dir", a), ("file", b), ("dir", c)}
        left = sorted(j.id for j in store.list_jobs())
        assert left == ["new-failed", "old-queued", "old-running"]
        assert store.read_logs("old-done") == [] and len(store.read_logs("new-failed")) == 3
        with store.transaction() as tx:
            assert tx.delete_jobs_ended_before(1e12) == (1, 3)
            assert tx.artifact_refs() == {("dir", a), ("file", b)}
    finally:
        store.close()


def test_hard_linked_blobs_free_their_bytes_once_and_only_with_their_last_link(
    home: Path, tmp_path: Path
) -> None:
    sqlite = _new_home(home)
    artifacts, cache = ArtifactStore(home / "artifacts"), ArtifactStore(home / "worker-cache")
    both = artifacts.put_bytes(b"1" * 1000)
    cache.link_from(artifacts.path(both), both)  # a worker cache on the same machine
    elsewhere = artifacts.put_bytes(b"2" * 300)
    os.link(artifacts.path(elsewhere), tmp_path / "workspace-link")
    for root in (home / "artifacts", home / "worker-cache"):
        _age_blobs(root, days=3)
    try:
        dry = gc.collect(home, sqlite, older_than=0, dry_run=True)
        done = gc.collect(home, sqlite, older_than=0)
    finally:
        sqlite.close()
    for report in (dry, done):
        assert (report.blobs, report.blob_bytes) == (3, 1000)
        assert (report.linked, report.linked_bytes) == (1, 300)
    assert "3 blobs (1.0 kB)" in done.summary() and "300 B" in done.summary()
    assert (tmp_path / "workspace-link").read_bytes() == b"2" * 300


def test_task_folders_of_workers_with_a_ledger_stay(home: Path) -> None:
    _new_home(home).close()
    workers = home / "workers"
    live = Ledger(workers)  # held by this process: a live worker for gc's process
    live.set_worker_id("w-live")
    dead = workers / "live" / "1-dead"  # its lock free: the next worker tidies it
    dead.mkdir()
    (dead / "lock").touch()
    (dead / "worker-id").write_text("w-dead")
    for name in ("w-live", "w-dead", "w-gone"):
        (workers / name / "task-1" / "workspace").mkdir(parents=True)
    try:
        done = gl("gc", home=home)
        assert done.returncode == 0, done.stderr
        assert "1 task folder" in done.stdout
        assert sorted(p.name for p in workers.iterdir()) == ["live", "w-dead", "w-live"]
        # A worker starting (its ledger has no id yet): every folder stays.
        (workers / "w-gone").mkdir()
        (workers / "live" / ".new-2-abcd").mkdir()
        starting = gl("gc", home=home)
        assert "a worker is starting" in starting.stderr and "0 task folders" in starting.stdout
        assert (workers / "w-gone").is_dir()
    finally:
        live.close()


@pytest.mark.parametrize("bad", ["soon", "-1h", "1y", "3651d", "9" * 400, ""])
def test_a_bad_age_is_refused_and_changes_nothing(home: Path, bad: str) -> None:
    _new_home(home).close()
    store = ArtifactStore(home / "artifacts")
    digest = store.put_bytes(b"stays")
    _age_blobs(home / "artifacts", days=3)
    refused = gl("gc", "--older-than", bad, home=home)
    assert refused.returncode == 2
    assert "--older-than" in refused.stderr and "is not a duration" in refused.stderr
    assert _stored(home, digest)


def test_gc_refuses_a_server_and_a_server_home(home: Path) -> None:
    _new_home(home).close()
    refused = gl("--server", "http://127.0.0.1:9", "gc", home=home)
    assert refused.returncode == 2 and "not supported yet" in refused.stderr
    (home / "server.lock").touch()
    refused = gl("gc", home=home)
    assert refused.returncode != 0 and "server's home" in refused.stderr
    missing = gl("gc", home=home / "nowhere")
    assert missing.returncode == 0 and "nothing to clean" in missing.stdout
    assert not (home / "nowhere").exists()


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90m", "12h", "7d", "2w", "3600")] == [
        5400,
        43200,
        7 * DAY,
        14 * DAY,
        3600,
    ]
    assert parse_duration("0", zero=True) == 0
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration("0")


def test_leftover_folders_and_freed_bytes_are_decided_without_io() -> None:
    assert gc.leftover_folders(["a", "b", "c"], {"l1": "a"}, {"b"}) == ["c"]
    assert gc.leftover_folders(["a"], {"l1": "x", "l2": None}, set()) is None
    blob = gc.Blob("artifacts", "f" * 64, 10, 0, 2, (1, 1))
    assert gc.freed([blob]) == (0, 0, 1, 10)
    assert gc.freed([blob, gc.Blob("worker-cache", "f" * 64, 10, 0, 2, (1, 1))]) == (2, 10, 0, 0)
    assert gc.choose_blobs([blob], set(), 1) == [blob]
    assert gc.choose_blobs([blob], {"f" * 64}, 1) == [] and gc.choose_blobs([blob], set(), 0) == []
