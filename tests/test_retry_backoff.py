"""A retry waits out its back-off: rules, placement, the log line, a restart."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulayer import defaults
from gpulayer.errors import SpecError
from gpulayer.jobs import RunTask, TaskResult, WorkerInfo
from gpulayer.scheduler import Capacity, Request, explain, place, retry_wait
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore


def test_the_wait_doubles_from_the_default_or_the_given_delay_up_to_the_cap() -> None:
    assert [retry_wait(None, n) for n in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert retry_wait(None, 40) == defaults.RETRY_DELAY_MAX_S
    assert [retry_wait(0.5, n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0]
    assert retry_wait(0, 5) == 0  # 0: at once, every time
    # A first wait longer than the cap is kept, not cut, and not doubled past it.
    assert retry_wait(600, 1) == retry_wait(600, 4) == 600


def test_a_job_backing_off_is_passed_over_and_holds_no_worker() -> None:
    cap = Capacity("w", (None,), frozenset({0}))
    held = Request("held", priority=9, seq=1, not_before=100.0)
    later = Request("later", priority=0, seq=2)
    # Before its time the later, lower job takes the only slot: nothing reserved it.
    assert [a.job_id for a in place([held, later], [cap], now=99.0)] == ["later"]
    assert "back-off" in explain(held, [cap], now=99.0)
    assert [a.job_id for a in place([held, later], [cap], now=100.0)] == ["held"]


@pytest.mark.parametrize("value", [-1, float("inf"), 2 * 24 * 3600.0, "soon", True])
def test_a_bad_retry_delay_is_refused_naming_it(plane: ControlPlane, value: object) -> None:
    with pytest.raises(SpecError) as info:
        plane.submit(parse_spec({"command": ["x"], "max_retries": 1, "retry_delay": value}))
    assert info.value.field == "retry_delay"
    assert plane.list_jobs() == []  # nothing stored


def _worker(plane: ControlPlane) -> str:
    return plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id


def _fail(plane: ControlPlane, job_id: str, wid: str, attempt: int) -> None:
    plane.task_finished(
        TaskResult(job_id=job_id, attempt=attempt, worker_id=wid, outcome="exited", exit_code=1)
    )


def test_a_retry_waits_its_delay_with_no_placement_meanwhile_and_says_so(
    plane: ControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpulayer.service.core as core

    passes: list[float] = []

    def counted(*args: object, **kwargs: object) -> object:
        passes.append(time.monotonic())
        return place(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(core, "place", counted)
    wid = _worker(plane)
    spec = parse_spec({"command": ["x"], "max_retries": 2, "retry_delay": 0.4})
    job = plane.submit(spec).id
    assert plane.take_instructions(wid)
    failed_at = time.time()
    _fail(plane, job, wid, 1)
    record = plane.get(job)
    assert record.state == "queued" and "back-off" in (record.reason or "")
    assert record.marks["retry_at"] == pytest.approx(failed_at + 0.4, abs=0.1)
    assert plane.take_instructions(wid) == []  # the slot is free, yet it waits
    before = len(passes)
    (task,) = plane.acquire(wid, timeout=10)  # the worker's long poll: woken when it is placed
    assert isinstance(task, RunTask) and task.attempt == 2
    assert time.time() >= record.marks["retry_at"]
    # One pass when the back-off ended, none spinning while it ran.
    assert len(passes) - before == 1
    lines = [line for line in plane.read_logs(job).lines if line.stream == "system"]
    assert [line.text for line in lines] == [
        "gpulayer: attempt 2 of 3 (after: exited with code 1), waiting 0.4 s"
    ]
    _fail(plane, job, wid, 2)  # the next waits twice as long
    assert plane.get(job).marks["retry_at"] - time.time() == pytest.approx(0.8, abs=0.15)
    plane.close_workers()  # its timer goes: nothing is placed after
    assert plane.acquire(wid, timeout=1.2) == []


def test_a_retry_delay_of_zero_retries_at_once(plane: ControlPlane) -> None:
    wid = _worker(plane)
    job = plane.submit(parse_spec({"command": ["x"], "max_retries": 1, "retry_delay": 0})).id
    assert plane.take_instructions(wid)
    _fail(plane, job, wid, 1)
    (task,) = plane.take_instructions(wid)
    assert isinstance(task, RunTask) and task.attempt == 2


def test_the_back_off_holds_through_a_restart_of_the_control_plane(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        first = ControlPlane(store, instance_id="dead")
        wid = _worker(first)
        spec = parse_spec({"command": ["x"], "max_retries": 1, "retry_delay": 1.0})
        job = first.submit(spec).id
        assert first.take_instructions(wid)
        _fail(first, job, wid, 1)
        retry_at = store.get_job(job).marks["retry_at"]  # type: ignore[union-attr]
        first.close_workers()  # it dies: its timer with it

        successor = ControlPlane(store, instance_id="successor")
        try:
            successor.recover("dead", workers_outlive=True)
            other = _worker(successor)
            assert successor.take_instructions(other) == []  # still backing off
            assert "back-off" in (successor.get(job).reason or "")
            (task,) = successor.acquire(other, timeout=10)
            assert isinstance(task, RunTask) and task.attempt == 2
            assert time.time() >= retry_at
        finally:
            successor.close_workers()
    finally:
        store.close()


def test_run_marks_each_new_attempt_in_its_streamed_log(tmp_path: Path) -> None:
    env = {**os.environ, "GPULAYER_HOME": str(tmp_path / "home")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", "run", "--retries", "1", "--",
         sys.executable, "-c", "import os; print('try', os.environ['GPULAYER_ATTEMPT']); exit(3)"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout == "try 1\ntry 2\n"
    # The default back-off: a second before the first retry.
    assert "gpulayer: attempt 2 of 2 (after: exited with code 3), waiting 1.0 s" in done.stderr
    assert time.monotonic() - started >= defaults.RETRY_DELAY_S
