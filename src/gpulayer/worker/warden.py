"""A worker process's warden: it ends the worker's tasks when the worker dies.

A task's processes run in sessions of their own, so a Ctrl-C at the worker's
terminal reaches the worker alone, which then ends them in order. That also
lets them outlive a worker that is killed (SIGKILL, the OOM killer, a crash).
The next worker process on the home ends them (see ledger.py); without the
warden they would run on until one starts, while the server retries their
jobs elsewhere and the GPUs they hold are offered again.

So a worker process forks a warden as it starts, before it has a thread: a
process that only waits on a pipe whose one writer is the worker, and never
written to. The pipe reads end-of-file once the worker is gone, however it
went. The warden then ends every process tree the worker's ledger lists as
running (still the same process: pid and start time agree), and everything
the worker's containment kept of its tasks (with cgroups: every process in
a task's cgroup, daemons that left the tree included, and what the last
spawn had not yet moved into one), says so on the worker's stderr, unregisters the worker (so its jobs go elsewhere now, not
after the heartbeat timeout), and exits. A worker that stopped normally
removed its ledger: its warden does nothing. One whose task outlived the
stop's wait left it: the warden ends that task.

The warden holds the ledger's lock as the worker did (it inherits the
descriptor), but not its "alive" lock, nor the worker's GPU claims. A next
worker process started on the home meanwhile sees the one lock held and the
other free, waits for the warden (see Ledger.recover), then takes the
ledger over: the dead worker's id, and the results it kept. So the warden's
work is bounded, by what the worker wrote in the ledger as it forked it:
the trees all at once, given the kill grace, and the goodbye a deadline (an
alarm, which ends the warden). It ignores the signals a terminal or a service manager
sends to the worker's whole process group: the worker handles those, and
the warden goes when the worker does. It takes no lock and starts no
thread: what it runs in the forked child is its own.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from .. import defaults
from ..errors import AccessDenied, ServerUnreachable, WorkerError
from .containment import Containment
from .ledger import Ledger, listed_tasks
from .process import KILL_WAIT_S, end_orphans

# Sent to a worker's whole process group by a terminal or a service manager:
# the worker handles them, and the warden leaves when it does.
# Ctrl-Z, and a terminal's stops for a background process's reads and
# writes, would stop it where a later SIGKILL of the worker alone leaves it.
_IGNORED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
)


class Warden:
    """The forked warden of this worker process (see the module's doc)."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        grace: float,
        goodbye: Callable[[str, str | None], None] | None = None,
        containment: Containment | None = None,
    ) -> None:
        """``goodbye(worker_id, generation)``, run in the warden once it has
        ended what the worker left, tells the control plane the worker is
        gone, on a connection of its own (it is another process); for that
        registration only, if the ledger has its number. ``containment``:
        the worker's, whose boxes the warden ends too."""
        if threading.active_count() > 1:
            # A fork copies only the calling thread: a lock another thread
            # held stays held in the child forever.
            raise WorkerError("a worker's warden is forked before the worker starts any thread")
        # For a next worker process on the home, which waits that long at
        # most for the warden of a dead worker (see Ledger.recover).
        ledger.set_warden_time(grace + KILL_WAIT_S + defaults.WARDEN_GOODBYE_TIMEOUT_S)
        read_end, write_end = os.pipe()
        try:
            pid = self._fork(read_end, ledger, grace, goodbye, containment)
        except BaseException:
            os.close(read_end)
            os.close(write_end)
            raise
        os.close(read_end)
        self.pid = pid
        self._write_end: int | None = write_end

    @staticmethod
    def _fork(
        read_end: int,
        ledger: Ledger,
        grace: float,
        goodbye: Callable[[str, str | None], None] | None,
        containment: Containment | None,
    ) -> int:
        """The warden's pid; in the warden itself, never returns."""
        if min(read_end, ledger.lock_fd) <= 2:
            # The warden puts /dev/null on 0 and 1: they would go.
            raise WorkerError(
                "a worker's warden needs stdin, stdout and stderr open (see open_stdio)"
            )
        worker = os.getpid()
        # Until the warden ignores them: a Ctrl-C now must not run the
        # worker's handler in it.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED)
        try:
            pid = os.fork()
            if pid == 0:  # the warden; it never returns
                code = 0
                try:
                    _watch(read_end, ledger, grace, worker, goodbye, mask, containment)
                except BaseException as exc:
                    _say(f"gpulayer: the warden of worker process {worker} failed: {exc!r}\n")
                    code = 1
                finally:
                    os._exit(code)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return pid

    def release(self) -> None:
        """The worker stops with its tasks ended: the warden goes now (it
        ends what the ledger still lists, if anything), and is reaped."""
        fd, self._write_end = self._write_end, None
        if fd is None:
            return
        os.close(fd)
        # Reaped on a thread: it may take a task's kill grace to end one
        # that outlived the worker's stop.
        threading.Thread(
            target=_reap, args=(self.pid,), name="gpulayer-warden", daemon=True
        ).start()


def open_stdio() -> None:
    """Open /dev/null on whichever of descriptors 0, 1 and 2 is closed, so
    that those made from now on (the ledger's lock, the warden's pipe) are
    not among them: the warden puts /dev/null on 0 and 1, and writes to 2."""
    while True:
        fd = os.open(os.devnull, os.O_RDWR)
        if fd > 2:
            os.close(fd)
            return
        os.set_inheritable(fd, True)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # reaped already
        os.waitpid(pid, 0)


def _watch(
    read_end: int,
    ledger: Ledger,
    grace: float,
    worker: int,
    goodbye: Callable[[str, str | None], None] | None,
    mask: set[int | signal.Signals],
    containment: Containment | None = None,
) -> None:
    # Objects the worker made stay as they are: a cycle collected here could
    # close a descriptor whose number this process has since reused.
    gc.disable()
    for signum in _IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    signal.set_wakeup_fd(-1)  # the worker's, if it had set one: not the warden's
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    # Only the pipe, the ledger's lock and stderr stay open: no reader of the
    # worker's stdout, nor the server, waits on the warden; and the ledger's
    # other lock, which says its worker is alive, goes with the worker alone.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    if null > 2:
        os.close(null)
    keep = {0, 1, 2, read_end, ledger.lock_fd}
    for fd in _open_fds():
        if fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own, closed already
                os.close(fd)
    while os.read(read_end, 1):
        pass  # nothing is written: only the end counts
    if not ledger.dir.exists():
        return  # the worker stopped, and tidied up: it has said goodbye itself
    # The boxes first (all of a task, daemons included; one grace for all),
    # then whatever listed process no box held (none, with cgroups).
    ended = 0
    if containment is not None:
        try:
            ended = containment.end_left(grace)
        except Exception as exc:  # the ledger's trees and the goodbye still go
            _say(
                f"gpulayer: the warden of worker process {worker} could not end its boxes: {exc!r}\n"
            )
    listed = listed_tasks(ledger.dir)
    ended = max(ended, end_orphans(listed, grace=grace) if listed else 0)
    if ended:
        _say(
            f"gpulayer: worker process {worker} is gone; its warden ended the "
            f"{ended} task process tree(s) it left running\n"
        )
    if goodbye is not None:
        _say_goodbye(ledger.dir, goodbye)


def _say_goodbye(ledger_dir: Path, goodbye: Callable[[str, str | None], None]) -> None:
    """Tell the control plane the worker is gone, so that its jobs go
    elsewhere now, not after the heartbeat timeout; unless results it kept
    wait for the server (which would first take their tasks for lost: the
    next worker on the home delivers them), or it never registered."""
    try:
        if any(not name.startswith(".") for name in os.listdir(ledger_dir / "results")):
            return
        worker_id = (ledger_dir / "worker-id").read_text().strip()
    except FileNotFoundError:  # the worker was removing its ledger as it stopped
        return
    try:
        # Late (held up on its way), a goodbye must not remove the next
        # worker process, which registers under the id once the warden is gone.
        generation: str | None = (ledger_dir / "generation").read_text().strip()
    except FileNotFoundError:  # killed with its registration on its way
        generation = None
    if not worker_id:
        return
    # However slow the server (or the name lookup): the warden holds the
    # ledger's lock, which the next worker process on the home waits for.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the end of the warden
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})  # one the worker blocked too
    signal.setitimer(signal.ITIMER_REAL, defaults.WARDEN_GOODBYE_TIMEOUT_S)
    try:
        goodbye(worker_id, generation)
    except (ServerUnreachable, AccessDenied):
        pass  # it finds out when the heartbeats stop; or the token that could tell is gone
    except Exception as exc:
        _say(
            f"gpulayer: the warden could not tell the server that worker {worker_id} "
            f"is gone ({exc}); the server finds out when its heartbeats stop\n"
        )


def _open_fds() -> list[int]:
    """This process's open descriptors (a listing, not a loop up to the
    limit on open files, which may be in the millions)."""
    for listing in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return [int(name) for name in os.listdir(listing)]
    return list(range(os.sysconf("SC_OPEN_MAX")))


def _say(text: str) -> None:
    with contextlib.suppress(OSError):  # no one reads the worker's stderr any more
        os.write(2, text.encode())
