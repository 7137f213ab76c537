"""The dashboard in a real browser (Debian's Chromium through Playwright),
against a real server and a real CPU worker: signing in, a running job's
log lines arriving while its page is open, cancelling it from the page, a
waiting job's reason, HTML in names, labels and logs staying text, one user
seeing nothing of another's jobs; and the screenshots docs/dashboard.md
shows. Every page's script errors, console errors and dialogs fail the test
(the ``context`` fixture).

A worker's GPUs come from a fake NVML (tests/fake_nvml.py) that its
process loads in place of pynvml: it detects and samples them as real ones.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect

from browser.conftest import (
    WAIT_MS,
    Dash,
    Watch,
    new_context,
    python_job,
    sign_in,
    start_gpu_worker,
    start_server,
)
from fake_nvml import FakeGpu

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"

# A job that prints, waits for the test to create a file, prints again and
# then waits for a second file (or for ever): its lines come when the test says.
STEPPED = (
    "import os, sys, time\n"
    "first, second = sys.argv[1:3]\n"
    "print(sys.argv[3], flush=True)\n"
    "while not os.path.exists(first): time.sleep(0.05)\n"
    "print(sys.argv[4], flush=True)\n"
    "while not os.path.exists(second): time.sleep(0.05)\n"
)


def stepped(tmp_path: Path, before: str, after: str) -> tuple[list[str], Path, Path]:
    go, end = tmp_path / "go", tmp_path / "end"
    return [*python_job(STEPPED), str(go), str(end), before, after], go, end


# ---- signing in ----


def test_a_bad_token_is_refused_in_plain_words(page: Page, watch: Watch) -> None:
    watch.allow("401")  # Chromium logs the refused form post's status
    for token in ("glt_u_not-a-token", "<img src=x onerror=alert(1)>"):
        page.goto("/signin")
        page.fill("#token", token)
        page.click("button[type=submit]")
        expect(page.get_by_role("alert")).to_have_text(
            "that token is not valid on this server (revoked, or mistyped)"
        )
        assert page.locator("img[src=x]").count() == 0
        assert page.context.cookies() == []
    # Signed out, every page leads to the form.
    page.goto("/jobs")
    expect(page).to_have_url(re.compile(r"/signin$"))


def test_sign_in_with_a_user_token_and_the_cookie_is_out_of_scripts_reach(
    page: Page, dash: Dash
) -> None:
    sign_in(page, dash.tokens["ada"])
    expect(page.locator("header .who")).to_have_text("ada")
    expect(page.get_by_role("link", name="Jobs")).to_be_visible()

    [cookie] = page.context.cookies()
    assert cookie["name"] == f"gpulayer_session_{dash.srv.port}"  # one per port
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert cookie["secure"] is False  # plain HTTP here; Secure over TLS (tests/server)
    assert page.evaluate("document.cookie") == ""

    page.click("header button:has-text('Sign out')")
    expect(page).to_have_url(re.compile(r"/signin$"))
    assert page.context.cookies() == []


# ---- a running job: its logs, then cancelling it ----


def test_log_lines_arrive_live_and_cancel_from_the_page(
    page: Page, dash: Dash, tmp_path: Path
) -> None:
    command, go, _ = stepped(tmp_path, "first line, before the file", "second line, after it")
    with dash.client("ada") as ada:
        job = ada.submit(command=command, name="follow-me")
        sign_in(page, dash.tokens["ada"])
        page.goto(f"/jobs/{job.id}")
        log = page.locator("#log")
        expect(log).to_contain_text("first line, before the file", timeout=WAIT_MS)
        expect(page.locator(".summary .state")).to_have_text("running")
        assert "second line" not in log.inner_text()  # the job waits for the file

        # The page stays loaded: what comes next comes by the script's polls.
        page.evaluate("window.stillThisPage = true")
        go.touch()
        expect(log).to_contain_text("second line, after it", timeout=WAIT_MS)
        assert page.evaluate("window.stillThisPage") is True
        assert log.inner_text().count("first line") == 1  # each line once

        page.get_by_role("button", name="Cancel").click()
        expect(page.locator(".summary .state")).to_have_text("cancelled", timeout=WAIT_MS)
        expect(page.get_by_role("button", name="Cancel")).to_have_count(0)
        assert job.refresh().state == "cancelled"


def test_a_waiting_job_shows_its_reason(page: Page, dash: Dash) -> None:
    with dash.client("ada") as ada:
        job = ada.submit(command=python_job("pass"), gpus=4, name="needs-four-gpus")
        try:
            reason = job.refresh().reason
            assert reason and "no worker has that many" in reason, reason
            sign_in(page, dash.tokens["ada"])
            page.goto("/jobs?state=queued")
            row = page.locator("table.jobs tr", has=page.locator(f"a[href='/jobs/{job.id}']"))
            expect(row.locator(".reason")).to_have_text(reason)
            expect(row.locator(".state")).to_have_text("queued")

            row.locator(f"a[href='/jobs/{job.id}']").click()
            expect(page.locator(".summary .reason")).to_have_text(reason)
            expect(page.locator(".summary dt", has_text="why it waits")).to_be_visible()
        finally:
            job.cancel()


# ---- hostile text ----

NAME = "<img src=x onerror=alert(1)>"
LABEL = "<b id=injected>bold</b>"
LINES = ("<script>alert(2)</script>", "<img src=x onerror=alert(3)>")


def test_html_in_names_labels_and_logs_stays_text(
    page: Page, dash: Dash, watch: Watch, tmp_path: Path
) -> None:
    command, go, end = stepped(tmp_path, *LINES)
    with dash.client("ada") as ada:
        job = ada.submit(command=command, name=NAME, labels={"note": LABEL})
        sign_in(page, dash.tokens["ada"])

        # The name as the text filter too: it comes back as the box's value.
        page.goto(f"/jobs?q={urllib.parse.quote(NAME)}")
        expect(page.locator("input[name=q]")).to_have_value(NAME)
        row = page.locator("table.jobs tr", has=page.locator(f"a[href='/jobs/{job.id}']"))
        expect(row.locator(".name")).to_have_text(NAME)
        expect(row.locator(".label")).to_have_text(f"note={LABEL}")

        page.goto(f"/jobs/{job.id}")
        expect(page.locator("h1")).to_contain_text(NAME)
        expect(page.locator(".spec .label")).to_have_text(f"note={LABEL}")
        log = page.locator("#log")
        expect(log).to_contain_text(LINES[0], timeout=WAIT_MS)  # as the page came, or polled
        go.touch()
        expect(log).to_contain_text(LINES[1], timeout=WAIT_MS)  # polled: set by the script
        end.touch()
        # It ends: the live part is replaced once more, from HTML the server sent.
        expect(page.locator(".summary .state")).to_have_text("succeeded", timeout=WAIT_MS)

        for where in (f"/jobs/{job.id}", f"/jobs?q={urllib.parse.quote(NAME)}"):
            if where != page.url.removeprefix(dash.url):
                page.goto(where)
            assert page.locator("img[src=x]").count() == 0, where
            assert page.locator("#injected").count() == 0, where
            assert page.locator("main script").count() == 0, where
        assert watch.dialogs == []


# ---- one user, another's jobs ----


def test_another_user_sees_no_trace_of_a_job(
    browser: Browser, page: Page, dash: Dash, tmp_path: Path
) -> None:
    command, _, _ = stepped(tmp_path, "ada's secret line", "and another")
    with dash.client("ada") as ada:
        job = ada.submit(command=command, name="ada-private-run")
        try:
            sign_in(page, dash.tokens["ada"])  # ada sees it, running, on every page
            page.goto(f"/jobs/{job.id}")
            expect(page.locator("#log")).to_contain_text("ada's secret line", timeout=WAIT_MS)
            page.goto("/workers")
            expect(page.locator("table.workers")).to_contain_text(job.id)

            bob_watch = Watch()
            bob_watch.allow("404")
            bob = new_context(browser, dash.url, bob_watch)
            try:
                seen = bob.new_page()
                sign_in(seen, dash.tokens["bob"])
                for path in ("/", "/jobs", "/workers", "/jobs?q=ada-private-run"):
                    seen.goto(path)
                    text = seen.locator("main").inner_text()
                    assert job.id not in text and "ada-private-run" not in text, path
                for path in (f"/jobs/{job.id}", f"/jobs/{job.id}/logs?attempt=0&seq=0"):
                    reply = seen.goto(path)
                    assert reply is not None and reply.status == 404, path
                    body = seen.content()
                    assert "ada-private-run" not in body and "secret line" not in body, path
            finally:
                bob.close()
            assert not bob_watch.errors and not bob_watch.dialogs
        finally:
            job.cancel()


# ---- a worker's GPUs ----

HOSTILE_GPU = "<img src=x onerror=alert(1)>"  # a GPU name is the worker's word


def test_a_workers_gpus_with_their_figures_and_a_gpu_job_s_dispatch(
    browser: Browser, watch: Watch, tmp_path: Path
) -> None:
    srv = start_server(tmp_path, slots=1)
    try:
        start_gpu_worker(
            srv,
            tmp_path,
            [
                FakeGpu(name=HOSTILE_GPU, uuid="GPU-fa4e0000", utilization=42),
                FakeGpu(uuid="GPU-fa4e0001", utilization=87, temperature=71, power_mw=312_000),
            ],
            name="gpu-1",
        )
        token = srv.token("user", "ada")
        with srv.client(token) as ada:
            job = ada.submit(command=python_job("print('on a GPU')"), gpus=1, name="gpu-job")
            assert job.wait(timeout=60) == "succeeded"
        context = new_context(browser, srv.url, watch)
        try:
            page = context.new_page()
            sign_in(page, token)
            # Placed and dispatched by the server: its latency is on the overview.
            expect(page.locator("[data-figure=dispatch]")).to_have_text(re.compile(r"\d ms$"))
            expect(page.locator("[data-figure=gpus-held]")).to_have_text("0")
            expect(page.locator("main")).to_contain_text("of 2 GPUs held")

            page.goto("/workers")
            row = page.locator("table.workers tbody tr", has_text="gpu-1")
            expect(row).to_contain_text(f"0: {HOSTILE_GPU}")  # as text, never a tag
            figures = row.locator("td").nth(4)
            expect(figures).to_contain_text("0: 42% 20.0/80.0 GiB 55 °C 250 W")
            expect(figures).to_contain_text("1: 87% 20.0/80.0 GiB 71 °C 312 W")
            # A sample every 5 s: two make each GPU's line of the last hour.
            expect(figures.locator("svg.spark polyline")).to_have_count(2, timeout=WAIT_MS)
            assert page.locator("img[src=x]").count() == 0
            cpu = page.locator("table.workers tbody tr", has_text="cpu-1")
            expect(cpu.locator("td").nth(3)).to_have_text("none")
        finally:
            context.close()
    finally:
        srv.stop()
    assert not watch.errors, "\n".join(watch.errors)
    assert not watch.dialogs, watch.dialogs


# ---- screenshots for docs/dashboard.md ----


@pytest.fixture
def showcase(tmp_path: Path) -> Iterator[Dash]:
    """A server of its own, so the pictures show these jobs and only these."""
    srv = start_server(tmp_path, slots=2)
    try:
        gpus = [
            FakeGpu(name="NVIDIA H100 80GB HBM3", uuid=f"GPU-5c0e000{i}", utilization=u)
            for i, u in enumerate((91, 64))
        ]
        start_gpu_worker(srv, tmp_path, gpus, name="gpu-1")
        yield Dash(srv, {"ada": srv.token("user", "ada")})
    finally:
        srv.stop()


TRAIN = (
    "import os, sys, time\n"
    "epochs = int(sys.argv[sys.argv.index('--epochs') + 1])\n"
    "for epoch in range(1, epochs + 1):\n"
    "    print(f'epoch {epoch}/{epochs}  loss {1.0 / epoch:.3f}  \\x1b[32mok\\x1b[0m', flush=True)\n"
    "print('saved checkpoint to out/model.pt', flush=True)\n"
    "while not os.path.exists(os.environ['RELEASE']): time.sleep(0.05)\n"
)


def test_screenshots_for_the_docs(
    browser: Browser, showcase: Dash, watch: Watch, tmp_path: Path
) -> None:
    dash = showcase
    release = tmp_path / "release"
    with dash.client("ada") as ada:
        done = ada.submit(
            command=python_job("print('evaluating'); print('accuracy 0.93')"),
            name="eval-baseline",
            labels={"team": "vision"},
        )
        done.wait(timeout=60)
        project = tmp_path / "project"
        project.mkdir()
        (project / "train.py").write_text(TRAIN)
        running = ada.submit(
            project / "train.py",
            ["--epochs", "5", "--lr", "3e-4"],
            env={"RELEASE": str(release)},
            name="train-resnet50",
            labels={"team": "vision", "sweep": "lr-3e-4"},
        )
        ada.submit(command=python_job("pass"), gpus=8, name="pretrain-large")
        context = new_context(browser, dash.url, watch)
        try:
            page = context.new_page()
            sign_in(page, dash.tokens["ada"])
            page.goto(f"/jobs/{running.id}")
            expect(page.locator("#log")).to_contain_text("saved checkpoint", timeout=WAIT_MS)
            expect(page.locator("#log .ansi-32")).to_have_text(["ok"] * 5)  # ANSI green

            # Into docs/ only when asked (GPULAYER_SCREENSHOTS=1): each run's
            # ids and times differ, and a test run should not change the tree.
            into = IMAGES if os.environ.get("GPULAYER_SCREENSHOTS") == "1" else tmp_path
            into.mkdir(parents=True, exist_ok=True)
            shots = {  # each page, and what it must show before its picture is taken
                "overview": ("/", "waiting in the queue"),
                "jobs": ("/jobs", "needs 8 GPUs but no worker has that many"),
                "job": (f"/jobs/{running.id}", "saved checkpoint to out/model.pt"),
                "workers": ("/workers", running.id),
            }
            for name, (path, shows) in shots.items():
                page.goto(path)
                expect(page.locator("main")).to_contain_text(shows, timeout=WAIT_MS)
                shot = into / f"dashboard-{name}.png"
                page.screenshot(path=str(shot), full_page=name == "job")  # with its log
                assert shot.read_bytes().startswith(b"\x89PNG"), shot
        finally:
            context.close()
            release.touch()
    assert not watch.errors, "\n".join(watch.errors)
