"""Everything a task starts ends with it, however it detached (ADR-0019).

A task's processes are kept in a *box*, which the worker ends when the task
ends: normal exit, failure, cancel, timeout, or the worker's own death (its
warden ends what it left). The kernel keeps the box, by one of:

- **cgroup v2** (``cgroups.py``), where the worker can make cgroups: a
  cgroup per task, in which whatever its processes start is born (setsid
  and double forks included), ended at once by ``cgroup.kill``, and which
  measures the task's CPU time and, where a memory controller is at hand,
  its peak memory.
- **subreaper**, otherwise (Linux): the worker is the child subreaper of its
  tasks, so a process whose parent exits is reparented to the worker instead
  of to init. When a task ends, its processes still attached to its tree and
  the orphans born while it ran (and while no other task that could own them
  ran) are ended and reaped; those that exit while it runs are reaped
  meanwhile, each zombie holding a pid. An orphan is the worker's child
  outside the worker's session (a task's processes are never in it: each
  task starts a session of its own).
- **process tree**, where neither exists (not Linux): the task's session,
  process group and tree as psutil reads them, which a daemon that leaves
  them escapes.

``GPULAYER_CONTAINMENT`` (or ``Worker(containment=...)``) forces one:
``cgroup`` (an error where it is not possible) or ``subreaper``; unset or
``auto``, the first that works. One of each kind serves every worker of a
process.

A job that runs as the worker's own user could leave its cgroup by writing
to the cgroup files itself, or signal the worker; one run as another user
(``--run-as``) can do neither.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import defaults
from ..errors import WorkerError
from .process import (
    KILL_WAIT_S,
    RunAs,
    Starter,
    TaskProcess,
    spawn,
    terminate_trees,
    wait_exited,
)

if TYPE_CHECKING:
    import psutil

log = logging.getLogger(__name__)

CGROUP = "cgroup v2"
SUBREAPER = "subreaper"
TREE = "process tree"
MODES = ("auto", "cgroup", "subreaper")

_PR_SET_CHILD_SUBREAPER = 36
# How long a subreaper's close waits for its reaper thread to end (it ends
# as soon as it is woken, unless it is in the middle of a reap).
_REAPER_STOP_S = 5.0
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Usage:
    """What a task's processes used, all of them, where it is known."""

    cpu_s: float | None = None
    peak_memory: int | None = None  # bytes, page cache included


class Box(ABC):
    """One task's processes: all it starts, wherever they went."""

    def __init__(self) -> None:
        self._end_lock = threading.Lock()
        self._ended = False
        self._told: set[int] = set()  # pids sent SIGTERM: each gets one

    @abstractmethod
    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[bytes, bytes],
        run_as: RunAs | None = None,
        starter: Starter = spawn,
    ) -> TaskProcess:
        """Start one of the task's processes in the box: by ``starter``,
        ``process.spawn`` (cold) or a zygote's (warm, held until released)."""

    @abstractmethod
    def signal_rest(self, sig: signal.Signals, skip_groups: frozenset[int] = frozenset()) -> None:
        """Signal every process still in the box, but those in ``skip_groups``
        (told already); SIGTERM only to those not told before."""

    def end(self, grace: float) -> None:
        """SIGTERM to each process not told yet, up to ``grace`` s to leave,
        then SIGKILL; returns once the box is empty (or, for what SIGKILL
        cannot end at once, a while later). Once ended, again is nothing; a
        second caller waits for the first."""
        with self._end_lock:
            if self._ended:
                return
            try:
                self._end(grace)
            finally:
                self._ended = True

    @abstractmethod
    def _end(self, grace: float) -> None: ...

    def close(self) -> Usage:
        """The task is over: end what is left, and say what it used."""
        self.end(0.0)
        return self._close()

    @abstractmethod
    def _close(self) -> Usage: ...


class Containment(ABC):
    """How a worker process keeps its tasks' boxes (one per kind per process)."""

    kind: str

    @abstractmethod
    def box(self) -> Box:
        """A new, empty box for one task."""

    def end_left(self, grace: float) -> int:
        """In the warden of a dead worker: end what its tasks left, and tidy
        up; how many boxes held something."""
        return 0

    def _close(self, leaving: Sequence[int] = ()) -> None:  # noqa: B027 - most have nothing to do
        """The last worker of the process that used it stopped; the
        processes in ``leaving`` (its warden) are about to exit."""


def acquire_containment(mode: str | None = None) -> Containment:
    """The process's containment of ``mode`` (``GPULAYER_CONTAINMENT`` if
    None), set up at its first use; give it back with :func:`release_containment`.

    A worker process acquires it before it forks its warden, and before it
    starts any thread: a cgroup's set-up moves the process (see the module).
    """
    wanted = (mode or os.environ.get(defaults.CONTAINMENT_ENV) or "auto").strip().lower()
    if wanted not in MODES:
        raise WorkerError(
            f"unknown containment {wanted!r} (from {defaults.CONTAINMENT_ENV} or the worker's "
            f"options); choose one of: {', '.join(MODES)}"
        )
    with _SHARED_LOCK:
        if wanted in ("auto", "cgroup"):
            found = _SHARED.get(CGROUP)
            if found is None:
                from .cgroups import CgroupContainment  # it builds on this module

                try:
                    found = CgroupContainment.make()
                except Unavailable as exc:
                    if wanted == "cgroup":
                        raise WorkerError(
                            f"containment by cgroup v2 is not possible: {exc}"
                        ) from None
                    log.info("no cgroup v2 containment (%s): the worker is a subreaper", exc)
            if found is not None:
                return _use(found)
        found = _SHARED.get(SUBREAPER)
        if found is None:
            try:
                found = SubreaperContainment()
            except Unavailable as exc:
                log.warning("no subreaper containment (%s): tasks are ended by process tree", exc)
                found = _SHARED.get(TREE) or TreeContainment()
        return _use(found)


def release_containment(containment: Containment, *, leaving: Sequence[int] = ()) -> None:
    """A worker is done with ``containment``; the last one tidies it up.
    ``leaving``: processes of the worker's about to exit (its warden)."""
    with _SHARED_LOCK:
        users = _USERS.get(id(containment), 0) - 1
        if users > 0:
            _USERS[id(containment)] = users
            return
        _USERS.pop(id(containment), None)
        if _SHARED.get(containment.kind) is containment:
            del _SHARED[containment.kind]
    containment._close(leaving)


_SHARED_LOCK = threading.Lock()
_SHARED: dict[str, Containment] = {}
_USERS: dict[int, int] = {}


def _use(containment: Containment) -> Containment:
    _SHARED[containment.kind] = containment
    _USERS[id(containment)] = _USERS.get(id(containment), 0) + 1
    return containment


class Unavailable(Exception):
    """This kind of containment cannot be had here (says why)."""


# -- process tree ------------------------------------------------------------------


class TreeContainment(Containment):
    """The task's session, group and tree only (no kernel help: not Linux)."""

    kind = TREE

    def box(self) -> Box:
        return TreeBox()


class TreeBox(Box):
    """What ``process.terminate_tree`` reaches; also a task's box where the
    worker gives it none (a ``TaskRun`` made on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.procs: list[TaskProcess] = []

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[bytes, bytes],
        run_as: RunAs | None = None,
        starter: Starter = spawn,
    ) -> TaskProcess:
        proc = starter(argv, cwd=cwd, env=env, run_as=run_as)
        self.procs.append(proc)
        return proc

    def signal_rest(self, sig: signal.Signals, skip_groups: frozenset[int] = frozenset()) -> None:
        for proc in self.procs:
            if proc.pid in skip_groups or (sig == signal.SIGTERM and proc.pid in self._told):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # spawn() makes each lead a group of its own
            if sig == signal.SIGTERM:
                self._told.add(proc.pid)

    def _end(self, grace: float) -> None:
        if not any(_group_alive(proc.pid) for proc in self.procs):
            for proc in self.procs:  # reap what exited: nothing else is left
                proc.wait()
            return
        told = all(proc.pid in self._told for proc in self.procs)
        terminate_trees(self.procs, grace=grace, sigterm=not told)

    def _close(self) -> Usage:
        return Usage()


def _group_alive(pid: int) -> bool:
    """Whether the process group ``pid`` led (see ``process.spawn``) still
    has a member: its id stays reserved while it has, so it is still ours."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- subreaper ---------------------------------------------------------------------


def _set_subreaper(on: bool) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError) as exc:
        raise Unavailable(f"no prctl ({exc})") from None
    if prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise Unavailable(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")


class SubreaperContainment(Containment):
    """Orphans of the worker's tasks come back to the worker (see the module)."""

    kind = SUBREAPER

    def __init__(self) -> None:
        if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
            raise Unavailable("no /proc/<pid>/task/<tid>/children to find orphans in")
        _set_subreaper(True)
        self._lock = threading.Lock()
        self._open: list[SubreaperBox] = []
        # Every task process started here, by pid, while its box is open: an
        # orphan whose session or group it led is that task's.
        self._roots: dict[int, SubreaperBox] = {}
        # The reaper (see _reap_loop), woken as boxes open and close; one
        # reap at a time, so that a zombie is reaped once, by its pidfd.
        self._changed = threading.Condition(self._lock)
        self._reaper: threading.Thread | None = None
        self._stopping = False
        self._reap_lock = threading.Lock()

    def box(self) -> Box:
        box = SubreaperBox(self)
        with self._lock:
            self._open.append(box)
            if self._reaper is None and not self._stopping:
                self._reaper = threading.Thread(
                    target=self._reap_loop, name="gpulayer-orphan-reaper", daemon=True
                )
                self._reaper.start()
            self._changed.notify_all()
        return box

    def _close(self, leaving: Sequence[int] = ()) -> None:
        with self._lock:
            self._stopping = True
            reaper, self._reaper = self._reaper, None
            self._changed.notify_all()
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(_REAPER_STOP_S)
        with contextlib.suppress(Unavailable):
            _set_subreaper(False)

    def _reap_loop(self) -> None:
        """Reap the tasks' dead orphans while any task runs here.

        An orphan's exit leaves a zombie of the worker's, holding its pid
        until the worker reaps it: reaped only at its task's end, a job that
        makes orphans by the thousand (``(cmd &)`` in a loop) would run the
        machine out of pids, for every user. Nothing tells a thread of a
        child's exit without taking it (SIGCHLD goes to the process, whose
        handlers are its host program's; a ``waitid(WNOWAIT)`` on all
        children wakes at once, and again, for a zombie left to another
        waiter): so the orphans are looked for every ``ORPHAN_REAP_S``, a
        read of one small /proc file when there are none."""
        while True:
            with self._lock:
                while not self._open and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
                self._changed.wait(defaults.ORPHAN_REAP_S)
                if self._stopping:
                    return
            try:
                self.reap()
            except Exception:  # never let the reaper die: it would leak pids
                log.exception("reaping the tasks' orphans failed; trying again")

    def reap(self) -> int:
        """Reap the zombies among the worker's children that are its open
        boxes' orphans; how many.

        Only those the boxes would end anyway (see :meth:`_orphans_of`): a
        child of the main thread outside the worker's session, not a task's
        own process (its waiter reaps it, for its exit status), and in a
        session or group a task's process led, or born since a box still
        open was made. So a child of the host program in its session (the
        usual ``Popen``), or born before, is never taken. Each is reaped
        through a pidfd taken after it was found: never a pid reused since."""
        with self._reap_lock:
            with self._lock:
                roots = set(self._roots)
                since = min((b.since for b in self._open), default=None)
            if since is None:
                return 0
            session = os.getsid(0)
            reaped = 0
            for pid in _children_of_main_thread():
                if pid in roots:
                    continue
                try:
                    st = proc_stat(pid)
                except (FileNotFoundError, ProcessLookupError):
                    continue
                if st.state != "Z" or st.session == session:
                    continue
                if st.start < since and not {st.session, st.group} & roots:
                    continue
                reaped += _reap_zombie(pid, st.start)
            return reaped

    def _started(self, box: SubreaperBox, pid: int) -> None:
        with self._lock:
            self._roots[pid] = box

    def _closed(self, box: SubreaperBox) -> None:
        with self._lock:
            with contextlib.suppress(ValueError):
                self._open.remove(box)
            for pid in [pid for pid, owner in self._roots.items() if owner is box]:
                del self._roots[pid]

    def _orphans_of(self, box: SubreaperBox) -> list[int]:
        """The worker's children that are orphans of ``box``'s task.

        An orphan is reparented to the worker's main thread (the first of
        its threads alive): the children of its other threads are its own,
        forked there (the tasks' processes, tools it ran). One of ``box``'s
        was born while it ran, is not in the worker's session (a task's
        processes never are), and either is in a session or group one of its
        processes led, or was born when no other task still running had
        started."""
        session = os.getsid(0)
        # The children first: one forked on the main thread after this
        # listing is not in it; one forked before it is recorded by now, or
        # born after its own box was made (so spared below).
        children = _children_of_main_thread()
        with self._lock:
            roots = dict(self._roots)
            others = [b for b in self._open if b is not box and not b.ending]
        found = []
        for pid in children:
            if pid in roots:
                continue
            try:
                if os.getsid(pid) == session:
                    continue  # the worker's own (its warden, a tool it ran)
                st = proc_stat(pid)
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
            if st.start < box.since:
                continue
            owner = roots.get(st.session) or roots.get(st.group)
            if owner is not None:
                if owner is box:
                    found.append(pid)
                continue
            if not any(b.since <= st.start for b in others):
                found.append(pid)
        return found


class SubreaperBox(Box):
    def __init__(self, owner: SubreaperContainment) -> None:
        super().__init__()
        self._owner = owner
        self.since = ticks_now()  # clock ticks since boot, as /proc/<pid>/stat counts
        self.ending = False
        self.procs: list[TaskProcess] = []
        self._closed = False

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[bytes, bytes],
        run_as: RunAs | None = None,
        starter: Starter = spawn,
    ) -> TaskProcess:
        # Forked on a thread of the worker's other than its main one, it is
        # never taken for an orphan, recorded yet or not (see _orphans_of).
        proc = starter(argv, cwd=cwd, env=env, run_as=run_as)
        self._owner._started(self, proc.pid)
        self.procs.append(proc)
        return proc

    def _members(self) -> list[psutil.Process]:
        """Its processes still attached to its tree, and its orphans (now the
        worker's children) with theirs."""
        import psutil

        found: dict[int, psutil.Process] = {}
        starts = [p.pid for p in self.procs if p.returncode is None]
        for pid in starts + self._owner._orphans_of(self):
            try:
                proc = psutil.Process(pid)
                found[pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return list(found.values())

    def signal_rest(self, sig: signal.Signals, skip_groups: frozenset[int] = frozenset()) -> None:
        self._signal(self._members(), sig, skip_groups)

    def _signal(
        self,
        procs: Sequence[psutil.Process],
        sig: signal.Signals,
        skip_groups: frozenset[int] = frozenset(),
    ) -> None:
        import psutil

        for proc in procs:
            if sig == signal.SIGTERM and proc.pid in self._told:
                continue
            try:
                if skip_groups and os.getpgid(proc.pid) in skip_groups:
                    continue
                proc.send_signal(sig)  # psutil checks the start time first: never a reused pid
            except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if sig == signal.SIGTERM:
                self._told.add(proc.pid)

    def _end(self, grace: float) -> None:
        self.ending = True  # an orphan that may be another running task's is left to it
        procs = self._members()
        if not procs:  # the usual case: the task left nothing
            return
        self._signal(procs, signal.SIGTERM)
        alive = wait_exited(procs, grace)
        for _ in range(3):  # and what a dying parent handed the worker meanwhile
            alive = list({p.pid: p for p in alive + self._members()}.values())
            if not alive:
                break
            self._signal(alive, signal.SIGKILL)
            alive = wait_exited(alive, KILL_WAIT_S / 3)
        if alive:
            log.warning("processes survived SIGKILL: %s", sorted(p.pid for p in alive))
        self._reap()

    def _reap(self) -> None:
        """Collect the orphans that died as the worker's children (the
        reaper does the same while the task runs)."""
        self._owner.reap()

    def _close(self) -> Usage:
        if not self._closed:
            self._closed = True
            self._reap()
            self._owner._closed(self)
        return Usage()


def _reap_zombie(pid: int, start: int) -> int:
    """Reap child ``pid``, a zombie that started at ``start``; 1 if reaped.

    Through a pidfd: once taken, ``/proc`` read again says whether the pid
    still names that zombie (the same start time), or was reaped by another
    waiter meanwhile and given to a new process, which is left alone."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return 0
    try:
        st = proc_stat(pid)
        if st.start != start or st.state != "Z":
            return 0
        if _P_PIDFD is not None:
            return 0 if os.waitid(_P_PIDFD, fd, os.WEXITED | os.WNOHANG) is None else 1
        # A Python without P_PIDFD: by pid, as checked above.
        return 1 if os.waitpid(pid, os.WNOHANG)[0] else 0
    except (ChildProcessError, FileNotFoundError, ProcessLookupError):
        return 0
    finally:
        os.close(fd)


_P_PIDFD: int | None = getattr(os, "P_PIDFD", None)


def _children_of_main_thread() -> list[int]:
    """The children of this process's main thread (Python's outlives the others)."""
    pid = os.getpid()
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]
    return []


# -- what /proc says of a process ----------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    state: str
    parent: int
    group: int
    session: int
    start: int  # clock ticks after boot


def proc_stat(pid: int | str) -> ProcStat:
    """What ``/proc/<pid>/stat`` says (FileNotFoundError once it is reaped)."""
    with open(f"/proc/{pid}/stat", "rb") as file:
        text = file.read()
    fields = text[text.rindex(b")") + 2 :].split()
    return ProcStat(
        state=fields[0].decode(),
        parent=int(fields[1]),
        group=int(fields[2]),
        session=int(fields[3]),
        start=int(fields[19]),
    )


def ticks_now() -> int:
    """Now, in the clock ticks after boot of a process's start time: one
    started later never reads less."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // (1_000_000_000 // _TICKS)
