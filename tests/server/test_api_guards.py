"""What the API refuses, and what it must not do, driven straight into the
ASGI app with real tokens: each of these was once a defect a review proved."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gpulayer import bundle
from gpulayer.artifacts import ArtifactStore
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.http.routing import App
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore
from server.rawhttp import asgi_request


def _app(tmp_path: Path, instance: str = "s1") -> tuple[App, ControlPlane, ArtifactStore]:
    store = SqliteStore(tmp_path / "db.sqlite")
    plane = ControlPlane(store, instance_id=instance)
    artifacts = ArtifactStore(tmp_path / "blobs")
    return create_app(plane, artifacts), plane, artifacts


def _worker(wid: str = "") -> dict[str, Any]:
    return {"worker": {"id": wid, "name": "w", "host": "h", "slot_gpus": [None]}, "running": []}


@pytest.mark.parametrize("depth", [500, 5000])
def test_a_body_nested_too_deeply_is_a_422_not_a_500(tmp_path: Path, depth: int) -> None:
    app, plane, _ = _app(tmp_path)
    admin = auth.create_token(plane.store, "admin")
    # A float where an integer goes makes the server look at the body again.
    raw = b'{"spec": {"command": ["true"], "gpus": 2.5}, "x": ' + b"[" * depth + b"]" * depth + b"}"
    status, _, body = asyncio.run(asgi_request(app, "POST", "/api/v1/jobs", raw=raw, token=admin))
    # Python 3.12's json module goes deeper than 3.11's: at depth 500 the second
    # look may get through, and then the answer names the field that is wrong.
    assert status == 422, body
    assert "nested too deeply" in body["error"] or (
        depth == 500 and body["error"].endswith("got `float` - at `$.spec.gpus`")
    )


def test_a_worker_token_cannot_act_for_a_worker_an_admin_registered(tmp_path: Path) -> None:
    """Local workers (``ensure_local_workers``) register with the client's token."""
    app, plane, artifacts = _app(tmp_path)
    admin = auth.create_token(plane.store, "admin")
    intruder = auth.create_token(plane.store, "worker")
    secret = artifacts.put_bytes(b"another user's input")

    async def scenario() -> list[int]:
        _, _, worker = await asgi_request(
            app, "POST", "/api/v1/workers", body=_worker(), token=admin
        )
        wid = worker["id"]
        spec = {"command": ["cat", "x"], "inputs": {"x": {"kind": "file", "digest": secret}}}
        await asgi_request(app, "POST", "/api/v1/jobs", body={"spec": spec}, token=admin)
        as_it = [(b"x-gpulayer-worker", wid.encode())]
        return [
            (
                await asgi_request(
                    app, "POST", f"/api/v1/workers/{wid}/acquire", "timeout=0", token=intruder
                )
            )[0],
            (
                await asgi_request(
                    app, "GET", f"/api/v1/blobs/{secret}", token=intruder, headers=as_it
                )
            )[0],
            (await asgi_request(app, "POST", "/api/v1/workers", body=_worker(wid), token=intruder))[
                0
            ],
        ]

    assert asyncio.run(scenario()) == [403, 403, 403]


# The line the control plane opens a retry's attempt with (its retry_delay is 0).
RETRY_LINE = "gpulayer: attempt 2 of 2 (after: its worker stopped), at once"


def test_a_worker_token_adds_log_lines_only_to_tasks_its_worker_ran(tmp_path: Path) -> None:
    """Also to an attempt that ended in a retry (its worker was cut off), after
    that worker is gone, and after a restart of the server; not once another
    token took the worker's id over. An attempt its worker gave back unrun
    has no lines to come."""
    app, plane, _ = _app(tmp_path, "s1")
    ta, tb = (auth.create_token(plane.store, "worker") for _ in "ab")
    user = auth.create_token(plane.store, "user", user="carol")
    jid = ""

    async def post(token: str, attempt: int, text: str, seq: int = 1) -> tuple[int, str]:
        body = {"job_id": jid, "attempt": attempt, "lines": [[seq, 1.0, "stdout", text]]}
        status, _, reply = await asgi_request(
            app, "POST", "/api/v1/tasks/logs", body=body, token=token
        )
        return status, "" if reply is None else reply["error"]

    async def texts() -> list[str]:
        _, _, chunk = await asgi_request(app, "GET", f"/api/v1/jobs/{jid}/logs", token=user)
        return [line[3] for line in chunk["lines"]]

    async def take(wid: str, token: str) -> list[tuple[str, int]]:
        path = f"/api/v1/workers/{wid}/acquire"
        _, _, items = await asgi_request(app, "POST", path, "timeout=0&ack=0", token=token)
        return [(i["job_id"], i["attempt"]) for i in items]

    async def started(wid: str, token: str, attempt: int) -> None:
        report = {"job_id": jid, "attempt": attempt, "worker_id": wid, "pid": 999_999}
        report |= dict.fromkeys(("acquired", "prepared", "started"), 1.0)
        await asgi_request(app, "POST", "/api/v1/tasks/started", body=report, token=token)

    async def register(token: str) -> str:
        _, _, worker = await asgi_request(
            app, "POST", "/api/v1/workers", body=_worker(), token=token
        )
        return str(worker["id"])

    async def before_restart() -> tuple[str, str]:
        nonlocal jid
        quitter = await register(ta)
        spec = {"spec": {"command": ["sleep", "600"], "max_retries": 1, "retry_delay": 0}}
        _, _, job = await asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=user)
        jid = job["id"]
        # It takes it and gives it back unrun (a stopping worker does): the
        # attempt's number is used again, by another worker.
        assert await take(quitter, ta) == [(jid, 1)]
        result = {"job_id": jid, "attempt": 1, "worker_id": quitter, "outcome": "returned"}
        await asgi_request(app, "POST", "/api/v1/tasks/finished", body=result, token=ta)
        assert await post(ta, 1, "forged") == (409, f"no worker ran attempt 1 of job {jid}")
        b = await register(tb)
        assert await take(b, tb) == [(jid, 1)]
        assert await post(ta, 1, "forged") == (
            403,
            f"attempt 1 of job {jid} ran on worker {b}, not while it was registered with "
            "this token; this one cannot add lines to it",
        )
        assert (await post(tb, 2, "forged"))[0] == 409  # no attempt 2 yet
        assert await post(tb, 1, "b1") == (204, "")
        await started(b, tb, 1)
        a = await register(ta)
        # B says goodbye while running it: the attempt is lost and the job retried on A.
        await asgi_request(app, "DELETE", f"/api/v1/workers/{b}", token=tb)
        assert await take(a, ta) == [(jid, 2)]
        assert (await post(ta, 1, "forged"))[0] == 403  # B is gone: its token still counts
        assert (await post(tb, 2, "forged"))[0] == 403
        # B was cut off, and delivers its attempt's last line late.
        assert await post(tb, 1, "b1-late", seq=2) == (204, "")
        assert await post(ta, 2, "a2") == (204, "")
        assert await texts() == ["b1", "b1-late", RETRY_LINE, "a2"]
        return a, b

    a, b = asyncio.run(before_restart())
    plane.store.close()
    restarted = ControlPlane(SqliteStore(tmp_path / "db.sqlite"), instance_id="s2")
    restarted.recover("s1", workers_outlive=True)
    app = create_app(restarted, ArtifactStore(tmp_path / "blobs"))

    async def after_restart() -> None:
        assert [(await post(ta, 1, "forged"))[0], (await post(tb, 2, "forged"))[0]] == [403, 403]
        assert await post(tb, 1, "again-1", seq=3) == (204, "")
        assert await post(ta, 2, "again-2", seq=3) == (204, "")
        assert await texts() == ["b1", "b1-late", "again-1", RETRY_LINE, "a2", "again-2"]
        # A's job ends; its late lines are answered from the store.
        result = {"job_id": jid, "attempt": 2, "worker_id": a, "outcome": "exited", "exit_code": 0}
        await asgi_request(app, "POST", "/api/v1/tasks/finished", body=result, token=ta)
        assert await post(ta, 2, "a2-late", seq=4) == (204, "")
        # Another token takes B's id over (B is gone): B's past is not its to write.
        body = _worker(b)
        assert (await asgi_request(app, "POST", "/api/v1/workers", body=body, token=ta))[0] == 201
        assert (await post(ta, 1, "forged", seq=4))[0] == 403
        # A task of a worker whose token is not known (run before the server
        # kept them): no worker token's.
        with restarted.store.transaction() as tx:
            tx.db.execute("DELETE FROM worker_tokens WHERE worker_id=?", (a,))
        assert (await post(ta, 2, "forged", seq=5))[0] == 403
        assert await texts() == ["b1", "b1-late", "again-1", RETRY_LINE, "a2", "again-2", "a2-late"]

    asyncio.run(after_restart())
    restarted.store.close()


def test_a_token_that_takes_a_gone_workers_id_over_cannot_write_into_its_ended_gang_node(
    tmp_path: Path,
) -> None:
    """Its node ended with it, while the job's other node runs on."""
    app, plane, _ = _app(tmp_path)
    ta, tc, intruder = (auth.create_token(plane.store, "worker") for _ in range(3))
    user = auth.create_token(plane.store, "user", user="carol")

    async def scenario() -> int:
        ids = []
        for token in (ta, tc):
            _, _, w = await asgi_request(
                app, "POST", "/api/v1/workers", body=_worker(), token=token
            )
            ids.append(w["id"])
        spec = {"spec": {"command": ["sleep", "600"], "nodes": 2}}
        _, _, job = await asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=user)
        nodes = {t["worker"]: t["node"] for t in job["tasks"]}
        await asgi_request(app, "DELETE", f"/api/v1/workers/{ids[0]}", token=ta)
        assert plane.get(job["id"]).state == "running"  # its other node winds down
        again = _worker(ids[0])
        assert (await asgi_request(app, "POST", "/api/v1/workers", body=again, token=intruder))[
            0
        ] == 201
        lines = [[99, 1.0, "stdout", "forged"]]
        body = {"job_id": job["id"], "attempt": 1, "node": nodes[ids[0]], "lines": lines}
        return (await asgi_request(app, "POST", "/api/v1/tasks/logs", body=body, token=intruder))[0]

    assert asyncio.run(scenario()) == 403
    plane.store.close()


def test_a_task_run_while_the_server_had_no_auth_takes_no_worker_tokens_lines(
    tmp_path: Path,
) -> None:
    """Not even those of the token its worker had before."""
    app, plane, _ = _app(tmp_path, "s1")
    token = auth.create_token(plane.store, "worker")

    async def registered() -> str:
        _, _, w = await asgi_request(app, "POST", "/api/v1/workers", body=_worker(), token=token)
        await asgi_request(app, "DELETE", f"/api/v1/workers/{w['id']}", token=token)
        return str(w["id"])

    wid = asyncio.run(registered())
    plane.store.close()
    plane = ControlPlane(SqliteStore(tmp_path / "db.sqlite"), instance_id="s2")
    plane.recover("s1", workers_outlive=True)
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=False)

    async def without_auth() -> str:
        await asgi_request(app, "POST", "/api/v1/workers", body=_worker(wid))
        _, _, job = await asgi_request(
            app, "POST", "/api/v1/jobs", body={"spec": {"command": ["x"]}}
        )
        result = {"job_id": job["id"], "attempt": 1, "worker_id": wid, "outcome": "exited"}
        await asgi_request(app, "POST", "/api/v1/tasks/finished", body={**result, "exit_code": 0})
        return str(job["id"])

    jid = asyncio.run(without_auth())
    plane.store.close()
    plane = ControlPlane(SqliteStore(tmp_path / "db.sqlite"), instance_id="s3")
    plane.recover("s2", workers_outlive=True)
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"))
    body = {"job_id": jid, "attempt": 1, "lines": [[1, 1.0, "stdout", "forged"]]}
    request = asgi_request(app, "POST", "/api/v1/tasks/logs", body=body, token=token)
    assert asyncio.run(request)[0] == 403
    plane.store.close()


def test_a_task_taken_before_a_restart_counts_when_a_new_worker_process_adopts_its_worker(
    tmp_path: Path,
) -> None:
    """The worker was killed after taking it, and the server restarted, before
    its start report (sent after 0.5 s) arrived: the new worker process on its
    home ended it, and says it adopted the dead one's id."""
    app, plane, _ = _app(tmp_path, "s1")
    worker = auth.create_token(plane.store, "worker")
    user = auth.create_token(plane.store, "user", user="carol")

    async def before() -> tuple[str, str]:
        _, _, w = await asgi_request(app, "POST", "/api/v1/workers", body=_worker(), token=worker)
        spec = {"spec": {"command": ["sleep", "600"]}}  # max_retries 0
        _, _, job = await asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=user)
        path = f"/api/v1/workers/{w['id']}/acquire"
        status, _, items = await asgi_request(app, "POST", path, "timeout=0&ack=0", token=worker)
        assert status == 200 and items[0]["job_id"] == job["id"]
        return w["id"], job["id"]

    wid, jid = asyncio.run(before())
    plane.store.close()
    restarted = ControlPlane(SqliteStore(tmp_path / "db.sqlite"), instance_id="s2")
    restarted.recover("s1", workers_outlive=True)
    app = create_app(restarted, ArtifactStore(tmp_path / "blobs"))
    body = {**_worker(wid), "adopted": True}
    assert (
        asyncio.run(asgi_request(app, "POST", "/api/v1/workers", body=body, token=worker))[0] == 201
    )
    job = restarted.get(jid)
    assert (job.state, job.attempt) == ("lost", 1), job.reason
    restarted.store.close()


def test_a_workers_fetch_does_not_read_its_big_file_inputs(tmp_path: Path) -> None:
    app, plane, artifacts = _app(tmp_path)
    worker = auth.create_token(plane.store, "worker")
    # An admin submits: these blobs were stored here, not uploaded by a user
    # (a user's job names only blobs its user may read: see test_sec_blobs.py).
    submitter = auth.create_token(plane.store, "admin")
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(200 * 2**20)
    big_digest = artifacts.put_file(big)
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "small.txt").write_text("hello")
    manifest = bundle.scan(folder)
    folder_digest = bundle.store(folder, manifest, artifacts)
    small = next(e.digest for e in manifest.entries if e.kind == "file")

    async def fetch() -> int:
        _, _, w = await asgi_request(app, "POST", "/api/v1/workers", body=_worker(), token=worker)
        inputs = {
            "a": {"kind": "file", "digest": big_digest, "size": 200 * 2**20},
            "b": {"kind": "dir", "digest": folder_digest, "size": 5},
        }
        spec = {"spec": {"command": ["true"], "inputs": inputs}}
        await asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=submitter)
        as_it = [(b"x-gpulayer-worker", w["id"].encode())]
        return (
            await asgi_request(app, "GET", f"/api/v1/blobs/{small}", token=worker, headers=as_it)
        )[0]

    tracemalloc.start()
    try:
        assert asyncio.run(fetch()) == 200
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, f"a 5-byte fetch allocated {peak / 2**20:.0f} MiB"
    plane.store.close()


def test_a_blob_the_disk_cannot_take_is_a_503_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import hashlib

    from gpulayer.artifacts import BlobWriter

    def full(self: BlobWriter, chunk: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    app, plane, artifacts = _app(tmp_path)
    user = auth.create_token(plane.store, "user", user="carol")
    data = b"a blob"
    digest = hashlib.sha256(data).hexdigest()
    monkeypatch.setattr(BlobWriter, "write", full)
    put = asgi_request(app, "PUT", f"/api/v1/blobs/{digest}", raw=data, token=user)
    status, _, body = asyncio.run(put)
    assert status == 503
    assert "No space left on device" in body["error"] and "try again" in body["error"]
    assert not artifacts.has(digest)
    assert [p for p in (tmp_path / "blobs").rglob("*") if p.is_file()] == []
    plane.store.close()


def test_a_job_not_found_is_not_taken_for_a_missing_blob() -> None:
    """The client tells the two 404s apart by the server's words, not by
    whether "blob" appears (a job id may hold it)."""
    from gpulayer.errors import ArtifactError, JobNotFoundError
    from gpulayer.transport.http import HttpTransport

    class Reply:
        status = 404

        def __init__(self, message: str) -> None:
            self.body = json.dumps({"error": message}).encode()

        def read(self) -> bytes:
            return self.body

    transport = HttpTransport("http://127.0.0.1:1")
    job = transport._error(Reply("no job with id 'myblob'"))  # type: ignore[arg-type]
    blob = transport._error(Reply(f"no blob {'0' * 64} on this server"))  # type: ignore[arg-type]
    assert isinstance(job, JobNotFoundError) and not isinstance(job, ArtifactError)
    assert isinstance(blob, ArtifactError)


def _count_manifest_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The digests of the manifests read from now on, in order."""
    loads: list[str] = []
    load = bundle.load

    def counted(source: Any, digest: str) -> bundle.Manifest:
        loads.append(digest)
        return load(source, digest)

    monkeypatch.setattr(bundle, "load", counted)
    return loads


def test_a_workers_fetches_of_a_folders_files_read_its_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, plane, artifacts = _app(tmp_path)
    worker = auth.create_token(plane.store, "worker")
    # An admin submits: these blobs were stored here, not uploaded by a user
    # (a user's job names only blobs its user may read: see test_sec_blobs.py).
    submitter = auth.create_token(plane.store, "admin")
    folder = tmp_path / "d"
    folder.mkdir()
    for i in range(5):
        (folder / f"f{i}.txt").write_text(f"file {i}")
    manifest = bundle.scan(folder)
    folder_digest = bundle.store(folder, manifest, artifacts)
    files = [e.digest for e in manifest.entries if e.kind == "file"]
    loads = _count_manifest_loads(monkeypatch)

    async def fetch_all() -> list[int]:
        _, _, w = await asgi_request(app, "POST", "/api/v1/workers", body=_worker(), token=worker)
        inputs = {"d": {"kind": "dir", "digest": folder_digest}}
        await asgi_request(
            app,
            "POST",
            "/api/v1/jobs",
            body={"spec": {"command": ["true"], "inputs": inputs}},
            token=submitter,
        )
        as_it = [(b"x-gpulayer-worker", w["id"].encode())]
        return [
            (await asgi_request(app, "GET", f"/api/v1/blobs/{d}", token=worker, headers=as_it))[0]
            for d in files
        ]

    assert asyncio.run(fetch_all()) == [200] * len(files)
    assert loads == [folder_digest]  # read for the first file, remembered for the rest
    plane.store.close()


def test_the_manifests_kept_for_fetch_checks_are_bounded_by_the_digests_they_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpulayer import defaults

    monkeypatch.setattr(defaults, "MANIFEST_DIGESTS_KEPT", 3)
    app, plane, artifacts = _app(tmp_path)
    worker = auth.create_token(plane.store, "worker")
    # An admin submits: these blobs were stored here, not uploaded by a user
    # (a user's job names only blobs its user may read: see test_sec_blobs.py).
    submitter = auth.create_token(plane.store, "admin")
    trees = {}
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        for i in range(2):
            (folder / f"{name}{i}.txt").write_text(f"{name} {i}")
        manifest = bundle.scan(folder)
        trees[name] = (
            bundle.store(folder, manifest, artifacts),
            next(e.digest for e in manifest.entries if e.kind == "file"),
        )
    loads = _count_manifest_loads(monkeypatch)

    async def fetch(order: str) -> list[int]:
        _, _, w = await asgi_request(app, "POST", "/api/v1/workers", body=_worker(), token=worker)
        inputs = {n: {"kind": "dir", "digest": trees[n][0]} for n in "ab"}
        spec = {"spec": {"command": ["true"], "inputs": inputs}}
        await asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=submitter)
        as_it = [(b"x-gpulayer-worker", w["id"].encode())]
        path = "/api/v1/blobs/{}"
        return [
            (await asgi_request(app, "GET", path.format(trees[n][1]), token=worker, headers=as_it))[
                0
            ]
            for n in order
        ]

    assert asyncio.run(fetch("aba")) == [200, 200, 200]
    # b's two digests pushed a's out (2 + 2 > 3): a is read again.
    a, b = trees["a"][0], trees["b"][0]
    assert loads == [a, b, a]
    assert plane._listed.held <= 3
    plane.store.close()


def test_a_json_body_over_the_limit_is_a_413_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpulayer import defaults

    monkeypatch.setattr(defaults, "JSON_BODY_MAX_BYTES", 2 * 2**20)
    app, plane, _ = _app(tmp_path)
    user = auth.create_token(plane.store, "user", user="carol")
    spec = {"spec": {"command": ["true"], "env": {"BIG": "x" * (3 * 2**20)}}}
    status, _, body = asyncio.run(asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=user))
    assert status == 413 and "over 2 MiB" in body["error"]
    assert plane.list_jobs() == []
    plane.store.close()


def test_a_workers_report_may_be_longer_than_a_users_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A glob output can match a million files: its report cannot be sent in
    parts, and one refused would leave the job running."""
    import gpulayer.http.app as app_module

    monkeypatch.setattr(app_module, "REPORT_MAX", 8 * 2**20)
    from gpulayer import defaults

    monkeypatch.setattr(defaults, "JSON_BODY_MAX_BYTES", 1 * 2**20)
    app, plane, _ = _app(tmp_path)
    worker = auth.create_token(plane.store, "worker")
    user = auth.create_token(plane.store, "user", user="carol")

    async def scenario() -> int:
        _, _, w = await asgi_request(app, "POST", "/api/v1/workers", body=_worker(), token=worker)
        spec = {"spec": {"command": ["true"], "outputs": ["frames/*.png"]}}
        _, _, job = await asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=user)
        await asgi_request(
            app, "POST", f"/api/v1/workers/{w['id']}/acquire", "timeout=0&ack=0", token=worker
        )
        ref = {"kind": "file", "digest": "0" * 64, "size": 1}
        outputs = {f"frames/{i:07d}.png": ref for i in range(20_000)}  # about 2 MiB
        report = {
            "job_id": job["id"],
            "attempt": 1,
            "worker_id": w["id"],
            "outcome": "exited",
            "exit_code": 0,
            "outputs": outputs,
        }
        status, _, _ = await asgi_request(
            app, "POST", "/api/v1/tasks/finished", "ack=1", body=report, token=worker
        )
        return status

    assert asyncio.run(scenario()) == 200
    plane.store.close()
