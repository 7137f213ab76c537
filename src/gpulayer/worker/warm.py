"""Warm start: a task's script forked from a Python that is ready.

Where a short job's time goes is the interpreter and PyTorch: 15 ms for
``python -c pass`` and a second or two for ``import torch`` on a small
machine, per rank. A worker keeps a *zygote* (``zygote.py``): its own
Python, started once, that has imported the preload set (``torch`` and
``numpy`` when importable) and waits. A script task, or a rank under the
direct launcher, then starts as a fork of it that becomes what a cold
``python script.py`` would be (see ``zygote.py`` for what is put right in
the child: session, descriptors, user, directory, environment, argv, path,
``__main__``, signals, exit).

What cannot be put right after the fork is what the preloaded modules read
as they were imported: thread counts (``OMP_NUM_THREADS``, read by libgomp
as it loads), allocators, the locale, every ``PYTHON*`` setting. A zygote is
made for one set of those values (its *key*); a task whose values differ
starts from the zygote made for them, or cold while that one starts (a few
are kept: the worker's own settings, and its ranks' ``OMP_NUM_THREADS=1``).

A task also starts cold, and its record says why, when its script's folder
or its ``PYTHONPATH`` holds a module of a name the zygote has imported (a
cold start would import that one instead), when the zygote is not ready
yet, or could not be made single-threaded (a fork copies one thread), or has
died (it is made again). See docs/adr/0023-warm-start.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from ..errors import WorkerError
from . import zygote as protocol
from .process import RunAs

log = logging.getLogger(__name__)

ZYGOTE = Path(protocol.__file__)
DEFAULT_PRELOAD = ("torch", "numpy")
WARM_ENV = "GPULAYER_WARM"
WARM_MODES = ("0", "1", "eager", "ready")
# What the direct launcher adds that a zygote reads (launch.cpu_threads).
RANK_SETTINGS = {b"OMP_NUM_THREADS": b"1"}
PRELOAD_ENV = "GPULAYER_PRELOAD"
MAX_ZYGOTES = 3  # per worker and user: each holds its own copy of torch (~200 MB)
MAX_REMAKES = 5  # a zygote that died this often is not made again
READY_TIMEOUT_S = 300.0  # for the zygote's imports, on a slow disk
STARTED_TIMEOUT_S = 10.0  # for a zygote to be past its start (see WarmStarts)

# What preloaded libraries read as they load (or at interpreter start):
# a task with other values than its zygote's cannot be its fork.
_READ_AT_START = (
    "PYTHON",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO",
    "BLIS_",
    "NPY_",
    "NUMPY_",
    "TORCH",
    "PYTORCH_",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "LC_",
    "LANG",
    "HIP_",
    "ROCM_",
    "HSA_",
    "KINETO_",
    "TRITON_",
)
# Read later, when first used: each task's own, set after the fork.
_READ_LATER = frozenset(
    {
        "PYTHONPATH",  # the child builds its sys.path from its own
        "PYTHONBREAKPOINT",  # read by each breakpoint() call
        "HIP_VISIBLE_DEVICES",  # GPU runtimes read these as they initialise,
        "ROCR_VISIBLE_DEVICES",  # which a zygote never does (it is checked)
        "PYTORCH_CUDA_ALLOC_CONF",  # at the first CUDA allocation
        "PYTORCH_HIP_ALLOC_CONF",
        "PYTORCH_ALLOC_CONF",
    }
)


FORK_TIMEOUT_S = 10.0  # for the zygote's answer, and a child's "go": else it is stuck
REPORT_WAIT_S = 1.0  # for the zygote's report of a child's end, once it has ended


_EXIT_LINE = re.compile(rb"exit (-?[0-9]{1,3})\n\Z")


def _left(deadline: float | None, most: float) -> float:
    return most if deadline is None else max(0.0, min(most, deadline - time.monotonic()))


class WarmUnavailable(OSError):
    """The zygote could not start this task's process (it died, or hangs):
    the task starts cold instead. Not the task's fault."""


def read_at_start(name: bytes) -> bool:
    text = name.decode("latin-1")
    return text.startswith(_READ_AT_START) and text not in _READ_LATER


Key = tuple[tuple[bytes, bytes], ...]

# The only settings a zygote is made with when a job's differ from the
# worker's, each with the values it may take. A zygote runs as the worker's
# user (root under --run-as) and serves every later job with its key: one
# made with a job's PYTHONHOME, LD_PRELOAD or PYTHONWARNINGS would run code
# that job chose, as root, in other users' jobs. Any other difference: cold,
# as the job's own user.
_COUNT = re.compile(rb"[0-9]{1,4}(,[0-9]{1,4}){0,7}")
_FLAG = re.compile(rb"[A-Za-z0-9]{0,8}")
_WORD = re.compile(rb"[A-Za-z0-9_.@:,=+-]{0,64}")  # locale names, affinity words: no path
_SETTABLE: dict[bytes, re.Pattern[bytes]] = {
    **dict.fromkeys(
        (
            b"OMP_NUM_THREADS",
            b"MKL_NUM_THREADS",
            b"OPENBLAS_NUM_THREADS",
            b"GOTO_NUM_THREADS",
            b"BLIS_NUM_THREADS",
            b"NUMEXPR_NUM_THREADS",
            b"OMP_THREAD_LIMIT",
        ),
        _COUNT,
    ),
    b"PYTHONHASHSEED": re.compile(rb"random|[0-9]{1,10}"),
    **dict.fromkeys(
        (
            b"PYTHONUNBUFFERED",
            b"PYTHONDONTWRITEBYTECODE",
            b"PYTHONUTF8",
            b"PYTHONNOUSERSITE",
            b"PYTHONSAFEPATH",
            b"PYTHONFAULTHANDLER",
            b"PYTHONDEVMODE",
            b"PYTHONOPTIMIZE",
        ),
        _FLAG,
    ),
    **dict.fromkeys(
        (
            b"LANG",
            b"LANGUAGE",
            b"LC_ALL",
            b"LC_CTYPE",
            b"LC_NUMERIC",
            b"LC_TIME",
            b"LC_COLLATE",
            b"LC_MONETARY",
            b"LC_MESSAGES",
            b"OMP_PROC_BIND",
            b"OMP_DYNAMIC",
            b"OMP_WAIT_POLICY",
            b"OMP_SCHEDULE",
            b"MKL_DYNAMIC",
            b"KMP_BLOCKTIME",
        ),
        _WORD,
    ),
}


def _not_for_a_zygote(key: Key, base: Key) -> str | None:
    """Why no zygote may be made with ``key`` (see _SETTABLE), if none may."""
    ours, theirs = dict(key), dict(base)
    for name in sorted({*ours, *theirs}):
        if ours.get(name) == theirs.get(name):
            continue
        value = ours.get(name)
        pattern = _SETTABLE.get(name)
        if pattern is None or (value is not None and pattern.fullmatch(value) is None):
            shown = name.decode("latin-1")
            return (
                f"its {shown} differs from the worker's, and a ready interpreter is made only "
                f"for thread counts, the locale and plain Python flags"
            )
    return None


def key_of(env: Mapping[bytes, bytes]) -> Key:
    return tuple(sorted((k, v) for k, v in env.items() if read_at_start(k)))


def _describe(key: Key, base: Key) -> str:
    ours, theirs = dict(key), dict(base)
    names = sorted({*ours, *theirs} - {k for k in ours if theirs.get(k) == ours[k]})
    return ", ".join(
        f"{n.decode('latin-1')}={ours[n].decode('latin-1')}" if n in ours else f"no {n.decode()}"
        for n in names
    )


class WarmProcess:
    """A task's process forked by a zygote: what the worker keeps of a
    ``Popen``. Held until :meth:`release` sends it its task, so that its
    box takes it in before it runs anything."""

    def __init__(
        self,
        zygote: Zygote,
        pid: int,
        channel: socket.socket,
        task: dict[str, Any],
        pipes: tuple[int, int, int, int],
    ) -> None:
        self.pid = pid
        self.args = task["argv"]
        self.returncode: int | None = None
        self._zygote = zygote
        self._channel: socket.socket | None = channel
        self._task = task
        out_r, out_w, err_r, err_w = pipes
        self._write_ends: list[int] = [out_w, err_w]
        self.stdout: IO[bytes] | None = open(out_r, "rb", buffering=0)  # noqa: SIM115
        self.stderr: IO[bytes] | None = open(err_r, "rb", buffering=0)  # noqa: SIM115
        self._exited = threading.Event()
        self._end_lock = threading.Lock()
        self._status: socket.socket | None = None
        # Taken while the child waits for its task: it cannot have exited,
        # so this is it, and stays it (never a later process on its pid).
        self._pidfd: int | None = os.pidfd_open(pid)

    def release(self) -> None:
        """Send the child its task; raise what a cold spawn would have (its
        folder missing, say) if it could not become the task's process."""
        channel, self._channel = self._channel, None
        assert channel is not None, "released twice"
        try:
            channel.settimeout(FORK_TIMEOUT_S)  # a child stopped (SIGSTOP) would hold the slot
            protocol.send(channel, ("task", self._task), fds=self._write_ends)
            reply, _ = protocol.receive(channel)
            channel.settimeout(None)
        except TimeoutError as e:
            channel.close()
            raise WarmUnavailable(f"its child {self.pid} did not start its task") from e
        except BaseException:
            channel.close()
            raise
        finally:
            for fd in self._write_ends:
                os.close(fd)
            self._write_ends = []
            self._task = {}  # its environment: not kept longer than needed
        if reply is not None and reply[0] == "go":
            with self._end_lock:
                if not self._exited.is_set():
                    self._status = channel  # its exit code comes here too (see _watch_orphan)
                    return
            channel.close()  # it has ended (and was reported) already
            return
        channel.close()
        if reply is not None and reply[0] == "error":  # what a cold start would meet too
            self.wait(timeout=FORK_TIMEOUT_S)
            raise OSError(reply[1], reply[2])
        raise WarmUnavailable(f"its child {self.pid} ended before its task began")

    def exit_fd(self) -> int:
        """A descriptor that turns readable when the process has exited."""
        with self._end_lock:
            if self._pidfd is not None:
                return os.dup(self._pidfd)
        # Ended and reported already: one that is readable now.
        read_end, write_end = os.pipe()
        os.write(write_end, b"x")
        os.close(write_end)
        return read_end

    def _ended(self, code: int) -> None:
        with self._end_lock:
            if self._exited.is_set():
                return  # told twice (its channel, then a zygote that woke up)
            self.returncode = code
            fd, self._pidfd = self._pidfd, None
            if fd is not None:
                os.close(fd)
            status, self._status = self._status, None
            if status is not None:
                status.close()
            self._exited.set()

    def _told_code(self) -> int | None:
        """The exit code the child sent as it ended, if it did."""
        with self._end_lock:
            status = self._status
            if status is None:
                return None
            # What the job's process wrote there: the job may have written
            # anything. One short line, a number in it, or nothing.
            with contextlib.suppress(OSError):
                status.setblocking(False)
                said = status.recv(1 << 16)
                match = _EXIT_LINE.search(said)  # the last thing it sent
                if match is not None:
                    return int(match.group(1))
            return None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, as the zygote reports it; or, from a zygote that
        does not (stopped: a job of the worker's user can), as the child
        sent it over its channel, the zygote then ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._exited.wait(_left(deadline, REPORT_WAIT_S)):
            if self._gone():
                code = self._told_code()
                self._zygote._give_up(f"it did not report the end of its child {self.pid}")
                self._ended(-signal.SIGKILL if code is None else code)
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    # The pidfd is used under _end_lock only: closed by _ended on another
    # thread, its number could be another descriptor's by the next call.

    def _gone(self) -> bool:
        """Whether the process has exited (its pidfd turned readable)."""
        with self._end_lock:
            fd = self._pidfd
            if fd is None:
                return False
            with contextlib.suppress(OSError, ValueError):
                return bool(select.select([fd], [], [], 0)[0])
            return False

    def send_signal(self, sig: int) -> None:
        with self._end_lock:
            fd = self._pidfd
            if self.returncode is None and fd is not None:
                with contextlib.suppress(ProcessLookupError, OSError):
                    signal.pidfd_send_signal(fd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close_unreleased(self) -> None:
        """It will not run (its task ended first): end it, and its pipes."""
        if self._channel is not None:
            self._channel.close()  # the child finds no task and exits
            self._channel = None
            for fd in self._write_ends:
                os.close(fd)
            self._write_ends = []
        self.wait(timeout=10.0)
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()


class Zygote:
    """One ready interpreter, for one key; its children are tasks' processes."""

    def __init__(
        self,
        env: Mapping[bytes, bytes],
        preload: Sequence[str],
        key: Key,
        user: RunAs | None = None,
    ) -> None:
        """``user``: the jobs' user (``--run-as``), whom it runs as: a job
        then reaches no process of root's, and the zygote's memory, hash
        secret and address layout are shared by that user's jobs only."""
        self.key = key
        self.user = user
        self.state = "starting"  # then "ready", "unready" or "dead"
        self.why: str | None = None  # when not ready: why
        self.info: dict[str, Any] = {}
        self.modules: frozenset[str] = frozenset()
        self.ready = threading.Event()  # set once it is ready or never will be
        self.started = threading.Event()  # it runs, and is no longer dumpable
        self._lock = threading.Lock()  # one fork request at a time
        self._pids: queue.Queue[int | None] = queue.Queue()
        self._children: dict[int, WarmProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before their process was known
        self._children_lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._control = ours
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(ZYGOTE), str(theirs.fileno()), ",".join(preload)],
                env=env,
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                close_fds=True,
                user=None if user is None else user.uid,
                group=None if user is None else user.gid,
                extra_groups=None if user is None else list(user.groups),
            )
        except OSError as e:  # its Python out of the user's reach, say: cold, saying so
            ours.close()
            theirs.close()
            who = "" if user is None else f" as {user.name}"
            self.state, self.why = "unready", f"the ready interpreter could not start{who}: {e}"
            self.ready.set()
            return
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read, name="gpulayer-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                message, _ = protocol.receive(self._control)
                if message is None:
                    break
                kind = message[0]
                if kind == "hello":
                    self.started.set()
                elif kind == "ready" and isinstance(message[1], dict):
                    self.info = message[1]
                    self.modules = frozenset(str(m) for m in self.info.get("modules", []))
                    self.state = "ready"
                    self.ready.set()
                elif kind == "unready":
                    self.why = str(message[1])[:500]
                    self.state = "unready"
                    self.ready.set()
                elif kind == "pid" and isinstance(message[1], int):
                    self._pids.put(message[1])
                elif kind == "exit" and all(isinstance(v, int) for v in message[1:3]):
                    self._exit(message[1], os.waitstatus_to_exitcode(message[2]))
        except (OSError, ValueError):  # gone, or it said something that is no message
            pass
        finally:
            if self.state in ("starting", "ready"):
                assert self.proc is not None
                self.state = "dead"
                self.why = self.why or f"the ready interpreter exited ({self.proc.wait()})"
            self.ready.set()
            self._pids.put(None)
            self._orphaned()

    def _exit(self, pid: int, code: int) -> None:
        with self._children_lock:
            child = self._children.pop(pid, None)
            if child is None:
                self._early[pid] = code
                return
        child._ended(code)

    def _orphaned(self) -> None:
        """The zygote died: its children still running have no one to
        report their exit. Each is watched through its pidfd; its status is
        the worker's to take if the child came to it (it is the subreaper)."""
        with self._children_lock:
            left = list(self._children.values())
            self._children.clear()
        for child in left:
            threading.Thread(target=_watch_orphan, args=(child,), daemon=True).start()

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[bytes, bytes],
        run_as: RunAs | None = None,
    ) -> WarmProcess:
        """A held child for this task (see :meth:`WarmProcess.release`)."""
        if (run_as is None) != (self.user is None) or (
            run_as is not None and self.user is not None and run_as.uid != self.user.uid
        ):
            raise WarmUnavailable("it is another user's")  # never: chosen by user
        # The child is its zygote's user already: no change of ids.
        task: dict[str, Any] = {
            "argv": list(argv),
            "cwd": os.fspath(cwd),
            "env": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in env.items()],
        }
        fds: list[int] = []
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fds.extend(os.pipe2(os.O_CLOEXEC))
            fds.extend(os.pipe2(os.O_CLOEXEC))
            with self._lock:
                if self.state != "ready":
                    raise WarmUnavailable(f"it is {self.state}")
                try:
                    protocol.send(self._control, ("fork",), fds=[theirs.fileno()])
                    pid = self._pids.get(timeout=FORK_TIMEOUT_S)
                except (OSError, queue.Empty) as e:
                    self._give_up(f"it did not answer ({type(e).__name__})")
                    raise WarmUnavailable("it did not answer") from e
            if pid is None:
                raise WarmUnavailable("it exited")
            try:
                child = WarmProcess(self, pid, ours, task, (fds[0], fds[1], fds[2], fds[3]))
            except ProcessLookupError as e:  # its spare was killed meanwhile
                raise WarmUnavailable(f"its child {pid} was gone at once") from e
        except BaseException:
            ours.close()
            for fd in fds:
                os.close(fd)
            raise
        finally:
            theirs.close()
        with self._children_lock:
            early = self._early.pop(pid, None)
            if early is None:
                self._children[pid] = child
        if early is not None:
            child._ended(early)
        return child

    def _give_up(self, why: str) -> None:
        """It is stuck: killed, so that the next task finds it dead and a
        new one is made (its reader then tells its children's waiters)."""
        self.why = f"the ready interpreter was ended: {why}"
        self.state = "dead"
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()

    def close(self) -> None:
        """Stop it; its children (tasks) are left to their boxes."""
        if self.proc is None:
            return  # it never started
        # Read first: the reader calls it dead as soon as the socket is shut.
        was_ready = self.state == "ready"
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_RDWR)
        self._control.close()
        if not was_ready:
            # In its imports it would see the end only after them (seconds,
            # with torch); stuck or dead, never: killed at once.
            self.proc.kill()
        try:
            self.proc.wait(timeout=5.0)  # a ready one leaves as it reads the end
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5.0)


def from_environment(
    base_env: Mapping[bytes, bytes],
    *,
    warm: bool | None,
    preload: Sequence[str] | None,
    eager: bool,
    users: Sequence[RunAs | None] = (None,),
) -> WarmStarts | None:
    """The worker's warm starts, or None (cold only): ``warm`` None reads
    ``GPULAYER_WARM`` (on unless "0"), ``preload`` None ``GPULAYER_PRELOAD``
    (a comma-separated list; empty: a zygote that imports nothing)."""
    mode = os.environ.get(WARM_ENV, "1") if warm is None else ("1" if warm else "0")
    if mode not in WARM_MODES:
        raise WorkerError(
            f"{WARM_ENV}={mode!r} is not one of {', '.join(WARM_MODES)} (0: every job starts "
            f"cold; 1: warm, the zygote made once a first job has run in this process, at once "
            f"in a worker of its own; eager: made at once; ready: made at once and waited for)"
        )
    if mode == "0" or not supported():
        return None
    if preload is None:
        listed = os.environ.get(PRELOAD_ENV)
        preload = DEFAULT_PRELOAD if listed is None else [m for m in listed.split(",") if m]
    env = dict(base_env)
    env.setdefault(b"PYTHONUNBUFFERED", b"1")  # as every task's (see TaskRun._launch)
    starts = WarmStarts(
        env, preload=preload, eager=eager or mode in ("eager", "ready"), users=users
    )
    if mode == "ready":
        starts.prepare(RANK_SETTINGS)  # the direct launcher's ranks' too
        if not starts.wait_ready():
            log.warning(
                "the worker's ready interpreters are not ready: %s",
                "; ".join(f"{z.state}: {z.why}" for z in starts.zygotes),
            )
    return starts


def supported() -> bool:
    """Linux's pidfds and /proc, which the worker's side relies on."""
    return (
        hasattr(os, "pidfd_open")
        and hasattr(signal, "pidfd_send_signal")
        and (os.path.isdir("/proc/self/task"))
    )


def _watch_orphan(child: WarmProcess) -> None:
    if child.returncode is not None:
        return
    fd = child.exit_fd()  # its own copy: the child's may be closed meanwhile
    try:
        with contextlib.suppress(OSError):
            select.select([fd], [], [])
        code: int | None = None
        p_pidfd = getattr(os, "P_PIDFD", None)
        if p_pidfd is not None:
            # Ours to reap where it came back to this process (a subreaper).
            with contextlib.suppress(ChildProcessError, OSError):
                result = os.waitid(p_pidfd, fd, os.WEXITED)
                if result is not None:
                    exited = result.si_code == os.CLD_EXITED
                    code = result.si_status if exited else -result.si_status
    finally:
        os.close(fd)
    if code is None:
        code = child._told_code()
    if code is None:
        # It ended without saying so: killed (or it closed its channel).
        log.warning("task process %d ended after its zygote died, without its exit code", child.pid)
        code = -signal.SIGKILL
    child._ended(code)


class WarmStarts:
    """The zygotes of one worker process, by key, made as tasks need them."""

    def __init__(
        self,
        base_env: Mapping[bytes, bytes],
        *,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        eager: bool = False,
        users: Sequence[RunAs | None] = (None,),
        max_zygotes: int = MAX_ZYGOTES,
    ) -> None:
        """``eager``: the zygote for the worker's own settings is made now
        (a worker of its own, which lives long); else once the first script
        task has run (embedded, where the program may run just one job: the
        zygote's imports would only compete with it for the CPU).

        ``users``: whom the jobs run as (``--run-as``; None: the worker's
        user). Each has zygotes of its own, run as it, ``max_zygotes`` at most."""
        self.base_env = dict(base_env)
        self.preload = tuple(preload)
        self.max_zygotes = max_zygotes
        self.users = list(dict.fromkeys(users))
        self._lock = threading.Lock()
        self._made = threading.Condition(self._lock)  # as the wanted ones are made
        self._zygotes: dict[tuple[int | None, Key], Zygote] = {}
        # To make once the task that wanted it is done.
        self._wanted: list[tuple[Key, RunAs | None]] = []
        self._closed = False
        self._deaths: dict[tuple[int | None, Key], int] = {}
        self.default_key = key_of(self.base_env)
        if eager:
            for user in self.users:
                self._make(self.default_key, user)
            # Until each is past its start, its user's processes could read
            # its environment (as for any program, see credentials.py): a
            # worker of its own takes no job before.
            for zygote in self._zygotes.values():
                if zygote.proc is not None:
                    zygote.started.wait(STARTED_TIMEOUT_S)

    def _make(self, key: Key, user: RunAs | None) -> Zygote | None:
        """Under no lock of a zygote's; with ``_lock`` held or at start."""
        uid = None if user is None else user.uid
        if sum(1 for owner, _ in self._zygotes if owner == uid) >= self.max_zygotes:
            return None
        env = {k: v for k, v in self.base_env.items() if not read_at_start(k)}
        env.update(key)
        if user is not None:
            env.update(user.env())
        # It never touches a GPU; should a preloaded module try, it finds none.
        env.update({b"CUDA_VISIBLE_DEVICES": b"", b"HIP_VISIBLE_DEVICES": b"-1"})
        env[b"ROCR_VISIBLE_DEVICES"] = b""
        zygote = Zygote(env, self.preload, key, user)
        self._zygotes[(uid, key)] = zygote
        return zygote

    def choose(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[bytes, bytes],
        run_as: RunAs | None = None,
    ) -> tuple[Zygote | None, str]:
        """The zygote to fork this task's process from, or None and why it
        starts cold."""
        key = key_of(env)
        uid = None if run_as is None else run_as.uid
        with self._lock:
            if self._closed:
                return None, "the worker is stopping"
            zygote = self._zygotes.get((uid, key))
            if zygote is not None and zygote.state == "dead":
                why = zygote.why or "the ready interpreter died"
                deaths = self._deaths[(uid, key)] = self._deaths.get((uid, key), 0) + 1
                if not zygote.info or deaths > MAX_REMAKES:
                    # Died before it was ever ready, or again and again: it
                    # would only die again, each time after an import of torch.
                    zygote.state = "unready"
                    zygote.why = f"{why}; not made again (it died {deaths} times)"
                    return None, zygote.why
                # Made again when it dies; the task that finds it dead goes cold.
                del self._zygotes[(uid, key)]
                threading.Thread(target=zygote.close, daemon=True).start()
                self._make(key, run_as)
                return None, f"{why}; a new one is starting"
            if zygote is None:
                unsafe = _not_for_a_zygote(key, self.default_key)
                if unsafe is not None:
                    return None, unsafe
                wanted = (key, run_as)
                mine = sum(1 for owner, _ in self._zygotes if owner == uid)
                mine += sum(1 for _, user in self._wanted if (user and user.uid) == uid)
                if mine >= self.max_zygotes and wanted not in self._wanted:
                    differs = _describe(key, self.default_key)
                    return None, f"no ready interpreter for {differs} (at most {self.max_zygotes})"
                if wanted not in self._wanted:
                    self._wanted.append(wanted)
                if key == self.default_key:
                    return None, "the ready interpreter starts once a first job has run"
                differs = _describe(key, self.default_key)
                return None, f"the ready interpreter for {differs} starts once this job has run"
        if zygote.state == "starting":
            return None, "the ready interpreter is still starting"
        if zygote.state != "ready":
            return None, zygote.why or f"the ready interpreter is {zygote.state}"
        shadow = _shadowed(argv, cwd, env, zygote.modules)
        if shadow is not None:
            return None, shadow
        return zygote, ""

    def task_done(self) -> None:
        """A task ended: make the zygotes tasks asked for (see ``eager``)."""
        with self._lock:
            if self._closed:
                return
            wanted, self._wanted = self._wanted, []
            for key, user in wanted:
                if ((None if user is None else user.uid), key) not in self._zygotes:
                    self._make(key, user)
            self._made.notify_all()

    def prepare(self, extra: Mapping[bytes, bytes] | None = None) -> list[Zygote]:
        """Make the zygotes for the worker's settings with ``extra`` over
        them now, for each of its jobs' users, where there are none
        (benchmarks, tests, a worker told to)."""
        key = key_of({**self.base_env, **(extra or {})})
        made = []
        with self._lock:
            if self._closed:
                return []
            for user in self.users:
                uid = None if user is None else user.uid
                zygote = self._zygotes.get((uid, key)) or self._make(key, user)
                if zygote is not None:
                    made.append(zygote)
        return made

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Whether every zygote made so far, or wanted by a task that ran,
        is ready (for tests and benchmarks): waits up to ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._made.wait_for(lambda: not self._wanted or self._closed, timeout)
            zygotes = list(self._zygotes.values())
        return all(
            z.ready.wait(max(0.0, deadline - time.monotonic())) and z.state == "ready"
            for z in zygotes
        )

    @property
    def zygotes(self) -> list[Zygote]:
        with self._lock:
            return list(self._zygotes.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            zygotes, self._zygotes = list(self._zygotes.values()), {}
            self._made.notify_all()
        for zygote in zygotes:
            zygote.close()


def _shadowed(
    argv: Sequence[str], cwd: Path, env: Mapping[bytes, bytes], modules: frozenset[str]
) -> str | None:
    """Where a cold start would import a module the zygote has, from the
    script's folder or the task's ``PYTHONPATH``: its own copy, not the
    zygote's."""
    script = Path(cwd, argv[1])
    folders = [os.path.dirname(os.path.realpath(script))]
    pythonpath = os.fsdecode(env.get(b"PYTHONPATH", b""))
    folders += protocol._pythonpath(pythonpath, os.fspath(cwd))
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            stem = name.partition(".")[0]
            if stem in modules and (name == stem or name.endswith((".py", ".so", ".pyc"))):
                return f"{os.path.join(folder, name)} would be imported instead of the preloaded {stem}"
    return None
