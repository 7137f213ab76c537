"""Which start a job had (warm: forked from its worker's ready interpreter;
cold, and why), from the worker's reports to the job's record and to
``gpulayer show``: driven with hand-made reports through the store, the
embedded control plane and the server's API, as a worker would send them."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gpulayer.artifacts import ArtifactStore
from gpulayer.cli.output import escape
from gpulayer.home import Home
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.jobs import (
    START_MAX,
    WARM,
    JobInfo,
    RunTask,
    TaskInfo,
    TaskResult,
    TaskStarted,
    WorkerInfo,
    clip_start,
    job_start,
)
from gpulayer.service import ControlPlane
from gpulayer.spec import JobSpec, parse_spec
from gpulayer.store.migrations import LATEST, MIGRATIONS
from gpulayer.store.sqlite import SqliteStore
from server.rawhttp import asgi_request

COLD_COMMAND = "cold: a command job, not a Python script"
COLD_STARTING = "cold: the ready interpreter is still starting"
# What a hostile worker might say: escape sequences that set the terminal's
# title and clear it, a C1 CSI, BEL, a bidirectional override, a newline and
# a tab to split the line, and far more text than anyone should keep.
HOSTILE = "cold: \x1b]0;pwned\x07\x1b[2J\x9b31m\u202eback\nnext\tcell " + "x" * 100_000

# The migration that added jobs.start (the 11th): stores before it are older.
BEFORE_START = 10


def register(plane: ControlPlane, name: str) -> str:
    return plane.register_worker(
        WorkerInfo(id="", name=name, host=name, slot_gpus=[None], address=f"10.0.0.{len(name)}")
    ).id


def submit(plane: ControlPlane, **fields: object) -> tuple[str, dict[int, tuple[str, RunTask]]]:
    """A job placed (on one-slot workers, one more per node): its id, and
    each node's (worker, task)."""
    nodes = int(fields.get("nodes", 1))  # type: ignore[call-overload]
    for n in range(nodes):
        register(plane, "w" * (n + 1))
    job = plane.submit(parse_spec({"command": ["x"], **fields}))
    tasks: dict[int, tuple[str, RunTask]] = {}
    for worker in plane.list_workers():
        for task in plane.take_instructions(worker.id):
            assert isinstance(task, RunTask) and task.job_id == job.id
            tasks[task.node] = (worker.id, task)
    assert sorted(tasks) == list(range(nodes))
    return job.id, tasks


def started(wid: str, task: RunTask, start: str | None) -> TaskStarted:
    return TaskStarted(
        job_id=task.job_id,
        attempt=task.attempt,
        worker_id=wid,
        acquired=1.0,
        prepared=2.0,
        started=3.0,
        pid=4242 + task.node,
        pid_created=10.5,
        node=task.node,
        start=start,
    )


def ended(wid: str, task: RunTask, start: str | None, code: int = 0) -> TaskResult:
    return TaskResult(
        job_id=task.job_id,
        attempt=task.attempt,
        worker_id=wid,
        outcome="exited",
        exit_code=code,
        node=task.node,
        marks={"exited": 5.0},
        start=start,
    )


def final_in_memory(plane: ControlPlane, job_id: str) -> JobInfo:
    """The final record the control plane hands a waiting client (built in
    memory as the job ends, not read back from the store)."""
    final, pending = plane.watch_job(job_id)
    assert final is not None and pending is None
    return final


# ---- the rules -------------------------------------------------------------


@pytest.mark.parametrize(
    ("starts", "expected"),
    [
        ([WARM], WARM),
        ([WARM, WARM, WARM], WARM),
        ([COLD_COMMAND], COLD_COMMAND),
        ([WARM, COLD_STARTING, COLD_COMMAND], COLD_STARTING),  # the first cold one's
        ([COLD_COMMAND, None], COLD_COMMAND),  # cold is known even with one unknown
        ([WARM, None], None),  # a node not started (or not saying): not known to be warm
        ([None], None),  # a worker from before warm starts
        ([], None),
    ],
)
def test_a_job_is_warm_only_if_every_node_was(
    starts: list[str | None], expected: str | None
) -> None:
    assert job_start(starts) == expected


def test_a_workers_start_text_is_cut_to_its_limit() -> None:
    assert clip_start(None) is None
    assert clip_start(WARM) == WARM
    exact = "cold: " + "y" * (START_MAX - 6)
    assert clip_start(exact) == exact
    cut = clip_start(exact + "z")
    assert cut is not None and len(cut) == START_MAX
    assert cut.startswith("cold: yyy") and cut.endswith("...")


# ---- the store ---------------------------------------------------------------


def test_the_store_keeps_a_start_until_the_job_is_queued_again(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    with store.transaction() as tx:
        tx.insert_job(JobInfo(id="j", spec=JobSpec(command=["x"]), seq=1, marks={"submitted": 0.5}))
        tx.place("j", worker="w", slots=[0], gpus=[], attempt=1, at=1.0)
    job = store.get_job("j")
    assert job is not None and job.start is None  # placed, not started
    with store.transaction() as tx:
        tx.start("j", marks={"started": 2.0}, pid=7, pid_created=1.0, start=COLD_STARTING)
        assert tx.starts("j") == (COLD_STARTING, {})
        # A report sent again by a worker that does not say erases nothing.
        tx.start("j", marks={"started": 2.0}, pid=7, pid_created=1.0, start=None)
    job = store.get_job("j")
    assert job is not None and job.start == COLD_STARTING and job.pid == 7
    # The result's word replaces the start report's.
    with store.transaction() as tx:
        tx.finish(
            "j", state="failed", exit_code=1, reason="x", marks={}, outputs={}, starts={0: WARM}
        )
    job = store.get_job("j")
    assert job is not None and job.start == WARM and job.state == "failed"
    # Queued again: the start was the ended attempt's.
    with store.transaction() as tx:
        tx.requeue("j", reason="retrying", owner="s")
    job = store.get_job("j")
    assert job is not None and job.start is None and job.state == "queued"
    # A finish naming no start (cancelled, lost) keeps what the start report said.
    with store.transaction() as tx:
        tx.place("j", worker="w", slots=[0], gpus=[], attempt=2, at=3.0)
        tx.start("j", marks={}, pid=8, pid_created=None, start=COLD_COMMAND)
        tx.finish("j", state="lost", exit_code=None, reason="gone", marks={}, outputs={})
    job = store.get_job("j")
    assert job is not None and job.start == COLD_COMMAND
    assert store.get_job("nosuchjob") is None
    with store.transaction() as tx:
        assert tx.starts("nosuchjob") == (None, {})
    store.close()


def test_the_store_keeps_each_nodes_start_and_the_jobs_from_them_all(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    gang = [TaskInfo(node=0, worker="w0"), TaskInfo(node=1, worker="w1")]
    with store.transaction() as tx:
        tx.insert_job(
            JobInfo(id="g", spec=JobSpec(command=["x"], nodes=2), seq=1, marks={"submitted": 0.5})
        )
        tx.place("g", worker="w0", slots=[0], gpus=[], attempt=1, at=1.0, tasks=gang)
        tx.start("g", marks={}, pid=10, pid_created=1.0, node=0, start=WARM)
        assert tx.starts("g") == (None, {0: WARM})  # node 1 has not started
        tx.start("g", marks={}, pid=11, pid_created=1.0, node=1, start=COLD_STARTING)
        assert tx.starts("g") == (COLD_STARTING, {0: WARM, 1: COLD_STARTING})
        # Node 1 ends first; its result says it was warm after all.
        tx.task_ended(
            "g",
            1,
            TaskResult(
                job_id="g",
                attempt=1,
                worker_id="w1",
                outcome="exited",
                exit_code=0,
                node=1,
                start=WARM,
            ),
        )
    job = store.get_job("g")
    assert job is not None and job.start == WARM
    assert [(t.node, t.pid, t.start) for t in job.tasks] == [(0, 10, WARM), (1, 11, WARM)]
    assert job.tasks[1].result is not None and job.tasks[1].result.start == WARM
    with store.transaction() as tx:
        tx.finish(
            "g",
            state="succeeded",
            exit_code=0,
            reason=None,
            marks={},
            outputs={},
            starts={0: COLD_COMMAND},
        )
    job = store.get_job("g")
    assert job is not None and job.start == COLD_COMMAND
    assert [t.start for t in job.tasks] == [COLD_COMMAND, WARM]
    with store.transaction() as tx:
        tx.requeue("g", reason="again", owner="s")
    job = store.get_job("g")
    assert job is not None and job.start is None and job.tasks == []
    store.close()


def test_an_older_store_is_migrated_with_no_start_for_its_jobs(tmp_path: Path) -> None:
    assert LATEST > BEFORE_START
    path = tmp_path / "db.sqlite"
    db = sqlite3.connect(path)
    for statements in MIGRATIONS[:BEFORE_START]:  # as GPUlayer before jobs.start left it
        for statement in statements:
            db.execute(statement)
    db.execute(f"PRAGMA user_version = {BEFORE_START}")
    insert = (
        "INSERT INTO jobs (id, seq, state, priority, spec, attempt, worker, tasks, pid) "
        "VALUES (?,?,?,?,?,?,?,?,?)"
    )
    db.execute(insert, ("one", 1, "succeeded", 0, b'{"command":["x"]}', 1, "w0", None, None))
    gang = '[{"node":0,"worker":"w0","pid":5},{"node":1,"worker":"w1"}]'
    db.execute(insert, ("gang", 2, "running", 0, b'{"command":["x"],"nodes":2}', 1, "w0", gang, 5))
    db.commit()
    db.close()
    store = SqliteStore(path)
    assert store.schema_version == LATEST
    one, old_gang = store.get_job("one"), store.get_job("gang")
    assert one is not None and one.start is None and one.state == "succeeded"
    assert old_gang is not None and old_gang.start is None
    assert [(t.pid, t.start) for t in old_gang.tasks] == [(5, None), (None, None)]
    # The job running through the upgrade takes its nodes' starts from then on.
    with store.transaction() as tx:
        tx.start("gang", marks={}, pid=6, pid_created=None, node=1, start=WARM)
    again = store.get_job("gang")
    assert again is not None and again.start is None  # node 0's is not known
    assert [t.start for t in again.tasks] == [None, WARM]
    store.close()


# ---- the embedded control plane ----------------------------------------------


def test_the_start_report_sets_it_and_the_result_replaces_it(plane: ControlPlane) -> None:
    job_id, tasks = submit(plane)
    wid, task = tasks[0]
    assert plane.get(job_id).start is None
    plane.task_started(started(wid, task, COLD_STARTING))
    running = plane.get(job_id)
    assert running.start == COLD_STARTING and running.pid == 4242
    plane.task_finished(ended(wid, task, WARM))
    assert plane.get(job_id).start == WARM
    assert final_in_memory(plane, job_id).start == WARM


@pytest.mark.parametrize("outcome", ["exited", "lost"])
def test_a_result_that_does_not_say_keeps_what_the_start_report_said(
    plane: ControlPlane, outcome: str
) -> None:
    """A result from a worker that does not say, or one the control plane
    makes itself (the worker lost), keeps the start report's word, in the
    store and in the record handed to a waiting client."""
    job_id, tasks = submit(plane)
    wid, task = tasks[0]
    plane.task_started(started(wid, task, COLD_COMMAND))
    if outcome == "lost":
        plane.unregister_worker(wid)
    else:
        plane.task_finished(ended(wid, task, None))
    stored = plane.get(job_id)
    assert stored.done and stored.start == COLD_COMMAND
    assert final_in_memory(plane, job_id).start == COLD_COMMAND


def test_a_job_from_a_worker_that_never_says_has_no_start(plane: ControlPlane) -> None:
    job_id, tasks = submit(plane)
    wid, task = tasks[0]
    plane.task_started(started(wid, task, None))
    plane.task_finished(ended(wid, task, None))
    assert plane.get(job_id).start is None
    assert final_in_memory(plane, job_id).start is None


def test_a_retry_has_no_start_until_it_starts_again(plane: ControlPlane) -> None:
    job_id, tasks = submit(plane, max_retries=1, retry_delay=0)
    wid, task = tasks[0]
    plane.task_started(started(wid, task, WARM))
    plane.task_finished(ended(wid, task, WARM, code=1))
    (again,) = plane.take_instructions(wid)
    assert isinstance(again, RunTask) and again.attempt == 2
    assert plane.get(job_id).start is None  # placed again: the warm start was attempt 1's
    plane.task_started(started(wid, again, COLD_STARTING))
    plane.task_finished(ended(wid, again, None))
    final = plane.get(job_id)
    assert final.state == "succeeded" and final.attempt == 2 and final.start == COLD_STARTING
    assert final_in_memory(plane, job_id).start == COLD_STARTING


@pytest.mark.parametrize(("node1_result", "expected"), [(None, COLD_STARTING), (WARM, WARM)])
def test_a_gang_is_warm_only_if_every_node_was(
    plane: ControlPlane, node1_result: str | None, expected: str
) -> None:
    job_id, tasks = submit(plane, nodes=2, procs_per_node=2)
    (w0, t0), (w1, t1) = tasks[0], tasks[1]
    plane.task_started(started(w0, t0, WARM))
    assert plane.get(job_id).start is None  # node 1 has not started yet
    plane.task_started(started(w1, t1, COLD_STARTING))
    running = plane.get(job_id)
    assert running.start == COLD_STARTING
    assert [t.start for t in running.tasks] == [WARM, COLD_STARTING]
    plane.task_finished(ended(w1, t1, node1_result))  # node 1 ends first; node 0 runs on
    assert plane.get(job_id).start == expected
    plane.task_finished(ended(w0, t0, WARM))
    final = plane.get(job_id)
    assert final.state == "succeeded" and final.start == expected
    assert [t.start for t in final.tasks] == [WARM, node1_result or COLD_STARTING]
    in_memory = final_in_memory(plane, job_id)
    assert in_memory.start == expected
    assert [t.start for t in in_memory.tasks] == [t.start for t in final.tasks]


def test_a_hostile_start_is_kept_bounded_and_changes_nothing_else(plane: ControlPlane) -> None:
    job_id, tasks = submit(plane)
    wid, task = tasks[0]
    plane.task_started(started(wid, task, HOSTILE))
    running = plane.get(job_id)
    assert running.start == HOSTILE[: START_MAX - 3] + "..."
    # The rest of the report applied as any other's.
    assert running.state == "running" and running.pid == 4242
    assert running.marks["started"] == 3.0
    plane.task_finished(ended(wid, task, "warm" + HOSTILE))
    final = plane.get(job_id)
    assert final.state == "succeeded" and final.exit_code == 0 and final.reason is None
    assert final.start is not None and len(final.start) == START_MAX
    assert final.start.startswith("warmcold: \x1b]0;")
    assert final_in_memory(plane, job_id).start == final.start
    # Its text reached no other field of the record.
    assert final.spec == parse_spec({"command": ["x"]})


# ---- the server --------------------------------------------------------------


def test_the_server_passes_the_start_through(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    plane = ControlPlane(store, instance_id="s1")
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"))
    admin = auth.create_token(store, "admin")

    async def scenario() -> list[str | None]:
        body = {"worker": {"id": "", "name": "w", "host": "h", "slot_gpus": [None]}, "running": []}
        _, _, worker = await asgi_request(app, "POST", "/api/v1/workers", body=body, token=admin)
        wid = worker["id"]
        seen: list[str | None] = []
        for start in (COLD_STARTING, None):  # None: a worker from before, which sends no key
            spec = {"spec": {"command": ["x"]}}
            _, _, job = await asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=admin)
            path = f"/api/v1/workers/{wid}/acquire"
            await asgi_request(app, "POST", path, "timeout=0", token=admin)
            report = {"job_id": job["id"], "attempt": 1, "worker_id": wid, "pid": 999_999}
            report |= dict.fromkeys(("acquired", "prepared", "started"), 1.0)
            if start is not None:
                report["start"] = start
            status, _, _ = await asgi_request(
                app, "POST", "/api/v1/tasks/started", body=report, token=admin
            )
            assert status == 204
            _, _, got = await asgi_request(app, "GET", f"/api/v1/jobs/{job['id']}", token=admin)
            seen.append(got.get("start"))
            result = {"job_id": job["id"], "attempt": 1, "worker_id": wid, "outcome": "exited"}
            result |= {"exit_code": 0} | ({"start": WARM} if start is not None else {})
            await asgi_request(app, "POST", "/api/v1/tasks/finished", body=result, token=admin)
            _, _, got = await asgi_request(app, "GET", f"/api/v1/jobs/{job['id']}", token=admin)
            assert got["state"] == "succeeded"
            seen.append(got.get("start"))
        return seen

    try:
        assert asyncio.run(scenario()) == [COLD_STARTING, WARM, None, None]
    finally:
        store.close()


# ---- gpulayer show -------------------------------------------------------------


def gl(*args: str, home: Path) -> str:
    env = {**os.environ, "GPULAYER_HOME": str(home), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_show_says_which_start_a_job_had(home: Path) -> None:
    store = SqliteStore(Home(home).db)
    plane = ControlPlane(store, instance_id="test")
    ids = {}
    try:
        for name, first, last in (
            ("warm", COLD_STARTING, WARM),
            ("cold", COLD_COMMAND, None),
            ("hostile", HOSTILE, None),
            ("unknown", None, None),
        ):
            job_id, tasks = submit(plane)
            wid, task = tasks[0]
            plane.task_started(started(wid, task, first))
            plane.task_finished(ended(wid, task, last))
            ids[name] = job_id
        gang_id, gang = submit(plane, nodes=2, procs_per_node=1)
        for node, start in ((0, WARM), (1, COLD_STARTING)):
            wid, task = gang[node]
            plane.task_started(started(wid, task, start))
            plane.task_finished(ended(wid, task, None))
    finally:
        store.close()

    def start_lines(job_id: str) -> list[str]:
        return [
            line for line in gl("show", job_id, home=home).splitlines() if line.startswith("start")
        ]

    assert start_lines(ids["warm"]) == ["start\twarm"]
    assert start_lines(ids["cold"]) == ["start\tcold (a command job, not a Python script)"]
    assert start_lines(ids["unknown"]) == []
    assert start_lines(gang_id) == [
        "start\tcold (the ready interpreter is still starting) on node 1"
    ]
    # The worker's text is escaped: it cannot split the line or reach the terminal.
    shown = gl("show", ids["hostile"], home=home)
    kept = HOSTILE[: START_MAX - 3] + "..."
    assert f"start\tcold ({escape(kept[len('cold: ') :])})\n" in shown
    assert "\x1b" not in shown and "\x9b" not in shown and "\u202e" not in shown
    # --json gives the text exactly (as JSON escapes), for the job and each node.
    as_json = json.loads(gl("show", ids["hostile"], "--json", home=home))
    assert as_json["start"] == kept
    gang_json = json.loads(gl("show", gang_id, "--json", home=home))
    assert gang_json["start"] == COLD_STARTING
    assert [t["start"] for t in gang_json["tasks"]] == [WARM, COLD_STARTING]
    assert json.loads(gl("show", ids["unknown"], "--json", home=home))["start"] is None
