"""What the control plane says about its workers."""

from __future__ import annotations

from pathlib import Path

from gpulayer.jobs import WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore


def test_a_workers_last_word_is_its_latest_heartbeat(tmp_path: Path) -> None:
    now = [100.0]
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="test", clock=lambda: now[0])
        info = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None]))
        now[0] = 142.5
        plane.heartbeat(info.id)
        (seen,) = plane.list_workers()
        assert (seen.started, seen.last_seen) == (100.0, 142.5)
    finally:
        store.close()


def test_waiting_on_a_job_that_just_ended_reads_no_store(tmp_path: Path) -> None:
    from gpulayer.jobs import RunTask, TaskResult
    from gpulayer.spec import parse_spec

    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="test")
        wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
        job = plane.submit(parse_spec({"command": ["x"]}))
        (task,) = plane.take_instructions(wid)
        assert isinstance(task, RunTask)
        plane.task_finished(
            TaskResult(job_id=job.id, attempt=1, worker_id=wid, outcome="exited", exit_code=0)
        )

        def no_reads(*args: object, **kwargs: object) -> None:
            raise AssertionError("read the store")

        store.get_job = no_reads  # type: ignore[method-assign, assignment]
        store.find_job = no_reads  # type: ignore[method-assign, assignment]
        final = plane.wait(job.id)
        assert (final.state, final.exit_code) == ("succeeded", 0)
    finally:
        store.close()


def test_a_stopping_worker_gets_no_more_work_and_gives_back_what_it_never_ran(
    tmp_path: Path,
) -> None:
    from gpulayer.jobs import RunTask
    from gpulayer.spec import parse_spec

    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="test")
        info = WorkerInfo(id="", name="w", host="h", slot_gpus=[None, None])
        wid = plane.register_worker(info).id
        spec = parse_spec({"command": ["x"]})  # max_retries 0: a lost attempt would end it
        placed = plane.submit(spec)
        (task,) = plane.take_instructions(wid)  # on its way to the worker...
        assert isinstance(task, RunTask) and task.job_id == placed.id
        plane.heartbeat(wid, stopping=True)  # ...which says it is stopping
        waiting = plane.submit(spec)
        assert plane.get(waiting.id).state == "queued"  # its free slot takes nothing now
        # It leaves having never started the task: no attempt is spent.
        plane.unregister_worker(wid, said=True)
        assert plane.get(placed.id).state == "queued"
        other = plane.register_worker(WorkerInfo(id="", name="o", host="o", slot_gpus=[None])).id
        (again,) = plane.take_instructions(other)
        assert isinstance(again, RunTask) and (again.job_id, again.attempt) == (placed.id, 1)
    finally:
        store.close()
