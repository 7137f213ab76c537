"""The server's ASGI router, driven directly with ASGI messages (no socket)."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpulayer.http.routing import App, Request, Response, json_response
from server.rawhttp import asgi_request


async def _ok(request: Request) -> Response:
    return json_response({"params": request.path_params, "method": request.method})


async def _boom(request: Request) -> Response:
    raise RuntimeError("a bug in a handler")


APP = App(
    [
        ("GET", "/api/v1/jobs", _ok),
        ("POST", "/api/v1/jobs", _ok),
        ("GET", "/api/v1/jobs/{job_id}", _ok),
        ("GET", "/api/v1/blobs/{digest:str}", _ok),
        ("GET", "/boom", _boom),
    ]
)


def call(app: App, method: str, path: str) -> tuple[int, dict[str, str], Any]:
    return asyncio.run(asgi_request(app, method, path))


def test_fixed_and_parameterised_paths_reach_their_handlers() -> None:
    status, _, body = call(APP, "GET", "/api/v1/jobs")
    assert (status, body) == (200, {"params": {}, "method": "GET"})
    status, _, body = call(APP, "GET", "/api/v1/jobs/1m8k")
    assert status == 200 and body["params"] == {"job_id": "1m8k"}
    status, _, body = call(APP, "GET", "/api/v1/blobs/" + "a" * 64)
    assert status == 200 and body["params"] == {"digest": "a" * 64}
    status, _, _ = call(APP, "HEAD", "/api/v1/jobs")  # HEAD is answered as GET
    assert status == 200


def test_unknown_paths_and_methods_get_json_errors() -> None:
    status, _, body = call(APP, "GET", "/api/v2/jobs")
    assert (status, body) == (404, {"error": "no endpoint at /api/v2/jobs"})
    status, _, body = call(APP, "GET", "/api/v1/jobs/a/b")  # one segment per parameter
    assert status == 404
    status, headers, body = call(APP, "DELETE", "/api/v1/jobs")
    assert status == 405
    assert headers["allow"] == "GET, HEAD, POST"
    assert body == {"error": "DELETE is not allowed on /api/v1/jobs (allowed: GET, HEAD, POST)"}


def test_a_failing_handler_is_a_json_500_and_logged(caplog: Any) -> None:
    status, _, body = call(APP, "GET", "/boom")
    assert status == 500
    assert body == {"error": "the server failed on this request; see its log"}
    assert "GET /boom failed" in caplog.text and "a bug in a handler" in caplog.text


def test_the_lifespan_runs_around_the_server() -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        events.append("up")
        yield
        events.append("down")

    app = App([])
    app.lifespan = lifespan
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])

    asyncio.run(app({"type": "lifespan"}, receive, send))  # type: ignore[arg-type]
    assert events == ["up", "down"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


@pytest.mark.parametrize(
    "raw",
    [b"", b"a=1&b=2&a=3", b"take=1&ack=5&gen=9", b"x", b"x=&y", b"&&a=1&", b"s=a+b%20c&t=%2F"],
)
def test_a_query_string_is_read_as_parse_qsl_reads_it(raw: bytes) -> None:
    expected: dict[str, list[str]] = {}
    for name, value in urllib.parse.parse_qsl(raw.decode(), keep_blank_values=True):
        expected.setdefault(name, []).append(value)
    assert Request({"query_string": raw}, _no_receive, {}).query == expected


async def _no_receive() -> dict[str, Any]:
    raise AssertionError("no body here")


def test_a_query_parameter_given_twice_counts_with_its_last_value() -> None:
    request = Request({"query_string": b"limit=5&limit=1"}, _no_receive, {})
    assert request.query_value("limit") == "1"
    assert request.query_value("absent") is None
