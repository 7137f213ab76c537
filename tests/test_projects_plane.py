"""Projects in the control plane, driven directly: which project a job goes
into, who sees it, a quota holding jobs back (and why they wait), fair
share between projects, and usage kept across a restart."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulayer.access import Viewer
from gpulayer.errors import GPUlayerError, JobNotFoundError
from gpulayer.jobs import RunTask
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore
from teams_kit import ADA, ADMIN, BOB, EVE, Clock, gpu_worker, job, make_lab, report


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


def test_a_job_goes_into_its_user_s_first_project_or_the_one_it_names(
    lab: ControlPlane,
) -> None:
    assert lab.submit(job(), viewer=ADA).spec.project == "vision"
    lab.add_project_member("nlp", "ada")
    assert lab.submit(job(project="nlp"), viewer=ADA).spec.project == "nlp"
    # A user in no project, and the embedded user, go into the default one.
    assert lab.submit(job(), viewer=Viewer("carol")).spec.project is None
    assert lab.submit(job()).spec.project is None
    assert lab.submit(job(project="nlp"), viewer=ADMIN).spec.project == "nlp"


def test_a_job_cannot_go_into_a_project_its_user_is_not_in_nor_escape_to_the_default(
    lab: ControlPlane,
) -> None:
    before = lab.list_jobs(viewer=ADMIN)
    for asked in ("nlp", "no-such-project"):
        with pytest.raises(GPUlayerError) as refused:
            lab.submit(job(project=asked), viewer=ADA)
        # One answer whether the project exists or not.
        assert str(refused.value) == (
            f"no project {asked!r} that you belong to (your projects are vision)"
        )
    with pytest.raises(GPUlayerError, match="you belong to project vision: submit into it"):
        lab.submit(job(project="default"), viewer=ADA)  # where no quota would hold it
    with pytest.raises(GPUlayerError, match=re.escape("project name '../x' is not valid")):
        lab.submit(job(project="../x"), viewer=ADA)
    assert lab.list_jobs(viewer=ADMIN) == before  # nothing was stored


def test_members_see_each_other_s_jobs_in_their_project_and_no_one_else_does(
    lab: ControlPlane,
) -> None:
    mine = lab.submit(job(), viewer=ADA)
    assert lab.get(mine.id, viewer=BOB).id == mine.id
    assert [j.id for j in lab.list_jobs(viewer=BOB)] == [mine.id]
    assert lab.resolve(mine.id[:6], viewer=BOB) == mine.id
    found, unknown = lab.finals([mine.id], viewer=BOB)
    assert (found, unknown) == ([], [])  # visible, and not final yet
    for outsider in (EVE, Viewer("carol")):
        with pytest.raises(JobNotFoundError):
            lab.get(mine.id, viewer=outsider)
        with pytest.raises(JobNotFoundError):
            lab.cancel(mine.id, viewer=outsider)
        assert lab.list_jobs(viewer=outsider) == []
        assert lab.finals([mine.id], viewer=outsider) == ([], [mine.id])
    assert lab.get(mine.id, viewer=ADA).state == "queued"  # nothing happened to it
    # A member may cancel a fellow member's job.
    assert lab.cancel(mine.id, viewer=BOB).state == "cancelled"


def test_jobs_in_the_default_project_stay_their_user_s_alone(lab: ControlPlane) -> None:
    carol = lab.submit(job(), viewer=Viewer("carol"))
    dave = Viewer("dave")  # also in no project: in "default" too
    with pytest.raises(JobNotFoundError):
        lab.get(carol.id, viewer=dave)
    assert lab.list_jobs(viewer=dave) == []


def test_a_member_taken_out_sees_the_others_jobs_no_more(lab: ControlPlane) -> None:
    ada_s = lab.submit(job(), viewer=ADA)
    bob_s = lab.submit(job(), viewer=BOB)
    lab.remove_project_member("vision", "bob")
    with pytest.raises(JobNotFoundError):
        lab.get(ada_s.id, viewer=BOB)
    assert lab.get(bob_s.id, viewer=BOB).id == bob_s.id  # its own, still


def test_a_project_at_its_quota_waits_with_the_reason_and_others_run(lab: ControlPlane) -> None:
    lab.set_project_quota("vision", gpus=2)
    w = gpu_worker(lab, 8)
    first = [lab.submit(job(), viewer=ADA) for _ in range(3)]
    other = lab.submit(job(), viewer=EVE)
    states = [lab.get(j.id).state for j in first]
    assert states == ["running", "running", "queued"]
    assert lab.get(other.id).state == "running"
    waiting = lab.get(first[2].id, viewer=ADA)
    assert waiting.reason == "project vision is at its quota of 2 GPUs (2 in use, this job needs 1)"
    listed = {j.id: j.reason for j in lab.list_jobs(viewer=ADA, states=["queued"])}
    assert listed == {first[2].id: waiting.reason}
    # A job of the project ends: the one waiting runs.
    tasks = {t.job_id: t for t in lab.take_instructions(w) if isinstance(t, RunTask)}
    report(lab, tasks[first[0].id], w)
    assert lab.get(first[2].id).state == "running"


def test_raising_a_quota_places_at_once_and_lowering_one_kills_nothing(
    lab: ControlPlane,
) -> None:
    lab.set_project_quota("vision", gpus=1)
    gpu_worker(lab, 4)
    a, b = (lab.submit(job(), viewer=ADA) for _ in range(2))
    assert (lab.get(a.id).state, lab.get(b.id).state) == ("running", "queued")
    lab.set_project_quota("vision", gpus=4)
    assert lab.get(b.id).state == "running"  # no other event needed
    lab.set_project_quota("vision", gpus=0)
    assert (lab.get(a.id).state, lab.get(b.id).state) == ("running", "running")
    c = lab.submit(job(), viewer=ADA)
    assert lab.get(c.id).reason == (
        "needs 1 GPU, more than project vision's quota of 0 GPUs: "
        "it cannot run unless an admin raises the quota"
    )


def test_the_project_that_used_less_lately_goes_first(lab: ControlPlane, clock: Clock) -> None:
    w = gpu_worker(lab, 1)
    # vision runs a job for an hour; then both projects queue one job each,
    # vision's first.
    long = lab.submit(job(), viewer=ADA)
    (task,) = lab.take_instructions(w)
    clock.now += 3600
    v = lab.submit(job(), viewer=ADA)
    n = lab.submit(job(), viewer=EVE)
    assert isinstance(task, RunTask) and task.job_id == long.id
    report(lab, task, w)
    assert lab.get(n.id).state == "running"  # nlp used nothing: it goes first
    assert lab.get(v.id).state == "queued"


def test_usage_survives_a_restart_of_the_control_plane(
    tmp_path: Path, lab: ControlPlane, clock: Clock
) -> None:
    w = gpu_worker(lab, 2)
    lab.submit(job(gpus=2), viewer=ADA)
    (task,) = lab.take_instructions(w)
    clock.now += 7200
    assert isinstance(task, RunTask)
    report(lab, task, w)
    lab.close_workers()
    lab.store.close()
    store = SqliteStore(tmp_path / "db.sqlite")
    again = ControlPlane(store, instance_id="test2", clock=clock)
    usage = again._accounts.usage(clock.now)
    # 2 GPUs for two hours, decayed with a half-life of a day: a little
    # under 14,400 GPU-seconds.
    assert 13_000 < usage["vision"] < 14_400
    assert usage.get("nlp", 0.0) == 0.0
    store.close()
