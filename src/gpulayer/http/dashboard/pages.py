"""The dashboard's handlers: a page, a form post, or a poll, each a few lines.

Each goes through :meth:`Dashboard.handler`, which answers for the server
shutting down, finds the session (a page without one redirects to the
sign-in form; a poll gets 401, and the script reloads), checks a POST's
origin and CSRF token, and turns the control plane's errors into plain
pages: a job the viewer may not see is a 404, as one that does not exist.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import FileResponse

from ...access import local_viewer
from ...errors import GPUlayerError, InvalidStateError, JobNotFoundError, StoreError
from ...jobs import STATES
from ..routing import ASGIResponse, BodyTooLarge, Handler, Request, Response
from . import views
from .render import Renderer, redirect, static_response
from .session import (
    Refused,
    Session,
    Sessions,
    check_csrf,
    check_origin,
    clear_cookie,
    set_cookie,
)

if TYPE_CHECKING:
    from ..app import Api

log = logging.getLogger(__name__)
FORM_MAX = 16 * 1024  # bytes of a form's body: a token, a CSRF token
_encoder = msgspec.json.Encoder()

Page = Callable[[Request, Session], Awaitable[ASGIResponse]]


class Dashboard:
    def __init__(
        self, api: Api, *, sign_in_once: str | None = None, detached: bool = False
    ) -> None:
        self.api = api
        self.plane = api.plane
        # ``detached``: this process runs no job (an embedded home's
        # dashboard): what runs and waits is read from the store.
        self.detached = detached
        # Without auth, every request is the server's local user's (as in the API).
        # `gpulayer dashboard` signs in with a one-time secret instead of a token
        # (``sign_in_once``, its sha256: cli/dashboard.py); a server does not.
        self.sessions = Sessions(
            api.plane.store,
            None if api.auth_enabled else local_viewer(),
            once=sign_in_once,
        )
        self.render = Renderer()

    def handler(self, page: Page, *, poll: bool = False, post: bool = False) -> Handler:
        async def endpoint(request: Request) -> ASGIResponse:
            session: Session | None = None
            try:
                if self.api.closing.begun:
                    raise Refused(503, "the server is shutting down; try again in a moment")
                session = self.sessions.of(request)
                if session is None:
                    if poll:
                        return _text(401, "signed out: sign in again")
                    return redirect("/signin")
                if post:
                    check_origin(request)
                    form = await _form(request)
                    check_csrf(session, _field(form, "csrf"))
                return await page(request, session)
            except Refused as exc:
                return self._refused(exc.status, str(exc), session, poll)
            except JobNotFoundError as exc:
                return self._refused(404, str(exc), session, poll)
            except InvalidStateError as exc:
                return self._refused(409, str(exc), session, poll)
            except StoreError as exc:
                log.error("%s %s: %s", request.method, request.scope["path"], exc)
                return self._refused(503, f"{exc}; nothing was changed, try again", session, poll)
            except GPUlayerError as exc:
                return self._refused(400, str(exc), session, poll)

        return endpoint

    def _refused(self, status: int, text: str, session: Session | None, poll: bool) -> Response:
        if poll:
            return _text(status, text)
        title = {404: "Not found", 409: "Not now", 403: "Refused"}.get(status, "Not done")
        return self.render.message(status, title, text, session=session)

    # ---- pages ----

    def _page(
        self, request: Request, name: str, session: Session, final: bool = False, **values: Any
    ) -> Response:
        values.update(session=session, path=request.scope["path"])
        if request.query_value("fragment") == "1":
            return self.render.fragment(name, final, **values)
        return self.render.page(name, **values)

    async def overview(self, request: Request, session: Session) -> ASGIResponse:
        _only(request, "fragment")
        figures = views.overview(
            self.plane,
            session.viewer,
            detached=self.detached,
            dispatch=self.api.metrics.recent_dispatch(),
        )
        return self._page(request, "overview.html", session, **figures)

    async def jobs(self, request: Request, session: Session) -> ASGIResponse:
        _only(request, *views.FILTER_FIELDS, "fragment")
        f = views.job_filter(request)
        found = views.jobs_page(self.plane, session.viewer, f)
        return self._page(
            request,
            "jobs.html",
            session,
            f=f,
            found=found,
            states=STATES,
            title_of=views.title_of,
        )

    async def job(self, request: Request, session: Session) -> ASGIResponse:
        _only(request, "fragment")
        job = self.plane.get(request.path_params["job_id"], session.viewer)
        chunk = None
        if request.query_value("fragment") != "1":
            chunk = views.log_lines(self.plane.logs_after(job.id, (0, 0)))
        return self._page(
            request,
            "job.html",
            session,
            job.done,
            job=job,
            title=views.title_of(job),
            timings=job.timings(),
            timeline=views.timeline(job),
            width=views.TIMELINE_WIDTH,
            logs=chunk,
        )

    async def workers(self, request: Request, session: Session) -> ASGIResponse:
        _only(request, "fragment")
        if self.detached:
            found = views.store_workers(self.plane, session.viewer)
        else:
            found = self.plane.list_workers(session.viewer)
        charts = views.gpu_charts(self.plane, found)  # each GPU's last hour
        return self._page(
            request,
            "workers.html",
            session,
            workers=found,
            charts=charts,
            gpu_figures=views.gpu_figures,
        )

    # ---- polls and files ----

    async def logs(self, request: Request, session: Session) -> ASGIResponse:
        """Log lines after a cursor (``attempt``, ``seq``), as JSON the script shows as text."""
        _only(request, "attempt", "seq")
        job_id = self.plane.resolve(request.path_params["job_id"], session.viewer)
        after = (_number(request, "attempt"), _number(request, "seq"))
        body = _encoder.encode(views.log_lines(self.plane.logs_after(job_id, after)))
        return Response(body, media_type="application/json", headers={"cache-control": "no-store"})

    async def output(self, request: Request, session: Session) -> ASGIResponse:
        """One output file of a job the viewer sees, as a download."""
        _only(request, "name")
        job = self.plane.get(request.path_params["job_id"], session.viewer)
        name = request.query_value("name") or ""
        ref = job.outputs.get(name)
        if ref is None:
            raise Refused(404, f"job {job.id} has no output named {name[:200]!r}")
        if ref.kind != "file":
            raise Refused(400, f"output {name!r} is a folder: fetch it with `gpulayer outputs`")
        path = self.api.artifacts.path(ref.digest)
        if not path.exists():
            raise Refused(404, f"output {name!r} of job {job.id} is no longer stored")
        filename = name.rpartition("/")[2] or "output"
        return FileResponse(
            path,
            media_type="application/octet-stream",
            headers={"x-content-type-options": "nosniff"},
            filename=filename,
        )

    async def static(self, request: Request) -> ASGIResponse:
        return static_response(self.render.static, request.path_params["name"])

    # ---- forms ----

    async def cancel(self, request: Request, session: Session) -> ASGIResponse:
        job = self.plane.cancel(request.path_params["job_id"], session.viewer)
        return redirect(f"/jobs/{urllib.parse.quote(job.id)}")

    async def rerun(self, request: Request, session: Session) -> ASGIResponse:
        """A new job with the spec of this one (as `gpulayer rerun`), the
        viewer's: into its project, by its rules. Refused, changing nothing,
        for a job with secrets (their values are never handed back) or whose
        files are no longer stored."""
        old = self.plane.get(request.path_params["job_id"], session.viewer)
        spec = old.spec
        if spec.secrets:
            raise Refused(
                409,
                f"job {old.id} had secrets, whose values are never handed back: rerun it with "
                f"gpulayer rerun {old.id} --secret NAME; nothing was submitted",
            )
        stored = [ref.digest for ref in spec.inputs.values()]
        stored += [spec.bundle] if spec.bundle is not None else []
        if any(not self.api.artifacts.has(digest) for digest in stored):
            raise Refused(
                409,
                f"job {old.id}'s files are no longer stored (freed since it ran?); "
                "submit it again from its files; nothing was submitted",
            )
        if spec.array_task is not None:  # one task again: an array of that one index
            spec = msgspec.structs.replace(spec, array=[spec.array_task.index], array_task=None)
        job = self.plane.submit(spec, viewer=session.viewer)
        return redirect(f"/jobs/{urllib.parse.quote(job.id)}")

    async def signin_form(self, request: Request) -> ASGIResponse:
        if self.sessions.of(request) is not None:
            return redirect("/")
        secret = request.query_value("token")
        if secret is None:
            return self.render.page("signin.html", session=None, error=None)
        if not self.sessions.takes_links:
            error = (
                "paste the token into the form: one in an address stays in the browser's history"
            )
            return self.render.page("signin.html", 400, session=None, error=error)
        # The printed link: its secret signs in once, and the redirect takes it
        # out of the address bar.
        try:
            session = self.sessions.sign_in(secret)
        except Refused as exc:
            return self.render.page("signin.html", exc.status, session=None, error=str(exc))
        return redirect("/", cookie=set_cookie(request, session))

    async def signin(self, request: Request) -> ASGIResponse:
        try:
            check_origin(request)
            form = await _form(request)
            session = self.sessions.sign_in(_field(form, "token") or "")
        except Refused as exc:
            return self.render.page("signin.html", exc.status, session=None, error=str(exc))
        return redirect("/", cookie=set_cookie(request, session))

    async def signout(self, request: Request, session: Session) -> ASGIResponse:
        self.sessions.sign_out(session)
        return redirect("/signin", cookie=clear_cookie(request))


def _text(status: int, text: str) -> Response:
    return Response(text.encode(), status, media_type="text/plain; charset=utf-8")


def _only(request: Request, *names: str) -> None:
    unknown = sorted(set(request.query) - set(names)) if request.scope["query_string"] else []
    if unknown:
        takes = ", ".join(names) or "none"
        raise Refused(400, f"unknown query parameter {unknown[0][:50]!r}; this page takes {takes}")


def _number(request: Request, name: str) -> int:
    raw = request.query_value(name) or "0"
    if not raw.isdigit() or len(raw) > 18:
        raise Refused(400, f"{name} must be a whole number, got {raw[:20]!r}")
    return int(raw)


async def _form(request: Request) -> dict[str, list[str]]:
    kind = (request.header(b"content-type") or "").partition(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        raise Refused(415, "send this as a form (application/x-www-form-urlencoded)")
    try:
        raw = await request.body(limit=FORM_MAX)
    except BodyTooLarge:
        raise Refused(413, f"the form is over {FORM_MAX // 1024} KiB") from None
    try:
        return urllib.parse.parse_qs(
            bytes(raw).decode(), keep_blank_values=True, strict_parsing=False, max_num_fields=20
        )
    except (UnicodeDecodeError, ValueError):
        raise Refused(400, "the form's body is not valid (UTF-8, at most 20 fields)") from None


def _field(form: dict[str, list[str]], name: str) -> str | None:
    values = form.get(name)
    return values[-1] if values else None
