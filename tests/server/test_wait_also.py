"""Waiting on one job brings the ends of the others asked about.

A client that waits on a batch of jobs one by one asks about its other
unfinished jobs with each wait, and the reply brings those that have ended:
a job whose end came that way costs no request of its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

import gpulayer
import gpulayer.client
from gpulayer.artifacts import ArtifactStore
from gpulayer.errors import JobNotFoundError, TransportError
from gpulayer.http.app import create_app
from gpulayer.jobs import TaskResult, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore
from server.conftest import ServerProc
from server.rawhttp import asgi_request

from helpers import PY


def _plane(tmp_path: Path) -> tuple[SqliteStore, ControlPlane, Any, str]:
    store = SqliteStore(tmp_path / "db.sqlite")
    plane = ControlPlane(store, instance_id="test")
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=False)
    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None] * 3)).id
    return store, plane, app, wid


def _finish(plane: ControlPlane, wid: str, job_id: str, code: int = 0) -> None:
    plane.task_finished(
        TaskResult(job_id=job_id, attempt=1, worker_id=wid, outcome="exited", exit_code=code)
    )


def test_the_reply_brings_the_others_that_ended_by_then(tmp_path: Path) -> None:
    store, plane, app, wid = _plane(tmp_path)
    a, b, c = (plane.submit(parse_spec({"command": ["true"]})).id for _ in range(3))
    _finish(plane, wid, b, code=3)

    async def scenario() -> None:
        waiting = asyncio.create_task(
            asgi_request(app, "POST", "/api/v1/jobs/wait", "timeout=5", {"id": a, "also": [b, c]})
        )
        for _ in range(3):  # let it run up to its wait
            await asyncio.sleep(0)
        assert not waiting.done()
        _finish(plane, wid, c)  # ends while the wait for a is open
        _finish(plane, wid, a)
        status, _, reply = await waiting
        assert status == 200
        assert (reply["job"]["id"], reply["job"]["state"]) == (a, "succeeded")
        ended = {j["id"]: (j["state"], j["exit_code"]) for j in reply["also"]}
        assert ended == {b: ("failed", 3), c: ("succeeded", 0)}

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_at_the_timeout_the_job_comes_as_it_is_with_only_ended_others(tmp_path: Path) -> None:
    store, plane, app, _ = _plane(tmp_path)
    a, b = (plane.submit(parse_spec({"command": ["true"]})).id for _ in range(2))
    try:
        status, _, reply = asyncio.run(
            asgi_request(app, "POST", "/api/v1/jobs/wait", "timeout=0.05", {"id": a, "also": [b]})
        )
        assert status == 200
        assert reply["job"]["state"] == "running"
        assert reply["also"] == []  # b runs on: not brought
    finally:
        store.close()


def test_ids_of_no_job_among_the_others_are_named_not_an_error(tmp_path: Path) -> None:
    """The others are hints (a client's handles may come from another server)."""
    store, plane, app, wid = _plane(tmp_path)
    a, b = (plane.submit(parse_spec({"command": ["true"]})).id for _ in range(2))
    _finish(plane, wid, a)
    _finish(plane, wid, b)
    try:
        body = {"id": a, "also": ["0000000000zzzz", b]}
        status, _, reply = asyncio.run(
            asgi_request(app, "POST", "/api/v1/jobs/wait", "timeout=0", body)
        )
        assert status == 200, reply
        assert [j["id"] for j in reply["also"]] == [b]
        assert reply["unknown"] == ["0000000000zzzz"]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        ({"id": "0000000000zzzz"}, 404, "0000000000zzzz"),
        ({"id": "JOB", "also": "JOB"}, 422, "also"),
        ({"id": "JOB", "also": ["x"] * 1001}, 422, "also"),
        ({"also": []}, 422, "id"),
    ],
)
def test_bad_waits_are_refused_naming_the_problem(
    tmp_path: Path, body: dict[str, Any], status: int, names: str
) -> None:
    store, plane, app, _ = _plane(tmp_path)
    job = plane.submit(parse_spec({"command": ["true"]})).id
    for key, value in body.items():
        body[key] = job if value == "JOB" else value
    try:
        got, _, reply = asyncio.run(
            asgi_request(app, "POST", "/api/v1/jobs/wait", "timeout=0", body)
        )
        assert got == status, reply
        assert names in reply["error"]
    finally:
        store.close()


def test_waiting_on_a_batch_one_by_one_needs_about_one_request_per_batch(
    server: ServerProc, tmp_path: Path
) -> None:
    """Ten jobs on one slot run in turn: once the last has ended, so have the
    others, and the reply to that one wait brings them all."""
    server.start_worker(tmp_path / "worker", slots=1)
    with gpulayer.Client(server.url, token=server.admin) as client:
        jobs = [client.submit(command=[PY, "-c", f"raise SystemExit({i})"]) for i in range(10)]
        asked: list[tuple[str, list[str]]] = []
        transport = client.transport
        wait_also = transport.wait_also

        def spy(job_id: str, also: Any, timeout: float | None) -> Any:
            asked.append((job_id, list(also)))
            return wait_also(job_id, also, timeout)

        transport.wait_also = spy  # type: ignore[method-assign]
        assert jobs[-1].wait(timeout=60) == "failed"
        assert asked == [(jobs[-1].id, [j.id for j in jobs[:-1]])]
        # Each of the others learnt its end from that reply: no more requests.
        for i, job in enumerate(jobs[:-1]):
            assert job.info.done
            assert job.wait() == ("succeeded" if i == 0 else "failed")
            assert job.exit_code == i
        assert len(asked) == 1


def test_a_handle_on_a_job_this_server_never_had_does_not_break_waits(
    server: ServerProc, tmp_path: Path
) -> None:
    server.start_worker(tmp_path / "worker", slots=1)
    with gpulayer.Client(server.url, token=server.admin) as client:
        real = client.submit(command=[PY, "-c", "pass"])
        stale = gpulayer.client.Job(client, msgspec.structs.replace(real.info, id="0000000000zzzz"))
        assert real.wait(timeout=60) == "succeeded"
        assert stale.id not in client._unfinished  # dropped: never asked about again
        with pytest.raises(JobNotFoundError):
            stale.wait(timeout=5)  # its own wait says so


def test_against_a_server_without_the_endpoint_waits_go_one_by_one(
    server: ServerProc, tmp_path: Path
) -> None:
    """A server older than POST /api/v1/jobs/wait routes it to a job's path and
    answers 405 (played here by refusing it in the client's transport)."""
    server.start_worker(tmp_path / "worker", slots=1)
    with gpulayer.Client(server.url, token=server.admin) as client:
        transport = client.transport
        call = transport._call  # type: ignore[attr-defined]
        paths: list[str] = []

        def older_server(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            paths.append(path)
            if path == "/api/v1/jobs/wait":
                raise TransportError(
                    "the server refused the request (405): POST is not allowed on "
                    "/api/v1/jobs/wait (allowed: GET, HEAD)"
                )
            return call(method, path, *args, **kwargs)

        transport._call = older_server  # type: ignore[attr-defined]
        jobs = [client.submit(command=[PY, "-c", "pass"]) for _ in range(3)]
        assert [j.wait(timeout=60) for j in jobs] == ["succeeded"] * 3
        waits = [p for p in paths if "wait" in p]
        assert waits == ["/api/v1/jobs/wait", *(f"/api/v1/jobs/{j.id}/wait" for j in jobs)]
