"""A real server process on a free port, and real worker processes, for server-mode tests."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import gpulayer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProc:
    home: Path
    port: int
    heartbeat_timeout: float = 30.0
    proc: subprocess.Popen[str] | None = None
    admin: str = ""
    workers: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpulayer.cli",
                "--home",
                str(self.home),
                "server",
                "start",
                "--port",
                str(self.port),
                "--heartbeat-timeout",
                str(self.heartbeat_timeout),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        assert self.proc.stderr is not None
        said = []
        for line in self.proc.stderr:  # "gpulayer: serving URL" once it listens
            said.append(line)
            if "serving" in line:
                break
        else:
            raise RuntimeError("the server ended before serving:\n" + "".join(said))
        self.admin = (self.home / "admin-token").read_text().strip()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe:
                pipe.close()

    def client(self, token: str | None = None) -> gpulayer.Client:
        return gpulayer.Client(self.url, token=token or self.admin)

    def token(self, role: str, user: str | None = None) -> str:
        """A new token of ``role``; a user token acts as ``user`` (default: carol)."""
        who = ["--user", user or "carol"] if role == "user" or user else []
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpulayer.cli",
                "--server",
                self.url,
                "--token",
                self.admin,
                "token",
                "create",
                "--role",
                role,
                *who,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()

    def start_worker(
        self,
        home: Path,
        *,
        slots: int = 1,
        name: str = "w",
        token: str | None = None,
        gpus: str = "none",  # CPU workers by default: the same on a machine with GPUs
        kill_grace: float = 0.5,
        shell: str | None = None,
    ) -> subprocess.Popen[str]:
        """``shell``: redirections for ``sh`` to apply (``"<&- >&-"`` closes
        stdin and stdout)."""
        env = {**os.environ, "GPULAYER_TOKEN": token or self.admin}
        sizing = ["--gpus", gpus] + (["--slots", str(slots)] if gpus == "none" else [])
        argv = [
            sys.executable,
            "-m",
            "gpulayer.cli",
            "--home",
            str(home),
            "--server",
            self.url,
            "worker",
            "start",
            *sizing,
            "--name",
            name,
            "--kill-grace",
            str(kill_grace),
        ]
        if shell is not None:
            argv = ["sh", "-c", f'exec "$@" {shell}', "sh", *argv]
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.workers.append(proc)
        assert proc.stderr is not None
        said = []
        for line in proc.stderr:  # "gpulayer: worker <id> (...) serving ..." once registered
            said.append(line)
            if "serving" in line:
                return proc
        raise AssertionError("the worker ended before serving:\n" + "".join(said))

    def stop(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)


def worker_start_refused(
    home: Path, url: str, env: dict[str, str], *options: str
) -> subprocess.CompletedProcess[str]:
    """`gpulayer worker start` that must fail to start (or it serves for ever)."""
    argv = [sys.executable, "-m", "gpulayer.cli", "--home", str(home), "--server", url]
    done = subprocess.run(
        [*argv, "worker", "start", *options],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0, done.stderr
    return done


def said(proc: subprocess.Popen[str], text: str, timeout: float = 60.0) -> str:
    """The first line of ``proc``'s stderr containing ``text``; fails after
    ``timeout`` s rather than wait on a process that never says it."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if text in line:
                lines.put(line)
                return
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    try:
        line = lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"nothing said {text!r} in {timeout} s") from None
    assert line is not None, f"it ended without saying {text!r}"
    return line


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProc]:
    srv = ServerProc(tmp_path / "server-home", free_port())
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
