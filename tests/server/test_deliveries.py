"""How instructions reach a worker over HTTP: numbered, re-sent until
acknowledged, and the next task carried by the reply to a finished report.

Raw requests to a real server play the worker, so each reply can be read,
or dropped as if the network lost it.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from gpulayer.artifacts import ArtifactStore
from gpulayer.http.app import create_app
from gpulayer.http.routing import App
from gpulayer.jobs import WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore
from server.conftest import ServerProc
from server.rawhttp import asgi_request, request

from helpers import PY, refuse_commits


def _register(server: ServerProc) -> str:
    worker = {"id": "", "name": "w", "host": "h", "slot_gpus": [None]}
    status, info, _ = request(server, "POST", "/api/v1/workers", {"worker": worker})
    assert status == 201, info
    return str(info["id"])


def _generation(server: ServerProc, wid: str) -> str:
    """The worker's registration, as a poll's reply names it."""
    _, _, headers = request(server, "POST", f"/api/v1/workers/{wid}/acquire?timeout=0&ack=0")
    return headers["x-gpulayer-generation"]


def _submit(server: ServerProc) -> str:
    status, job, _ = request(server, "POST", "/api/v1/jobs", {"spec": {"command": ["true"]}})
    assert status == 201, job
    return str(job["id"])


def _acquire(server: ServerProc, wid: str, query: str) -> tuple[list[Any], str | None]:
    status, items, headers = request(server, "POST", f"/api/v1/workers/{wid}/acquire?{query}")
    assert status == 200, items
    return list(items), headers.get("x-gpulayer-seq")


def _finished(
    server: ServerProc, wid: str, job_id: str, query: str
) -> tuple[list[Any], str | None]:
    report = {"job_id": job_id, "attempt": 1, "worker_id": wid, "outcome": "exited", "exit_code": 0}
    status, items, headers = request(server, "POST", f"/api/v1/tasks/finished?{query}", report)
    assert status == 200, items
    return list(items), headers.get("x-gpulayer-seq")


async def _call(app: App, method: str, path: str, query: str, body: object = None) -> Any:
    """(status, JSON body, X-GPUlayer-Seq) of one request straight into the app."""
    status, headers, answer = await asgi_request(app, method, path, query, body)
    return status, answer, headers.get("x-gpulayer-seq")


def test_the_next_task_comes_with_the_finished_reply_not_the_open_poll(tmp_path: Path) -> None:
    """In a stream of jobs on one slot, the finished report's reply carries the
    next task: the worker's open long poll is not answered with it (one reply,
    not two). One event loop, so the poll is surely open when the report comes."""
    store = SqliteStore(tmp_path / "db.sqlite")
    plane = ControlPlane(store, instance_id="test")
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=False)
    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    first, second = (plane.submit(parse_spec({"command": ["true"]})).id for _ in range(2))
    acquire = f"/api/v1/workers/{wid}/acquire"
    report = {"job_id": first, "attempt": 1, "worker_id": wid, "outcome": "exited", "exit_code": 0}

    async def scenario() -> None:
        status, items, seq = await _call(app, "POST", acquire, "timeout=5&ack=0")
        assert (status, [i["job_id"] for i in items], seq) == (200, [first], "1")
        poll = asyncio.create_task(_call(app, "POST", acquire, "timeout=0.5&ack=1"))
        for _ in range(3):  # let it run up to its wait
            await asyncio.sleep(0)
        assert not poll.done()
        finished = await _call(app, "POST", "/api/v1/tasks/finished", "take=1&ack=1", report)
        status, items, seq = finished
        assert (status, [(i["type"], i["job_id"]) for i in items], seq) == (
            200,
            [("run", second)],
            "2",
        )
        for _ in range(3):
            await asyncio.sleep(0)
        assert not poll.done()  # the report took the task: the poll is not even woken
        status, items, _ = await poll
        assert (status, items) == (200, [])  # it waited out its timeout, empty-handed

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_a_delivery_whose_reply_was_lost_is_sent_again(server: ServerProc) -> None:
    wid = _register(server)
    job_id = _submit(server)
    items, seq = _acquire(server, wid, "timeout=5&ack=0")
    assert (items[0]["job_id"], seq) == (job_id, "1")
    # That reply "was lost": the next poll acknowledges nothing yet, and the
    # task comes again with its number; a poll acknowledging it gets nothing.
    again, seq = _acquire(server, wid, "timeout=5&ack=0")
    assert (again, seq) == (items, "1")
    assert _acquire(server, wid, "timeout=0&ack=1") == ([], "2")
    # A finished report acknowledges too, and what it does not cover comes again.
    second = _submit(server)  # waits for the one slot
    items, seq = _finished(server, wid, job_id, "take=1&ack=1")
    assert ([i["job_id"] for i in items], seq) == ([second], "2")
    assert _finished(server, wid, job_id, "take=1&ack=1") == (items, "2")  # reply lost: again
    assert _finished(server, wid, job_id, "take=1&ack=2") == ([], "3")


def test_workers_that_do_not_number_deliveries_get_plain_lists(server: ServerProc) -> None:
    wid = _register(server)
    job_id = _submit(server)
    items, seq = _acquire(server, wid, "timeout=5")
    assert ([i["job_id"] for i in items], seq) == ([job_id], None)
    assert _acquire(server, wid, "timeout=0") == ([], None)  # taken once, never re-sent
    _submit(server)
    assert _finished(server, wid, job_id, "") == ([], None)  # no take: nothing comes with it
    items, _ = _acquire(server, wid, "timeout=5")
    assert len(items) == 1


def test_a_stopping_worker_does_not_take_the_queue_with_it(
    server: ServerProc, tmp_path: Path
) -> None:
    """Its running task ends lost; it must not then take each waiting job in
    the reply to handing the last one back, and hand that back too."""
    proc = server.start_worker(tmp_path / "w", slots=1)
    with server.client() as client:
        code = "import time; print('up', flush=True); time.sleep(60)"
        running = client.submit(command=[PY, "-c", code])
        assert client.transport.read_logs(running.id, (0, 0), timeout=30).lines  # it runs
        waiting = [client.submit(command=["true"]) for _ in range(20)]  # the one slot is busy
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert running.refresh().state == "lost"
        states = [job.refresh().state for job in waiting]
        # Those placed on it as it stopped were given back unrun, not lost:
        # they all wait for another worker, and run there though none may
        # be retried (max_retries is 0).
        assert states == ["queued"] * len(waiting), states
        server.start_worker(tmp_path / "w2", slots=1, name="w2")
        assert [job.wait(timeout=60) for job in waiting] == ["succeeded"] * len(waiting)


def test_an_acknowledgement_from_an_earlier_registration_confirms_nothing(
    server: ServerProc,
) -> None:
    wid = _register(server)
    done = _submit(server)
    items, seq = _acquire(server, wid, "timeout=5&ack=0")
    old = _generation(server, wid)
    assert items[0]["job_id"] == done
    _finished(server, wid, done, f"take=1&ack=1&gen={old}")
    # The worker registers again (same id): numbers start afresh, under a new generation.
    worker = {"id": wid, "name": "w", "host": "h", "slot_gpus": [None]}
    status, _, headers = request(server, "POST", "/api/v1/workers", {"worker": worker})
    new = headers["x-gpulayer-generation"]
    assert status == 201 and new != old
    job_id = _submit(server)
    items, seq = _acquire(server, wid, f"timeout=5&ack=0&gen={new}")
    assert ([i["job_id"] for i in items], seq) == ([job_id], "1")  # and that reply is lost
    # A report made before the re-registration, with its old numbers, lands now:
    # it acknowledges nothing and takes nothing.
    assert _finished(server, wid, done, f"take=1&ack=3&gen={old}") == ([], "0")
    # So the next poll gets the lost task again; a stale poll gets nothing.
    items, seq = _acquire(server, wid, f"timeout=5&ack=0&gen={new}")
    assert ([i["job_id"] for i in items], seq) == ([job_id], "1")
    assert _acquire(server, wid, f"timeout=5&ack=1&gen={old}") == ([], "0")


def test_a_report_the_store_refused_is_a_503_and_applies_when_sent_again(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    plane = ControlPlane(store, instance_id="test")
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=False)
    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    first, second = (plane.submit(parse_spec({"command": ["true"]})).id for _ in range(2))
    report = {"job_id": first, "attempt": 1, "worker_id": wid, "outcome": "exited", "exit_code": 0}

    async def scenario() -> None:
        status, items, _ = await _call(app, "POST", f"/api/v1/workers/{wid}/acquire", "ack=0")
        assert (status, [i["job_id"] for i in items]) == (200, [first])
        refuse_commits(store)
        status, body, _ = await _call(app, "POST", "/api/v1/tasks/finished", "take=1&ack=1", report)
        assert status == 503
        assert "disk is full" in body["error"] and "try again" in body["error"]
        assert plane.get(first).state == "running"
        status, items, _ = await _call(
            app, "POST", "/api/v1/tasks/finished", "take=1&ack=1", report
        )
        assert (status, [i["job_id"] for i in items]) == (200, [second])
        assert plane.get(first).state == "succeeded"

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_a_read_the_store_fails_is_a_503_naming_it(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    plane = ControlPlane(store, instance_id="test")
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=False)
    refuse_commits(store, 0).reads_fail = True

    async def scenario() -> None:
        for path in ("/api/v1/jobs", "/api/v1/jobs/0123456789abcd", "/api/v1/workers"):
            status, body, _ = await _call(app, "GET", path, "")
            assert status == 503, path
            assert "disk I/O error" in body["error"]

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_a_long_poll_for_a_registration_the_server_replaced_asks_to_register_again(
    server: ServerProc,
) -> None:
    """The server changed the worker's registration without the worker (it
    refused to store one half-way, with a 503): the worker's polls would be
    answered empty at once, forever. The poll says it must register again."""
    from gpulayer.errors import InvalidStateError
    from gpulayer.jobs import WorkerInfo
    from gpulayer.transport.http import HttpTransport

    transport = HttpTransport(server.url, token=server.admin)
    try:
        info = transport.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None]))
        assert transport.acquire(info.id, timeout=0) == []  # its own registration: fine
        again = {"id": info.id, "name": "w", "host": "h", "slot_gpus": [None]}
        status, _, _ = request(server, "POST", "/api/v1/workers", {"worker": again})
        assert status == 201  # a registration the worker never heard of
        with pytest.raises(InvalidStateError, match="register again"):
            transport.acquire(info.id, timeout=5)
        transport.register_worker(info)  # it does, and polls as before
        assert transport.acquire(info.id, timeout=0) == []
    finally:
        transport.close()


def test_a_goodbye_to_an_earlier_registration_leaves_the_worker(server: ServerProc) -> None:
    """A dead worker's goodbye that comes late (held up on its way) finds
    its id registered again by the next worker process on its home: it is
    for the registration it names, so that one stays, with its job."""
    from gpulayer.jobs import WorkerInfo
    from gpulayer.transport.http import HttpTransport

    dead, heir = (HttpTransport(server.url, token=server.admin) for _ in range(2))
    try:
        info = dead.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None]))
        gone = dead.generation()
        heir.register_worker(info, adopted=True)
        assert gone is not None and heir.generation() not in (None, gone)
        dead.unregister_worker(info.id, died=True, generation=gone)  # late: changes nothing
        assert [w.id for w in heir.list_workers()] == [info.id]
        heir.unregister_worker(info.id, died=True, generation=heir.generation())
        assert heir.list_workers() == []
    finally:
        dead.close()
        heir.close()


def test_a_goodbye_to_a_worker_known_from_before_a_restart_removes_it(
    server: ServerProc,
) -> None:
    """Registration numbers live in the server's memory: after a restart, a
    worker known from the store has none, and a goodbye naming its last one
    (its warden's, say, once the server is back) still removes it."""
    from gpulayer.jobs import WorkerInfo
    from gpulayer.transport.http import HttpTransport

    before = HttpTransport(server.url, token=server.admin, retries=1)
    info = before.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None]))
    generation = before.generation()
    before.close()
    server.kill()
    server.start()  # same home: the worker is known, not connected
    after = HttpTransport(server.url, token=server.admin, retries=1)
    try:
        after.unregister_worker(info.id, died=True, generation=generation)
        assert after.list_workers() == []
    finally:
        after.close()
