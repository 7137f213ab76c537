"""Watching a running task from one thread: its output, its exit, its deadline.

One ``poll`` set holds the task's stdout and stderr pipes and a descriptor
that becomes readable when the process exits (a pidfd on Linux; elsewhere a
pipe written by a small waiter thread). The task's thread blocks in
``poll`` until one of them is ready or the deadline passes, so a task costs
one thread, and nothing sleeps or polls on a timer.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from .. import defaults

Emit = Callable[[str, str], None]  # (stream, text)
_CUT = " [gpulayer: line cut at {limit} bytes]"


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


def _exit_fd(proc: subprocess.Popen[bytes]) -> tuple[int, Callable[[], None]]:
    """A descriptor that turns readable when ``proc`` exits, and its cleanup."""
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


def watch(
    proc: subprocess.Popen[bytes],
    emit: Emit,
    *,
    deadline: float | None = None,
    on_deadline: Callable[[], None] | None = None,
    still_running_at: float | None = None,
    on_still_running: Callable[[], None] | None = None,
) -> tuple[int, float]:
    """Ship the output of ``proc`` to ``emit`` until it exits and its pipes close.

    Returns the exit code and the time of the exit. ``on_deadline`` runs once
    when ``deadline`` (a ``time.monotonic()`` value) passes first;
    ``on_still_running`` once at ``still_running_at`` if the process has not
    exited by then. Processes the
    task leaves behind in its process group get SIGTERM when it exits, and
    SIGKILL if they keep its pipes open past ``PIPE_DRAIN_S``.
    """
    assert proc.stdout is not None and proc.stderr is not None
    splitters = {
        proc.stdout.fileno(): LineSplitter("stdout", emit),
        proc.stderr.fileno(): LineSplitter("stderr", emit),
    }
    exit_fd, close_exit_fd = _exit_fd(proc)
    poller = select.poll()
    for fd in (*splitters, exit_fd):
        poller.register(fd, select.POLLIN)
    open_pipes = set(splitters)
    code: int | None = None
    exited_at = 0.0
    drain_until = 0.0
    killed = False
    try:
        while open_pipes or code is None:
            now = time.monotonic()
            if code is None and deadline is not None and now >= deadline:
                if on_deadline is not None:
                    on_deadline()
                deadline = None
            if code is None and still_running_at is not None and now >= still_running_at:
                if on_still_running is not None:
                    on_still_running()
                still_running_at = None
            if code is not None and now >= drain_until:
                if killed:
                    break  # something outside the group holds the pipes; stop reading
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                killed, drain_until = True, now + defaults.PIPE_DRAIN_S
            limits = [
                t
                for t in (
                    deadline if code is None else None,
                    still_running_at if code is None else None,
                    drain_until if code is not None else None,
                )
                if t
            ]
            timeout_ms = None if not limits else max(0, int((min(limits) - now) * 1000) + 1)
            for fd, _ in poller.poll(timeout_ms):
                if fd == exit_fd:
                    code = proc.wait()
                    exited_at = time.time()
                    poller.unregister(exit_fd)
                    # The usual case raises: nothing was left in the group.
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGTERM)
                    drain_until = time.monotonic() + defaults.PIPE_DRAIN_S
                    continue
                data = os.read(fd, 65536)
                if data:
                    splitters[fd].feed(data)
                else:
                    poller.unregister(fd)
                    open_pipes.discard(fd)
                    splitters[fd].close()
    finally:
        close_exit_fd()
        proc.stdout.close()
        proc.stderr.close()
    assert code is not None
    return code, exited_at
