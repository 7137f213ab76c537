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

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sec_containment_kit import DAEMON_ONLY, cgroups_possible, running
from sec_python import nobody_pythonpath

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


@pytest.fixture(params=["cgroup", "subreaper"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The containment the worker is forced to use (the variable a CI sets)."""
    if request.param == "cgroup" and not cgroups_possible():
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


def _kill(pidfile: Path) -> None:
    """Tidy up after a failed test: the escaped process goes now."""
    if pidfile.exists() and running(pidfile):
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
    assert not running(pidfile), f"the {how} process outlived its job"


def test_a_daemon_ends_when_its_job_is_cancelled(contained: gpulayer.Client, pidfile: Path) -> None:
    job = contained.submit(
        command=[sys.executable, "-c", HOSTILE, "double-fork", "hang", str(pidfile)]
    )
    _wait_for(pidfile)
    job.cancel()
    assert job.wait(timeout=60) == "cancelled"
    assert not running(pidfile), "the daemon outlived its cancelled job"


def test_a_daemon_ends_when_its_job_times_out(contained: gpulayer.Client, pidfile: Path) -> None:
    job = contained.submit(
        command=[sys.executable, "-c", HOSTILE, "double-fork", "hang", str(pidfile)],
        timeout=1.5,
    )
    assert job.wait(timeout=60) == "timed_out"
    assert pidfile.exists(), "the daemon had not started within the timeout"
    assert not running(pidfile), "the daemon outlived its timed-out job"


def test_a_daemon_started_before_the_job_is_placed_is_kept_too(
    contained: gpulayer.Client, pidfile: Path
) -> None:
    """The shell forks at once, well before the worker has moved its process
    into the task's cgroup: what it started is swept in after it."""
    job = contained.submit(
        command=["/bin/sh", "-c", SHELL_FIRST, sys.executable, DAEMON_ONLY, str(pidfile)]
    )
    assert job.wait(timeout=60) == "succeeded", job.info.reason
    assert not running(pidfile), "the daemon the shell started at once outlived its job"


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
    cgroups = cgroups_possible()
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "auto")
    server.start_worker(tmp_path / "w", name="boxed")
    # Its memory is counted from when it is in its task's cgroups (moved
    # there just after it starts: cgroups.py): it allocates once it is.
    burn = (
        "import re, time\n"
        "def boxed():\n"
        "    lines = [l for l in open('/proc/self/cgroup').read().splitlines() if 'gpulayer-' in l]\n"
        "    return all(re.search(r'/t[0-9]+$', l) for l in lines)\n"
        "deadline = time.monotonic() + 30\n"
        "while not boxed() and time.monotonic() < deadline: time.sleep(0.001)\n"
        "x = b'\\x01' * (64 << 20)  # written: a bytearray's zero pages are not\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass"
    )
    with server.client() as client:
        job = client.submit(command=[sys.executable, "-c", burn])
        assert job.wait(timeout=60) == "succeeded", job.info.reason
    cli = [sys.executable, "-m", "gpulayer.cli", "--server", server.url, "--token", server.admin]
    listed = subprocess.run([*cli, "workers"], capture_output=True, text=True, check=True)
    assert re.search(r"boxed\s.*\s(cgroup v2|subreaper)\s", listed.stdout), listed.stdout
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
    if not cgroups_possible():
        pytest.skip("the subreaper cannot tell a dead worker's setsid orphans from others")
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "cgroup")
    worker = server.start_worker(tmp_path / "w", name="doomed", kill_grace=0.5)
    with server.client() as client:
        job = client.submit(
            command=[sys.executable, "-c", HOSTILE, "double-fork", "hang", str(pidfile)]
        )
        _wait_for(pidfile)
        assert running(pidfile)
        worker.kill()
        worker.wait(timeout=30)
        deadline = time.monotonic() + 30
        while running(pidfile):
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
    if not cgroups_possible():
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
    assert running(pidfile), "nothing was left to end"
    server.start_worker(tmp_path / "w", name="heir", kill_grace=0.5)  # once it serves
    assert not running(pidfile), "the daemon outlived its worker and its warden"


def test_a_containment_asked_for_that_cannot_be_had_is_refused_in_plain_words() -> None:
    with pytest.raises(WorkerError, match=r"unknown containment 'jail'.*auto, cgroup, subreaper"):
        acquire_containment("jail")


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a worker as nobody, who may make no cgroup")
def test_cgroups_asked_for_where_none_can_be_made_are_refused(tmp_path: Path) -> None:
    """Forced to cgroups as a user who may make none: it says why, and never
    runs a job unkept."""
    import shutil

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
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    done = subprocess.run(
        [*as_nobody, "/usr/bin/python3.11", "-c", code],
        env={"PYTHONPATH": nobody_pythonpath(), "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "containment by cgroup v2 is not possible" in done.stderr, done.stderr


# Each pass makes one orphan that writes "<pid> <start time>" and exits:
# half plainly (``(cmd &)``: the subshell exits before its child), half in a
# session of its own, which no task's session or group names. Then the job
# waits for the test's go (a file) and exits 7.
ORPHAN = 'read -r stat < /proc/$$/stat; set -- $stat; echo "$1 ${22}" >> "$0"'
ORPHANS = r"""
pids=$1 go=$2 n=$3 orphan=$4
i=0
while [ $i -lt $n ]; do
    (sh -c "$orphan" "$pids" &)
    (setsid sh -c "$orphan" "$pids" &)
    i=$((i + 2))
done
echo made
while [ ! -e "$go" ]; do sleep 0.05; done
exit 7
"""


def _still_there(pid: int, start: str) -> bool:
    """Whether process ``pid`` that started at ``start`` is not reaped yet
    (running, or a zombie); a pid reused since has another start time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[19] == start


def _zombie_of(pid: int, worker: int) -> str:
    """How process ``pid`` looks, for a message."""
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        held = "the worker's" if int(fields[1]) == worker else f"process {fields[1]}'s"
        return f"{pid}: state {fields[0]}, {held}"
    return f"{pid}: gone"


def test_a_running_jobs_orphans_are_reaped_while_it_runs(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subreaper mode: a job's orphans come back to the worker as they exit,
    and each dead one held a pid until the job ended (500 ``(true &)`` made
    500 zombies; at scale, the machine's pid table runs out for every
    user). They are reaped while the job still runs, and neither the task's
    own exit status nor that of the host program's children is taken."""
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "subreaper")
    worker_pid = os.getpid()  # an embedded worker: this process
    # The host program's own children, dead before and while the job runs,
    # that it has not waited for yet: one in its session, one in its own.
    host_children = [
        subprocess.Popen(["sh", "-c", "exit 5"]),
        subprocess.Popen(["sh", "-c", "exit 6"], start_new_session=True),
    ]
    try:
        for child in host_children:
            deadline = time.monotonic() + 30
            while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                assert time.monotonic() < deadline, "a host child never exited"
                time.sleep(0.01)  # polled with a deadline: another process exits
        pids, go, count = tmp_path / "orphans", tmp_path / "go", 200
        with gpulayer.Client(home=home) as client:
            client.ensure_local_workers(1, kill_grace=0.5)
            assert client.workers()[0].containment == SUBREAPER
            job = client.submit(
                command=["sh", "-c", ORPHANS, "sh", str(pids), str(go), str(count), ORPHAN]
            )
            try:
                deadline = time.monotonic() + 60
                while "made" not in job.logs() or len(pids.read_text().splitlines()) < count:
                    assert time.monotonic() < deadline, f"the job made no orphans: {job.info}"
                    time.sleep(0.02)  # polled with a deadline: the job and its orphans write
                orphans = [line.split() for line in pids.read_text().splitlines()]
                assert len(orphans) == count
                # Each has exited (or soon will): none may stay unreaped, the
                # worker's zombie, holding its pid.
                deadline = time.monotonic() + 10
                while held := [p for p, start in orphans if _still_there(int(p), start)]:
                    assert time.monotonic() < deadline, (
                        f"{len(held)} of the running job's {count} orphans are not reaped while "
                        f"it runs: {[_zombie_of(int(p), worker_pid) for p in held[:3]]}"
                    )
                    time.sleep(0.02)  # polled with a deadline: the worker reaps them
                assert job.info.state == "running", "the job ended before its orphans were checked"
            finally:
                go.touch()
            assert job.wait(timeout=60) == "failed"
            assert job.info.exit_code == 7, job.info  # its own exit status, not taken by the reaper
    finally:  # waited for here, whatever happened above
        statuses = [child.wait(timeout=10) for child in host_children]
    assert statuses == [5, 6], "the worker took the exit status of a child of its host program"


@pytest.mark.parametrize("act", ["move", "kill", "warden"])
def test_a_pid_reused_after_the_sweep_listed_it_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, act: str
) -> None:
    """cgroups: the worker (root) lists what a task's process started in
    ``worker/`` before its move, then moves each into the task's cgroup,
    kills it (a fork storm), or, in the warden, ends it. Each by pid: were
    one to exit and its pid go to an unrelated process in between, that
    process would be moved into the task's cgroup (and killed with it) or
    killed. Pid reuse cannot be raced in a test: the listing is made stale
    here instead, naming a process of another session that was never in
    ``worker/`` and born after the task's start, as a reused pid's would
    be. It is neither moved nor signalled."""
    if not cgroups_possible():
        pytest.skip("no writable cgroup v2 hierarchy here")
    from gpulayer.worker import cgroups
    from gpulayer.worker.process import spawn

    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        where = Path(f"/proc/{bystander.pid}/cgroup").read_text()
        containment = acquire_containment("cgroup")
        try:
            assert isinstance(containment, cgroups.CgroupContainment)
            listed = cgroups._pids_here
            stale = [bystander.pid]

            def listing(cgroup: Path) -> list[int]:
                found = listed(cgroup)
                if cgroup == containment.spawner and stale:
                    found.append(stale.pop())  # listed once, as if it were there
                return found

            monkeypatch.setattr(cgroups, "_pids_here", listing)
            if act == "kill":
                monkeypatch.setattr(cgroups, "_SWEEP_MOVE_ROUNDS", 0)
            box = containment.box()
            assert isinstance(box, cgroups.CgroupBox)
            task = spawn(["sleep", "120"], cwd=tmp_path, env={})
            try:
                if act == "warden":
                    containment.end_left(0.0)  # as a dead worker's warden would
                else:
                    # Born after the task's start, as a reused pid is: since=0.
                    record = containment.begin(box)
                    record.since = 0
                    containment.started(record, task.pid)
                    try:
                        containment.place(record)
                    finally:
                        containment.finish(record)
            finally:
                task.kill()
                task.wait()
                for pipe in (task.stdout, task.stderr):
                    assert pipe is not None
                    pipe.close()
                box.close()
        finally:
            release_containment(containment)
        assert bystander.poll() is None, f"the sweep ({act}) killed a process not the task's"
        assert Path(f"/proc/{bystander.pid}/cgroup").read_text() == where, (
            f"the sweep ({act}) moved a process not the task's into the task's cgroup"
        )
    finally:
        bystander.kill()
        bystander.wait()


def test_where_the_kernel_has_no_cgroup_kill_each_process_is_killed_in_turn(
    tmp_path: Path,
) -> None:
    """Before Linux 5.14 (no ``cgroup.kill``) a task's cgroup is ended one
    process at a time, each by a pidfd taken once it is known to be there:
    one that ignores SIGTERM still goes."""
    if not cgroups_possible():
        pytest.skip("no writable cgroup v2 hierarchy here")
    from gpulayer.worker import cgroups

    containment = acquire_containment("cgroup")
    try:
        assert isinstance(containment, cgroups.CgroupContainment)
        containment.has_kill = False
        box = containment.box()
        stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(120)"
        proc = box.spawn([sys.executable, "-c", stubborn], cwd=tmp_path, env={})
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline() == b"up\n"
        box.end(0.0)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        proc.stdout.close()
        proc.stderr.close()
        box.close()
    finally:
        release_containment(containment)
