"""uvicorn's HTTP protocol, sending each reply's head and body in one write.

uvicorn writes a response's status line and headers as soon as the
application sends ``http.response.start``, and its body at
``http.response.body``. With ``TCP_NODELAY`` each write leaves as its own
segment, so a client blocked in ``recv`` wakes for the head alone, parses it,
and reads again for the body: two wake-ups and two reads per reply, on every
message of a job's path (a worker's task, a client's answer). Here the head
waits for the body's first write and both go in one.

Only the order of writes is touched, never their bytes. A head that no body
write follows (a reply to ``HEAD``) goes at the event loop's next turn, and
before the connection closes.

Imported only by the server (it imports uvicorn).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadWithBody:
    """A transport whose writes pass through, except that a response's head
    is held until the next write (its body) and joined to it."""

    __slots__ = ("_head", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data[:5] == b"HTTP/" and data[-4:] == b"\r\n\r\n":
            self._head = data
            self._loop.call_soon(self.flush)  # in case no body write follows
        else:
            self._transport.write(data)

    def flush(self) -> None:
        head, self._head = self._head, None
        if head is not None:
            self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    # What uvicorn calls per request, spelled out (no __getattr__ on the way).
    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a :class:`HeadWithBody` transport."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadWithBody(transport, self.loop))  # type: ignore[arg-type]
