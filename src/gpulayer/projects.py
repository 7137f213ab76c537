"""Projects: the teams that share a server's machines.

A user belongs to projects (an admin makes them and adds users); each job
is submitted into one of its user's projects, and members see and manage
each other's jobs in it. A project may have a quota: the most GPUs, and the
most CPU slots, its running jobs may hold at once (see scheduler.py).

Every job belongs to a project. Where none is set up (embedded, or a server
whose admin made none) it is :data:`DEFAULT_PROJECT`, the implicit project:
no quota, and membership in it lets no one see another user's jobs (a job
there is its submitter's alone, as before projects existed).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

from .errors import GPUlayerError

DEFAULT_PROJECT = "default"
MAX_PROJECT_CHARS = 40
# Lower-case letters, digits and - _ (a name that reads the same in a URL,
# a table, a shell and a metric label), starting with a letter.
_PROJECT_CHARS = rf"[a-z][a-z0-9_-]{{0,{MAX_PROJECT_CHARS - 1}}}"
_PROJECT = re.compile(_PROJECT_CHARS)
PROJECT_PATTERN = f"^{_PROJECT_CHARS}$"  # as JSON Schema spells it
# The most a quota may say: more GPUs or slots than any fleet has is no
# limit, and a bound keeps sums in the scheduler small integers.
MAX_QUOTA = 1_000_000


class ProjectNotFound(GPUlayerError, LookupError):
    """No project has that name, or the user named is not in it (a 404 over HTTP)."""


class ProjectInfo(msgspec.Struct, kw_only=True):
    """A project as the store keeps it and an admin sees it."""

    name: str
    # Its quota: the most GPUs / CPU slots its running jobs hold at once
    # (None: no limit). A GPU job's slots count as GPUs, not CPU slots.
    gpus: int | None = None
    slots: int | None = None
    members: list[str] = []  # user names, in the order they were added
    created: float = 0.0


# The windows ``gpulayer usage`` sums GPU-hours over, back from now.
USAGE_DAY_S = 24 * 3600.0
USAGE_WEEK_S = 7 * USAGE_DAY_S


class ProjectUsage(msgspec.Struct, kw_only=True):
    """A project's use of the machines, as ``gpulayer usage`` shows it (one
    row of the control plane's ``usage``)."""

    project: str
    # GPU-hours its jobs held over the last 24 hours and 7 days: each
    # attempt's GPUs (gpus x nodes) times the part of its time, from placed
    # to its end (or now, running), within the window.
    gpu_hours_day: float = 0.0
    gpu_hours_week: float = 0.0
    running: int = 0  # its jobs running now
    waiting: int = 0  # its jobs queued now
    # What its running jobs hold now, against its quota (a GPU job's slots
    # count as GPUs, not CPU slots).
    gpus_held: int = 0
    slots_held: int = 0
    gpu_quota: int | None = None  # None: no limit
    slot_quota: int | None = None
    # Its recent usage for fair share: weighted GPU-seconds halved every
    # half-life (fairshare.py). None where the row counts only your jobs.
    fair_share_usage: float | None = None
    # The row counts only the asking user's own jobs: the default project,
    # seen by a user (a job there is its submitter's alone).
    only_yours: bool = False


def check_project_name(name: str) -> str:
    """``name`` if it is a valid project name; else a GPUlayerError that says why."""
    if not isinstance(name, str) or _PROJECT.fullmatch(name) is None:
        shown = repr(name) if len(str(name)) <= 80 else repr(str(name)[:77] + "...")
        raise GPUlayerError(
            f"project name {shown} is not valid: use 1 to {MAX_PROJECT_CHARS} lower-case "
            "letters, digits, - and _, starting with a letter"
        )
    return name


def check_quota(what: str, value: int | None) -> int | None:
    """``value`` if it is a valid quota of ``what`` ("gpus", "slots")."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUOTA:
        raise GPUlayerError(
            f"a quota of {what} must be a whole number from 0 to {MAX_QUOTA} (or none), "
            f"not {value!r}"
        )
    return value


class Memberships:
    """Which projects each user belongs to, in memory (the store is the
    record): the control plane asks it on every look at a job. Not
    thread-safe: the control plane calls it under its lock."""

    def __init__(
        self, projects: Iterable[ProjectInfo] = (), members: Iterable[tuple[str, str]] = ()
    ) -> None:
        """``members``: (project, user) pairs, in the order they were added
        (a user's first project is the one they joined first)."""
        self._projects: dict[str, ProjectInfo] = {p.name: p for p in projects}
        self._of: dict[str, list[str]] = {}
        for info in self._projects.values():
            info.members = []
        for name, user in members:
            self.add(name, user)

    def create(self, project: ProjectInfo) -> None:
        self._projects[project.name] = project

    def add(self, project: str, user: str) -> None:
        info = self._projects[project]
        if user not in info.members:
            info.members.append(user)
            self._of.setdefault(user, []).append(project)

    def remove(self, project: str, user: str) -> None:
        info = self._projects[project]
        if user in info.members:
            info.members.remove(user)
            self._of[user].remove(project)

    def drop(self, name: str) -> None:
        """Forget the project (deleted), and each member's membership of it."""
        info = self._projects.pop(name, None)
        for user in info.members if info is not None else ():
            self._of[user].remove(name)

    def get(self, name: str) -> ProjectInfo | None:
        return self._projects.get(name)

    def of(self, user: str | None) -> tuple[str, ...]:
        """The projects ``user`` belongs to, first joined first."""
        return tuple(self._of.get(user, ())) if user is not None else ()

    def all(self) -> list[ProjectInfo]:
        return list(self._projects.values())


__all__ = [
    "DEFAULT_PROJECT",
    "USAGE_DAY_S",
    "USAGE_WEEK_S",
    "Memberships",
    "ProjectInfo",
    "ProjectNotFound",
    "ProjectUsage",
    "check_project_name",
    "check_quota",
]
