"""The server's HTTP protocol sends each reply's head and body in one write,
and otherwise writes exactly what uvicorn writes."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from gpulayer.http.protocol import HeadWithBody, Protocol
from gpulayer.http.routing import App, Request, Response, json_response


class Recording:
    """A transport that keeps what is written to it (and passes it on)."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        if self.inner is not None:
            self.inner.write(data)

    def close(self) -> None:
        self.closed = True
        if self.inner is not None:
            self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def test_a_head_waits_for_its_body_and_both_go_in_one_write() -> None:
    async def main() -> Recording:
        inner = Recording()
        transport = HeadWithBody(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        transport.write(HEAD)
        assert inner.writes == []
        transport.write(b"{}")
        transport.write(b"more")  # what follows the body passes straight on
        await asyncio.sleep(0)  # the turn that would send a head left alone
        return inner

    assert asyncio.run(main()).writes == [HEAD + b"{}", b"more"]


def test_a_head_with_no_body_after_it_goes_at_the_next_turn_or_at_close() -> None:
    async def main() -> tuple[list[bytes], list[bytes], bool]:
        loop = asyncio.get_running_loop()
        alone = Recording()
        HeadWithBody(alone, loop).write(HEAD)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        closing = Recording()
        transport = HeadWithBody(closing, loop)  # type: ignore[arg-type]
        transport.write(HEAD)
        transport.close()
        return alone.writes, closing.writes, closing.closed

    alone, closing, closed = asyncio.run(main())
    assert alone == [HEAD]
    assert closing == [HEAD] and closed


def test_an_interim_head_keeps_its_place_before_the_reply() -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"

    async def main() -> Recording:
        inner = Recording()
        transport = HeadWithBody(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        transport.write(interim)
        transport.write(HEAD)
        transport.write(b"{}")
        await asyncio.sleep(0)
        return inner

    assert b"".join(asyncio.run(main()).writes) == interim + HEAD + b"{}"


async def _hello(request: Request) -> Response:
    return json_response({"hello": "world"})


async def _nothing(request: Request) -> Response:
    return Response(status=204)


def test_uvicorn_over_the_protocol_answers_in_one_write_per_reply() -> None:
    app = App([("GET", "/hello", _hello), ("POST", "/nothing", _nothing)])
    config = uvicorn.Config(app, http=Protocol, log_level="warning", lifespan="off")
    config.load()
    state = ServerState()
    seen: list[Recording] = []

    class Recorded(Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            seen.append(Recording(transport))
            super().connection_made(seen[-1])  # type: ignore[arg-type]

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: Recorded(config=config, server_state=state, app_state={}, _loop=loop),
            "127.0.0.1",
            0,
        )
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        replies = []
        for request in (
            b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n",
            b"HEAD /hello HTTP/1.1\r\nhost: x\r\n\r\n",
            b"POST /nothing HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
        ):
            writer.write(request)
            replies.append(await reader.readuntil(b"\r\n\r\n"))
            if request.startswith(b"GET"):
                replies[-1] += await reader.readexactly(len(b'{"hello":"world"}'))
        writer.close()
        server.close()
        await server.wait_closed()
        return replies

    get, head, nothing = asyncio.run(main())
    (connection,) = seen
    assert connection.writes == [get, head, nothing]  # one write each, as received
    assert get.startswith(b"HTTP/1.1 200 OK\r\n") and get.endswith(b'\r\n\r\n{"hello":"world"}')
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 17" in head
    assert nothing.startswith(b"HTTP/1.1 204 ")
