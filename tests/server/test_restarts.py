"""Followers survive a server restart: the server ends its long polls with
503 and Retry-After as it shuts down (never 500), and `gpulayer logs -f`, a
foreground `gpulayer run` and the workers wait it out and carry on where
they were: every log line once, in order.

Real processes throughout (a server, a worker, the CLI followers); the job
waits on files the test creates, so each step is a real event, not a sleep.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from gpulayer.artifacts import ArtifactStore
from gpulayer.http.app import create_app
from gpulayer.jobs import WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore
from server.conftest import ServerProc
from server.rawhttp import asgi_request

from helpers import PY

LINES = 30


def _job_code(gates: Path) -> str:
    """A job printing ``line 1`` .. ``line 30``: after line 10 it waits for
    the file ``down``, after line 20 it creates ``printed-20`` and waits for ``up``."""
    return (
        "import pathlib, sys, time\n"
        f"gates = pathlib.Path({str(gates)!r})\n"
        "def wait_for(name):\n"
        "    deadline = time.monotonic() + 90\n"
        "    while not (gates / name).exists():\n"
        "        if time.monotonic() > deadline:\n"
        "            sys.exit(3)\n"
        "        time.sleep(0.02)\n"
        f"for i in range(1, {LINES + 1}):\n"
        "    print(f'line {i}', flush=True)\n"
        "    if i == 10:\n"
        "        wait_for('down')\n"
        "    if i == 20:\n"
        "        (gates / 'printed-20').touch()\n"
        "        wait_for('up')\n"
    )


class Output:
    """A pipe read to its end on a thread, its lines kept for the test to wait on."""

    def __init__(self, pipe: IO[str] | None) -> None:
        assert pipe is not None
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._ended = False
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: IO[str]) -> None:
        with pipe:
            for line in pipe:
                with self._cond:
                    self.lines.append(line.rstrip("\n"))
                    self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        """The first line containing ``text``, once it has come."""
        with self._cond:
            found = self._cond.wait_for(
                lambda: self._ended or any(text in line for line in self.lines), timeout
            )
            for line in self.lines:
                if text in line:
                    return line
        raise AssertionError(
            f"no line with {text!r} ({'ended' if found else 'timed out'}): {self.lines}"
        )

    def text(self, timeout: float = 30.0) -> str:
        """Everything, once the pipe has ended."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._ended, timeout), self.lines
            return "\n".join(self.lines)


def _cli(
    server: ServerProc, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpulayer.cli", "--server", server.url, *args],
        env={**os.environ, "GPULAYER_TOKEN": server.admin, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop_server(server: ServerProc, sig: int) -> str:
    """Stop the server process with ``sig``; what it wrote to stderr since it served."""
    proc = server.proc
    assert proc is not None and proc.stderr is not None and proc.stdout is not None
    proc.send_signal(sig)
    said = proc.stderr.read()  # to its end: the process has exited
    proc.wait(timeout=30)
    proc.stderr.close()
    proc.stdout.close()
    server.proc = None
    return said


def _wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _park_a_wait(server: ServerProc, job_id: str) -> http.client.HTTPConnection:
    """A client's long poll on ``job_id``, open on the server: its connection
    is served already (a first request answered), and the poll's request sent."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/healthz")
    assert conn.getresponse().read()
    auth = {"Authorization": f"Bearer {server.admin}"}
    conn.request("POST", f"/api/v1/jobs/{job_id}/wait?timeout=30", headers=auth)
    return conn


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_followers_ride_through_a_server_restart(
    server: ServerProc, tmp_path: Path, sig: int
) -> None:
    gates = tmp_path / "gates"
    gates.mkdir()
    worker = server.start_worker(tmp_path / "w1")
    worker_err = Output(worker.stderr)
    run = _cli(server, "run", "--", PY, "-c", _job_code(gates))
    run_out, run_err = Output(run.stdout), Output(run.stderr)
    job_id = run_err.wait_for("submitted").split()[2]  # "gpulayer: job ID submitted"
    logs = _cli(server, "logs", "-f", job_id)
    logs_out, logs_err = Output(logs.stdout), Output(logs.stderr)
    run_out.wait_for("line 10")
    logs_out.wait_for("line 10")

    parked = _park_a_wait(server, job_id) if sig == signal.SIGTERM else None
    said = _stop_server(server, sig)
    if parked is not None:
        # Shutting down, it answered the open long poll at once: a 503 to send again.
        reply = parked.getresponse()
        assert reply.status == 503, reply.read()
        assert reply.getheader("Retry-After") == "2"
        assert b"shutting down" in reply.read()
        parked.close()
        assert "Traceback" not in said and "Internal Server Error" not in said, said

    (gates / "down").touch()  # lines 11..20 are printed while the server is down
    _wait_for_file(gates / "printed-20")
    server.start()  # the same home and port
    (gates / "up").touch()

    assert run.wait(timeout=90) == 0, run_err.text()
    assert logs.wait(timeout=90) == 0, logs_err.text()
    every = [f"line {i}" for i in range(1, LINES + 1)]
    assert run_out.text().splitlines() == every  # each line once, in order
    assert logs_out.text().splitlines() == every
    for err in (run_err.text(), logs_err.text()):
        # Once, not at every try; or not at all, where the server was back
        # before the client's next request found it gone.
        assert err.count("is unavailable; retrying") == err.count("reconnected") <= 1, err
        assert "failed (500)" not in err, err
    assert "succeeded" in run_err.text()

    # The job's result went back by the worker's outbox; its poll for work
    # notices the server again at its next try, within its back-off.
    worker_err.wait_for("waiting for it")
    worker_err.wait_for("the server answers again")
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=30)
    worker_err.wait_for("stopping")
    assert not any("Traceback" in line for line in worker_err.lines), worker_err.lines


def test_a_follower_gives_up_after_the_configured_time(server: ServerProc, tmp_path: Path) -> None:
    """A server gone for good: the follower ends (it does not wait for ever),
    saying how long it tried and what sets that."""
    server.start_worker(tmp_path / "w1")
    with server.client() as client:
        job = client.submit(
            command=[PY, "-c", "import time; print('ready', flush=True); time.sleep(120)"]
        )
    logs = _cli(server, "logs", "-f", job.id, env={"GPULAYER_RECONNECT_GIVE_UP_S": "1"})
    out, err = Output(logs.stdout), Output(logs.stderr)
    out.wait_for("ready")
    _stop_server(server, signal.SIGKILL)
    started = time.monotonic()
    assert logs.wait(timeout=30) == 2
    assert time.monotonic() - started < 15
    said = err.text()
    assert "is unavailable" in said and "gave up after" in said, said
    assert "GPULAYER_RECONNECT_GIVE_UP_S" in said, said
    server.start()  # for the worker's goodbye: it stops at once then


@pytest.mark.parametrize("value", ["5; rm -rf /", "-1", "nan", "inf", '{"s": 1}'])
def test_a_bad_give_up_time_is_refused_in_plain_words(tmp_path: Path, value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", "--server", "http://127.0.0.1:9", "jobs"],
        env={**os.environ, "GPULAYER_RECONNECT_GIVE_UP_S": value, "GPULAYER_TOKEN": "t"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "$GPULAYER_RECONNECT_GIVE_UP_S must be a number of seconds" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_open_long_polls_and_new_requests_get_503_while_shutting_down(tmp_path: Path) -> None:
    """Each kind of long poll (a client's wait and log follow, a worker's
    acquire) is answered 503 with Retry-After the moment the shutdown begins,
    and so is any request after; nothing changes. One event loop, so the
    polls are surely open when it begins."""
    store = SqliteStore(tmp_path / "db.sqlite")
    plane = ControlPlane(store, instance_id="test")
    app = create_app(plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=False)
    closing = app.state["api"].closing
    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    job = plane.submit(parse_spec({"command": ["true"], "gpus": 1}))  # never placed: no GPU

    async def scenario() -> None:
        polls = [
            asyncio.create_task(
                asgi_request(app, "POST", f"/api/v1/jobs/{job.id}/wait", "timeout=30")
            ),
            asyncio.create_task(
                asgi_request(app, "GET", f"/api/v1/jobs/{job.id}/logs", "timeout=30")
            ),
            asyncio.create_task(
                asgi_request(app, "POST", f"/api/v1/workers/{wid}/acquire", "timeout=30&ack=0")
            ),
        ]
        for _ in range(100):  # until each waits on its signal
            if closing.polls == len(polls):
                break
            await asyncio.sleep(0)
        assert closing.polls == len(polls)
        closing.begin()
        later = await asgi_request(
            app, "POST", "/api/v1/jobs", body={"spec": {"command": ["true"]}}
        )
        for status, headers, answer in [*await asyncio.gather(*polls), later]:
            assert status == 503, answer
            assert headers["retry-after"] == "2"
            assert "shutting down" in answer["error"]
        assert closing.polls == 0

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
        assert [j.id for j in plane.list_jobs()] == [job.id]  # the submit changed nothing
        assert plane.get(job.id).state == "queued"
    finally:
        store.close()
