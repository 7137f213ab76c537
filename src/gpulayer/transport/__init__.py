"""How clients and workers reach a control plane.

:class:`Transport` is the one interface both use. ``inprocess.py`` calls an
embedded :class:`~gpulayer.service.ControlPlane` directly; an HTTP transport
implements the same methods against a server. Blobs move through it too, so a
worker never needs to know where the control plane keeps them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from ..artifacts import ArtifactStore
from ..errors import GPUlayerError
from ..jobs import (
    STATES,
    GpuStats,
    Instruction,
    JobInfo,
    LogChunk,
    LogLine,
    TaskResult,
    TaskStarted,
    WorkerInfo,
)
from ..projects import ProjectUsage
from ..spec import MAX_LABEL_KEY_CHARS, MAX_LABEL_VALUE_CHARS, MAX_LABELS, JobSpec


def check_job_filter(states: Iterable[str], labels: Mapping[str, str]) -> None:
    """The filters of a listing (:meth:`Transport.list_jobs`), checked alike
    by the client, embedded and by a server, so that a typo gets the same
    words everywhere rather than an empty list. Raises GPUlayerError."""
    for state in states:
        if state not in STATES:
            raise GPUlayerError(f"unknown state {state!r}; states are: {', '.join(STATES)}")
    # A job carries at most MAX_LABELS labels: a filter of more matches none,
    # and each label is one more bound parameter in the store's query.
    if len(labels) > MAX_LABELS:
        raise GPUlayerError(f"at most {MAX_LABELS} labels to filter by, got {len(labels)}")
    for key, value in labels.items():
        if not key:
            raise GPUlayerError(f"a label to filter by needs a key, got {'=' + value!r}")
        for part, text, most in (
            ("key", key, MAX_LABEL_KEY_CHARS),
            ("value", value, MAX_LABEL_VALUE_CHARS),
        ):
            if len(text) > most:
                raise GPUlayerError(
                    f"label {key[:64]!r} to filter by: its {part} has {len(text)} characters; "
                    f"a label's {part} has at most {most}, so no job carries it"
                )
        if "\x00" in key + value:
            raise GPUlayerError(f"label {key[:64]!r} holds a NUL character, which no label can")


def label_pairs(items: Iterable[str], where: str = "--label") -> dict[str, str]:
    """``KEY=VALUE`` texts (a command line's, a query string's) as a label
    filter; GPUlayerError naming ``where`` for one that is not."""
    found: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise GPUlayerError(f"{where} takes KEY=VALUE, got {item!r}")
        if key in found and found[key] != value:
            raise GPUlayerError(
                f"{where} {key}= given twice ({found[key]!r} and {value!r}); "
                "a job carries one value for each label"
            )
        found[key] = value
    return found


class Transport(abc.ABC):
    # ---- clients ----
    @abc.abstractmethod
    def submit(self, spec: JobSpec) -> JobInfo: ...

    @abc.abstractmethod
    def get_job(self, job_id: str) -> JobInfo: ...

    @abc.abstractmethod
    def list_jobs(
        self,
        *,
        states: Iterable[str] = (),
        limit: int | None = None,
        labels: Mapping[str, str] | None = None,
        array: str | None = None,
    ) -> list[JobInfo]:
        """Jobs newest first, an array as its one row; with ``labels``, only
        those carrying every one (key and value exactly); with ``array``
        (its id or start), that array's tasks by index. See
        :func:`check_job_filter`."""

    @abc.abstractmethod
    def wait(self, job_id: str, timeout: float | None) -> JobInfo: ...

    def wait_also(
        self, job_id: str, also: Sequence[str], timeout: float | None
    ) -> tuple[JobInfo, list[JobInfo], list[str]]:
        """:meth:`wait` for ``job_id``, and the records of those of ``also``
        (full ids) that are final by then, and those of them that name no
        job: a transport where each call is a request brings them in the
        same one."""
        return self.wait(job_id, timeout), [], []

    @abc.abstractmethod
    def cancel(self, job_id: str) -> JobInfo: ...

    @abc.abstractmethod
    def read_logs(self, job_id: str, after: tuple[int, int], timeout: float) -> LogChunk: ...

    @abc.abstractmethod
    def list_workers(self) -> list[WorkerInfo]: ...

    @abc.abstractmethod
    def usage(self) -> list[ProjectUsage]:
        """Usage by project, the rows the caller may see (see
        ``service/projects.py``): GPU-hours over the last day and week, jobs
        running and waiting, what they hold, quotas."""

    @abc.abstractmethod
    def missing_blobs(self, digests: Iterable[str]) -> set[str]:
        """Which of ``digests`` the control plane does not hold yet."""

    @abc.abstractmethod
    def upload_blob(
        self,
        path: Path,
        digest: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> str:
        """Store the file's bytes (skipped when ``digest`` is already held); return its digest."""

    @abc.abstractmethod
    def upload_bytes(self, data: bytes) -> str: ...

    def upload_blobs(
        self, files: Mapping[str, Path], on_progress: Callable[[int], None] | None = None
    ) -> None:
        """Upload each ``digest -> path``; transports may do several at once."""
        for digest, path in files.items():
            self.upload_blob(path, digest, on_progress)

    @abc.abstractmethod
    def download_blob(self, digest: str, cache: ArtifactStore) -> Path:
        """Make ``digest`` present in ``cache`` (a no-op on a hit); return its path."""

    # ---- workers ----
    @abc.abstractmethod
    def register_worker(
        self, info: WorkerInfo, running: Iterable[tuple[str, int]] = (), *, adopted: bool = False
    ) -> WorkerInfo:
        """Register, or re-attach with the tasks (job id, attempt) still running here.
        ``adopted``: a new worker process taking the id of one that died (it
        ended what that one left running)."""

    @abc.abstractmethod
    def heartbeat(
        self, worker_id: str, *, stopping: bool = False, gpus: Sequence[GpuStats] = ()
    ) -> None:
        """The worker is alive; a ``stopping`` one takes no more work.
        ``gpus``: its GPUs' latest figures (see worker/telemetry.py)."""

    @abc.abstractmethod
    def unregister_worker(
        self, worker_id: str, *, died: bool = False, generation: str | None = None
    ) -> None:
        """The worker leaves; the jobs it runs are retried or end lost. ``died``:
        its process died and its warden ended those (the reason they are given).
        ``generation`` (see :meth:`generation`): only if that registration
        is still the worker's, not one made since under its id."""

    def generation(self) -> str | None:
        """The worker's registration as the control plane numbers it, if it
        does (over HTTP); None in process."""
        return None

    @abc.abstractmethod
    def acquire(self, worker_id: str, timeout: float) -> list[Instruction]: ...

    @abc.abstractmethod
    def task_started(self, report: TaskStarted) -> None: ...

    @abc.abstractmethod
    def task_rendezvous(self, job_id: str, attempt: int, worker_id: str, port: int) -> None:
        """Node 0 of a distributed job tells the port its rank 0 will listen on."""

    @abc.abstractmethod
    def append_logs(
        self, job_id: str, attempt: int, lines: list[LogLine], node: int = 0
    ) -> None: ...

    @abc.abstractmethod
    def task_finished(self, result: TaskResult, *, take: bool = True) -> list[Instruction]:
        """Report a task's end; returns instructions for the reporting worker
        that came with the reply (a server sends its next task this way), to
        act on as on those from :meth:`acquire`. With ``take=False`` (a
        worker that is stopping), none come."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections; the default holds none."""


__all__ = ["Transport", "check_job_filter", "label_pairs"]
