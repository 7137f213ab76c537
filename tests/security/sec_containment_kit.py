"""What the containment tests share."""

from __future__ import annotations

from pathlib import Path

from gpulayer.errors import WorkerError
from gpulayer.worker.containment import acquire_containment, release_containment


def cgroups_possible() -> bool:
    """Whether this process may make the worker's cgroups here (root, cgroup v2)."""
    try:
        containment = acquire_containment("cgroup")
    except WorkerError:
        return False
    release_containment(containment)
    return True


# A daemon as a hostile job leaves one: it ignores SIGTERM and SIGHUP, lets
# go of the job's pipes, and writes "<pid> <start time>" to the file named
# by its argument once it runs; then it sleeps for ever.
DAEMON_ONLY = r"""
import os, signal, sys, time
for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
with open("/proc/self/stat") as f:
    start = f.read().rsplit(")", 1)[1].split()[19]
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {start}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(3600)
"""


def running(pidfile: Path) -> bool:
    """Whether the process that wrote ``pidfile`` still runs (a zombie does
    not; a pid reused since has another start time)."""
    pid, start = pidfile.read_text().split()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[19] == start and fields[0] not in ("Z", "X")
