"""Jobs after jobs: ``after`` (it waits for them to succeed, and is
cancelled, saying why, when one cannot) and ``after_any`` (to end)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gpulayer
from gpulayer.access import Viewer
from gpulayer.errors import InvalidStateError, SpecError
from gpulayer.jobs import RunTask, TaskResult, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore


def test_a_job_after_another_runs_once_it_succeeds(client: gpulayer.Client) -> None:
    first = client.submit(command=["sh", "-c", "sleep 0.2; echo first"], name="first")
    second = client.submit(command=["echo", "second"], after=[first])
    assert second.wait(timeout=60) == "succeeded"
    assert first.wait(timeout=60) == "succeeded"
    assert second.info.marks["placed"] >= first.info.marks["finished"]
    assert second.info.spec.after == [first.id]


def test_a_job_after_a_failed_one_is_cancelled_saying_why_and_so_is_what_follows(
    client: gpulayer.Client,
) -> None:
    failing = client.submit(command=["sh", "-c", "exit 3"])
    then = client.submit(command=["echo", "never"], after=[failing.id[:8]])  # a prefix will do
    last = client.submit(command=["echo", "never either"], after=[then])
    either = client.submit(command=["echo", "ran"], after_any=[failing])
    assert failing.wait(timeout=60) == "failed"
    assert then.wait(timeout=60) == "cancelled"
    assert then.info.reason == (
        f"cancelled: job {failing.id}, which it was to run after (--after), ended failed; "
        "it can no longer run as asked"
    )
    assert last.wait(timeout=60) == "cancelled" and then.id in (last.info.reason or "")
    assert either.wait(timeout=60) == "succeeded"


def test_a_job_after_one_that_already_failed_is_refused_and_nothing_is_stored(
    client: gpulayer.Client,
) -> None:
    failed = client.submit(command=["sh", "-c", "exit 1"])
    assert failed.wait(timeout=60) == "failed"
    before = len(client.jobs())
    with pytest.raises(InvalidStateError, match=f"job {failed.id} has already ended failed"):
        client.submit(command=["echo", "x"], after=[failed])
    assert len(client.jobs()) == before
    ok = client.submit(command=["echo", "x"], after_any=[failed])  # whatever its end
    assert ok.wait(timeout=60) == "succeeded"


def test_bad_dependencies_are_refused_in_plain_words(client: gpulayer.Client) -> None:
    with pytest.raises(SpecError, match=r"after\[0\]: a job id \(or its start\) is 1 to 14"):
        client.submit(command=["true"], after=["../../etc"])
    with pytest.raises(SpecError, match=r"after\[0\]: no job with id 'zzzzzzzzzzzzzz'"):
        client.submit(command=["true"], after=["zzzzzzzzzzzzzz"])
    with pytest.raises(SpecError, match=r"after_any: give a job, a job id or a list"):
        client.submit(command=["true"], after_any=5)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=r"after\[1\]: give a job or a job id, not 5"):
        client.submit(command=["true"], after=["0" * 14, 5])  # type: ignore[list-item]
    with pytest.raises(SpecError, match="preemptible"):
        client.submit(command=["true"], preemptible="no")  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="at most 100 jobs to wait for"):
        client.submit(command=["true"], after_any=["0" * 14] * 101)


def _worker(plane: ControlPlane) -> str:
    return plane.register_worker(WorkerInfo(id="", name="w", host="w", slot_gpus=[None])).id


def _finish(plane: ControlPlane, task: RunTask, worker_id: str, code: int = 0) -> None:
    plane.task_finished(
        TaskResult(
            job_id=task.job_id,
            attempt=task.attempt,
            worker_id=worker_id,
            outcome="exited",
            exit_code=code,
        )
    )


def test_a_waiting_job_says_what_it_waits_for(plane: ControlPlane) -> None:
    first = plane.submit(parse_spec({"command": ["a"]}))  # no worker: it waits
    second = plane.submit(parse_spec({"command": ["b"], "after": [first.id]}))
    assert plane.get(second.id).reason == f"waiting for job {first.id} to succeed"
    w = _worker(plane)
    (task,) = plane.take_instructions(w)  # the first only, though the worker has room
    assert isinstance(task, RunTask) and task.job_id == first.id
    assert plane.get(second.id).state == "queued"


def test_no_one_can_wait_on_a_job_they_may_not_see(plane: ControlPlane) -> None:
    theirs = plane.submit(parse_spec({"command": ["x"]}), viewer=Viewer("ada"))
    with pytest.raises(SpecError, match=f"after\\[0\\]: no job with id {theirs.id!r}"):
        plane.submit(parse_spec({"command": ["y"], "after": [theirs.id]}), viewer=Viewer("eve"))
    assert plane.list_jobs(viewer=Viewer("eve")) == []


def test_what_waits_survives_a_restart_of_the_control_plane(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    store = SqliteStore(path)
    before = ControlPlane(store, instance_id="s1")
    first = before.submit(parse_spec({"command": ["a"]}))
    second = before.submit(parse_spec({"command": ["b"], "after": [first.id]}))
    store.close()
    store = SqliteStore(path)
    try:
        after = ControlPlane(store, instance_id="s2")
        after.recover("s1", workers_outlive=True)  # a server's restart
        w = _worker(after)
        (task,) = after.take_instructions(w)
        assert isinstance(task, RunTask) and task.job_id == first.id
        assert after.get(second.id).reason == f"waiting for job {first.id} to succeed"
        _finish(after, task, w)
        # Released by the pass its end sets off (a moment later, on a timer).
        assert after.wait(first.id, timeout=10).state == "succeeded"
        (nxt,) = _take_within(after, w)
        assert isinstance(nxt, RunTask) and nxt.job_id == second.id
        after.close_workers()
    finally:
        store.close()


def _take_within(plane: ControlPlane, worker_id: str) -> list[object]:
    """The worker's next instructions, by its long poll (woken when placed)."""
    return list(plane.acquire(worker_id, timeout=10))
