"""A task's process forked by a zygote, as the worker sees it
(:class:`WarmProcess`, what it keeps of a ``Popen``): its release into its
task, its exit as the zygote or its channel reports it, or as its pidfd
shows it once its zygote has died (``_watch_orphan``); and the *primed*
children, forked ahead of their task."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
from typing import IO, TYPE_CHECKING, Any

from .. import zygote as protocol

if TYPE_CHECKING:
    from .handle import Zygote

log = logging.getLogger(__name__)

FORK_TIMEOUT_S = 10.0  # for the zygote's answer, and a child's "go": else it is stuck
REPORT_WAIT_S = 1.0  # for the zygote's report of a child's end, once it has ended


_EXIT_LINE = re.compile(rb"exit (-?[0-9]{1,3})\n\Z")


def _left(deadline: float | None, most: float) -> float:
    return most if deadline is None else max(0.0, min(most, deadline - time.monotonic()))


class WarmUnavailable(OSError):
    """The zygote could not start this task's process (it died, or hangs):
    the task starts cold instead. Not the task's fault."""


class WarmProcess:
    """A task's process forked by a zygote: what the worker keeps of a
    ``Popen``. Held until :meth:`release` sends it its task, so that its
    box takes it in before it runs anything."""

    def __init__(
        self,
        zygote: Zygote,
        child: Primed,
        task: dict[str, Any],
        pipes: tuple[int, int, int, int],
    ) -> None:
        pid, channel, pidfd = child
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
        # Taken while the child waited for its task (Zygote._on_pid): it had
        # not exited, so this is it, and stays it (never a later process on
        # its pid).
        self._pidfd: int | None = pidfd

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
        except (BrokenPipeError, ConnectionResetError) as e:
            # Killed as it waited for a task (a job of the worker's user can).
            channel.close()
            raise WarmUnavailable(f"its child {self.pid} was gone before its task") from e
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


# A child of a zygote connected to the worker, waiting for its task: its
# pid, its channel and a pidfd taken while it waited.
Primed = tuple[int, socket.socket, int]


def _readable(fd: int) -> bool:
    """Whether a pidfd says its process has exited."""
    with contextlib.suppress(OSError, ValueError):
        return bool(select.select([fd], [], [], 0)[0])
    return True


def _end_primed(primed: Primed, wait_s: float = 5.0) -> None:
    """A primed child that will get no task: its channel closed, it exits
    (see zygote._child) and is waited for; reaped here if it came to this
    process (a subreaper), else its zygote's, or init's, to reap."""
    _pid, channel, pidfd = primed
    channel.close()
    try:
        with contextlib.suppress(OSError, ValueError):
            select.select([pidfd], [], [], wait_s)
        p_pidfd = getattr(os, "P_PIDFD", None)
        if p_pidfd is not None:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(p_pidfd, pidfd, os.WEXITED | os.WNOHANG)
    finally:
        os.close(pidfd)


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
