"""Process-tree control with real processes.

Every child announces itself on stdout ("<role> <pid>") once it is ready
(signal handlers installed, session left); the tests block on those lines,
never on a sleep. Whatever a test starts is killed and reaped afterwards.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psutil
import pytest

from gpulayer.worker.process import (
    CREATE_TIME_TOLERANCE_S,
    kill_orphans,
    spawn,
    terminate_tree,
)

GRACE = 0.3

# Waits forever; with IGNORE_TERM set, SIGTERM does not end it either.
SLEEPER = """
import os, signal, sys
if "IGNORE_TERM" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "SETSID" in sys.argv:
    os.setsid()
print(sys.argv[1], os.getpid(), flush=True)
while True:
    signal.pause()
"""

# Starts a SLEEPER grandchild (passing on its own arguments), then waits.
PARENT = """
import os, signal, subprocess, sys
subprocess.Popen([sys.executable, "-c", sys.argv[1], "grandchild", *sys.argv[2:]])
print("child", os.getpid(), flush=True)
while True:
    signal.pause()
"""


class Lines:
    """Reads a child's stdout line by line, failing after a deadline."""

    def __init__(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        self.fd = stream.fileno()
        self.buffer = b""

    def next(self, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.fd], [], [], remaining)[0]:
                raise AssertionError(f"no line within {timeout} s (got {self.buffer!r})")
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise AssertionError(f"EOF before a full line (got {self.buffer!r})")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode()

    def pids(self, *roles: str) -> dict[str, int]:
        """Read one "<role> <pid>" line per role, in whatever order they come."""
        found: dict[str, int] = {}
        while len(found) < len(roles):
            role, pid = self.next().split()
            assert role in roles, role
            found[role] = int(pid)
        return found


class Procs:
    """Starts processes for a test and remembers them for the clean-up."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.popens: list[subprocess.Popen[bytes]] = []
        self.tracked: list[psutil.Process] = []

    def start(self, code: str, *args: str) -> tuple[subprocess.Popen[bytes], Lines]:
        proc = spawn([sys.executable, "-c", code, *args], cwd=self.cwd, env=os.environ)
        self.popens.append(proc)
        return proc, Lines(proc.stdout)

    def track(self, pid: int) -> psutil.Process:
        proc = psutil.Process(pid)
        self.tracked.append(proc)
        return proc

    def clean_up(self) -> None:
        for proc in self.tracked:
            if running(proc):
                proc.kill()
        for popen in self.popens:
            if popen.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait()
            for pipe in (popen.stdout, popen.stderr):
                if pipe is not None:
                    pipe.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    tracker = Procs(tmp_path)
    try:
        yield tracker
    finally:
        tracker.clean_up()


@pytest.fixture(params=["pidfd", "polling"])
def wait_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test both with pidfds and with the fallback used where there are none."""
    if request.param == "polling":
        monkeypatch.delattr(os, "pidfd_open")
    return str(request.param)


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_spawn_runs_in_its_own_session_with_cwd_env_and_no_stdin(
    procs: Procs, tmp_path: Path
) -> None:
    code = textwrap.dedent("""
        import os, sys
        print(os.getcwd(), os.environ["GPULAYER_TEST"], sys.stdin.read() == "")
        print(os.getsid(0) == os.getpid() == os.getpgid(0))
        sys.stderr.write("to stderr")
    """)
    proc = spawn([sys.executable, "-c", code], cwd=tmp_path, env={"GPULAYER_TEST": "yes"})
    procs.popens.append(proc)
    out, err = proc.communicate(timeout=20)
    assert out.decode().split() == [str(tmp_path), "yes", "True", "True"]
    assert err == b"to stderr"


@pytest.mark.usefixtures("wait_mode")
def test_grandchild_ignoring_sigterm_is_killed(procs: Procs) -> None:
    proc, lines = procs.start(PARENT, SLEEPER, "IGNORE_TERM")
    pids = lines.pids("child", "grandchild")
    child, grandchild = procs.track(pids["child"]), procs.track(pids["grandchild"])

    terminate_tree(proc, grace=GRACE)

    assert proc.returncode == -signal.SIGTERM  # the child took SIGTERM and was reaped
    assert not running(child)
    assert not running(grandchild)


def test_terminate_while_another_thread_waits(procs: Procs) -> None:
    # The worker's waiter thread sits in proc.wait() while a cancel ends the tree.
    proc, lines = procs.start(PARENT, SLEEPER, "IGNORE_TERM")
    grandchild = procs.track(lines.pids("child", "grandchild")["grandchild"])
    codes: list[int] = []
    waiter = threading.Thread(target=lambda: codes.append(proc.wait()))
    waiter.start()

    terminate_tree(proc, grace=GRACE)
    waiter.join(timeout=20)

    assert codes == [-signal.SIGTERM] and proc.returncode == -signal.SIGTERM
    assert not running(grandchild)


def test_grandchild_that_left_the_group_is_still_killed(procs: Procs) -> None:
    proc, lines = procs.start(PARENT, SLEEPER, "IGNORE_TERM", "SETSID")
    pids = lines.pids("child", "grandchild")
    grandchild = procs.track(pids["grandchild"])
    assert os.getpgid(grandchild.pid) != proc.pid  # out of reach of killpg

    terminate_tree(proc, grace=GRACE)

    assert proc.returncode == -signal.SIGTERM
    assert not running(grandchild)


def test_process_that_exits_on_sigterm_is_not_killed(procs: Procs, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    code = textwrap.dedent("""
        import os, signal, sys
        def on_term(signum, frame):
            with open(sys.argv[1], "a") as f:
                f.write("SIGTERM\\n")
            os._exit(42)
        signal.signal(signal.SIGTERM, on_term)
        print("child", os.getpid(), flush=True)
        while True:
            signal.pause()
    """)
    proc, lines = procs.start(code, str(marker))
    lines.pids("child")

    started = time.monotonic()
    terminate_tree(proc, grace=5.0)  # a long grace that a clean exit cuts short

    assert proc.returncode == 42  # its own exit, not -SIGKILL
    assert marker.read_text() == "SIGTERM\n"
    assert time.monotonic() - started < 5.0


def test_process_started_during_the_grace_period_is_killed(procs: Procs) -> None:
    # On SIGTERM the child starts a SIGTERM-ignoring helper in its group, too
    # late for the tree read before signalling, and exits; the helper must not
    # outlive it.
    code = textwrap.dedent("""
        import os, signal, subprocess, sys
        def on_term(signum, frame):
            late = subprocess.Popen([sys.executable, "-c", sys.argv[1], "late", "IGNORE_TERM"],
                                    stdout=subprocess.PIPE)
            print(late.stdout.readline().decode(), end="", flush=True)
            os._exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("child", os.getpid(), flush=True)
        while True:
            signal.pause()
    """)
    proc, lines = procs.start(code, SLEEPER)
    lines.pids("child")

    terminate_tree(proc, grace=10.0)  # cut short when the child exits

    assert proc.returncode == 0
    late_pid = lines.pids("late")["late"]
    try:
        late = procs.track(late_pid)
    except psutil.NoSuchProcess:
        return  # killed and already reaped
    assert not running(late)


def test_already_exited_processes_are_no_error(procs: Procs) -> None:
    reaped, _ = procs.start("pass")
    reaped.wait(timeout=20)
    terminate_tree(reaped, grace=GRACE)
    terminate_tree(reaped.pid, grace=GRACE)
    assert reaped.returncode == 0

    # Exited but not yet reaped (a zombie): its own exit status is kept.
    zombie, _ = procs.start("pass")
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)
    terminate_tree(zombie, grace=GRACE)
    assert zombie.returncode == 0


def test_kill_orphans_ends_the_tree_a_dead_worker_left(procs: Procs) -> None:
    # A stand-in worker starts a job in its own session, then dies abruptly.
    worker = textwrap.dedent("""
        import os, subprocess, sys
        subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]],
                         start_new_session=True)
        os._exit(0)
    """)
    before = time.time()  # what a worker records as the start: its clock before the spawn
    proc, lines = procs.start(worker, PARENT, SLEEPER, "IGNORE_TERM")
    pids = lines.pids("child", "grandchild")
    assert proc.wait(timeout=20) == 0
    job, grandchild = procs.track(pids["child"]), procs.track(pids["grandchild"])
    assert job.ppid() != proc.pid  # reparented: no longer anyone we started

    assert kill_orphans(job.pid, before, grace=GRACE) is True

    assert not running(job)
    assert not running(grandchild)


def test_kill_orphans_leaves_a_reused_pid_alone(procs: Procs) -> None:
    _, lines = procs.start(SLEEPER, "child")
    sleeper = procs.track(lines.pids("child")["child"])

    assert kill_orphans(sleeper.pid, sleeper.create_time() - 60, grace=GRACE) is False
    assert running(sleeper)


def test_a_start_time_read_before_the_spawn_matches_psutils(procs: Procs) -> None:
    # psutil adds clock ticks to a boot time in whole seconds: its reading can
    # be up to a second before the worker's clock, never beyond the tolerance.
    before = time.time()
    _, lines = procs.start(SLEEPER, "child")
    sleeper = procs.track(lines.pids("child")["child"])

    assert abs(sleeper.create_time() - before) < CREATE_TIME_TOLERANCE_S - 0.5


def test_gone_process_has_no_orphans(procs: Procs) -> None:
    gone, _ = procs.start("pass")
    gone.wait(timeout=20)
    assert kill_orphans(gone.pid, time.time(), grace=GRACE) is False


def test_a_spawn_that_runs_out_of_descriptors_leaks_none(tmp_path: Path) -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    spawn(
        [sys.executable, "-c", "pass"], cwd=tmp_path, env=os.environ
    ).communicate()  # /dev/null opened
    held: list[int] = []
    try:
        while True:  # fill the table but for two: the first pipe, not the second
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for _ in range(2):
            os.close(held.pop())
        free = _free_fds(soft)
        with pytest.raises(OSError):
            spawn([sys.executable, "-c", "pass"], cwd=tmp_path, env=os.environ)
        assert _free_fds(soft) == free
    finally:
        for fd in held:
            os.close(fd)


def _free_fds(limit: int) -> list[int]:
    free = []
    for fd in range(limit):
        try:
            os.fstat(fd)
        except OSError:
            free.append(fd)
    return free
