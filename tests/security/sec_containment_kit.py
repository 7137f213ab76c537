"""What the containment tests share."""

from __future__ import annotations

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
