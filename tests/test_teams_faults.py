"""Faults in sharing found by review (issue 20): holds on workers that
outlive their reason, a job that can never fit, a deleted project, a worker
from before preemption. Each test is the attack or the accident, then the
check that the system still does what the docs promise."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulayer.jobs import CancelTask, RunTask
from gpulayer.service import ControlPlane
from teams_kit import ADA, BOB, EVE, Clock, gpu_worker, job, make_lab, report


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def lab(tmp_path: Path, clock: Clock) -> Iterator[ControlPlane]:
    plane = make_lab(tmp_path, clock)
    try:
        yield plane
    finally:
        plane.store.close()


def test_workers_held_for_a_job_its_quota_now_forbids_are_not_held_forever(
    lab: ControlPlane,
) -> None:
    # eve's preemptible job fills the worker; ada's urgent job preempts it.
    w = gpu_worker(lab, 2)
    low = lab.submit(job(2, preemptible=True), viewer=EVE)
    (task,) = lab.take_instructions(w)
    urgent = lab.submit(job(1, priority=5), viewer=ADA)
    assert lab.take_instructions(w) == [CancelTask(job_id=low.id, attempt=1, preempt=True)]
    # Before the victim has stopped, the admin sets vision's quota to 0: the
    # urgent job can never run now ("unless an admin raises the quota").
    lab.set_project_quota("vision", gpus=0)
    report(lab, task, w, "preempted", -15)
    assert lab.get(urgent.id, viewer=ADA).state == "queued"
    # The worker is free and eve's job waits: it should run again. It does
    # not: the worker stays held for a job that cannot be placed.
    assert lab.get(low.id, viewer=EVE).state == "running"


def test_a_never_fitting_high_priority_job_does_not_switch_preemption_off(
    lab: ControlPlane,
) -> None:
    w = gpu_worker(lab, 2)
    lab.submit(job(2, preemptible=True), viewer=EVE)
    (task,) = lab.take_instructions(w)
    # A careless user's 64-GPU job of high priority: no worker could ever hold it.
    lab.submit(job(64, priority=9), viewer=BOB)
    urgent = lab.submit(job(1, priority=5), viewer=ADA)
    assert isinstance(task, RunTask)
    assert lab.take_instructions(w) == [CancelTask(job_id=task.job_id, attempt=1, preempt=True)], (
        f"no preemption for {urgent.id}"
    )


def test_a_deleted_project_s_jobs_are_not_seen_by_members_of_a_new_one_of_that_name(
    lab: ControlPlane,
) -> None:
    from gpulayer.errors import JobNotFoundError

    w = gpu_worker(lab, 1)
    secret = lab.submit(job(1), viewer=ADA)  # into vision
    (task,) = lab.take_instructions(w)
    report(lab, task, w, "exited", 0)
    lab.delete_project("vision")  # its final jobs stay, "their submitters' alone"
    lab.create_project("vision")
    lab.add_project_member("vision", "eve")
    with pytest.raises(JobNotFoundError):
        lab.wait(secret.id, timeout=0, viewer=EVE)


def test_get_of_a_deleted_project_s_job_by_a_new_member_is_a_404_not_a_crash(
    lab: ControlPlane,
) -> None:
    from gpulayer.errors import JobNotFoundError

    w = gpu_worker(lab, 1)
    secret = lab.submit(job(1), viewer=ADA)
    (task,) = lab.take_instructions(w)
    report(lab, task, w, "exited", 0)
    lab.delete_project("vision")
    lab.create_project("vision")
    lab.add_project_member("vision", "eve")
    with pytest.raises(JobNotFoundError):
        lab.get(secret.id, viewer=EVE)


def test_a_job_whose_held_worker_went_away_can_still_preempt_elsewhere(
    lab: ControlPlane,
) -> None:
    w1 = gpu_worker(lab, 1, "w1")
    w2 = gpu_worker(lab, 1, "w2")
    lab.submit(job(1, preemptible=True), viewer=EVE)
    lab.submit(job(1, preemptible=True), viewer=EVE)
    on = {}
    for w in (w1, w2):
        (t,) = lab.take_instructions(w)
        on[w] = t
    urgent = lab.submit(job(1, priority=5), viewer=ADA)
    cancels = {w: lab.take_instructions(w) for w in (w1, w2)}
    (held,) = [w for w, c in cancels.items() if c]
    other = w2 if held == w1 else w1
    # The worker held for the urgent job goes away before its victim stopped.
    lab.unregister_worker(held)
    assert lab.get(urgent.id, viewer=ADA).state == "queued"
    # The urgent job still waits; the other preemptible job should now be
    # stopped for it. Nothing is: held_for still names the urgent job, so
    # preempt() returns at once, for good.
    assert lab.take_instructions(other) == [
        CancelTask(job_id=on[other].job_id, attempt=1, preempt=True)
    ]


def test_a_preempted_job_stopped_by_a_worker_from_before_preemption_is_queued_again(
    lab: ControlPlane,
) -> None:
    # jobs.CancelTask: preempt "Left out when False: a worker from before it
    # reads it as a cancel". Such a worker stops the task and reports
    # "cancelled": the plane asked for a preemption, not a cancel.
    w = gpu_worker(lab, 1)
    low = lab.submit(job(1, preemptible=True), viewer=EVE)
    (task,) = lab.take_instructions(w)
    lab.submit(job(1, priority=5), viewer=ADA)
    assert lab.take_instructions(w) == [CancelTask(job_id=low.id, attempt=1, preempt=True)]
    report(lab, task, w, "cancelled", -15)
    assert lab.get(low.id, viewer=EVE).state in ("queued", "running")
