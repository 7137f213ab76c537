"""A worker gets instructions on two paths (its long poll, and the replies to
its finished reports), so they may come twice or out of order."""

from __future__ import annotations

import threading
from pathlib import Path

from gpulayer.embedded import Embedded
from gpulayer.jobs import CancelTask, Instruction, RunTask
from gpulayer.spec import parse_spec
from gpulayer.transport.http import _Received
from gpulayer.transport.inprocess import InProcessTransport
from gpulayer.worker.worker import Worker

from helpers import PY


def _cancels(*ids: str) -> list[Instruction]:
    return [CancelTask(job_id=i, attempt=1) for i in ids]


def test_each_numbered_instruction_is_handed_on_once_whatever_the_order() -> None:
    received = _Received()
    a, b, c, d = _cancels("a", "b", "c", "d")
    assert received.accept(1, [a]) == [a]
    assert received.accept(3, [c]) == [c]  # ahead of a gap: handed on, not acknowledged
    assert received.acked == 1
    assert received.accept(1, [a, b, c]) == [b]  # sent again with the gap: only b is new
    assert received.acked == 3
    assert received.accept(3, [c, d]) == [d]
    assert received.accept(2, [b, c, d]) == []
    assert received.acked == 4


class _HeldPoll(InProcessTransport):
    """The real in-process transport, but the worker's long poll brings nothing:
    the test hands the worker its instructions itself, in the order it likes."""

    def __init__(self, embedded: Embedded) -> None:
        super().__init__(embedded.plane, embedded.artifacts)
        self.closed = threading.Event()

    def acquire(self, worker_id: str, timeout: float) -> list[Instruction]:
        self.closed.wait(timeout)
        return []


def test_a_cancel_that_comes_before_its_task_stops_it_from_starting(home: Path) -> None:
    embedded = Embedded(home)
    transport = _HeldPoll(embedded)
    worker = Worker(transport, cache=embedded.artifacts, work_dir=home / "w", slots=1)
    marker = home / "it-ran"
    try:
        worker.start()
        job = transport.submit(parse_spec({"command": [PY, "-c", f"open({str(marker)!r}, 'w')"]}))
        (task,) = embedded.plane.take_instructions(worker.id)
        assert isinstance(task, RunTask)
        embedded.plane.cancel(job.id)
        (cancel,) = embedded.plane.take_instructions(worker.id)
        assert cancel == CancelTask(job_id=job.id, attempt=1)
        worker._handle([cancel])  # the cancel's reply came first...
        worker._handle([task])  # ...then the task's
        final = embedded.plane.wait(job.id, timeout=60)
        assert final.state == "cancelled"
        assert "started" not in final.marks and not marker.exists()
    finally:
        transport.closed.set()
        worker.stop(timeout=30)
        embedded.close()
