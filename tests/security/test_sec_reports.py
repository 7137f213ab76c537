"""Worker reports past their size: refused early, with the server's memory bounded.

A hostile worker (or a stolen worker token) sends a 600 MiB report: once
declared in its Content-Length, once streamed in chunks with no length, once
with a Content-Length that lies. Each is refused (413, or the connection
dropped) and the real server process's RSS grows by a few tens of MiB at
most. Honest reports, as large as real workers send, still go through.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from gpulayer import defaults
from gpulayer.artifacts import ArtifactStore
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.jobs import LogLine, RunTask, TaskResult, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import ArtifactRef
from gpulayer.store.sqlite import SqliteStore
from gpulayer.transport.http import HttpTransport
from gpulayer.worker.logs import in_batches
from server.conftest import ServerProc
from server.rawhttp import asgi_request, request

MiB = 2**20
HOSTILE = 600 * MiB
# What the server may grow by while refusing: the largest limit (a result's,
# 16 MiB) held once, and the allocator's slack.
GROWTH_MAX = 40 * MiB


def _entries(size: int) -> bytes:
    """``size`` bytes of a result's outputs, as a hostile worker pads one."""
    entry = b'"frames/0000000.png":{"kind":"file","digest":"' + b"0" * 64 + b'","size":1},'
    return (entry * (size // len(entry) + 1))[:size]


@contextmanager
def _peak_rss(pid: int) -> Iterator[dict[str, int]]:
    """The process's RSS before, and its highest while the block runs (sampled every ms)."""
    proc = psutil.Process(pid)
    seen = {"before": proc.memory_info().rss, "peak": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen["peak"] = max(seen["peak"], proc.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()
        seen["peak"] = max(seen["peak"], proc.memory_info().rss)


def _head(path: str, token: str, length: str) -> bytes:
    framing = f"Content-Length: {length}" if length != "chunked" else "Transfer-Encoding: chunked"
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n"
    ).encode()


def _status(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:200]
    return int(reply.split()[1])


def _send_until_answered(sock: socket.socket, chunks: Iterator[bytes]) -> tuple[bytes, int]:
    """Send ``chunks`` until the server answers (or stops reading); what it
    answered, and how many bytes had gone by then."""
    sent = 0
    for chunk in chunks:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            break
        try:
            sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break
        sent += len(chunk)
    sock.settimeout(30)
    try:
        return sock.recv(65536), sent
    except ConnectionResetError:
        return b"", sent


def _chunked(total: int, step: int = MiB) -> Iterator[bytes]:
    body = _entries(step)
    yield b"%x\r\n" % 1 + b"{" + b"\r\n"
    for _ in range(total // step):
        yield b"%x\r\n" % len(body) + body + b"\r\n"
    yield b"0\r\n\r\n"


def _plain(total: int, step: int = MiB) -> Iterator[bytes]:
    body = _entries(step)
    for _ in range(total // step):
        yield body


@pytest.fixture
def worker_token(server: ServerProc) -> str:
    status, made, _ = request(server, "POST", "/api/v1/tokens", {"role": "worker"})
    assert status == 201, made
    return str(made["token"])


def _warm(server: ServerProc, token: str) -> None:
    """A few requests first, so that the RSS before is the server's at work."""
    for _ in range(20):
        request(server, "POST", "/api/v1/tasks/finished", {"job_id": "x"}, token=token)


def test_a_declared_600_mib_report_is_refused_before_a_byte_of_it_is_read(
    server: ServerProc, worker_token: str
) -> None:
    assert server.proc is not None
    _warm(server, worker_token)
    address = ("127.0.0.1", server.port)
    with _peak_rss(server.proc.pid) as rss, socket.create_connection(address) as sock:
        sock.sendall(_head("/api/v1/tasks/finished", worker_token, str(HOSTILE)))
        sock.settimeout(10)  # no body sent: it must answer on the headers alone
        reply = sock.recv(65536)
    assert _status(reply) == 413, reply
    assert b"over 16 MiB" in reply and b"declare a folder" in reply
    assert rss["peak"] - rss["before"] < GROWTH_MAX, rss


@pytest.mark.parametrize("framing", ["chunked", "lying"])
def test_a_600_mib_report_streamed_is_refused_at_its_limit_with_memory_bounded(
    server: ServerProc, worker_token: str, framing: str
) -> None:
    """Chunked, with no length to refuse it by; or with a Content-Length of
    100 bytes and 600 MiB behind it (the rest is no request at all)."""
    assert server.proc is not None
    _warm(server, worker_token)
    address = ("127.0.0.1", server.port)
    with _peak_rss(server.proc.pid) as rss, socket.create_connection(address) as sock:
        if framing == "chunked":
            sock.sendall(_head("/api/v1/tasks/finished", worker_token, "chunked"))
            reply, sent = _send_until_answered(sock, _chunked(HOSTILE))
        else:
            sock.sendall(_head("/api/v1/tasks/finished", worker_token, "100"))
            reply, sent = _send_until_answered(sock, _plain(HOSTILE))
    grown = rss["peak"] - rss["before"]
    if framing == "chunked":
        assert _status(reply) == 413, reply[:300]
        assert b"over 16 MiB" in reply
    else:  # its 100 bytes are no JSON; what follows is no HTTP request
        assert reply == b"" or 400 <= _status(reply) < 500, reply[:300]
    assert sent < HOSTILE // 4, f"the server read {sent / MiB:.0f} MiB before answering"
    assert grown < GROWTH_MAX, f"the server grew by {grown / MiB:.1f} MiB"
    assert request(server, "GET", "/healthz")[0] == 200


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        ("/api/v1/workers", defaults.REPORT_MAX_BYTES),
        ("/api/v1/workers/w1/heartbeat", defaults.REPORT_MAX_BYTES),
        ("/api/v1/tasks/started", defaults.REPORT_MAX_BYTES),
        ("/api/v1/tasks/rendezvous", defaults.REPORT_MAX_BYTES),
        ("/api/v1/tasks/logs", defaults.LOG_REPORT_MAX_BYTES),
        ("/api/v1/tasks/finished", defaults.RESULT_REPORT_MAX_BYTES),
    ],
)
def test_each_report_has_its_own_limit(
    server: ServerProc, worker_token: str, path: str, limit: int
) -> None:
    """Over it by a byte, declared: refused unread. Streamed: refused once past it."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_head(path, worker_token, str(limit + 1)))
        sock.settimeout(10)
        assert _status(sock.recv(65536)) == 413
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_head(path, worker_token, "chunked"))
        reply, sent = _send_until_answered(sock, _chunked(limit + 8 * MiB, step=256 * 1024))
    assert _status(reply) == 413, reply[:300]
    assert f"over {limit // MiB} MiB".encode() in reply
    assert sent < limit + 8 * MiB


# ---- honest reports ----


def _in_process(tmp_path: Path) -> tuple[Any, ControlPlane, str, str]:
    store = SqliteStore(tmp_path / "db.sqlite")
    plane = ControlPlane(store, instance_id="s1")
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"))
    worker = auth.create_token(store, "worker")
    return app, plane, worker, auth.create_token(store, "user", user="carol")


def test_the_largest_log_batches_a_worker_sends_fit(tmp_path: Path) -> None:
    """Lines at their longest, of the characters JSON takes 6 bytes for, in
    the batches the log sender makes: each one is taken whole."""
    app, plane, worker, user = _in_process(tmp_path)
    text = "\x01" * defaults.LOG_LINE_MAX_BYTES
    lines = [LogLine(seq=i + 1, ts=1.0, stream="stdout", text=text) for i in range(40)]
    batches = in_batches(lines, defaults.LOG_BATCH_MAX_BYTES)
    assert len(batches) > 1

    async def scenario() -> list[int]:
        _, _, w = await asgi_request(
            app,
            "POST",
            "/api/v1/workers",
            body={"worker": {"id": "", "name": "w", "host": "h", "slot_gpus": [None]}},
            token=worker,
        )
        spec = {"spec": {"command": ["true"]}}
        _, _, job = await asgi_request(app, "POST", "/api/v1/jobs", body=spec, token=user)
        path = f"/api/v1/workers/{w['id']}/acquire"
        await asgi_request(app, "POST", path, "timeout=0&ack=0", token=worker)
        statuses = []
        for batch in batches:
            raw = msgspec.json.encode({"job_id": job["id"], "attempt": 1, "lines": batch})
            assert len(raw) <= defaults.LOG_BATCH_MAX_BYTES + 1024
            status, _, _ = await asgi_request(
                app, "POST", "/api/v1/tasks/logs", raw=raw, token=worker
            )
            statuses.append(status)
        return statuses

    try:
        assert asyncio.run(scenario()) == [204] * len(batches)
    finally:
        plane.store.close()


def test_a_result_too_long_to_report_ends_its_job_failed_saying_why(
    server: ServerProc, worker_token: str
) -> None:
    """200,000 outputs of a glob: the worker's transport reports the task
    failed (its outputs could not be reported) rather than a result the
    server would refuse, which would leave the job running."""
    status, made, _ = request(server, "POST", "/api/v1/tokens", {"role": "user", "user": "carol"})
    assert status == 201, made
    carol = made["token"]
    transport = HttpTransport(server.url, token=worker_token)
    try:
        info = transport.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None]))
        spec = {"spec": {"command": ["true"], "outputs": ["frames/*.png"]}}
        status, job, _ = request(server, "POST", "/api/v1/jobs", spec, token=carol)
        assert status == 201, job
        (task,) = transport.acquire(info.id, timeout=10)
        assert isinstance(task, RunTask) and task.job_id == job["id"]
        ref = ArtifactRef(kind="file", digest="0" * 64, size=1)
        outputs = {f"frames/{i:07d}.png": ref for i in range(200_000)}
        result = TaskResult(
            job_id=job["id"],
            attempt=1,
            worker_id=info.id,
            outcome="exited",
            exit_code=0,
            outputs=outputs,
        )
        assert len(msgspec.json.encode(result)) > defaults.RESULT_REPORT_MAX_BYTES
        transport.task_finished(result, take=False)
        status, ended, _ = request(server, "GET", f"/api/v1/jobs/{job['id']}", token=carol)
        assert status == 200 and ended["state"] == "failed", ended
        assert "200,000 outputs" in ended["reason"] and "declare a folder" in ended["reason"]
        assert ended["outputs"] == {}
    finally:
        transport.close()
