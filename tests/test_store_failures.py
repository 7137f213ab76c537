"""A store write that fails (a full disk, an I/O error) changes nothing, and
what hit it applies when it comes again; where no one sends it again, the
control plane moves on and the store catches up with the job's next step."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import sys
import threading
from pathlib import Path

import pytest

import gpulayer
import gpulayer.worker.worker as worker_module
from gpulayer.artifacts import ArtifactStore
from gpulayer.errors import ServerUnreachable, StoreError
from gpulayer.jobs import (
    CancelTask,
    JobInfo,
    LogLine,
    RunTask,
    TaskResult,
    TaskStarted,
    WorkerInfo,
)
from gpulayer.service import ControlPlane
from gpulayer.service.state import Done
from gpulayer.spec import JobSpec, parse_spec
from gpulayer.store.sqlite import SqliteStore
from gpulayer.transport.inprocess import InProcessTransport
from test_jobs import wait_for_line

from helpers import refuse_commits


def _gang(plane: ControlPlane) -> tuple[str, str, str]:
    """A job of two nodes, each taken by its worker: (job, node 0's, node 1's)."""
    a, b = (
        plane.register_worker(WorkerInfo(id="", name=n, host=n, slot_gpus=[None])).id for n in "ab"
    )
    job = plane.submit(parse_spec({"command": ["x"], "nodes": 2})).id
    nodes = {}
    for wid in (a, b):
        (task,) = plane.take_instructions(wid)
        assert isinstance(task, RunTask)
        nodes[task.node] = wid
    return job, nodes[0], nodes[1]


def _result(job: str, wid: str, node: int, **fields: object) -> TaskResult:
    return TaskResult(job_id=job, attempt=1, worker_id=wid, node=node, **fields)  # type: ignore[arg-type]


def test_a_gang_whose_lost_node_was_not_stored_ends_when_it_is_lost_again(
    plane: ControlPlane,
) -> None:
    job, w0, w1 = _gang(plane)
    refuse_commits(plane.store)
    with pytest.raises(StoreError):
        plane.unregister_worker(w0, reason="its worker stopped heartbeating")
    assert w0 in [w.id for w in plane.list_workers()]  # not lost yet, as far as anyone knows
    assert plane.take_instructions(w1) == []  # and the other node told nothing
    assert plane.get(job).state == "running"

    plane.unregister_worker(w0, reason="its worker stopped heartbeating")  # the reaper, again
    assert plane.take_instructions(w1) == [CancelTask(job_id=job, attempt=1)]  # now it is
    plane.task_finished(_result(job, w1, 1, outcome="cancelled"))
    assert plane.get(job).state not in ("queued", "running")


def test_a_worker_lost_while_the_store_refuses_is_lost_again_later(plane: ControlPlane) -> None:
    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    job = plane.submit(parse_spec({"command": ["x"], "max_retries": 1, "retry_delay": 0})).id
    plane.take_instructions(wid)
    refuse_commits(plane.store)
    with pytest.raises(StoreError):
        plane.unregister_worker(wid, reason="its worker stopped heartbeating")
    assert plane.get(job).state == "running"
    assert wid in [w.id for w in plane.list_workers()]  # still there, the job still on it

    plane.unregister_worker(wid, reason="its worker stopped heartbeating")  # the reaper, again
    other = plane.register_worker(WorkerInfo(id="", name="o", host="o", slot_gpus=[None])).id
    (again,) = plane.take_instructions(other)
    assert isinstance(again, RunTask) and (again.job_id, again.attempt) == (job, 2)


def test_a_gang_node_its_worker_came_back_without_ends_though_that_write_failed(
    plane: ControlPlane,
) -> None:
    job, w0, w1 = _gang(plane)
    refuse_commits(plane.store, skip=1)  # the registration is stored; the node's end is not
    with pytest.raises(StoreError):
        plane.register_worker(WorkerInfo(id=w0, name="a", host="a", slot_gpus=[None]), [])
    # Memory moved on (node 0 is over); the other node ends on its own.
    plane.task_finished(_result(job, w1, 1, outcome="exited", exit_code=0))
    assert plane.get(job).state not in ("queued", "running")


def test_an_error_after_the_end_was_stored_does_not_undo_it(plane: ControlPlane) -> None:
    job, w0, w1 = _gang(plane)
    plane.task_finished(_result(job, w1, 1, outcome="exited", exit_code=0))
    final, done = plane.watch_job(job)
    assert final is None and done is not None

    def closed_loop() -> None:
        raise RuntimeError("Event loop is closed")  # a waiter's loop shut down

    plane.subscribe_done(done, closed_loop)
    with pytest.raises(RuntimeError):
        plane.task_finished(_result(job, w0, 0, outcome="exited", exit_code=0))
    assert plane.get(job).state == "succeeded"
    nxt = plane.submit(parse_spec({"command": ["x"], "nodes": 2})).id
    assert [t.job_id for t in plane.take_instructions(w0)] == [nxt]  # its slot is free


def test_gang_log_lines_the_store_refused_are_stored_when_sent_again(
    plane: ControlPlane,
) -> None:
    job, _, _ = _gang(plane)
    refusing = refuse_commits(plane.store, count=0)
    lines = [LogLine(1, 0.0, "stdout", "hello")]
    real = refusing.execute

    def full_once(sql: str, *args: object) -> sqlite3.Cursor:
        refusing.execute = real  # type: ignore[method-assign]
        raise sqlite3.OperationalError("database or disk is full")

    refusing.execute = full_once  # type: ignore[method-assign]
    with pytest.raises(StoreError):
        plane.append_logs(job, 1, lines, node=1)
    plane.append_logs(job, 1, lines, node=1)  # the log sender sends them again
    assert [line.text for _, line in plane.store.read_logs(job)] == ["hello"]


def test_an_embedded_workers_report_the_store_refused_goes_again(
    plane: ControlPlane, tmp_path: Path
) -> None:
    transport = InProcessTransport(plane, ArtifactStore(tmp_path / "blobs"))
    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    job = plane.submit(parse_spec({"command": ["x"]})).id
    plane.take_instructions(wid)
    refuse_commits(plane.store, count=None)
    with pytest.raises(ServerUnreachable):  # its outbox keeps it, and sends it again
        transport.task_finished(_result(job, wid, 0, outcome="exited", exit_code=0))


def test_a_rollback_that_fails_too_is_still_a_store_error(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    refuse_commits(store).rollback_fails = True
    try:
        with pytest.raises(StoreError), store.transaction() as tx:
            tx.insert_job(JobInfo(id="j1", spec=JobSpec(command=["x"]), seq=1))
    finally:
        store.close()


def test_an_embedded_client_closes_while_the_store_refuses_its_reports(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "_OUTBOX_STOP_S", 0.2)
    go = tmp_path / "go"
    os.mkfifo(go)
    client = gpulayer.Client(home=home)
    try:
        client.ensure_local_workers(1, kill_grace=0.5)
        waits = f"print('up', flush=True); open({str(go)!r}).read()"
        job = client.submit(command=[sys.executable, "-c", waits])
        wait_for_line(job, "up")  # it runs, its start stored
        assert client._embedded is not None
        store = client._embedded.store
        refuse_commits(store, count=None)
        with open(go, "w"):
            pass  # it ends now; its end cannot be stored
    finally:
        closer = threading.Thread(target=client.close, daemon=True)
        closer.start()
        closer.join(30)
    assert not closer.is_alive(), "close() waited on reports the store kept refusing"


def _clocked(tmp_path: Path, now: list[float]) -> tuple[ControlPlane, SqliteStore]:
    store = SqliteStore(tmp_path / "clocked.sqlite")
    return ControlPlane(store, instance_id="test", clock=lambda: now[0]), store


def test_a_node_loss_the_store_refused_cancels_nothing(tmp_path: Path) -> None:
    """Its worker was only slow: the loss that was not stored must not have
    ended the job's other nodes."""
    now = [1000.0]
    plane, store = _clocked(tmp_path, now)
    try:
        job, w0, w1 = _gang(plane)
        now[0] += 100
        plane.heartbeat(w1)
        refuse_commits(plane.store)
        with pytest.raises(StoreError):
            plane.reap(30)  # w0 is silent; the store refuses its loss
        plane.heartbeat(w0)  # it was only slow
        assert plane.take_instructions(w1) == []  # no cancel went out
        for wid, node in ((w0, 0), (w1, 1)):
            plane.task_finished(_result(job, wid, node, outcome="exited", exit_code=0))
        assert plane.get(job).state == "succeeded"
    finally:
        store.close()


def test_a_goodbye_the_store_refused_counts_as_one_when_the_reaper_comes(tmp_path: Path) -> None:
    now = [1000.0]
    plane, store = _clocked(tmp_path, now)
    try:
        wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
        job = plane.submit(parse_spec({"command": ["x"]})).id  # in its inbox, never taken
        refuse_commits(plane.store)
        with pytest.raises(StoreError):
            plane.unregister_worker(wid, said=True)  # its goodbye, sent once
        now[0] += 100
        assert plane.reap(30) == [wid]
        info = plane.get(job)
        assert (info.state, info.attempt) == ("queued", 0)  # never an attempt: it never saw it
    finally:
        store.close()


def test_a_worker_back_without_its_task_while_the_store_refuses_finds_it_missing_again(
    plane: ControlPlane,
) -> None:
    info = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None]))
    job = plane.submit(parse_spec({"command": ["x"], "max_retries": 1, "retry_delay": 0})).id
    (task,) = plane.take_instructions(info.id)
    assert isinstance(task, RunTask)
    plane.task_started(
        TaskStarted(
            job_id=job, attempt=1, worker_id=info.id, acquired=0, prepared=0, started=0, pid=1
        )
    )
    back = WorkerInfo(id=info.id, name="w", host="h", slot_gpus=[None])
    refuse_commits(plane.store)
    with pytest.raises(StoreError):
        plane.register_worker(back, running=[])  # its new process: the task is gone
    assert plane.get(job).state == "running"
    assert plane.get(job).attempt == 1

    plane.register_worker(back, running=[])  # it registers again, and this write is stored
    (again,) = plane.take_instructions(info.id)
    assert isinstance(again, RunTask) and (again.job_id, again.attempt) == (job, 2)


def test_a_new_worker_whose_registration_the_store_refused_gets_no_work(
    plane: ControlPlane,
) -> None:
    refuse_commits(plane.store)
    with pytest.raises(StoreError):
        plane.register_worker(WorkerInfo(id="w-refused", name="w", host="h", slot_gpus=[None]))
    assert plane.list_workers() == []
    job = plane.submit(parse_spec({"command": ["x"]}))
    assert job.state == "queued"  # not placed on a worker that no one knows


def test_the_reaper_goes_on_past_a_loss_the_store_refused(tmp_path: Path) -> None:
    now = [1000.0]
    plane, store = _clocked(tmp_path, now)
    try:
        first, second = (
            plane.register_worker(WorkerInfo(id="", name=n, host=n, slot_gpus=[None])).id
            for n in "ab"
        )
        now[0] += 100
        refuse_commits(plane.store)  # the first loss only
        refused: list[str] = []
        assert plane.reap(30, on_refused=lambda wid, exc: refused.append(wid)) == [second]
        assert refused == [first]
        assert [w.id for w in plane.list_workers()] == [first]
        assert plane.reap(30) == [first]  # next turn
    finally:
        store.close()


def test_the_server_logs_a_refused_loss_once_a_minute_not_each_turn(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio
    import logging

    from gpulayer.http.server import Server

    server = Server(tmp_path / "home", heartbeat_timeout=0.2)
    turns: list[list[str]] = []
    reap = server.plane.reap

    def counted(timeout: float, on_refused: object = None) -> list[str]:
        turns.append(reap(timeout, on_refused=on_refused))  # type: ignore[arg-type]
        if len(turns) == 6:
            refusing.count = 0  # the disk has room again
        if turns[-1]:
            finished.set()
        return turns[-1]

    server.plane.reap = counted  # type: ignore[method-assign]
    wid = server.plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    refusing = refuse_commits(server.store, None)

    async def main() -> None:
        reaper = asyncio.create_task(server._reap_forever())
        await finished.wait()
        reaper.cancel()

    finished = asyncio.Event()
    try:
        with caplog.at_level(logging.WARNING, logger="gpulayer.http.server"):
            asyncio.run(main())
    finally:
        server.close()
    refused = [r for r in caplog.records if "declaring it lost failed" in r.getMessage()]
    assert len(turns) >= 6 and turns[-1] == [wid]
    assert len(refused) == 1 and "disk is full" in refused[0].getMessage()
    assert any(
        f"worker {wid} stopped heartbeating: declared lost" in r.getMessage()
        for r in caplog.records
    )


def _restarted_with_a_known_worker(store: SqliteStore) -> tuple[ControlPlane, str]:
    """A plane after a restart, knowing a worker that has not registered again."""
    first = ControlPlane(store, instance_id="first")
    wid = first.register_worker(WorkerInfo(id="", name="w", host="w", slot_gpus=[None])).id
    second = ControlPlane(store, instance_id="second")
    second.recover("first", workers_outlive=True)
    return second, wid


def test_a_known_worker_whose_registration_was_refused_gets_no_work(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    plane, wid = _restarted_with_a_known_worker(store)
    back = WorkerInfo(id=wid, name="w", host="w", slot_gpus=[None])
    refuse_commits(store)
    with pytest.raises(StoreError):
        plane.register_worker(back, running=[])
    assert plane.submit(parse_spec({"command": ["x"]})).state == "queued"
    plane.register_worker(back, running=[])  # again, stored
    (task,) = plane.take_instructions(wid)
    assert isinstance(task, RunTask) and task.attempt == 1
    store.close()


def test_a_gang_waits_whole_for_a_worker_whose_registration_was_refused(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    plane, wid = _restarted_with_a_known_worker(store)
    other = plane.register_worker(WorkerInfo(id="", name="v", host="v", slot_gpus=[None])).id
    back = WorkerInfo(id=wid, name="w", host="w", slot_gpus=[None])
    refuse_commits(store)
    with pytest.raises(StoreError):
        plane.register_worker(back, running=[])
    job = plane.submit(parse_spec({"command": ["x"], "nodes": 2})).id  # max_retries 0
    assert plane.get(job).state == "queued"  # not half on a worker no one has heard from
    plane.register_worker(back, running=[])
    placed = plane.take_instructions(wid) + plane.take_instructions(other)
    assert sorted((t.node, t.attempt) for t in placed if isinstance(t, RunTask)) == [(0, 1), (1, 1)]
    store.close()


def test_waiters_are_woken_by_a_stored_end_though_the_read_after_it_fails(
    plane: ControlPlane,
) -> None:
    job = plane.submit(parse_spec({"command": ["x"]})).id  # no worker: queued
    _, done = plane.watch_job(job)
    assert done is not None
    woken: list[bool] = []
    done.signal.subscribe(lambda: woken.append(True))
    refuse_commits(plane.store, 0).reads_fail = True
    with contextlib.suppress(StoreError):  # its reply reads the record: that may fail
        plane.cancel(job)
    assert woken == [True]


def _taken_before_a_restart(
    tmp_path: Path, *, started: bool = False
) -> tuple[SqliteStore, ControlPlane, str, str]:
    """A job (no retries) its worker took, then a restart: (store, the new
    plane, the worker's id, the job's id). ``started``: its start was stored."""
    store = SqliteStore(tmp_path / "db.sqlite")
    first = ControlPlane(store, instance_id="first")
    wid = first.register_worker(WorkerInfo(id="", name="w", host="w", slot_gpus=[None])).id
    job = first.submit(parse_spec({"command": ["x"]})).id
    (task,) = first.take_instructions(wid)
    assert isinstance(task, RunTask)
    if started:
        first.task_started(
            TaskStarted(
                job_id=job, attempt=1, worker_id=wid, acquired=1, prepared=1, started=1, pid=9
            )
        )
    second = ControlPlane(store, instance_id="second")
    second.recover("first", workers_outlive=True)
    return store, second, wid, job


@pytest.mark.parametrize("adopted", [True, False])
def test_a_task_placed_before_a_restart_counts_if_a_new_worker_process_comes_back_without_it(
    tmp_path: Path, adopted: bool
) -> None:
    """Whether the worker took it was kept in memory only. A new worker
    process (adopting the dead one's id, after ending what it ran) may have
    had it running: lost, not run again as the same attempt. The same worker
    process, registering again, would have named it or reported its end."""
    store, second, wid, job = _taken_before_a_restart(tmp_path)
    back = WorkerInfo(id=wid, name="w", host="w", slot_gpus=[None])
    second.register_worker(back, running=[], adopted=adopted)
    info = second.get(job)
    if adopted:
        assert (info.state, info.attempt) == ("lost", 1)
        assert info.reason == "its worker came back without it"
    else:
        assert (info.state, info.attempt) == ("running", 1)  # placed again, uncounted
    store.close()


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("started", [True, False])
def test_a_goodbye_after_a_restart_never_runs_a_taken_task_again_as_the_same_attempt(
    tmp_path: Path, named: bool, started: bool
) -> None:
    """After a restart, whether the worker took a task is unknown until it
    names it: a goodbye then counts it, rather than queueing it as never
    taken (and running attempt 1 twice)."""
    store, second, wid, job = _taken_before_a_restart(tmp_path, started=started)
    if named:  # the same process comes back, naming it
        second.register_worker(WorkerInfo(id=wid, name="w", host="w", slot_gpus=[None]), [(job, 1)])
    second.unregister_worker(wid, said=True)  # then stops with it still there
    other = second.register_worker(WorkerInfo(id="", name="o", host="o", slot_gpus=[None])).id
    again = second.take_instructions(other)
    assert not any(isinstance(i, RunTask) and i.attempt == 1 for i in again)
    assert second.get(job).state == "lost"
    store.close()


def test_wait_wakes_for_an_end_whose_record_could_not_be_read(plane: ControlPlane) -> None:
    """The end lands between wait()'s look at the job and its sleep, and the
    read of its record after the stored end fails: wait() must not sleep on
    a signal that has already fired."""
    job = plane.submit(parse_spec({"command": ["x"]})).id  # no worker: queued
    watch, read = plane.watch_job, plane.store.get_job

    def failing_once(job_id: str) -> JobInfo | None:
        plane.store.get_job = read  # type: ignore[method-assign]
        raise StoreError("disk I/O error")

    def end() -> None:  # a report on another thread ends it now
        plane.store.get_job = failing_once  # type: ignore[method-assign]
        plane.cancel(job)  # its own reply's read comes after, and succeeds

    def racing_watch(job_id: str) -> tuple[JobInfo | None, Done | None]:
        result = watch(job_id)
        if not ended:
            ended.append(True)
            ender = threading.Thread(target=end)
            ender.start()
            ender.join()
        return result

    ended: list[bool] = []
    plane.watch_job = racing_watch  # type: ignore[method-assign]
    done: list[JobInfo] = []
    waiter = threading.Thread(target=lambda: done.append(plane.wait(job)), daemon=True)
    waiter.start()
    waiter.join(30)  # a bound only: it returns at once when right
    assert [j.state for j in done] == ["cancelled"]
