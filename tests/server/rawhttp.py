"""Raw requests to a test server, for what the client library does not send."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from server.conftest import ServerProc


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
