"""A real Chromium (Debian's, driven by Playwright) on a real server with a
real CPU worker: one browser and one server for the whole directory, a
fresh browser context (cookies, storage) for each test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Dialog,
    Page,
    ViewportSize,
    sync_playwright,
)

import gpulayer
from fake_nvml import FILE_ENV, FakeGpu, FakeNvml
from gpulayer.worker.gpus import NVML_MODULE_ENV
from server.conftest import ServerProc, free_port

CHROMIUM = os.environ.get("GPULAYER_TEST_CHROMIUM", "/usr/bin/chromium")
VIEWPORT = ViewportSize(width=1200, height=800)  # the screenshots' size too
WAIT_MS = 30_000  # what an expectation waits at most: polls come every 3 to 5 s


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: install Debian's chromium "
            "(apt-get install chromium) or point GPULAYER_TEST_CHROMIUM at one"
        )
    with sync_playwright() as p:
        # Tests run as root in CI, where Chromium's sandbox refuses to start.
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        try:
            yield launched
        finally:
            launched.close()


def start_server(root: Path, *, slots: int) -> ServerProc:
    """A server and one CPU worker of ``slots`` slots, both on ``root``. The
    worker's zygote preloads nothing (as tests/conftest.py sets per test:
    this runs before its fixtures) and it claims GPUs from no shared file."""
    srv = ServerProc(root / "server-home", free_port())
    srv.start()
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("GPULAYER_PRELOAD", "")
            env.setenv("GPULAYER_GPU_LOCKS", str(root / "gpu-locks"))
            env.delenv("GPULAYER_WARM", raising=False)
            srv.start_worker(root / "worker-home", slots=slots, name="cpu-1")
    except BaseException:
        srv.stop()
        raise
    return srv


TESTS = Path(__file__).resolve().parents[1]


def start_gpu_worker(srv: ServerProc, root: Path, gpus: list[FakeGpu], name: str) -> None:
    """A worker offering the GPUs of a fake NVML (tests/fake_nvml.py), which
    it detects and samples as it would real ones, beside ``srv``'s others."""
    figures = root / f"{name}-nvml.json"
    FakeNvml.write(figures, gpus)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GPULAYER_PRELOAD", "")
        env.setenv("GPULAYER_GPU_LOCKS", str(root / f"{name}-gpu-locks"))
        env.delenv("GPULAYER_WARM", raising=False)
        env.setenv(NVML_MODULE_ENV, "fake_nvml")
        env.setenv(FILE_ENV, str(figures))
        env.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
        srv.start_worker(root / f"{name}-home", gpus="all", name=name)


@dataclass
class Dash:
    """The directory's server, with a user token each for ada and bob."""

    srv: ServerProc
    tokens: dict[str, str]

    @property
    def url(self) -> str:
        return self.srv.url

    def client(self, user: str) -> gpulayer.Client:
        return self.srv.client(self.tokens[user])


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dash]:
    srv = start_server(tmp_path_factory.mktemp("dash"), slots=2)
    try:
        yield Dash(srv, {user: srv.token("user", user) for user in ("ada", "bob")})
    finally:
        srv.stop()


@dataclass
class Watch:
    """What went wrong in a context's pages: script errors, console errors,
    dialogs (an ``alert`` from injected HTML would be one)."""

    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)

    def attach(self, page: Page) -> None:
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        page.on("console", self._console)
        page.on("dialog", self._dialog)

    def allow(self, text: str) -> None:
        """A console error containing ``text`` is expected (Chromium logs
        "Failed to load resource" for a page answered 401 or 404)."""
        self.allowed.append(text)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error" and not any(a in message.text for a in self.allowed):
            self.errors.append(f"console error: {message.text} at {message.location}")

    def _dialog(self, dialog: Dialog) -> None:
        self.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()


@pytest.fixture
def watch() -> Watch:
    return Watch()


def new_context(browser: Browser, url: str, watch: Watch) -> BrowserContext:
    context = browser.new_context(base_url=url, viewport=VIEWPORT)
    context.set_default_timeout(WAIT_MS)
    context.on("page", watch.attach)
    return context


@pytest.fixture
def context(browser: Browser, dash: Dash, watch: Watch) -> Iterator[BrowserContext]:
    ctx = new_context(browser, dash.url, watch)
    try:
        yield ctx
    finally:
        ctx.close()
    assert not watch.errors, "\n".join(watch.errors)
    assert not watch.dialogs, watch.dialogs


@pytest.fixture
def page(context: BrowserContext) -> Page:
    return context.new_page()


def sign_in(page: Page, token: str) -> None:
    """Through the form, as a person would; lands on the overview."""
    page.goto("/signin")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url("**/")


def python_job(code: str) -> list[str]:
    """A job's command: this interpreter running ``code``."""
    return [sys.executable, "-c", code]
