"""The control plane's side of distributed jobs, driven directly: placement of
a gang, the master port handed from node 0 to the others, log lines from
several workers numbered once, and how the first failure ends the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulayer.jobs import (
    CancelTask,
    LogLine,
    Rendezvous,
    RunTask,
    TaskResult,
    TaskStarted,
    WorkerInfo,
)
from gpulayer.service import ControlPlane
from gpulayer.spec import ArtifactRef, parse_spec
from gpulayer.store.sqlite import SqliteStore


def worker(plane: ControlPlane, name: str, address: str | None = None) -> str:
    info = plane.register_worker(
        WorkerInfo(id="", name=name, host=name, slot_gpus=[None], address=address)
    )
    return info.id


def gang(plane: ControlPlane, **fields: object) -> tuple[str, RunTask, RunTask, str, str]:
    a = worker(plane, "a", "10.0.0.1")
    b = worker(plane, "b", "10.0.0.2")
    spec = parse_spec({"command": ["x"], "nodes": 2, "procs_per_node": 2, **fields})
    job = plane.submit(spec)
    tasks: dict[str, RunTask] = {}
    for wid in (a, b):
        (task,) = plane.take_instructions(wid)
        assert isinstance(task, RunTask)
        tasks[wid] = task
    first, second = sorted(tasks.values(), key=lambda t: t.node)
    workers = {t.node: wid for wid, t in tasks.items()}
    return job.id, first, second, workers[0], workers[1]


def result(job_id: str, wid: str, node: int, **fields: object) -> TaskResult:
    return TaskResult(job_id=job_id, attempt=1, worker_id=wid, node=node, **fields)  # type: ignore[arg-type]


def test_a_gang_is_placed_whole_and_told_where_rank_0_listens(plane: ControlPlane) -> None:
    job_id, first, second, w0, w1 = gang(plane)
    assert (first.node, second.node) == (0, 1)
    assert first.master_addr == second.master_addr == "10.0.0.1"  # node 0's advertised address
    stored = plane.get(job_id)
    assert stored.state == "running"
    assert [(t.node, t.worker) for t in stored.tasks] == [(0, w0), (1, w1)]
    # Node 0 reserved a port: node 1 learns it; node 0 gets nothing back.
    plane.task_rendezvous(job_id, 1, w0, 40123)
    assert plane.take_instructions(w1) == [Rendezvous(job_id=job_id, attempt=1, master_port=40123)]
    assert plane.take_instructions(w0) == []
    # A report from a worker that is not node 0's changes nothing.
    plane.task_rendezvous(job_id, 1, w1, 1)
    assert plane.take_instructions(w1) == []


def test_lines_from_several_nodes_are_numbered_once_in_arrival_order(
    plane: ControlPlane,
) -> None:
    job_id, *_ = gang(plane)

    def lines(node_seqs: range, rank: int) -> list[LogLine]:
        return [LogLine(s, 0.0, "stdout", f"r{rank} l{s}", rank) for s in node_seqs]

    plane.append_logs(job_id, 1, lines(range(1, 3), rank=2), node=1)
    plane.append_logs(job_id, 1, lines(range(1, 4), rank=0), node=0)
    first = plane.logs_after(job_id, (0, 0))
    # Node 1's batch is sent again (its reply was lost) with one line more.
    plane.append_logs(job_id, 1, lines(range(1, 4), rank=2), node=1)
    later = plane.logs_after(job_id, first.cursor)
    texts = [line.text for line in first.lines + later.lines]
    assert texts == ["r2 l1", "r2 l2", "r0 l1", "r0 l2", "r0 l3", "r2 l3"]
    assert [line.seq for line in first.lines + later.lines] == [1, 2, 3, 4, 5, 6]
    assert [line.rank for line in later.lines] == [2]

    # The server restarts; node 1 sends its last batch again (the reply was
    # lost in the crash), with a line more: only that line is new.
    successor = ControlPlane(plane.store, instance_id="successor")
    successor.recover("test", workers_outlive=True)
    successor.append_logs(job_id, 1, lines(range(1, 5), rank=2), node=1)
    after = successor.logs_after(job_id, later.cursor)
    assert [(line.seq, line.text) for line in after.lines] == [(7, "r2 l4")]


def test_the_first_failure_ends_the_other_nodes_and_names_its_rank(plane: ControlPlane) -> None:
    job_id, _, _, w0, w1 = gang(plane)
    for wid, node in ((w0, 0), (w1, 1)):
        plane.task_started(
            TaskStarted(
                job_id=job_id,
                attempt=1,
                worker_id=wid,
                acquired=1.0,
                prepared=2.0 + node,
                started=3.0 + node,
                pid=100 + node,
                node=node,
            )
        )
    assert plane.get(job_id).marks["started"] == 4.0  # the job started when its last node did
    plane.task_finished(
        result(
            job_id,
            w1,
            1,
            outcome="exited",
            exit_code=3,
            rank=3,
            stderr_tail=["boom"],
            marks={"exited": 5.0},
        )
    )
    assert plane.get(job_id).state == "running"  # node 0 still has to end
    assert plane.take_instructions(w0) == [CancelTask(job_id=job_id, attempt=1)]
    # Node 0 ends: ended by us (cancelled) or a rank that failed after its peer.
    plane.task_finished(
        result(job_id, w0, 0, outcome="exited", exit_code=1, rank=0, marks={"exited": 6.0})
    )
    final = plane.get(job_id)
    assert final.state == "failed" and final.exit_code == 3
    assert final.reason is not None
    assert final.reason.startswith(f"rank 3 (node 1, worker {w1}) exited with code 3")
    assert "boom" in final.reason
    # Both workers are free again; a second report changes nothing.
    assert {w.id: w.running for w in plane.list_workers()} == {w0: [], w1: []}
    plane.task_finished(result(job_id, w1, 1, outcome="exited", exit_code=0))
    assert plane.get(job_id).state == "failed"


def test_a_lost_node_retries_the_whole_gang(plane: ControlPlane) -> None:
    job_id, _, _, w0, w1 = gang(plane, max_retries=1, retry_delay=0)
    plane.unregister_worker(w1, reason="its worker b stopped heartbeating")
    assert plane.take_instructions(w0) == [CancelTask(job_id=job_id, attempt=1)]
    plane.task_finished(result(job_id, w0, 0, outcome="cancelled", exit_code=-15))
    job = plane.get(job_id)
    # Queued again (one worker left cannot hold a gang of two) and says why.
    assert job.state == "queued" and job.attempt == 1
    assert job.reason is not None and "stopped heartbeating" in job.reason
    worker(plane, "c")
    assert plane.get(job_id).state == "running" and plane.get(job_id).attempt == 2


def test_success_takes_node_0s_outputs(plane: ControlPlane) -> None:
    job_id, _, _, w0, w1 = gang(plane, outputs=["model.pt"])
    plane.task_finished(result(job_id, w1, 1, outcome="exited", exit_code=0))
    outputs = {"model.pt": ArtifactRef(kind="file", digest="a" * 64, size=1)}
    plane.task_finished(result(job_id, w0, 0, outcome="exited", exit_code=0, outputs=outputs))
    final = plane.get(job_id)
    assert final.state == "succeeded" and final.outputs == outputs


def test_a_restarted_server_hands_node_0s_port_to_a_node_that_comes_back(
    plane: ControlPlane, tmp_path: Path
) -> None:
    job_id, _, _, w0, w1 = gang(plane)
    plane.task_rendezvous(job_id, 1, w0, 40123)
    # The server restarts before node 1's worker took the Rendezvous: a new
    # control plane on the same store takes over, and the workers return.
    successor = ControlPlane(plane.store, instance_id="successor")
    successor.recover("test", workers_outlive=True)
    for wid, name in ((w0, "a"), (w1, "b")):
        successor.register_worker(
            WorkerInfo(id=wid, name=name, host=name, slot_gpus=[None]), [(job_id, 1)]
        )
    assert successor.take_instructions(w1) == [
        Rendezvous(job_id=job_id, attempt=1, master_port=40123)
    ]
    assert successor.take_instructions(w0) == []
    assert successor.get(job_id).state == "running"


def test_a_long_poll_of_a_replaced_worker_process_takes_nothing(plane: ControlPlane) -> None:
    """A killed worker's request may still be open on the server when its
    successor registers under the same id: what is placed then is the new one's."""
    wid = worker(plane, "a")
    woken: list[bool] = []
    delivery, _, generation = plane.watch_worker(wid, lambda: woken.append(True))
    assert delivery.items == []
    plane.register_worker(WorkerInfo(id=wid, name="a", host="a", slot_gpus=[None]), [])
    assert woken == [True]  # the old poll is ended...
    job = plane.submit(parse_spec({"command": ["x"]}))
    assert plane.take_instructions(wid, generation) == []  # ...empty-handed
    (task,) = plane.take_instructions(wid)
    assert isinstance(task, RunTask) and task.job_id == job.id


def test_a_restarted_server_remembers_which_nodes_already_ended(
    plane: ControlPlane,
) -> None:
    job_id, _, _, w0, w1 = gang(plane)
    plane.task_finished(result(job_id, w1, 1, outcome="exited", exit_code=0))
    successor = ControlPlane(plane.store, instance_id="successor")
    successor.recover("test", workers_outlive=True)
    successor.register_worker(
        WorkerInfo(id=w0, name="a", host="a", slot_gpus=[None]), [(job_id, 1)]
    )
    successor.register_worker(WorkerInfo(id=w1, name="b", host="b", slot_gpus=[None]), [])
    assert successor.get(job_id).state == "running"
    assert successor.take_instructions(w0) == []  # node 0 runs on, nothing cancels it
    successor.task_finished(result(job_id, w0, 0, outcome="exited", exit_code=0))
    assert successor.get(job_id).state == "succeeded"


def test_a_lost_node_that_comes_back_still_running_is_told_to_stop(plane: ControlPlane) -> None:
    job_id, _, _, _, w1 = gang(plane)
    plane.unregister_worker(w1, reason="silent")
    plane.register_worker(WorkerInfo(id=w1, name="b", host="b", slot_gpus=[None]), [(job_id, 1)])
    assert plane.take_instructions(w1) == [CancelTask(job_id=job_id, attempt=1)]


def test_a_worker_back_with_fewer_slots_does_not_break_placement(plane: ControlPlane) -> None:
    a = plane.register_worker(WorkerInfo(id="", name="a", host="a", slot_gpus=[None, None])).id
    first = plane.submit(parse_spec({"command": ["x"]}))  # a's slot 0
    b = worker(plane, "b")
    job = plane.submit(parse_spec({"command": ["x"], "nodes": 2}))
    assert [(t.worker, t.slots) for t in plane.get(job.id).tasks] == [(a, [1]), (b, [0])]
    # a returns with one slot and without its tasks.
    plane.register_worker(WorkerInfo(id=a, name="a", host="a", slot_gpus=[None]), [])
    later = plane.submit(parse_spec({"command": ["x"]}))  # placement works on
    # The first job (never taken by a) runs again on a's one slot; b still
    # holds the gang's node 1 until it has ended; so the later job waits.
    assert (plane.get(first.id).worker, plane.get(first.id).slots) == (a, [0])
    assert plane.get(later.id).state == "queued"
    assert {w.id: w.running for w in plane.list_workers()} == {a: [first.id], b: [job.id]}


def test_a_job_being_cancelled_whose_worker_is_lost_ends_cancelled(plane: ControlPlane) -> None:
    wid = worker(plane, "a")
    job = plane.submit(parse_spec({"command": ["x"], "max_retries": 3}))
    plane.cancel(job.id)
    plane.unregister_worker(wid, reason="its worker a stopped")
    final = plane.get(job.id)
    assert final.state == "cancelled", final.reason


def _give_back_node_1(plane: ControlPlane, job_id: str, w0: str, w1: str) -> None:
    plane.heartbeat(w1, stopping=True)
    plane.task_finished(result(job_id, w1, 1, outcome="returned"))  # node 1's worker stops
    assert plane.take_instructions(w0) == [CancelTask(job_id=job_id, attempt=1)]
    plane.task_finished(result(job_id, w0, 0, outcome="cancelled"))


def test_a_gang_node_given_back_queues_the_job_again_uncounted(plane: ControlPlane) -> None:
    """Under a new attempt number (a healthy node's worker may still hold the
    old one), but one that does not count against the job's retries."""
    job_id, _, _, w0, w1 = gang(plane)  # max_retries 0
    _give_back_node_1(plane, job_id, w0, w1)
    job = plane.get(job_id)
    assert (job.state, job.attempt, job.given_back) == ("queued", 1, 1)
    assert job.reason == (
        "queued again after attempt 1, not counted as one: its worker stopped before it started"
    )
    c = worker(plane, "c")  # room again for both nodes (b takes no more work)
    placed = plane.take_instructions(w0) + plane.take_instructions(c)
    assert sorted((t.node, t.attempt) for t in placed if isinstance(t, RunTask)) == [(0, 2), (1, 2)]
    for wid, node in ((w0, 0), (c, 1)):
        plane.task_finished(
            TaskResult(
                job_id=job_id, attempt=2, worker_id=wid, node=node, outcome="exited", exit_code=0
            )
        )
    final = plane.get(job_id)
    assert (final.state, final.attempt, final.given_back) == ("succeeded", 2, 1)


def test_a_failure_after_a_give_back_still_spends_the_retries(plane: ControlPlane) -> None:
    job_id, _, _, w0, w1 = gang(plane)  # max_retries 0
    _give_back_node_1(plane, job_id, w0, w1)
    c = worker(plane, "c")
    plane.take_instructions(w0), plane.take_instructions(c)
    failed = TaskResult(
        job_id=job_id, attempt=2, worker_id=c, node=1, outcome="exited", exit_code=3
    )
    plane.task_finished(failed)
    assert plane.take_instructions(w0) == [CancelTask(job_id=job_id, attempt=2)]
    plane.task_finished(
        TaskResult(job_id=job_id, attempt=2, worker_id=w0, node=0, outcome="cancelled")
    )
    final = plane.get(job_id)
    assert (final.state, final.attempt) == ("failed", 2)  # its one counted attempt: no retry


def test_a_restarted_plane_still_knows_what_was_given_back(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    first = ControlPlane(store, instance_id="first")
    job_id, _, _, w0, w1 = gang(first, max_retries=1)
    _give_back_node_1(first, job_id, w0, w1)
    second = ControlPlane(store, instance_id="second")
    second.recover("first", workers_outlive=True)
    a, c = worker(second, "a2"), worker(second, "c2")
    placed = second.take_instructions(a) + second.take_instructions(c)
    assert sorted(t.attempt for t in placed if isinstance(t, RunTask)) == [2, 2]
    second.unregister_worker(c, reason="its worker c2 stopped heartbeating")
    assert second.take_instructions(a) == [CancelTask(job_id=job_id, attempt=2)]
    second.task_finished(
        TaskResult(job_id=job_id, attempt=2, worker_id=a, node=0, outcome="cancelled")
    )
    # Two attempts, one given back: its one retry is left for this loss.
    job = second.get(job_id)
    assert (job.state, job.attempt, job.given_back) == ("queued", 2, 1), job.reason
    store.close()


@pytest.mark.parametrize("returned_first", [True, False])
def test_a_real_failure_beside_a_give_back_decides_whatever_the_order(
    plane: ControlPlane, returned_first: bool
) -> None:
    job_id, _, _, w0, w1 = gang(plane)  # max_retries 0
    plane.heartbeat(w1, stopping=True)
    returned = result(job_id, w1, 1, outcome="returned")
    error = result(job_id, w0, 0, outcome="error", error="no such image")
    for report in (returned, error) if returned_first else (error, returned):
        plane.task_finished(report)
    final = plane.get(job_id)
    assert (final.state, final.given_back) == ("failed", 0)
    assert "no such image" in (final.reason or "")


def test_a_gang_node_never_taken_by_a_worker_saying_goodbye_is_given_back(
    plane: ControlPlane,
) -> None:
    a, b = worker(plane, "a"), worker(plane, "b")
    job_id = plane.submit(parse_spec({"command": ["x"], "nodes": 2})).id  # max_retries 0
    plane.take_instructions(a)  # b stops before taking its node (still in its inbox)
    plane.unregister_worker(b, reason="its worker stopped", said=True)
    assert plane.take_instructions(a) == [CancelTask(job_id=job_id, attempt=1)]
    plane.task_finished(result(job_id, a, 0, outcome="cancelled"))
    job = plane.get(job_id)
    assert (job.state, job.attempt, job.given_back) == ("queued", 1, 1), job.reason


def test_a_gang_node_its_worker_took_is_lost_when_the_worker_goes(plane: ControlPlane) -> None:
    job_id, _, _, w0, w1 = gang(plane)  # both taken; max_retries 0
    plane.unregister_worker(w1, reason="its worker stopped", said=True)
    assert plane.take_instructions(w0) == [CancelTask(job_id=job_id, attempt=1)]
    plane.task_finished(result(job_id, w0, 0, outcome="cancelled"))
    job = plane.get(job_id)
    assert (job.state, job.given_back) == ("lost", 0)
