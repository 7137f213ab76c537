"""Ownership: a user token reaches only its user's jobs; admins reach all.

Each attack is made as bob against alice's jobs (one running on a real
worker, one finished), by full id and by prefix, on every job endpoint. Each
must be answered exactly as for an id of no job (status, body, the store
reads it costs), and alice's jobs must be untouched afterwards: still
running, not cancelled, their logs as they were.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import gpulayer
from gpulayer.access import Viewer, local_viewer
from gpulayer.artifacts import ArtifactStore
from gpulayer.errors import GPUlayerError
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore
from server.conftest import ServerProc
from server.rawhttp import asgi_request, request

from helpers import PY, pids_alive

SLEEPER = [PY, "-c", "import os, time; print('alive', os.getpid(), flush=True); time.sleep(120)"]
QUICK = [PY, "-c", "print('done')"]


def _token(server: ServerProc, role: str, user: str | None = None) -> str:
    body: dict[str, Any] = {"role": role}
    if user is not None:
        body["user"] = user
    status, made, _ = request(server, "POST", "/api/v1/tokens", body)
    assert status == 201, made
    return str(made["token"])


def _submit(server: ServerProc, token: str, command: list[str]) -> str:
    status, job, _ = request(
        server, "POST", "/api/v1/jobs", {"spec": {"command": command}}, token=token
    )
    assert status == 201, job
    return str(job["id"])


def _until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def _state(server: ServerProc, token: str, job_id: str) -> dict[str, Any]:
    status, job, _ = request(server, "GET", f"/api/v1/jobs/{job_id}", token=token)
    assert status == 200, job
    return job


def _unknown_like(job_id: str) -> str:
    """An id of the same length that names no job (ids start with the time: 'z' is centuries away)."""
    return "z" * len(job_id)


def _same_answer(
    got: tuple[int, dict[str, Any], dict[str, str]],
    unknown: tuple[int, dict[str, Any], dict[str, str]],
    job_id: str,
    unknown_id: str,
) -> None:
    """The answer about ``job_id`` is the one about an id of no job, but for the id itself."""
    status, body, headers = got
    assert status == 404, body
    assert (status, body["error"].replace(job_id, "ID")) == (
        unknown[0],
        unknown[1]["error"].replace(unknown_id, "ID"),
    )
    assert set(body) == set(unknown[1]) == {"error"}
    drop = {"date", "Date"}
    assert {k: v for k, v in headers.items() if k not in drop} == {
        k: v for k, v in unknown[2].items() if k not in drop
    }


@pytest.fixture
def fleet(server: ServerProc, tmp_path: Path) -> dict[str, str]:
    """Alice with a job running on a real worker and one finished; bob with one finished."""
    server.start_worker(tmp_path / "worker-home", slots=3)
    tokens = {"alice": _token(server, "user", "alice"), "bob": _token(server, "user", "bob")}
    running = _submit(server, tokens["alice"], SLEEPER)
    finished = _submit(server, tokens["alice"], QUICK)
    bobs = _submit(server, tokens["bob"], QUICK)
    for who, job_id in (("alice", finished), ("bob", bobs)):
        _until(lambda j=job_id, t=tokens[who]: _state(server, t, j)["state"] == "succeeded", job_id)

    def says_alive() -> bool:
        path = f"/api/v1/jobs/{running}/logs"
        status, chunk, _ = request(server, "GET", path, token=tokens["alice"])
        return status == 200 and any(line[3].startswith("alive ") for line in chunk["lines"])

    _until(says_alive, "alice's job printed")
    return {**tokens, "running": running, "finished": finished, "bobs": bobs}


def test_bob_reaches_none_of_alices_jobs_by_any_endpoint(
    server: ServerProc, fleet: dict[str, str]
) -> None:
    bob, alice = fleet["bob"], fleet["alice"]
    running, finished = fleet["running"], fleet["finished"]
    before = _state(server, alice, running)
    logs = f"/api/v1/jobs/{running}/logs"
    lines_before = request(server, "GET", logs, token=alice)[1]["lines"]
    assert before["state"] == "running" and before["user"] == "alice"

    # Each endpoint on one job, by full id and by a prefix only alice's jobs have.
    attacks = [
        ("GET", "/api/v1/jobs/{}", ""),
        ("GET", "/api/v1/jobs/{}/logs", ""),
        ("GET", "/api/v1/jobs/{}/logs", "?timeout=5"),  # a follow: refused at once, not held
        ("POST", "/api/v1/jobs/{}/wait", "?timeout=5"),
        ("POST", "/api/v1/jobs/{}/cancel", ""),
    ]
    for job_id in (running, finished, running[:11]):
        unknown_id = _unknown_like(job_id)
        for method, path, query in attacks:
            started = time.monotonic()
            got = request(server, method, path.format(job_id) + query, token=bob)
            assert time.monotonic() - started < 3.0, (method, path, "held like a real wait")
            unknown = request(server, method, path.format(unknown_id) + query, token=bob)
            _same_answer(got, unknown, job_id, unknown_id)
        # A wait whose other jobs are alice's: hers are unknown, as an id of no job.
        asked = [running, finished, unknown_id]
        status, reply, _ = request(
            server,
            "POST",
            "/api/v1/jobs/wait?timeout=0",
            {"id": fleet["bobs"], "also": asked},
            token=bob,
        )
        assert status == 200, reply
        assert reply["also"] == [] and sorted(reply["unknown"]) == sorted(asked)
        status, reply, _ = request(
            server, "POST", "/api/v1/jobs/wait?timeout=0", {"id": job_id}, token=bob
        )
        assert status == 404 and reply["error"] == f"no job with id {job_id!r}"

    # Listings: bob's jobs only; a worker's running jobs only his.
    status, listed, _ = request(server, "GET", "/api/v1/jobs", token=bob)
    assert status == 200 and [j["id"] for j in listed] == [fleet["bobs"]]
    status, workers, _ = request(server, "GET", "/api/v1/workers", token=bob)
    assert status == 200 and all(running not in w["running"] for w in workers)
    status, workers, _ = request(server, "GET", "/api/v1/workers", token=alice)
    assert status == 200 and any(running in w["running"] for w in workers)

    # A user token adds no log line, to anyone's job.
    line = {"job_id": running, "attempt": 1, "lines": [[99, 1.0, "stdout", "forged"]]}
    assert request(server, "POST", "/api/v1/tasks/logs", line, token=bob)[0] == 403

    # Nothing happened to alice's jobs.
    after = _state(server, alice, running)
    assert after["state"] == "running" and not after["cancel_requested"]
    assert after == before
    assert request(server, "GET", logs, token=alice)[1]["lines"] == lines_before
    pid = int(next(line[3] for line in lines_before if line[3].startswith("alive ")).split()[1])
    assert pids_alive(pid) == [pid]
    assert _state(server, alice, finished)["state"] == "succeeded"


def test_a_prefix_resolves_among_the_callers_jobs_only(
    server: ServerProc, fleet: dict[str, str]
) -> None:
    """Ids start with the time, so jobs made together share a prefix: for
    bob it names his one job, not "several" (that would tell alice's exist)."""
    ids = [fleet["running"], fleet["finished"], fleet["bobs"]]
    shared = "".join(
        c[0] for c in itertools.takewhile(lambda c: len(set(c)) == 1, zip(*ids, strict=False))
    )
    assert shared, ids
    status, job, _ = request(server, "GET", f"/api/v1/jobs/{shared}", token=fleet["bob"])
    assert (status, job["id"], job["user"]) == (200, fleet["bobs"], "bob")
    status, answer, _ = request(server, "GET", f"/api/v1/jobs/{shared}", token=fleet["alice"])
    assert status == 404 and "matches several jobs" in answer["error"]  # her own two
    status, answer, _ = request(server, "GET", f"/api/v1/jobs/{shared}", token="admin")
    assert status == 404 and "matches several jobs" in answer["error"]


def test_an_admin_sees_and_cancels_every_job(server: ServerProc, fleet: dict[str, str]) -> None:
    status, listed, _ = request(server, "GET", "/api/v1/jobs", token="admin")
    assert status == 200
    assert {fleet["running"], fleet["finished"], fleet["bobs"]} <= {j["id"] for j in listed}
    assert {j["user"] for j in listed} == {"alice", "bob"}
    assert _state(server, server.admin, fleet["running"])["user"] == "alice"
    status, job, _ = request(
        server, "POST", f"/api/v1/jobs/{fleet['running']}/cancel", token="admin"
    )
    assert status == 200, job
    _until(
        lambda: _state(server, fleet["alice"], fleet["running"])["state"] == "cancelled", "cancel"
    )


def test_the_owner_cancels_her_own_job(server: ServerProc, fleet: dict[str, str]) -> None:
    status, job, _ = request(
        server, "POST", f"/api/v1/jobs/{fleet['running']}/cancel", token=fleet["alice"]
    )
    assert status == 200 and job["cancel_requested"], job
    _until(
        lambda: _state(server, fleet["alice"], fleet["running"])["state"] == "cancelled", "cancel"
    )


def test_a_submit_reusing_anothers_job_id_gets_a_new_job(
    server: ServerProc, fleet: dict[str, str]
) -> None:
    """A client's job id only makes a retried submit idempotent: bob reusing
    alice's id (same spec) neither gets her record nor learns it is taken."""
    before = _state(server, fleet["alice"], fleet["finished"])
    body = {"spec": before["spec"], "id": fleet["finished"]}
    status, made, _ = request(server, "POST", "/api/v1/jobs", body, token=fleet["bob"])
    assert status == 201, made
    assert made["id"] != fleet["finished"] and made["user"] == "bob"
    assert _state(server, fleet["alice"], fleet["finished"]) == before
    # Alice's own retry of it is still the same job.
    status, again, _ = request(server, "POST", "/api/v1/jobs", body, token=fleet["alice"])
    assert (status, again["id"]) == (201, fleet["finished"])


def test_the_command_line_shows_each_jobs_user(server: ServerProc, fleet: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GPULAYER_SERVER", "GPULAYER_TOKEN")}
    env |= {"COLUMNS": "250", "GPULAYER_TOKEN": fleet["alice"]}
    base = [sys.executable, "-m", "gpulayer.cli", "--server", server.url]
    shown = subprocess.run(
        [*base, "show", fleet["running"]], capture_output=True, text=True, env=env, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert any(line.split()[:2] == ["user", "alice"] for line in shown.stdout.splitlines())
    listed = subprocess.run([*base, "jobs"], capture_output=True, text=True, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[0][:2] == ["ID", "USER"]
    assert sorted(row[:2] for row in rows[1:]) == sorted(
        [[fleet["running"], "alice"], [fleet["finished"], "alice"]]
    )
    refused = subprocess.run(
        [*base, "show", fleet["bobs"]], capture_output=True, text=True, env=env, timeout=60
    )
    assert refused.returncode != 0 and f"no job with id {fleet['bobs']!r}" in refused.stderr


# ---- tokens ----


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"role": "user"}, "a user token needs a user"),
        ({"role": "user", "user": ""}, "is not valid"),
        ({"role": "user", "user": "a b"}, "is not valid"),
        ({"role": "user", "user": "../alice"}, "is not valid"),
        ({"role": "user", "user": "-alice"}, "is not valid"),
        ({"role": "user", "user": "alice\n"}, "is not valid"),
        ({"role": "user", "user": "ä"}, "is not valid"),
        ({"role": "user", "user": "a" * 65}, "is not valid"),
        ({"role": "user", "user": "a" * 300}, "length <= 256"),
        ({"role": "worker", "user": "alice"}, "a worker token acts for workers"),
    ],
)
def test_a_token_without_a_valid_owner_is_refused_and_nothing_made(
    tmp_path: Path, body: dict[str, Any], words: str
) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        app = create_app(ControlPlane(store, instance_id="s1"), ArtifactStore(tmp_path / "blobs"))
        admin = auth.create_token(store, "admin")
        status, _, answer = asyncio.run(
            asgi_request(app, "POST", "/api/v1/tokens", body=body, token=admin)
        )
        assert status == 422 and words in answer["error"], answer
        assert len(store.list_tokens()) == 1  # the admin's only
        with pytest.raises(GPUlayerError):
            auth.create_token(store, body["role"], user=body.get("user"))
    finally:
        store.close()


def test_the_command_line_refuses_a_user_token_without_a_user(server: ServerProc) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GPULAYER_SERVER", "GPULAYER_TOKEN")}
    argv = [sys.executable, "-m", "gpulayer.cli", "--server", server.url, "token", "create"]
    done = subprocess.run(
        [*argv, "--role", "user"],
        capture_output=True,
        text=True,
        env={**env, "GPULAYER_TOKEN": server.admin},
        timeout=60,
    )
    assert done.returncode == 2 and "a user token needs --user NAME" in done.stderr
    status, tokens, _ = request(server, "GET", "/api/v1/tokens")
    assert status == 200 and [t["role"] for t in tokens] == ["admin"]
    made = subprocess.run(
        [*argv, "--role", "admin", "--user", "root-ops"],
        capture_output=True,
        text=True,
        env={**env, "GPULAYER_TOKEN": server.admin},
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    ops = made.stdout.strip()
    job = _submit(server, ops, QUICK)
    assert _state(server, ops, job)["user"] == "root-ops"


def test_tokens_and_jobs_from_before_users_are_no_one_s_to_see(tmp_path: Path) -> None:
    """A store from before ownership: its user token gets a user of its own
    ("legacy-<id>"), and its jobs (whose submitter was never kept) belong to
    no user: only admins see them, never a legacy token."""
    path = tmp_path / "db.sqlite"
    store = SqliteStore(path)
    plane = ControlPlane(store, instance_id="s1")
    old_job = plane.submit(gpulayer.JobSpec(command=["true"]))
    store.close()
    db = sqlite3.connect(path)  # back to schema 8, as an older GPUlayer left it
    db.execute("DROP INDEX jobs_in_array")  # migration 15
    for column in ("array_of", "array_index", "array_size"):
        db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    db.execute("ALTER TABLE jobs DROP COLUMN scratch")  # migration 14
    db.execute("DROP INDEX jobs_by_finished")  # migration 13
    db.execute("DROP INDEX past_tasks_by_ended")
    for column in ("finished", "began", "gpu_demand"):
        db.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
    db.execute("ALTER TABLE past_tasks DROP COLUMN ended")
    for table in ("projects", "project_members", "project_usage"):  # migration 12
        db.execute(f"DROP TABLE {table}")
    db.execute("DROP INDEX jobs_by_project")
    db.execute("ALTER TABLE jobs DROP COLUMN project")
    db.execute("DROP INDEX jobs_by_user")
    db.execute("ALTER TABLE jobs DROP COLUMN user_name")
    db.execute("ALTER TABLE jobs DROP COLUMN start")  # migration 11
    db.execute("ALTER TABLE tokens DROP COLUMN user_name")
    db.execute(
        "INSERT INTO tokens (digest, role, name, created) VALUES (?, 'user', 'old', 1.0)",
        (auth.digest("glt_u_old"),),
    )
    db.execute(
        "INSERT INTO tokens (digest, role, name, created) VALUES (?, 'admin', 'boss', 1.0)",
        (auth.digest("glt_a_old"),),
    )
    db.execute("PRAGMA user_version = 8")
    db.commit()
    db.close()

    store = SqliteStore(path)
    try:
        app = create_app(ControlPlane(store, instance_id="s2"), ArtifactStore(tmp_path / "blobs"))
        legacy = auth.caller_of(store, "Bearer glt_u_old")
        assert (
            legacy.role == "user"
            and legacy.viewer is not None
            and legacy.viewer is not None
            and legacy.viewer.user == f"legacy-{auth.digest('glt_u_old')[:12]}"
        )
        assert auth.caller_of(store, "Bearer glt_a_old").viewer == Viewer(None, admin=True)

        async def scenario() -> list[Any]:
            return [
                await asgi_request(app, "GET", f"/api/v1/jobs/{old_job.id}", token="glt_u_old"),
                await asgi_request(app, "GET", "/api/v1/jobs", token="glt_u_old"),
                await asgi_request(app, "GET", f"/api/v1/jobs/{old_job.id}", token="glt_a_old"),
            ]

        (hidden, _, _), (_, _, listed), (shown, _, job) = asyncio.run(scenario())
        assert (hidden, listed) == (404, [])
        assert (shown, job["user"]) == (200, None)
    finally:
        store.close()


# ---- in process: the cost of an answer ----


def test_anothers_job_costs_the_store_reads_of_an_unknown_id(tmp_path: Path) -> None:
    """No timing tells "not yours" from "no such job": each endpoint makes
    the same store reads for both (alice's job is in the plane's memory,
    where her own requests would find it without a read)."""
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="s1")
        app = create_app(plane, ArtifactStore(tmp_path / "blobs"))
        alice = auth.create_token(store, "user", user="alice")
        bob = auth.create_token(store, "user", user="bob")
        reads: Counter[str] = Counter()
        for name in ("get_job", "find_job", "read_logs", "list_jobs"):
            real = getattr(store, name)

            def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
                reads[_name] += 1
                return _real(*args, **kwargs)

            setattr(store, name, counted)

        async def scenario() -> list[tuple[Any, ...]]:
            _, _, job = await asgi_request(
                app, "POST", "/api/v1/jobs", body={"spec": {"command": ["true"]}}, token=alice
            )
            _, _, mine = await asgi_request(
                app, "POST", "/api/v1/jobs", body={"spec": {"command": ["true"]}}, token=bob
            )
            hers, unknown = job["id"], _unknown_like(job["id"])
            answers = []
            for method, path, query, body in [
                ("GET", "/api/v1/jobs/{}", "", None),
                ("GET", "/api/v1/jobs/{}/logs", "timeout=1", None),
                ("POST", "/api/v1/jobs/{}/wait", "timeout=1", None),
                ("POST", "/api/v1/jobs/{}/cancel", "", None),
                ("POST", "/api/v1/jobs/wait", "timeout=0", {"id": mine["id"], "also": ["{}"] * 50}),
            ]:
                seen = []
                for job_id in (hers, unknown):
                    reads.clear()
                    text = path.format(job_id)
                    sent = None if body is None else {**body, "also": [job_id] * 50}
                    status, _, answer = await asgi_request(
                        app, method, text, query, body=sent, token=bob
                    )
                    if isinstance(answer, dict) and "error" in answer:
                        answer = answer["error"].replace(job_id, "ID")
                    elif isinstance(answer, dict):
                        answer = (answer["also"], answer["unknown"] == [job_id] * 50)
                    seen.append((status, answer, dict(reads)))
                answers.append((method, path, *seen))
            return answers

        for method, path, hers, unknown in asyncio.run(scenario()):
            assert hers == unknown, (method, path)
            assert hers[0] in (404, 200), (method, path, hers)
        assert plane.get(store.list_jobs(user="alice")[0].id).state == "queued"  # not cancelled
    finally:
        store.close()


def test_embedded_jobs_are_the_local_users(home: Path) -> None:
    with gpulayer.Client(home=home, auto_worker=False) as client:
        job = client.submit(command=["true"])
        assert job.user == local_viewer().user and job.user
        assert [j.user for j in client.jobs()] == [job.user]
        assert client.job(job.id[:8]).id == job.id  # the local user sees every job
