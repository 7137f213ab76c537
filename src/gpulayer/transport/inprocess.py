"""The transport for an embedded control plane: plain method calls."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from ..artifacts import ArtifactStore
from ..errors import ArtifactError, ServerUnreachable, StoreError
from ..jobs import (
    WORKER_DIED,
    WORKER_STOPPED,
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
from ..service import ControlPlane
from ..spec import JobSpec
from . import Transport


class InProcessTransport(Transport):
    def __init__(self, plane: ControlPlane, artifacts: ArtifactStore) -> None:
        self.plane = plane
        self.artifacts = artifacts

    def submit(self, spec: JobSpec) -> JobInfo:
        return self.plane.submit(spec)

    def get_job(self, job_id: str) -> JobInfo:
        return self.plane.get(job_id)

    def list_jobs(
        self,
        *,
        states: Iterable[str] = (),
        limit: int | None = None,
        labels: Mapping[str, str] | None = None,
        array: str | None = None,
    ) -> list[JobInfo]:
        return self.plane.list_jobs(states=states, limit=limit, labels=labels, array=array)

    def wait(self, job_id: str, timeout: float | None) -> JobInfo:
        return self.plane.wait(job_id, timeout)

    def cancel(self, job_id: str) -> JobInfo:
        return self.plane.cancel(job_id)

    def read_logs(self, job_id: str, after: tuple[int, int], timeout: float) -> LogChunk:
        return self.plane.read_logs(job_id, after, timeout)

    def list_workers(self) -> list[WorkerInfo]:
        return self.plane.list_workers()

    def usage(self) -> list[ProjectUsage]:
        return self.plane.usage()

    def missing_blobs(self, digests: Iterable[str]) -> set[str]:
        return {d for d in digests if not self.artifacts.has(d)}

    def upload_blob(
        self,
        path: Path,
        digest: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> str:
        return self.artifacts.put_file(path, digest=digest, on_progress=on_progress)

    def upload_blobs(
        self, files: Mapping[str, Path], on_progress: Callable[[int], None] | None = None
    ) -> None:
        self.artifacts.put_files(files, on_progress=on_progress)

    def upload_bytes(self, data: bytes) -> str:
        return self.artifacts.put_bytes(data)

    def download_blob(self, digest: str, cache: ArtifactStore) -> Path:
        if cache.root == self.artifacts.root:
            if not self.artifacts.has(digest):
                raise ArtifactError(
                    f"artifact {digest} is not in the store at {self.artifacts.root}"
                )
            return self.artifacts.path(digest)
        if not cache.has(digest):
            cache.link_from(self.artifacts.path(digest), digest)
        return cache.path(digest)

    def register_worker(
        self, info: WorkerInfo, running: Iterable[tuple[str, int]] = (), *, adopted: bool = False
    ) -> WorkerInfo:
        return self.plane.register_worker(info, running, adopted=adopted)

    def heartbeat(
        self, worker_id: str, *, stopping: bool = False, gpus: Sequence[GpuStats] = ()
    ) -> None:
        self.plane.heartbeat(worker_id, stopping=stopping, gpus=gpus)

    def unregister_worker(
        self, worker_id: str, *, died: bool = False, generation: str | None = None
    ) -> None:
        with _store_unavailable():  # a stopping worker leaves anyway
            reason = WORKER_DIED if died else WORKER_STOPPED
            gen = int(generation) if generation else None
            self.plane.unregister_worker(worker_id, reason, said=True, generation=gen)

    def acquire(self, worker_id: str, timeout: float) -> list[Instruction]:
        return self.plane.acquire(worker_id, timeout)

    # A worker's reports. A write the store refused changed nothing: raised as
    # ServerUnreachable, the report stays in the worker's outbox and goes again,
    # as it would to a server that answered 503.

    def task_started(self, report: TaskStarted) -> None:
        with _store_unavailable():
            self.plane.task_started(report)

    def task_rendezvous(self, job_id: str, attempt: int, worker_id: str, port: int) -> None:
        with _store_unavailable():
            self.plane.task_rendezvous(job_id, attempt, worker_id, port)

    def append_logs(self, job_id: str, attempt: int, lines: list[LogLine], node: int = 0) -> None:
        with _store_unavailable():
            self.plane.append_logs(job_id, attempt, lines, node)

    def task_finished(self, result: TaskResult, *, take: bool = True) -> list[Instruction]:
        with _store_unavailable():
            self.plane.task_finished(result)
        return []  # in-process, the worker's long poll costs nothing: it brings them


@contextlib.contextmanager
def _store_unavailable() -> Iterator[None]:
    try:
        yield
    except StoreError as exc:
        raise ServerUnreachable(str(exc)) from exc
