"""The ready interpreter: a Python that has imported the preload set and
forks, on request, into a task's script (see ``warm/``, the worker's side,
and docs/adr/0023-warm-start.md).

This file runs as a program (``python zygote.py FD PRELOAD``), never imported
by the worker: every module it imports is in every task it starts, so it
imports the standard library only, and nothing of GPUlayer's.

The zygote holds no job's data, ever. The worker sends it one descriptor
per task, one end of a socket pair; the zygote forks, and only the child
reads the task (its argv, environment, directory, user and output pipes)
from it. So what one task was given cannot be found in another's memory.

Protocol (JSON lists, each framed by a 4-byte length; descriptors ride on
the first byte of a frame; a child's last word is a line of text):

    worker -> zygote   ("fork",) + fd       fork a child that reads its task from fd
                                            (asked ahead of any task: the child
                                            waits for it, primed; see warm.Zygote)
    zygote -> worker   ("ready", info)      preloaded, single-threaded, forking
                       ("unready", why)     will not fork; exits
                       ("pid", pid)         the child forked for the last "fork"
                       ("exit", pid, st)    a child ended (its raw wait status)
    worker -> child    ("task", task) + fds (stdout, stderr)
    child -> worker    ("go",) | ("error", errno, message), then b"exit CODE\n"
"""

# ruff: noqa: E402 - the imports come after the startup modules are listed

from __future__ import annotations

import sys

# What a cold interpreter has imported too, before the script's first line:
# a module of another name in the script's folder is the script's to
# import, and a warm start would not (see warm/starts.py, _shadowed).
_STARTUP_MODULES = frozenset(sys.modules)

if __name__ == "__main__":
    del sys.path[0]  # this file's folder: never a place to import from

# After the path fix and the list above: every import below (E402). Each
# is in every child: it is in the list of modules the worker checks.
import array
import atexit
import builtins
import contextlib
import fcntl
import gc
import importlib.machinery
import json
import os
import select
import signal
import socket
import threading
import time
import types
from typing import Any

_CHANNEL_FD = 1000  # the lowest a child's channel to the worker may take
_SIGNALS = {
    sig: signal.getsignal(sig) for sig in signal.valid_signals() if sig not in (9, 19)
}  # every disposition as Python left it at start, to give each child back


def send(sock: socket.socket, message: tuple[Any, ...], fds: list[int] | None = None) -> None:
    # JSON, not marshal or pickle: the worker reads what a zygote or a child
    # sends, and either may be running a job's user's code by then.
    data = json.dumps(message).encode()
    frame = len(data).to_bytes(4, "little") + data
    if fds:
        sent = sock.sendmsg(
            [frame[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        )
        frame = frame[sent:]
    sock.sendall(frame)


def receive(
    sock: socket.socket, max_fds: int = 0, limit: int = 1 << 20
) -> tuple[list[Any] | None, list[int]]:
    """One message and the descriptors it carried; (None, []) at the end.
    A frame over ``limit`` bytes is refused (ValueError), never read."""
    fds: list[int] = []
    head = b""
    if max_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, 4, max_fds)
        if not head:
            return None, fds
    while len(head) < 4:
        more = sock.recv(4 - len(head))
        if not more:
            return None, fds
        head += more
    size = int.from_bytes(head, "little")
    if size > limit:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a message of {size} bytes, over {limit}")
    data = bytearray()
    while len(data) < size:
        more = sock.recv(min(size - len(data), 1 << 20))
        if not more:
            return None, fds
        data += more
    message = json.loads(data)
    if not isinstance(message, list) or not message:
        raise ValueError("not a message")
    return message, fds


def _threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:
            continue
    return names


def _unready(preloaded: list[str]) -> str | None:
    """Why forking now would not give a child what a cold start gives."""
    names = _threads()
    if len(names) > 1:
        return f"the ready interpreter runs {len(names)} threads ({', '.join(sorted(names))})"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "the ready interpreter has initialised CUDA"
    return None


def _settle() -> None:
    """Let the preload's libraries stop their threads: OpenBLAS (numpy's,
    started at import) ends its pool before a fork, in a handler of its own,
    and starts it again when next needed. A fork of nothing does it."""
    if len(_threads()) > 1:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)


def _quiet_finalizers() -> None:
    """The preload's ``weakref.finalize`` objects (torch has one per
    operator library) would run at each child's exit: only to tidy the
    memory of a process about to end, for 10 to 30 ms. They are the
    zygote's, not the task's; a task's own still run."""
    import weakref

    registry = getattr(weakref.finalize, "_registry", {})
    for info in registry.values():
        info.atexit = False


def _first_calls() -> None:
    """Make once here what each child's first call would make again: numpy
    seeding (its first call imports and builds for 15 to 30 ms) and the
    type checks of _flush_files."""
    import io

    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    for kind in (io.FileIO, io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper, io.BytesIO):
        issubclass(kind, io.IOBase)
    # A process's first compile() sets up the parser and compiler: about
    # 1 ms, which each child would pay again for its script. Compiled only.
    compile(_WARM_UP, "<warm-up>", "exec", dont_inherit=True)


_WARM_UP = """\
import os.path as p, sys
from os import sep as s
@staticmethod
def f(a, /, b=1, *c, d, **e) -> None:
    global g
    x = [i for i in c if i] + [*c]; y = {k: v for k, v in e.items()}
    z = lambda q: (yield q) if q else f"{a!r:>{b}} {1.5e3}"
    with open(a) as h, open(b):
        pass
    try:
        assert a, b
    except (ValueError, KeyError) as err:
        raise RuntimeError() from err
    finally:
        del x
    while a < b or not c:
        break
    for i, j in zip(c, c):
        continue
    return a if b else -d ** 2 // 3 % 4 @ e
class C(object, metaclass=type):
    x: int = 0
    async def m(self):
        async with self as a:
            await a
        async for _ in self:
            pass
match sys.argv:
    case [str(n), *_] | {"k": n}:
        pass
"""


def _base_path() -> list[str]:
    """``sys.path`` but for what this start's ``PYTHONPATH`` put first:
    each child puts its own there (see ``_child_path``)."""
    path = list(sys.path)
    for entry in _pythonpath(os.environ.get("PYTHONPATH", ""), os.getcwd()):
        if path and path[0] == entry:
            path.pop(0)
    return path


def _pythonpath(value: str, cwd: str) -> list[str]:
    # As CPython's getpath does: each entry made absolute, an empty one the cwd.
    return (
        [os.path.normpath(os.path.join(cwd, p)) for p in value.split(os.pathsep)] if value else []
    )


_LIBC: Any = None  # libc through ctypes, loaded once here rather than in each child


def _dumpable(on: bool) -> None:
    """``prctl(PR_SET_DUMPABLE)``. The zygote is not dumpable, as its
    worker is not (credentials.py): a job of the worker's user could else
    read its memory or attach to it, and so to every later job's start.
    Each child is again, as a cold process is (its user may attach py-spy);
    it holds nothing but the preload and its own task (see the module)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    _LIBC.prctl(4, 1 if on else 0, 0, 0, 0)  # PR_SET_DUMPABLE, <linux/prctl.h>


def main() -> None:
    _dumpable(False)
    control = socket.socket(fileno=int(sys.argv[1]))
    send(control, ("hello",))  # not dumpable from now on (a worker waits for it)
    # Ctrl-C at the terminal of an embedded worker's program reaches its
    # process group, the zygote's too: the program decides, not the zygote.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    preload = [name for name in sys.argv[2].split(",") if name]
    preloaded, failed = [], []
    for name in preload:
        try:
            __import__(name)
            preloaded.append(name)
        except ImportError:
            continue  # "when importable": not installed here
        except Exception as e:  # say why, and start cold
            failed.append(f"{name}: {type(e).__name__}: {e}")
    base = _base_path()
    _quiet_finalizers()
    _first_calls()
    _settle()
    gc.collect()
    # Moved out of the collector's sight: a child's collections then never
    # touch (and copy) the preloaded objects' pages, and its list of live
    # objects (see _flush_files) holds only its own.
    gc.freeze()
    why = "; ".join(failed) or _unready(preloaded)
    if why is not None:
        send(control, ("unready", why))
        return
    imported = sorted({m.partition(".")[0] for m in set(sys.modules) - _STARTUP_MODULES})
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    send(control, ("ready", {"modules": imported, "preloaded": preloaded, "rss": rss}))
    _Loop(control, preloaded, base).run()


class _Loop:
    """Fork on request; tell the worker of each child's end.

    One child is forked ahead, a *spare* that waits for its task's
    descriptor: a request is then answered at once. The fork (copying the
    page tables of a process that holds torch: milliseconds) happens before
    the request, at start and as a child ends."""

    def __init__(self, control: socket.socket, preloaded: list[str], base: list[str]) -> None:
        self.control = control
        self.preloaded = preloaded
        self.base = base
        # A child's end wakes the loop through this pipe (SIGCHLD's handler
        # is Python's own, which writes to the wakeup descriptor).
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.spare: tuple[int, socket.socket] | None = None

    def run(self) -> None:
        self._fork_spare()
        while True:
            ready, _, _ = select.select([self.control.fileno(), self.wake_r], [], [])
            if self.wake_r in ready:
                while True:
                    try:
                        os.read(self.wake_r, 4096)
                    except BlockingIOError:
                        break
                self._reap()
            if self.control.fileno() in ready:
                message, fds = receive(self.control, max_fds=1)
                if message is None:
                    return  # the worker is gone: the children are its tasks, left running
                if message[0] != "fork" or not fds:
                    for fd in fds:
                        os.close(fd)
                    continue
                if not self._hand(fds[0]):
                    return

    def _hand(self, channel_fd: int) -> bool:
        """Give the spare (or, if it is gone, a new fork) the task's channel."""
        try:
            spare, self.spare = self.spare, None
            if spare is None:
                spare = self._fork()
                if spare is None:
                    return False
            pid, sock = spare
            try:
                socket.send_fds(sock, [b"t"], [channel_fd])
            except OSError:  # the spare died (killed): fork one for this task
                sock.close()
                spare = self._fork()
                if spare is None:
                    return False
                pid, sock = spare
                socket.send_fds(sock, [b"t"], [channel_fd])
            sock.close()
        finally:
            os.close(channel_fd)
        send(self.control, ("pid", pid))
        # The next spare is forked once a child has ended, not now: its
        # copy would compete with the task just started for the CPU.
        return True

    def _fork_spare(self) -> None:
        if self.spare is None:
            self.spare = self._fork()

    def _fork(self) -> tuple[int, socket.socket] | None:
        why = _unready(self.preloaded)
        if why is not None:
            send(self.control, ("unready", why))
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # What the loop made since is out of the child's collections too:
        # they would write to (copy) its pages (see gc.freeze in main).
        gc.collect()
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _child(theirs, self.control, (self.wake_r, self.wake_w), self.base)  # never returns
        theirs.close()
        return pid, ours

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.spare is not None and self.spare[0] == pid:
                self.spare[1].close()  # never given a task: not the worker's to know
                self.spare = None
                continue
            send(self.control, ("exit", pid, status))
            if self.spare is None:
                self.spare = self._fork()


# -- in the child --------------------------------------------------------------


def _child(
    spare: socket.socket, control: socket.socket, wake: tuple[int, int], base: list[str]
) -> None:
    try:
        control.close()
        for fd in wake:
            os.close(fd)
        # A spare until its task's channel comes (or the zygote ends).
        _, fds, _, _ = socket.recv_fds(spare, 1, 1)
        spare.close()
        if not fds:
            os._exit(0)
        # Connected to the worker now, which asked for it ahead of its task
        # (warm.Zygote._prime): what does not depend on the task is done
        # while it waits, off the task's start.
        channel = _detach(fds[0])
        message, task_fds = receive(channel, max_fds=2, limit=1 << 28)
        if message is None or message[0] != "task" or len(task_fds) != 2:
            os._exit(1)  # the worker went away before sending it
        task = message[1]
        try:
            script = _enter(task, task_fds, base)
        except OSError as e:
            send(channel, ("error", e.errno or 0, str(e)))
            os._exit(1)
        send(channel, ("go",))
    except BaseException:  # a child never returns into the zygote's loop
        os._exit(1)
    me = os.getpid()
    code = _run(script, task["argv"])
    # Its status, for the worker to know should the zygote (which reports
    # each child's end) have died meanwhile: the task's process only, not a
    # child the script forked that ran on to the end of it.
    if os.getpid() == me:
        with contextlib.suppress(OSError):
            channel.sendall(f"exit {code}\n".encode())
    os._exit(code)


def _detach(channel_fd: int) -> socket.socket:
    """What ``Popen`` and a cold start give every task alike: its own
    session, the signal dispositions and mask Python starts with, stdin
    ``/dev/null`` and no other descriptor but the channel (kept open while
    the script runs, out of the way of the descriptors it opens, a cold
    start's first is 3, and of what it executes)."""
    os.setsid()
    signal.set_wakeup_fd(-1)
    for sig, handler in _SIGNALS.items():
        if handler is not None:
            try:
                signal.signal(sig, handler)
            except (OSError, ValueError):
                continue
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    high = fcntl.fcntl(channel_fd, fcntl.F_DUPFD_CLOEXEC, _CHANNEL_FD)
    os.close(channel_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    keep = {0, 1, 2, high}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                continue  # the listing's own descriptor, closed already
    return socket.socket(fileno=high)


def _enter(task: dict[str, Any], task_fds: list[int], base: list[str]) -> str:
    """Become the task's process, as ``Popen`` and a cold start would make it."""
    for fd, target in zip(task_fds, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    _dumpable(True)
    os.chdir(task["cwd"])
    # The environment first: whatever runs next reads the task's. What
    # differs from the zygote's only (os.environ.clear() alone took 0.5 ms).
    env = {k.encode("latin-1"): v.encode("latin-1") for k, v in task["env"]}  # bytes, as text
    for key in [k for k in os.environb if k not in env]:
        del os.environb[key]
    for key, value in env.items():
        if os.environb.get(key) != value:
            os.environb[key] = value
    time.tzset()
    argv: list[str] = task["argv"]
    script = os.path.abspath(argv[1])
    sys.argv = list(argv[1:])
    sys.orig_argv = list(argv)
    sys.path[:] = [
        *([] if sys.flags.safe_path else [os.path.dirname(os.path.realpath(script))]),
        *_pythonpath(os.environ.get("PYTHONPATH", ""), os.getcwd()),
        *base,
    ]
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:  # imported by the preload: found again from this TMPDIR
        tempfile.tempdir = None  # type: ignore[attr-defined]
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # its global generator, seeded at import: each process its own
    return script


def _run(script: str, argv: list[str]) -> int:
    """Run the script as ``__main__``; its exit status, once ended as a
    cold interpreter ends (threads joined, ``atexit``, files closed, streams
    flushed) but without tearing down every module (the slow part with
    torch)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __loader__=importlib.machinery.SourceFileLoader("__main__", script),
        __spec__=None,
        __annotations__={},
        __builtins__=builtins,
        __file__=script,
        __cached__=None,
    )
    sys.modules["__main__"] = main
    code = 0
    interrupted = False
    try:
        with open(script, "rb") as f:
            source = f.read()
    except OSError as e:  # as CPython says it, and its status
        print(
            f"{sys.orig_argv[0]}: can't open file {script!r}: [Errno {e.errno}] {e.strerror}",
            file=sys.stderr,
        )
        sys.stderr.flush()
        return 2
    compiled: types.CodeType | None
    try:
        compiled = compile(source, script, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        # CPython reads a script's file with a tokenizer of its own, whose
        # words (and the line it shows) differ from compile()'s on bytes:
        # a script that does not compile is left to a real interpreter, as
        # cold. The process is the task's already: its pid, session,
        # descriptors (the channel closes on exec), directory, environment.
        with contextlib.suppress(OSError):
            os.execv(sys.executable, sys.orig_argv)
        compiled = None  # no interpreter to run: the error is reported below
    try:
        if compiled is None:
            compiled = compile(source, script, "exec", dont_inherit=True)  # raises it again
        exec(compiled, main.__dict__)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        sys.last_type, sys.last_value = type(e), e
        tb = e.__traceback__
        # Only the script's frames, as a cold start prints: not this one
        # (Python's hook prints the exception's own traceback).
        e = e.with_traceback(tb.tb_next if tb is not None else None)
        try:
            sys.excepthook(type(e), e, e.__traceback__)
        except BaseException as hook_error:  # as CPython reports a failing hook
            print("Error in sys.excepthook:", file=sys.stderr)
            hook_tb = hook_error.__traceback__
            hook_error = hook_error.with_traceback(hook_tb.tb_next if hook_tb else None)
            sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
            print("\nOriginal exception was:", file=sys.stderr)
            sys.__excepthook__(type(e), e, e.__traceback__)
        code = 1
    # What Py_Finalize waits for first: the threads that are not daemons
    # (and, as there, whatever goes wrong in it is not the script's status).
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]

    atexit._run_exitfuncs()
    _close_files(main)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # as Python's exit when its streams cannot be flushed
            code = 120
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as Python ends on an uncaught KeyboardInterrupt
    return code


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        # CPython takes a C long (-1, so 255, when it does not fit), then
        # the system keeps the low byte.
        return e.code & 0xFF if -(2**63) <= e.code < 2**63 else 255
    with contextlib.suppress(Exception):
        print(e.code, file=sys.stderr)
    return 1


def _close_files(main: types.ModuleType) -> None:
    """Close what the script left open, as a cold interpreter's teardown
    does: a file's buffer written out, and a gzip or zip file's end written
    (by its close, or its ``__del__``). First ``__main__``'s names go, as the
    teardown begins with them; then every file object still open is
    closed, wrappers before what they wrap. Only objects made since the
    fork are in the collector's list (see gc.freeze above)."""
    import io

    with contextlib.suppress(Exception):
        main.__dict__.clear()
    gc.collect()
    left = []
    ranks: dict[type, int | None] = {}  # each type's checked once (an ABC's check is slow)
    for obj in gc.get_objects():
        # type(), not isinstance(): that would read the object's own
        # __class__, which some run code for (torch's deprecated names warn).
        kind = type(obj)
        if kind in ranks:
            rank = ranks[kind]
        elif not issubclass(kind, io.IOBase):
            rank = ranks[kind] = None
        elif issubclass(kind, io.TextIOBase):
            rank = ranks[kind] = 0
        elif issubclass(kind, (io.BufferedWriter, io.BufferedReader, io.BufferedRandom)):
            rank = ranks[kind] = 2
        elif issubclass(kind, io.BufferedIOBase):
            rank = ranks[kind] = 1  # gzip, bz2, lzma: over a buffer or file of their own
        else:
            rank = ranks[kind] = 3
        if rank is not None and obj is not sys.stdout and obj is not sys.stderr:
            left.append((rank, obj))
    for _, obj in sorted(left, key=lambda pair: pair[0]):
        if obj is sys.stdin:
            continue
        try:
            if not obj.closed:
                obj.close()
        except Exception:  # as a failed close at exit is ignored
            continue


if __name__ == "__main__":
    main()
