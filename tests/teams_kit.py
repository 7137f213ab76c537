"""What the tests of sharing (projects, quotas, fair share, preemption)
drive the control plane with: a clock a test moves, a lab of two projects,
GPU workers, and the reports their tasks send."""

from __future__ import annotations

from pathlib import Path

from gpulayer.access import Viewer
from gpulayer.jobs import RunTask, TaskResult, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import JobSpec, parse_spec
from gpulayer.store.sqlite import SqliteStore

ADA, BOB, EVE = Viewer("ada"), Viewer("bob"), Viewer("eve")
ADMIN = Viewer("root", admin=True)


class Clock:
    """The control plane's clock, moved by the test (``clock.now += 3600``)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def make_lab(tmp_path: Path, clock: Clock) -> ControlPlane:
    """A plane with project vision (ada, bob) and nlp (eve); no workers."""
    plane = ControlPlane(SqliteStore(tmp_path / "db.sqlite"), instance_id="test", clock=clock)
    plane.create_project("vision")
    plane.create_project("nlp")
    for user in ("ada", "bob"):
        plane.add_project_member("vision", user)
    plane.add_project_member("nlp", "eve")
    return plane


def job(gpus: int = 1, **fields: object) -> JobSpec:
    return parse_spec({"command": ["x"], "gpus": gpus, **fields})


def gpu_worker(plane: ControlPlane, gpus: int, name: str = "w") -> str:
    info = WorkerInfo(id="", name=name, host=name, slot_gpus=list(range(gpus)))
    return plane.register_worker(info).id


def report(
    plane: ControlPlane, task: RunTask, worker_id: str, outcome: str = "exited", code: int = 0
) -> None:
    """``task`` ended on ``worker_id`` (by default: exited 0)."""
    plane.task_finished(
        TaskResult(
            job_id=task.job_id,
            attempt=task.attempt,
            worker_id=worker_id,
            node=task.node,
            outcome=outcome,  # type: ignore[arg-type]
            exit_code=code,
        )
    )
