"""The ASGI application: a fixed table of routes, dispatched in one step.

Handlers take a Starlette ``Request`` and return a Starlette ``Response``,
but requests do not go through Starlette's application: its middleware
layers (server errors, exception handlers, the router trying each route's
pattern in turn) cost about a third of the server's time per request in a
burst of short jobs (py-spy), and the API needs none of what they add. Here
a path without parameters is one dict lookup, the rest one regular
expression each, tried among the few routes with as many segments.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]

_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


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
        response: Response
        if handlers is None:
            response = _error(404, f"no endpoint at {path}")
        else:
            handler = handlers.get("GET" if method == "HEAD" else method)
            if handler is None:
                allowed = ", ".join(sorted({*handlers, *(["HEAD"] if "GET" in handlers else [])}))
                response = _error(405, f"{method} is not allowed on {path} (allowed: {allowed})")
                response.headers["Allow"] = allowed
            else:
                scope["path_params"] = params
                try:
                    response = await handler(Request(scope, receive, send))
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
    return JSONResponse({"error": message}, status_code=status)
