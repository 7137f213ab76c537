"""Where jobs, logs and workers are kept.

:class:`Store` is the interface the control plane uses; ``sqlite.py`` is the
embedded implementation. A PostgreSQL store implements the same methods and
nothing above this package changes. Writes happen inside
:meth:`Store.transaction`, so each step of a job's life is one atomic commit.
"""

from __future__ import annotations

import abc
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager

from msgspec import UNSET, UnsetType

from ..jobs import JobInfo, LogLine, TaskInfo, TaskResult, WorkerInfo
from ..projects import ProjectInfo
from ..spec import ArtifactRef


class Transaction(abc.ABC):
    """The writes that make up one atomic step."""

    @abc.abstractmethod
    def insert_job(self, job: JobInfo) -> bool:
        """Store a new job; False (nothing written) if its id is stored already."""

    @abc.abstractmethod
    def insert_tasks(self, tasks: Sequence[JobInfo]) -> None:
        """Store an array's tasks, just made (new ids), in one statement."""

    @abc.abstractmethod
    def array_started(self, array_id: str, at: float) -> None:
        """An array's first task was placed: the array is running."""

    @abc.abstractmethod
    def place(
        self,
        job_id: str,
        *,
        worker: str,
        slots: Sequence[int],
        gpus: Sequence[int],
        attempt: int,
        at: float,
        tasks: Sequence[TaskInfo] = (),
    ) -> bool:
        """Mark a queued job placed; False if it is no longer queued.

        ``worker``, ``slots`` and ``gpus`` are its (first) task's; a job of
        several nodes also passes every task in ``tasks``."""

    @abc.abstractmethod
    def start(
        self,
        job_id: str,
        *,
        marks: dict[str, float],
        pid: int,
        pid_created: float | None,
        node: int | None = None,
        procs: Sequence[tuple[int, float | None]] = (),
        start: str | None = None,
    ) -> None:
        """A task's process started. A distributed job's task names its
        ``node`` and, with several ranks, each one's process in ``procs``.
        ``start``: how its processes started (``jobs.WARM`` or "cold:
        <why>"), kept as the task's and, through ``jobs.job_start``, the
        job's; None (a worker that does not say) leaves what is kept."""

    @abc.abstractmethod
    def finish(
        self,
        job_id: str,
        *,
        state: str,
        exit_code: int | None,
        reason: str | None,
        marks: dict[str, float],
        outputs: dict[str, ArtifactRef],
        starts: Mapping[int, str] | None = None,
    ) -> None:
        """End the job. ``starts``: how each node's task started, as its
        result said (node 0 alone for a job of one); each replaces what that
        node's start report said, and the job's start follows. A node not
        named keeps its own."""

    @abc.abstractmethod
    def starts(self, job_id: str) -> tuple[str | None, dict[int, str]]:
        """How the job's current attempt started, as kept: the job's start,
        and each node's that is known (a job of several nodes; else ``{}``)."""

    @abc.abstractmethod
    def cancel_requested(self, job_id: str) -> bool:
        """Whether a cancel was asked for (by any process on this home)."""

    @abc.abstractmethod
    def task_ended(self, job_id: str, node: int, result: TaskResult) -> None:
        """One node of a distributed job ended while others run on (its
        ``result.start``, if given, replaces the node's start)."""

    @abc.abstractmethod
    def set_master_port(self, job_id: str, port: int) -> None:
        """The master port node 0 of a distributed job reserved (kept with node 0's task)."""

    @abc.abstractmethod
    def requeue(
        self,
        job_id: str,
        *,
        reason: str | None,
        owner: str,
        attempt: int | None = None,
        given_back: int | None = None,
        retry_at: float | None = None,
        at: float | None = None,
        scratch: ArtifactRef | None = None,
    ) -> None:
        """Queue a job again; ``attempt``, if given, is the attempts it has made
        (one placement did not count); ``given_back``, if given, how many of
        them were given back unrun and do not count against its retries;
        ``retry_at``, if given, when its back-off ends (kept as its mark
        ``retry_at``, so that it holds through a restart). Its start, like
        its marks after ``submitted``, was the ended attempt's: cleared.
        ``at``: when the attempt that ended did, kept with it for its usage
        (:meth:`Store.gpu_seconds`); without it that attempt's is not
        counted. ``scratch``, if given, what the attempt left in its scratch
        folder, kept for the next (see :meth:`Store.scratch_of`)."""

    @abc.abstractmethod
    def append_logs(self, job_id: str, attempt: int, lines: Sequence[LogLine]) -> None:
        """Lines the control plane itself adds to a job's log (stream
        ``system``), in the same commit as the step they tell of."""

    @abc.abstractmethod
    def request_cancel(self, job_id: str) -> None: ...

    @abc.abstractmethod
    def cancel_queued(self, job_id: str, at: float) -> bool:
        """End a job that is still queued as cancelled; False if it is not queued."""

    @abc.abstractmethod
    def adopt(self, from_owner: str, to_owner: str, *, workers: bool) -> list[str]:
        """Move the queued and running jobs of one instance to another (and,
        with ``workers``, its workers; else drop them). Returns the queued ids."""

    @abc.abstractmethod
    def upsert_worker(
        self, worker: WorkerInfo, *, token_digest: str | None = None, at: float = 0.0
    ) -> None:
        """Store the worker, with the sha256 of the token that registered it
        (at ``at``: see :meth:`last_binding`)."""

    @abc.abstractmethod
    def delete_worker(self, worker_id: str) -> None: ...

    @abc.abstractmethod
    def grant_blobs(self, reader: str, digests: Iterable[str]) -> None:
        """Let ``reader`` (a user name, or a worker token's: see
        ``service/blobs.py``) read the blobs ``digests``; granting one twice
        changes nothing."""

    @abc.abstractmethod
    def delete_workers(self, instance: str) -> None: ...

    @abc.abstractmethod
    def delete_jobs_ended_before(self, cutoff: float) -> tuple[int, int]:
        """Delete every job in a final state that finished before ``cutoff``
        (seconds since the epoch), with its log lines, outputs and past
        tasks; never a queued or running one. Returns (jobs, log lines)."""

    @abc.abstractmethod
    def save_usage(self, project: str, usage: float, at: float) -> None:
        """Keep ``project``'s recent usage (decayed GPU-seconds) as of ``at``,
        in the same commit as the step that changed it (a job's end)."""

    @abc.abstractmethod
    def artifact_refs(self) -> set[tuple[str, str]]:
        """What the stored jobs name, as (kind, digest): each one's bundle
        (a "dir": a manifest), inputs and outputs. What a manifest lists is
        not read here (see ``gc.py``)."""


class Store(abc.ABC):
    @abc.abstractmethod
    def transaction(self) -> AbstractContextManager[Transaction]: ...

    @abc.abstractmethod
    def scratch_of(self, job_id: str) -> ArtifactRef | None:
        """What the job's last attempt left in its scratch folder, if it is
        not final and one was kept (Transaction.requeue)."""

    @abc.abstractmethod
    def get_job(
        self, job_id: str, *, user: str | None = None, projects: Collection[str] = ()
    ) -> JobInfo | None:
        """The job with this id; with ``user``, only if it is that user's or
        in one of ``projects`` (the user's: never the default project, which
        is never matched by it)."""

    @abc.abstractmethod
    def find_job(
        self, prefix: str, *, user: str | None = None, projects: Collection[str] = ()
    ) -> list[str]:
        """Ids starting with ``prefix`` (at most 2: enough to tell unique from
        ambiguous), an array's tasks only by their whole id; with ``user``,
        only among that user's jobs and those in ``projects`` (as
        :meth:`get_job`)."""

    @abc.abstractmethod
    def list_jobs(
        self,
        *,
        states: Iterable[str] = (),
        owner: str | None = None,
        user: str | None = None,
        projects: Collection[str] = (),
        project: str | None = None,
        limit: int | None = None,
        labels: Mapping[str, str] | None = None,
        array: str | None = None,
        top_level: bool = False,
        submitter: str | None = None,
        text: str | None = None,
        offset: int = 0,
    ) -> list[JobInfo]:
        """Jobs, newest first; with ``owner``, only that control-plane
        instance's; with ``user``, only that user's and those in ``projects``
        (as :meth:`get_job`); with ``project``, only that project's (the
        default project's: those of none); with ``labels``, only those whose
        spec carries every one of them (key and value exactly). With
        ``array``, only that array's tasks (by index); with ``top_level``,
        no array's tasks (an array is its one row); with ``submitter``, only
        that user's; with ``text``, only those whose name, script or command
        holds it (case aside); ``offset``: after passing over that many."""

    @abc.abstractmethod
    def array_counts(self, array_ids: Collection[str]) -> dict[str, dict[str, int]]:
        """Each array's tasks by state."""

    @abc.abstractmethod
    def array_task(self, array_id: str, index: int) -> str | None:
        """The id of an array's task with ``index``; None if it has none."""

    @abc.abstractmethod
    def array_members(self, array_id: str) -> list[tuple[str, str]]:
        """An array's tasks as (id, state), by index."""

    @abc.abstractmethod
    def append_logs(
        self,
        job_id: str,
        attempt: int,
        lines: Sequence[LogLine],
        *,
        node: int = 0,
        node_last: int | None = None,
    ) -> None:
        """Store a batch. A node of a job of several also gives ``node_last``,
        the batch's last line in the node's own numbering (see :meth:`node_lines`)."""

    @abc.abstractmethod
    def node_lines(self, job_id: str, attempt: int) -> dict[int, int]:
        """For a job of several nodes: each node's last line stored, in its own numbering."""

    @abc.abstractmethod
    def last_binding(self, worker_id: str) -> tuple[str, float] | None:
        """The sha256 of the token ``worker_id`` last registered with, and
        since when (the first registration with it), kept after the worker
        is gone; None if it never registered with one."""

    @abc.abstractmethod
    def task_worker(self, job_id: str, attempt: int, node: int = 0) -> tuple[str, float] | None:
        """The worker that ran (or runs) ``node`` of the job's ``attempt``,
        and when it was placed; None if no worker did, or no such job."""

    @abc.abstractmethod
    def last_log_seq(self, job_id: str, attempt: int) -> int:
        """The number of the last line stored for an attempt (0: none)."""

    @abc.abstractmethod
    def read_logs(
        self, job_id: str, after: tuple[int, int] = (0, 0), limit: int = 10_000
    ) -> list[tuple[int, LogLine]]:
        """Lines after the (attempt, seq) cursor, as (attempt, line) pairs."""

    @abc.abstractmethod
    def list_workers(self) -> list[WorkerInfo]: ...

    @abc.abstractmethod
    def owners(self) -> set[str]:
        """Every control-plane instance that owns a job that is not final."""

    @abc.abstractmethod
    def count_by_state(self) -> dict[str, int]: ...

    @abc.abstractmethod
    def gpu_seconds(
        self, since: Sequence[float], until: float
    ) -> dict[tuple[str, str | None], list[float]]:
        """GPU-seconds of the attempts that ended by ``until``, for each window
        from one of ``since`` to ``until``: (project, user) -> one sum per
        window, in the order of ``since``. An attempt counts its GPUs (the
        spec's gpus x nodes) times the part of its time from its placement
        to its end that falls in the window: a job's last attempt ends when
        it became final, an earlier one when it was queued again
        (:meth:`Transaction.requeue` given ``at``). Only attempts that ended
        by ``until`` count, so that one still running then is left to the
        control plane, which holds it. The default project is
        ``projects.DEFAULT_PROJECT``."""

    @abc.abstractmethod
    def add_token(
        self,
        digest: str,
        role: str,
        name: str | None,
        created: float,
        expires: float | None = None,
        *,
        user: str | None = None,
    ) -> None: ...

    @abc.abstractmethod
    def token_role(self, digest: str) -> tuple[str, float | None] | None:
        """The role of the token whose sha256 is ``digest`` and when it
        expires (None: never), if it exists."""

    @abc.abstractmethod
    def token_user(self, digest: str) -> str | None:
        """The user the token whose sha256 is ``digest`` acts as (None: it
        has none, or there is no such token)."""

    @abc.abstractmethod
    def token_users(self) -> dict[str, str]:
        """The sha256 of every token that has a user -> that user."""

    @abc.abstractmethod
    def count_tokens(self, role: str) -> int: ...

    @abc.abstractmethod
    def list_tokens(self) -> list[tuple[str, str, str | None, float, float | None]]:
        """Every token as (sha256, role, name, created, expires), oldest first."""

    @abc.abstractmethod
    def delete_token(self, digest: str, *, keep_last: str | None = None) -> bool:
        """Delete the token whose sha256 is ``digest``. False, with nothing
        deleted, if there is none, or if it is the last token of the role
        ``keep_last`` that does not expire: one atomic step, so two deletes
        at once cannot take the last two."""

    @abc.abstractmethod
    def readable_blobs(self, reader: str, digests: Collection[str]) -> set[str]:
        """Those of ``digests`` granted to ``reader`` (:meth:`Transaction.grant_blobs`),
        in one query however many: it is on the path of every submit over HTTP."""

    @abc.abstractmethod
    def worker_bindings(self) -> dict[str, str]:
        """Worker id -> the sha256 of the token that registered it, for every
        worker registered with a token (see ``upsert_worker``)."""

    # ---- projects (see projects.py) ----
    # Each write is one atomic step. The control plane keeps the registry in
    # memory (projects.Memberships) and calls these with its lock held.

    @abc.abstractmethod
    def create_project(self, info: ProjectInfo) -> bool:
        """Store a new project, with ``info.members`` (added at ``info.created``);
        False, with nothing changed, if one has that name."""

    @abc.abstractmethod
    def set_project_quota(
        self,
        name: str,
        *,
        gpus: int | UnsetType | None = UNSET,
        slots: int | UnsetType | None = UNSET,
    ) -> bool:
        """Change the project's quotas: a number, None for no limit,
        ``msgspec.UNSET`` (the default) to leave one as it is. False, with
        nothing changed, if there is no such project."""

    @abc.abstractmethod
    def add_project_member(self, project: str, user: str, added: float) -> bool:
        """Make ``user`` a member (one already is stays, as added first);
        False, with nothing changed, if there is no such project."""

    @abc.abstractmethod
    def remove_project_member(self, project: str, user: str) -> bool:
        """False if there is no such project, or ``user`` is not in it."""

    @abc.abstractmethod
    def delete_project(self, name: str) -> bool:
        """Delete the project, its members and usage; False if there is none.
        Refused (InvalidStateError, nothing changed) while a job in it is
        not final. The final jobs kept are taken out of it (they belong to
        no project any more, not even a new one of the same name, whose
        members must not see them); each one's spec still names it."""

    @abc.abstractmethod
    def list_projects(self) -> list[ProjectInfo]:
        """Every project, oldest first, with its members in the order they were added."""

    @abc.abstractmethod
    def project_members(self) -> list[tuple[str, str]]:
        """Every (project, user), in the order they were added (to build
        projects.Memberships: a user's first project is the one joined first)."""

    @abc.abstractmethod
    def load_usage(self) -> dict[str, tuple[float, float]]:
        """Each project's recent usage as kept: project -> (usage, at)."""

    @abc.abstractmethod
    def save_usage(self, project: str, usage: float, at: float) -> None:
        """As :meth:`Transaction.save_usage`, in a commit of its own."""

    @abc.abstractmethod
    def close(self) -> None: ...


__all__ = ["Store", "Transaction"]
