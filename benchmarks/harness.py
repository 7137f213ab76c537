"""Starting and stopping GPUlayer processes, for the benchmarks and the
multi-host test harness (``tests/netns_cluster.py``).

Each process's output is copied line by line into a log file by a thread (a
pipe nobody reads could fill and stall the process). The copier notes the
line a process prints once it is ready, "serving": the server once it
listens, a worker once it has registered. Callers block on that; nothing
polls.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import IO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log, for a failure message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Announced:
    """``pipe`` (a process's output) copied into ``log`` by a thread, which
    notes when the process says it is serving."""

    def __init__(self, pipe: IO[bytes], log: Path) -> None:
        self.log = log
        self.serving = False
        self._said = threading.Event()  # serving, or the output ended
        self.thread = threading.Thread(target=self._copy, args=(pipe,), daemon=True)
        self.thread.start()

    def _copy(self, pipe: IO[bytes]) -> None:
        with pipe, self.log.open("wb") as out:
            for line in pipe:
                out.write(line)
                out.flush()
                if not self.serving and b"serving" in line:
                    self.serving = True
                    self._said.set()
        self._said.set()

    def wait(self, failure: str, timeout: float = 60) -> None:
        """Block until the process says it is serving; else raise ``failure``
        with its last lines (it ended, or said nothing for ``timeout`` s)."""
        self._said.wait(timeout)
        if not self.serving:
            raise RuntimeError(f"{failure}:\n{tail(self.log)}")


def stop(proc: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM, up to ``grace`` seconds, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def exit_on_sigterm() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so what a benchmark started is
    stopped and removed too."""

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGHUP, leave)
