"""Usage by project (``gpulayer usage``): GPU-hours over the last day and
week with a clock the test holds, running and waiting counts, who sees
which row, the store's query and its migration, the command embedded, and
the docs that show it."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gpulayer.access import Viewer
from gpulayer.cli.usage import USAGE_COLUMNS, usage_object
from gpulayer.jobs import JobInfo, RunTask, TaskResult, WorkerInfo
from gpulayer.projects import USAGE_DAY_S, USAGE_WEEK_S, ProjectUsage
from gpulayer.service import ControlPlane
from gpulayer.spec import JobSpec, parse_spec
from gpulayer.store.migrations import LATEST, MIGRATIONS
from gpulayer.store.sqlite import SqliteStore
from teams_kit import Clock

ROOT = Path(__file__).resolve().parents[1]
H = 3600.0
ADA, EVE, CAROL, DAVE = Viewer("ada"), Viewer("eve"), Viewer("carol"), Viewer("dave")
ADMIN = Viewer("root", admin=True)


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000_000_000.0)


@pytest.fixture
def lab(tmp_path: Path, clock: Clock) -> ControlPlane:
    """A plane with projects vision (ada) and nlp (eve), vision's quota 6
    GPUs; workers of 4 and 2 GPUs."""
    plane = ControlPlane(SqliteStore(tmp_path / "db.sqlite"), instance_id="t", clock=clock)
    plane.create_project("vision", gpus=6)
    plane.create_project("nlp")
    plane.add_project_member("vision", "ada")
    plane.add_project_member("nlp", "eve")
    for name, gpus in (("a", 4), ("b", 2)):
        plane.register_worker(WorkerInfo(id="", name=name, host=name, slot_gpus=list(range(gpus))))
    return plane


def job(gpus: int = 1, **fields: object) -> JobSpec:
    return parse_spec({"command": ["x"], "gpus": gpus, **fields})


def workers(plane: ControlPlane) -> list[str]:
    return [w.id for w in plane.list_workers()]


def start(plane: ControlPlane, spec: JobSpec, viewer: Viewer) -> tuple[str, list[RunTask]]:
    """Submit; the job's tasks, taken by their workers (it must be placed)."""
    made = plane.submit(spec, viewer=viewer)
    tasks = [
        t
        for w in workers(plane)
        for t in plane.take_instructions(w)
        if isinstance(t, RunTask) and t.job_id == made.id
    ]
    assert tasks, f"job {made.id} was not placed: {plane.get(made.id).reason}"
    return made.id, tasks


def end(plane: ControlPlane, tasks: list[RunTask], exit_code: int = 0) -> None:
    for task in tasks:
        plane.task_finished(
            TaskResult(
                job_id=task.job_id,
                attempt=task.attempt,
                worker_id=_worker_of(plane, task),
                node=task.node,
                outcome="exited",
                exit_code=exit_code,
            )
        )


def _worker_of(plane: ControlPlane, task: RunTask) -> str:
    info = plane.get(task.job_id)
    if info.tasks:
        return next(t.worker for t in info.tasks if t.node == task.node)
    assert info.worker is not None
    return info.worker


def run_for(plane: ControlPlane, clock: Clock, spec: JobSpec, viewer: Viewer, hours: float) -> str:
    job_id, tasks = start(plane, spec, viewer)
    clock.now += hours * H
    end(plane, tasks)
    assert plane.get(job_id).state == "succeeded"
    return job_id


def rows(plane: ControlPlane, viewer: Viewer) -> dict[str, ProjectUsage]:
    return {r.project: r for r in plane.usage(viewer)}


def test_gpu_hours_count_each_attempt_s_overlap_with_the_day_and_the_week(
    lab: ControlPlane, clock: Clock
) -> None:
    now = clock.now + 8 * 24 * H + H  # when usage is asked for
    # Ended more than a week ago: counts nowhere.
    run_for(lab, clock, job(), ADA, 2)
    # Straddles the week's edge: 3 of its 4 hours are in the week.
    clock.now = now - USAGE_WEEK_S - H
    run_for(lab, clock, job(), ADA, 4)
    # Straddles the day's edge: 4 of its 6 hours are in the day, all in the week.
    clock.now = now - 26 * H
    run_for(lab, clock, job(), ADA, 6)
    # 2 GPUs on each of 2 nodes for an hour: 4 GPU-hours.
    clock.now = now - 10 * H
    run_for(lab, clock, job(gpus=2, nodes=2), ADA, 1)
    clock.now = now - 5 * H
    run_for(lab, clock, job(), EVE, 1)
    # Running for the last 2 hours: counts up to now.
    clock.now = now - 2 * H
    running, _ = start(lab, job(), ADA)
    # Waiting: past vision's quota of 6 GPUs (1 held, 6 more asked).
    waiting = lab.submit(job(gpus=6), viewer=ADA)
    clock.now = now
    assert lab.get(waiting.id).state == "queued"

    seen = rows(lab, ADMIN)
    assert list(seen) == ["vision", "nlp", "default"]
    vision = seen["vision"]
    assert vision.gpu_hours_day == pytest.approx(4 + 4 + 2)
    assert vision.gpu_hours_week == pytest.approx(3 + 6 + 4 + 2)
    assert (vision.running, vision.waiting, vision.gpus_held) == (1, 1, 1)
    assert (vision.gpu_quota, vision.slot_quota, vision.only_yours) == (6, None, False)
    assert vision.fair_share_usage is not None and vision.fair_share_usage > 0
    nlp = seen["nlp"]
    assert (nlp.gpu_hours_day, nlp.gpu_hours_week) == (pytest.approx(1), pytest.approx(1))
    assert (nlp.running, nlp.waiting, nlp.gpus_held, nlp.gpu_quota) == (0, 0, 0, None)
    assert seen["default"] == ProjectUsage(project="default", fair_share_usage=0.0)
    # An hour later the running job has an hour more; the day lost 1 GPU-hour
    # of the job that straddled its edge (now 3 of its 6 hours).
    clock.now += H
    later = rows(lab, ADMIN)["vision"]
    assert later.gpu_hours_day == pytest.approx(3 + 4 + 3)
    assert later.gpu_hours_week == pytest.approx(2 + 6 + 4 + 3)
    assert running in {j.id for j in lab.list_jobs(states=["running"])}


def test_a_retried_attempt_counts_its_own_time_beside_the_last_one(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    t = 5_000_000.0
    spec = job(gpus=2, project="vision")
    with store.transaction() as tx:
        tx.insert_job(JobInfo(id="j1", spec=spec, seq=1, user="ada", marks={"submitted": t}))
    with store.transaction() as tx:
        assert tx.place("j1", worker="w", slots=[0, 1], gpus=[0, 1], attempt=1, at=t)
    with store.transaction() as tx:  # the first attempt failed (or was preempted) after 1 h
        tx.requeue("j1", reason="retrying", owner="t", at=t + H)
    # Requeued, not final: only the ended attempt counts.
    assert store.gpu_seconds([t - H], t + 2 * H) == {("vision", "ada"): [2 * H]}
    with store.transaction() as tx:
        assert tx.place("j1", worker="w", slots=[0, 1], gpus=[0, 1], attempt=2, at=t + 2 * H)
    with store.transaction() as tx:
        tx.finish(
            "j1",
            state="succeeded",
            exit_code=0,
            reason=None,
            marks={"finished": t + 2.5 * H},
            outputs={},
        )
    # 2 GPUs x (1 h + 0.5 h); a window from t + 0.5 h takes half the first.
    found = store.gpu_seconds([t - H, t + 0.5 * H], t + 3 * H)
    assert found == {("vision", "ada"): [pytest.approx(3 * H), pytest.approx(2 * H)]}
    # Not counted: a window that ends before, and the job's queued time.
    assert store.gpu_seconds([t + 3 * H], t + 4 * H) == {}
    store.close()


def test_a_job_cancelled_while_queued_and_a_cpu_job_count_no_gpu_hours(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    t = 5_000_000.0
    with store.transaction() as tx:
        tx.insert_job(JobInfo(id="q", spec=job(gpus=4), seq=1, user="ada", marks={"submitted": t}))
        tx.insert_job(JobInfo(id="c", spec=job(gpus=0), seq=2, user="ada", marks={"submitted": t}))
    with store.transaction() as tx:
        assert tx.cancel_queued("q", t + H)
        assert tx.place("c", worker="w", slots=[0], gpus=[], attempt=1, at=t)
        tx.finish(
            "c", state="succeeded", exit_code=0, reason=None, marks={"finished": t + H}, outputs={}
        )
    # The cancelled job is found (it ended in the window) but held nothing;
    # the CPU job is not even read.
    assert store.gpu_seconds([t - H], t + 2 * H) == {("default", "ada"): [0.0]}
    store.close()


def test_who_sees_which_row(lab: ControlPlane, clock: Clock) -> None:
    start(lab, job(), ADA)
    start(lab, job(), EVE)
    start(lab, job(), CAROL)  # in no project: default
    dave = lab.submit(job(gpus=50), viewer=DAVE)  # default, waiting (no worker has 50)
    clock.now += H
    assert lab.get(dave.id).state == "queued"

    assert list(rows(lab, ADA)) == ["vision", "default"]
    assert list(rows(lab, EVE)) == ["nlp", "default"]
    assert rows(lab, ADA)["vision"].gpu_hours_day == pytest.approx(1)
    # A user's default row counts only their own jobs there, and shows no
    # fair-share figure (everyone's in default).
    carol = rows(lab, CAROL)
    assert list(carol) == ["default"]
    assert carol["default"] == ProjectUsage(
        project="default",
        gpu_hours_day=pytest.approx(1),
        gpu_hours_week=pytest.approx(1),
        running=1,
        gpus_held=1,
        only_yours=True,
    )
    theirs = rows(lab, DAVE)["default"]
    assert (theirs.running, theirs.waiting, theirs.gpus_held, theirs.gpu_hours_day) == (0, 1, 0, 0)
    # Ada sees nothing of default's others, nor of nlp.
    assert rows(lab, ADA)["default"].running == 0
    everyone = rows(lab, ADMIN)["default"]
    assert (everyone.running, everyone.waiting, everyone.gpus_held) == (1, 1, 1)
    # 1 GPU for an hour, decayed a little (half-life a day): as fairshare.py has it.
    assert everyone.fair_share_usage == lab._accounts.usage(clock.now)["default"]
    assert 0.98 * H < everyone.fair_share_usage < H
    # Embedded (the local viewer, an admin) sees every row.
    assert [r.project for r in lab.usage()] == ["vision", "nlp", "default"]


def test_a_user_taken_out_of_a_project_no_longer_gets_its_row(lab: ControlPlane) -> None:
    lab.add_project_member("nlp", "ada")
    assert list(rows(lab, ADA)) == ["vision", "nlp", "default"]
    lab.remove_project_member("nlp", "ada")
    assert list(rows(lab, ADA)) == ["vision", "default"]


def _v12_store(path: Path) -> None:
    """A store as GPUlayer with 12 migrations left it, with two jobs."""
    db = sqlite3.connect(path)
    for migration in MIGRATIONS[:12]:
        for statement in migration:
            db.execute(statement)
    spec = json.dumps({"command": ["x"], "gpus": 2, "nodes": 2, "project": "vision"})
    marks = json.dumps({"submitted": 100.0, "placed": 1000.0, "finished": 1000.0 + H})
    db.execute(
        "INSERT INTO jobs (id, seq, state, priority, spec, marks, user_name, project) "
        "VALUES ('done', 1, 'succeeded', 0, ?, ?, 'ada', 'vision')",
        (spec.encode(), marks),
    )
    db.execute(
        "INSERT INTO jobs (id, seq, state, priority, spec, marks, user_name) "
        "VALUES ('live', 2, 'running', 0, ?, ?, 'ada')",
        (json.dumps({"command": ["x"]}).encode(), json.dumps({"placed": 1000.0})),
    )
    db.execute("PRAGMA user_version = 12")
    db.commit()
    db.close()


def test_migration_13_fills_in_when_each_job_ended_and_what_it_held(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    _v12_store(path)
    store = SqliteStore(path)
    assert store.schema_version == LATEST
    with sqlite3.connect(path) as db:
        found = dict(db.execute("SELECT id, finished FROM jobs").fetchall())
        demand = dict(db.execute("SELECT id, gpu_demand FROM jobs").fetchall())
        began = dict(db.execute("SELECT id, began FROM jobs").fetchall())
        # What the usage query reads of a job, found from the index alone.
        plan = db.execute(
            "EXPLAIN QUERY PLAN SELECT project, user_name, gpu_demand, began FROM jobs "
            "WHERE finished >= 0 AND finished <= 1 AND gpu_demand > 0"
        ).fetchall()
    assert found == {"done": 1000.0 + H, "live": None}
    assert demand == {"done": 4, "live": 0}
    assert began == {"done": 1000.0, "live": 1000.0}
    assert "COVERING INDEX jobs_by_finished" in str(plan)  # a range of the index alone
    # 4 GPUs for an hour.
    assert store.gpu_seconds([0.0], 10 * H) == {("vision", "ada"): [pytest.approx(4 * H)]}
    store.close()


GPULAYER = [sys.executable, "-m", "gpulayer.cli"]


def test_usage_embedded_shows_one_default_row(home: Path) -> None:
    env = {**os.environ, "GPULAYER_HOME": str(home)}
    shown = subprocess.run(
        [*GPULAYER, "usage"], capture_output=True, text=True, env=env, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    # Piped: tab-separated, a header and one row.
    assert shown.stdout.splitlines() == [
        "\t".join(c.header for c in USAGE_COLUMNS),
        "default\t0.0\t0.0\t0\t0\t0\tnone",
    ]
    as_json = subprocess.run(
        [*GPULAYER, "usage", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == [
        usage_object(ProjectUsage(project="default", fair_share_usage=0.0))
    ]


def test_the_docs_show_the_command_and_every_json_key() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    section = operations.split("### Usage", 1)[1].split("\n## ", 1)[0]
    assert "$ gpulayer usage\n" in section
    header = section.split("$ gpulayer usage\n", 1)[1].splitlines()[0].split()
    assert " ".join(header) == " ".join(c.header for c in USAGE_COLUMNS)
    documented = (ROOT / "docs" / "json-output.md").read_text().split("### Usage", 1)[1]
    documented = documented.split("\n### ", 1)[0]
    keys = usage_object(ProjectUsage(project="x"))
    for key in keys:
        assert f"| `{key}` |" in documented, key
    assert USAGE_DAY_S == 24 * H
