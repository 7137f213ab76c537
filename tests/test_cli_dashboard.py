"""`gpulayer dashboard`, run for real in a subprocess on the test's home.

The jobs are submitted by an embedded client in this process, as a second
terminal would; the dashboard only looks at them (and cancels one). A
browser is urllib with a cookie jar that does not follow redirects, so each
one is checked where it goes.
"""

from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpulayer
from server.test_dashboard import Dash
from test_cli_actions import SLEEP, started

PY = sys.executable


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    text: str


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # the 303 comes back as the reply, to be checked


class Browser:
    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self._open = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),  # loopback, whatever the environment says
            _NoRedirect(),
            urllib.request.HTTPCookieProcessor(self.jar),
        ).open

    def request(self, path_or_url: str, form: dict[str, str] | None = None) -> Reply:
        url = path_or_url if path_or_url.startswith("http") else self.base + path_or_url
        data = None if form is None else urllib.parse.urlencode(form).encode()
        req = urllib.request.Request(url, data=data)
        if data is not None:
            req.add_header("origin", self.base)  # as a browser sends it with a form
        try:
            with self._open(req, timeout=30) as reply:
                return Reply(reply.status, dict(reply.headers), reply.read().decode())
        except urllib.error.HTTPError as exc:
            with exc:
                return Reply(exc.code, dict(exc.headers), exc.read().decode())

    def csrf(self, path: str) -> str:
        found = re.search(r'name="csrf" value="([^"]+)"', self.request(path).text)
        assert found, f"no CSRF token on {path}"
        return found.group(1)


@dataclass
class Dashboard:
    proc: subprocess.Popen[str]
    link: str  # the printed sign-in link

    @property
    def base(self) -> str:
        return self.link.partition("/signin")[0]

    @property
    def secret(self) -> str:
        return urllib.parse.parse_qs(urllib.parse.urlsplit(self.link).query)["token"][0]

    def stop(self, signum: int = signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(signum)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err


def gl(*args: str, home: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "GPULAYER_HOME": str(home)}
    return subprocess.Popen(
        [PY, "-m", "gpulayer.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture
def dashboard(home: Path) -> Iterator[Dashboard]:
    proc = gl("dashboard", home=home)
    try:
        assert proc.stdout is not None
        link = proc.stdout.readline().strip()  # printed once it listens
        assert link.startswith("http://127.0.0.1:"), (link, proc.poll())
        yield Dashboard(proc, link)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=60)


def test_the_link_signs_in_once_and_shows_the_jobs_of_another_process(
    client: gpulayer.Client, dashboard: Dashboard
) -> None:
    job = client.submit(command=[PY, "-c", "print('hi')"], name="from-the-test")
    job.wait(timeout=60)
    b = Browser(dashboard.base)

    # Hostile first: no session, a wrong secret, the secret in a sign-in form sent
    # from another site.
    assert b.request("/jobs").headers["location"] == "/signin"
    wrong = b.request(f"/signin?token={dashboard.secret[:-1]}x")
    assert wrong.status == 401 and "wrong, or was used already" in wrong.text
    assert b.request("/jobs").headers["location"] == "/signin"

    signed = b.request(dashboard.link)
    assert (signed.status, signed.headers["location"]) == (303, "/")  # the secret leaves the bar
    flags = {f.strip() for f in signed.headers["set-cookie"].split(";")}
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= flags
    page = b.request("/jobs")
    assert page.status == 200
    assert job.id in page.text and "from-the-test" in page.text
    assert b.request("/").status == 200

    # Spent: another browser (or the history) cannot use it again, by link or by form.
    other = Browser(dashboard.base)
    again = other.request(dashboard.link)
    assert again.status == 401 and "used already" in again.text
    assert other.request("/signin", {"token": dashboard.secret}).status == 401
    assert other.request("/jobs").headers["location"] == "/signin"
    assert b.request("/jobs").status == 200  # the signed-in browser stays so

    code, err = dashboard.stop()
    assert code == 0, err
    assert dashboard.secret not in err  # printed once, on stdout only


def test_cancel_on_the_page_ends_a_job_another_process_runs(
    client: gpulayer.Client, dashboard: Dashboard
) -> None:
    job = client.submit(command=SLEEP)
    started(job)
    b = Browser(dashboard.base)
    assert b.request(dashboard.link).status == 303
    path = f"/jobs/{job.id}"
    assert b.request(f"{path}/cancel", {"csrf": "wrong"}).status == 403
    assert job.status == "running"

    reply = b.request(f"{path}/cancel", {"csrf": b.csrf(path)})
    assert (reply.status, reply.headers["location"]) == (303, path)
    assert job.wait(timeout=60) == "cancelled"


def test_no_job_runs_in_the_dashboard(home: Path, dashboard: Dashboard) -> None:
    """It starts no worker: a job submitted while only it is open waits."""
    b = Browser(dashboard.base)
    assert b.request(dashboard.link).status == 303
    # The API is not served: nothing can be submitted through it.
    assert b.request("/api/v1/jobs", {"spec": "{}"}).status == 404
    with gpulayer.Client(home=home, auto_worker=False) as c:
        job = c.submit(command=[PY, "-c", "print('hi')"])
        assert job.status == "queued"
        assert job.id in b.request("/jobs?state=queued").text
        job.cancel()


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "192.168.1.10", "localhost", "127.0.0.1.evil.example", ""]
)
def test_a_host_other_than_loopback_is_refused(home: Path, host: str) -> None:
    proc = gl("dashboard", "--host", host, home=home)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "is not a loopback address" in err and out == ""
    assert not (home / "instances").exists()  # refused before the home was opened


def test_a_server_address_is_refused(home: Path) -> None:
    proc = gl("--server", "http://127.0.0.1:9", "dashboard", home=home)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "open http://127.0.0.1:9/ in a browser" in err and out == ""


def test_a_port_in_use_is_refused_in_plain_words(home: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = gl("dashboard", "--port", str(port), home=home)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1 port {port}" in err and out == ""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_it_cleanly(home: Path, dashboard: Dashboard, signum: int) -> None:
    port = int(dashboard.base.rpartition(":")[2])
    assert Browser(dashboard.base).request("/signin").status == 200
    code, err = dashboard.stop(signum)
    assert code == 0, err
    assert "Traceback" not in err
    assert list((home / "instances").iterdir()) == []  # the home released
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass


def test_a_server_takes_no_token_in_a_link(tmp_path: Path) -> None:
    """Only the dashboard's one-time secret signs in by a link: a server's
    token in an address would stay in the browser's history."""
    dash = Dash(tmp_path)
    try:
        b = dash.browser()
        reply = b.get("/signin", f"token={dash.tokens['admin']}")
        assert reply.status == 400 and "paste the token into the form" in reply.text
        assert "set-cookie" not in reply.headers and b.get("/").location == "/signin"
        assert dash.browser("admin").get("/").status == 200  # the form still signs in
    finally:
        dash.store.close()


def test_the_overview_counts_what_other_processes_run_and_queue(
    client: gpulayer.Client, home: Path, dashboard: Dashboard
) -> None:
    """No job runs in the dashboard's process, so its figures come from the
    store, where the processes that run and queue jobs record them."""
    running = client.submit(command=SLEEP, name="runs-elsewhere")
    started(running)
    with gpulayer.Client(home=home, auto_worker=False) as c:
        waiting = c.submit(command=[PY, "-c", "pass"], name="waits")
        try:
            b = Browser(dashboard.base)
            assert b.request(dashboard.link).status == 303
            page = b.request("/").text
            figure = {
                name: int(value)
                for name, value in re.findall(r'data-figure="([a-z-]+)">(\d+)<', page)
            }
            assert figure["queued"] == 1 and figure["busy"] == 1, figure
            assert re.search(r'data-state="running">1<', page)
            assert re.search(r'data-state="queued">1<', page)
            assert "no task dispatched yet" in page  # no dispatch happens here
            worker = running.refresh().worker
            assert worker is not None
            row = re.search(
                rf"<tr>\s*<td>[^<]*<small><code>{worker}</code>.*?</tr>",
                b.request("/workers").text,
                re.S,
            )
            assert row is not None and running.id in row.group(0)  # on its worker's row
        finally:
            waiting.cancel()
            running.cancel()


def test_an_embedded_overview_counts_an_array_by_its_tasks(
    client: gpulayer.Client, home: Path
) -> None:
    """An array's row never runs: its tasks hold the slots and wait."""
    from gpulayer.access import local_viewer
    from gpulayer.embedded import Embedded
    from gpulayer.home import resolve_home
    from gpulayer.http.dashboard import views

    array = client.submit(command=SLEEP, array=range(3), max_parallel=1)
    first = client.jobs(array=array)[0]
    started(first)
    other = Embedded(resolve_home(home))  # as the dashboard's process reads the home
    try:
        figures = views.overview(other.plane, local_viewer(), detached=True)
        (row,) = figures["usage"]
        assert (row.running, row.waiting, row.slots_held) == (1, 2, 1)
        assert figures["busy"] == 1 and figures["free_slots"] == figures["slots"] - 1
        workers = views.store_workers(other.plane, local_viewer())
        assert [j for w in workers for j in w.running] == [first.id]
    finally:
        other.close()
        array.cancel()
