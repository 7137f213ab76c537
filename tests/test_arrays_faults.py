"""Arrays under attack: what an adversarial review proved broken, each
fixed and kept here (retried submits, gc during a sweep, release order,
cancels from another process, waits, big arrays, hostile words)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

import gpulayer
from gpulayer.arrays import parse_array, split_task
from gpulayer.cli.jobs import logs as logs_command
from gpulayer.errors import (
    GPUlayerError,
    SpecError,
    WaitTimeout,  # noqa: F401
)
from gpulayer.ids import new_id
from gpulayer.jobs import LogLine, RunTask
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore
from teams_kit import ADA, EVE, Clock, gpu_worker, job, make_lab, report


# ---- An array after another job: its tasks are released by index.
def test_an_array_after_a_job_starts_its_first_indices_first(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 8)
    first = plane.submit(job(1), viewer=ADA)
    (running,) = plane.take_instructions(w)
    assert isinstance(running, RunTask) and running.job_id == first.id
    plane.submit(job(1, array=list(range(20)), after=[first.id], max_parallel=2), viewer=ADA)
    report(plane, running, w)
    got = list(plane.acquire(w, timeout=10))
    while len(got) < 2:
        got += list(plane.acquire(w, timeout=10))
    indices = sorted(t.spec.array_task.index for t in got)  # type: ignore[union-attr]
    assert indices == [0, 1]


# ---- A number for array (a job file, submit(array=8)) is refused naming it.
def test_submit_with_a_number_for_array_is_refused_naming_it(tmp_path: Path) -> None:
    with (
        gpulayer.Client(home=tmp_path / "home", auto_worker=False) as client,
        pytest.raises(SpecError, match="array"),
    ):
        client.submit(command=["true"], array=8)  # type: ignore[arg-type]


def test_a_job_file_whose_array_is_a_number_is_refused_in_words(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text('command: ["true"]\narray: 8\n')
    env = {**os.environ, "GPULAYER_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", "run", "-f", str(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    assert "array" in done.stderr


# ---- An array cancelled by another process on the home ends, GPUs busy or not.
def test_an_array_cancelled_elsewhere_ends_though_gpus_are_busy(tmp_path: Path) -> None:
    a = ControlPlane(SqliteStore(tmp_path / "db.sqlite"), instance_id="a")
    b = ControlPlane(SqliteStore(tmp_path / "db.sqlite"), instance_id="b")
    w = gpu_worker(a, 1)
    array = a.submit(job(1, array=[0, 1, 2], max_parallel=1))
    (first,) = a.take_instructions(w)
    other = a.submit(job(1))  # waits for the one GPU
    b.cancel(array.id)  # `gpulayer cancel ARRAY` in another process
    report(a, first, w, outcome="cancelled", code=-15)  # its process was killed
    (nxt,) = list(a.acquire(w, timeout=10))
    assert isinstance(nxt, RunTask) and nxt.job_id == other.id  # the other job runs on
    assert a.get(array.id).array_states == {"cancelled": 3}  # every task is final
    final = a.wait(array.id, timeout=3)
    assert final.state == "cancelled", (final.state, final.reason)


# ---- gc keeps the ended tasks of an array still running: its end counts them.
def test_gc_while_an_array_runs_does_not_change_how_it_ends(tmp_path: Path) -> None:
    clock = Clock()
    plane = make_lab(tmp_path, clock)
    w = gpu_worker(plane, 2)
    array = plane.submit(job(1, array=[0, 1]), viewer=ADA)
    one, two = plane.take_instructions(w)
    assert isinstance(one, RunTask) and isinstance(two, RunTask)
    report(plane, one, w, code=3)  # task 0 fails
    clock.now += 30 * 86400  # a long sweep: task 1 runs on for a month
    with plane.store.transaction() as tx:  # `gpulayer gc` (older than a week)
        tx.delete_jobs_ended_before(clock.now - 7 * 86400)
    report(plane, two, w)
    final = plane.wait(array.id, timeout=10, viewer=ADA)
    assert final.state == "failed", final.reason


# ---- A task held back by max_parallel says so, not that it waits for GPUs.
def test_a_held_task_says_it_waits_for_its_array_s_limit(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 8)
    array = plane.submit(job(1, array=[0, 1, 2], max_parallel=1), viewer=ADA)
    assert len(plane.take_instructions(w)) == 1
    held = plane.list_jobs(array=array.id, viewer=ADA)[1]
    assert held.state == "queued"
    assert "busy" not in (held.reason or ""), held.reason
    assert "at most 1" in (held.reason or "") or "max_parallel" in (held.reason or "")


# ---- Hostile words for arrays get a plain error, never a ValueError (a 500).
@pytest.mark.parametrize("text", ["0%²", "1" * 5000, "0-9%" + "9" * 5000, "0-" + "9" * 5000])
def test_parse_array_refuses_hostile_digits_with_a_spec_error(text: str) -> None:
    with pytest.raises(SpecError):
        parse_array(text)


@pytest.mark.parametrize("ref", ["0123abcd:²", "0123abcd:" + "1" * 5000])
def test_split_task_refuses_hostile_digits_with_a_gpulayer_error(ref: str) -> None:
    with pytest.raises(GPUlayerError):
        split_task(ref)


def test_a_url_s_job_colon_superscript_is_not_found_not_a_crash(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    with pytest.raises(GPUlayerError):  # the HTTP app maps GPUlayerError; ValueError is a 500
        plane.get("0123abcd:²", ADA)


# ---- `gpulayer logs ARRAY` shows every task, past the 1,000 of a listing.
N = 1005


def test_logs_of_an_array_shows_every_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with gpulayer.Client(home=tmp_path / "home", auto_worker=False) as client:
        plane = client.transport.plane  # type: ignore[attr-defined]
        w = gpu_worker(plane, 64)
        array = client.submit(command=["x"], gpus=1, array=range(N))
        done = 0
        while done < N:
            for task in plane.take_instructions(w):
                assert isinstance(task, RunTask)
                with plane.store.transaction() as tx:
                    index = task.spec.array_task.index  # type: ignore[union-attr]
                    tx.append_logs(
                        task.job_id, task.attempt, [LogLine(1, 0.0, "stdout", str(index))]
                    )
                report(plane, task, w)
                done += 1
        assert array.wait(timeout=30) == "succeeded"
        with click.Context(logs_command, obj={"client": client}) as ctx:
            ctx.invoke(logs_command, job_id=array.id, follow=False, tail=None, as_json=False)
        shown = capsys.readouterr().out.splitlines()
        assert len(shown) == N


# ---- A retried submit of an array (the same id) leaves it running.
def test_a_retried_array_submit_keeps_the_array_running(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 4)
    spec = job(1, array=[0, 1, 2], max_parallel=1)
    made = new_id()
    array = plane.submit(spec, job_id=made, viewer=ADA)
    again = plane.submit(spec, job_id=array.id, viewer=ADA)  # the client's retry
    assert again.id == array.id
    (first,) = plane.take_instructions(w)
    report(plane, first, w)
    nxt = list(plane.acquire(w, timeout=5))
    assert len(nxt) == 1, "the next held task was never released"


def test_another_user_s_submit_with_an_array_s_id_cannot_freeze_it(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 4)
    array = plane.submit(job(1, array=[0, 1, 2], max_parallel=1), viewer=ADA)
    # eve guesses/sees ada's array id (in a log, a URL) and submits with it
    mine = plane.submit(job(0, array=[0]), job_id=array.id, viewer=EVE)
    assert mine.id != array.id  # given an id of its own, as designed
    (first,) = [t for t in plane.take_instructions(w) if t.spec.array_task.array == array.id]
    report(plane, first, w)
    nxt = [t for t in plane.acquire(w, timeout=5) if t.spec.array_task.array == array.id]
    assert len(nxt) == 1, "ada's array was frozen by eve's submit"


# ---- wait() on an ended array gives its tasks by state.
def test_wait_on_an_ended_array_says_its_tasks_states(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        before = ControlPlane(store, instance_id="s1", clock=Clock())
        w = gpu_worker(before, 2)
        array = before.submit(job(0, array=[0, 1]))
        tasks = before.take_instructions(w)
        for task in tasks:
            assert isinstance(task, RunTask)
            report(before, task, w)
        assert before.wait(array.id, timeout=10).array_states == {"succeeded": 2}
        after = ControlPlane(store, instance_id="s2")  # a restart, or another process
        after.recover("s1", workers_outlive=True)
        assert after.get(array.id).array_states == {"succeeded": 2}
        assert after.wait(array.id, timeout=10).array_states == {"succeeded": 2}
        found, _ = after.finals([array.id])
        assert found[0].array_states == {"succeeded": 2}
    finally:
        store.close()
