"""The HTTP API: ``/api/v1`` routes onto a control plane.

Every handler is a few lines: authenticate, decode (msgspec, strict), call
the control plane, encode. Long polls (a worker's acquire, a client's wait,
a log follow) subscribe to the control plane's signals and await them on the
event loop: a waiting request holds no thread. Control-plane calls are short
and made on the loop thread itself; blob bodies are streamed in chunks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

from starlette.responses import FileResponse

from .. import defaults
from ..access import Viewer, local_viewer, sees_all
from ..arrays import MAX_ARRAY_TASKS
from ..artifacts import ArtifactStore
from ..errors import (
    ArtifactError,
    GPUlayerError,
    InvalidStateError,
    JobNotFoundError,
    SpecError,
    StoreError,
)
from ..jobs import (
    RUNNING,
    WORKER_DIED,
    WORKER_STOPPED,
    JobInfo,
    LogChunk,
    TaskResult,
    TaskStarted,
)
from ..projects import ProjectNotFound
from ..service import ControlPlane
from ..service.blobs import worker_reader
from ..service.state import Delivery
from ..signals import Unsubscribe
from ..transport import check_job_filter, label_pairs
from . import auth
from .dashboard import routes as dashboard_routes
from .handling import (
    CALLER,
    DIGEST,
    GENERATION,
    LOGS_MAX,
    REPORT_MAX,
    RESULT_ADVICE,
    SEQ,
    SMALL_REPORT_MAX,
    ApiError,
    Closing,
    caller_of,
    error_response,
    poll_timeout,
    query_generation,
    query_int,
    read_body,
    role_of,
    until_signal,
    viewer_of,
)
from .metrics import Metrics
from .routing import App, ASGIResponse, Handler, Request, Response, json_response
from .schemas import (
    BlobList,
    HeartbeatRequest,
    LogBatch,
    ProjectQuotaRequest,
    ProjectRequest,
    RegisterRequest,
    RendezvousReport,
    SubmitRequest,
    TokenRequest,
    TokenResponse,
    WaitReply,
    WaitRequest,
)

log = logging.getLogger(__name__)
_MAX_CACHED_TOKENS = 10_000
T = TypeVar("T")


class Api:
    def __init__(
        self, plane: ControlPlane, artifacts: ArtifactStore, *, auth_enabled: bool = True
    ) -> None:
        self.plane = plane
        self.artifacts = artifacts
        self.auth_enabled = auth_enabled
        self.metrics = Metrics(plane)
        self.closing = Closing()  # begun by the server as it shuts down (see server.py)
        # Valid tokens' callers, by Authorization header: every request of a
        # job would otherwise hash its token and query the store. A token's
        # role and user never change; a revocation empties it (see revoke_token).
        self._roles: dict[str, auth.Caller] = {}
        # Without auth every request is the server's local user's, an admin.
        self._local = auth.Caller(auth.ADMIN, None, None, local_viewer())
        # Which token (its sha256) registered each worker: a worker token acts
        # only for the workers it registered, not for others' (a fleet
        # sharing one token shares that right). Stored with the worker's row
        # (none without auth), so that after a restart no other token acts
        # for a worker that has not registered again yet, and revoking its
        # token removes it (see revoke_token).
        self._owners: dict[str, str] = plane.store.worker_bindings()
        if auth_enabled:  # who may read which blob (without auth: the local user, every one)
            plane.keep_blob_readers(artifacts, self._uploader_of)

    def guard(
        self, roles: tuple[str, ...] | None, handler: Handler, query: tuple[str, ...] | None = ()
    ) -> Handler:
        """Authenticate (unless ``roles`` is None: open), refuse query parameters not in
        ``query`` (None: any), then map errors to statuses."""

        async def endpoint(request: Request) -> ASGIResponse:
            try:
                if self.closing.begun:
                    raise self.closing.error()
                if roles is not None and self.auth_enabled:
                    header = request.header(b"authorization") or ""
                    known = self._roles.get(header)
                    if known is None or (
                        known.expires is not None and known.expires <= time.time()
                    ):
                        self._roles.pop(header, None)
                        known = self._caller(header)  # 401 if not valid, or expired
                        if len(self._roles) >= _MAX_CACHED_TOKENS:
                            self._roles.clear()
                        self._roles[header] = known
                    auth.require(known.role, roles)
                    request.scope[CALLER] = (known, header)
                else:
                    request.scope[CALLER] = (self._local, "")
                # Most requests have no query string: parse none then.
                unknown = (
                    sorted(set(request.query) - set(query))
                    if query is not None and request.scope["query_string"]
                    else ()
                )
                if unknown:
                    takes = f"it takes {', '.join(query)}" if query else "it takes none"
                    raise ApiError(422, f"unknown query parameter {unknown[0]!r}; {takes}")
                return await handler(request)
            except auth.AuthError as exc:
                return error_response(exc.status, str(exc))
            except ApiError as exc:
                return error_response(exc.status, str(exc), exc.retry_after)
            except asyncio.CancelledError:
                # uvicorn cancels what is still running once its grace after
                # a shutdown is spent (a slow upload, say): a 503 to send
                # again, not the 500 it would answer itself.
                if not self.closing.begun:
                    raise
                error = self.closing.error()
                return error_response(error.status, str(error), error.retry_after)
            except SpecError as exc:
                return json_response({"error": str(exc), "field": exc.field}, 422)
            except (JobNotFoundError, ProjectNotFound) as exc:
                return error_response(404, str(exc))
            except InvalidStateError as exc:
                return error_response(409, str(exc))
            except ArtifactError as exc:
                return error_response(400, str(exc))
            except StoreError as exc:  # the server's, not the request's: worth sending again
                log.error("%s %s: %s", request.method, request.scope["path"], exc)
                return error_response(503, f"{exc}; nothing was changed, try again")
            except GPUlayerError as exc:
                return error_response(400, str(exc))

        return endpoint

    # ---- jobs ----

    async def submit(self, request: Request) -> Response:
        body = await read_body(request, SubmitRequest, defaults.SUBMIT_MAX_BYTES)
        viewer = viewer_of(request)
        self.plane.check_blobs(viewer, body.spec, self.artifacts)  # only blobs it may read
        job = self.plane.submit(body.spec, body.id, viewer=viewer)
        if job.state == RUNNING:
            # Placed at once: let the worker's long poll answer first; it is
            # on the job's path, this reply is not.
            await asyncio.sleep(0)
        return json_response(job, 201)

    async def list_jobs(self, request: Request) -> Response:
        states = request.query.get("state", [])
        try:  # the words a client checking first, and embedded, give
            labels = label_pairs(request.query.get("label", []), "query parameter label")
            check_job_filter(states, labels)
        except GPUlayerError as exc:
            raise ApiError(422, str(exc)) from None
        arrays = request.query.get("array", [])
        if len(arrays) > 1:
            raise ApiError(422, "query parameter array: give one array, not several")
        # An array's tasks, all in one listing if asked (at most MAX_ARRAY_TASKS).
        most = MAX_ARRAY_TASKS if arrays else defaults.LIST_JOBS_MAX
        limit = query_int(request, "limit", 100, low=1, high=most)
        viewer = viewer_of(request)  # only the caller's jobs, as without a filter
        return json_response(
            self.plane.list_jobs(
                states=states,
                limit=limit,
                viewer=viewer,
                labels=labels,
                array=arrays[0] if arrays else None,
            )
        )

    # Each endpoint on one job finds it through the control plane with the
    # caller's viewer: a job it may not see is a 404, as for no job at all.

    async def get_job(self, request: Request) -> Response:
        return json_response(self.plane.get(request.path_params["job_id"], viewer_of(request)))

    async def _wait(self, job_id: str, timeout: float, viewer: Viewer) -> JobInfo:
        """The job (one ``viewer`` may see) once it is final, or as it is after ``timeout``."""
        final, done = self.plane.watch_job(job_id)
        if final is None and done is not None:
            await until_signal(
                self.plane, lambda cb: self.plane.subscribe_done(done, cb), timeout, self.closing
            )
            final = done.job  # the record the job ended with, when it did: no store read
        return final or self.plane.get(job_id, viewer)

    async def wait_job(self, request: Request) -> Response:
        viewer = viewer_of(request)
        job_id = self.plane.resolve(request.path_params["job_id"], viewer)
        return json_response(await self._wait(job_id, poll_timeout(request, 30.0), viewer))

    async def wait_jobs(self, request: Request) -> Response:
        """Wait for one job, and bring the records of the others asked about
        that are final by then (those the caller may not see are unknown)."""
        body = await read_body(request, WaitRequest)
        viewer = viewer_of(request)
        timeout = poll_timeout(request, 30.0)
        job = await self._wait(self.plane.resolve(body.id, viewer), timeout, viewer)
        also, unknown = self.plane.finals(body.also, viewer)
        return json_response(WaitReply(job=job, also=also, unknown=unknown))

    async def cancel_job(self, request: Request) -> Response:
        return json_response(self.plane.cancel(request.path_params["job_id"], viewer_of(request)))

    async def job_logs(self, request: Request) -> Response:
        job_id = self.plane.resolve(request.path_params["job_id"], viewer_of(request))
        after = (query_int(request, "attempt", 0), query_int(request, "seq", 0))
        timeout = poll_timeout(request, 0.0)
        chunk = self.plane.logs_after(job_id, after)
        if chunk.lines or chunk.done or timeout <= 0:
            return json_response(chunk)
        found: list[LogChunk] = []

        def subscribe(callback: Callable[[], None]) -> Unsubscribe | None:
            unsubscribe = self.plane.watch_logs(job_id, callback)
            again = self.plane.logs_after(job_id, after)  # lines that came before we subscribed
            if again.lines or again.done:
                self.plane.unsubscribe(unsubscribe)
                found.append(again)
                return None
            return unsubscribe

        await until_signal(self.plane, subscribe, timeout, self.closing)
        return json_response(found[0] if found else self.plane.logs_after(job_id, after))

    async def list_workers(self, request: Request) -> Response:
        return json_response(self.plane.list_workers(viewer_of(request)))

    # ---- blobs ----

    # A user token reaches only the blobs its user may read (service/blobs.py),
    # and a worker token's missing and PUT count only the blobs it uploaded.
    # Any other blob is answered for as one not on the server: the same
    # status, words and work, whether it is stored or not.

    def _reader(self, request: Request) -> str | None:
        """Whose blobs the caller reaches (in missing and PUT; for a worker's
        GET see may_fetch): its user's, or a worker token's uploads; None:
        every blob (an admin, a server without auth)."""
        caller = caller_of(request)
        if caller.role == auth.WORKER:
            return worker_reader(caller.digest or "")
        viewer = caller.viewer
        return None if viewer is None or sees_all(viewer) else viewer.user

    def _uploader_of(self, worker_id: str) -> str | None:
        """Whose uploads the results of ``worker_id`` may name as outputs for
        a user to read: its worker token's; None (any blob) for a worker an
        admin's token registered."""
        digest = self._owners.get(worker_id)
        role = self.plane.store.token_role(digest) if digest is not None else None
        if role is not None and role[0] == auth.ADMIN:
            return None
        return worker_reader(digest or "")  # no token: it proved nothing

    async def missing_blobs(self, request: Request) -> Response:
        body = await read_body(request, BlobList, defaults.BLOB_LIST_MAX_BYTES)
        asked = set(body.digests)
        reader = self._reader(request)
        if reader is None:
            missing = [d for d in asked if not self.artifacts.has(d)]
        else:
            for digest in asked:
                if not DIGEST.fullmatch(digest):
                    self.artifacts.path(digest)  # the 400 that names it
            # Only those it may read are looked for on disk: another user's
            # is missing for it (it uploads it, and may read it then).
            readable = self.plane.readable_by(reader, asked)
            missing = [d for d in asked if d not in readable or not self.artifacts.has(d)]
        return json_response(BlobList(digests=sorted(missing)))

    async def put_blob(self, request: Request) -> Response:
        """Store a blob: 201 whether or not it was stored already. Its sender
        may read it after (a worker token: name it as an output), but only
        once every byte was received and verified: a digest proves nothing."""
        digest = request.path_params["digest"]
        path = self.artifacts.path(digest)
        reader = self._reader(request)
        if (reader is None or self.plane.readable_by(reader, [digest])) and path.exists():
            size = 0
            async for chunk in request.stream():
                size += len(chunk)  # drained: it is here, and the caller may read it
            return json_response({"digest": digest, "size": size}, 201)
        stored, size = await self._receive_blob(request, digest, evenly=reader is not None)
        if reader is not None:
            self.plane.grant_to(reader, [stored])
        return json_response({"digest": stored, "size": size}, 201)

    async def _receive_blob(
        self, request: Request, digest: str, *, evenly: bool
    ) -> tuple[str, int]:
        """Stream the body into the store as blob ``digest`` (ArtifactError if
        it is not that). ``evenly``: as long for a blob stored already as for
        a new one (written out and fsynced either way), so that the time
        taken does not tell a user that another stored it."""
        try:
            writer = self.artifacts.writer(digest)
            try:
                async for chunk in request.stream():
                    writer.write(chunk)
                if evenly and os.path.exists(self.artifacts.path(digest)):
                    # What committing a new blob costs; this copy is then
                    # dropped as a duplicate.
                    os.fsync(writer._fd)
                stored = writer.commit()
            except BaseException:
                writer.abort()
                raise
        except OSError as exc:  # a full disk: the server's, not the request's
            log.error("storing blob %s failed: %s", digest, exc)
            raise ApiError(
                503,
                f"the server could not store blob {digest} ({exc.strerror or exc}); "
                "nothing was kept, try again",
            ) from None
        return stored, writer.size

    async def get_blob(self, request: Request) -> ASGIResponse:
        digest = request.path_params["digest"]
        path = self.artifacts.path(digest)
        if role_of(request) == auth.WORKER:
            worker_id = request.header(b"x-gpulayer-worker") or ""
            self._check_owner(request, worker_id)
            if not self.plane.may_fetch(worker_id, digest, self.artifacts):
                raise auth.AuthError(403, f"worker {worker_id or '?'} was not given blob {digest}")
        else:
            reader = self._reader(request)
            if reader is not None and not self.plane.readable_by(reader, [digest]):
                raise ApiError(404, f"no blob {digest} on this server")
        if not path.exists():
            raise ApiError(404, f"no blob {digest} on this server")
        return FileResponse(path, media_type="application/octet-stream")

    # ---- workers ----

    def _check_owner(self, request: Request, worker_id: str) -> None:
        """A worker token may act only for a worker it registered, or one no
        token is bound to (registered while the server ran without auth)."""
        caller = caller_of(request)
        role, digest = caller.role, caller.digest
        if role != auth.WORKER:
            return  # admins (and servers without auth) act for any worker
        owner = self._owners.get(worker_id)
        if owner is not None and owner != digest:
            if not self.plane.has_worker(worker_id):
                # Declared lost since (its stored row went with it): the
                # worker on its home may come back under its id, with
                # another token.
                del self._owners[worker_id]
                return
            if not self._valid(owner):
                # Its token expired or went while it could not say so (no
                # request of its came since): the worker started again on
                # its home, with a new token, takes over from it.
                self._drop_workers_of(owner, "its worker's token expired or was revoked")
                if not self.plane.has_worker(worker_id):
                    return
                # The store refused its removal: it still holds its tasks.
                raise ApiError(503, f"worker {worker_id} could not be removed yet; try again")
            raise auth.AuthError(
                403,
                f"worker {worker_id} was registered with another token; this one cannot act for it",
            )

    async def register(self, request: Request) -> Response:
        body = await read_body(request, RegisterRequest, SMALL_REPORT_MAX)
        caller, token = request.scope[CALLER]
        digest, expires = caller.digest, caller.expires
        if (
            self.auth_enabled
            and token
            and (token not in self._roles or (expires is not None and expires <= time.time()))
        ):
            # Revoked (a revoke empties the cache), or expired, while its body came?
            self._caller(token)
        if body.worker.id:  # coming back under its id: only with the token it had
            self._check_owner(request, body.worker.id)
        running = [(j, a) for j, a in body.running]
        # Stored with the worker, in the same write: kept across a restart.
        info = self.plane.register_worker(
            body.worker, running, adopted=body.adopted, token_digest=digest
        )
        # Whatever its role: a worker an admin's token registered (a local
        # worker a client started) is not for any worker token to act for.
        if digest is not None:
            self._owners[info.id] = digest
        response = json_response(info, 201)
        response.headers[GENERATION] = str(self.plane.generation(info.id))
        return response

    async def unregister(self, request: Request) -> Response:
        worker_id = request.path_params["worker_id"]
        self._check_owner(request, worker_id)
        died = query_int(request, "died", 0, high=1)
        reason = WORKER_DIED if died else WORKER_STOPPED
        generation = query_generation(request)  # a late goodbye to an earlier one does nothing
        gone = self.plane.unregister_worker(worker_id, reason, said=True, generation=generation)
        if gone or generation is None:
            self._owners.pop(worker_id, None)  # its row, binding and all
        return Response(status=204)

    async def heartbeat(self, request: Request) -> Response:
        beat = await read_body(request, HeartbeatRequest, SMALL_REPORT_MAX)
        self._check_owner(request, request.path_params["worker_id"])
        self.plane.heartbeat(
            request.path_params["worker_id"], stopping=beat.stopping, gpus=beat.gpus
        )
        return Response(status=204)

    async def acquire(self, request: Request) -> Response:
        """The worker's long poll. With ``ack`` (what a worker of this version
        sends), deliveries are numbered and re-sent until acknowledged; the
        first one's number is in the ``X-GPUlayer-Seq`` header."""
        worker_id = request.path_params["worker_id"]
        self._check_owner(request, worker_id)
        timeout = poll_timeout(request, 30.0)
        numbered = "ack" in request.query
        ack: list[int | None] = [query_int(request, "ack", 0) if numbered else None]
        registration = query_generation(request)
        opened: list[tuple[Delivery, bool, int]] = []

        def subscribe(callback: Callable[[], None]) -> Unsubscribe | None:
            delivery, unsubscribe, generation = self.plane.watch_worker(
                worker_id, callback, numbered=numbered, ack=ack[0], generation=registration
            )
            opened.append((delivery, unsubscribe is None, generation))
            return unsubscribe

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = max(0.0, deadline - loop.time())
            fired = await until_signal(self.plane, subscribe, left, self.closing)
            delivery, at_once, generation = opened[-1]
            if at_once or not fired:
                break
            # A poll left open by a worker process that has since been
            # replaced (same id) gets nothing: its reply may go nowhere.
            taken = (
                self.plane.take_delivery(worker_id, generation)
                if numbered
                else Delivery(0, self.plane.take_instructions(worker_id, generation))
            )
            if taken is None or taken.items or not numbered:
                delivery = taken or delivery
                break
            # The worker's own finished report took them (see task_finished):
            # this poll waits on, acknowledging nothing more.
            ack[0] = None
        return self._deliver(delivery, generation if numbered else None)

    def _deliver(self, delivery: Delivery, generation: int | None) -> Response:
        """The reply: numbered (``generation`` given) or not."""
        self.metrics.observe_dispatch(delivery.items[delivery.resent :], time.time())
        response = json_response(delivery.items)
        if generation is not None:
            response.headers[SEQ] = str(delivery.first)
            response.headers[GENERATION] = str(generation)
        return response

    async def task_started(self, request: Request) -> Response:
        report = await read_body(request, TaskStarted, SMALL_REPORT_MAX)
        self._check_owner(request, report.worker_id)
        self.plane.task_started(report)
        return Response(status=204)

    async def task_logs(self, request: Request) -> Response:
        batch = await read_body(request, LogBatch, LOGS_MAX)
        if role_of(request) == auth.WORKER:
            self._check_runner(request, batch)
        self.plane.append_logs(batch.job_id, batch.attempt, batch.lines, batch.node)
        return Response(status=204)

    def _check_runner(self, request: Request, batch: LogBatch) -> None:
        """A worker token adds lines only to a task placed on a worker while
        that worker was registered with it: not to one a worker ran before
        another token took its id over, nor one of a worker registered
        without auth."""
        digest = caller_of(request).digest
        running_on = self.plane.running_on(batch.job_id, batch.attempt, batch.node)
        if running_on is not None and self._owners.get(running_on) == digest:
            return  # the usual case, answered from memory
        task = f"{f'node {batch.node} of ' if batch.node else ''}attempt {batch.attempt}"
        ran = self.plane.store.task_worker(batch.job_id, batch.attempt, batch.node)
        if ran is None:  # 409: the lines are refused, not the token (see LogSender)
            raise ApiError(409, f"no worker ran {task} of job {batch.job_id}")
        runner, placed = ran
        binding = self.plane.store.last_binding(runner)
        if binding is None or binding[0] != digest or placed < binding[1]:
            raise auth.AuthError(
                403,
                f"{task} of job {batch.job_id} ran on worker {runner}, not while it was "
                "registered with this token; this one cannot add lines to it",
            )

    async def task_rendezvous(self, request: Request) -> Response:
        report = await read_body(request, RendezvousReport, SMALL_REPORT_MAX)
        self._check_owner(request, report.worker_id)
        self.plane.task_rendezvous(
            report.job_id, report.attempt, report.worker_id, report.master_port
        )
        return Response(status=204)

    async def task_finished(self, request: Request) -> Response:
        """Apply a task's result. With ``take=1`` the reply carries what waits
        for the reporting worker now, numbered and acknowledged (``ack``) as
        a long poll's reply is (see :meth:`acquire`): in a stream of short
        jobs, the next task comes with the answer to this report instead of
        in a long poll reply of its own.
        """
        result = await read_body(request, TaskResult, REPORT_MAX, RESULT_ADVICE)
        self._check_owner(request, result.worker_id)
        take = query_int(request, "take", 0, high=1)
        ack = query_int(request, "ack", 0) if "ack" in request.query else None
        registration = query_generation(request)
        delivery = None
        if take:
            # From an earlier registration of the worker: its numbers mean
            # nothing now, and it takes nothing (None).
            delivery = self.plane.finish_and_take(result, registration, ack=ack)
        else:
            self.plane.task_finished(result, yield_to_waiters=False)
        # The waiting client's reply (and a next task's) go before this one.
        await asyncio.sleep(0)
        if not take:
            return json_response([])
        return self._deliver(delivery or Delivery(0, []), registration or 0)

    # ---- admin and operations ----

    async def create_token(self, request: Request) -> Response:
        body = await read_body(request, TokenRequest)
        try:
            auth.check_user(body.role, body.user)
        except GPUlayerError as exc:
            raise ApiError(422, f"invalid request body: {exc}") from None
        expires = None if body.expires_in is None else time.time() + body.expires_in
        token = auth.create_token(
            self.plane.store, body.role, body.name, user=body.user, expires=expires
        )
        reply = TokenResponse(token=token, role=body.role, expires=expires, user=body.user)
        return json_response(reply, 201)

    async def list_tokens(self, request: Request) -> Response:
        return json_response(auth.list_tokens(self.plane.store))

    async def revoke_token(self, request: Request) -> Response:
        token_id = request.path_params["token_id"]
        found = auth.find_token(self.plane.store, token_id)
        if found is None:
            raise ApiError(404, f"no token {token_id} on this server (see GET /api/v1/tokens)")
        hashed, role = found
        # Refused only for the last admin token that does not expire: nothing
        # awaits between the look-up and here, so no other request has
        # revoked it meanwhile.
        if not self.plane.store.delete_token(hashed, keep_last=auth.ADMIN):
            raise ApiError(
                409,
                f"token {token_id} is the last admin token that does not expire: without it "
                "no one could make or revoke tokens once the others expire; make another "
                "admin token first",
            )
        # The cache would honour the token still. Finding its entries means
        # hashing every cached header (one token may be sent in several
        # spellings); emptying it costs each token in use one store read.
        self._roles.clear()
        # The workers it registered can no longer be heard: they go now, so
        # nothing more is placed on them and their tasks are retried or end,
        # and their ids are free for the worker started again with a valid
        # token (the next one on a home adopts the id, see ledger.py).
        self._drop_workers_of(hashed, "its worker's token was revoked")
        log.info("token %s (%s) revoked", token_id, role)
        return Response(status=204)

    # ---- projects (admin) ----

    async def create_project(self, request: Request) -> Response:
        body = await read_body(request, ProjectRequest)
        made = _given(
            lambda: self.plane.create_project(body.name, gpus=body.gpus, slots=body.slots)
        )
        log.info("project %s created", made.name)
        return json_response(made, 201)

    async def list_projects(self, request: Request) -> Response:
        return json_response(self.plane.list_projects())

    async def set_project_quota(self, request: Request) -> Response:
        body = await read_body(request, ProjectQuotaRequest)
        name = request.path_params["name"]
        return json_response(
            _given(lambda: self.plane.set_project_quota(name, gpus=body.gpus, slots=body.slots))
        )

    async def add_project_member(self, request: Request) -> Response:
        name, user = request.path_params["name"], request.path_params["user"]
        return json_response(_given(lambda: self.plane.add_project_member(name, user)))

    async def remove_project_member(self, request: Request) -> Response:
        name, user = request.path_params["name"], request.path_params["user"]
        return json_response(_given(lambda: self.plane.remove_project_member(name, user)))

    async def delete_project(self, request: Request) -> Response:
        name = request.path_params["name"]
        _given(lambda: self.plane.delete_project(name))
        log.info("project %s deleted", name)
        return Response(status=204)

    # ---- usage (any user: the rows it may see) ----

    async def usage(self, request: Request) -> Response:
        return json_response(self.plane.usage(viewer_of(request)))

    def _caller(self, header: str) -> auth.Caller:
        """Who the token in ``header`` is, or AuthError(401). An expired
        token's workers go, as a revoked one's."""
        try:
            return auth.caller_of(self.plane.store, header)
        except auth.TokenExpired as exc:
            self._drop_workers_of(exc.digest, "its worker's token expired")
            raise

    def _valid(self, digest: str) -> bool:
        found = self.plane.store.token_role(digest)
        return found is not None and (found[1] is None or found[1] > time.time())

    def _drop_workers_of(self, digest: str, reason: str) -> None:
        """Remove the workers the token ``digest`` registered: it cannot be
        heard any more. What waits in their inboxes never ran."""
        for worker_id, owner in list(self._owners.items()):
            if owner != digest:
                continue
            try:
                self.plane.unregister_worker(worker_id, reason, said=True)
                del self._owners[worker_id]
            except StoreError:  # the reaper ends it
                # Still bound to the token, so that no other token acts for it.
                self.plane.close_worker(worker_id)
                log.warning("worker %s (%s) stays until it is reaped", worker_id, reason)

    async def health(self, request: Request) -> Response:
        return json_response({"ok": True})

    async def metrics_text(self, request: Request) -> Response:
        # The projects' figures: those the caller may see (as /api/v1/usage).
        body, content_type = self.metrics.render(viewer_of(request))
        return Response(body, media_type=content_type)

    async def openapi(self, request: Request) -> Response:
        from .openapi import document

        return json_response(document())


def _given(call: Callable[[], T]) -> T:
    """A project operation. What it refuses in what it was given (a name, a
    user, a quota; nothing changed) is a 422, as a body that does not decode."""
    try:
        return call()
    except (ProjectNotFound, InvalidStateError, StoreError):
        raise  # 404, 409, 503
    except GPUlayerError as exc:
        raise ApiError(422, str(exc)) from None


def create_app(plane: ControlPlane, artifacts: ArtifactStore, *, auth_enabled: bool = True) -> App:
    api = Api(plane, artifacts, auth_enabled=auth_enabled)
    user, worker, both = (auth.USER,), (auth.WORKER,), (auth.USER, auth.WORKER)
    g = api.guard
    v1 = "/api/v1"
    endpoints = [
        ("GET", "/healthz", g(None, api.health, None)),
        ("GET", "/openapi.json", g(None, api.openapi, None)),
        ("GET", "/metrics", g(user, api.metrics_text, None)),
        ("POST", f"{v1}/jobs", g(user, api.submit)),
        ("GET", f"{v1}/jobs", g(user, api.list_jobs, ("state", "limit", "label", "array"))),
        ("GET", f"{v1}/jobs/{{job_id}}", g(user, api.get_job)),
        ("POST", f"{v1}/jobs/wait", g(user, api.wait_jobs, ("timeout",))),
        ("POST", f"{v1}/jobs/{{job_id}}/wait", g(user, api.wait_job, ("timeout",))),
        ("POST", f"{v1}/jobs/{{job_id}}/cancel", g(user, api.cancel_job)),
        ("GET", f"{v1}/jobs/{{job_id}}/logs", g(user, api.job_logs, ("attempt", "seq", "timeout"))),
        ("GET", f"{v1}/workers", g(user, api.list_workers)),
        ("POST", f"{v1}/workers", g(worker, api.register)),
        ("DELETE", f"{v1}/workers/{{worker_id}}", g(worker, api.unregister, ("died", "gen"))),
        ("POST", f"{v1}/workers/{{worker_id}}/heartbeat", g(worker, api.heartbeat)),
        (
            "POST",
            f"{v1}/workers/{{worker_id}}/acquire",
            g(worker, api.acquire, ("timeout", "ack", "gen")),
        ),
        ("POST", f"{v1}/tasks/started", g(worker, api.task_started)),
        ("POST", f"{v1}/tasks/logs", g(worker, api.task_logs)),
        ("POST", f"{v1}/tasks/rendezvous", g(worker, api.task_rendezvous)),
        ("POST", f"{v1}/tasks/finished", g(worker, api.task_finished, ("take", "ack", "gen"))),
        ("POST", f"{v1}/blobs/missing", g(both, api.missing_blobs)),
        ("PUT", f"{v1}/blobs/{{digest:str}}", g(both, api.put_blob)),
        ("GET", f"{v1}/blobs/{{digest:str}}", g(both, api.get_blob)),
        ("POST", f"{v1}/tokens", g((), api.create_token)),
        ("GET", f"{v1}/tokens", g((), api.list_tokens)),
        ("DELETE", f"{v1}/tokens/{{token_id}}", g((), api.revoke_token)),
        ("POST", f"{v1}/projects", g((), api.create_project)),
        ("GET", f"{v1}/projects", g((), api.list_projects)),
        ("PATCH", f"{v1}/projects/{{name}}", g((), api.set_project_quota)),
        ("DELETE", f"{v1}/projects/{{name}}", g((), api.delete_project)),
        ("PUT", f"{v1}/projects/{{name}}/members/{{user}}", g((), api.add_project_member)),
        ("DELETE", f"{v1}/projects/{{name}}/members/{{user}}", g((), api.remove_project_member)),
        ("GET", f"{v1}/usage", g(user, api.usage)),
        *dashboard_routes(api),  # the web pages, signed in by a session cookie
    ]
    app = App(endpoints)
    app.state["api"] = api
    return app


__all__ = ["create_app"]
