"""A worker gets instructions on two paths (its long poll, and the replies to
its finished reports), so they may come twice or out of order."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from gpulayer.embedded import Embedded
from gpulayer.errors import AccessDenied, InvalidStateError, ServerUnreachable, WorkerError
from gpulayer.jobs import CancelTask, Instruction, RunTask, TaskResult, WorkerInfo
from gpulayer.spec import parse_spec
from gpulayer.transport.http import _Received
from gpulayer.transport.inprocess import InProcessTransport
from gpulayer.worker import task as task_module
from gpulayer.worker.task import TaskRun
from gpulayer.worker.worker import Worker

from helpers import PY, record_registrations

T = TypeVar("T", bound=InProcessTransport)


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


def _worker_on(
    embedded: Embedded, transport: InProcessTransport | None = None, **options: Any
) -> Worker:
    """A one-slot worker (not started) on ``transport``, by default the plane's own."""
    transport = transport or InProcessTransport(embedded.plane, embedded.artifacts)
    return Worker(
        transport, cache=embedded.artifacts, work_dir=embedded.home.path / "w", slots=1, **options
    )


@contextmanager
def _one_slot_worker(
    home: Path, make: Callable[[Embedded], T], *, stop: float = 30.0
) -> Iterator[tuple[Embedded, T, Worker]]:
    """A one-slot worker (not started) on ``make(embedded)``'s transport, stopped
    and its control plane closed afterwards; a held long poll is let go first."""
    embedded = Embedded(home)
    transport = make(embedded)
    worker = Worker(transport, cache=embedded.artifacts, work_dir=home / "w", slots=1)
    try:
        yield embedded, transport, worker
    finally:
        if isinstance(transport, _HeldPoll):
            transport.closed.set()
        worker.stop(timeout=stop)
        embedded.close()


def test_a_cancel_that_comes_before_its_task_stops_it_from_starting(home: Path) -> None:
    with _one_slot_worker(home, _HeldPoll) as (embedded, transport, worker):
        marker = home / "it-ran"
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


class _TakeOnFinish(_HeldPoll):
    """As over HTTP: the reply to a finished report brings what waits for the worker."""

    def task_finished(self, result: TaskResult, *, take: bool = True) -> list[Instruction]:
        self.plane.task_finished(result)
        return self.plane.take_instructions(result.worker_id) if take else []


def test_a_task_in_a_finished_reply_is_run_by_the_reporting_thread(home: Path) -> None:
    """In a stream of jobs, each next one is supervised by the thread that
    reported the last: its own thread is never started. It is still a task
    like any other: its output is kept, and it can be cancelled."""
    with _one_slot_worker(home, _TakeOnFinish) as (embedded, transport, worker):
        ran: list[TaskRun] = []
        task_done = worker._task_done

        def spy(run: TaskRun) -> None:
            ran.append(run)
            task_done(run)

        worker._task_done = spy  # type: ignore[method-assign]
        worker.start()
        jobs = [
            transport.submit(parse_spec({"command": [PY, "-c", f"print('job {i}')"]}))
            for i in range(3)
        ]
        sleeper = transport.submit(
            parse_spec({"command": [PY, "-c", "import time; print('up'); time.sleep(60)"]})
        )
        worker._handle(embedded.plane.take_instructions(worker.id))  # the first; the rest follow
        for i, job in enumerate(jobs):
            final = embedded.plane.wait(job.id, timeout=60)
            assert final.state == "succeeded", final.reason
            lines = embedded.plane.read_logs(job.id, (0, 0), 0).lines
            assert [line.text for line in lines] == [f"job {i}"]
        up = embedded.plane.read_logs(sleeper.id, (0, 0), 30).lines  # it runs now...
        assert [line.text for line in up] == ["up"]
        embedded.plane.cancel(sleeper.id)
        worker._handle(embedded.plane.take_instructions(worker.id))  # ...and hears of the cancel
        assert embedded.plane.wait(sleeper.id, timeout=60).state == "cancelled"
        with worker._tasks_lock:  # its thread tidies up after reporting
            assert worker._idle.wait_for(lambda: not worker._tasks, timeout=30)
        assert [r.task.job_id for r in ran] == [j.id for j in [*jobs, sleeper]]
        started = [r.thread is not None for r in ran]
        assert started == [True, False, False, False]


def test_a_handed_over_task_runs_even_if_tidying_after_the_last_failed(home: Path) -> None:
    """Tidying up after a task (its folder, the ledger) can fail, a full disk
    say; the task that came in its finished reply must still be watched."""
    with _one_slot_worker(home, _TakeOnFinish) as (embedded, transport, worker):
        task_done = worker._task_done
        failed = []

        def full_disk_once(run: TaskRun) -> None:
            task_done(run)
            if not failed:
                failed.append(run.task.job_id)
                raise OSError(28, "No space left on device")

        worker._task_done = full_disk_once  # type: ignore[method-assign]
        worker.start()
        first, second = (
            transport.submit(parse_spec({"command": [PY, "-c", "pass"]})) for _ in range(2)
        )
        worker._handle(embedded.plane.take_instructions(worker.id))
        assert embedded.plane.wait(first.id, timeout=60).state == "succeeded"
        assert embedded.plane.wait(second.id, timeout=60).state == "succeeded"
        assert failed == [first.id]


def test_a_task_whose_tidying_up_fails_still_reports_its_end(home: Path) -> None:
    """Closing a task's log (or joining its terminators) can fail; the task's
    result must still be reported and the task let go, or its job runs on
    forever and the worker's stop waits for it."""
    with _one_slot_worker(home, _HeldPoll) as (embedded, transport, worker):

        def full_disk(task: object) -> None:
            raise OSError(28, "No space left on device")

        worker._logs.close_task = full_disk  # type: ignore[method-assign,assignment]
        worker.start()
        job = transport.submit(parse_spec({"command": [PY, "-c", "pass"]}))
        worker._handle(embedded.plane.take_instructions(worker.id))
        assert embedded.plane.wait(job.id, timeout=60).state == "succeeded"
        with worker._tasks_lock:
            assert worker._idle.wait_for(lambda: not worker._tasks, timeout=30)


def test_a_terminator_is_listed_only_once_started(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's thread joins every terminator listed; one listed before its
    start, by a cancel on another thread, made that join raise."""
    with _one_slot_worker(home, _HeldPoll) as (embedded, transport, worker):
        worker.start()
        job = transport.submit(
            parse_spec({"command": [PY, "-c", "import time; print('up'); time.sleep(60)"]})
        )
        worker._handle(embedded.plane.take_instructions(worker.id))
        assert [line.text for line in embedded.plane.read_logs(job.id, (0, 0), 30).lines] == ["up"]
        with worker._tasks_lock:
            (run,) = worker._tasks.values()
        listed_at_start: list[bool] = []
        start = threading.Thread.start

        def watched_start(thread: threading.Thread) -> None:
            if getattr(thread, "_target", None) is task_module.terminate_tree:
                listed_at_start.append(any(t is thread for t in run._terminators))
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", watched_start)
        embedded.plane.cancel(job.id)
        worker._handle(embedded.plane.take_instructions(worker.id))
        assert embedded.plane.wait(job.id, timeout=60).state == "cancelled"
        monkeypatch.undo()
        assert listed_at_start == [False]


class _UnknownAndAway(InProcessTransport):
    """A server that forgot the worker, and does not answer its registration."""

    def __init__(self, embedded: Embedded) -> None:
        super().__init__(embedded.plane, embedded.artifacts)
        self.registered = False
        self.attempts: list[float] = []
        self.enough = threading.Event()

    def register_worker(
        self, info: WorkerInfo, running: Iterable[tuple[str, int]] = (), *, adopted: bool = False
    ) -> WorkerInfo:
        if not self.registered:  # the first: the worker's start
            self.registered = True
            return super().register_worker(info, running, adopted=adopted)
        self.attempts.append(time.monotonic())
        if len(self.attempts) == 3:
            self.enough.set()
        raise ServerUnreachable("no answer")

    def acquire(self, worker_id: str, timeout: float) -> list[Instruction]:
        raise InvalidStateError(f"worker {worker_id} is not registered")


def test_a_worker_whose_registration_goes_unanswered_backs_off(home: Path) -> None:
    with _one_slot_worker(home, _UnknownAndAway, stop=5) as (_, transport, worker):
        worker.start()
        assert transport.enough.wait(30)
    first, second, third = transport.attempts[:3]
    # It waits (0.05 s, then 0.1 s; with room for a coarse clock), where it had
    # asked again within microseconds.
    assert second - first >= 0.04 and third - second >= 0.08


def _unreachable() -> None:
    raise ServerUnreachable("away")


def test_a_worker_does_not_register_again_while_a_report_is_still_on_its_way(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else the server would take a task whose end is still in the outbox for
    one that never reached the worker, and run it again as the same attempt."""
    from gpulayer import defaults

    monkeypatch.setattr(defaults, "RECONNECT_MAX_S", 0.1)
    embedded = Embedded(home)
    calls = record_registrations(embedded.transport)
    worker = Worker(embedded.transport, cache=embedded.artifacts, work_dir=home / "w", slots=1)
    try:
        worker._outbox.send(_unreachable)  # a task's end, kept while the server is away
        assert worker._reregister() is False
        assert calls == []
    finally:
        worker._outbox.stop()
        worker._release_containment()  # never started: its cgroups go
        embedded.close()


def test_a_worker_adopting_an_id_registers_with_a_server_from_before_that_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpulayer.errors import TransportError
    from gpulayer.transport.http import HttpTransport

    bodies: list[bytes] = []

    def old_server(self: HttpTransport, body: bytes) -> tuple[WorkerInfo, str | None]:
        bodies.append(body)
        if b'"adopted"' in body:
            raise TransportError(
                "the server refused the request (422): invalid request body: "
                "Object contains unknown field `adopted`"
            )
        return WorkerInfo(id="w1", name="w", host="h", slot_gpus=[None]), "1"

    monkeypatch.setattr(HttpTransport, "_register", old_server)
    transport = HttpTransport("http://127.0.0.1:1")
    info = transport.register_worker(
        WorkerInfo(id="w1", name="w", host="h", slot_gpus=[None]), adopted=True
    )
    assert info.id == "w1"
    assert [b'"adopted"' in b for b in bodies] == [True, False]


def test_a_report_queued_just_after_the_outbox_was_through_still_holds_registration(
    home: Path,
) -> None:
    """A task may end, and its report meet a 503, between the outbox's flush
    and the look at the running tasks: the task is then named nowhere."""
    embedded = Embedded(home)
    calls = record_registrations(embedded.transport)
    worker = Worker(embedded.transport, cache=embedded.artifacts, work_dir=home / "w", slots=1)
    flush = worker._outbox.flush

    def through_then_a_report(timeout: float | None = None) -> bool:
        through = flush(timeout)
        worker._outbox.send(_unreachable)  # the task's end, refused, kept
        return through

    worker._outbox.flush = through_then_a_report  # type: ignore[method-assign]
    try:
        assert worker._reregister() is False
        assert calls == []
    finally:
        worker._outbox.stop()
        worker._release_containment()  # never started: its cgroups go
        embedded.close()


def test_a_stopping_worker_does_not_register_again(home: Path) -> None:
    """Its goodbye is on its way: a registration after it would leave a
    worker the server places jobs on, that no process serves."""
    embedded = Embedded(home)
    worker = Worker(embedded.transport, cache=embedded.artifacts, work_dir=home / "w", slots=1)
    try:
        worker._stopping.set()
        assert worker._reregister() is False
        assert embedded.plane.list_workers() == []
    finally:
        worker._release_containment()  # never started: its cgroups go
        embedded.close()


def test_an_outbox_told_the_server_is_back_retries_at_once() -> None:
    """After a long outage its back-off has grown to seconds: a worker that
    hears from the server again (and must deliver before registering) does
    not wait it out."""
    from gpulayer.worker.outbox import Outbox

    outbox = Outbox(max_backoff=60)
    attempts: list[int] = []
    seventh = threading.Event()
    up = threading.Event()

    def deliver() -> None:
        attempts.append(1)
        if len(attempts) == 7:
            seventh.set()  # its next back-off is 1.6 s
        if not up.is_set():
            raise ServerUnreachable("away")

    try:
        outbox.send(deliver)
        assert seventh.wait(30)
        up.set()
        outbox.retry_now()
        assert outbox.flush(timeout=1.0), "it waited out its back-off"
    finally:
        outbox.stop()


class _Garbled(InProcessTransport):
    """The first long poll's reply cannot be read (a bug, a proxy's page)."""

    def __init__(self, embedded: Embedded) -> None:
        super().__init__(embedded.plane, embedded.artifacts)
        self.garbled = 0

    def acquire(self, worker_id: str, timeout: float) -> list[Instruction]:
        if not self.garbled:
            self.garbled += 1
            raise ValueError("not JSON")
        return super().acquire(worker_id, timeout)


def test_a_long_poll_reply_it_cannot_read_does_not_end_the_worker(home: Path) -> None:
    with _one_slot_worker(home, _Garbled) as (embedded, transport, worker):
        worker.start()
        job = transport.submit(parse_spec({"command": [PY, "-c", "pass"]}))
        assert embedded.plane.wait(job.id, timeout=30).state == "succeeded"
        assert transport.garbled == 1 and worker.gave_up is None


class _ForgotThenRefusesRegistration(InProcessTransport):
    """The server restarted (the long poll says it does not know the worker);
    the registration that follows fails once with ``error``, then works."""

    def __init__(self, embedded: Embedded, error: Exception) -> None:
        super().__init__(embedded.plane, embedded.artifacts)
        self.error = error
        self.registrations = 0
        self.forgot = True
        self.registered_again = threading.Event()

    def register_worker(
        self, info: WorkerInfo, running: Iterable[tuple[str, int]] = (), *, adopted: bool = False
    ) -> WorkerInfo:
        self.registrations += 1
        if self.registrations == 2:  # the first registration after the "restart"
            raise self.error
        if self.registrations >= 3:
            self.forgot = False
            self.registered_again.set()
        return super().register_worker(info, running, adopted=adopted)

    def acquire(self, worker_id: str, timeout: float) -> list[Instruction]:
        if self.forgot:
            raise InvalidStateError(f"worker {worker_id} is not registered")
        return super().acquire(worker_id, min(timeout, 0.2))


def test_a_registration_again_whose_reply_it_cannot_read_is_tried_again(home: Path) -> None:
    """A long poll answered 409 leads to registering again; a reply to that it
    cannot read (a proxy's page) must not end the acquire thread, or the worker
    serves nothing again while its heartbeats keep it quiet."""
    with _one_slot_worker(
        home,
        lambda embedded: _ForgotThenRefusesRegistration(embedded, ValueError("not JSON")),
        stop=10,
    ) as (_, transport, worker):
        worker.start()
        assert transport.registered_again.wait(15)
        assert worker.gave_up is None


def test_a_registration_again_refused_for_its_token_gives_up(home: Path) -> None:
    embedded = Embedded(home)
    refused = AccessDenied("the token is not valid on this server")
    transport = _ForgotThenRefusesRegistration(embedded, refused)
    told = threading.Event()
    worker = Worker(
        transport, cache=embedded.artifacts, work_dir=home / "w", slots=1, on_give_up=told.set
    )
    try:
        worker.start()
        assert told.wait(15)
        assert worker.gave_up == f"the server refused this worker's token: {refused}"
    finally:
        worker.stop(timeout=10)
        embedded.close()


class _LogsRefused(InProcessTransport):
    """Every log batch is refused (a 401 for a revoked token, say)."""

    def append_logs(self, *args: object, **kwargs: object) -> None:
        raise AccessDenied("the token is not valid on this server")


def test_a_task_whose_last_log_lines_are_refused_still_reports_its_end(home: Path) -> None:
    """Its last lines go before its result; refused, they must not keep the
    result from going, or the worker from letting the task go."""
    with _one_slot_worker(
        home, lambda embedded: _LogsRefused(embedded.plane, embedded.artifacts), stop=5
    ) as (embedded, transport, worker):
        worker.start()
        job = transport.submit(parse_spec({"command": [PY, "-c", "print('hello')"]}))
        assert embedded.plane.wait(job.id, timeout=20).state == "succeeded"
        with worker._tasks_lock:
            assert worker._idle.wait_for(lambda: not worker._tasks, timeout=30)


def test_a_worker_stopped_between_registering_and_serving_says_goodbye(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal there (the CLI exits at once until it serves): the job placed
    on it as it registered goes elsewhere now, not after the heartbeat
    timeout, and that placement does not count as an attempt."""
    from gpulayer.worker import worker as worker_module

    def signalled(path: Path) -> Path:
        raise KeyboardInterrupt

    with _one_slot_worker(home, _HeldPoll) as (embedded, transport, worker):
        job = transport.submit(parse_spec({"command": [PY, "-c", "pass"]}))
        monkeypatch.setattr(worker_module, "make_spare", signalled)
        with pytest.raises(KeyboardInterrupt):
            worker.start()
        assert embedded.plane.list_workers() == []
        info = embedded.plane.get(job.id)
        assert (info.state, info.attempt) == ("queued", 0), info.reason


def test_a_worker_whose_start_fails_once_serving_stops_its_loop_and_says_goodbye(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its heartbeat thread cannot start, say, after its acquire loop has, and
    has taken a job: the job is ended, not left running here."""
    started = home / "started"
    home.mkdir(parents=True, exist_ok=True)
    os.mkfifo(started)

    class NoHeartbeat(threading.Thread):
        def start(self) -> None:
            if self.name.startswith("gpulayer-heartbeat"):
                with open(started) as job_runs:  # until the job has started
                    job_runs.read()
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(threading, "Thread", NoHeartbeat)
    embedded = Embedded(home)
    transport = InProcessTransport(embedded.plane, embedded.artifacts)
    worker = _worker_on(embedded, transport, heartbeat_interval=60)
    code = f"open({str(started)!r}, 'w').write('x'); import time; time.sleep(600)"
    job = transport.submit(parse_spec({"command": [PY, "-c", code]}))
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            worker.start()  # its loop has taken the job by now
        assert worker._thread is not None and not worker._thread.is_alive()
        assert embedded.plane.list_workers() == []
        assert worker.running() == 0, "the job taken was ended, not left running here"
        assert embedded.plane.get(job.id).state == "lost"
        with pytest.raises(WorkerError, match="a worker starts once"):
            worker.start()
    finally:
        embedded.close()


def test_a_failed_starts_goodbye_waits_only_a_few_seconds(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stopped answering: the worker, asked to go, goes."""
    from gpulayer.worker import worker as worker_module

    answered, gone = threading.Event(), threading.Event()

    class Unanswered(InProcessTransport):
        def unregister_worker(self, worker_id: str, **kwargs: Any) -> None:
            answered.wait(5)
            gone.set()

    def signalled(path: Path) -> Path:
        raise KeyboardInterrupt

    monkeypatch.setattr(worker_module, "_GOODBYE_WAIT_S", 0.2)
    monkeypatch.setattr(worker_module, "make_spare", signalled)
    embedded = Embedded(home)
    worker = _worker_on(embedded, Unanswered(embedded.plane, embedded.artifacts))
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.start()  # after 0.2 s, not once the goodbye is answered
        assert not gone.is_set()
    finally:
        answered.set()
        embedded.close()


def test_a_worker_whose_loop_thread_cannot_start_says_goodbye_and_lets_go(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The original error is the one raised; no ghost, no thread left."""

    class NoLoop(threading.Thread):
        def start(self) -> None:
            if self.name.startswith("gpulayer-worker-"):
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(threading, "Thread", NoLoop)
    embedded = Embedded(home)
    worker = _worker_on(embedded)
    try:
        with pytest.raises(RuntimeError, match="can't start new thread"):
            worker.start()
        assert embedded.plane.list_workers() == []
        assert not worker._logs._thread.is_alive()
    finally:
        embedded.close()


def test_stop_twice_touches_nothing_the_second_time(home: Path) -> None:
    """A ledger's descriptors are closed once: the second stop() must not
    close a file the process has opened since under the same number."""
    embedded = Embedded(home)
    worker = _worker_on(embedded, ledger=True)
    try:
        worker.start()
        worker.stop()
        with open(os.devnull) as since:  # may take a number the ledger had
            worker.stop()
            os.fstat(since.fileno())
    finally:
        embedded.close()


def test_finished_task_folders_are_deleted_in_order_on_one_thread(tmp_path: Path) -> None:
    from gpulayer.worker.workspace import Remover, make_spare

    remover = Remover()
    folders = [make_spare(tmp_path / f"task-{i}") for i in range(20)]
    for folder in folders:
        (folder / "workspace" / "big").write_bytes(b"x" * 4096)
    threads_before = threading.active_count()
    for folder in folders:
        remover.remove(folder)
    assert threading.active_count() <= threads_before + 1  # one deleting thread, not twenty
    assert remover.wait(30)
    assert [f for f in folders if f.exists()] == []
    assert remover.wait(0)  # nothing handed over: done at once
