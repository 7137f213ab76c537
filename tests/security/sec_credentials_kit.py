"""Real servers and workers for the credential and secret tests, with the
worker (and so its jobs) run as a Unix user that is not root where the tests
run as root: root reads every /proc file, so a hostile job must be tried as
an ordinary user to mean anything.

Run as root, workers run as ``nobody`` through ``setpriv``, with
``/usr/bin/python3.11`` (root's own interpreter is under a 0700 home) and the
checkout's sources and installed packages on ``PYTHONPATH``. Run as anyone
else, workers run as that user.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
from sec_python import nobody_pythonpath

import gpulayer

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3.11"
AS_ROOT = os.geteuid() == 0


def _src_path() -> str:
    """Where an interpreter of another user finds gpulayer and its packages."""
    if AS_ROOT:
        return nobody_pythonpath()
    return os.pathsep.join(
        [str(Path(gpulayer.__file__).parents[1]), str(Path(msgspec.__file__).parents[1])]
    )


def job_python() -> str:
    """The interpreter a job of the worker's user can run."""
    return SYSTEM_PYTHON if AS_ROOT else sys.executable


def need_other_user() -> None:
    """Skip unless a worker can run as an ordinary user here."""
    if AS_ROOT and not (shutil.which("setpriv") and os.access(SYSTEM_PYTHON, os.X_OK)):
        pytest.skip(f"running as root, a worker needs setpriv and {SYSTEM_PYTHON} to run as nobody")


def worker_uid() -> int:
    return NOBODY if AS_ROOT else os.getuid()


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A folder the worker's user owns (pytest's tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gpulayer-sec-"))
    try:
        if AS_ROOT:
            os.chown(path, NOBODY, NOBODY)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def own(path: Path, mode: int) -> Path:
    """``path`` owned by the worker's user, with ``mode``."""
    if AS_ROOT:
        os.chown(path, NOBODY, NOBODY)
    os.chmod(path, mode)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def said(proc: subprocess.Popen[str], text: str, timeout: float = 60.0) -> list[str]:
    """``proc``'s stderr lines up to the first containing ``text``; the rest
    of its stderr goes on being collected into the same list."""
    lines: list[str] = []
    found: queue.Queue[bool] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        seen = False
        for line in proc.stderr:
            lines.append(line)
            if not seen and text in line:
                seen = True
                found.put(True)
        if not seen:
            found.put(False)

    threading.Thread(target=read, daemon=True).start()
    try:
        ok = found.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"nothing said {text!r} in {timeout} s: {''.join(lines)}") from None
    assert ok, f"it ended without saying {text!r}:\n{''.join(lines)}"
    return lines


@dataclass
class Cluster:
    """A server (as this user) and workers (as the worker's user)."""

    root: Path  # a shared_dir()
    port: int = field(default_factory=free_port)
    server: subprocess.Popen[str] | None = None
    server_said: list[str] = field(default_factory=list)
    admin: str = ""
    workers: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def home(self) -> Path:
        return self.root / "server-home"

    def start(self) -> None:
        argv = [sys.executable, "-m", "gpulayer.cli", "-v", "--home", str(self.home)]
        argv += ["server", "start", "--port", str(self.port)]
        self.server = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=_env_without_tokens(),
        )
        self.server_said = said(self.server, "serving")
        self.admin = (self.home / "admin-token").read_text().strip()

    def client(self) -> gpulayer.Client:
        return gpulayer.Client(self.url, token=self.admin)

    def token(self, role: str) -> str:
        with self.client() as client:
            transport = client.transport
            return transport.create_token(role, "sec-test")  # type: ignore[attr-defined, no-any-return]

    def get(self, path: str) -> bytes:
        """A raw API answer, as any client reads it."""
        request = urllib.request.Request(
            self.url + path, headers={"Authorization": f"Bearer {self.admin}"}
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return bytes(answer.read())

    def worker_argv(self, name: str, *options: str) -> list[str]:
        home = self.root / f"worker-{name}"
        home.mkdir(exist_ok=True)
        own(home, 0o700)
        argv = [job_python(), "-m", "gpulayer.cli", "-v", "--home", str(home)]
        argv += ["--server", self.url, "worker", "start", "--gpus", "none"]
        argv += ["--name", name, "--kill-grace", "0.5", *options]
        if AS_ROOT:
            argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
        return argv

    def worker_env(self, **extra: str) -> dict[str, str]:
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "PYTHONPATH": _src_path(),
            "GPULAYER_GPU_LOCKS": str(self.root / "gpu-locks"),
        }
        env.update(extra)
        return env

    def start_worker(
        self, name: str, *options: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[str], list[str]]:
        """A worker process, once it serves; and what it says on stderr.
        Without ``env``, a worker token of its own in $GPULAYER_TOKEN."""
        proc = subprocess.Popen(
            self.worker_argv(name, *options),
            env=env or self.worker_env(GPULAYER_TOKEN=self.token("worker")),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.workers.append(proc)
        return proc, said(proc, "serving")

    def stop(self) -> None:
        for proc in [*self.workers, self.server]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.workers, self.server]:
            if proc is None:
                continue
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()


def _env_without_tokens() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_TOKEN")}


@contextmanager
def cluster() -> Iterator[Cluster]:
    with shared_dir() as root:
        found = Cluster(root)
        try:
            found.start()
            yield found
        finally:
            found.stop()


def descendants(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


# A hostile job: for each pid given, it tries what a process of the same user
# can do to read another's secrets, and writes whatever it got under LOOT:
# environment and command line whole; from memory, anything shaped like a
# token (it reads every mapped region it can).
PROBE = r"""
import ctypes, json, os, re, sys
loot, pids = sys.argv[1], [int(p) for p in sys.argv[2:]]
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
tried = {"uid": os.getuid(), "own_env": dict(os.environ)}
shaped = re.compile(rb"glt_[a-z]_[A-Za-z0-9_-]{20,}")

def memory(pid):
    found = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if perms[0] != "r" or end - start > 1 << 28:
                continue
            try:
                mem.seek(start)
                found.update(shaped.findall(mem.read(end - start)))
            except (OSError, OverflowError, ValueError):
                continue
    return b"\n".join(sorted(found))

for pid in pids:
    got = tried[str(pid)] = {}
    for name in ("environ", "cmdline", "mem", "maps"):
        try:
            if name == "mem":
                data = memory(pid)
            else:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    data = f.read(1 << 20)
            with open(os.path.join(loot, f"{pid}.{name}"), "wb") as out:
                out.write(data)
            got[name] = "read"
        except OSError as exc:
            got[name] = exc.strerror
    seized = libc.ptrace(0x4206, pid, None, None)  # PTRACE_SEIZE: attaches, stops nothing
    got["ptrace"] = "attached" if seized == 0 else os.strerror(ctypes.get_errno())
with open(os.path.join(loot, "tried.json"), "w") as out:
    json.dump(tried, out)
print("probed", len(pids))
"""


def loot_of(loot: Path) -> tuple[dict[str, object], bytes]:
    """What the probe tried, and every byte it got."""
    tried = json.loads((loot / "tried.json").read_text())
    got = b"".join(p.read_bytes() for p in sorted(loot.iterdir()))
    return tried, got


def all_command_lines() -> bytes:
    """What `ps` shows any user: every process's command line."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    found.append(f.read())
            except OSError:
                continue  # ended meanwhile
    return b"\n".join(found)
