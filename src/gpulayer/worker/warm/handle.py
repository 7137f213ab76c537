"""The worker's handle on one zygote process (:class:`Zygote`): it starts
``zygote.py``, reads its messages, keeps one child primed and hands a
task the child it forked for it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import zygote as protocol
from ..process import RunAs
from .keys import Key
from .process import (
    FORK_TIMEOUT_S,
    Primed,
    WarmProcess,
    WarmUnavailable,
    _end_primed,
    _left,
    _readable,
    _watch_orphan,
)

ZYGOTE = Path(protocol.__file__)


class Zygote:
    """One ready interpreter, for one key; its children are tasks' processes.

    One child is kept *primed*: forked (or handed from the zygote's spare)
    and connected to the worker before a task wants it, so that starting a
    task is one message to the child and its answer, not a round trip to
    the zygote first. The next is asked for once a child has ended (as the
    zygote forks its spare: not while a task just started needs the CPU),
    or by a task that finds none."""

    def __init__(
        self,
        env: Mapping[bytes, bytes],
        preload: Sequence[str],
        key: Key,
        user: RunAs | None = None,
        *,
        light: bool = False,
    ) -> None:
        """``user``: the jobs' user (``--run-as``), whom it runs as: a job
        then reaches no process of root's, and the zygote's memory, hash
        secret and address layout are shared by that user's jobs only.
        ``light``: the companion that preloads nothing (see WarmStarts)."""
        self.key = key
        self.user = user
        self.light = light
        self.state = "starting"  # then "ready", "unready" or "dead"
        self.why: str | None = None  # when not ready: why
        self.info: dict[str, Any] = {}
        self.modules: frozenset[str] = frozenset()
        self.ready = threading.Event()  # set once it is ready or never will be
        self.started = threading.Event()  # it runs, and is no longer dumpable
        self._lock = threading.Lock()  # over the primed child, and the request for it
        self._primed_made = threading.Condition(self._lock)
        self._primed: Primed | None = None
        self._priming: socket.socket | None = None  # our end, until its pid comes
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
                    with self._lock:
                        self.state = "ready"
                        self._prime()
                    self.ready.set()
                elif kind == "unready":
                    self.why = str(message[1])[:500]
                    self.state = "unready"
                    self.ready.set()
                elif kind == "pid" and isinstance(message[1], int):
                    self._on_pid(message[1])
                elif kind == "exit" and all(isinstance(v, int) for v in message[1:3]):
                    self._exit(message[1], os.waitstatus_to_exitcode(message[2]))
                    with self._lock:
                        self._prime()  # a child ended: the next one is asked for
        except (OSError, ValueError):  # gone, or it said something that is no message
            pass
        finally:
            if self.state in ("starting", "ready"):
                assert self.proc is not None
                self.state = "dead"
                self.why = self.why or f"the ready interpreter exited ({self.proc.wait()})"
            self.ready.set()
            with self._lock:
                primed, self._primed = self._primed, None
                priming, self._priming = self._priming, None
                self._primed_made.notify_all()  # a task waiting for one goes cold
            if priming is not None:
                priming.close()
            if primed is not None:
                _end_primed(primed)
            self._orphaned()

    def _prime(self) -> None:
        """Ask the zygote for the next child, ahead of its task; with
        ``_lock`` held. One request at a time: its answer is this one's."""
        if self._primed is not None or self._priming is not None or self.state != "ready":
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            protocol.send(self._control, ("fork",), fds=[theirs.fileno()])
        except OSError as e:
            ours.close()
            self._give_up(f"it did not take a request ({type(e).__name__})")
            return
        finally:
            theirs.close()
        self._priming = ours

    def _on_pid(self, pid: int) -> None:
        """The child for the request made: primed, once it has a pidfd."""
        with self._lock:
            channel, self._priming = self._priming, None
            if channel is None:
                return  # asked for by no one: never
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:  # killed at once: the next task asks again
                channel.close()
            else:
                self._primed = (pid, channel, pidfd)
            self._primed_made.notify_all()

    def primed(self, timeout: float) -> bool:
        """Whether a ready zygote's primed child is there (or no longer
        asked for), waiting up to ``timeout``: for tests and benchmarks."""
        with self._lock:
            return self._primed_made.wait_for(
                lambda: self._priming is None or self.state != "ready", timeout
            )

    def _take_primed(self) -> Primed:
        """The primed child (asked for, and waited for, if there is none);
        with ``_lock`` held."""
        deadline = time.monotonic() + FORK_TIMEOUT_S
        while True:
            if self.state != "ready":
                raise WarmUnavailable(f"it is {self.state}")
            primed, self._primed = self._primed, None
            if primed is not None:
                if not _readable(primed[2]):
                    return primed
                _end_primed(primed)  # killed as it waited (its user's job can)
                continue
            self._prime()
            if not self._primed_made.wait(_left(deadline, FORK_TIMEOUT_S)):
                self._give_up("it did not answer")
                raise WarmUnavailable("it did not answer")

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
        try:
            fds.extend(os.pipe2(os.O_CLOEXEC))
            fds.extend(os.pipe2(os.O_CLOEXEC))
            with self._lock:
                primed = self._take_primed()
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        pid = primed[0]
        child = WarmProcess(self, primed, task, (fds[0], fds[1], fds[2], fds[3]))
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
        with self._lock:
            primed, self._primed = self._primed, None
            priming, self._priming = self._priming, None
        if priming is not None:
            priming.close()
        if primed is not None:
            _end_primed(primed)
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
