"""Raw requests to a test server, for what the client library does not send;
or straight into an ASGI app, with no socket."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from server.conftest import ServerProc

ASGIApp = Any  # an ASGI application: app(scope, receive, send)


def request(
    server: ServerProc,
    method: str,
    path: str,
    body: object = None,
    *,
    raw: bytes | None = None,
    token: str | None = "admin",
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One request: (status, JSON body, headers). ``token="admin"``: the admin's."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {server.admin if token == 'admin' else token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, content, headers = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, content, headers = e.code, e.read(), dict(e.headers)
        e.close()
    try:
        answer = json.loads(content) if content else {}
    except ValueError:
        answer = {"not JSON": content.decode(errors="replace")}
    return status, answer, headers


async def asgi_request(
    app: ASGIApp,
    method: str,
    path: str,
    query: str = "",
    body: object = None,
    *,
    raw: bytes | None = None,
    token: str | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> tuple[int, dict[str, str], Any]:
    """One request straight into ``app``: (status, headers, JSON body, or the
    bytes of any other body, or None).
    ``raw``: the body's bytes as they are, instead of ``body`` as JSON."""
    if raw is None:
        raw = json.dumps(body).encode() if body is not None else b""
    sent_headers = [(b"content-type", b"application/json")] if raw else []
    if token is not None:
        sent_headers.append((b"authorization", f"Bearer {token}".encode()))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [*sent_headers, *headers],
    }
    sent: list[dict[str, Any]] = []

    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays connected (until cancelled)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    content = b"".join(m.get("body", b"") for m in sent[1:])
    if not content:
        return start["status"], headers, None
    if headers.get("content-type") != "application/json":
        return start["status"], headers, content  # a blob, as it came
    return start["status"], headers, json.loads(content)
