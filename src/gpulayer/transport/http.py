"""The transport to a GPUlayer server: JSON over HTTP/1.1 (``wire.py``).

One keep-alive connection per thread. Long polls (acquire, wait, log follow)
are plain requests the server holds open. Blobs stream in 1 MiB chunks in
both directions and are verified against their digest; a file is never held
whole in memory. Errors come back as the exceptions the embedded control
plane raises, so callers handle both alike.

The client is kept small on purpose: it is on every worker's and CLI's
import path and runs for every task, so it is a thin layer over the
httptools parser rather than a general HTTP client (ADR-0008, ADR-0013).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from .. import defaults
from ..access import check_user_name
from ..artifacts import ArtifactStore, sha256_file
from ..errors import (
    AccessDenied,
    ArtifactError,
    GPUlayerError,
    InvalidStateError,
    JobNotFoundError,
    ServerUnreachable,
    SpecError,
    TransportError,
    UntrustedServer,
)
from ..http.schemas import TokenInfo
from ..ids import new_id
from ..jobs import (
    GpuStats,
    Instruction,
    JobInfo,
    LogChunk,
    LogLine,
    TaskResult,
    TaskStarted,
    WorkerInfo,
)
from ..projects import ProjectInfo, ProjectNotFound, ProjectUsage, check_project_name
from ..spec import JobSpec
from . import Transport
from .wire import Connection, Disconnected, Response

T = TypeVar("T")
log = logging.getLogger(__name__)
_CHUNK = 1024 * 1024
_MAX_IDLE = 8  # idle connections kept per transport
# Below the server's keep-alive timeout (75 s, see http/server.py), after
# which it closes idle connections; other servers may close them sooner,
# which a request survives (see _exchange).
_IDLE_MAX_S = 60.0
# How a request fails on a keep-alive connection the server already closed.
_CLOSED_UNDER_US = (Disconnected, BrokenPipeError, ConnectionResetError)
_PLAIN = re.compile(r"[A-Za-z0-9._~-]*")  # a query value that needs no quoting
_POLL_S = 30.0  # the longest single long poll; longer waits loop
_encode = msgspec.json.encode


def _query_string(query: Mapping[str, Any]) -> str:
    """``urlencode(query, doseq=True)`` for our own keys, with no quoting of
    the plain numbers and words that most values are (a worker sends three
    with every task's end)."""
    parts = []
    for key, value in query.items():
        for item in value if isinstance(value, list | tuple) else (value,):
            text = str(item)
            parts.append(
                f"{key}={text}" if _PLAIN.fullmatch(text) else urllib.parse.urlencode({key: text})
            )
    return "&".join(parts)


class _Received:
    """Which numbered instructions a worker got (see the server's acquire).

    They come in replies to its long poll and to its finished reports, which
    can arrive in either order; one whose reply was lost is sent again. So
    each is handed on once: the first time its number is seen.
    """

    def __init__(self, generation: str | None = None) -> None:
        self.generation = generation  # the registration the numbers belong to
        self.acked = 0  # got every one up to this number
        self._ahead: set[int] = set()  # and these, past a gap
        self._lock = threading.Lock()

    def accept(self, first: int, items: list[Instruction]) -> list[Instruction]:
        fresh = []
        with self._lock:
            for seq, item in enumerate(items, first):
                if seq > self.acked and seq not in self._ahead:
                    self._ahead.add(seq)
                    fresh.append(item)
            while self.acked + 1 in self._ahead:
                self.acked += 1
                self._ahead.discard(self.acked)
        return fresh


class _Outage:
    """One long poll riding out a server that is away: restarting (a 503),
    or out of reach (a dropped connection, a refused one).

    Each failure waits a little longer before the next try (honouring a
    Retry-After), up to ``give_up`` seconds of outage in all; the outage is
    said once as it begins and once as it ends, not at every try. The poll
    is asked again as it was (the same cursor): it changes nothing, so
    nothing is lost or repeated.
    """

    def __init__(self, url: str, give_up: float) -> None:
        self.url = url
        self.give_up = give_up
        self.since: float | None = None
        self.pause = defaults.RECONNECT_PAUSE_FIRST_S

    def failed(self, exc: ServerUnreachable, deadline: float | None = None) -> None:
        """Sleep before the next try; raise ServerUnreachable once the outage
        has lasted ``give_up`` seconds (or reaches ``deadline``)."""
        if isinstance(exc, UntrustedServer):  # the same on every try
            raise exc
        now = time.monotonic()
        if self.since is None:  # said once, as the outage begins
            self.since = now
            if self.give_up > 0:
                log.warning(
                    "the server at %s is unavailable; retrying for up to %g s (%s)",
                    self.url,
                    self.give_up,
                    exc,
                )
        end = self.since + self.give_up
        limit = "GPULAYER_RECONNECT_GIVE_UP_S sets how long"
        if deadline is not None and deadline < end:
            end, limit = deadline, "the wait's timeout"
        if now >= end:
            gave_up = ServerUnreachable(
                f"{exc}; gave up after {now - self.since:.0f} s of retrying ({limit})"
            )
            raise gave_up from None
        pause = max(self.pause, exc.retry_after or 0.0)
        time.sleep(min(pause, defaults.RECONNECT_PAUSE_MAX_S, end - now))
        self.pause = min(self.pause * 2, defaults.RECONNECT_PAUSE_MAX_S)

    def answered(self) -> None:
        if self.since is not None:
            log.warning(
                "reconnected to the server at %s after %.1f s",
                self.url,
                time.monotonic() - self.since,
            )
            self.since = None
            self.pause = defaults.RECONNECT_PAUSE_FIRST_S


class HttpTransport(Transport):
    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        worker_id: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        ca_file: str | None = None,
        reconnect_give_up: float = defaults.RECONNECT_GIVE_UP_S,
    ) -> None:
        """``reconnect_give_up``: how long in all a long poll (wait, a log
        follow) rides out a server that is away before it raises
        ServerUnreachable (see _Outage); other requests fail sooner."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise GPUlayerError(f"a server URL looks like http://host:8585, got {url!r}")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._base = parts.path.rstrip("/")
        self._token = token
        self.worker_id = worker_id  # sent with blob fetches so the server can check them
        self._timeout = timeout
        self._retries = retries
        self._give_up = reconnect_give_up
        self._ssl = ssl.create_default_context(cafile=ca_file) if self._https else None
        # Idle keep-alive connections, shared by every thread: a worker's
        # task threads are short-lived, and a connection each would cost a
        # TCP handshake (and a new connection on the server) per report.
        self._idle: list[tuple[float, Connection]] = []
        self._idle_lock = threading.Lock()
        self._received = _Received()
        self._no_wait_also = False  # the server predates POST /api/v1/jobs/wait
        self._no_gpu_stats = False  # the server predates GPU figures in heartbeats

    def __repr__(self) -> str:
        return f"HttpTransport({self.url!r})"  # never the token

    # ---- plumbing ----

    def _checkout(self, timeout: float) -> Connection:
        conn = None
        stale = []
        now = time.monotonic()
        with self._idle_lock:
            while self._idle:
                used, idle = self._idle.pop()
                if now - used < _IDLE_MAX_S:
                    conn = idle
                    break
                stale.append(idle)  # the server may have closed it by now
        for old in stale:
            old.close()
        if conn is None:
            conn = Connection(self._host, self._port, timeout, self._ssl)
        else:
            conn.settimeout(timeout)
        return conn

    def _checkin(self, conn: Connection) -> None:
        """Keep a connection whose last response was read to the end."""
        with self._idle_lock:
            if len(self._idle) < _MAX_IDLE:
                self._idle.append((time.monotonic(), conn))
                return
        conn.close()

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        # Only what the server reads: each header is a callback in its parser.
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        if extra:
            headers.update(extra)
        return headers

    @contextlib.contextmanager
    def _exchange(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: bytes | Callable[[], Any] | None = None,
        headers: Mapping[str, str] | None = None,
        wait: float = 0.0,
        retry: bool = True,
    ) -> Iterator[Response]:
        """One request, its response for the caller to read. Connection
        failures are retried (``retry``), then raise ServerUnreachable; error
        statuses raise. The connection goes back to the pool if the caller
        read the response to its end.

        ``body`` is JSON bytes, or a function giving the body afresh for each
        try (a file rewound); ``headers`` then say what it is."""
        target = self._base + path
        if query:
            target += "?" + _query_string(query)
        sent = self._headers(
            headers or ({"Content-Type": "application/json"} if body is not None else None)
        )
        attempts = self._retries if retry else 1
        attempt = 0
        while True:
            conn = self._checkout(self._timeout + wait)
            reused = conn.sock is not None
            try:
                payload = body() if callable(body) else body
                response = conn.request(method, target, sent, payload)
            except BaseException as exc:
                conn.close()  # a half-used keep-alive connection cannot be trusted
                if not isinstance(exc, OSError):  # ProtocolError is one
                    raise
                if isinstance(exc, ssl.SSLCertVerificationError):  # the same on every try
                    raise UntrustedServer(
                        f"the GPUlayer server at {self.url} sent a certificate this side "
                        f"does not trust ({exc.reason}: {exc.verify_message}); give the "
                        "certificate of the authority that signed it: --ca-file, "
                        "GPULAYER_CA_FILE, or Client(ca_file=...)"
                    ) from None
                if reused and isinstance(exc, _CLOSED_UNDER_US):
                    continue  # the server closed it while idle: a new one, not a retry
                attempt += 1
                if attempt == attempts:
                    raise ServerUnreachable(
                        f"cannot reach the GPUlayer server at {self.url}: {exc}"
                    ) from None
                time.sleep(min(0.05 * 2 ** (attempt - 1), 1.0))  # back off before retrying
                continue
            break
        if response.status >= 400:
            try:
                error = self._error(response)
            except BaseException:
                conn.close()
                raise
            self._release(conn, response)
            raise error
        try:
            yield response
        except BaseException:
            conn.close()
            raise
        self._release(conn, response)

    def _release(self, conn: Connection, response: Response) -> None:
        """Back to the pool if ``response`` was read to its end, else closed."""
        if response.reusable():
            self._checkin(conn)
        else:
            conn.close()

    def _error(self, response: Response) -> GPUlayerError:
        raw = response.read()
        try:
            data = json.loads(raw)
            message = str(data.get("error", raw[:200]))
        except ValueError:
            data, message = {}, raw[:200].decode("utf-8", "replace")
        status = response.status
        if status in (401, 403):
            return AccessDenied(f"{message} ({self.url})")
        if status == 404 and message.startswith("no blob "):
            return ArtifactError(message)
        if status == 404 and message.startswith("no token "):
            return TransportError(message)
        if status == 404 and (
            message.startswith("no project ") or " is not a member of project " in message
        ):
            return ProjectNotFound(message)
        if status == 404:
            return JobNotFoundError(message)
        if status == 409:
            return InvalidStateError(message)
        if status == 422 and "field" in data:
            error = SpecError(str(data["field"]), "")
            error.args = (message,)
            return error
        if status in (502, 503, 504):
            # It could not do it now (503), or a proxy in front of it could
            # not reach it (502, 504): send it again later.
            away = ServerUnreachable(f"the server is unavailable ({status}): {message}")
            away.status = status
            after = response.getheader("Retry-After") or ""
            if after.strip().isdigit():  # seconds (an HTTP date is taken as none)
                away.retry_after = float(after)
            return away
        failed = TransportError(
            f"the server failed ({status}): {message}"
            if status >= 500
            else f"the server refused the request ({status}): {message}"
        )
        failed.status = status
        return failed

    def _call(self, method: str, path: str, kind: type[T], **kwargs: Any) -> T:
        with self._exchange(method, path, **kwargs) as response:
            raw = response.read()
        return msgspec.json.decode(raw, type=kind)

    def _post(self, path: str, payload: object, **kwargs: Any) -> None:
        with self._exchange("POST", path, body=_encode(payload), **kwargs) as response:
            response.read()

    # ---- clients ----

    def submit(self, spec: JobSpec) -> JobInfo:
        # The id is made here so a submit retried after a lost reply is stored once.
        body = _encode({"spec": spec, "id": new_id()})
        return self._call("POST", "/api/v1/jobs", JobInfo, body=body)

    def get_job(self, job_id: str) -> JobInfo:
        return self._call("GET", f"/api/v1/jobs/{_q(job_id)}", JobInfo)

    def list_jobs(
        self,
        *,
        states: Iterable[str] = (),
        limit: int | None = None,
        labels: Mapping[str, str] | None = None,
        array: str | None = None,
    ) -> list[JobInfo]:
        query: dict[str, Any] = {"state": list(states)}
        if limit is not None:
            query["limit"] = limit
        if array is not None:
            query["array"] = array
        if labels:  # label=KEY=VALUE, once for each
            query["label"] = [f"{key}={value}" for key, value in labels.items()]
        return self._call("GET", "/api/v1/jobs", list[JobInfo], query=query)

    def wait(self, job_id: str, timeout: float | None) -> JobInfo:
        deadline = None if timeout is None else time.monotonic() + timeout
        outage = _Outage(self.url, self._give_up)
        while True:
            left = (
                _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            )
            try:
                job = self._call(
                    "POST",
                    f"/api/v1/jobs/{_q(job_id)}/wait",
                    JobInfo,
                    query={"timeout": f"{left:.3f}"},
                    wait=left,
                )
            except ServerUnreachable as exc:
                outage.failed(exc, deadline)
                continue
            outage.answered()
            if job.done or (deadline is not None and time.monotonic() >= deadline):
                return job

    def wait_also(
        self, job_id: str, also: Sequence[str], timeout: float | None
    ) -> tuple[JobInfo, list[JobInfo], list[str]]:
        if not also or self._no_wait_also:
            return self.wait(job_id, timeout), [], []
        deadline = None if timeout is None else time.monotonic() + timeout
        found: dict[str, JobInfo] = {}
        unknown: set[str] = set()
        outage = _Outage(self.url, self._give_up)
        while True:
            left = (
                _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - time.monotonic()))
            )
            asked = [j for j in also if j not in found and j not in unknown]
            try:
                reply = self._call(
                    "POST",
                    "/api/v1/jobs/wait",
                    _WaitReply,
                    body=_encode({"id": job_id, "also": asked}),
                    query={"timeout": f"{left:.3f}"},
                    wait=left,
                )
            except ServerUnreachable as exc:
                outage.failed(exc, deadline)
                continue
            except (JobNotFoundError, TransportError) as exc:
                # A server older than this endpoint: its router says there is
                # none ("no endpoint", or POST "not allowed" on a job's path).
                if "/api/v1/jobs/wait" not in str(exc):
                    raise
                self._no_wait_also = True
                return self.wait(job_id, timeout), list(found.values()), sorted(unknown)
            outage.answered()
            found.update((info.id, info) for info in reply.also)
            unknown.update(reply.unknown)
            if reply.job.done or (deadline is not None and time.monotonic() >= deadline):
                return reply.job, list(found.values()), sorted(unknown)

    def cancel(self, job_id: str) -> JobInfo:
        return self._call("POST", f"/api/v1/jobs/{_q(job_id)}/cancel", JobInfo)

    def read_logs(self, job_id: str, after: tuple[int, int], timeout: float) -> LogChunk:
        """Lines after the cursor ``after``. A follow's read (``timeout`` > 0,
        a long poll) rides out a server that is away (see _Outage), asking
        again from the same cursor; a one-off read fails at once."""
        timeout = min(timeout, 60.0)
        query = {"attempt": after[0], "seq": after[1], "timeout": f"{timeout:.3f}"}
        outage = _Outage(self.url, self._give_up)
        while True:
            try:
                chunk = self._call(
                    "GET", f"/api/v1/jobs/{_q(job_id)}/logs", LogChunk, query=query, wait=timeout
                )
            except ServerUnreachable as exc:
                if timeout <= 0:
                    raise
                outage.failed(exc)
                continue
            outage.answered()
            return chunk

    def list_workers(self) -> list[WorkerInfo]:
        return self._call("GET", "/api/v1/workers", list[WorkerInfo])

    def usage(self) -> list[ProjectUsage]:
        return self._call("GET", "/api/v1/usage", list[ProjectUsage])

    # ---- blobs ----

    def missing_blobs(self, digests: Iterable[str]) -> set[str]:
        asked = sorted(set(digests))
        missing: set[str] = set()
        step = defaults.MISSING_BLOBS_PER_REQUEST  # a tree may hold millions of files
        for start in range(0, len(asked), step):
            found = self._call(
                "POST",
                "/api/v1/blobs/missing",
                _BlobList,
                body=_encode({"digests": asked[start : start + step]}),
            )
            missing.update(found.digests)
        return missing

    def upload_blob(
        self,
        path: Path,
        digest: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> str:
        digest = digest or sha256_file(path)
        size = path.stat().st_size
        with open(path, "rb") as f:
            reader = _Reader(f, on_progress)

            def from_the_start() -> _Reader:
                f.seek(0)
                return reader

            with self._exchange(
                "PUT",
                f"/api/v1/blobs/{digest}",
                body=from_the_start,
                headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            ) as response:
                response.read()
        return digest

    def upload_bytes(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        with self._exchange("PUT", f"/api/v1/blobs/{digest}", body=data) as response:
            response.read()
        return digest

    def download_blob(self, digest: str, cache: ArtifactStore) -> Path:
        if cache.has(digest):
            return cache.path(digest)
        # A worker says who it is: it may fetch only what it was given.
        mine = {"X-GPUlayer-Worker": self.worker_id} if self.worker_id else None
        with self._exchange("GET", f"/api/v1/blobs/{digest}", headers=mine) as response:
            writer = cache.writer(digest)
            try:
                while chunk := response.read(_CHUNK):
                    writer.write(chunk)
            except BaseException:
                writer.abort()
                raise
        writer.commit()
        return cache.path(digest)

    # ---- workers ----

    def register_worker(
        self, info: WorkerInfo, running: Iterable[tuple[str, int]] = (), *, adopted: bool = False
    ) -> WorkerInfo:
        fields: dict[str, Any] = {"worker": info, "running": [list(r) for r in running]}
        if adopted:  # only then: a server from before this field takes the rest
            fields["adopted"] = True
        try:
            registered, generation = self._register(_encode(fields))
        except TransportError as exc:
            if not adopted or "unknown field" not in str(exc) or "adopted" not in str(exc):
                raise
            del fields["adopted"]  # a server from before it: as it would have had it
            registered, generation = self._register(_encode(fields))
        self.worker_id = registered.id
        # The server numbers each registration's deliveries afresh.
        self._received = _Received(generation)
        return registered

    def _register(self, body: bytes) -> tuple[WorkerInfo, str | None]:
        with self._exchange("POST", "/api/v1/workers", body=body) as response:
            registered = msgspec.json.decode(response.read(), type=WorkerInfo)
            return registered, response.getheader("X-GPUlayer-Generation")

    def unregister_worker(
        self, worker_id: str, *, died: bool = False, generation: str | None = None
    ) -> None:
        query: dict[str, Any] = {}
        if died:
            query["died"] = 1
        if generation:
            query["gen"] = generation
        try:
            with self._exchange(
                "DELETE", f"/api/v1/workers/{_q(worker_id)}", query=query or None
            ) as response:
                response.read()
        except TransportError as exc:
            if not query or exc.status != 422:
                raise
            # A server older than ``gen`` (or ``died`` too) refuses it: without.
            if generation:
                self.unregister_worker(worker_id, died=died)
            else:
                self.unregister_worker(worker_id)

    def generation(self) -> str | None:
        return self._received.generation

    def heartbeat(
        self, worker_id: str, *, stopping: bool = False, gpus: Sequence[GpuStats] = ()
    ) -> None:
        # Retried: the server may have closed an idle keep-alive connection.
        body: dict[str, object] = {"running": []}
        if stopping:
            body["stopping"] = True
        if gpus and not self._no_gpu_stats:  # only then: a server from before them takes the rest
            body["gpus"] = list(gpus)
        path = f"/api/v1/workers/{_q(worker_id)}/heartbeat"
        try:
            self._post(path, body)
        except TransportError as exc:
            if "gpus" not in body or exc.status != 422:
                raise
            # Figures refused must not cost the worker its place: the beat goes without.
            if "unknown field `gpus`" in str(exc):  # a server from before them
                self._no_gpu_stats = True
                log.info("the server at %s takes no GPU figures: none are sent", self.url)
            else:
                log.warning("the server refused this worker's GPU figures: %s", exc)
            del body["gpus"]
            self._post(path, body)

    def acquire(self, worker_id: str, timeout: float) -> list[Instruction]:
        timeout = min(timeout, 60.0)
        return self._instructions(
            f"/api/v1/workers/{_q(worker_id)}/acquire",
            None,
            {"timeout": f"{timeout:.3f}"},
            poll=True,
            wait=timeout,
            retry=False,
        )

    def _instructions(
        self,
        path: str,
        body: bytes | None,
        query: dict[str, Any],
        *,
        poll: bool = False,
        **kwargs: Any,
    ) -> list[Instruction]:
        """A numbered delivery of instructions; those not seen before.

        A reply for a registration newer than this transport's (the server
        changed it, then refused to store it: a 503) is void; for a long poll
        (``poll``) it raises InvalidStateError, so that the worker registers
        again rather than poll for replies that can only be void."""
        received = self._received
        query["ack"] = received.acked
        if received.generation:
            query["gen"] = received.generation
        with self._exchange("POST", path, query=query, body=body, **kwargs) as response:
            raw = response.read()
            first = response.getheader("X-GPUlayer-Seq")
            generation = response.getheader("X-GPUlayer-Generation")
        items = msgspec.json.decode(raw, type=list[Instruction])
        if not first:
            return items  # a server that does not number them
        if received is not self._received:
            return []  # it registered again since this went out: for the old one, void
        if generation != received.generation:
            if poll:  # it would only be answered so again, at once
                raise InvalidStateError(
                    "the server holds a newer registration of this worker than its own "
                    "(one it refused half-way, say): it must register again"
                )
            return []
        return received.accept(int(first), items)

    def task_started(self, report: TaskStarted) -> None:
        self._post("/api/v1/tasks/started", report)

    def task_rendezvous(self, job_id: str, attempt: int, worker_id: str, port: int) -> None:
        self._post(
            "/api/v1/tasks/rendezvous",
            {"job_id": job_id, "attempt": attempt, "worker_id": worker_id, "master_port": port},
        )

    def append_logs(self, job_id: str, attempt: int, lines: list[LogLine], node: int = 0) -> None:
        batch: dict[str, object] = {"job_id": job_id, "attempt": attempt, "lines": lines}
        if node:
            batch["node"] = node
        self._post("/api/v1/tasks/logs", batch)

    def task_finished(self, result: TaskResult, *, take: bool = True) -> list[Instruction]:
        body = _encode(result)
        if len(body) > defaults.RESULT_REPORT_MAX_BYTES:
            body = _encode(_too_long(result, len(body)))
        # The reply brings what waits for this worker: in a stream of short
        # jobs, its next task, one long poll reply fewer per job.
        if not take:
            with self._exchange("POST", "/api/v1/tasks/finished", body=body) as response:
                response.read()
            return []
        return self._instructions("/api/v1/tasks/finished", body, {"take": 1})

    def local_address(self) -> str:
        """This machine's address on the route to the server (no packet is sent)."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((self._host, self._port))
                return str(probe.getsockname()[0])
        except OSError:
            return socket.gethostname()

    def create_token(
        self,
        role: str,
        name: str | None = None,
        *,
        user: str | None = None,
        expires_in: float | None = None,
    ) -> str:
        """A new token (needs an admin token) acting as ``user`` (a user
        token needs one), refused ``expires_in`` seconds from now (None:
        valid until revoked)."""
        request: dict[str, object] = {"role": role, "name": name}
        if user is not None:
            request["user"] = user
        if expires_in is not None:
            request["expires_in"] = expires_in
        made = self._call("POST", "/api/v1/tokens", _Token, body=_encode(request))
        return made.token

    def list_tokens(self) -> list[TokenInfo]:
        """Every token's id, role, name and creation time (needs an admin token)."""
        return self._call("GET", "/api/v1/tokens", list[TokenInfo])

    def revoke_token(self, token_id: str) -> None:
        """From now on the server refuses the token with this id (needs an
        admin token). InvalidStateError for the server's last admin token,
        TransportError for an id that names no token."""
        # Not sent again after a failure: had the first gone through, a
        # second would say there is no such token.
        with self._exchange("DELETE", f"/api/v1/tokens/{_q(token_id)}", retry=False) as response:
            response.read()

    # ---- projects (each needs an admin token) ----

    def create_project(
        self, name: str, *, gpus: int | None = None, slots: int | None = None
    ) -> ProjectInfo:
        """A new project with these quotas (None: no limit). InvalidStateError
        if one has that name."""
        # Not sent again after a failure: had the first gone through, a
        # second would say the project exists.
        body = _encode({"name": name, "gpus": gpus, "slots": slots})
        return self._call("POST", "/api/v1/projects", ProjectInfo, body=body, retry=False)

    def list_projects(self) -> list[ProjectInfo]:
        """Every project, oldest first, with its quotas and members."""
        return self._call("GET", "/api/v1/projects", list[ProjectInfo])

    def set_project_quota(
        self,
        name: str,
        *,
        gpus: int | UnsetType | None = UNSET,
        slots: int | UnsetType | None = UNSET,
    ) -> ProjectInfo:
        """Change its quotas: a number, None for no limit, UNSET to leave it."""
        given: dict[str, int | None] = {}
        if not isinstance(gpus, UnsetType):
            given["gpus"] = gpus
        if not isinstance(slots, UnsetType):
            given["slots"] = slots
        path = _project_path(name)
        return self._call("PATCH", path, ProjectInfo, body=_encode(given))

    def add_project_member(self, name: str, user: str) -> ProjectInfo:
        return self._call("PUT", _project_path(name, user), ProjectInfo)

    def remove_project_member(self, name: str, user: str) -> ProjectInfo:
        """ProjectNotFound if there is no such project or ``user`` is not in it."""
        # Not sent again: a second would say the user is not in it.
        return self._call("DELETE", _project_path(name, user), ProjectInfo, retry=False)

    def delete_project(self, name: str) -> None:
        """InvalidStateError while a job in it is queued or running."""
        path = _project_path(name)
        with self._exchange("DELETE", path, retry=False) as response:
            response.read()

    def close(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for _, conn in idle:
            conn.close()


def _too_long(result: TaskResult, size: int) -> TaskResult:
    """What a worker reports for a task whose result is longer than the
    server takes (refused, it would leave the job running): the task could
    not report its outputs, and why. Its blobs are stored; nothing names them."""
    limit = defaults.RESULT_REPORT_MAX_BYTES // 2**20
    return msgspec.structs.replace(
        result,
        outcome="error",
        outputs={},
        missing_outputs=[],
        error=(
            f"its result lists {len(result.outputs):,} outputs, {size / 2**20:.0f} MiB of JSON, "
            f"over the {limit} MiB a task's result may take: declare a folder (one output) "
            "rather than a glob that matches many files"
        ),
    )


class _Token(msgspec.Struct):
    token: str
    role: str


class _WaitReply(msgspec.Struct):
    job: JobInfo
    also: list[JobInfo]
    unknown: list[str] = []


class _BlobList(msgspec.Struct):
    digests: list[str]


class _Reader:
    """A file body that reports progress as it is read."""

    def __init__(self, f: Any, on_progress: Callable[[int], None] | None) -> None:
        self.f = f
        self.on_progress = on_progress

    def read(self, n: int = _CHUNK) -> bytes:
        data: bytes = self.f.read(min(n, _CHUNK) if n > 0 else _CHUNK)
        if data and self.on_progress is not None:
            self.on_progress(len(data))
        return data


def _q(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def _project_path(name: str, user: str | None = None) -> str:
    """A project's route (and a member's). The names are checked here first: one
    with a ``/`` in it would reach another route, and be refused in other words."""
    path = f"/api/v1/projects/{_q(check_project_name(name))}"
    return path if user is None else f"{path}/members/{_q(check_user_name(user))}"


__all__ = ["HttpTransport"]
