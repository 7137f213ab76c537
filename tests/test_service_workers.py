"""What the control plane says about its workers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpulayer.errors import InvalidStateError, StoreError
from gpulayer.ids import new_id
from gpulayer.jobs import Instruction, RunTask, TaskResult, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.signals import Signal
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore

from helpers import refuse_commits


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


@pytest.mark.parametrize("goes", ["says goodbye", "goes silent"])
def test_what_a_worker_never_took_is_not_an_attempt_however_it_goes(
    tmp_path: Path, goes: str
) -> None:
    """A job placed on a worker that never reached it (still in its inbox)
    never ran: queued again, no attempt spent, whether the worker said
    goodbye or went silent before its next long poll."""
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="test")
        info = WorkerInfo(id="", name="w", host="h", slot_gpus=[None, None])
        wid = plane.register_worker(info).id
        spec = parse_spec({"command": ["x"]})  # max_retries 0: a lost attempt ends the job
        taken = plane.submit(spec)
        (task,) = plane.take_instructions(wid)  # the worker took this one...
        assert isinstance(task, RunTask) and task.job_id == taken.id
        untaken = plane.submit(spec)  # ...not this one, still in its inbox
        if goes == "says goodbye":
            plane.heartbeat(wid, stopping=True)  # it says it is stopping
            waiting = plane.submit(spec)
            assert plane.get(waiting.id).state == "queued"  # its free slots take nothing now
            plane.unregister_worker(wid, said=True)
        else:
            assert plane.reap(-1.0) == [wid]
        # The one it took may have run (a start is reported late over HTTP):
        # lost. The one it never saw is queued again, no attempt spent.
        assert plane.get(taken.id).state == "lost"
        assert plane.get(untaken.id).state == "queued"
        other = plane.register_worker(WorkerInfo(id="", name="o", host="o", slot_gpus=[None])).id
        (again,) = plane.take_instructions(other)
        assert isinstance(again, RunTask) and (again.job_id, again.attempt) == (untaken.id, 1)
        assert store.get_job(untaken.id).attempt == 1  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_long_poll_of_a_worker_removed_meanwhile_takes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Woken by its removal, an in-process worker's long poll must not take
    the job queued again from its inbox: it would run twice, as one attempt."""
    from gpulayer.service import fleet

    waiting, woken, go = threading.Event(), threading.Event(), threading.Event()
    wait_on = fleet.wait_on

    def wait_then_hold(lock: threading.Lock, signal: Signal, timeout: float | None) -> bool:
        waiting.set()  # the plane's lock is held until wait_on has subscribed
        fired = wait_on(lock, signal, timeout)
        lock.release()  # the removal happens here, before the poll goes on
        woken.set()
        assert go.wait(30)
        lock.acquire()
        return fired

    monkeypatch.setattr(fleet, "wait_on", wait_then_hold)
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="test")
        wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
        polled: list[list[Instruction]] = []
        poll = threading.Thread(target=lambda: polled.append(plane.acquire(wid, 30)))
        poll.start()
        assert waiting.wait(30)
        job = plane.submit(parse_spec({"command": ["x"]}))  # placed in its inbox: it wakes
        assert woken.wait(30)
        assert plane.reap(-1.0) == [wid]
        go.set()
        poll.join(30)
        assert polled == [[]]
        assert plane.get(job.id).state == "queued"
    finally:
        go.set()
        store.close()


def _placed_and_taken(plane: ControlPlane, **spec: object) -> tuple[str, str]:
    """A job placed on a worker, which took it: (job id, worker id)."""
    from gpulayer.spec import parse_spec

    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    job = plane.submit(parse_spec({"command": ["x"], **spec}))
    assert plane.take_instructions(wid)
    return job.id, wid


def test_a_job_given_back_keeps_its_attempts_across_a_restart(tmp_path: Path) -> None:
    from gpulayer.jobs import RunTask, TaskResult

    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="dead")
        job_id, wid = _placed_and_taken(plane, max_retries=1, retry_delay=0)
        plane.heartbeat(wid, stopping=True)
        plane.task_finished(TaskResult(job_id=job_id, attempt=1, worker_id=wid, outcome="returned"))
        # The control plane dies; its successor finds the job queued, no attempt spent.
        successor = ControlPlane(store, instance_id="successor")
        successor.recover("dead", workers_outlive=True)
        other = successor.register_worker(WorkerInfo(id="", name="o", host="o", slot_gpus=[None]))
        (task,) = successor.take_instructions(other.id)
        assert isinstance(task, RunTask) and task.attempt == 1
        failed = TaskResult(
            job_id=job_id, attempt=1, worker_id=other.id, outcome="exited", exit_code=1
        )
        successor.task_finished(failed)
        assert successor.get(job_id).state == "running"  # its one retry, still owed
    finally:
        store.close()


def test_a_job_cancelled_by_another_process_and_given_back_ends_cancelled(tmp_path: Path) -> None:
    from gpulayer.jobs import TaskResult

    store = SqliteStore(tmp_path / "db.sqlite")
    other_store = SqliteStore(tmp_path / "db.sqlite")  # another process on the same home
    try:
        plane = ControlPlane(store, instance_id="owner")
        job_id, wid = _placed_and_taken(plane)
        ControlPlane(other_store, instance_id="other").cancel(job_id)  # only in the store
        plane.heartbeat(wid, stopping=True)
        plane.task_finished(TaskResult(job_id=job_id, attempt=1, worker_id=wid, outcome="returned"))
        assert plane.get(job_id).state == "cancelled"
    finally:
        other_store.close()
        store.close()


def test_a_cancel_from_another_process_an_instant_before_a_give_back_holds(
    tmp_path: Path,
) -> None:
    """The other process's cancel lands just before the give-back's
    transaction: the job ends cancelled, and runs no more."""
    from gpulayer.jobs import TaskResult

    store = SqliteStore(tmp_path / "db.sqlite")
    other_store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="owner")
        other = ControlPlane(other_store, instance_id="other")
        job_id, wid = _placed_and_taken(plane)
        idle = plane.register_worker(WorkerInfo(id="", name="i", host="i", slot_gpus=[None])).id
        plane.heartbeat(wid, stopping=True)
        transaction = store.transaction

        def cancelled_elsewhere_first() -> object:
            other.cancel(job_id)
            store.transaction = transaction  # type: ignore[method-assign]
            return transaction()

        store.transaction = cancelled_elsewhere_first  # type: ignore[method-assign, assignment]
        plane.task_finished(TaskResult(job_id=job_id, attempt=1, worker_id=wid, outcome="returned"))
        assert plane.get(job_id).state == "cancelled"
        assert plane.take_instructions(idle) == []
    finally:
        other_store.close()
        store.close()


def test_a_job_cancelled_elsewhere_ends_cancelled_when_its_worker_leaves(tmp_path: Path) -> None:
    from gpulayer.spec import parse_spec

    store = SqliteStore(tmp_path / "db.sqlite")
    other_store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="owner")
        wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
        job = plane.submit(parse_spec({"command": ["x"], "max_retries": 2}))  # never taken
        ControlPlane(other_store, instance_id="other").cancel(job.id)  # only in the store
        plane.unregister_worker(wid, said=True)
        assert plane.get(job.id).state == "cancelled"
        idle = plane.register_worker(WorkerInfo(id="", name="i", host="i", slot_gpus=[None])).id
        assert plane.take_instructions(idle) == []  # not retried
    finally:
        other_store.close()
        store.close()


def _one_slot(plane: ControlPlane) -> WorkerInfo:
    return plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None]))


def _ended(job_id: str, worker_id: str) -> TaskResult:
    return TaskResult(job_id=job_id, attempt=1, worker_id=worker_id, outcome="exited", exit_code=0)


def _job_ids(items: object) -> list[str]:
    return [item.job_id for item in items]  # type: ignore[attr-defined]


def test_a_submit_retried_with_its_id_stores_and_places_the_job_once(plane: ControlPlane) -> None:
    wid = _one_slot(plane).id
    spec = parse_spec({"command": ["true"]})
    placed, queued = new_id(), new_id()
    first = plane.submit(spec, placed)
    assert plane.submit(spec, placed) == first  # the reply was lost; the client asks again
    plane.submit(spec, queued)  # the one slot is taken: this one waits
    assert plane.submit(spec, queued).state == "queued"

    assert sorted(j.id for j in plane.list_jobs()) == sorted([placed, queued])
    assert _job_ids(plane.take_instructions(wid)) == [placed]  # placed once
    with pytest.raises(InvalidStateError, match="different spec"):
        plane.submit(parse_spec({"command": ["false"]}), queued)
    assert [j.id for j in plane.list_jobs(states=["queued"])] == [queued]

    # The queued one is still queued in memory too: the slot frees, it runs.
    plane.task_finished(_ended(placed, wid))
    assert _job_ids(plane.take_instructions(wid)) == [queued]
    assert plane.get(placed).state == "succeeded"


def test_a_finish_takes_the_next_task_without_waking_the_long_poll(plane: ControlPlane) -> None:
    wid = _one_slot(plane).id
    first, second = (plane.submit(parse_spec({"command": ["true"]})).id for _ in range(2))
    taken = plane.take_delivery(wid)
    assert taken is not None and _job_ids(taken.items) == [first]
    woken: list[bool] = []
    _, unsubscribe, _ = plane.watch_worker(wid, lambda: woken.append(True), numbered=True)
    assert unsubscribe is not None  # the long poll waits

    delivery = plane.finish_and_take(_ended(first, wid), ack=taken.first)

    assert delivery is not None
    assert [type(item) for item in delivery.items] == [RunTask]
    assert _job_ids(delivery.items) == [second]
    assert woken == []  # the reply brings it; the long poll has nothing to wake for
    assert plane.get(first).state == "succeeded"


def test_a_finish_from_an_old_registration_wakes_the_new_long_poll(plane: ControlPlane) -> None:
    info = _one_slot(plane)
    first, second = (plane.submit(parse_spec({"command": ["true"]})).id for _ in range(2))
    plane.take_delivery(info.id)
    old = plane.generation(info.id)
    plane.register_worker(info, [(first, 1)])  # it came back, still running the first
    woken: list[bool] = []
    _, unsubscribe, _ = plane.watch_worker(info.id, lambda: woken.append(True), numbered=True)
    assert unsubscribe is not None

    assert plane.finish_and_take(_ended(first, info.id), old) is None  # the old registration's

    assert woken == [True]  # the second job waits for the new long poll, which wakes
    assert _job_ids(plane.take_instructions(info.id)) == [second]


@pytest.mark.parametrize("code", [0, 1])  # a job that ends; one that fails and is retried
def test_a_result_the_store_refused_applies_when_sent_again(plane: ControlPlane, code: int) -> None:
    wid = _one_slot(plane).id
    spec = parse_spec({"command": ["true"], "max_retries": 1, "retry_delay": 0})
    job, waiting = plane.submit(spec).id, plane.submit(spec).id
    assert _job_ids(plane.take_instructions(wid)) == [job]
    ended = TaskResult(job_id=job, attempt=1, worker_id=wid, outcome="exited", exit_code=code)

    refuse_commits(plane.store)
    with pytest.raises(StoreError, match="disk is full"):
        plane.task_finished(ended)
    # Nothing changed: the job still runs on its slot, the other still waits.
    assert plane.get(job).state == "running"
    assert plane.take_instructions(wid) == []
    assert [j.id for j in plane.list_jobs(states=["queued"])] == [waiting]

    plane.task_finished(ended)  # the worker's report, sent again
    after = plane.get(job)
    if code == 0:
        assert after.state == "succeeded"
        assert _job_ids(plane.take_instructions(wid)) == [waiting]  # the freed slot's next job
    else:  # retried once, first in line again (it was submitted first)
        assert (after.state, after.attempt) == ("running", 2)
        assert _job_ids(plane.take_instructions(wid)) == [job]
        assert [j.id for j in plane.list_jobs(states=["queued"])] == [waiting]


def test_a_cancel_the_store_refused_leaves_the_job_as_it_was(plane: ControlPlane) -> None:
    wid = _one_slot(plane).id
    running, queued = (plane.submit(parse_spec({"command": ["true"]})).id for _ in range(2))
    assert _job_ids(plane.take_instructions(wid)) == [running]

    for job_id in (queued, running):
        refuse_commits(plane.store)
        with pytest.raises(StoreError):
            plane.cancel(job_id)
    assert plane.take_instructions(wid) == []  # no cancel went to the worker
    plane.task_finished(_ended(running, wid))
    assert plane.get(running).state == "succeeded"  # not "cancelled": that was refused
    assert _job_ids(plane.take_instructions(wid)) == [queued]  # still queued, and placed now


def test_a_give_back_the_store_refused_applies_when_sent_again(plane: ControlPlane) -> None:
    wid = _one_slot(plane).id
    job = plane.submit(parse_spec({"command": ["true"]})).id
    assert _job_ids(plane.take_instructions(wid)) == [job]
    back = TaskResult(job_id=job, attempt=1, worker_id=wid, outcome="returned")  # it stops

    refuse_commits(plane.store)
    with pytest.raises(StoreError):
        plane.task_finished(back)
    assert plane.get(job).state == "running"

    plane.task_finished(back)  # sent again
    stored = plane.get(job)
    assert (stored.state, stored.attempt) == ("queued", 0)  # given back, no attempt spent
