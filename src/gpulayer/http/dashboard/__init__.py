"""The web dashboard: server-rendered pages over the control plane (ADR-0025).

Served by the API's server on the same port, at ``/`` and beside
``/api/v1``; signed in with a token through a session cookie (session.py).
Pages are Jinja2 templates (views.py shapes what they show, pages.py
handles the requests); a little script (static/dashboard.js) refreshes the
page's live part and follows logs while its tab is visible.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ..routing import Handler
from .pages import Dashboard

if TYPE_CHECKING:
    from ..app import Api


def routes(
    api: Api, *, sign_in_once: str | None = None, detached: bool = False
) -> list[tuple[str, str, Handler]]:
    """The dashboard's routes, for the app's table. ``sign_in_once``: the
    sha256 of a one-time sign-in secret (`gpulayer dashboard`), in place of
    tokens. ``detached``: no job runs in this process (an embedded home's
    dashboard), so what runs and waits is read from the store."""
    d = Dashboard(api, sign_in_once=sign_in_once, detached=detached)
    page = d.handler
    poll = functools.partial(d.handler, poll=True)
    post = functools.partial(d.handler, post=True)
    return [
        ("GET", "/", page(d.overview)),
        ("GET", "/jobs", page(d.jobs)),
        ("GET", "/jobs/{job_id}", page(d.job)),
        ("GET", "/jobs/{job_id}/logs", poll(d.logs)),
        ("GET", "/jobs/{job_id}/output", page(d.output)),
        ("POST", "/jobs/{job_id}/cancel", post(d.cancel)),
        ("POST", "/jobs/{job_id}/rerun", post(d.rerun)),
        ("GET", "/workers", page(d.workers)),
        ("GET", "/signin", d.signin_form),
        ("POST", "/signin", d.signin),
        ("POST", "/signout", post(d.signout)),
        ("GET", "/static/{name}", d.static),
    ]


__all__ = ["routes"]
