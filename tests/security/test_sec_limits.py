"""Oversize specs, timeouts past what a worker can wait, and an empty --host.

Each test makes the attack first (a field far past any real job's, a host
that means every interface), then checks that nothing was stored or opened.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import gpulayer
from gpulayer import defaults
from gpulayer import spec as specs
from gpulayer.errors import GPUlayerError, SpecError
from gpulayer.http.server import Server, is_loopback
from server.conftest import ServerProc, free_port
from server.rawhttp import request

PASS = [sys.executable, "-c", "pass"]
MiB = 1024 * 1024


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": "n" * (specs.MAX_NAME_CHARS + 1)}, "name"),
        ({"args": ["a"] * specs.MAX_ARGV_ITEMS}, "args"),
        ({"args": ["x" * (specs.MAX_ARG_BYTES + 1)]}, "args[0]"),
        ({"env": {"BIG": "v" * (specs.MAX_ARG_BYTES + 1)}}, "env.BIG"),
        ({"env": {f"K{i}": "v" * 100_000 for i in range(3)}}, "env"),
        ({"env": {f"K{i}": "" for i in range(specs.MAX_ENV_ITEMS + 1)}}, "env"),
        ({"outputs": [f"o{i}" for i in range(specs.MAX_OUTPUTS + 1)]}, "outputs"),
        ({"outputs": ["o" * (specs.MAX_PATH_CHARS + 1)]}, "outputs[0]"),
        ({"labels": {f"k{i}": "" for i in range(specs.MAX_LABELS + 1)}}, "labels"),
        ({"labels": {"k" * (specs.MAX_LABEL_KEY_CHARS + 1): "v"}}, "labels."),
        ({"labels": {"team": "v" * (specs.MAX_LABEL_VALUE_CHARS + 1)}}, "labels.team"),
        ({"labels": {"": "v"}}, "labels"),
        ({"timeout": specs.MAX_TIMEOUT_S * 2}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
    ],
)
def test_oversize_fields_are_refused_and_name_the_field(
    fields: dict[str, object], field: str
) -> None:
    with pytest.raises(SpecError) as caught:
        specs.parse_spec({"command": PASS, **fields})
    assert caught.value.field.startswith(field)
    assert "at most" in caught.value.reason or "must not be empty" in caught.value.reason


def test_a_whole_spec_past_its_limit_is_refused() -> None:
    # Each output within its own limit, together over 256 KiB.
    outputs = [f"{i:04d}" + "o" * 4000 for i in range(70)]
    with pytest.raises(SpecError, match="bytes of JSON for the whole spec") as caught:
        specs.parse_spec({"command": PASS, "outputs": outputs})
    assert caught.value.field == "spec"


def test_limits_leave_real_jobs_alone() -> None:
    spec = specs.parse_spec(
        {
            "command": PASS,
            "args": ["--lr", "3e-4"] * 100,
            "env": {f"K{i}": "v" * 100 for i in range(200)},
            "outputs": ["model.pt", "logs/**/*.json"],
            "labels": {"team": "vision", "sweep": "lr-1"},
            "name": "train " * 40,
            "timeout": 30 * 24 * 3600.0,  # a month: longer than poll() can wait in one go
        }
    )
    assert spec.timeout == 30 * 24 * 3600.0


def test_an_oversize_name_is_refused_embedded_and_nothing_stored(home: Path) -> None:
    with gpulayer.Client(home=home) as client:
        with pytest.raises(SpecError, match="name: at most 256 characters, got 64,000,000"):
            client.submit(command=PASS, name="n" * 64_000_000)
        assert client.jobs() == []


def test_an_oversize_spec_over_http_is_refused_and_nothing_stored(server: ServerProc) -> None:
    spec = {"command": PASS, "name": "n" * MiB}
    status, body, _ = request(server, "POST", "/api/v1/jobs", {"spec": spec})
    assert status == 422, body
    assert body["field"] == "name"
    assert "at most 256 characters" in body["error"]
    # Past the submit limit the body is not even read: no spec that long could pass.
    assert _declared(server, "/api/v1/jobs", 63 * MiB).startswith(b"HTTP/1.1 413")
    status, listed, _ = request(server, "GET", "/api/v1/jobs")
    assert status == 200 and listed == []


def _declared(server: ServerProc, path: str, length: int) -> bytes:
    """The reply to a POST whose Content-Length says ``length``, of which only
    a few bytes are sent: a body refused on its length is never read."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {server.admin}\r\nContent-Length: {length}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"id": "')
        return sock.recv(4096)


def test_a_wait_or_a_blob_list_past_its_limit_is_refused_unread(server: ServerProc) -> None:
    """A 60 MiB wait (its `also` list) or list of digests took a server from
    37 to 965 MiB before its item limit was checked (found by a reviewer)."""
    for path in ("/api/v1/jobs/wait?timeout=0", "/api/v1/blobs/missing"):
        reply = _declared(server, path, 60 * MiB)
        assert reply.startswith(b"HTTP/1.1 413"), (path, reply[:200])
    # Within the bytes, past the count: refused by name, nothing looked up.
    too_many = {"digests": ["0" * 64] * (defaults.MISSING_BLOBS_PER_REQUEST + 1)}
    status, body, _ = request(server, "POST", "/api/v1/blobs/missing", too_many)
    assert status == 422 and "digests" in body["error"], body
    status, body, _ = request(
        server, "POST", "/api/v1/jobs/wait", {"id": "x", "also": ["x"] * 1001}
    )
    assert status == 422 and "also" in body["error"], body


def test_a_month_long_timeout_runs_instead_of_failing_at_once(home: Path) -> None:
    """Past about 24.9 days a single poll() overflows; the watcher waits in pieces."""
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1, kill_grace=0.5)
        job = client.submit(command=PASS, timeout=30 * 24 * 3600.0)
        assert job.wait(timeout=60) == "succeeded", job.logs()
        assert "OverflowError" not in job.logs()


def test_an_empty_host_is_not_loopback() -> None:
    assert not is_loopback("")
    assert not is_loopback("  ")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")


def test_server_refuses_an_empty_host_with_or_without_auth(tmp_path: Path) -> None:
    for auth_enabled in (False, True):
        with pytest.raises(GPUlayerError, match="every interface"):
            Server(tmp_path / f"h{auth_enabled}", host="", auth_enabled=auth_enabled)


def test_cli_server_start_with_empty_host_and_no_auth_exits_and_listens_nowhere(
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {**os.environ, "GPULAYER_HOME": str(tmp_path / "h")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulayer.cli",
            "server",
            "start",
            "--host",
            "",
            "--port",
            str(port),
            "--no-auth",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "every interface" in done.stderr
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"secrets": {"API_KEY": "sk-live-hunter2\udcff"}}, "secrets.API_KEY"),
        ({"secrets": {"API_KEY": "sk-live\x00hunter2"}}, "secrets.API_KEY"),
        ({"env": {"TOKEN": "sk-live-hunter2\udcff"}}, "env.TOKEN"),
        ({"env": {"TOKEN": "sk-live\x00hunter2"}}, "env.TOKEN"),
        ({"args": ["sk-live-hunter2\udcff"]}, "args[0]"),
        ({"args": ["sk-live\x00hunter2"]}, "args[0]"),
        ({"name": "sk-live-hunter2\udcff"}, "name"),
        ({"labels": {"team": "sk-live-hunter2\udcff"}}, "labels.team"),
    ],
)
def test_text_no_process_can_take_is_refused_naming_the_field_never_the_value(
    home: Path, fields: dict[str, object], field: str
) -> None:
    """A lone surrogate (argv bytes that were not UTF-8) crashed the submit
    with an exception carrying the whole value; a NUL failed the job at spawn."""
    with gpulayer.Client(home=home) as client:
        with pytest.raises(SpecError) as caught:
            client.submit(command=PASS, **fields)  # type: ignore[arg-type]
        assert caught.value.field == field
        for shown in (str(caught.value), repr(caught.value), caught.value.reason):
            assert "hunter2" not in shown
        assert client.jobs() == []
