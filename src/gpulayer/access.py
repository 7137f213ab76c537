"""Who may see which jobs: the one rule every look at a job goes through.

A job belongs to the user who submitted it (``JobInfo.user``) and to a
project (``JobSpec.project``, see projects.py). A :class:`Viewer` is
whoever asks: a user sees that user's jobs, and every job in the projects
they belong to (not in the implicit default project: there a job is its
user's alone); an admin, and the one local user of an embedded home, see
every job. Each operation on a
job (show, list, wait, logs, cancel, an id prefix, the ``also`` of a wait)
asks :func:`may_see`, or has the store filter by :attr:`Viewer.only`, which
is the same rule, and answers for a job it may not see exactly as for one
that does not exist. Teams and projects extend this module, nothing else.
"""

from __future__ import annotations

import functools
import getpass
import re
from collections.abc import Collection
from dataclasses import dataclass

from . import defaults
from .errors import GPUlayerError
from .projects import DEFAULT_PROJECT

MAX_USER_CHARS = 64
# Letters, digits and . _ - @ + (an e-mail address is a user name); nothing
# that needs quoting in a table, a URL or a shell.
_USER_CHARS = rf"[A-Za-z0-9][A-Za-z0-9._@+-]{{0,{MAX_USER_CHARS - 1}}}"
_USER = re.compile(_USER_CHARS)
USER_PATTERN = f"^{_USER_CHARS}$"  # as JSON Schema spells it


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who asks about jobs, and who a job it submits belongs to."""

    # The user it acts as: its jobs are this user's. None only for an admin
    # token made without a user: its jobs belong to no user (admins see them).
    user: str | None
    admin: bool = False  # sees every job

    def __post_init__(self) -> None:
        if not self.admin and not self.user:
            raise ValueError("a viewer that is not an admin needs a user")

    @property
    def only(self) -> str | None:
        """The one user whose jobs it sees, for the store to filter on
        (None: every job)."""
        return None if self.admin else self.user


def may_see(
    viewer: Viewer,
    user: str | None,
    project: str | None = None,
    projects: Collection[str] = (),
) -> bool:
    """Whether ``viewer``, a member of ``projects``, may see (and wait on,
    follow, cancel) a job of ``user`` in ``project`` (None: the default)."""
    return (
        viewer.admin
        or (user is not None and user == viewer.user)
        or (project is not None and project != DEFAULT_PROJECT and project in projects)
    )


def sees_all(viewer: Viewer) -> bool:
    """Whether :func:`may_see` holds for ``viewer`` and every job: a loop
    over many jobs may skip asking it of each."""
    return viewer.admin


def _valid(name: str) -> bool:
    return _USER.fullmatch(name) is not None


def check_user_name(name: str) -> str:
    """``name`` if it is a valid user name; else a GPUlayerError that says why."""
    if not _valid(name):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise GPUlayerError(
            f"user name {shown!r} is not valid: use 1 to {MAX_USER_CHARS} letters, digits "
            "and . _ - @ +, starting with a letter or a digit"
        )
    return name


@functools.cache
def local_viewer() -> Viewer:
    """The one user of an embedded home (and of a server without auth): the
    OS login name, or ``defaults.LOCAL_USER`` where that is not a valid user
    name. It sees every job on the home."""
    try:
        name = getpass.getuser()
    except (OSError, KeyError, ImportError):  # no login name, no passwd entry
        name = ""
    return Viewer(name if _valid(name) else defaults.LOCAL_USER, admin=True)


__all__ = ["Viewer", "check_user_name", "local_viewer", "may_see", "sees_all"]
