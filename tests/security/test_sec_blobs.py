"""Blobs are content-addressed and shared; reading one takes more than its digest.

A digest can be guessed: the sha256 of a short secret file (``db_pin=NNNNNN``)
is found by trying candidates. So every way bob has of asking the server
about alice's blob (``missing``, GET, PUT, a job naming it as an input or
in a bundle) must answer as for a blob no one stored, and bob reads its
bytes only after sending them all himself, nor through a worker token's
result naming them as his job's outputs. Alice reads what she sent and what
her jobs made; an admin reads everything.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

import gpulayer
from gpulayer import bundle
from gpulayer.store.sqlite import SqliteStore
from server.conftest import ServerProc

Answer = tuple[int, bytes, dict[str, str]]


def _call(
    server: ServerProc,
    method: str,
    path: str,
    token: str,
    data: bytes | None = None,
    *,
    json_body: object = None,
) -> Answer:
    """One request: (status, body bytes, headers less the date)."""
    if json_body is not None:
        data = json.dumps(json_body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    if json_body is not None:
        req.add_header("Content-Type", "application/json")
    elif data is not None:
        req.add_header("Content-Type", "application/octet-stream")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, body, headers = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, body, headers = e.code, e.read(), dict(e.headers)
        e.close()
    return status, body, {k.lower(): v for k, v in headers.items() if k.lower() != "date"}


def _token(server: ServerProc, role: str, user: str | None = None) -> str:
    body: dict[str, Any] = {"role": role} | ({"user": user} if user else {})
    status, made, _ = _call(server, "POST", "/api/v1/tokens", server.admin, json_body=body)
    assert status == 201, made
    return str(json.loads(made)["token"])


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _put(server: ServerProc, token: str, data: bytes, digest: str | None = None) -> Answer:
    return _call(server, "PUT", f"/api/v1/blobs/{digest or _digest(data)}", token, data)


def _get(server: ServerProc, token: str, digest: str) -> Answer:
    return _call(server, "GET", f"/api/v1/blobs/{digest}", token)


def _missing(server: ServerProc, token: str, digests: list[str]) -> list[str]:
    status, body, _ = _call(
        server, "POST", "/api/v1/blobs/missing", token, json_body={"digests": digests}
    )
    assert status == 200, body
    return list(json.loads(body)["digests"])


def _submit(server: ServerProc, token: str, spec: dict[str, Any]) -> Answer:
    return _call(server, "POST", "/api/v1/jobs", token, json_body={"spec": spec})


def _as_for(got: Answer, digest: str, absent: Answer, absent_digest: str) -> None:
    """``got`` (about ``digest``) is ``absent`` (about ``absent_digest``), but for the digest."""
    assert got[0] == absent[0], (got, absent)
    assert got[1].replace(digest.encode(), b"D") == absent[1].replace(absent_digest.encode(), b"D")
    assert got[2] == absent[2]


def _pin(n: int) -> bytes:
    return f"db_user=alice\ndb_pin={n:06d}\n".encode()


def test_bob_guessing_alices_pin_learns_nothing_from_missing_get_or_put(
    server: ServerProc,
) -> None:
    """The reviewer's attack: bob tries the candidates' digests and reads the
    one that is there. Every answer about alice's blob is the answer about a
    candidate no one stored, and no answer carries her bytes."""
    alice, bob = _token(server, "user", "alice"), _token(server, "user", "bob")
    secret = _pin(424242)
    assert _put(server, alice, secret)[0] == 201
    candidates = [_pin(n) for n in range(424237, 424247)]  # ten, one of them hers
    digests = [_digest(c) for c in candidates]
    stored, absent = _digest(secret), _digest(b"stored by no one")

    # missing: all ten missing, in one request and one by one.
    assert sorted(_missing(server, bob, digests)) == sorted(digests)
    assert all(_missing(server, bob, [d]) == [d] for d in digests)

    # GET: the 404 of a blob no one stored; never her bytes.
    for digest in digests:
        got = _get(server, bob, digest)
        _as_for(got, digest, _get(server, bob, absent), absent)
        assert secret not in got[1]

    # PUT without her bytes (none, too few, others of the same length): refused
    # as for a blob no one stored, and bob still reads nothing.
    for body in (b"", secret[:-1], _pin(1)):
        got = _put(server, bob, body, stored)
        _as_for(got, stored, _put(server, bob, body, absent), absent)
        assert got[0] == 400
        assert _get(server, bob, stored)[0] == 404

    # PUT with each candidate's bytes: one answer for all ten, stored or not.
    answers = set()
    for candidate in candidates:
        status, body, headers = _put(server, bob, candidate)
        reply = json.loads(body)
        answers.add((status, frozenset(reply), reply["size"], frozenset(headers.items())))
    assert len(answers) == 1
    assert next(iter(answers))[:3] == (201, frozenset({"digest", "size"}), len(secret))

    # Alice's blob is as she left it, and hers to read.
    assert _get(server, alice, stored)[:2] == (200, secret)


def test_bob_reads_content_alice_stored_once_he_sent_every_byte(server: ServerProc) -> None:
    alice, bob = _token(server, "user", "alice"), _token(server, "user", "bob")
    carol = _token(server, "user", "carol")
    data = b"weights of alice's model\n" * 1000
    digest = _digest(data)
    assert _put(server, alice, data)[0] == 201
    assert _missing(server, bob, [digest]) == [digest]

    assert _put(server, bob, data)[:1] == (201,)
    assert _get(server, bob, digest)[:2] == (200, data)
    assert _missing(server, bob, [digest]) == []
    # His upload gave carol nothing; alice keeps hers; the admin reads it.
    assert _get(server, carol, digest)[0] == 404
    assert _missing(server, carol, [digest]) == [digest]
    assert _get(server, alice, digest)[:2] == (200, data)
    assert _get(server, server.admin, digest)[:2] == (200, data)
    assert _missing(server, server.admin, [digest]) == []


def test_a_job_is_no_way_to_another_users_blobs(server: ServerProc, tmp_path: Path) -> None:
    """Bob names alice's blob as his job's input, her bundle as his, or a
    manifest of his own that lists her file: each refused, in the words
    used for a blob no one stored, and no job of his is stored."""
    alice, bob = _token(server, "user", "alice"), _token(server, "user", "bob")
    secret = _pin(31337)
    folder = tmp_path / "alices"
    folder.mkdir()
    (folder / "db.conf").write_bytes(secret)
    manifest = bundle.scan(folder)
    encoded = msgspec.json.encode(manifest)
    for blob in (secret, encoded):
        assert _put(server, alice, blob)[0] == 201
    file_d, tree_d = _digest(secret), _digest(encoded)
    absent_file, absent_tree = _digest(_pin(1)), _digest(b'{"entries":[]}')

    def forged(member: str) -> str:
        """A manifest of bob's listing ``member``, stored by bob."""
        entry = bundle.Entry(path="db.conf", kind="file", size=len(secret), digest=member)
        data = msgspec.json.encode(bundle.Manifest(entries=(entry,)))
        assert _put(server, bob, data)[0] == 201
        return _digest(data)

    def spec(kind: str, digest: str) -> dict[str, Any]:
        if kind == "bundle":
            return {"script": "run.py", "bundle": digest}
        ref_kind = "file" if kind == "file" else "dir"
        return {"command": ["cat", "x"], "inputs": {"x": {"kind": ref_kind, "digest": digest}}}

    for kind, hers, nobodys in [
        ("file", file_d, absent_file),
        ("dir", tree_d, absent_tree),
        ("bundle", tree_d, absent_tree),
    ]:
        got = _submit(server, bob, spec(kind, hers))
        assert got[0] == 422, got
        assert b"is not on this server" in got[1]
        _as_for(got, hers, _submit(server, bob, spec(kind, nobodys)), nobodys)
    for kind in ("dir", "bundle"):
        mine_hers, mine_nobodys = forged(file_d), forged(absent_file)
        got = _submit(server, bob, spec(kind, mine_hers))
        assert got[0] == 422 and b"lists a file whose blob" in got[1], got
        refused = _submit(server, bob, spec(kind, mine_nobodys))
        norm = [
            (a[0], a[1].replace(m.encode(), b"M").replace(f.encode(), b"F"))
            for a, m, f in ((got, mine_hers, file_d), (refused, mine_nobodys, absent_file))
        ]
        assert norm[0] == norm[1]
    status, jobs, _ = _call(server, "GET", "/api/v1/jobs", bob)
    assert (status, json.loads(jobs)) == (200, [])
    # Alice may use her own, and the admin anyone's.
    for token in (alice, server.admin):
        assert _submit(server, token, spec("dir", tree_d))[0] == 201
        assert _submit(server, token, spec("file", file_d))[0] == 201


MAKER = """\
import os
os.makedirs("out/sub", exist_ok=True)
open("result.txt", "w").write("result of " + os.environ["WHO"])
open("out/a.txt", "w").write("a")
open("out/sub/b.txt", "w").write("b of " + os.environ["WHO"])
"""


def test_alice_downloads_her_jobs_outputs_and_bob_reads_none(
    server: ServerProc, tmp_path: Path
) -> None:
    """Over the real client, with a worker token: alice's job's bundle and
    input upload (granted), its file and folder outputs are granted as the
    result is accepted, and she downloads them; bob, asking by digest, is
    told of none; bob's own run of the same project uploads it again and
    gets his outputs."""
    server.start_worker(tmp_path / "worker-home", token=_token(server, "worker"))
    alice, bob = _token(server, "user", "alice"), _token(server, "user", "bob")
    project = tmp_path / "project"
    project.mkdir()
    (project / "make.py").write_text(MAKER)
    data = tmp_path / "data.txt"
    data.write_text("alice's input")

    def run(token: str, who: str) -> gpulayer.Job:
        with gpulayer.Client(server.url, token=token) as client:
            job = client.submit(
                project / "make.py",
                inputs={"data": data},
                outputs=["result.txt", "out"],
                env={"WHO": who},
            )
            assert job.wait(timeout=60) == "succeeded", (job.info.reason, job.logs())
            out = job.download_outputs(tmp_path / f"dl-{who}")
        assert (out / "result.txt").read_text() == f"result of {who}"
        assert (out / "out/a.txt").read_text() == "a"
        assert (out / "out/sub/b.txt").read_text() == f"b of {who}"
        return job

    job = run(alice, "alice")
    outputs = job.info.outputs
    assert {rel: ref.kind for rel, ref in outputs.items()} == {"result.txt": "file", "out": "dir"}
    tree = _get(server, alice, outputs["out"].digest)
    assert tree[0] == 200
    members = [e.digest for e in msgspec.json.decode(tree[1], type=bundle.Manifest).entries]
    theirs = [ref.digest for ref in outputs.values()] + [d for d in members if d]
    assert job.info.spec.bundle is not None
    theirs += [job.info.spec.bundle, job.info.spec.inputs["data"].digest]
    assert len(theirs) == 6

    for digest in theirs:
        assert _get(server, alice, digest)[0] == 200
        assert _get(server, server.admin, digest)[0] == 200
        _as_for(_get(server, bob, digest), digest, _get(server, bob, "0" * 64), "0" * 64)
    assert sorted(_missing(server, bob, theirs)) == sorted(theirs)
    assert _missing(server, alice, theirs) == []

    run(bob, "bob")  # the same bundle and input: sent again by bob, then his
    assert _get(server, bob, job.info.spec.bundle)[0] == 200
    assert _get(server, bob, outputs["result.txt"].digest)[0] == 404  # alice's result, not his


def test_which_blobs_a_user_may_read_is_one_statement_for_many(tmp_path: Path) -> None:
    """A submit asks about every file of its bundle at once (up to 50,000 a
    request, past SQLite's limit on bound parameters)."""
    store = SqliteStore(tmp_path / "db.sqlite")
    digests = [_digest(str(i).encode()) for i in range(50_000)]
    with store.transaction() as tx:
        tx.grant_blobs("alice", digests[::1000])
        tx.grant_blobs("alice", digests[:1])  # again: nothing changes
        tx.grant_blobs("bob", digests[1:2])
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    try:
        assert store.readable_blobs("alice", digests) == set(digests[::1000])
        assert store.readable_blobs("bob", digests) == {digests[1]}
        assert store.readable_blobs("carol", digests) == set()
    finally:
        store._db.set_trace_callback(None)
    assert len(statements) == 3
    store.close()
    rows = sqlite3.connect(tmp_path / "db.sqlite").execute("SELECT COUNT(*) FROM blob_readers")
    assert rows.fetchone()[0] == 51


def test_a_workers_result_grants_only_outputs_its_token_uploaded(server: ServerProc) -> None:
    """Bob holds a worker token too. His worker's result for his own job names
    alice's blob as a file output, and as a file of a folder output whose
    manifest it did upload: bob reads neither. What it uploaded, he reads."""
    alice, bob = _token(server, "user", "alice"), _token(server, "user", "bob")
    worker = _token(server, "worker")
    secret = _pin(271828)
    stolen = _digest(secret)
    assert _put(server, alice, secret)[0] == 201
    # To that token, alice's blob is missing: it has not sent it.
    assert _missing(server, worker, [stolen]) == [stolen]
    made = b"what bob's job really made"
    entry = bundle.Entry(path="db.conf", kind="file", size=len(secret), digest=stolen)
    tree = msgspec.json.encode(bundle.Manifest(entries=(entry,)))
    for blob in (made, tree):
        assert _put(server, worker, blob)[0] == 201

    spec = {"command": ["true"], "outputs": ["stolen", "tree", "made"]}
    status, job, _ = _submit(server, bob, spec)
    assert status == 201, job
    job_id = json.loads(job)["id"]
    info = {"id": "", "name": "bobs", "host": "h", "slot_gpus": [None]}
    status, reg, _ = _call(
        server, "POST", "/api/v1/workers", worker, json_body={"worker": info, "running": []}
    )
    assert status == 201, reg
    wid = json.loads(reg)["id"]
    status, items, _ = _call(server, "POST", f"/api/v1/workers/{wid}/acquire?timeout=30", worker)
    assert status == 200 and [i["job_id"] for i in json.loads(items)] == [job_id], items
    outputs = {
        "stolen": {"kind": "file", "digest": stolen, "size": len(secret)},
        "tree": {"kind": "dir", "digest": _digest(tree), "size": len(secret)},
        "made": {"kind": "file", "digest": _digest(made), "size": len(made)},
    }
    result = {
        "job_id": job_id,
        "attempt": 1,
        "worker_id": wid,
        "outcome": "exited",
        "exit_code": 0,
        "outputs": outputs,
    }
    status, body, _ = _call(server, "POST", "/api/v1/tasks/finished", worker, json_body=result)
    assert status == 200, body
    status, body, _ = _call(server, "GET", f"/api/v1/jobs/{job_id}", bob)
    assert json.loads(body)["state"] == "succeeded"

    assert _get(server, bob, _digest(made))[:2] == (200, made)
    assert _get(server, bob, _digest(tree))[:2] == (200, tree)
    got = _get(server, bob, stolen)
    _as_for(got, stolen, _get(server, bob, "0" * 64), "0" * 64)
    assert secret not in got[1]
    assert _missing(server, bob, [stolen]) == [stolen]
