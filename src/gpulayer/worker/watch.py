"""Watching a running task from one thread: its output, its exit, its deadline.

One ``poll`` set holds the stdout and stderr pipes of the task's process
(or of each of its ranks) and, for each, a descriptor that becomes readable
when it exits (a pidfd on Linux; elsewhere a pipe written by a small waiter
thread). The task's thread blocks in
``poll`` until one of them is ready or the deadline passes, so a task costs
one thread, and nothing sleeps or polls on a timer.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence

from .. import defaults
from .process import TaskProcess

Emit = Callable[[str, str], None]  # (stream, text)
IndexedEmit = Callable[[int, str, str], None]  # (which process, stream, text)
_CUT = " [gpulayer: line cut at {limit} bytes]"
_POLL_MAX_MS = 24 * 3600 * 1000  # a day: well inside poll()'s 32-bit milliseconds


class LineSplitter:
    """Bytes in, whole lines out; a line longer than ``limit`` is cut."""

    def __init__(self, stream: str, emit: Emit, limit: int = defaults.LOG_LINE_MAX_BYTES) -> None:
        self.stream = stream
        self.emit = emit
        self.limit = limit
        self.buf = bytearray()
        self.skipping = False  # inside the rest of a line already cut

    def _out(self, raw: bytes | bytearray, cut: bool = False) -> None:
        text = bytes(raw).rstrip(b"\r").decode("utf-8", "replace")
        self.emit(self.stream, text + _CUT.format(limit=self.limit) if cut else text)

    def feed(self, data: bytes) -> None:
        self.buf += data
        start = 0
        buf = self.buf
        while True:
            end = buf.find(b"\n", start)
            if end < 0:
                break
            if self.skipping:
                self.skipping = False
            elif end - start > self.limit:
                self._out(buf[start : start + self.limit], cut=True)
            else:
                self._out(buf[start:end])
            start = end + 1
        del buf[:start]
        if len(buf) > self.limit:
            if not self.skipping:
                self._out(buf[: self.limit], cut=True)
                self.skipping = True
            buf.clear()

    def close(self) -> None:
        if self.buf and not self.skipping:
            self._out(self.buf)
        self.buf.clear()


def _exit_fd(proc: TaskProcess) -> tuple[int, Callable[[], None]]:
    """A descriptor that turns readable when ``proc`` exits, and its cleanup."""
    own = getattr(proc, "exit_fd", None)
    if own is not None:  # a zygote's child: its pidfd, taken before it could exit
        fd = own()
        return fd, lambda: os.close(fd)
    if hasattr(os, "pidfd_open"):
        with contextlib.suppress(OSError):
            fd = os.pidfd_open(proc.pid)
            return fd, lambda: os.close(fd)
    read_end, write_end = os.pipe()

    def waiter() -> None:
        proc.wait()
        os.write(write_end, b"x")

    threading.Thread(target=waiter, name=f"gpulayer-waiter-{proc.pid}", daemon=True).start()

    def close() -> None:
        os.close(read_end)
        os.close(write_end)

    return read_end, close


class _Watched:
    """One process of a task, as :func:`watch_all` follows it."""

    def __init__(self, index: int, proc: TaskProcess) -> None:
        self.index = index
        self.proc = proc
        self.code: int | None = None
        self.exited_at = 0.0
        self.drain_until = 0.0
        self.killed = False
        self.pipes: set[int] = set()
        exit_fd, self.close_exit_fd = _exit_fd(proc)
        self.exit_fd = exit_fd


def watch_all(
    procs: Sequence[TaskProcess],
    emit: IndexedEmit,
    *,
    deadline: float | None = None,
    on_deadline: Callable[[], None] | None = None,
    still_running_at: float | None = None,
    on_still_running: Callable[[], None] | None = None,
    on_exit: Callable[[int, int], None] | None = None,
    rest: Callable[[signal.Signals, frozenset[int]], None] | None = None,
) -> list[tuple[int, float]]:
    """Ship the output of every process in ``procs`` (the ranks of a task, or
    its one process) to ``emit(index, stream, text)`` until each has exited
    and closed its pipes.

    Returns each process's exit code and time of exit. ``on_exit(index,
    code)`` runs as each exits. ``on_deadline`` runs once when ``deadline``
    (a ``time.monotonic()`` value) passes first while any still runs;
    ``on_still_running`` once at ``still_running_at`` if any has not exited by
    then. Processes a task leaves behind in its process group get SIGTERM when
    it exits, and SIGKILL if they keep its pipes open past ``PIPE_DRAIN_S``.

    ``rest(signal, told_groups)`` reaches all the task's processes, wherever
    they went (its containment's box): once the last process has exited it
    gets the SIGTERM, to all but the groups told already as theirs exited,
    and the SIGKILL.
    """
    watched = [_Watched(i, proc) for i, proc in enumerate(procs)]
    splitters: dict[int, tuple[_Watched, LineSplitter]] = {}
    by_exit_fd: dict[int, _Watched] = {}
    poller = select.poll()
    for w in watched:
        assert w.proc.stdout is not None and w.proc.stderr is not None
        for stream, pipe in (("stdout", w.proc.stdout), ("stderr", w.proc.stderr)):
            fd = pipe.fileno()
            index = w.index
            splitters[fd] = (
                w,
                LineSplitter(stream, lambda s, t, i=index: emit(i, s, t)),  # type: ignore[misc]
            )
            w.pipes.add(fd)
            poller.register(fd, select.POLLIN)
        by_exit_fd[w.exit_fd] = w
        poller.register(w.exit_fd, select.POLLIN)
    running = len(watched)
    told: set[int] = set()  # the groups sent SIGTERM as their leader exited

    def end_rest(w: _Watched, sig: signal.Signals) -> None:
        if rest is not None and not running:
            rest(sig, frozenset(told))
            return
        with contextlib.suppress(ProcessLookupError):  # nothing was left in the group
            os.killpg(w.proc.pid, sig)
        if sig == signal.SIGTERM:
            told.add(w.proc.pid)

    try:
        while running or any(w.pipes for w in watched):
            now = time.monotonic()
            if running and deadline is not None and now >= deadline:
                if on_deadline is not None:
                    on_deadline()
                deadline = None
            if running and still_running_at is not None and now >= still_running_at:
                if on_still_running is not None:
                    on_still_running()
                still_running_at = None
            limits = [t for t in (deadline, still_running_at) if t and running]
            for w in watched:
                if w.code is None or not w.pipes:
                    continue
                if now >= w.drain_until:
                    if w.killed:
                        # Something outside the group holds the pipes: stop reading.
                        for fd in w.pipes:
                            poller.unregister(fd)
                            splitters[fd][1].close()
                        w.pipes.clear()
                        continue
                    end_rest(w, signal.SIGKILL)
                    w.killed, w.drain_until = True, now + defaults.PIPE_DRAIN_S
                limits.append(w.drain_until)
            if not running and not any(w.pipes for w in watched):
                break
            # poll() takes a 32-bit count of milliseconds (about 24.8 days): a
            # later deadline is waited for in pieces, the loop looking again.
            timeout_ms = (
                None
                if not limits
                else min(_POLL_MAX_MS, max(0, int((min(limits) - now) * 1000) + 1))
            )
            for fd, _ in poller.poll(timeout_ms):
                exited = by_exit_fd.get(fd)
                if exited is not None:
                    exited.code = code = exited.proc.wait()
                    exited.exited_at = time.time()
                    running -= 1
                    poller.unregister(fd)
                    end_rest(exited, signal.SIGTERM)
                    exited.drain_until = time.monotonic() + defaults.PIPE_DRAIN_S
                    if on_exit is not None:
                        on_exit(exited.index, code)
                    continue
                owner, splitter = splitters[fd]
                if fd not in owner.pipes:
                    continue
                data = os.read(fd, 65536)
                if data:
                    splitter.feed(data)
                else:
                    poller.unregister(fd)
                    owner.pipes.discard(fd)
                    splitter.close()
    finally:
        for w in watched:
            w.close_exit_fd()
            assert w.proc.stdout is not None and w.proc.stderr is not None
            w.proc.stdout.close()
            w.proc.stderr.close()
    return [(w.code if w.code is not None else -1, w.exited_at) for w in watched]
