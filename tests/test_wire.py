"""The client's HTTP/1.1 connection (transport/wire.py) against canned replies.

A real socket server on a free port answers each request with the bytes a
test gives it, and hands back what it received, so the request's exact
wire form and each way a reply can be cut short are checked.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gpulayer.errors import ServerUnreachable
from gpulayer.transport.http import HttpTransport, _query_string
from gpulayer.transport.wire import Connection, Disconnected, ProtocolError


class Close(bytes):
    """A reply after which the server closes the connection."""


class Canned:
    """Accepts connections; answers each request (read up to its end) with the next reply.

    A :class:`Close` reply is sent, then the connection is closed.
    """

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = list(replies)
        self.requests: list[bytes] = []
        self.connections = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.replies:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                while self.replies:
                    request = _read_request(conn)
                    if request is None:
                        break
                    self.requests.append(request)
                    reply = self.replies.pop(0)
                    conn.sendall(reply)
                    if isinstance(reply, Close):
                        break

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes a waiting accept()
        self.listener.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


@contextmanager
def canned(*replies: bytes) -> Iterator[Canned]:
    server = Canned(list(replies))
    try:
        yield server
    finally:
        server.close()


@contextmanager
def talking(*replies: bytes) -> Iterator[tuple[Canned, Connection]]:
    """A canned server and a connection to it, closed at the end."""
    with canned(*replies) as server:
        conn = Connection("127.0.0.1", server.port, 5.0)
        try:
            yield server, conn
        finally:
            conn.close()


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-gpulayer-seq: 7\r\n\r\nhi"


def test_a_request_goes_out_whole_and_its_reply_is_read() -> None:
    with talking(OK) as (server, conn):
        response = conn.request("POST", "/api/v1/x?a=1", {"Accept": "application/json"}, b"{}")
        assert response.status == 200
        assert response.getheader("X-GPUlayer-Seq") == "7"  # any case
        assert response.read() == b"hi"
        assert response.reusable()
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /api/v1/x?a=1 HTTP/1.1"
    assert f"Host: 127.0.0.1:{server.port}".encode() in lines
    assert b"Content-Length: 2" in lines
    assert body == b"{}"


def test_a_keep_alive_connection_carries_the_next_request() -> None:
    with talking(OK, OK) as (server, conn):
        for _ in range(2):
            response = conn.request("GET", "/", {})
            assert response.read() == b"hi"
            assert response.reusable()
    assert server.connections == 1


def test_a_chunked_body_streams_in_pieces_of_the_size_asked() -> None:
    chunks = [b"a" * 700, b"b" * 500, b"c" * 300]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    with talking(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body) as (_, conn):
        response = conn.request("GET", "/blob", {})
        pieces = []
        while piece := response.read(400):
            assert len(piece) <= 400
            pieces.append(piece)
        assert b"".join(pieces) == b"".join(chunks)
        assert response.reusable()


def test_a_reply_that_closes_the_connection_is_not_reused() -> None:
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi"
    with talking(reply) as (_, conn):
        response = conn.request("GET", "/", {})
        assert response.read() == b"hi"
        assert not response.reusable()


def test_a_body_left_unread_keeps_the_connection_from_reuse() -> None:
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123456789"
    with talking(reply) as (_, conn):
        response = conn.request("GET", "/", {})
        assert response.read(4) == b"0123"
        assert not response.reusable()
        assert response.read() == b"456789"
        assert response.reusable()


def test_a_connection_closed_before_any_reply_says_so() -> None:
    with talking(Close()) as (_, conn), pytest.raises(Disconnected):
        conn.request("GET", "/", {})


def test_a_reply_cut_short_or_garbled_is_a_protocol_error() -> None:
    short = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123"
    with talking(Close(short)) as (_, conn):
        response = conn.request("GET", "/", {})
        with pytest.raises(ProtocolError, match="middle of its reply"):
            response.read()
    with (
        talking(b"SMTP ready\r\n\r\n") as (_, conn),
        pytest.raises(ProtocolError, match="unreadable reply"),
    ):
        conn.request("GET", "/", {})


def test_a_header_value_with_a_line_break_is_refused_unsent() -> None:
    with talking(OK) as (_, conn):
        with pytest.raises(ValueError, match="Authorization") as caught:
            conn.request("GET", "/", {"Authorization": "Bearer s3cret\r\nX-Evil: 1"})
        assert "s3cret" not in str(caught.value)
        assert conn.sock is None  # nothing was sent: not even connected


def test_a_file_body_goes_out_in_chunks_after_the_headers() -> None:
    payload = bytes(range(256)) * 5000  # over the size sent with the headers

    class File:
        def __init__(self) -> None:
            self.at = 0

        def read(self, n: int = -1) -> bytes:
            piece = payload[self.at : self.at + 100_000]
            self.at += len(piece)
            return piece

    with talking(OK) as (server, conn):
        headers = {"Content-Length": str(len(payload))}
        assert conn.request("PUT", "/blob", headers, File()).read() == b"hi"
    assert server.requests[0].partition(b"\r\n\r\n")[2] == payload


def test_a_body_that_runs_until_the_server_closes_is_read_whole() -> None:
    with talking(Close(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n[1, 2]")) as (_, conn):
        response = conn.request("GET", "/", {})
        assert response.read() == b"[1, 2]"
        assert not response.reusable()


def test_an_informational_reply_is_skipped_for_the_reply_proper() -> None:
    reply = b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + OK
    with talking(reply, OK) as (_, conn):
        response = conn.request("GET", "/", {})
        assert (response.status, response.getheader("link"), response.read()) == (200, None, b"hi")
        assert response.reusable()
        assert conn.request("GET", "/", {}).read() == b"hi"  # in step with the server


def test_repeated_headers_are_joined() -> None:
    reply = b"HTTP/1.1 200 OK\r\nvary: a\r\nvary: b\r\ncontent-length: 0\r\n\r\n"
    with talking(reply) as (_, conn):
        assert conn.request("GET", "/", {}).getheader("Vary") == "a, b"


@pytest.mark.parametrize(
    ("method", "target"), [("HEAD", "/"), ("GET", "/a b"), ("GET", "/\r\nX: 1")]
)
def test_requests_this_client_cannot_make_right_are_refused_unsent(
    method: str, target: str
) -> None:
    conn = Connection("127.0.0.1", 9, 5.0)  # nothing listens: nothing may be sent
    with pytest.raises(ValueError):
        conn.request(method, target, {})
    assert conn.sock is None


@pytest.mark.parametrize(
    "query",
    [
        {"take": 1, "ack": 5, "gen": 123456789},
        {"state": ["queued", "running"], "limit": 100},
        {"timeout": "30.000"},
        {"odd": "a b&c=d/é?#", "flag": True},
    ],
)
def test_a_query_string_is_what_urlencode_makes(query: dict[str, object]) -> None:
    assert _query_string(query) == urllib.parse.urlencode(query, doseq=True)


def test_a_server_that_never_answers_times_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        conn = Connection("127.0.0.1", port, timeout=0.05)
        try:
            with pytest.raises(TimeoutError):
                conn.request("GET", "/x", {})
            assert conn.sock is not None
            conn.settimeout(0.3)  # on the open connection: the next request waits longer
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                conn.request("GET", "/x", {})
            assert time.monotonic() - start >= 0.29
        finally:
            conn.close()


def test_a_503_means_send_it_again_later() -> None:
    body = b'{"error": "the job store failed: disk is full; nothing was changed, try again"}'
    reply = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with canned(reply) as server:
        transport = HttpTransport(f"http://127.0.0.1:{server.port}", retries=1)
        try:
            # The worker's outbox keeps a report that raised this, and sends it again.
            with pytest.raises(ServerUnreachable, match="disk is full"):
                transport.get_job("j")
        finally:
            transport.close()
