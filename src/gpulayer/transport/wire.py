"""HTTP/1.1 on one socket, the client's side: requests out, responses parsed by httptools.

The stdlib's ``http.client`` parses each response's headers with the
``email`` package and sends a request's headers and body in two writes; for
the small JSON exchanges of this API that was about half of a request's
client CPU, paid by every worker for every task (ADR-0013). Here a request
leaves in one write and its response is parsed by httptools, the C parser
(llhttp) the server's uvicorn already uses.

A :class:`Connection` carries one request at a time and is kept alive for
the next one when its response was read to the end. Bodies stream both ways:
a file goes out in chunks, and :meth:`Response.read` with a size returns at
most that much, receiving only what it needs.

Timeouts: on Linux a plain TCP connection is a blocking socket with the
kernel's send and receive timeouts (``SO_SNDTIMEO``, ``SO_RCVTIMEO``). A
Python socket timeout polls before every send and every receive instead: two
more system calls per request, each dear on a machine whose caches the jobs
keep cold. A timeout raises ``TimeoutError`` either way. The kernel's send
timeout bounds each wait for room to send, so a large upload fails when the
server stops reading, not when it reads slowly.
"""

from __future__ import annotations

import re
import socket
import ssl
import struct
import sys
from collections.abc import Mapping
from typing import Protocol

import httptools

# Replies are read into one buffer per connection: a fresh 256 KiB bytes per
# recv() was an mmap, an mremap and a munmap (and a page fault) per reply.
_RECV = 64 * 1024
_BLANKS = re.compile(r"[ \r\n\t]")  # never in a request target
_KERNEL_TIMEOUTS = sys.platform.startswith("linux")  # struct timeval is two longs there
_CHUNK = 1024 * 1024
_JOIN_MAX = 256 * 1024  # bodies up to this go out in the headers' write


class Disconnected(ConnectionError):
    """The server closed the connection before a byte of the response came."""


class ProtocolError(OSError):
    """The server's reply is not HTTP/1.1 this client can read."""


class Body(Protocol):
    """A request body read in chunks (a file, rewound for each try)."""

    def read(self, n: int = ..., /) -> bytes: ...


class Connection:
    """One keep-alive connection to ``host:port`` (TLS when ``context`` is given)."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float,
        context: ssl.SSLContext | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.context = context
        self.sock: socket.socket | None = None
        self._buffer = memoryview(bytearray(_RECV))  # where replies are read into
        name = f"[{host}]" if ":" in host else host
        default = 443 if context is not None else 80
        self._host_header = name if port == default else f"{name}:{port}"

    def settimeout(self, timeout: float) -> None:
        if timeout == self.timeout:
            return  # each change is a system call or two
        self.timeout = timeout
        if self.sock is not None:
            self._apply_timeout(self.sock)

    def _apply_timeout(self, sock: socket.socket) -> None:
        if self._kernel_timeouts:
            whole = int(self.timeout)
            micros = int((self.timeout - whole) * 1_000_000)
            if not whole and not micros:
                micros = 1  # zero would mean no timeout at all
            value = struct.pack("ll", whole, micros)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        else:
            sock.settimeout(self.timeout)

    @property
    def _kernel_timeouts(self) -> bool:
        return _KERNEL_TIMEOUTS and self.context is None

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
            else:
                sock.settimeout(None)  # blocking, and no poll before each call
                self._apply_timeout(sock)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        return sock

    def request(
        self,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | Body | None = None,
    ) -> Response:
        """Send one request and read its status line and headers.

        ``body`` is bytes, or a :class:`Body` whose length ``headers`` give
        (Content-Length).
        """
        if method == "HEAD":  # its reply has no body, which the parser cannot be told
            raise ValueError("HEAD requests are not supported")
        if _BLANKS.search(target):
            raise ValueError(f"a request path has no spaces or line breaks: {target!r}")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                # Never echo the value: it may be a token.
                raise ValueError(f"header {name} has a line break in its value")
            lines.append(f"{name}: {value}")
        if isinstance(body, bytes):
            lines.append(f"Content-Length: {len(body)}")
        elif body is None and method in ("POST", "PUT", "PATCH"):
            lines.append("Content-Length: 0")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        sock = self.sock or self._connect()
        try:
            if isinstance(body, bytes) and len(body) <= _JOIN_MAX:
                sock.sendall(head + body)
            else:
                sock.sendall(head)
                if isinstance(body, bytes):
                    sock.sendall(body)
                elif body is not None:
                    while chunk := body.read(_CHUNK):
                        sock.sendall(chunk)
        except BlockingIOError:  # the kernel's timeout ran out
            raise TimeoutError(f"could not send within {self.timeout:g} s") from None
        response = Response(sock, self._buffer)
        response.begin()
        return response

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


class Response:
    """One response: its status and headers at once, its body as read."""

    def __init__(self, sock: socket.socket, buffer: memoryview) -> None:
        self._sock = sock
        self._buffer = buffer
        self._parser = httptools.HttpResponseParser(self)
        self._headers: dict[str, str] = {}
        self._body = bytearray()  # received, not yet read
        self._headers_done = False
        self._done = False
        self._got_any = False
        self._until_close = False  # the body is what comes until the server closes
        self.status = 0
        self.keep_alive = False

    # ---- httptools callbacks ----

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        before = self._headers.get(key)
        self._headers[key] = text if before is None else f"{before}, {text}"

    def on_headers_complete(self) -> None:
        status = self.status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # informational: the reply proper follows
        self._headers_done = True
        # Asked here: once the message is complete the parser starts afresh.
        self.keep_alive = self._parser.should_keep_alive()
        headers = self._headers
        self._until_close = (
            status not in (204, 304)
            and "content-length" not in headers
            and "chunked" not in headers.get("transfer-encoding", "").lower()
        )

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        if not self._headers_done:  # the end of an informational reply
            self._headers.clear()
            return
        self._done = True
        self.keep_alive = self.keep_alive and self._parser.should_keep_alive()

    # ----

    def _receive(self) -> None:
        try:
            got = self._sock.recv_into(self._buffer)
        except BlockingIOError:  # the kernel's timeout ran out (see the module's notes)
            raise TimeoutError("the server did not answer in time") from None
        if not got:
            if not self._got_any:
                raise Disconnected("the server closed the connection")
            if self._headers_done and self._until_close:
                self._done, self.keep_alive = True, False  # that close ends the body
                return
            raise ProtocolError("the server closed the connection in the middle of its reply")
        self._got_any = True
        try:
            self._parser.feed_data(self._buffer[:got])
        except httptools.HttpParserError as exc:
            raise ProtocolError(f"unreadable reply from the server: {exc}") from None

    def begin(self) -> None:
        while not self._headers_done:
            self._receive()

    def getheader(self, name: str) -> str | None:
        return self._headers.get(name.lower())

    def read(self, n: int = -1) -> bytes:
        """The rest of the body, or at most ``n`` bytes of it (b"" at its end)."""
        while not self._done and (n < 0 or len(self._body) < n):
            self._receive()
        if n < 0 or n >= len(self._body):
            data = bytes(self._body)
            self._body.clear()
        else:
            data = bytes(self._body[:n])
            del self._body[:n]
        return data

    def reusable(self) -> bool:
        """Read to its end, and the connection may carry the next request."""
        return self._done and not self._body and self.keep_alive
