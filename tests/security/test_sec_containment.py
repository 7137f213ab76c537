"""Containment: every process a job starts ends when the job ends.

A job that double-forks a ``setsid`` daemon, or starts a ``setsid`` child,
or a child that ignores SIGTERM, left it running after a normal exit, a
cancel and a timeout (a daemon outside the job's session and group, and
not holding its pipes, was out of the worker's reach): on a GPU machine it
kept the GPU the next job was given. Each test here performs one such
escape, then checks, as soon as the job is reported ended, that the
process is gone (a zombie counts: it runs nothing; a pid reused since is
told apart by its start time). Each runs with the worker's cgroup v2
containment and with the subreaper it falls back to; the last one SIGKILLs
a real worker process and waits for its warden to end what the job left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer
from gpulayer import defaults
from gpulayer.errors import WorkerError
from gpulayer.worker.containment import (
    CGROUP,
    SUBREAPER,
    acquire_containment,
    release_containment,
)

# The job's main process starts a process that tries to outlive it (how:
# double-fork, setsid, stubborn), which ignores SIGTERM and SIGHUP, lets go
# of the job's pipes and writes "<pid> <start time>" to the pid file once it
# runs. The main process waits for that, then exits 0 ("exit") or runs on
# ("hang") until it is cancelled or times out.
HOSTILE = r"""
import os, signal, sys, time
how, then, pidfile = sys.argv[1:4]
ready_r, ready_w = os.pipe()

def become_daemon():
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    with open("/proc/self/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    with open(pidfile + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {start}")
    os.rename(pidfile + ".tmp", pidfile)
    os.write(ready_w, b"x")
    while True:
        time.sleep(3600)

if os.fork() == 0:
    if how in ("double-fork", "setsid"):
        os.setsid()
    if how == "double-fork" and os.fork() != 0:
        os._exit(0)
    become_daemon()
os.read(ready_r, 1)
print("started", how, flush=True)
if then == "hang":
    time.sleep(3600)
"""

# The fastest escape: a shell whose first act is to start a setsid process
# (the worker moves a job's process into its cgroup just after it starts:
# this one forks before that), then exits 0 once it runs.
SHELL_FIRST = 'setsid "$0" -c "$1" "$2" & while [ ! -s "$2" ]; do :; done'
DAEMON_ONLY = r"""
import os, signal, sys, time
for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
with open("/proc/self/stat") as f:
    start = f.read().rsplit(")", 1)[1].split()[19]
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {start}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(3600)
"""


def _cgroups_possible() -> bool:
    try:
        containment = acquire_containment("cgroup")
    except WorkerError:
        return False
    release_containment(containment)
    return True


@pytest.fixture(params=["cgroup", "subreaper"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The containment the worker is forced to use (the variable a CI sets)."""
    if request.param == "cgroup" and not _cgroups_possible():
        pytest.skip("no writable cgroup v2 hierarchy here")
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, request.param)
    # A stray that ignores SIGTERM is killed this long after the job exits.
    monkeypatch.setattr(defaults, "PIPE_DRAIN_S", 0.3)
    return str(request.param)


@pytest.fixture
def contained(mode: str, home: Path) -> Iterator[gpulayer.Client]:
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1, kill_grace=0.5)
        (worker,) = client.workers()
        assert worker.containment == {"cgroup": CGROUP, "subreaper": SUBREAPER}[mode]
        yield client


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never written: the job did not start it"
        time.sleep(0.01)  # polled with a deadline: another process writes it


def _running(pidfile: Path) -> bool:
    """Whether the process that wrote ``pidfile`` still runs (a zombie does
    not; a pid reused since has another start time)."""
    pid, start = pidfile.read_text().split()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[19] == start and fields[0] not in ("Z", "X")


def _kill(pidfile: Path) -> None:
    """Tidy up after a failed test: the escaped process goes now."""
    if pidfile.exists() and _running(pidfile):
        os.kill(int(pidfile.read_text().split()[0]), signal.SIGKILL)


@pytest.fixture
def pidfile(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "escaped.pid"
    yield path
    _kill(path)


@pytest.mark.parametrize("how", ["double-fork", "setsid", "stubborn"])
def test_what_a_job_started_ends_when_it_exits(
    contained: gpulayer.Client, pidfile: Path, how: str
) -> None:
    job = contained.submit(command=[sys.executable, "-c", HOSTILE, how, "exit", str(pidfile)])
    assert job.wait(timeout=60) == "succeeded", job.info.reason
    assert not _running(pidfile), f"the {how} process outlived its job"


def test_a_daemon_ends_when_its_job_is_cancelled(contained: gpulayer.Client, pidfile: Path) -> None:
    job = contained.submit(
        command=[sys.executable, "-c", HOSTILE, "double-fork", "hang", str(pidfile)]
    )
    _wait_for(pidfile)
    job.cancel()
    assert job.wait(timeout=60) == "cancelled"
    assert not _running(pidfile), "the daemon outlived its cancelled job"


def test_a_daemon_ends_when_its_job_times_out(contained: gpulayer.Client, pidfile: Path) -> None:
    job = contained.submit(
        command=[sys.executable, "-c", HOSTILE, "double-fork", "hang", str(pidfile)],
        timeout=1.5,
    )
    assert job.wait(timeout=60) == "timed_out"
    assert pidfile.exists(), "the daemon had not started within the timeout"
    assert not _running(pidfile), "the daemon outlived its timed-out job"


def test_a_daemon_started_before_the_job_is_placed_is_kept_too(
    contained: gpulayer.Client, pidfile: Path
) -> None:
    """The shell forks at once, well before the worker has moved its process
    into the task's cgroup: what it started is swept in after it."""
    job = contained.submit(
        command=["/bin/sh", "-c", SHELL_FIRST, sys.executable, DAEMON_ONLY, str(pidfile)]
    )
    assert job.wait(timeout=60) == "succeeded", job.info.reason
    assert not _running(pidfile), "the daemon the shell started at once outlived its job"


def test_the_next_job_runs_once_the_last_ones_processes_are_gone(
    contained: gpulayer.Client, pidfile: Path
) -> None:
    """What a GPU job left would hold the GPU the next job is given: the
    next job on the slot finds nothing of the last one running."""
    first = contained.submit(
        command=[sys.executable, "-c", HOSTILE, "double-fork", "exit", str(pidfile)]
    )
    assert first.wait(timeout=60) == "succeeded"
    pid = pidfile.read_text().split()[0]
    second = contained.submit(
        command=[
            sys.executable,
            "-c",
            "import os, sys\n"
            f"try:\n    state = open('/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]\n"
            "except FileNotFoundError:\n    state = 'gone'\n"
            "print(state)\nsys.exit(0 if state in ('gone', 'Z', 'X') else 3)",
        ]
    )
    assert second.wait(timeout=60) == "succeeded", second.info.reason


def test_a_workers_containment_is_listed_and_a_jobs_use_is_shown(
    server: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``gpulayer workers`` says how each worker keeps its jobs' processes;
    ``gpulayer show`` gives a job's CPU time and peak memory where the
    worker measures them (a cgroup per task)."""
    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    cgroups = _cgroups_possible()
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "auto")
    server.start_worker(tmp_path / "w", name="boxed")
    burn = "import time\nx = bytearray(64 << 20)\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    with server.client() as client:
        job = client.submit(command=[sys.executable, "-c", burn])
        assert job.wait(timeout=60) == "succeeded", job.info.reason
    cli = [sys.executable, "-m", "gpulayer.cli", "--server", server.url, "--token", server.admin]
    listed = subprocess.run([*cli, "workers"], capture_output=True, text=True, check=True)
    assert re.search(r"boxed .* (cgroup v2|subreaper) ", listed.stdout), listed.stdout
    shown = subprocess.run([*cli, "show", job.id], capture_output=True, text=True, check=True)
    if cgroups:
        assert "cgroup v2" in listed.stdout
        cpu = re.search(r"cpu seconds\s+([0-9.]+)", shown.stdout)
        assert cpu and float(cpu.group(1)) >= 0.3, shown.stdout
        peak = re.search(r"peak memory\s+([0-9.]+) MiB", shown.stdout)
        if peak is not None:  # known where a memory controller is at hand
            assert float(peak.group(1)) >= 64, shown.stdout


def test_the_warden_of_a_killed_worker_ends_what_its_job_left(
    server: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pidfile: Path
) -> None:
    """A worker process SIGKILLed (the OOM killer, say) with a job whose
    daemon left its session: its warden ends the daemon too, not only the
    job's tree."""
    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    if not _cgroups_possible():
        pytest.skip("the subreaper cannot tell a dead worker's setsid orphans from others")
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "cgroup")
    worker = server.start_worker(tmp_path / "w", name="doomed", kill_grace=0.5)
    with server.client() as client:
        job = client.submit(
            command=[sys.executable, "-c", HOSTILE, "double-fork", "hang", str(pidfile)]
        )
        _wait_for(pidfile)
        assert _running(pidfile)
        worker.kill()
        worker.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _running(pidfile):
            assert time.monotonic() < deadline, "the daemon outlived its killed worker"
            time.sleep(0.05)  # polled with a deadline: the warden works in another process
        assert job.wait(timeout=60) in ("lost", "failed"), job.info.reason


def test_what_a_worker_and_its_warden_left_is_ended_by_the_next_worker(
    server: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pidfile: Path
) -> None:
    """Worker and warden both SIGKILLed (a kill of the whole service, say):
    the next worker process started in the same place ends the daemon they
    left, before it serves."""
    import psutil

    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    if not _cgroups_possible():
        pytest.skip("only cgroups keep a dead worker's setsid orphans findable")
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "cgroup")
    worker = server.start_worker(tmp_path / "w", name="doomed", kill_grace=0.5)
    with server.client() as client:
        client.submit(command=[sys.executable, "-c", HOSTILE, "double-fork", "hang", str(pidfile)])
        _wait_for(pidfile)
    cmdline = psutil.Process(worker.pid).cmdline()
    (warden,) = [p for p in psutil.Process(worker.pid).children() if p.cmdline() == cmdline]
    warden.kill()  # a zombie until its parent goes: not waited for
    worker.kill()
    worker.wait(timeout=30)
    assert _running(pidfile), "nothing was left to end"
    server.start_worker(tmp_path / "w", name="heir", kill_grace=0.5)  # once it serves
    assert not _running(pidfile), "the daemon outlived its worker and its warden"


def test_a_containment_asked_for_that_cannot_be_had_is_refused_in_plain_words() -> None:
    with pytest.raises(WorkerError, match=r"unknown containment 'jail'.*auto, cgroup, subreaper"):
        acquire_containment("jail")


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a worker as nobody, who may make no cgroup")
def test_cgroups_asked_for_where_none_can_be_made_are_refused(tmp_path: Path) -> None:
    """Forced to cgroups as a user who may make none: it says why, and never
    runs a job unkept."""
    import shutil

    import msgspec

    if shutil.which("setpriv") is None or not os.access("/usr/bin/python3.11", os.X_OK):
        pytest.skip("needs setpriv and /usr/bin/python3.11 to start a worker as nobody")
    home = tmp_path / "nobody-home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    tmp_path.chmod(0o711)
    code = (
        "from gpulayer.worker.containment import acquire_containment\n"
        "acquire_containment('cgroup')\n"
    )
    paths = [str(Path(gpulayer.__file__).parents[1]), str(Path(msgspec.__file__).parents[1])]
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    done = subprocess.run(
        [*as_nobody, "/usr/bin/python3.11", "-c", code],
        env={"PYTHONPATH": os.pathsep.join(paths), "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "containment by cgroup v2 is not possible" in done.stderr, done.stderr
