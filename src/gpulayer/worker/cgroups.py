"""A cgroup v2 per task: what it starts is born in it, and ends with it.

Layout, under the cgroup the worker process was started in::

    gpulayer-<pid>-<start>/    one per worker process (its pid and start time)
        worker/                the worker process and its warden
        t<n>/                  one task's processes, and all they start

A task's first process starts in its parent's cgroup: Python cannot start it
elsewhere (it has no ``CLONE_INTO_CGROUP``), and a ``preexec_fn`` would cost
the fast vfork path of every spawn. So the process is moved into its task's
cgroup just after it starts. Whatever it started before that move was born
in ``worker/`` too, beside the worker's own processes (embedded, the worker
process is the user's program, which may start processes of its own, in
sessions of their own): once the task's process is moved, every process
born since in ``worker/`` that is the task's is swept into its cgroup.

Several tasks may start at once (one per slot): each sweep takes only what
is its own task's. A stray is known by its session, or its parent, parent's
parent and so on: reaching a task's process first, it is that task's;
reaching the worker process first, it is the worker's own, and left. An
orphan, whose parents reach neither (a daemon that forked twice and left its
session, all before its task's process was moved: a few milliseconds), is
its task's if no other task being started had begun when it was born, and
is killed if one had: which task it came from cannot be told, and it may
outlive neither.

Ending a task: SIGTERM to each process in its cgroup, the grace period, then
``cgroup.kill``, waiting on ``cgroup.events`` for it to be empty. The
cgroup then gives the task's CPU time (``cpu.stat``); its peak memory comes
from v2's memory controller where the worker's cgroup delegates it, else
from v1's beside it where there is one the worker may use. An empty task
cgroup is kept for the next task (its counters read again at the start):
making and removing one per task cost more than the rest together.

A worker that dies leaves its cgroups to its warden, which ends every task's
and removes them; where the warden died too, the next worker process
started in the same place removes what a dead worker left (its pid and
start time say whether it is dead; a populated ``worker/`` that its warden
is still at work).

Moving a process is what costs: the kernel waits for an RCU grace period
(some 10 ms) when moves are rare, unless the cgroup2 mount has the
``favordynmods`` option; the launching thread waits, not the CPU, and the
task's process runs meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import WorkerError
from .cgroupfs import (
    _mount_of,
    _own_cgroup,
    _pidfd_of_member,
    _pids,
    _pids_here,
    _populated,
    _read,
    _remove,
    _signal_member,
    _signal_pidfds,
    _sweep_stale,
    _v1_memory,
    _wait_empty,
    _wait_left,
    _write,
    kill_all,
)
from .containment import (
    CGROUP,
    Box,
    Containment,
    ProcStat,
    Unavailable,
    Usage,
    proc_stat,
    ticks_now,
)
from .process import KILL_WAIT_S, RunAs, Starter, TaskProcess, spawn

log = logging.getLogger(__name__)

# How long the sweep of what a task's process started before its move may
# take (a fork storm racing it), and after how many rounds of moves what is
# left is killed instead. One round: some 30 us, measured.
_SWEEP_TIMEOUT_S = 1.0
_SWEEP_MOVE_ROUNDS = 10
# How long a stopping worker process waits for its warden to leave their
# cgroup, so that it can remove it.
_RELEASE_WAIT_S = 1.0
# Empty task cgroups kept for the next tasks.
_POOL_MAX = 16
# How far up its parents a stray is followed to find the task it came from.
_PARENTS_MAX = 64


@dataclass
class Spawn:
    """A task's process being started and placed in its box."""

    box: CgroupBox
    since: int  # clock ticks after boot, as /proc/<pid>/stat counts
    pid: int | None = None  # once it is started


class CgroupContainment(Containment):
    """A cgroup per task, under one for the worker process (see the module)."""

    kind = CGROUP

    def __init__(
        self, base: Path, path: str, root: Path, memory: Path | None, has_kill: bool
    ) -> None:
        self.base = base  # where the worker process was, and goes back to
        self.root = root
        self.hierarchy_path = f"{path.rstrip('/')}/{root.name}"  # as /proc/<pid>/cgroup says
        self.spawner = root / "worker"  # the worker process: where its children start
        self.spawner_path = f"{self.hierarchy_path}/worker"
        self.memory = memory  # the v1 memory controller's cgroup for it, if any
        self.has_kill = has_kill
        self.v2_memory = "memory" in (root / "cgroup.subtree_control").read_text().split()
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()
        # The spawns in flight; notified as each learns its pid or ends.
        self._spawning: list[Spawn] = []
        self._spawns = threading.Condition(threading.Lock())
        # Empty task cgroups, each with its v1 memory one and its CPU time so far.
        self._free: list[tuple[Path, Path | None, float]] = []

    @classmethod
    def make(cls) -> CgroupContainment:
        """Set up in the cgroup this process is in, and move it to ``worker/``."""
        try:
            path, _ = _own_cgroup()
            base = _mount_of("cgroup2", path)
        except OSError as exc:
            raise Unavailable(f"cannot read this process's cgroups: {exc}") from None
        if base is None:
            raise Unavailable(f"no cgroup2 mount holds this process's cgroup {path}")
        _sweep_stale(base, path)
        name = f"gpulayer-{os.getpid()}-{proc_stat('self').start}"
        for again in itertools.count(1):
            root = base / name
            try:
                root.mkdir()
                break
            except FileExistsError:
                # This process's, from a containment released while processes
                # its program started were still in worker/: kept until they
                # end, and swept once this process has.
                name = f"gpulayer-{os.getpid()}-{proc_stat('self').start}-{again}"
            except OSError as exc:
                raise Unavailable(f"cannot make a cgroup in {base}: {exc.strerror}") from None
        try:
            (root / "worker").mkdir()
            controllers = (root / "cgroup.controllers").read_text().split()
            if "memory" in controllers:  # delegated to us: the tasks' peak memory
                with contextlib.suppress(OSError):
                    _write(root / "cgroup.subtree_control", "+memory")
            _write(root / "worker" / "cgroup.procs", "0")  # this process, all its threads
        except OSError as exc:
            _remove(root)
            raise Unavailable(f"cannot move the worker into {root}: {exc.strerror}") from None
        memory = None if "memory" in controllers else _v1_memory(name)
        return cls(base, path, root, memory, (root / "cgroup.kill").exists())

    def box(self) -> Box:
        with self._lock:
            free = self._free.pop() if self._free else None
        if free is not None:
            path, memory, cpu = free
            return CgroupBox(self, path, memory, cpu_before=cpu)
        path = self.root / f"t{next(self._numbers)}"
        path.mkdir()
        memory = None
        if self.memory is not None:
            memory = self.memory / path.name
            try:
                memory.mkdir()
            except OSError:
                memory = None  # its peak memory is then unknown
        return CgroupBox(self, path, memory)

    def _done_with(self, box: CgroupBox, cpu: float | None) -> None:
        """An ended task's cgroup: kept for another, or removed."""
        with self._lock:
            if cpu is not None and not self.v2_memory and len(self._free) < _POOL_MAX:
                self._free.append((box.path, box.memory, cpu))  # (v2's peak stays: not kept)
                return
        _remove(box.path)
        if box.memory is not None:
            _remove(box.memory)

    def begin(self, box: CgroupBox) -> Spawn:
        """A spawn into ``box`` begins: recorded before its process forks."""
        with self._spawns:
            record = Spawn(box, ticks_now())
            self._spawning.append(record)
        return record

    def started(self, record: Spawn, pid: int) -> None:
        with self._spawns:
            record.pid = pid
            self._spawns.notify_all()

    def finish(self, record: Spawn) -> None:
        with self._spawns:
            self._spawning.remove(record)
            self._spawns.notify_all()

    def place(self, record: Spawn) -> None:
        """Move the task's new process into its box, then what it started
        before the move (see the module).

        The task's process is the worker's child, not reaped yet: its pid
        is its own. A stray is known by a listing only, and may have exited
        since, its pid given to another process: each is acted on through a
        pidfd, once ``/proc`` says (read after the pidfd was taken) that the
        pid still names a process in ``worker/``, outside the worker's
        session, born since the task's start, which only a process of a
        task starting can be (see the module). A kill goes through that
        pidfd. A move can only name a pid (``cgroup.procs`` takes no pidfd):
        between the check and the write, the stray would have to exit, be
        reaped and its pid be given out again, which takes the kernel's
        allocator a round of the whole pid space (it hands pids out in
        turn), not the microseconds in between."""
        box, pid = record.box, record.pid
        assert pid is not None, "placed before it was started"
        box.move(pid)
        me, session = os.getpid(), os.getsid(0)
        deadline = time.monotonic() + _SWEEP_TIMEOUT_S
        for rounds in itertools.count(1):
            listed = _pids_here(self.spawner)
            # Read after the listing: a spawn begins before its process forks,
            # so whichever made a process listed is known here, or has ended
            # (its processes moved out of worker/ since: see _pidfd_of_member).
            with self._spawns:
                tasks = {s.pid: s for s in self._spawning if s.pid is not None}
                pending = [s.since for s in self._spawning if s.pid is None]
                # Those that could have made an orphan: begun before it was born.
                others = [s.since for s in self._spawning if s is not record]
            late = time.monotonic() > deadline
            take: list[int] = []
            kill: list[int] = []
            unsure = -1  # the latest start of a stray whose task may not be known yet
            for stray in listed:
                try:
                    st = proc_stat(stray)
                except (ProcessLookupError, FileNotFoundError):
                    continue  # gone
                if stray == me or st.session == session or st.start < record.since:
                    continue  # the worker's own (its warden), or older than the task
                owner = _owner_of(st, tasks, me)
                if owner is record:
                    (take if rounds <= _SWEEP_MOVE_ROUNDS else kill).append(stray)
                elif owner is not None:
                    continue  # another task's (its own sweep takes it), or the worker's
                elif not late and any(since <= st.start for since in pending):
                    unsure = max(unsure, st.start)  # perhaps of a task not known yet
                elif any(since <= st.start for since in others):
                    kill.append(stray)  # an orphan of this task or of another: cannot tell
                else:
                    take.append(stray)  # an orphan born while only this task was starting
            if not (take or kill) and unsure < 0:
                return
            if kill and rounds <= _SWEEP_MOVE_ROUNDS:
                log.warning(
                    "killing %d process(es) that left their session before their task's "
                    "process was in its cgroup, while other tasks started: whose they "
                    "are cannot be told",
                    len(kill),
                )
            for stray, act in [(p, "move") for p in take] + [(p, "kill") for p in kill]:
                fd = _pidfd_of_member(stray, self.spawner_path, session, record.since)
                if fd is None:
                    continue  # gone, or its pid is another process's now
                try:
                    if act == "move":
                        box.move(stray)
                    else:  # forking faster than it is moved, or whose is unknown
                        _signal_pidfds([fd], signal.SIGKILL)
                finally:
                    os.close(fd)
            if time.monotonic() > deadline + _SWEEP_TIMEOUT_S:
                raise WorkerError(
                    f"the processes a task started could not be kept in {box.path} within "
                    f"{_SWEEP_TIMEOUT_S:g} s"
                )
            if unsure >= 0 and not (take or kill):
                # Until the tasks starting that could have made them are
                # known (their process started); past the deadline, killed.
                with self._spawns:
                    self._spawns.wait_for(
                        functools.partial(self._all_known_before, unsure),
                        max(0.0, deadline - time.monotonic()) + 0.001,
                    )

    def _all_known_before(self, horizon: int) -> bool:
        """Whether every spawn begun by ``horizon`` knows its process (under ``_spawns``)."""
        return not any(s.pid is None and s.since <= horizon for s in self._spawning)

    def end_left(self, grace: float) -> int:
        """In the warden of a dead worker: end every task's cgroup at once,
        one grace for all, and what its last spawn had not yet moved into
        one; then remove the worker's cgroups."""
        me, session = os.getpid(), os.getsid(0)
        # Held by pidfd from the listing on: they get SIGKILL after the
        # grace, when their pids could long be other processes'.
        unplaced = [
            fd
            for pid in _pids_here(self.spawner)
            if pid != me
            and (fd := _pidfd_of_member(pid, self.spawner_path, session, 0)) is not None
        ]
        try:
            _signal_pidfds(unplaced, signal.SIGTERM)
            held = [CgroupBox(self, path, None) for path in self._task_dirs() if _populated(path)]
            for box in held:
                box.signal_rest(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for box in held:
                _wait_empty(box.path, max(0.0, deadline - time.monotonic()))
            _signal_pidfds(unplaced, signal.SIGKILL)
        finally:
            for fd in unplaced:
                os.close(fd)
        # And what those started meanwhile, or had no pidfd (out of fds):
        # one at a time, each known to be there still.
        for _ in range(100):  # each round kills all there are; forks race it
            found = False
            for pid in _pids_here(self.spawner):
                fd = None if pid == me else _pidfd_of_member(pid, self.spawner_path, session, 0)
                if fd is not None:
                    found = True
                    _signal_pidfds([fd], signal.SIGKILL)
                    os.close(fd)
            if not found:
                break
        for box in held:
            box.end(0.0)
        self._close()  # the warden leaves the worker's cgroup, and removes it
        return len(held) + (1 if unplaced else 0)

    def _task_dirs(self) -> list[Path]:
        try:
            return [e for e in self.root.iterdir() if e.is_dir() and e.name != "worker"]
        except OSError:
            return []

    def _close(self, leaving: Sequence[int] = ()) -> None:
        """Go back to where the worker process was, and remove the cgroups,
        once the processes ``leaving`` have left ``worker/``. Another
        process still there (a warden at work, as a start failed; one the
        worker's program started) removes them, or the next worker's sweep."""
        try:
            _write(self.base / "cgroup.procs", "0")
        except OSError as exc:
            log.warning("cannot move the worker back to %s: %s", self.base, exc.strerror)
            return
        quiet = True
        if not set(leaving) & set(_pids_here(self.spawner)) or _wait_left(
            self.spawner, set(leaving), _RELEASE_WAIT_S
        ):
            quiet = bool(_pids_here(self.spawner))
        _remove(self.root, quiet=quiet)
        if self.memory is not None:
            _remove(self.memory, quiet=quiet)


class CgroupBox(Box):
    def __init__(
        self,
        owner: CgroupContainment,
        path: Path,
        memory: Path | None,
        *,
        cpu_before: float | None = None,
    ) -> None:
        """``cpu_before``: a cgroup kept from earlier tasks, and the CPU time
        they used (its counters count from here on)."""
        super().__init__()
        self._owner = owner
        self.path = path
        self.hierarchy_path = f"{owner.hierarchy_path}/{path.name}"  # as /proc/<pid>/cgroup says
        self.memory = memory
        self._procs = f"{path}/cgroup.procs"
        self._memory_procs = None if memory is None else f"{memory}/cgroup.procs"
        self._done = False
        self._empty = False  # found so once ended: nothing in it can start anything
        self._cpu_before = cpu_before or 0.0
        if cpu_before is not None and memory is not None:
            with contextlib.suppress(OSError):
                _write(memory / "memory.max_usage_in_bytes", "0")

    def move(self, pid: int) -> None:
        """Put process ``pid`` (all its threads) in this box. The v1 memory
        cgroup first: a child forked in between is then still in the v2
        cgroup it came from, and swept from there into both."""
        try:
            if self._memory_procs is not None:
                with contextlib.suppress(OSError):  # its memory is then unknown
                    _write(self._memory_procs, str(pid))
            _write(self._procs, str(pid))
        except ProcessLookupError:
            pass  # exited already: nothing of it to keep

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[bytes, bytes],
        run_as: RunAs | None = None,
        starter: Starter = spawn,
    ) -> TaskProcess:
        record = self._owner.begin(self)
        try:
            proc = starter(argv, cwd=cwd, env=env, run_as=run_as)
            self._owner.started(record, proc.pid)
            try:
                self._owner.place(record)
            except BaseException:
                kill_all(self.path, self.hierarchy_path, has_kill=self._owner.has_kill)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)  # its child, not reaped: its own pid
                proc.wait()
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
                raise
        finally:
            self._owner.finish(record)
        return proc

    def signal_rest(self, sig: signal.Signals, skip_groups: frozenset[int] = frozenset()) -> None:
        if not _populated(self.path):  # the usual case as a task's last process exits
            return
        if sig == signal.SIGKILL and not skip_groups:
            kill_all(self.path, self.hierarchy_path, has_kill=self._owner.has_kill)
            return
        for pid in _pids(self.path):
            if sig == signal.SIGTERM and pid in self._told:
                continue
            told = _signal_member(pid, sig, self.hierarchy_path, skip_groups)
            if told and sig == signal.SIGTERM:
                self._told.add(pid)

    def _end(self, grace: float) -> None:
        if not _populated(self.path):  # the usual case: the task left nothing
            self._empty = True
            return
        self.signal_rest(signal.SIGTERM)
        if _wait_empty(self.path, grace):
            self._empty = True
            return
        kill_all(self.path, self.hierarchy_path, has_kill=self._owner.has_kill)
        self._empty = _wait_empty(self.path, KILL_WAIT_S)
        if not self._empty:
            log.warning("processes of %s survived SIGKILL: %s", self.path, _pids(self.path))

    def _close(self) -> Usage:
        total = self._cpu_total()
        usage = Usage(
            cpu_s=None if total is None else max(0.0, total - self._cpu_before),
            peak_memory=self._peak(),
        )
        if not self._done:
            self._done = True
            if self._empty:
                self._owner._done_with(self, total)
            else:  # survived SIGKILL (stuck in the kernel): not for another task
                log.warning("leaving %s: it still holds processes", self.path)
        return usage

    def _cpu_total(self) -> float | None:
        with contextlib.suppress(OSError, ValueError):
            for line in _read(f"{self.path}/cpu.stat").splitlines():
                key, _, value = line.partition(b" ")
                if key == b"usage_usec":
                    return int(value) / 1e6
        return None

    def _peak(self) -> int | None:
        files = [f"{self.path}/memory.peak"] if self._owner.v2_memory else []
        if self.memory is not None:
            files.append(f"{self.memory}/memory.max_usage_in_bytes")
        for file in files:
            with contextlib.suppress(OSError, ValueError):
                return int(_read(file))
        return None


def _owner_of(
    stray: ProcStat, tasks: Mapping[int, Spawn], me: int
) -> Spawn | Literal["worker"] | None:
    """Whose a stray in ``worker/`` is: the spawn whose task process
    (``tasks``, by pid) leads its session or is one of its parents, its
    parent's parents and so on; ``_WORKERS`` if those reach the worker
    process ``me`` first ("worker": a process its host program started;
    embedded, the worker process is the user's); None for an orphan, whose parents
    reach neither (a task's double-forked daemon, reparented to init or a
    subreaper), or one whose parent is gone meanwhile."""
    if stray.session in tasks:
        return tasks[stray.session]
    parent = stray.parent
    try:
        for _ in range(_PARENTS_MAX):
            if parent in tasks:
                return tasks[parent]
            if parent <= 1:
                # Init's: an orphan. (A worker that is its container's init
                # is every orphan's parent too: then it cannot tell its own.)
                return None
            if parent == me:
                return "worker"
            parent = proc_stat(parent).parent
    except (ProcessLookupError, FileNotFoundError, ValueError):
        pass
    return None
