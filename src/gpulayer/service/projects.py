"""What an admin does with projects: make them, set their quotas, add and
remove their members, delete them (see ``projects.py``); and what anyone
may ask of them: their usage (:meth:`ProjectAdmin.usage`).

Only admins may change projects (the HTTP layer checks it, as for tokens).
Each operation checks everything it is given before it writes, so bad input
changes nothing; then it writes the store (the record) and the plane's
registry in memory (:class:`~gpulayer.projects.Memberships`, which every
look at a job asks) in one step under the plane's lock, so the two never
disagree, even with two admins at once.

Usage follows the rule of access.py: an admin sees every project's row; a
user, the rows of the projects they belong to (every member's jobs, as
they see them) and the default project's counting only their own jobs
(there a job is its submitter's alone), without its fair-share figure,
which is everyone's there. Nothing else: the call takes no project to ask
about.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from ..access import Viewer, check_user_name, local_viewer
from ..errors import GPUlayerError, InvalidStateError
from ..projects import (
    DEFAULT_PROJECT,
    USAGE_DAY_S,
    USAGE_WEEK_S,
    Memberships,
    ProjectInfo,
    ProjectNotFound,
    ProjectUsage,
    check_project_name,
    check_quota,
)
from ..spec import JobSpec
from .core import PlaneCore

_HOUR_S = 3600.0


def _copy(info: ProjectInfo) -> ProjectInfo:
    """What a caller gets: never the registry's own record, which it could change."""
    return msgspec.structs.replace(info, members=list(info.members))


def _named(name: str) -> str:
    """``name`` if it may name a project an admin made; else why not."""
    check_project_name(name)
    if name == DEFAULT_PROJECT:
        raise GPUlayerError(
            f"project {DEFAULT_PROJECT} is the implicit project of the users in no other; "
            "its name is reserved: it cannot be made, deleted, given members or a quota"
        )
    return name


def _missing(name: str) -> ProjectNotFound:
    return ProjectNotFound(f"no project {name} on this server (see gpulayer project list)")


class ProjectAdmin(PlaneCore):
    # Made in PlaneCore.__init__ from the store; changed only here, under
    # self._lock.
    _memberships: Memberships

    def create_project(
        self, name: str, *, gpus: int | None = None, slots: int | None = None
    ) -> ProjectInfo:
        """A new project with no members. InvalidStateError if one has that name."""
        info = ProjectInfo(
            name=_named(name),
            gpus=check_quota("gpus", gpus),
            slots=check_quota("slots", slots),
            members=[],
            created=self._clock(),
        )
        with self._lock:
            if not self.store.create_project(info):
                raise InvalidStateError(f"project {name} exists already")
            self._memberships.create(info)
            return _copy(info)

    def set_project_quota(
        self,
        name: str,
        *,
        gpus: int | UnsetType | None = UNSET,
        slots: int | UnsetType | None = UNSET,
    ) -> ProjectInfo:
        """Change a project's quotas: a number, None for no limit,
        ``msgspec.UNSET`` (the default) to leave it. It takes effect at the
        next placement; no running job is stopped for it."""
        _named(name)
        if not isinstance(gpus, UnsetType):
            check_quota("gpus", gpus)
        if not isinstance(slots, UnsetType):
            check_quota("slots", slots)
        with self._lock:
            info = self._memberships.get(name)
            if info is None or not self.store.set_project_quota(name, gpus=gpus, slots=slots):
                raise _missing(name)
            if not isinstance(gpus, UnsetType):
                info.gpus = gpus
            if not isinstance(slots, UnsetType):
                info.slots = slots
            changed = _copy(info)
        # A lower quota holds back what waits; a higher one may let it run
        # now. Called without the lock held: it takes it itself.
        placement = getattr(self, "_quota_changed", None)
        if placement is not None and (gpus is not UNSET or slots is not UNSET):
            placement()
        return changed

    def add_project_member(self, name: str, user: str) -> ProjectInfo:
        """Make ``user`` a member; one already in it stays, as it was."""
        _named(name)
        check_user_name(user)
        with self._lock:
            info = self._memberships.get(name)
            if info is None or not self.store.add_project_member(name, user, self._clock()):
                raise _missing(name)
            self._memberships.add(name, user)
            return _copy(info)

    def remove_project_member(self, name: str, user: str) -> ProjectInfo:
        """Take ``user`` out. The jobs it submitted there stay in the project:
        its quota counts them, its members see them, and so does ``user``
        (its own); it sees the others' no more."""
        _named(name)
        check_user_name(user)
        with self._lock:
            info = self._memberships.get(name)
            if info is None:
                raise _missing(name)
            if not self.store.remove_project_member(name, user):
                raise ProjectNotFound(f"user {user} is not a member of project {name}")
            self._memberships.remove(name, user)
            return _copy(info)

    def delete_project(self, name: str) -> None:
        """Delete a project that has no job queued or running (else
        InvalidStateError, naming how many). Its final jobs stay, their
        submitters' alone."""
        _named(name)
        with self._lock:
            if self._memberships.get(name) is None or not self.store.delete_project(name):
                raise _missing(name)
            self._memberships.drop(name)
            # Its final jobs kept here name it still: read from the store from
            # now on, where they are the deleted project's (no member of a
            # project made later under the name sees them).
            for job_id in [j for j, f in self._finished.items() if f.spec.project == name]:
                del self._finished[job_id]

    def list_projects(self) -> list[ProjectInfo]:
        """Every project, oldest first, with its members in the order added."""
        with self._lock:
            return [_copy(info) for info in self._memberships.all()]

    def usage(self, viewer: Viewer | None = None, now: float | None = None) -> list[ProjectUsage]:
        """The projects ``viewer`` may see (embedded: every one), oldest
        first, then the default project: GPU-hours over the last day and
        week, jobs running and waiting, what they hold, quotas, fair-share
        usage. See the module's docstring for who sees which row.

        What runs and waits is read from memory under the lock, at ``now``;
        the attempts that had ended by ``now`` from the store after, in one
        query over two index ranges, without the lock (placement does not
        wait on it). An attempt ending meanwhile ends after ``now``: the
        store's sum leaves it out, so it is counted once, as running."""
        viewer = viewer or local_viewer()
        with self._lock:
            now = self._clock() if now is None else now
            rows = self._usage_rows(viewer)
            day, week = now - USAGE_DAY_S, now - USAGE_WEEK_S
            for run in self._running.values():
                found = _row(rows, viewer, run.spec.project, run.user)
                if found is None:
                    continue
                found.running += 1
                gpus = run.spec.gpus * run.spec.nodes
                began = run.marks.get("placed", now)
                found.gpu_hours_day += gpus * max(0.0, now - max(began, day)) / _HOUR_S
                found.gpu_hours_week += gpus * max(0.0, now - max(began, week)) / _HOUR_S
                if found.only_yours:  # the project's holdings are everyone's there
                    held_gpus, held_slots = _demand(run.spec)
                    found.gpus_held += held_gpus
                    found.slots_held += held_slots
            for pending in self._queue.values():
                found = _row(rows, viewer, pending.spec.project, pending.user)
                if found is not None:
                    found.waiting += 1
            fair = self._accounts.usage(now)
            for name, found in rows.items():
                if not found.only_yours:
                    found.gpus_held, found.slots_held = self._accounts.held.get(name, (0, 0))
                    found.fair_share_usage = fair.get(name, 0.0)
        ended = self.store.gpu_seconds((day, week), now)
        for (project, user), (in_day, in_week) in ended.items():
            found = _row(rows, viewer, project, user)
            if found is not None:
                found.gpu_hours_day += in_day / _HOUR_S
                found.gpu_hours_week += in_week / _HOUR_S
        return list(rows.values())

    def _usage_rows(self, viewer: Viewer) -> dict[str, ProjectUsage]:
        """The empty rows ``viewer`` may see, by project. Call with the lock held."""
        if viewer.admin:
            infos = self._memberships.all()
        else:
            infos = [
                info
                for name in self._memberships.of(viewer.user)
                if (info := self._memberships.get(name)) is not None
            ]
        rows = {
            info.name: ProjectUsage(project=info.name, gpu_quota=info.gpus, slot_quota=info.slots)
            for info in infos
        }
        rows[DEFAULT_PROJECT] = ProjectUsage(project=DEFAULT_PROJECT, only_yours=not viewer.admin)
        return rows


def _row(
    rows: dict[str, ProjectUsage], viewer: Viewer, project: str | None, user: str | None
) -> ProjectUsage | None:
    """The row a job of ``user`` in ``project`` counts in, if ``viewer`` has
    one for it: in a row of only its own jobs, only if it is one."""
    found = rows.get(project or DEFAULT_PROJECT)
    if found is None or (found.only_yours and user != viewer.user):
        return None
    return found


def _demand(spec: JobSpec) -> tuple[int, int]:
    """What a running job holds against its project's quota: (GPUs, CPU
    slots); as the plane counts it (core._demand)."""
    return (spec.gpus * spec.nodes, 0) if spec.gpus else (0, spec.nodes)


__all__ = ["ProjectAdmin"]
