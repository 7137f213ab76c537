"""What every handler of the HTTP API does: read its body and query
parameters within their limits, know its caller, and await a control-plane
signal (a long poll) without holding a thread.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from .. import defaults
from ..access import Viewer
from ..errors import GPUlayerError
from ..service import ControlPlane
from ..signals import Unsubscribe
from . import auth
from .routing import BodyTooLarge, Request, Response, json_response

# Where the guard leaves the caller (an auth.Caller) and its Authorization
# header in the ASGI scope.
CALLER = "gpulayer.caller"
T = TypeVar("T")

MAX_POLL_S = 60.0  # a long poll returns empty after this; the caller asks again
_encoder = msgspec.json.Encoder()


class ApiError(GPUlayerError):
    """A request's answer other than success; ``retry_after``: seconds the
    caller should wait before sending it again (a ``Retry-After`` header)."""

    def __init__(self, status: int, message: str, *, retry_after: int | None = None) -> None:
        self.status = status
        self.retry_after = retry_after
        super().__init__(message)


def error_response(status: int, message: str, retry_after: int | None = None) -> Response:
    response = json_response({"error": message}, status)
    if retry_after is not None:
        response.headers["retry-after"] = str(retry_after)
    return response


class Closing:
    """Whether the server has begun to shut down, and the long polls to end then.

    uvicorn's graceful shutdown waits for every request in flight; a long
    poll waits up to a minute for a signal that never comes while the
    server stops, so uvicorn would cancel it past its grace and answer 500.
    Instead, :meth:`begin` (called as the shutdown starts, on the loop's
    thread) ends every open long poll at once, and every request from then
    on, with 503 and ``Retry-After``: the caller tries again, and finds the
    server started again.
    """

    def __init__(self) -> None:
        self.begun = False
        self._polls: set[Callable[[], None]] = set()

    def begin(self) -> None:
        self.begun = True
        polls, self._polls = self._polls, set()
        for end in polls:
            end()

    def watch(self, end: Callable[[], None]) -> None:
        """Call ``end`` when the shutdown begins (until :meth:`forget`)."""
        self._polls.add(end)

    def forget(self, end: Callable[[], None]) -> None:
        self._polls.discard(end)

    @property
    def polls(self) -> int:
        """How many long polls are open (and would end as the shutdown begins)."""
        return len(self._polls)

    def error(self) -> ApiError:
        return ApiError(
            503,
            "the server is shutting down (restarting, say); nothing was changed, try again",
            retry_after=defaults.SHUTDOWN_RETRY_AFTER_S,
        )


# What each worker report may take (see defaults): a task's result the most
# (an entry per output file), since it cannot be sent in parts; the others
# far less. Past its limit a body is refused unread (see routing.Request.body).
REPORT_MAX = defaults.RESULT_REPORT_MAX_BYTES
LOGS_MAX = defaults.LOG_REPORT_MAX_BYTES
SMALL_REPORT_MAX = defaults.REPORT_MAX_BYTES
RESULT_ADVICE = (
    "a task's result this long lists too many outputs: declare a folder (one entry) "
    "rather than a glob that matches many files"
)

DIGEST = re.compile("[0-9a-f]{64}")  # as artifacts checks it, without making a path
_LONG_DIGITS = re.compile(rb"\d{19}")  # a JSON number this long may not fit in 64 bits
_INT64 = (-(2**63), 2**63 - 1)


async def read_body(
    request: Request, kind: type[T], limit: int | None = None, advice: str = "send it in parts"
) -> T:
    try:
        raw = await request.body(limit=limit or defaults.JSON_BODY_MAX_BYTES)
    except BodyTooLarge as exc:
        raise ApiError(
            413, f"the request body is over {exc.limit // 2**20} MiB; {advice}"
        ) from None
    try:
        try:
            body = msgspec.json.decode(raw, type=kind, strict=True)
        except msgspec.ValidationError as exc:
            body = _with_whole_floats(raw, kind, exc)
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # in msgspec, or in the second look for whole floats
        raise ApiError(422, "invalid request body: nested too deeply") from None
    if _LONG_DIGITS.search(raw):  # rare: look for integers the store cannot hold
        where = _too_big(body, "$")
        if where is not None:
            raise ApiError(
                422, f"invalid request body: integer out of range (64 bits at most) - at `{where}`"
            )
    return body


def _with_whole_floats(raw: bytes | bytearray, kind: type[T], exc: msgspec.ValidationError) -> T:
    """Decode again taking ``2.0`` for the integer 2, as JSON Schema does; else a 422."""
    if "got `float`" in str(exc):
        data = _ints_for_whole_floats(msgspec.json.decode(raw))
        try:
            return msgspec.json.decode(_encoder.encode(data), type=kind, strict=True)
        except msgspec.ValidationError as again:
            exc = again
    raise ApiError(422, f"invalid request body: {exc}") from None


def _ints_for_whole_floats(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _ints_for_whole_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_ints_for_whole_floats(item) for item in value]
    return value


def _too_big(value: Any, path: str) -> str | None:
    """Where in a decoded body an integer outside 64 bits is, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if _INT64[0] <= value <= _INT64[1] else path
    if isinstance(value, msgspec.Struct):
        items = [(f"{path}.{name}", getattr(value, name)) for name in value.__struct_fields__]
    elif isinstance(value, dict):
        items = [(f"{path}.{key}", item) for key, item in value.items()]
    elif isinstance(value, list | tuple):
        items = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
    else:
        return None
    for where, item in items:
        found = _too_big(item, where)
        if found is not None:
            return found
    return None


def query_float(request: Request, name: str, default: float, *, high: float = MAX_POLL_S) -> float:
    raw = request.query_value(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ApiError(
            422, f"query parameter {name} must be a number of seconds, got {raw!r}"
        ) from None
    if not 0 <= value <= high:
        raise ApiError(422, f"query parameter {name} must be between 0 and {high:g}, got {raw!r}")
    return value


def query_int(
    request: Request, name: str, default: int, *, low: int = 0, high: int = 1 << 62
) -> int:
    raw = request.query_value(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(422, f"query parameter {name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise ApiError(422, f"query parameter {name} must be between {low} and {high}, got {raw!r}")
    return value


# Numbered deliveries (see Api.acquire): the first number in a reply, and the
# registration the numbers belong to.
SEQ = "X-GPUlayer-Seq"
GENERATION = "X-GPUlayer-Generation"


def query_generation(request: Request) -> int | None:
    if "gen" not in request.query:
        return None
    return query_int(request, "gen", 0, high=(1 << 63) - 1)


def caller_of(request: Request) -> auth.Caller:
    caller: auth.Caller = request.scope[CALLER][0]
    return caller


def role_of(request: Request) -> str:
    return caller_of(request).role


def viewer_of(request: Request) -> Viewer:
    """Whose jobs the caller sees (see access.py)."""
    viewer = caller_of(request).viewer
    if viewer is None:  # a token of no user that a route let through: sees nothing
        raise auth.AuthError(403, f"a {role_of(request)} token cannot look at jobs")
    return viewer


def poll_timeout(request: Request, default: float) -> float:
    """A long poll's ``timeout`` query parameter, cut to end when the caller's
    token expires: nothing is handed out on an expired token."""
    timeout = query_float(request, "timeout", default)
    expires = caller_of(request).expires
    return timeout if expires is None else max(0.0, min(timeout, expires - time.time()))


async def until_signal(
    plane: ControlPlane,
    subscribe: Callable[[Callable[[], None]], Unsubscribe | None],
    timeout: float,
    closing: Closing,
) -> bool:
    """Await one firing of a control-plane signal, or ``timeout``; True if it
    fired. The server beginning to shut down ends the wait with a 503
    (``closing.error()``).

    Lean on purpose: a placement wakes the worker's long poll from inside
    the request that placed it, on this loop's thread, and every hop of the
    loop before the waiting request resumes is on the job's path. So a
    firing on the loop's thread settles the future at once (no self-pipe
    write), and the timeout is one timer rather than ``asyncio.wait_for``'s
    wrapper task and futures.
    """
    if closing.begun:
        raise closing.error()
    loop = asyncio.get_running_loop()
    fired: asyncio.Future[bool | None] = loop.create_future()
    loop_thread = threading.get_ident()

    def settle(result: bool | None) -> None:
        if not fired.done():
            fired.set_result(result)

    def wake() -> None:  # called under the control plane's lock, maybe from another thread
        if threading.get_ident() == loop_thread:
            settle(True)
        else:
            loop.call_soon_threadsafe(settle, True)

    unsubscribe = subscribe(wake)
    if unsubscribe is None:
        return True
    timer = loop.call_later(timeout, settle, False)

    def closed() -> None:  # on the loop's thread
        settle(None)

    closing.watch(closed)
    try:
        result = await fired
    finally:
        closing.forget(closed)
        timer.cancel()
        plane.unsubscribe(unsubscribe)
    if result is None:
        raise closing.error()
    return result
