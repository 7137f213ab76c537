"""The web dashboard, in-process: sign-in sessions and their cookie, CSRF on
every form, who sees which job, HTML in names and log lines shown as text,
the static files (hostile paths first), the jobs page's filters and pages;
then one real server."""

from __future__ import annotations

import asyncio
import http.client
import re
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpulayer.access import Viewer
from gpulayer.artifacts import ArtifactStore
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.http.dashboard.session import COOKIE
from gpulayer.jobs import LogLine
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore
from server.conftest import ServerProc

HOST = "gpulayer.test"


class Reply:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @property
    def text(self) -> str:
        return self.body.decode()

    @property
    def location(self) -> str | None:
        return self.headers.get("location")


async def _call(
    app: Any,
    method: str,
    path: str,
    query: str,
    body: bytes,
    headers: Sequence[tuple[str, str]],
    scheme: str,
    port: int,
) -> Reply:
    scope = {
        "type": "http",
        "method": method,
        "scheme": scheme,
        "server": ("127.0.0.1", port),
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [(k.encode(), v.encode()) for k, v in [("host", HOST), *headers]],
    }
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = sent[0]
    got = {k.decode(): v.decode() for k, v in start["headers"]}
    return Reply(start["status"], got, b"".join(m.get("body", b"") for m in sent[1:]))


PORT = 8080  # what the in-process server listens on, as uvicorn's scope says


class Browser:
    """One browser on a dashboard: it keeps the cookies it is given, by name,
    and sends every one back, as a browser does to any port of one host."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.jar: dict[str, str] = {}

    @property
    def cookie(self) -> str | None:
        """The session cookie's value on the usual port (plain HTTP)."""
        return self.jar.get(f"{COOKIE}_{PORT}")

    @cookie.setter
    def cookie(self, value: str) -> None:
        self.jar[f"{COOKIE}_{PORT}"] = value

    def get(self, path: str, query: str = "", **kw: Any) -> Reply:
        return self.request("GET", path, query, **kw)

    def post(self, path: str, form: dict[str, str], **kw: Any) -> Reply:
        return self.request("POST", path, body=urllib.parse.urlencode(form).encode(), **kw)

    def request(
        self,
        method: str,
        path: str,
        query: str = "",
        *,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
        scheme: str = "http",
        port: int = PORT,
    ) -> Reply:
        sent = list(headers)
        if method == "POST" and not any(k == "content-type" for k, _ in sent):
            sent.append(("content-type", "application/x-www-form-urlencoded"))
        if self.jar:
            sent.append(("cookie", "; ".join(f"{k}={v}" for k, v in self.jar.items())))
        reply = asyncio.run(_call(self.app, method, path, query, body, sent, scheme, port))
        cookie = reply.headers.get("set-cookie")
        if cookie is not None:
            name, _, value = cookie.split(";")[0].partition("=")
            if value:
                self.jar[name] = value
            else:
                self.jar.pop(name, None)
        return reply

    def sign_in(self, token: str) -> Reply:
        reply = self.post("/signin", {"token": token})
        assert reply.status == 303, reply.text
        return reply

    def csrf(self, path: str = "/") -> str:
        found = re.search(r'name="csrf" value="([^"]+)"', self.get(path).text)
        assert found is not None, "no CSRF token on the page"
        return found.group(1)


class Dash:
    """A plane behind its app, with tokens for ada, bob, an admin and a worker."""

    def __init__(self, tmp_path: Path, *, auth_enabled: bool = True) -> None:
        self.store = SqliteStore(tmp_path / "db.sqlite")
        self.plane = ControlPlane(self.store, instance_id="s1")
        self.app = create_app(
            self.plane, ArtifactStore(tmp_path / "blobs"), auth_enabled=auth_enabled
        )
        self.tokens = {
            "admin": auth.create_token(self.store, "admin"),
            "ada": auth.create_token(self.store, "user", user="ada"),
            "bob": auth.create_token(self.store, "user", user="bob"),
            "worker": auth.create_token(self.store, "worker"),
        }

    def submit(self, user: str, **spec: Any) -> str:
        made = parse_spec({"command": ["echo", "hi"], **spec})  # no worker: it waits
        return self.plane.submit(made, viewer=Viewer(user)).id

    def browser(self, who: str | None = None) -> Browser:
        b = Browser(self.app)
        if who is not None:
            b.sign_in(self.tokens[who])
        return b


@pytest.fixture
def dash(tmp_path: Path) -> Iterator[Dash]:
    made = Dash(tmp_path)
    try:
        yield made
    finally:
        made.store.close()


def _flags(cookie: str) -> set[str]:
    return {part.strip() for part in cookie.split(";")[1:]}


# ---- signing in and out ----


def test_signin_with_a_good_token_sets_a_strict_session_cookie(dash: Dash) -> None:
    b = dash.browser()
    reply = b.sign_in(dash.tokens["ada"])
    assert reply.location == "/"
    cookie = reply.headers["set-cookie"]
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= _flags(cookie)
    assert "Secure" not in _flags(cookie)  # plain HTTP: a Secure cookie would never come back
    assert dash.tokens["ada"] not in cookie  # a random id, not the token
    page = b.get("/")
    assert page.status == 200, page.text
    assert "ada" in page.text and "Overview" in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'self'")


def test_over_tls_the_cookie_is_secure(dash: Dash) -> None:
    b = dash.browser()
    reply = b.post("/signin", {"token": dash.tokens["ada"]}, scheme="https")
    cookie = reply.headers["set-cookie"]
    assert "Secure" in _flags(cookie)
    # __Host-: the browser keeps it only from a secure page, for this host only.
    assert cookie.startswith(f"__Host-{COOKIE}_{PORT}=")
    assert b.get("/", scheme="https").status == 200
    assert b.get("/").location == "/signin"  # not sent back by name over plain HTTP


def test_two_dashboards_on_one_host_keep_their_own_sessions(tmp_path: Path) -> None:
    """A browser sends a host's cookies to each of its ports: a server's
    dashboard and another on the same machine must not overwrite each
    other's session, nor take one for the other's."""
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    first, second = Dash(tmp_path / "one"), Dash(tmp_path / "two")
    try:
        b = first.browser()
        b.sign_in(first.tokens["ada"])  # on PORT
        b.app = second.app
        assert b.get("/", port=PORT + 1).location == "/signin"  # the first's is not taken
        reply = b.post("/signin", {"token": second.tokens["bob"]}, port=PORT + 1)
        assert reply.headers["set-cookie"].startswith(f"{COOKIE}_{PORT + 1}=")
        assert "bob" in b.get("/", port=PORT + 1).text
        b.app = first.app
        page = b.get("/")
        assert page.status == 200 and "ada" in page.text  # still signed in there
    finally:
        first.store.close()
        second.store.close()


@pytest.mark.parametrize(
    ("token", "status", "words"),
    [
        ("glt_u_not-a-token", 401, "not valid on this server"),
        ("", 401, "paste a token"),
        ("worker", 403, "a worker token cannot sign in"),
    ],
)
def test_a_bad_token_is_refused_in_plain_words(
    dash: Dash, token: str, status: int, words: str
) -> None:
    sent = dash.tokens.get(token, token)
    b = dash.browser()
    reply = b.post("/signin", {"token": sent})
    assert reply.status == status
    assert words in reply.text
    assert "set-cookie" not in reply.headers
    if sent:
        assert sent not in reply.text  # never echoed
    assert b.get("/").location == "/signin"


def test_signin_from_another_site_is_refused(dash: Dash) -> None:
    b = dash.browser()
    reply = b.post(
        "/signin", {"token": dash.tokens["ada"]}, headers=[("origin", "https://evil.example")]
    )
    assert reply.status == 403
    assert "set-cookie" not in reply.headers


def test_a_form_that_is_not_a_form_is_refused(dash: Dash) -> None:
    reply = dash.browser().request(
        "POST", "/signin", body=b"", headers=[("content-type", "application/json")]
    )
    assert reply.status == 415
    big = dash.browser().post("/signin", {"token": "x" * 20_000})
    assert big.status == 413


@pytest.mark.parametrize("path", ["/", "/jobs", "/jobs/abc", "/workers", "/jobs/abc/output"])
def test_pages_redirect_to_signin_without_a_session(dash: Dash, path: str) -> None:
    b = dash.browser()
    assert b.get(path).location == "/signin"
    b.cookie = "forged-session-id"
    assert b.get(path).location == "/signin"


def test_polls_without_a_session_get_401(dash: Dash) -> None:
    job = dash.submit("ada")
    reply = dash.browser().get(f"/jobs/{job}/logs")
    assert reply.status == 401
    assert "sign in" in reply.text


def test_signout_ends_the_session(dash: Dash) -> None:
    b = dash.browser("ada")
    sid = b.cookie
    assert b.post("/signout", {"csrf": "wrong"}).status == 403  # CSRF here too
    reply = b.post("/signout", {"csrf": b.csrf()})
    assert (reply.status, reply.location) == (303, "/signin")
    assert "Max-Age=0" in _flags(reply.headers["set-cookie"])
    b.cookie = sid  # the old cookie, kept by a copy: the server forgot it
    assert b.get("/").location == "/signin"


def test_a_revoked_token_ends_its_sessions(dash: Dash) -> None:
    b = dash.browser("ada")
    assert b.get("/").status == 200
    assert dash.store.delete_token(auth.digest(dash.tokens["ada"]), keep_last=auth.ADMIN)
    assert b.get("/").location == "/signin"


def test_without_auth_the_pages_need_no_signin(tmp_path: Path) -> None:
    open_dash = Dash(tmp_path, auth_enabled=False)
    try:
        job = open_dash.submit("ada")
        b = open_dash.browser()
        assert b.get("/").status == 200
        assert b.post(f"/jobs/{job}/cancel", {}).status == 403  # still CSRF-checked
        reply = b.post(f"/jobs/{job}/cancel", {"csrf": b.csrf(f"/jobs/{job}")})
        assert reply.status == 303
        assert open_dash.plane.get(job).state == "cancelled"
    finally:
        open_dash.store.close()


# ---- cancelling ----


@pytest.mark.parametrize("csrf", [None, "", "wrong-token"])
def test_cancel_without_the_right_csrf_token_does_nothing(dash: Dash, csrf: str | None) -> None:
    job = dash.submit("ada")
    b = dash.browser("ada")
    reply = b.post(f"/jobs/{job}/cancel", {} if csrf is None else {"csrf": csrf})
    assert reply.status == 403
    assert "CSRF" in reply.text
    assert dash.plane.get(job).state == "queued"


def test_cancel_from_another_origin_does_nothing(dash: Dash) -> None:
    job = dash.submit("ada")
    b = dash.browser("ada")
    token = b.csrf(f"/jobs/{job}")
    for headers in ([("origin", "http://evil.example")], [("sec-fetch-site", "cross-site")]):
        assert b.post(f"/jobs/{job}/cancel", {"csrf": token}, headers=headers).status == 403
    assert dash.plane.get(job).state == "queued"


def test_cancel_with_the_csrf_token_cancels(dash: Dash) -> None:
    job = dash.submit("ada")
    b = dash.browser("ada")
    token = b.csrf(f"/jobs/{job}")
    reply = b.post(f"/jobs/{job}/cancel", {"csrf": token}, headers=[("origin", f"http://{HOST}")])
    assert (reply.status, reply.location) == (303, f"/jobs/{job}")
    assert dash.plane.get(job).state == "cancelled"
    assert "Cancel</button>" not in b.get(f"/jobs/{job}").text  # nothing left to cancel


# ---- re-running ----


def test_rerun_submits_the_same_spec_as_the_viewer_s_job(dash: Dash) -> None:
    job = dash.submit("ada", name="again", labels={"k": "v"})
    b = dash.browser("ada")
    token = b.csrf(f"/jobs/{job}")
    assert b.post(f"/jobs/{job}/rerun", {}).status == 403  # no CSRF token: nothing
    assert len(dash.plane.list_jobs()) == 1
    reply = b.post(f"/jobs/{job}/rerun", {"csrf": token})
    assert reply.status == 303 and reply.location != f"/jobs/{job}"
    new = reply.location.rsplit("/", 1)[1]  # type: ignore[union-attr]
    again = dash.plane.get(new)
    assert again.user == "ada" and again.spec == dash.plane.get(job).spec


def test_rerun_of_another_user_s_job_or_one_with_secrets_submits_nothing(dash: Dash) -> None:
    theirs = dash.submit("ada")
    b = dash.browser("bob")
    assert b.post(f"/jobs/{theirs}/rerun", {"csrf": b.csrf()}).status == 404
    secret = dash.submit("bob", secrets={"API_KEY": "s3cret"})
    reply = b.post(f"/jobs/{secret}/rerun", {"csrf": b.csrf()})
    assert reply.status == 409 and "secrets" in reply.text and "s3cret" not in reply.text
    assert "Re-run</button>" not in b.get(f"/jobs/{secret}").text
    assert len(dash.plane.list_jobs()) == 2


def test_another_session_s_csrf_token_does_not_work(dash: Dash) -> None:
    job = dash.submit("ada")
    other = dash.browser("ada").csrf()
    b = dash.browser("ada")
    assert b.post(f"/jobs/{job}/cancel", {"csrf": other}).status == 403
    assert dash.plane.get(job).state == "queued"


# ---- who sees what ----


def test_another_user_s_job_is_a_404_that_says_nothing_of_it(dash: Dash) -> None:
    job = dash.submit("ada", name="ada-secret-experiment")
    bob = dash.browser("bob")
    for path in (f"/jobs/{job}", f"/jobs/{job[:8]}"):
        page = bob.get(path)
        assert page.status == 404
        assert "ada-secret-experiment" not in page.text
    assert bob.get(f"/jobs/{job}/logs").status == 404
    assert "ada-secret-experiment" not in bob.get("/jobs").text
    reply = bob.post(f"/jobs/{job}/cancel", {"csrf": bob.csrf()})
    assert reply.status == 404
    assert dash.plane.get(job).state == "queued"
    # The admin and ada see it.
    assert "ada-secret-experiment" in dash.browser("admin").get(f"/jobs/{job}").text
    assert "ada-secret-experiment" in dash.browser("ada").get("/jobs").text


def test_overview_counts_only_what_a_user_sees(dash: Dash) -> None:
    dash.submit("ada")
    dash.submit("bob")
    dash.submit("bob")
    page = dash.browser("ada").get("/").text
    assert re.search(r'data-state="queued">1<', page), page
    page = dash.browser("admin").get("/").text
    assert re.search(r'data-state="queued">3<', page), page


# ---- HTML shown as text ----

SCRIPT = "<script>alert(1)</script>"


def test_html_in_names_labels_and_logs_is_shown_as_text(dash: Dash) -> None:
    job = dash.submit("ada", name=SCRIPT, labels={"team": '"><img src=x onerror=alert(2)>'})
    line = LogLine(seq=1, ts=0.0, stream="stdout", text="<b>bold</b> & <i onclick=x>")
    dash.plane.append_logs(job, 0, [line])
    b = dash.browser("ada")
    for path in ("/jobs", f"/jobs/{job}"):
        text = b.get(path).text
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
        assert "<script>alert" not in text
        assert "<img src=x" not in text
    job_page = b.get(f"/jobs/{job}").text
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; &lt;i onclick=x&gt;" in job_page
    assert "<b>bold" not in job_page
    # The poll gives lines as JSON data (the script sets them as text).
    polled = b.get(f"/jobs/{job}/logs")
    assert polled.headers["content-type"] == "application/json"
    assert '"text":"<b>bold</b> & <i onclick=x>"' in polled.text


def test_log_poll_gives_the_lines_after_its_cursor(dash: Dash) -> None:
    job = dash.submit("ada")
    dash.plane.append_logs(
        job, 0, [LogLine(seq=i, ts=0.0, stream="stdout", text=f"l{i}") for i in (1, 2, 3)]
    )
    b = dash.browser("ada")
    reply = b.get(f"/jobs/{job}/logs", "attempt=0&seq=2")
    assert reply.status == 200, reply.text
    assert re.findall(r'"text":"(l\d)"', reply.text) == ["l3"]
    for bad in ("seq=-1", "seq=abc", "attempt=1e9", "seq=1&follow=1"):
        assert b.get(f"/jobs/{job}/logs", bad).status == 400


# ---- static files ----


@pytest.mark.parametrize(
    "path",
    [
        "/static/../app.py",
        "/static/..",
        "/static/%2e%2e",
        "/static/%2e%2e%2fapp.py",
        "/static/..%2fapp.py",
        "/static/..%5capp.py",
        "/static/pages.py",
        "/static/__init__.py",
        "/static/",
        "/static//etc/passwd",
        "/static/dashboard.css%00.py",
    ],
)
def test_static_serves_nothing_outside_its_assets(dash: Dash, path: str) -> None:
    reply = dash.browser().get(path)
    assert reply.status == 404, path
    assert b"import" not in reply.body


def test_static_assets_come_with_cache_headers(dash: Dash) -> None:
    b = dash.browser()  # no session needed: the sign-in page uses them
    css = b.get("/static/dashboard.css")
    assert css.status == 200
    assert css.headers["content-type"].startswith("text/css")
    assert "max-age" in css.headers["cache-control"]
    js = b.get("/static/dashboard.js")
    assert js.headers["content-type"].startswith("text/javascript")
    assert b"visibilityState" in js.body
    icon = b.get("/static/favicon.svg")
    assert icon.headers["content-type"] == "image/svg+xml" and b"<script" not in icon.body
    signin = b.get("/signin").text
    assert "/static/dashboard.js?v=" in signin and "/static/favicon.svg?v=" in signin


# ---- the jobs page ----


def _rows(text: str) -> list[str]:
    return re.findall(r'<a href="/jobs/([^"?/]+)"><code>', text)


def test_jobs_page_filters_by_state_and_paginates(dash: Dash) -> None:
    ids = [dash.submit("ada", name=f"job-{i}") for i in range(120)]
    for job in ids[:5]:
        dash.plane.cancel(job)
    b = dash.browser("ada")
    first = b.get("/jobs").text
    assert _rows(first) == ids[::-1][:50]  # newest first
    assert 'rel="next" href="/jobs?page=2"' in first
    assert 'rel="prev"' not in first
    last = b.get("/jobs", "page=3").text
    assert _rows(last) == ids[::-1][100:]
    assert 'rel="next"' not in last
    cancelled = b.get("/jobs", "state=cancelled").text
    assert sorted(_rows(cancelled)) == sorted(ids[:5])


def test_jobs_page_filters_by_user_project_label_and_text(dash: Dash) -> None:
    a = dash.submit("ada", name="resnet-sweep", labels={"team": "vision"})
    b_job = dash.submit("bob", command=["python", "train_bert.py"])
    admin = dash.browser("admin")
    assert _rows(admin.get("/jobs", "user=bob").text) == [b_job]
    assert _rows(admin.get("/jobs", "q=BERT").text) == [b_job]
    assert _rows(admin.get("/jobs", "q=resnet").text) == [a]
    assert _rows(admin.get("/jobs", "label=team%3Dvision").text) == [a]
    assert _rows(admin.get("/jobs", "project=default").text) == [b_job, a]
    assert _rows(admin.get("/jobs", "project=nlp").text) == []
    # The filter's values come back into the form escaped.
    page = admin.get("/jobs", "q=%22%3E%3Cscript%3E").text
    assert 'value="&#34;&gt;&lt;script&gt;"' in page


@pytest.mark.parametrize(
    ("query", "words"),
    [
        ("state=bogus", "unknown state 'bogus'"),
        ("page=0", "page must be a number from 1 to 200"),
        ("page=abc", "page must be a number"),
        ("page=99999999999999999999", "page must be a number"),
        ("label=novalue", "label takes KEY=VALUE"),
        ("q=" + "x" * 201, "over 200 characters"),
        ("admin=1", "unknown query parameter 'admin'"),
    ],
)
def test_jobs_page_refuses_bad_filters_in_plain_words(dash: Dash, query: str, words: str) -> None:
    reply = dash.browser("ada").get("/jobs", query)
    assert reply.status == 400
    assert words in reply.text.replace("&#39;", "'")


def test_a_fragment_is_only_the_live_part(dash: Dash) -> None:
    job = dash.submit("ada")
    b = dash.browser("ada")
    part = b.get("/jobs", "fragment=1")
    assert part.status == 200
    assert "<html" not in part.text and "<table" in part.text
    assert _rows(part.text) == [job]
    assert "x-gpulayer-final" not in b.get(f"/jobs/{job}", "fragment=1").headers
    dash.plane.cancel(job)
    assert b.get(f"/jobs/{job}", "fragment=1").headers["x-gpulayer-final"] == "1"


def test_workers_page_lists_none_before_one_registers(dash: Dash) -> None:
    page = dash.browser("ada").get("/workers")
    assert page.status == 200
    assert "No worker has registered" in page.text


def test_the_api_is_unchanged_beside_the_pages(dash: Dash) -> None:
    b = dash.browser()
    reply = b.get("/api/v1/jobs")
    assert reply.status == 401  # a token, not a cookie, for the API
    b.sign_in(dash.tokens["ada"])
    assert b.get("/api/v1/jobs").status == 401  # the session cookie is no API token


# ---- a real server ----


def test_a_real_server_serves_the_dashboard(server: ServerProc) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(
            "POST",
            "/signin",
            urllib.parse.urlencode({"token": server.admin}),
            {"content-type": "application/x-www-form-urlencoded"},
        )
        reply = conn.getresponse()
        reply.read()
        assert reply.status == 303
        cookie = reply.getheader("set-cookie") or ""
        # The port it listens on names the cookie (uvicorn's scope says it).
        assert cookie.startswith(f"{COOKIE}_{server.port}=") and "HttpOnly" in cookie
        conn.request("GET", "/jobs", headers={"cookie": cookie.split(";")[0]})
        page = conn.getresponse()
        assert page.status == 200
        assert b"<h1>Jobs</h1>" in page.read()
        conn.request("GET", "/static/../app.py")
        refused = conn.getresponse()
        assert refused.status == 404
        assert b"import" not in refused.read()
    finally:
        conn.close()


@pytest.mark.parametrize("name", ["../../db.sqlite", "/etc/passwd", "", "%00"])
def test_an_output_name_is_looked_up_never_joined_to_a_path(dash: Dash, name: str) -> None:
    job = dash.submit("ada")
    reply = dash.browser("ada").get(f"/jobs/{job}/output", urllib.parse.urlencode({"name": name}))
    assert reply.status == 404
    assert "has no output named" in reply.text
    other = dash.browser("bob").get(f"/jobs/{job}/output", "name=x")
    assert other.status == 404 and "has no output" not in other.text  # not even that it exists
