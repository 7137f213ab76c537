"""The ASGI application: a fixed table of routes, dispatched in one step.

Handlers take a Starlette ``Request`` and return a Starlette ``Response``,
but requests do not go through Starlette's application: its middleware
layers (server errors, exception handlers, the router trying each route's
pattern in turn) cost about a third of the server's time per request in a
burst of short jobs (py-spy), and the API needs none of what they add. Here
a path without parameters is one dict lookup, the rest one regular
expression each, tried among the few routes with as many segments.

Handlers take a :class:`Request` and return any ASGI response: a
:class:`Response` here, or one of Starlette's (a ``FileResponse`` for blobs).
Both are a few fields over the ASGI messages: Starlette's request and
response objects (their header and query multi-dicts, the body stream
wrapped in an async generator) cost about a sixth of the server's time per
request in a burst of short jobs (yappi), for what the API does not use.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import msgspec

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIResponse = Callable[[Scope, Receive, Send], Awaitable[None]]
Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]

_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")
_encoder = msgspec.json.Encoder()
_JSON = (b"content-type", b"application/json")


def _unquote(text: str) -> str:
    return urllib.parse.unquote_plus(text, errors="replace")


class ClientDisconnect(Exception):
    """The client went away while its request's body was being read."""


class BodyTooLarge(Exception):
    """A request's body is longer than its handler reads."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is over {limit} bytes")
        self.limit = limit


class Request:
    """One HTTP request, as its handler sees it."""

    __slots__ = ("_query", "path_params", "receive", "scope")

    def __init__(self, scope: Scope, receive: Receive, path_params: dict[str, str]) -> None:
        self.scope = scope
        self.receive = receive
        self.path_params = path_params
        self._query: dict[str, list[str]] | None = None

    @property
    def method(self) -> str:
        method: str = self.scope["method"]
        return method

    def header(self, name: bytes) -> str | None:
        """The value of header ``name`` (lower case, as ASGI gives names), or None."""
        for key, value in self.scope["headers"]:
            if key == name:
                text: str = value.decode("latin-1")
                return text
        return None

    @property
    def query(self) -> dict[str, list[str]]:
        """The query string's values by name, in order (parsed when first asked)."""
        if self._query is None:
            self._query = {}
            raw: bytes = self.scope.get("query_string", b"")
            # As parse_qsl(keep_blank_values=True) parses it, but unquoting
            # only what needs it: the API's values are numbers and ids.
            for part in raw.decode("latin-1").split("&") if raw else ():
                if not part:
                    continue
                name, _, value = part.partition("=")
                if "%" in part or "+" in part:
                    name, value = _unquote(name), _unquote(value)
                self._query.setdefault(name, []).append(value)
        return self._query

    def query_value(self, name: str) -> str | None:
        """The value of query parameter ``name`` (the last, if it is given
        more than once, as Starlette had it), or None."""
        values = self.query.get(name)
        return values[-1] if values else None

    async def stream(self) -> AsyncIterator[bytes]:
        """The body, as it arrives."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            chunk: bytes = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return

    def content_length(self) -> int | None:
        """The ``Content-Length`` the client declared (None: none, or not a number)."""
        raw = self.header(b"content-length")
        if raw is None or not raw.strip().isdigit():
            return None
        return int(raw)

    async def body(self, limit: int | None = None) -> bytes | bytearray:
        """The whole body (the API's JSON bodies are small; blobs are
        streamed); :class:`BodyTooLarge` past ``limit`` bytes, read no further.

        Never more than ``limit`` bytes are held: a body declared longer is
        refused before any of it is read, and one sent in chunks (no length
        declared) as soon as it passes the limit. The server reads no more
        of it than it holds (uvicorn stops reading the socket meanwhile).
        """
        declared = self.content_length()
        if limit is not None and declared is not None and declared > limit:
            raise BodyTooLarge(limit)
        message = await self.receive()  # usually all of it, in one message
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        body: bytes = message.get("body", b"")
        if limit is not None and len(body) > limit:
            raise BodyTooLarge(limit)
        if not message.get("more_body", False):
            return body
        # One buffer, grown in place: no list of parts joined into a second copy.
        whole = bytearray(body)
        async for chunk in self.stream():
            if limit is not None and len(whole) + len(chunk) > limit:
                raise BodyTooLarge(limit)
            whole += chunk
        return whole


class Response:
    """A whole response: status, headers, body."""

    __slots__ = ("_json", "body", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        *,
        media_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = dict(headers or {})
        self._json = media_type == "application/json"  # its header is made once, here
        if media_type is not None and not self._json:
            self.headers["content-type"] = media_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        if self._json:
            raw.append(_JSON)
        if self.status >= 200 and self.status not in (204, 304):  # those have no body
            raw.append((b"content-length", b"%d" % len(self.body)))
        await send({"type": "http.response.start", "status": self.status, "headers": raw})
        await send({"type": "http.response.body", "body": self.body})


def json_response(data: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(data), status, media_type="application/json")


Handler = Callable[[Request], Awaitable[ASGIResponse]]


class App:
    """Routes ``(method, path pattern, handler)``; a pattern's ``{name}``
    matches one path segment, handed to the handler in ``path_params``."""

    def __init__(self, routes: list[tuple[str, str, Handler]]) -> None:
        self._static: dict[str, dict[str, Handler]] = {}
        patterns: dict[str, dict[str, Handler]] = {}
        for method, path, handler in routes:
            table = patterns if _PARAM.search(path) else self._static
            table.setdefault(path, {})[method] = handler
        self._dynamic: dict[int, list[tuple[re.Pattern[str], dict[str, Handler]]]] = {}
        for path, handlers in patterns.items():
            regex = re.compile("^" + _PARAM.sub(r"(?P<\1>[^/]+)", path) + "$")
            self._dynamic.setdefault(path.count("/"), []).append((regex, handlers))
        self.lifespan: Lifespan | None = None
        self.state: dict[str, Any] = {}

    def match(self, path: str) -> tuple[dict[str, Handler] | None, dict[str, str]]:
        handlers = self._static.get(path)
        if handlers is not None:
            return handlers, {}
        for regex, handlers in self._dynamic.get(path.count("/"), ()):
            found = regex.match(path)
            if found is not None:
                return handlers, found.groupdict()
        return None, {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        handlers, params = self.match(path)
        response: ASGIResponse
        if handlers is None:
            response = _error(404, f"no endpoint at {path}")
        else:
            handler = handlers.get("GET" if method == "HEAD" else method)
            if handler is None:
                allowed = ", ".join(sorted({*handlers, *(["HEAD"] if "GET" in handlers else [])}))
                error = _error(405, f"{method} is not allowed on {path} (allowed: {allowed})")
                error.headers["allow"] = allowed
                response = error
            else:
                scope["path_params"] = params
                try:
                    response = await handler(Request(scope, receive, params))
                except ClientDisconnect:
                    return  # no one to answer
                except Exception:
                    log.exception("%s %s failed", method, path)
                    response = _error(500, "the server failed on this request; see its log")
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Run :attr:`lifespan` (an async context manager factory) around the
        server's life, as the ASGI lifespan protocol tells."""
        message = await receive()
        assert message["type"] == "lifespan.startup"
        context = self.lifespan(self) if self.lifespan is not None else None
        try:
            if context is not None:
                await context.__aenter__()
        except Exception as exc:
            log.exception("the server failed to start")
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        assert message["type"] == "lifespan.shutdown"
        try:
            if context is not None:
                await context.__aexit__(None, None, None)
        except Exception as exc:
            log.exception("the server failed to shut down cleanly")
            await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.shutdown.complete"})


def _error(status: int, message: str) -> Response:
    return json_response({"error": message}, status)
