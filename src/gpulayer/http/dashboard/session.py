"""Sign-in sessions of the dashboard, and the checks every form post passes.

A browser signs in once with a token (user or admin) and holds a random
session id in a cookie, ``gpulayer_session_<port>``: ``HttpOnly`` (no
script reads it), ``SameSite=Strict`` (no other site's page sends it),
``Path=/``, and ``Secure`` when the request came over TLS, its name then
prefixed ``__Host-`` (which the browser keeps only from a secure page,
for this host alone). The port is in the name because a browser's
cookies are per host, not per port: two dashboards on one machine (a
server and ``gpulayer dashboard``, say) would otherwise each overwrite
the other's session. The session
itself stays in the server's memory: the sha256 of its token (never the
token), a CSRF token, and when it ends. Each request looks the token up
again (two indexed reads), so a revoked or expired token ends its
sessions at their next request. A restart of the server ends every
session: its users sign in again.

An embedded home has no tokens: ``gpulayer dashboard`` (cli/dashboard.py)
prints a sign-in link instead, whose secret signs in one browser, once, as
the home's local user; only the secret's sha256 is kept, in memory.

Every POST carries the session's CSRF token in a form field, compared in
constant time, and is refused when its ``Origin`` (or ``Sec-Fetch-Site``)
says another site sent it: the sign-in form too, which has no session yet.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from http.cookies import CookieError, SimpleCookie

from ...access import Viewer, local_viewer
from ...store import Store
from .. import auth
from ..routing import Request

COOKIE = "gpulayer_session"  # the name's start; see cookie_name
SESSION_S = 12 * 3600.0  # a session ends this long after its sign-in, at the latest
MAX_SESSIONS = 10_000  # past this many, the oldest ends (memory stays bounded)


class Refused(Exception):
    """A request the dashboard answers with ``status`` and a plain message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Session:
    sid: str
    digest: str | None  # the token's sha256; None: a server without auth, or a one-time sign-in
    csrf: str
    expires: float
    viewer: Viewer
    role: str


class Sessions:
    """The signed-in browsers of one server, in memory."""

    def __init__(self, store: Store, local: Viewer | None = None, once: str | None = None) -> None:
        """``local``: the viewer of a server without auth, whose every
        request is signed in already (as the API's are). ``once``: the
        sha256 of the one secret that signs in here (``gpulayer
        dashboard``), once, as the local user; tokens do not then."""
        self._store = store
        self._links = once is not None
        self._once = once
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._local = (
            None
            if local is None
            else Session("", None, secrets.token_urlsafe(32), float("inf"), local, auth.ADMIN)
        )

    @property
    def auth_enabled(self) -> bool:
        return self._local is None

    @property
    def takes_links(self) -> bool:
        """Whether a link (``GET /signin?token=``) may sign in: only with a
        one-time secret, never with a token, which the browser's history
        would keep."""
        return self._links

    def sign_in(self, token: str) -> Session:
        """A new session for ``token``, or Refused(401/403) saying why not."""
        token = token.strip()
        if not token:
            raise Refused(401, "paste a token to sign in")
        if self._links:
            return self._sign_in_once(token)
        caller = self._caller(auth.digest(token))
        if caller is None:
            # Never the token itself: it may be someone's password-like secret.
            raise Refused(401, "that token is not valid on this server (revoked, or mistyped)")
        if caller.viewer is None:
            raise Refused(
                403, f"a {caller.role} token cannot sign in; use a user or an admin token"
            )
        expires = time.time() + SESSION_S
        if caller.expires is not None:
            expires = min(expires, caller.expires)
        return self._add(caller.digest, expires, caller.viewer, caller.role)

    def _sign_in_once(self, secret: str) -> Session:
        once = self._once
        if once is None or not hmac.compare_digest(auth.digest(secret), once):
            raise Refused(
                401,
                "that sign-in link is wrong, or was used already (each one signs in once); "
                "start `gpulayer dashboard` again for a new one",
            )
        self._once = None
        return self._add(None, time.time() + SESSION_S, local_viewer(), auth.ADMIN)

    def _add(self, digest: str | None, expires: float, viewer: Viewer, role: str) -> Session:
        session = Session(
            secrets.token_urlsafe(32), digest, secrets.token_urlsafe(32), expires, viewer, role
        )
        if len(self._by_id) >= MAX_SESSIONS:
            self._by_id.popitem(last=False)
        self._by_id[session.sid] = session
        return session

    def sign_out(self, session: Session) -> None:
        self._by_id.pop(session.sid, None)

    def of(self, request: Request) -> Session | None:
        """The request's valid session (the local one without auth), or None."""
        if self._local is not None:
            return self._local
        sid = cookie_value(request, cookie_name(request))
        session = self._by_id.get(sid) if sid else None
        if session is None:
            return None
        if session.expires <= time.time() or not self._still_valid(session):
            self._by_id.pop(session.sid, None)
            return None
        return session

    def _still_valid(self, session: Session) -> bool:
        """Whether its token is still there, for the same user and role."""
        if session.digest is None:
            return True  # a one-time sign-in's: no token to end it, only its end or sign-out
        caller = self._caller(session.digest)
        return (
            caller is not None and caller.viewer == session.viewer and caller.role == session.role
        )

    def _caller(self, digest: str) -> auth.Caller | None:
        """Who the token with sha256 ``digest`` is (as auth.caller_of tells
        it from a header), or None: no such token, or expired."""
        found = self._store.token_role(digest)
        if found is None:
            return None
        role, expires = found
        if expires is not None and expires <= time.time():
            return None
        return auth.Caller.of(role, digest, expires, self._store.token_user(digest))

    def __len__(self) -> int:
        return len(self._by_id)


def cookie_value(request: Request, name: str) -> str | None:
    raw = request.header(b"cookie")
    if not raw:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except CookieError:
        return None
    morsel = jar.get(name)
    return None if morsel is None else morsel.value


def cookie_name(request: Request) -> str:
    """The session cookie's name on the server that took ``request``: the
    port it listens on (not what the Host header says) in it."""
    server = request.scope.get("server")
    port = server[1] if isinstance(server, tuple | list) and len(server) == 2 else None
    name = f"{COOKIE}_{port}" if isinstance(port, int) else COOKIE
    return f"__Host-{name}" if request.scope.get("scheme") == "https" else name


def set_cookie(request: Request, session: Session) -> str:
    """The ``Set-Cookie`` value that holds ``session`` in the browser."""
    age = max(0, int(session.expires - time.time()))
    return _cookie(request, session.sid, age)


def clear_cookie(request: Request) -> str:
    return _cookie(request, "", 0)


def _cookie(request: Request, value: str, max_age: int) -> str:
    secure = "; Secure" if request.scope.get("scheme") == "https" else ""
    return f"{cookie_name(request)}={value}; Max-Age={max_age}; Path=/; HttpOnly; SameSite=Strict{secure}"


def check_origin(request: Request) -> None:
    """Refuse a POST another site's page sent (Refused 403). Browsers send
    ``Origin`` with every form post; a request without one (curl) passes."""
    site = request.header(b"sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise Refused(403, "this form was sent from another site; it was refused")
    origin = request.header(b"origin")
    if origin is None:
        return
    scheme = request.scope.get("scheme", "http")
    host = request.header(b"host")
    if host is None or origin != f"{scheme}://{host}":
        raise Refused(403, f"this form was sent from {origin}, not from this server; refused")


def check_csrf(session: Session, sent: str | None) -> None:
    """Refuse a POST whose form does not carry the session's CSRF token."""
    if not sent or not hmac.compare_digest(sent.encode(), session.csrf.encode()):
        raise Refused(403, "the form's CSRF token is missing or wrong; reload the page and retry")
