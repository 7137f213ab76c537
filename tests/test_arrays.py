"""Arrays (sweeps): one job id, a task per index, at most N running at once,
one row in a listing, JOB:7 for one task; through a restart too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpulayer
from gpulayer.arrays import MAX_ARRAY_TASKS, parse_array, split_task, tally
from gpulayer.errors import InvalidStateError, JobNotFoundError, SpecError
from gpulayer.jobs import RunTask, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore
from teams_kit import ADA, ADMIN, EVE, Clock, gpu_worker, job, make_lab, report

# ---- the words ---------------------------------------------------------


def test_slurm_s_array_syntax_is_read_as_slurm_reads_it() -> None:
    assert parse_array("0-99%8") == (list(range(100)), 8)
    assert parse_array("1,3,5-7") == ([1, 3, 5, 6, 7], None)
    assert parse_array("0-20:5") == ([0, 5, 10, 15, 20], None)
    assert parse_array(" 4 ") == ([4], None)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "neither an index nor a range"),
        ("a-b", "'a-b' is neither an index nor a range"),
        ("5-1", "'5-1' ends before it starts"),
        ("0-9:0", "needs a step of 1 or more"),
        ("0-9%0", "after % comes how many tasks may run at once"),
        ("0-9%x", "after % comes how many tasks may run at once"),
        ("0-10000", f"at most {MAX_ARRAY_TASKS} tasks"),
        ("0-9999999", "an index is at most 999999"),
        ("-1", "neither an index nor a range"),
    ],
)
def test_a_bad_array_is_refused_naming_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(SpecError, match="array: .*" + words.replace("(", r"\(")):
        parse_array(text)


@given(st.lists(st.integers(0, 999), min_size=1, max_size=20, unique=True))
@settings(max_examples=50, deadline=None)
def test_a_list_of_indices_reads_back_as_itself(indices: list[int]) -> None:
    assert parse_array(",".join(map(str, indices))) == (indices, None)


def test_one_task_is_named_as_the_array_and_its_index() -> None:
    assert split_task("0123abcd:7") == ("0123abcd", 7)
    assert split_task("0123abcd") == ("0123abcd", None)
    for bad in ("0123:x", "0123:-1", "0123:", "0123:1:2", "../x:1", "0123:\u0663", "å:1"):
        with pytest.raises(JobNotFoundError, match="as in 1m8tw4bp:7"):
            split_task(bad)


def test_a_spec_s_array_is_checked() -> None:
    with pytest.raises(SpecError, match=r"array\[2\]: index 1 is given twice"):
        parse_spec({"command": ["x"], "array": [0, 1, 1]})
    with pytest.raises(SpecError, match="max_parallel: limits the tasks of an array"):
        parse_spec({"command": ["x"], "max_parallel": 2})
    with pytest.raises(SpecError, match="array"):
        parse_spec({"command": ["x"], "array": [-1]})


def test_a_submit_cannot_pretend_to_be_another_array_s_task(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    theirs = plane.submit(job(array=[0, 1]), viewer=EVE)
    forged = {"command": ["x"], "array_task": {"array": theirs.id, "index": 0}}
    with pytest.raises(SpecError, match="array_task: is set by GPUlayer"):
        plane.submit(parse_spec(forged), viewer=ADA)
    assert plane.list_jobs(array=theirs.id, viewer=ADMIN)[0].user == "eve"
    assert len(plane.list_jobs(viewer=ADMIN)) == 1


# ---- in the control plane -------------------------------------------------


def _tasks(plane: ControlPlane, worker: str) -> list[RunTask]:
    found = plane.take_instructions(worker)
    assert all(isinstance(t, RunTask) for t in found)
    return found  # type: ignore[return-value]


def _take_within(plane: ControlPlane, worker: str) -> list[RunTask]:
    """The worker's next instructions, by its long poll (woken when placed)."""
    return list(plane.acquire(worker, timeout=10))  # type: ignore[arg-type]


def test_at_most_max_parallel_tasks_run_and_the_next_by_index_follows(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 8)
    array = plane.submit(job(1, array=list(range(10)), max_parallel=3), viewer=ADA)
    assert array.state == "running"
    first = _tasks(plane, w)
    assert [t.spec.array_task.index for t in first] == [0, 1, 2]  # type: ignore[union-attr]
    assert {t.spec.array_task.array for t in first} == {array.id}  # type: ignore[union-attr]
    shown = plane.get(array.id, ADA)
    assert shown.array_states == {"running": 3, "queued": 7}
    assert shown.reason == "tasks: 7 queued, 3 running (at most 3 at once)"
    seen = [0, 1, 2]
    running = first
    while running:
        report(plane, running.pop(0), w)
        running += _take_within(plane, w) if len(seen) < 10 else []
        seen = sorted({*seen, *(t.spec.array_task.index for t in running)})  # type: ignore[union-attr]
        assert len(running) <= 3
    assert seen == list(range(10))
    final = plane.wait(array.id, timeout=10, viewer=ADA)
    assert final.state == "succeeded"
    assert plane.get(array.id, ADA).array_states == {"succeeded": 10}


def test_an_array_is_one_row_in_a_listing_and_its_tasks_are_listed_by_index(
    tmp_path: Path,
) -> None:
    plane = make_lab(tmp_path, Clock())
    single = plane.submit(job(0), viewer=ADA)
    array = plane.submit(job(0, array=[5, 6, 7]), viewer=ADA)
    listed = plane.list_jobs(viewer=ADA)
    assert [j.id for j in listed] == [array.id, single.id]
    assert listed[0].array_states == {"queued": 3}
    tasks = plane.list_jobs(array=array.id, viewer=ADA)
    assert [t.spec.array_task.index for t in tasks] == [5, 6, 7]  # type: ignore[union-attr]
    assert all(t.spec.project == "vision" and t.user == "ada" for t in tasks)
    assert plane.store.count_by_state() == {"queued": 4}  # the tasks and the single job


def test_one_task_is_named_job_colon_index_and_others_get_404(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    array = plane.submit(job(0, array=[3, 9]), viewer=ADA)
    task = plane.get(f"{array.id[:6]}:9", ADA)
    assert task.spec.array_task is not None and task.spec.array_task.index == 9
    with pytest.raises(JobNotFoundError, match=f"array {array.id} has no task 4"):
        plane.get(f"{array.id}:4", ADA)
    with pytest.raises(JobNotFoundError, match=f"no job with id {array.id!r}"):
        plane.get(f"{array.id}:9", EVE)  # not eve's: as if it did not exist
    single = plane.submit(job(0), viewer=ADA)
    with pytest.raises(JobNotFoundError, match="is not an array"):
        plane.get(f"{single.id}:0", ADA)


def test_cancelling_the_array_cancels_every_task_and_ends_it(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 2)
    array = plane.submit(job(1, array=list(range(6)), max_parallel=2), viewer=ADA)
    running = _tasks(plane, w)
    assert len(running) == 2
    plane.cancel(array.id, ADA)
    cancels = plane.take_instructions(w)
    assert {c.job_id for c in cancels} == {t.job_id for t in running}
    for task in running:
        report(plane, task, w, outcome="cancelled", code=-15)
    final = plane.wait(array.id, timeout=10, viewer=ADA)
    assert final.state == "cancelled"
    assert final.array_states == {"cancelled": 6} or plane.get(array.id, ADA).array_states == {
        "cancelled": 6
    }
    assert plane.take_instructions(w) == []  # nothing held back was released
    with pytest.raises(InvalidStateError, match="already cancelled"):
        plane.cancel(array.id, ADA)


def test_cancelling_one_task_leaves_the_rest_and_the_array_says_so(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 1)
    array = plane.submit(job(1, array=[0, 1, 2], max_parallel=1), viewer=ADA)
    (first,) = _tasks(plane, w)
    plane.cancel(f"{array.id}:2", ADA)  # held back: cancelled where it waits
    report(plane, first, w)
    (second,) = _take_within(plane, w)
    assert second.spec.array_task.index == 1  # type: ignore[union-attr]
    report(plane, second, w)
    final = plane.wait(array.id, timeout=10, viewer=ADA)
    assert final.state == "cancelled"
    assert final.reason == "1 of 3 tasks cancelled (2 succeeded, 1 cancelled)"


def test_a_failed_task_fails_the_array_once_every_task_has_ended(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 2)
    array = plane.submit(job(1, array=[0, 1]), viewer=ADA)
    one, two = _tasks(plane, w)
    report(plane, one, w, code=3)
    assert plane.get(array.id, ADA).state == "running"  # the other still runs
    report(plane, two, w)
    final = plane.wait(array.id, timeout=10, viewer=ADA)
    assert final.state == "failed"
    assert final.reason == "1 of 2 tasks did not succeed (1 succeeded, 1 failed)"


def test_a_retried_task_keeps_its_place_and_does_not_let_another_start(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 4)
    array = plane.submit(
        job(1, array=[0, 1, 2], max_parallel=1, max_retries=1, retry_delay=0), viewer=ADA
    )
    (first,) = _tasks(plane, w)
    report(plane, first, w, code=1)  # retried at once: still the one released
    (again,) = _tasks(plane, w)
    assert (again.job_id, again.attempt) == (first.job_id, 2)
    assert plane.get(array.id, ADA).array_states == {"running": 1, "queued": 2}


def test_a_job_after_an_array_waits_for_all_of_it(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    w = gpu_worker(plane, 2)
    array = plane.submit(job(1, array=[0, 1]), viewer=ADA)
    after = plane.submit(job(1, after=[array.id]), viewer=ADA)
    one, two = _tasks(plane, w)
    report(plane, one, w)
    assert plane.get(after.id, ADA).reason == f"waiting for job {array.id} to succeed"
    report(plane, two, w)
    (nxt,) = _take_within(plane, w)
    assert nxt.job_id == after.id


def test_an_array_and_its_limit_survive_a_restart_of_the_control_plane(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    store = SqliteStore(path)
    before = ControlPlane(store, instance_id="s1")
    array = before.submit(job(0, array=list(range(5)), max_parallel=2))
    store.close()
    store = SqliteStore(path)
    try:
        after = ControlPlane(store, instance_id="s2")
        after.recover("s1", workers_outlive=True)
        w = gpu_worker(after, 4)
        got = _tasks(after, w)
        assert [t.spec.array_task.index for t in got] == [0, 1]  # type: ignore[union-attr]
        for task in got:
            report(after, task, w)
        done = 2
        while done < 5:
            nxt = _take_within(after, w)
            assert len(nxt) <= 2
            for task in nxt:
                report(after, task, w)
            done += len(nxt)
        assert after.wait(array.id, timeout=10).state == "succeeded"
        after.close_workers()
    finally:
        store.close()


def test_an_array_whose_end_was_not_stored_ends_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    store = SqliteStore(path)
    before = ControlPlane(store, instance_id="s1", clock=Clock())
    w = gpu_worker(before, 4)
    array = before.submit(job(0, array=[0]))
    (task,) = _tasks(before, w)
    before._settle_arrays = lambda now: None  # type: ignore[method-assign]  # "crashes" first
    report(before, task, w)
    assert before.store.get_job(array.id).state == "running"  # type: ignore[union-attr]
    store.close()
    store = SqliteStore(path)
    try:
        after = ControlPlane(store, instance_id="s2")
        after.recover("s1", workers_outlive=True)
        assert after.wait(array.id, timeout=10).state == "succeeded"
    finally:
        store.close()


def test_a_ten_thousand_task_array_is_one_submit(tmp_path: Path) -> None:
    plane = make_lab(tmp_path, Clock())
    array = plane.submit(job(1, array=list(range(MAX_ARRAY_TASKS)), max_parallel=8), viewer=ADA)
    assert plane.get(array.id, ADA).array_states == {"queued": MAX_ARRAY_TASKS}
    assert len(plane._waiting) == 8  # the scheduler sees no more than may run
    with pytest.raises(SpecError, match="at most 10000 tasks"):
        plane.submit(job(1, array=list(range(MAX_ARRAY_TASKS + 1))), viewer=ADA)


# ---- end to end --------------------------------------------------------


def test_each_task_reads_its_index_and_runs_embedded(client: gpulayer.Client) -> None:
    array = client.submit(
        command=["sh", "-c", 'echo "index=$GPULAYER_ARRAY_INDEX of $GPULAYER_ARRAY_JOB_ID"'],
        array=[2, 4, 6],
        max_parallel=2,
    )
    assert array.wait(timeout=60) == "succeeded"
    tasks = client.jobs(array=array.id)
    assert [t.info.spec.array_task.index for t in tasks] == [2, 4, 6]  # type: ignore[union-attr]
    for task in tasks:
        index = task.info.spec.array_task.index  # type: ignore[union-attr]
        assert client.job(f"{array.id}:{index}").logs() == f"index={index} of {array.id}\n"
    assert tally(array.info.array_states) == "3 succeeded"
    assert os.environ.get("GPULAYER_ARRAY_INDEX") is None


def test_a_task_running_through_a_restart_still_counts_against_the_limit(
    tmp_path: Path,
) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        before = ControlPlane(store, instance_id="s1")
        w = gpu_worker(before, 4)
        array = before.submit(job(0, array=[0, 1, 2], max_parallel=1))
        (running,) = _tasks(before, w)
        after = ControlPlane(store, instance_id="s2")  # the server restarts
        after.recover("s1", workers_outlive=True)
        assert after.get(array.id).array_states == {"running": 1, "queued": 2}
        after.register_worker(
            WorkerInfo(id=w, name="w", host="w", slot_gpus=[0, 1, 2, 3]), [(running.job_id, 1)]
        )
        assert after.take_instructions(w) == []  # the one running holds the only place
        report(after, running, w)
        (nxt,) = _take_within(after, w)
        assert isinstance(nxt, RunTask) and nxt.spec.array_task.index == 1  # type: ignore[union-attr]
        assert after.get(array.id).array_states == {"succeeded": 1, "running": 1, "queued": 1}
        after.close_workers()
    finally:
        store.close()


def test_rerunning_one_task_runs_that_index_again(client: gpulayer.Client) -> None:
    array = client.submit(command=["sh", "-c", "echo $GPULAYER_ARRAY_INDEX"], array=[3, 8])
    assert array.wait(timeout=60) == "succeeded"
    again = client.rerun(f"{array.id}:8")
    assert again.info.spec.array == [8] and again.id != array.id
    assert again.wait(timeout=60) == "succeeded"
    (task,) = client.jobs(array=again)
    assert task.logs() == "8\n"
