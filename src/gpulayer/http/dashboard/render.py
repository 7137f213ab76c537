"""Pages from Jinja2 templates (every value autoescaped), and the static assets.

The templates and assets are package data (``templates/``, ``static/``):
they ship in the wheel, and nothing is built to serve them. A static asset
is found by its name in a table made at start-up from the files there, never
by joining a path from the request: ``/static/../app.py``, encoded or not,
names no entry.
"""

from __future__ import annotations

import hashlib
import time
from importlib import resources
from typing import Any

import jinja2

from ..routing import Response

# No script, style or frame from anywhere but here; no inline script or
# style at all (so an injected tag would do nothing even if one got through).
HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}
_TYPES = {
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
STATIC_CACHE = "public, max-age=3600"  # assets change with the package; an hour is short


def _span(seconds: float) -> str:
    """``seconds`` in the largest units that say it: 42s, 5m 3s, 2h 10m, 3d 4h."""
    s = int(seconds)
    for unit, size, next_unit, next_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if s >= size:
            return f"{s // size}{unit} {s % size // next_size}{next_unit}"
    return f"{s // 60}m {s % 60}s" if s >= 60 else f"{seconds:.1f}s"


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ago(ts: float | None) -> str:
    if not ts:
        return "never"
    return f"{_span(max(0.0, time.time() - ts))} ago"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0.01:  # a dispatch takes well under a millisecond
        return f"{value * 1000:.2f} ms"
    return f"{value * 1000:.0f} ms" if value < 1 else _span(value)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("gpulayer.http.dashboard", "templates"),
        autoescape=True,  # every template here is HTML
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=_when, ago=_ago, seconds=_seconds)
    return env


class Renderer:
    def __init__(self) -> None:
        self._env = _environment()
        self.static = _static_files()
        # A digest of each asset in its URL: a new release is fetched at once
        # despite the cache.
        self.asset = {name: f"/static/{name}?v={tag}" for name, (_, _, tag) in self.static.items()}

    def page(self, template: str, status: int = 200, **values: Any) -> Response:
        values.setdefault("session", None)
        values.setdefault("path", "")
        body = self._env.get_template(template).render(asset=self.asset, **values)
        return Response(
            body.encode(), status, media_type="text/html; charset=utf-8", headers=HEADERS
        )

    def fragment(self, template: str, final: bool = False, **values: Any) -> Response:
        """Only the live part of a page (its ``live`` block), for the script's
        refresh; ``final``: it will not change again (the script stops asking)."""
        made = self._env.get_template(template)
        context = made.new_context({"asset": self.asset, **values})
        body = "".join(made.blocks["live"](context))
        headers = {**HEADERS, "x-gpulayer-final": "1"} if final else HEADERS
        return Response(body.encode(), media_type="text/html; charset=utf-8", headers=headers)

    def message(self, status: int, title: str, text: str, **values: Any) -> Response:
        """A plain page saying what went wrong."""
        return self.page("message.html", status, title=title, text=text, **values)


def redirect(to: str, cookie: str | None = None) -> Response:
    headers = {"location": to, "cache-control": "no-store"}
    if cookie is not None:
        headers["set-cookie"] = cookie
    return Response(b"", 303, headers=headers)


def _static_files() -> dict[str, tuple[bytes, str, str]]:
    """Each asset by name: its bytes, media type and content digest."""
    found: dict[str, tuple[bytes, str, str]] = {}
    folder = resources.files("gpulayer.http.dashboard") / "static"
    for entry in folder.iterdir():
        kind = _TYPES.get("." + entry.name.rpartition(".")[2])
        if kind is None or not entry.is_file():
            continue
        body = entry.read_bytes()
        found[entry.name] = (body, kind, hashlib.sha256(body).hexdigest()[:12])
    return found


def static_response(files: dict[str, tuple[bytes, str, str]], name: str) -> Response:
    found = files.get(name)
    if found is None:
        return Response(
            b"no such file", 404, media_type="text/plain; charset=utf-8", headers=HEADERS
        )
    body, kind, tag = found
    headers = {
        "cache-control": STATIC_CACHE,
        "etag": f'"{tag}"',
        "x-content-type-options": "nosniff",
    }
    return Response(body, media_type=kind, headers=headers)
