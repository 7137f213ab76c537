"""Containment while several tasks start at once in one worker process.

A task's process is moved into its cgroup just after it starts; what it
started before that is swept in after it. With one slot per GPU, tasks start
side by side: each sweep must take what is its own task's and nothing of
another's (a process put in the wrong task's cgroup would be killed when
that task ends, and outlive its own), and a stray whose task cannot be told
is killed rather than left out of every cgroup. The first test runs real
jobs side by side; the others place real processes by hand, so that which
spawns overlap is known.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sec_containment_kit import DAEMON_ONLY, cgroups_possible, running

import gpulayer
from gpulayer import defaults
from gpulayer.worker import cgroups
from gpulayer.worker.containment import CGROUP, acquire_containment, release_containment
from gpulayer.worker.process import spawn

# A job's shell starts a setsid daemon as its first act (before the worker
# has moved the shell into its cgroup), waits until it runs, then checks
# that it is in the shell's own cgroup: "same", or "differ" after 10 s.
SIDE_BY_SIDE = r"""
setsid "$0" -c "$1" "$2" &
while [ ! -s "$2" ]; do :; done
daemon=$(cut -d' ' -f1 "$2")
i=0
while [ "$(cat /proc/$daemon/cgroup)" != "$(cat /proc/$$/cgroup)" ]; do
  i=$((i+1)); [ $i -gt 100000 ] && { echo differ; exit 3; }
done
echo same
"""


def test_jobs_started_side_by_side_each_keep_their_own_daemon(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight jobs on four slots of one worker process, each of whose shell
    starts a daemon before it is moved: every daemon ends up in its own
    job's cgroup (never another's), every job succeeds, and no daemon
    outlives its job."""
    if not cgroups_possible():
        pytest.skip("no writable cgroup v2 hierarchy here")
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "cgroup")
    monkeypatch.setattr(defaults, "PIPE_DRAIN_S", 0.3)
    pidfiles = [tmp_path / f"daemon{i}.pid" for i in range(8)]
    try:
        with gpulayer.Client(home=home) as client:
            client.ensure_local_workers(1, slots=4, kill_grace=0.5)
            (worker,) = client.workers()
            assert worker.containment == CGROUP
            jobs = [
                client.submit(
                    command=["/bin/sh", "-c", SIDE_BY_SIDE, sys.executable, DAEMON_ONLY, str(p)]
                )
                for p in pidfiles
            ]
            for job in jobs:
                assert job.wait(timeout=90) == "succeeded", (job.info.reason, job.logs())
                assert job.logs().strip() == "same"
        for p in pidfiles:
            assert not running(p), f"the daemon of {p.name} outlived its job"
    finally:
        for p in pidfiles:
            if p.exists() and running(p):
                os.kill(int(p.read_text().split()[0]), 9)


def test_a_burst_of_jobs_on_four_workers_of_one_process_all_succeed(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 jobs that exit at once, on four workers of one process: their
    processes start side by side, each moved into its cgroup by one thread
    while another's sweep lists ``worker/``. None is taken for another's (it
    would be killed when that one ends) nor killed as a stray of unknown
    task. (Sweeps that did not tell tasks apart lost 8 of 200; one that
    read which tasks were starting before its listing, 1.)"""
    if not cgroups_possible():
        pytest.skip("no writable cgroup v2 hierarchy here")
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "cgroup")
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(4)
        jobs = [client.submit(command=["true"]) for _ in range(200)]
        ended = [(job.wait(timeout=60), job.info.reason) for job in jobs]
    assert [e for e in ended if e[0] != "succeeded"] == []


# A task's process that starts, at once, a sleeper of its own session
# ("child"), or one that forks twice and leaves its session, orphaned before
# the task is placed ("orphan"); either writes its pid to the file named.
CHILD = 'sleep 120 & echo $! > "$0"; wait'
ORPHAN = '(setsid sh -c "echo \\$\\$ > $0; exec sleep 120" &); exec sleep 120'


@pytest.fixture
def containment() -> Iterator[cgroups.CgroupContainment]:
    if not cgroups_possible():
        pytest.skip("no writable cgroup v2 hierarchy here")
    made = acquire_containment("cgroup")
    assert isinstance(made, cgroups.CgroupContainment)
    yield made
    release_containment(made)


class _Task:
    """A task's process, started in ``worker/`` as a box's spawn starts it."""

    def __init__(self, script: str, tmp: Path, name: str) -> None:
        self.pidfile = tmp / f"{name}.pid"
        self.proc = spawn(["/bin/sh", "-c", script, str(self.pidfile)], cwd=tmp, env={})

    def stray(self) -> int:
        """The pid of what the task started, once it is written (and, for
        an orphan, once its parent is gone)."""
        deadline = time.monotonic() + 30
        while not (self.pidfile.exists() and self.pidfile.read_text().strip()):
            assert time.monotonic() < deadline, "the task never started its process"
            time.sleep(0.005)  # polled with a deadline: the task's shell writes it
        pid = int(self.pidfile.read_text())
        while _parent(pid) not in (1, os.getpid(), self.proc.pid):
            assert time.monotonic() < deadline, "the orphan's parent never exited"
            time.sleep(0.005)  # polled with a deadline: the subshell exits at once
        return pid

    def end(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            assert pipe is not None
            pipe.close()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text()


def _ends(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie within 10 s (it was SIGKILLed)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.005)  # polled with a deadline: the kernel delivers SIGKILL
    return False


def _place(containment: cgroups.CgroupContainment, record: cgroups.Spawn, pid: int) -> None:
    containment.started(record, pid)
    try:
        containment.place(record)
    finally:
        containment.finish(record)


def test_an_orphan_of_a_spawn_alone_is_its_own(
    containment: cgroups.CgroupContainment, tmp_path: Path
) -> None:
    box = containment.box()
    record = containment.begin(box)
    task = _Task(ORPHAN, tmp_path, "a")
    try:
        orphan = task.stray()
        _place(containment, record, task.proc.pid)
        assert _cgroup_of(orphan) == _cgroup_of(task.proc.pid), "the orphan was not swept in"
    finally:
        box.end(0.0)
        task.end()
        box.close()


def test_an_orphan_born_while_another_spawn_was_in_flight_is_killed(
    containment: cgroups.CgroupContainment, tmp_path: Path
) -> None:
    """Whose it is cannot be told: it is killed, not left outside every cgroup."""
    boxes = [containment.box(), containment.box()]
    first = containment.begin(boxes[0])
    second = containment.begin(boxes[1])  # in flight at the same time
    task = _Task(ORPHAN, tmp_path, "a")
    try:
        orphan = task.stray()
        _place(containment, first, task.proc.pid)
        assert _ends(orphan), "an orphan whose task cannot be told was left running"
        assert _cgroup_of(task.proc.pid).strip().endswith(boxes[0].path.name)
    finally:
        containment.finish(second)
        for box in boxes:
            box.end(0.0)
        task.end()
        for box in boxes:
            box.close()


def test_each_sweep_takes_its_own_tasks_children_and_no_others(
    containment: cgroups.CgroupContainment, tmp_path: Path
) -> None:
    """Two spawns at once, each of whose process started a child before its
    move; the first is placed while the second's pid is not known yet (it
    waits rather than take or kill what could be the second's)."""
    boxes = [containment.box(), containment.box()]
    records = [containment.begin(box) for box in boxes]
    tasks = [_Task(CHILD, tmp_path, name) for name in ("a", "b")]
    try:
        children = [task.stray() for task in tasks]
        placing = threading.Thread(target=_place, args=(containment, records[0], tasks[0].proc.pid))
        placing.start()
        containment.started(records[1], tasks[1].proc.pid)
        placing.join(timeout=30)
        assert not placing.is_alive()
        assert _cgroup_of(children[0]) == _cgroup_of(tasks[0].proc.pid)
        assert _cgroup_of(children[1]) != _cgroup_of(tasks[0].proc.pid), (
            "the first sweep took the second task's child"
        )
        assert not _ends_now(children[1]), "the first sweep killed the second task's child"
        _place(containment, records[1], tasks[1].proc.pid)
        assert _cgroup_of(children[1]) == _cgroup_of(tasks[1].proc.pid)
        assert _cgroup_of(tasks[1].proc.pid).strip().endswith(boxes[1].path.name)
    finally:
        for record in records:
            if record in containment._spawning:
                containment.finish(record)
        for box in boxes:
            box.end(0.0)
        for task in tasks:
            task.end()
        for box in boxes:
            box.close()


def _ends_now(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def test_the_worker_stays_out_of_its_tasks_way(containment: cgroups.CgroupContainment) -> None:
    """A tool the worker itself runs (its own session) is never swept."""
    box = containment.box()
    record = containment.begin(box)
    tool = subprocess.Popen(["sleep", "120"])  # the worker's session
    task = spawn(["sleep", "120"], cwd=Path("/"), env={})
    try:
        where = _cgroup_of(tool.pid)
        _place(containment, record, task.pid)
        assert _cgroup_of(tool.pid) == where
        assert tool.poll() is None
    finally:
        tool.kill()
        tool.wait()
        box.end(0.0)
        task.kill()
        task.wait()
        for pipe in (task.stdout, task.stderr):
            assert pipe is not None
            pipe.close()
        box.close()


def test_an_orphan_born_before_another_spawn_began_is_its_tasks(
    containment: cgroups.CgroupContainment, tmp_path: Path
) -> None:
    """The other spawn began after the orphan was born: it cannot be that
    one's (a spawn's processes are born after it begins), so it is kept,
    in its own task's cgroup."""
    from gpulayer.worker.containment import proc_stat, ticks_now

    boxes = [containment.box(), containment.box()]
    first = containment.begin(boxes[0])
    task = _Task(ORPHAN, tmp_path, "a")
    second = None
    try:
        orphan = task.stray()
        born = proc_stat(orphan).start
        deadline = time.monotonic() + 10
        while ticks_now() <= born:  # the clock's next tick (10 ms at most), so B begins later
            assert time.monotonic() < deadline
        second = containment.begin(boxes[1])
        _place(containment, first, task.proc.pid)
        assert not _ends_now(orphan), "the task's own orphan was killed"
        assert _cgroup_of(orphan) == _cgroup_of(task.proc.pid)
    finally:
        if second is not None:
            containment.finish(second)
        for box in boxes:
            box.end(0.0)
        task.end()
        for box in boxes:
            box.close()


def test_a_process_the_worker_process_starts_in_a_session_of_its_own_is_left(
    containment: cgroups.CgroupContainment,
) -> None:
    """Embedded, the worker process is the user's program: a process it
    starts in a session of its own (a data server, TensorBoard, a GPU
    probe) while a task starts is its own, not the task's: neither moved
    into the task's cgroup nor ended with it."""
    box = containment.box()
    record = containment.begin(box)
    mine = subprocess.Popen(["sleep", "120"], start_new_session=True)
    task = spawn(["sleep", "120"], cwd=Path("/"), env={})
    try:
        where = _cgroup_of(mine.pid)
        _place(containment, record, task.pid)
        assert _cgroup_of(mine.pid) == where, "the program's own process was swept in"
        box.end(0.0)
        assert mine.poll() is None, "the program's own process ended with the task"
    finally:
        mine.kill()
        mine.wait()
        task.kill()
        task.wait()
        for pipe in (task.stdout, task.stderr):
            assert pipe is not None
            pipe.close()
        box.close()


def test_an_embedded_programs_own_daemons_outlive_its_jobs(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program using an embedded client starts helpers of its own, each in
    a session of its own, while 100 of its jobs start on four slots: none
    is killed by the jobs' containment. (Sweeps that took whatever was
    outside the worker's session killed 125 of 126.)"""
    if not cgroups_possible():
        pytest.skip("no writable cgroup v2 hierarchy here")
    monkeypatch.setenv(defaults.CONTAINMENT_ENV, "cgroup")
    helpers: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()

    def start_helpers() -> None:
        while not stop.is_set() and len(helpers) < 200:
            helpers.append(subprocess.Popen(["sleep", "120"], start_new_session=True))
            stop.wait(0.002)  # spread over the burst

    try:
        with gpulayer.Client(home=home) as client:
            client.ensure_local_workers(2, slots=2)
            starter = threading.Thread(target=start_helpers)
            starter.start()
            try:
                jobs = [client.submit(command=["true"]) for _ in range(100)]
                assert [job.wait(timeout=60) for job in jobs] == ["succeeded"] * 100
            finally:
                stop.set()
                starter.join()
            # Each job was reported ended once its cgroup was empty: a helper
            # swept into one would be dead by now.
            dead = [h.pid for h in helpers if h.poll() is not None]
        assert helpers and dead == [], f"{len(dead)} of {len(helpers)} helpers were killed"
    finally:
        for h in helpers:
            h.kill()
            h.wait()


def test_an_orphan_is_judged_as_one_when_the_worker_is_its_containers_init() -> None:
    """A worker that is PID 1 (`docker run ... gpulayer worker start`) is the
    parent every orphan is given: a task's double-forked daemon must still be
    an orphan (taken or killed), not the worker's own (left running)."""
    from gpulayer.worker.containment import ProcStat

    task = cgroups.Spawn(box=None, since=0, pid=4242)  # type: ignore[arg-type]
    orphan = ProcStat(state="S", parent=1, group=777, session=777, start=5)
    assert cgroups._owner_of(orphan, {4242: task}, me=1) is None
    own = ProcStat(state="S", parent=os.getpid(), group=778, session=778, start=5)
    assert cgroups._owner_of(own, {4242: task}, me=os.getpid()) == "worker"


def test_a_program_whose_helpers_outlive_its_containment_can_make_another() -> None:
    """Embedded, a program's own helper started while its workers ran stays
    in their worker/ cgroup when the client closes (it is not a task's):
    the next client of the same process still gets cgroups."""
    if not cgroups_possible():
        pytest.skip("no writable cgroup v2 hierarchy here")
    first = acquire_containment("cgroup")
    helper = subprocess.Popen(["sleep", "120"])  # born in worker/
    try:
        release_containment(first)
        again = acquire_containment("cgroup")
        try:
            assert isinstance(again, cgroups.CgroupContainment)
            assert again.root != first.root  # type: ignore[attr-defined]
        finally:
            release_containment(again)
    finally:
        helper.kill()
        helper.wait()
