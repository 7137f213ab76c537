from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from gpulayer.errors import StoreError
from gpulayer.jobs import JobInfo, LogLine, TaskInfo, WorkerInfo
from gpulayer.spec import JobSpec
from gpulayer.store.migrations import LATEST, MIGRATIONS
from gpulayer.store.sqlite import SqliteStore

from helpers import refuse_commits


def test_new_store_is_migrated_and_reopens_with_its_data(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    store = SqliteStore(path)
    assert store.schema_version == LATEST
    with store.transaction() as tx:
        tx.insert_job(
            JobInfo(id="j1", spec=JobSpec(command=["x"]), seq=1, marks={"submitted": 1.5})
        )
    store.append_logs("j1", 1, [LogLine(1, 2.0, "stdout", "hi")])
    with store.transaction() as tx:
        for at, (worker, digest) in enumerate(
            [("w1", "a" * 64), ("w2", "b" * 64), ("w3", None), ("w1", "c" * 64), ("w1", "c" * 64)]
        ):
            tx.upsert_worker(
                WorkerInfo(id=worker, name=worker, host="h", slot_gpus=[None]),
                token_digest=digest,
                at=float(at),
            )
        tx.delete_worker("w2")
    store.close()
    again = SqliteStore(path)
    job = again.get_job("j1")
    assert job is not None and job.spec.command == ["x"] and job.marks == {"submitted": 1.5}
    assert [line.text for _, line in again.read_logs("j1")] == ["hi"]
    assert again.worker_bindings() == {"w1": "c" * 64}  # the last one holds; none without auth
    assert {w.id for w in again.list_workers()} == {"w1", "w3"}
    # Kept after the worker is gone (a worker token's late log lines), since
    # the first registration with that token.
    assert [again.last_binding(w) for w in ("w1", "w2", "w3")] == [
        ("c" * 64, 3.0),
        ("b" * 64, 1.0),
        None,
    ]
    again.close()


def test_the_workers_of_a_requeued_attempt_are_kept_for_its_late_log_lines(
    tmp_path: Path,
) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    gang = [TaskInfo(node=0, worker="w0"), TaskInfo(node=1, worker="w1")]
    with store.transaction() as tx:
        for job_id in ("one", "gang"):
            tx.insert_job(JobInfo(id=job_id, spec=JobSpec(command=["x"]), seq=1))
        tx.place("one", worker="w0", slots=[0], gpus=[], attempt=1, at=1.0)
        tx.place("gang", worker="w0", slots=[0], gpus=[], attempt=1, at=1.5, tasks=gang)

    def workers(job_id: str, pairs: list[tuple[int, int]]) -> list[tuple[str, float] | None]:
        return [store.task_worker(job_id, attempt, node) for attempt, node in pairs]

    assert workers("one", [(1, 0), (1, 1)]) == [("w0", 1.0), None]
    assert workers("gang", [(1, 0), (1, 1), (1, 2)]) == [("w0", 1.5), ("w1", 1.5), None]
    with store.transaction() as tx:
        for job_id in ("one", "gang"):
            tx.requeue(job_id, reason="retrying: lost", owner="s")
    # Queued again, the rows name no worker: the history answers.
    assert workers("one", [(1, 0), (1, 1)]) == [("w0", 1.0), None]
    assert workers("gang", [(1, 0), (1, 1)]) == [("w0", 1.5), ("w1", 1.5)]
    with store.transaction() as tx:
        tx.place("one", worker="w2", slots=[0], gpus=[], attempt=2, at=2.0)
    assert workers("one", [(1, 0), (2, 0), (3, 0)]) == [("w0", 1.0), ("w2", 2.0), None]
    # Given back unrun (its number is used again): it left no lines to come.
    with store.transaction() as tx:
        tx.requeue("one", reason=None, owner="s", attempt=1)
    assert workers("one", [(1, 0), (2, 0)]) == [("w0", 1.0), None]
    assert store.task_worker("nosuchjob", 1) is None
    store.close()


def test_a_store_of_an_older_schema_is_brought_up_to_date_with_its_jobs(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    db = sqlite3.connect(path)
    for statements in MIGRATIONS[:4]:  # as GPUlayer before "given_back" left it
        for statement in statements:
            db.execute(statement)
    db.execute("PRAGMA user_version = 4")
    db.execute(
        "INSERT INTO jobs (id, seq, state, priority, spec, attempt) VALUES (?,?,?,?,?,?)",
        ("j1", 1, "queued", 0, b'{"command":["x"]}', 2),
    )
    db.commit()
    db.close()
    store = SqliteStore(path)
    assert store.schema_version == LATEST
    job = store.get_job("j1")
    assert job is not None and (job.attempt, job.given_back) == (2, 0)
    store.close()


def test_an_upgrade_binds_live_workers_to_their_tokens_from_then_on(tmp_path: Path) -> None:
    """Since the upgrade: which token a worker's earlier tasks ran under (it
    may have been taken over since) is not known."""
    path = tmp_path / "db.sqlite"
    db = sqlite3.connect(path)
    for statements in MIGRATIONS[:7]:
        for statement in statements:
            db.execute(statement)
    db.execute("PRAGMA user_version = 7")
    db.execute(
        "INSERT INTO workers (id, instance, info, token_digest) VALUES ('w', 's', '{}', ?)",
        ("d" * 64,),
    )
    db.commit()
    db.close()
    before = time.time()
    store = SqliteStore(path)
    binding = store.last_binding("w")
    assert binding is not None and binding[0] == "d" * 64 and binding[1] >= int(before)
    store.close()


def test_a_newer_schema_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    SqliteStore(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {LATEST + 1}")
    db.commit()
    db.close()
    with pytest.raises(StoreError, match="newer than this GPUlayer"):
        SqliteStore(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == LATEST + 1
    db.close()


def test_a_failed_transaction_leaves_nothing(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    with pytest.raises(RuntimeError), store.transaction() as tx:
        tx.insert_job(JobInfo(id="j1", spec=JobSpec(command=["x"]), seq=1))
        raise RuntimeError("boom")
    assert store.get_job("j1") is None
    store.close()


def test_marks_keep_full_float_precision(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    t = 1795941517.6718388
    with store.transaction() as tx:
        tx.insert_job(JobInfo(id="j1", spec=JobSpec(command=["x"]), seq=1, marks={"submitted": t}))
        tx.place("j1", worker="w", slots=[0], gpus=[], attempt=1, at=t)
    job = store.get_job("j1")
    assert job is not None and job.marks == {"submitted": t, "placed": t}
    store.close()


def test_a_refused_write_is_a_store_error_and_leaves_nothing(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    refuse_commits(store)
    with pytest.raises(StoreError, match="disk is full"), store.transaction() as tx:
        tx.insert_job(JobInfo(id="j1", spec=JobSpec(command=["x"]), seq=1))
    assert store.get_job("j1") is None
    with store.transaction() as tx:  # the store goes on working
        tx.insert_job(JobInfo(id="j1", spec=JobSpec(command=["x"]), seq=1))
    assert store.get_job("j1") is not None
    store.close()


def test_a_failed_read_is_a_store_error(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    with store.transaction() as tx:
        tx.insert_job(JobInfo(id="j1", spec=JobSpec(command=["x"]), seq=1))
    refuse_commits(store, 0).reads_fail = True
    for read in (
        lambda: store.get_job("j1"),
        lambda: store.list_jobs(),
        lambda: store.read_logs("j1"),
        lambda: store.list_workers(),
        lambda: store.token_role("x"),
    ):
        with pytest.raises(StoreError, match="disk I/O error"):
            read()
    store.close()
