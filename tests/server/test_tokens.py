"""Listing and revoking API tokens: a real server, raw requests and the CLI;
the role cache and the store's guard for the last admin token in-process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpulayer.artifacts import ArtifactStore
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.http.openapi import document
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore
from gpulayer.transport.http import HttpTransport
from server.conftest import ServerProc, said
from server.rawhttp import asgi_request, request

from helpers import PY, pids_alive, refuse_commits

REVOKED = {"error": "the token is not valid on this server"}
_WORKER = {"worker": {"id": "", "name": "w", "host": "h", "slot_gpus": [None]}}


def _id(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def _make(server: ServerProc, role: str, name: str | None = None) -> str:
    """A token of ``role``; a user token's user is its name, else carol."""
    transport = HttpTransport(server.url, token=server.admin)
    try:
        return transport.create_token(
            role, name, user=(name or "carol") if role == "user" else None
        )
    finally:
        transport.close()


def _listed(server: ServerProc) -> list[dict[str, Any]]:
    status, tokens, _ = request(server, "GET", "/api/v1/tokens")
    assert status == 200, tokens
    assert isinstance(tokens, list)
    return tokens


def _revoke(server: ServerProc, token_id: str, token: str = "admin") -> tuple[int, Any]:
    status, answer, _ = request(server, "DELETE", f"/api/v1/tokens/{token_id}", token=token)
    return status, answer


# ---- a real server ----


def test_the_list_shows_each_token_without_its_secret(server: ServerProc) -> None:
    before = time.time()
    alice = _make(server, "user", "alice")
    box = _make(server, "worker")
    after = time.time()
    tokens = _listed(server)
    assert [(t["id"], t["role"], t["name"]) for t in tokens] == [
        (_id(server.admin), "admin", "first admin"),
        (_id(alice), "user", "alice"),
        (_id(box), "worker", None),
    ]
    assert all(set(t) == {"id", "role", "name", "user", "created", "expires"} for t in tokens)
    assert [t["user"] for t in tokens] == [None, "alice", None]
    assert [t["expires"] for t in tokens] == [None, None, None]
    assert before <= tokens[1]["created"] <= tokens[2]["created"] <= after
    shown = str(tokens)
    for token in (server.admin, alice, box):
        secret = token.split("_", 2)[2]
        assert secret not in shown
        assert hashlib.sha256(token.encode()).hexdigest() not in shown  # what the store keeps


def test_a_revoked_user_token_is_refused_from_its_next_request(server: ServerProc) -> None:
    alice, bob = _make(server, "user", "alice"), _make(server, "user", "bob")
    for _ in range(2):  # the second is answered from the server's cache of roles
        assert request(server, "GET", "/api/v1/jobs", token=alice)[0] == 200
    assert request(server, "GET", "/api/v1/jobs", token=bob)[0] == 200
    assert _revoke(server, _id(alice)) == (204, {})
    for _ in range(2):
        status, answer, _ = request(server, "GET", "/api/v1/jobs", token=alice)
        assert (status, answer) == (401, REVOKED)
    # Nothing else changed: the other tokens work, and only alice's left the list.
    assert request(server, "GET", "/api/v1/jobs", token=bob)[0] == 200
    assert [t["name"] for t in _listed(server)] == ["first admin", "bob"]


def test_a_revoked_worker_token_is_refused_and_its_workers_go(server: ServerProc) -> None:
    """Its workers can no longer be heard: they are removed at once, so
    nothing more is placed on them (a job stays queued, not lost unrun)."""
    mine = _make(server, "worker")
    status, registered, _ = request(server, "POST", "/api/v1/workers", _WORKER, token=mine)
    assert status == 201, registered
    beat = f"/api/v1/workers/{registered['id']}/heartbeat"
    assert request(server, "POST", beat, {"running": []}, token=mine)[0] == 204
    assert _revoke(server, _id(mine)) == (204, {})
    assert request(server, "POST", beat, {"running": []}, token=mine)[:2] == (401, REVOKED)
    acquire = f"/api/v1/workers/{registered['id']}/acquire?timeout=0"
    assert request(server, "POST", acquire, token=mine)[:2] == (401, REVOKED)
    assert request(server, "POST", "/api/v1/workers", _WORKER, token=mine)[:2] == (401, REVOKED)
    with server.client() as client:
        assert client.workers() == []
        job = client.submit(command=[PY, "-c", "pass"], max_retries=0)
        assert job.info.state == "queued", job.info.reason


def test_a_worker_whose_token_is_revoked_exits_and_comes_back_with_a_new_one(
    server: ServerProc, tmp_path: Path
) -> None:
    """Its job ends at once; the worker says why it cannot go on, ends its
    task (still printing, its last lines refused too) and exits, leaving its
    home clean; started again there with a new token, it serves."""
    box = _make(server, "worker", "box")
    home = tmp_path / "w1"
    worker = server.start_worker(home, token=box)
    with server.client() as client:
        code = (
            "import os, time\n"
            "print('on', os.getpid(), flush=True)\n"
            "while True:\n"
            "    print('tick', flush=True)\n"
            "    time.sleep(0.05)\n"
        )
        job = client.submit(command=[PY, "-c", code], max_retries=0)
        on, pid = next(line.text for line in job.stream_logs()).split()
        assert on == "on"
        assert _revoke(server, _id(box)) == (204, {})
        assert job.wait(timeout=30) == "lost"
        assert job.info.reason == "its worker's token was revoked"
        said(worker, "stopping: the server refused this worker's token")
        assert worker.wait(timeout=60) == 1
        assert pids_alive(int(pid)) == []
        assert list((home / "workers" / "live").iterdir()) == []  # it left cleanly
        server.start_worker(home, token=_make(server, "worker", "box again"))
        again = client.submit(command=[PY, "-c", "print('back')"])
        assert again.wait(timeout=60) == "succeeded"


def test_the_last_admin_token_cannot_be_revoked(server: ServerProc) -> None:
    first = _id(server.admin)
    status, answer = _revoke(server, first)
    assert status == 409, answer
    assert answer["error"] == (
        f"token {first} is the last admin token that does not expire: without it no one could "
        "make or revoke tokens once the others expire; make another admin token first"
    )
    assert [t["id"] for t in _listed(server)] == [first]  # still there, and still works
    second = _make(server, "admin", "second")
    assert _revoke(server, first, token=second) == (204, {})
    assert request(server, "GET", "/api/v1/tokens", token=server.admin)[:2] == (401, REVOKED)
    assert _revoke(server, _id(second), token=second)[0] == 409
    assert request(server, "GET", "/api/v1/tokens", token=second)[0] == 200


def test_only_an_admin_lists_or_revokes_and_an_unknown_id_is_a_404(server: ServerProc) -> None:
    user, worker = _make(server, "user"), _make(server, "worker")
    for token, role in ((user, "user"), (worker, "worker")):
        status, answer, _ = request(server, "GET", "/api/v1/tokens", token=token)
        assert (status, answer) == (403, {"error": f"a {role} token cannot do this (needs: admin)"})
        status, answer = _revoke(server, _id(user), token=token)
        assert status == 403, answer
    assert len(_listed(server)) == 3  # nothing was revoked
    for unknown in ("0123456789ab", "nope", "f" * 64):
        status, answer = _revoke(server, unknown)
        assert status == 404, answer
        assert answer["error"] == f"no token {unknown} on this server (see GET /api/v1/tokens)"
    assert request(server, "GET", "/api/v1/jobs", token=user)[0] == 200


def _gl(
    *args: str, server: ServerProc | None, token: str | None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPULAYER_SERVER", "GPULAYER_TOKEN")}
    env["COLUMNS"] = "200"
    where = ["--server", server.url] if server else []
    who = ["--token", token] if token else []
    return subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", *where, *who, "token", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_token_list_and_revoke_from_the_command_line(server: ServerProc) -> None:
    made = _gl(
        "create",
        "--role",
        "user",
        "--user",
        "bob",
        "--name",
        "[bold]bob",
        server=server,
        token=server.admin,
    )
    assert made.returncode == 0, made.stderr
    bob = made.stdout.strip()
    brief = _gl(
        "create", "--role", "worker", "--expires-in", "2d", server=server, token=server.admin
    )
    assert brief.returncode == 0, brief.stderr
    listed = _gl("list", server=server, token=server.admin)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[0] == ["ID", "ROLE", "USER", "NAME", "CREATED", "EXPIRES"]
    assert [row[:4] for row in rows[1:]] == [
        [_id(server.admin), "admin", "-", "first"],  # "first admin": two words
        [_id(bob), "user", "bob", "[bold]bob"],  # a name is shown as it is, not as markup
        [_id(brief.stdout.strip()), "worker", "-", "-"],
    ]
    assert time.strptime(" ".join(rows[2][4:6]), "%Y-%m-%d %H:%M:%S")
    assert rows[2][6:] == ["never"]
    expires = time.mktime(time.strptime(" ".join(rows[3][6:8]), "%Y-%m-%d %H:%M:%S"))
    assert abs(expires - (time.time() + 2 * 86400)) < 120
    for bad in ("soon", "0", "-1h", "3y", "1.5.2d", "3651d", "9" * 400):
        refused = _gl(
            "create", "--role", "user", "--expires-in", bad, server=server, token=server.admin
        )
        assert refused.returncode == 2 and "is not a duration" in refused.stderr, bad
    assert bob.split("_", 2)[2] not in listed.stdout

    revoked = _gl("revoke", _id(bob), server=server, token=server.admin)
    assert (revoked.returncode, revoked.stdout) == (0, f"token {_id(bob)} revoked\n")
    assert request(server, "GET", "/api/v1/jobs", token=bob)[0] == 401
    assert _id(bob) not in _gl("list", server=server, token=server.admin).stdout

    again = _gl("revoke", _id(bob), server=server, token=server.admin)
    assert again.returncode == 2
    assert f"gpulayer: error: no token {_id(bob)} on this server" in again.stderr
    last = _gl("revoke", _id(server.admin), server=server, token=server.admin)
    assert last.returncode == 2 and "is the last admin token" in last.stderr
    user = _make(server, "user")
    denied = _gl("list", server=server, token=user)
    assert denied.returncode == 2
    assert "a user token cannot do this (needs: admin)" in denied.stderr
    assert user not in denied.stderr


@pytest.mark.parametrize("args", [["list"], ["revoke", "0123456789ab"]])
def test_token_commands_need_a_server(args: list[str]) -> None:
    done = _gl(*args, server=None, token="glt_a_x")
    assert done.returncode == 2
    assert "tokens belong to a server: --server URL or GPULAYER_SERVER" in done.stderr


# ---- in-process ----


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    db = SqliteStore(tmp_path / "db.sqlite")
    try:
        yield db
    finally:
        db.close()


def test_every_spelling_of_a_revoked_token_is_dropped_from_the_cache(
    store: SqliteStore, tmp_path: Path
) -> None:
    app = create_app(ControlPlane(store, instance_id="s1"), ArtifactStore(tmp_path / "blobs"))
    admin, user = auth.create_token(store, "admin"), auth.create_token(store, "user", user="carol")
    spellings = [f"Bearer {user}", f"bearer {user}", f"Bearer  {user} "]

    async def jobs(header: str) -> int:
        auth_header = [(b"authorization", header.encode())]
        status, _, _ = await asgi_request(app, "GET", "/api/v1/jobs", headers=auth_header)
        return int(status)

    async def scenario() -> tuple[list[int], int, list[int]]:
        before = [await jobs(h) for h in spellings]  # each one cached
        path = f"/api/v1/tokens/{_id(user)}"
        revoked, _, _ = await asgi_request(app, "DELETE", path, token=admin)
        return before, revoked, [await jobs(h) for h in spellings]

    assert asyncio.run(scenario()) == ([200, 200, 200], 204, [401, 401, 401])


def test_the_store_keeps_the_last_token_of_a_role(store: SqliteStore) -> None:
    store.add_token("a" * 64, "admin", "one", 1.0)
    store.add_token("b" * 64, "admin", "two", 2.0)
    store.add_token("c" * 64, "user", None, 3.0)
    assert store.delete_token("c" * 64, keep_last="admin")  # the last user token: no guard
    assert store.delete_token("a" * 64, keep_last="admin")
    assert not store.delete_token("b" * 64, keep_last="admin")
    assert not store.delete_token("d" * 64, keep_last="admin")  # none such
    assert store.list_tokens() == [("b" * 64, "admin", "two", 2.0, None)]
    # One that expires does not count: it cannot stand in for the last one.
    store.add_token("e" * 64, "admin", "brief", 4.0, expires=5.0)
    assert not store.delete_token("b" * 64, keep_last="admin")
    assert store.delete_token("e" * 64, keep_last="admin")
    assert store.delete_token("b" * 64)  # no guard asked for


def test_a_new_token_never_takes_an_id_in_use(
    store: SqliteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn = iter(["same", "same", "other"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda _n: next(drawn))
    first, second = (
        auth.create_token(store, "user", user="carol"),
        auth.create_token(store, "user", user="carol"),
    )
    assert (first, second) == ("glt_u_same", "glt_u_other")  # "same" again was drawn anew
    assert sorted(t.id for t in auth.list_tokens(store)) == sorted([_id(first), _id(second)])


def test_the_document_describes_both_routes() -> None:
    paths = document()["paths"]
    listing = paths["/api/v1/tokens"]["get"]["responses"]["200"]["content"]["application/json"]
    assert listing["schema"]["type"] == "array"
    revoke = paths["/api/v1/tokens/{token_id}"]["delete"]
    assert revoke["parameters"][0]["schema"]["pattern"] == "^[0-9a-f]{12}$"
    assert "204" in revoke["responses"] and "409" in revoke["responses"]


def _in_process(store: SqliteStore, tmp_path: Path) -> tuple[ControlPlane, Any, str, str]:
    """A plane and its app (no server process), an admin token and a worker token."""
    plane = ControlPlane(store, instance_id="s1")
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"))
    return plane, app, auth.create_token(store, "admin"), auth.create_token(store, "worker")


@pytest.mark.parametrize("ends", ["revoked", "expires"])
def test_a_registration_whose_body_comes_after_the_token_ends_registers_nothing(
    store: SqliteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """The token is checked when the headers arrive; revoked, or expired, while
    the body is on its way, it must not register a worker nothing can hear
    (jobs would be placed on it, and end lost unrun)."""
    plane, app, admin, box = _in_process(store, tmp_path)
    clock = [time.time()]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    if ends == "expires":
        box = auth.create_token(store, "worker", expires=clock[0] + 60)

    async def scenario() -> tuple[int, int]:
        reading, body_may_come = asyncio.Event(), asyncio.Event()
        sent: list[dict[str, Any]] = []
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/api/v1/workers",
            "raw_path": b"/api/v1/workers",
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"authorization", f"Bearer {box}".encode()),
            ],
        }

        async def receive() -> dict[str, Any]:
            reading.set()  # past the token check: reading the body
            await body_may_come.wait()
            return {"type": "http.request", "body": json.dumps(_WORKER).encode()}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        # Its role is cached first, as for a worker that made requests before
        # (the guard caches it before it refuses what a worker may not do).
        assert (await asgi_request(app, "GET", "/api/v1/workers", token=box))[0] == 403
        registering = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(reading.wait(), 10)
        if ends == "revoked":
            ended, _, _ = await asgi_request(
                app, "DELETE", f"/api/v1/tokens/{_id(box)}", token=admin
            )
        else:
            clock[0] += 61
            ended = 204
        body_may_come.set()
        await asyncio.wait_for(registering, 10)
        return ended, sent[0]["status"]

    assert asyncio.run(scenario()) == (204, 401)
    assert plane.list_workers() == []
    job = plane.submit(parse_spec({"command": [PY, "-c", "pass"], "max_retries": 0}))
    assert job.state == "queued"


async def _registered_then_revoked(
    app: Any, admin: str, box: str, between: Callable[[], object]
) -> tuple[int, int]:
    """A worker registered with ``box``, then ``between()``, then ``box`` revoked:
    the two statuses."""
    registered, _, _ = await asgi_request(app, "POST", "/api/v1/workers", body=_WORKER, token=box)
    between()
    revoked, _, _ = await asgi_request(app, "DELETE", f"/api/v1/tokens/{_id(box)}", token=admin)
    return registered, revoked


def test_a_job_placed_on_a_revoked_worker_but_never_taken_is_queued_again(
    store: SqliteStore, tmp_path: Path
) -> None:
    plane, app, admin, box = _in_process(store, tmp_path)

    def placed() -> None:  # on it; no long poll took it yet
        job = plane.submit(parse_spec({"command": [PY, "-c", "pass"], "max_retries": 0}))
        assert job.state == "running"

    assert asyncio.run(_registered_then_revoked(app, admin, box, placed)) == (201, 204)
    (job,) = plane.list_jobs()
    assert (job.state, job.attempt - job.given_back) == ("queued", 0), job.reason


def test_a_revoke_whose_worker_removal_the_store_refused_still_places_nothing_on_it(
    store: SqliteStore, tmp_path: Path
) -> None:
    plane, app, admin, box = _in_process(store, tmp_path)
    refused = asyncio.run(
        _registered_then_revoked(app, admin, box, lambda: refuse_commits(store, 1))
    )
    assert refused == (201, 204)
    job = plane.submit(parse_spec({"command": [PY, "-c", "pass"], "max_retries": 0}))
    assert job.state == "queued", f"placed on {job.worker}, a worker whose token is revoked"


@pytest.mark.parametrize("ends", ["revoked while the store refused its removal", "expires"])
def test_a_worker_whose_token_went_unheard_is_taken_over_but_not_its_tasks(
    store: SqliteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """Its token revoked while the store refused the worker's removal, or
    expired while it could not say so, the worker stays bound to a dead
    token. The one started again on its home with a new token takes over its
    id, but its running job ends first: no token takes over a task."""
    plane, app, admin, box = _in_process(store, tmp_path)
    other = auth.create_token(store, "worker")
    clock = [time.time()]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    if ends == "expires":
        box = auth.create_token(store, "worker", expires=clock[0] + 60)

    async def scenario() -> tuple[int, int, list[Any]]:
        _, _, info = await asgi_request(app, "POST", "/api/v1/workers", body=_WORKER, token=box)
        job = plane.submit(parse_spec({"command": [PY, "-c", "pass"], "max_retries": 0}))
        acquire = f"/api/v1/workers/{info['id']}/acquire"
        await asgi_request(app, "POST", acquire, "timeout=0", token=box)
        if ends == "expires":
            clock[0] += 61
            revoked = 204
        else:
            refuse_commits(store, 1)
            revoked, _, _ = await asgi_request(
                app, "DELETE", f"/api/v1/tokens/{_id(box)}", token=admin
            )
        assert plane.get(job.id).state == "running"  # nothing removed it yet
        takeover = {
            "worker": {**_WORKER["worker"], "id": info["id"]},
            "running": [[job.id, 1]],
            "adopted": True,
        }
        # While the store refuses the old worker's removal, it keeps its tasks:
        # nothing is let through for it (a 503: try again).
        refuse_commits(store, 2)  # one removal each
        acquire_other = await asgi_request(app, "POST", acquire, "timeout=0", token=other)
        refused, _, _ = await asgi_request(
            app, "POST", "/api/v1/workers", body=takeover, token=other
        )
        assert (acquire_other[0], refused) == (503, 503), acquire_other
        assert plane.get(job.id).state == "running"
        taken, _, _ = await asgi_request(app, "POST", "/api/v1/workers", body=takeover, token=other)
        _, _, told = await asgi_request(app, "POST", acquire, "timeout=0", token=other)
        return revoked, taken, told

    revoked, taken, told = asyncio.run(scenario())
    assert (revoked, taken) == (204, 201)
    (job,) = plane.list_jobs()
    assert (job.state, job.reason) == ("lost", "its worker's token expired or was revoked")
    assert [(t["type"], t["job_id"]) for t in told] == [("cancel", job.id)]  # end it


def test_a_worker_declared_lost_can_come_back_under_its_id_with_another_token(
    store: SqliteStore, tmp_path: Path
) -> None:
    """The worker on its home adopts the id of the one that died (its token
    since replaced): once the server has declared that one lost, the old
    binding must not refuse it until the server restarts."""
    plane, app, _, first = _in_process(store, tmp_path)
    second = auth.create_token(store, "worker")

    async def scenario() -> tuple[int, int, int]:
        status, _, info = await asgi_request(
            app, "POST", "/api/v1/workers", body=_WORKER, token=first
        )
        again = {"worker": {**_WORKER["worker"], "id": info["id"]}, "adopted": True}
        refused, _, _ = await asgi_request(app, "POST", "/api/v1/workers", body=again, token=second)
        assert plane.reap(-1.0) == [info["id"]]  # silent (any time counts): declared lost
        back, _, _ = await asgi_request(app, "POST", "/api/v1/workers", body=again, token=second)
        return status, refused, back

    assert asyncio.run(scenario()) == (201, 403, 201)


def test_after_a_restart_no_other_token_acts_for_a_worker_and_a_revoke_removes_it(
    store: SqliteStore, tmp_path: Path
) -> None:
    """Which token registered a worker outlives the server: until the worker
    registers again, another worker token cannot take it (and its running
    job) over, and revoking its own token ends its job at once, not after the
    heartbeat timeout."""
    plane, app, admin, box = _in_process(store, tmp_path)
    other = auth.create_token(store, "worker")

    async def before() -> tuple[str, str]:
        _, _, info = await asgi_request(app, "POST", "/api/v1/workers", body=_WORKER, token=box)
        job = plane.submit(parse_spec({"command": [PY, "-c", "pass"], "max_retries": 0}))
        acquire = f"/api/v1/workers/{info['id']}/acquire"
        status, _, taken = await asgi_request(app, "POST", acquire, "timeout=0", token=box)
        assert (status, [t["job_id"] for t in taken]) == (200, [job.id])
        return info["id"], job.id

    worker_id, job_id = asyncio.run(before())
    # The server restarts: a new plane on the same store; the worker, still
    # running the job, has not registered again yet.
    again = ControlPlane(store, instance_id="s2")
    again.recover("s1", workers_outlive=True)
    restarted = create_app(again, ArtifactStore(tmp_path / "blobs"))
    takeover = {
        "worker": {**_WORKER["worker"], "id": worker_id},
        "running": [[job_id, 1]],
        "adopted": True,
    }

    async def after() -> tuple[int, int]:
        taken, _, _ = await asgi_request(
            restarted, "POST", "/api/v1/workers", body=takeover, token=other
        )
        revoked, _, _ = await asgi_request(
            restarted, "DELETE", f"/api/v1/tokens/{_id(box)}", token=admin
        )
        return taken, revoked

    assert asyncio.run(after()) == (403, 204)
    job = again.get(job_id)
    assert (job.state, job.reason) == ("lost", "its worker's token was revoked")
    assert store.worker_bindings() == {}


def test_a_worker_declared_lost_leaves_no_binding_behind(
    store: SqliteStore, tmp_path: Path
) -> None:
    plane, app, _, box = _in_process(store, tmp_path)
    asyncio.run(asgi_request(app, "POST", "/api/v1/workers", body=_WORKER, token=box))
    assert list(store.worker_bindings().values()) == [auth.digest(box)]
    assert len(plane.reap(-1.0)) == 1  # silent (any time counts): declared lost
    assert store.worker_bindings() == {}


def test_workers_of_a_server_without_auth_come_back_when_it_restarts_with_auth(
    store: SqliteStore, tmp_path: Path
) -> None:
    """Without auth no token registered them: nothing binds them after a
    restart with auth, so their own token brings them back."""
    plane = ControlPlane(store, instance_id="s1")
    open_app = create_app(plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=False)
    _, _, info = asyncio.run(asgi_request(open_app, "POST", "/api/v1/workers", body=_WORKER))
    assert store.worker_bindings() == {}
    again = ControlPlane(store, instance_id="s2")
    again.recover("s1", workers_outlive=True)
    closed_app = create_app(again, ArtifactStore(tmp_path / "blobs"))
    box = auth.create_token(store, "worker")
    back = {"worker": {**_WORKER["worker"], "id": info["id"]}}
    status, _, _ = asyncio.run(
        asgi_request(closed_app, "POST", "/api/v1/workers", body=back, token=box)
    )
    assert status == 201


def test_a_token_is_refused_once_it_expires_also_from_the_cache(
    store: SqliteStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, app, admin, _ = _in_process(store, tmp_path)
    clock = [time.time()]
    monkeypatch.setattr(time, "time", lambda: clock[0])

    async def scenario() -> list[Any]:
        status, _, made = await asgi_request(
            app,
            "POST",
            "/api/v1/tokens",
            body={"role": "user", "user": "carol", "expires_in": 60},
            token=admin,
        )
        assert status == 201 and made["expires"] == clock[0] + 60, made
        answers = [(await asgi_request(app, "GET", "/api/v1/jobs", token=made["token"]))[0]]
        clock[0] += 61  # its role is cached now: the cache must not honour it
        answers.append(await asgi_request(app, "GET", "/api/v1/jobs", token=made["token"]))
        return answers

    ok, (status, _, body) = asyncio.run(scenario())
    assert (ok, status) == (200, 401)
    assert body["error"].startswith("the token expired at ") and "ask an admin" in body["error"]


def test_an_admin_token_may_expire_but_the_last_one_that_does_not_stays(
    store: SqliteStore, tmp_path: Path
) -> None:
    _, app, admin, _ = _in_process(store, tmp_path)

    async def scenario() -> tuple[int, int, int]:
        made = await asgi_request(
            app, "POST", "/api/v1/tokens", body={"role": "admin", "expires_in": 3600}, token=admin
        )
        brief = made[2]["token"]
        first = await asgi_request(app, "DELETE", f"/api/v1/tokens/{_id(admin)}", token=brief)
        itself = await asgi_request(app, "DELETE", f"/api/v1/tokens/{_id(brief)}", token=admin)
        return made[0], first[0], itself[0]

    assert asyncio.run(scenario()) == (201, 409, 204)


@pytest.mark.parametrize("expires_in", [0, -5, 10 * 366 * 86400, "1d"])
def test_a_bad_expiry_is_a_422_naming_it(
    store: SqliteStore, tmp_path: Path, expires_in: object
) -> None:
    _, app, admin, _ = _in_process(store, tmp_path)
    body = {"role": "user", "expires_in": expires_in}
    status, _, answer = asyncio.run(
        asgi_request(app, "POST", "/api/v1/tokens", body=body, token=admin)
    )
    assert status == 422 and "$.expires_in" in answer["error"], answer
    assert len(store.list_tokens()) == 2  # nothing made


def test_a_long_poll_ends_when_its_token_expires_and_hands_nothing_out(
    store: SqliteStore, tmp_path: Path
) -> None:
    """A worker's long poll open on a token that expires ends then, empty;
    its next request is refused, and the server removes the worker, so the
    job submitted meanwhile stays queued rather than going to a worker that
    can no longer be heard."""
    plane, app, _, _ = _in_process(store, tmp_path)
    box = auth.create_token(store, "worker", expires=time.time() + 0.5)

    async def scenario() -> tuple[int, Any, int]:
        _, _, info = await asgi_request(app, "POST", "/api/v1/workers", body=_WORKER, token=box)
        acquire = f"/api/v1/workers/{info['id']}/acquire"
        status, _, taken = await asgi_request(app, "POST", acquire, "timeout=60", token=box)
        refused, _, _ = await asgi_request(app, "POST", acquire, "timeout=0", token=box)
        return status, taken, refused

    started = time.monotonic()
    status, taken, refused = asyncio.run(scenario())
    assert (status, taken, refused) == (200, [], 401)
    assert time.monotonic() - started < 30  # ended at the expiry, not after its 60 s
    assert plane.list_workers() == []
    job = plane.submit(parse_spec({"command": [PY, "-c", "pass"], "max_retries": 0}))
    assert job.state == "queued"
