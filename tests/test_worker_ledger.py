"""A worker's ledger of its tasks' processes, left for the next worker on
its home when its tasks could not all be ended."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpulayer.embedded import Embedded
from gpulayer.errors import ServerUnreachable, WorkerError
from gpulayer.jobs import Instruction, LogLine, TaskResult
from gpulayer.spec import parse_spec
from gpulayer.transport.inprocess import InProcessTransport
from gpulayer.worker import worker as worker_module
from gpulayer.worker.ledger import Kept, Ledger, _read
from gpulayer.worker.logs import TaskLog
from gpulayer.worker.worker import Worker

from helpers import PY, pids_alive, record_registrations

STUBBORN = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('pid', os.getpid(), flush=True)\n"
    "time.sleep(120)\n"
)


def _keeping_a_ledger(
    embedded: Embedded, work: Path, *, kill_grace: float, warden: bool = False
) -> Worker:
    """A one-slot worker (not started) that keeps a ledger, as a worker process does."""
    return Worker(
        embedded.transport,
        cache=embedded.artifacts,
        work_dir=work,
        slots=1,
        kill_grace=kill_grace,
        ledger=True,
        warden=warden,
    )


def test_a_task_that_outlives_the_stop_is_left_in_the_ledger(home: Path) -> None:
    embedded = Embedded(home)
    work = home / "ledger-workers"
    worker = _keeping_a_ledger(embedded, work, kill_grace=60)  # longer than the stop waits
    try:
        worker.start()
        job = embedded.transport.submit(parse_spec({"command": [PY, "-c", STUBBORN]}))
        (line,) = embedded.plane.read_logs(job.id, timeout=30).lines
        pid = int(line.text.split()[1])
        worker.stop(timeout=0.5)  # the task ignores SIGTERM: it is still there
        assert pids_alive(pid) == [pid]
        records = list((work / "live").glob("*/tasks/*"))
        assert len(records) == 1 and records[0].read_text().startswith(f"{pid} ")
        # The worker process ends (its lock goes with it); the next worker
        # process on this home ends what the ledger lists.
        assert worker._ledger is not None
        _die(worker._ledger)
        Ledger(work).recover(grace=0.2)
        assert pids_alive(pid) == []
    finally:
        worker._release_containment()  # what the next worker's sweep would remove
        embedded.close()


def test_stop_again_once_a_task_that_outlived_it_ended_tidies_up(home: Path) -> None:
    embedded = Embedded(home)
    # Its grace is longer than the first stop waits.
    worker = _keeping_a_ledger(embedded, home / "ledger-workers", kill_grace=0.5)
    try:
        worker.start()
        job = embedded.transport.submit(parse_spec({"command": [PY, "-c", STUBBORN]}))
        embedded.plane.read_logs(job.id, timeout=30)  # it runs
        worker.stop(timeout=0.1)  # it ignores SIGTERM: it outlives this stop
        with worker._tasks_lock:  # until SIGKILL after the grace, and its report
            assert worker._idle.wait_for(lambda: not worker._tasks, 30)
        worker.stop()
        assert worker._ledger is not None and not worker._ledger.dir.exists()
        assert worker.tasks_dir is not None and not worker.tasks_dir.exists()
    finally:
        embedded.close()


def test_record_files_are_reused_in_place_and_blanked_when_tasks_end(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    try:
        ledger.record("a-1", [(11, 1.5), (12, 2.5)])
        ledger.record("b-1", [(13, 3.5)])
        files = sorted((ledger.dir / "tasks").iterdir())
        assert len(files) == 2

        ledger.forget("a-1")
        ledger.record("c-1", [(14, 4.5)])  # shorter than a-1's: nothing of it may remain

        assert sorted((ledger.dir / "tasks").iterdir()) == files  # no new file
        assert sorted(entry for f in files for entry in _read(f)) == [(13, 3.5), (14, 4.5)]
        ledger.forget("b-1")
        ledger.forget("c-1")
        assert [_read(f) for f in files] == [[], []]
    finally:
        ledger.close()
    assert not ledger.dir.exists()


def test_a_worker_taking_over_a_dead_ones_id_says_it_adopted_it(home: Path) -> None:
    """So the control plane counts what the dead one may have run (see
    test_gangs / test_store_failures for what it does with that)."""
    work = home / "ledger-workers"
    dead = Ledger(work)
    dead.set_worker_id("1m8deadworker0")
    _die(dead)  # the process died: its locks went with it
    embedded = Embedded(home)
    calls = record_registrations(embedded.transport)
    worker = Worker(
        embedded.transport, cache=embedded.artifacts, work_dir=work, slots=1, ledger=True
    )
    try:
        worker.start()
        assert calls == [("1m8deadworker0", True)]
    finally:
        worker.stop(timeout=5)
        embedded.close()


def _result(job_id: str, attempt: int = 1) -> TaskResult:
    return TaskResult(
        job_id=job_id, attempt=attempt, worker_id="1m8deadworker0", outcome="exited", exit_code=3
    )


def test_kept_results_outlive_their_worker_process_until_dropped(tmp_path: Path) -> None:
    dead = Ledger(tmp_path)
    dead.set_worker_id("1m8deadworker0")
    first, second = _result("1m8job00000001"), _result("1m8job00000002", attempt=2)
    lines = [LogLine(7, 1.5, "stdout", "the last line", None)]
    dead.keep(first, lines)
    dead.keep(second)
    dead.drop(second)  # the server took this one
    dead.drop(_result("1m8job00000003"))  # never kept: nothing to do
    with_lines = Kept(first, lines)
    assert dead.kept() == [with_lines]
    dead.close()  # a result is still kept: the ledger stays for the next worker
    assert dead.dir.exists()

    heir = Ledger(tmp_path)
    try:
        assert heir.recover(grace=0.2) == "1m8deadworker0"
        assert not dead.dir.exists()
        assert heir.kept() == [with_lines]  # now its own, read back whole
        _die(heir)  # this one dies too, before delivering it
        again = Ledger(tmp_path)
        assert again.recover(grace=0.2) is None  # no id was set on the heir
        assert again.kept() == [with_lines]
        again.drop(first)
        assert again.kept() == [] and list((again.dir / "results").iterdir()) == []
        again.close()
        assert not again.dir.exists()  # nothing left to recover: tidied away
    finally:
        with contextlib.suppress(OSError):
            _die(heir)


class _Away(InProcessTransport):
    """The server is away for results, log lines and goodbyes while ``away`` is set."""

    def __init__(self, embedded: Embedded) -> None:
        super().__init__(embedded.plane, embedded.artifacts)
        self.away = threading.Event()

    def task_finished(self, result: TaskResult, *, take: bool = True) -> list[Instruction]:
        if self.away.is_set():
            raise ServerUnreachable("away")
        return super().task_finished(result, take=take)

    def heartbeat(self, worker_id: str, *, stopping: bool = False) -> None:
        if self.away.is_set():
            raise ServerUnreachable("away")
        super().heartbeat(worker_id, stopping=stopping)

    def append_logs(self, job_id: str, attempt: int, lines: list[LogLine], node: int = 0) -> None:
        if self.away.is_set():
            raise ServerUnreachable("away")
        super().append_logs(job_id, attempt, lines, node)

    def unregister_worker(self, worker_id: str, **kwargs: Any) -> None:
        if self.away.is_set():
            raise ServerUnreachable("away")
        super().unregister_worker(worker_id, **kwargs)


class _BackForTheGoodbye(_Away):
    """The server is away while the task ends and while the stopping worker's
    outbox tries, and is back by the time the worker says goodbye (it came
    back during the outbox's back-off, after its last try)."""

    def unregister_worker(self, worker_id: str, **kwargs: Any) -> None:
        self.away.clear()
        super().unregister_worker(worker_id, **kwargs)


def _told_when_kept(worker: Worker) -> threading.Event:
    """An event set once ``worker`` has kept a result on disk."""
    assert worker._ledger is not None
    keep, kept = worker._ledger.keep, threading.Event()

    def keep_and_tell(result: TaskResult, lines: list[LogLine] | None = None) -> None:
        keep(result, lines)
        kept.set()

    worker._ledger.keep = keep_and_tell  # type: ignore[method-assign]
    return kept


@pytest.mark.parametrize("transport_type", [_Away, _BackForTheGoodbye])
def test_a_result_kept_while_the_server_was_away_is_delivered_by_the_next_worker(
    home: Path, monkeypatch: pytest.MonkeyPatch, transport_type: type[_Away]
) -> None:
    """A task ends while the server is away, and its worker stops (or is
    killed) before the server is back: the next worker process on the home
    delivers the result before registering, so the job ends as it ran. A
    stopping worker with a result still kept says no goodbye (which the
    server may be back to hear): the server would take the task for lost,
    and the result the next worker delivers would come too late."""
    monkeypatch.setattr(worker_module, "_OUTBOX_STOP_S", 0.2)
    embedded = Embedded(home)
    work = home / "ledger-workers"
    transport = transport_type(embedded)
    first = Worker(transport, cache=embedded.artifacts, work_dir=work, slots=1, ledger=True)
    second = None
    kept = _told_when_kept(first)
    try:
        first.start()
        transport.away.set()
        code = "print('during the outage', flush=True); raise SystemExit(7)"
        job = transport.submit(parse_spec({"command": [PY, "-c", code]}))
        assert kept.wait(60)  # it ended, and its end waits in the outbox
        first.stop(timeout=0.5)  # the outbox gives up
        assert embedded.plane.get(job.id).state == "running"
        (kept,) = (work / "live").glob("*/results/*")
        assert kept.name == f"{job.id}-1-0"

        transport.away.clear()
        second = Worker(transport, cache=embedded.artifacts, work_dir=work, slots=1, ledger=True)
        second.start()
        final = embedded.plane.wait(job.id, timeout=30)
        assert (final.state, final.exit_code, final.attempt) == ("failed", 7, 1), final.reason
        logs = embedded.plane.read_logs(job.id, (0, 0), 0).lines
        assert [line.text for line in logs] == ["during the outage"]  # kept with it
        assert second.id == first.id  # it took over the dead one's id
        assert list((work / "live").glob("*/results/*")) == []
    finally:
        if second is not None:
            second.stop(timeout=5)
        embedded.close()


class _Answers:
    """An HTTP server that answers every request with ``status`` (a proxy
    in front of a server that is down: 502/504; a token it does not take:
    401/403), counting the requests for finished reports."""

    def __init__(self, status: int) -> None:
        import http.server

        answers = self
        self.finished = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                if self.path.startswith("/api/v1/tasks/finished"):
                    answers.finished += 1
                body = b'{"error": "no"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("status", [401, 403, 502, 504])
def test_a_next_worker_that_cannot_start_keeps_the_results_it_could_not_deliver(
    tmp_path: Path, status: int
) -> None:
    """The next worker's start fails (its registration is answered ``status``
    as its reports were): the results the dead one kept must still be kept,
    for the try that follows (the right token, the server behind the proxy
    back). Only a refusal of the result itself may drop it."""
    from gpulayer.artifacts import ArtifactStore
    from gpulayer.errors import TransportError
    from gpulayer.transport.http import HttpTransport

    work = tmp_path / "workers"
    dead = Ledger(work)
    dead.set_worker_id("1m8deadworker0")
    result = _result("1m8job00000001")
    dead.keep(result)
    _die(dead)  # its process dies
    server = _Answers(status)
    heir = Worker(
        HttpTransport(server.url, token="t", retries=1),
        cache=ArtifactStore(tmp_path / "cache"),
        work_dir=work,
        slots=1,
        ledger=True,
    )
    try:
        with pytest.raises(TransportError):
            heir.start()
        assert server.finished == 1  # it tried to deliver it
        kept = [p.name for p in (work / "live").glob("*/results/*")]
        assert kept == [f"{result.job_id}-1-0"]
    finally:
        server.close()
        if heir._ledger is not None:
            _die(heir._ledger)  # as its process exits


def test_a_kept_result_that_cannot_be_read_back_is_dropped(tmp_path: Path) -> None:
    """Cut short, or not the result its name says: never delivered, and not
    left to keep the ledger from being tidied away."""
    ledger = Ledger(tmp_path)
    good, other = _result("1m8job00000001"), _result("1m8job00000002")
    ledger.keep(good)
    ledger.keep(other)
    kept = ledger.dir / "results"
    assert {(p.name, p.stat().st_mode & 0o777) for p in kept.iterdir()} == {
        ("1m8job00000001-1-0", 0o600),  # private: it carries the task's stderr
        ("1m8job00000002-1-0", 0o600),
    }
    (kept / "1m8job00000002-1-0").write_bytes((kept / "1m8job00000001-1-0").read_bytes())
    assert ledger.kept() == [Kept(good)]
    (kept / "1m8job00000001-1-0").write_bytes(b'{"job_id": "1m8')  # cut short
    assert ledger.kept() == []
    assert list(kept.iterdir()) == [] and not ledger.holds_results()
    ledger.close()
    assert not ledger.dir.exists()


def test_a_result_kept_by_the_previous_version_is_still_delivered(tmp_path: Path) -> None:
    """Results were kept bare before their log lines were kept with them: a
    worker upgraded meanwhile reads those too, rather than dropping them."""
    result = _result("1m8job00000001")
    dead = Ledger(tmp_path)
    dead.set_worker_id("1m8deadworker0")
    (dead.dir / "results" / "1m8job00000001-1-0").write_bytes(msgspec.json.encode(result))
    _die(dead)
    heir = Ledger(tmp_path)
    try:
        assert heir.recover(grace=0.2) == "1m8deadworker0"
        assert heir.kept() == [Kept(result)]
    finally:
        heir.close()


class _LinesHang(InProcessTransport):
    """The server is away (``away``) for results and log lines. The task's
    own thread is refused at once; a retry of its lines from another thread
    (the outbox's, or the log sender's) hangs until ``release``, as a request
    to a server that does not answer does until its timeout."""

    def __init__(self, embedded: Embedded) -> None:
        super().__init__(embedded.plane, embedded.artifacts)
        self.away = threading.Event()
        self.task_tried = threading.Event()
        self.hanging = threading.Event()
        self.release = threading.Event()

    def task_finished(self, result: TaskResult, *, take: bool = True) -> list[Instruction]:
        if self.away.is_set():
            raise ServerUnreachable("away")
        return super().task_finished(result, take=take)

    def append_logs(self, job_id: str, attempt: int, lines: list[LogLine], node: int = 0) -> None:
        if self.away.is_set():
            if threading.current_thread().name.startswith("gpulayer-task-"):
                self.task_tried.set()  # its last lines, tried as it ends
            elif self.task_tried.is_set():
                self.hanging.set()
                self.release.wait(60)
            raise ServerUnreachable("away")
        super().append_logs(job_id, attempt, lines, node)


def _hang_a_send_before_the_keep(worker: Worker, transport: _LinesHang) -> None:
    """A retry of the task's lines by the outbox hangs before the result is kept."""
    waiting = worker._logs.waiting

    def waiting_once_a_send_hangs(task: TaskLog) -> list[LogLine]:
        assert transport.hanging.wait(30)  # the order under test: the send started first
        return waiting(task)

    worker._logs.waiting = waiting_once_a_send_hangs  # type: ignore[method-assign]


def _hang_a_send_before_the_last_try(worker: Worker, transport: _LinesHang) -> None:
    """The task's own last try fails; the log sender's retry then hangs."""
    close_task = worker._logs.close_task

    def close_task_then_let_the_sender_retry(task: TaskLog) -> None:
        close_task(task)  # fails at once: its lines wait again
        assert transport.hanging.wait(30)  # the log sender's retry of them is under way

    worker._logs.close_task = close_task_then_let_the_sender_retry  # type: ignore[method-assign]


@pytest.mark.parametrize("hang", [_hang_a_send_before_the_keep, _hang_a_send_before_the_last_try])
def test_a_result_is_kept_at_once_while_a_send_of_its_last_lines_hangs(
    home: Path, hang: Callable[[Worker, _LinesHang], None]
) -> None:
    """Keeping a result must not wait for a send of the task's lines already
    under way, by the outbox or the log sender (it may hang until its
    timeout, minutes): until it is kept, a worker killed loses it. The lines
    in flight are kept with it; the outbox, not the task's thread, waits for
    that send before delivering them and the result, in that order."""
    embedded = Embedded(home)
    work = home / "ledger-workers"
    transport = _LinesHang(embedded)
    worker = Worker(transport, cache=embedded.artifacts, work_dir=work, slots=1, ledger=True)
    kept = _told_when_kept(worker)
    hang(worker, transport)
    try:
        worker.start()
        transport.away.set()
        job = transport.submit(parse_spec({"command": [PY, "-c", "print('last words')"]}))
        assert transport.hanging.wait(30)
        assert kept.wait(10), "the result is not on disk while a send of its lines hangs"
        (found,) = (work / "live").glob("*/results/*")
        assert found.name == f"{job.id}-1-0"
        lines = msgspec.json.decode(found.read_bytes(), type=Kept).lines
        assert [line.text for line in lines] == ["last words"]
    finally:
        transport.release.set()
        transport.away.clear()
        worker.stop(timeout=10)
        embedded.close()


def test_a_dead_workers_id_a_next_one_failed_to_register_with_is_adopted_by_the_one_after(
    tmp_path: Path,
) -> None:
    """ "Should this process die before it registers, the next one adopts the
    id in turn": so should it fail to register."""
    from gpulayer.artifacts import ArtifactStore
    from gpulayer.errors import ServerUnreachable
    from gpulayer.transport.http import HttpTransport

    work = tmp_path / "workers"
    dead = Ledger(work)
    dead.set_worker_id("1m8deadworker0")
    _die(dead)  # its process dies, with nothing kept
    heir = Worker(
        HttpTransport("http://127.0.0.1:9", token="t", retries=1),  # nothing listens
        cache=ArtifactStore(tmp_path / "cache"),
        work_dir=work,
        slots=1,
        ledger=True,
    )
    with pytest.raises(ServerUnreachable):
        heir.start()
    assert heir._ledger is not None
    _die(heir._ledger)  # as its process exits
    after = Ledger(work)
    try:
        assert after.recover(grace=0.1) == "1m8deadworker0"
    finally:
        after.close()


def test_a_warden_is_not_forked_once_a_thread_runs(home: Path) -> None:
    """A fork copies the calling thread alone: a lock another thread held
    would stay held in the warden. So a worker refuses, and keeps nothing."""
    embedded = Embedded(home)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    work = home / "workers"
    try:
        with pytest.raises(WorkerError, match="before the worker starts any thread"):
            _keeping_a_ledger(embedded, work, kill_grace=1.0, warden=True)
    finally:
        release.set()
        other.join()
        embedded.close()
    assert list((work / "live").iterdir()) == []


def test_a_warden_needs_a_ledger(home: Path) -> None:
    embedded = Embedded(home)
    try:
        with pytest.raises(WorkerError, match="ledger=True"):
            Worker(embedded.transport, cache=embedded.artifacts, work_dir=home / "w", warden=True)
    finally:
        embedded.close()


def test_a_wardens_goodbye_has_a_deadline_however_slow_the_server(tmp_path: Path) -> None:
    """The warden holds the dead worker's ledger lock, which the next worker
    on the home waits for: a goodbye to a server that answers byte by byte
    (or a name lookup that hangs) ends at the deadline, with the warden;
    also where the worker had SIGALRM blocked (the warden inherits that)."""
    import signal
    import subprocess
    import sys

    script = (
        "import signal, sys, threading\n"
        "from pathlib import Path\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "from gpulayer import defaults\n"
        "defaults.WARDEN_GOODBYE_TIMEOUT_S = 0.2\n"
        "from gpulayer.worker import warden\n"
        "ledger = Path(sys.argv[1])\n"
        "(ledger / 'results').mkdir(parents=True)\n"
        "(ledger / 'worker-id').write_text('1m8worker00001')\n"
        "warden._say_goodbye(ledger, lambda *_: threading.Event().wait())\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ledger")], timeout=60)
    assert done.returncode == -signal.SIGALRM


_TERMED = (
    "import signal, sys, time\n"
    "def noted(*_):\n"
    "    with open(sys.argv[1], 'w') as f:\n"
    "        f.write(repr(time.time()))\n"
    "signal.signal(signal.SIGTERM, noted)\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    time.sleep(60)\n"
)


def test_a_dead_workers_trees_get_their_sigterm_together(tmp_path: Path) -> None:
    """One after the other, the last tree would get its SIGTERM only after
    the others' graces (80 s for eight stubborn tasks at the default)."""
    from gpulayer.worker.ledger import end_listed
    from gpulayer.worker.process import spawn

    ledger = Ledger(tmp_path / "work")
    procs = []
    for i in range(3):
        at = time.time()
        proc = spawn(
            [PY, "-c", _TERMED, str(tmp_path / f"termed-{i}")], cwd=tmp_path, env=os.environ
        )
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        ledger.record(f"job{i}-1", [(proc.pid, at)])
        procs.append(proc)
    try:
        assert end_listed(ledger.dir, grace=1.0) == 3
        termed = [float((tmp_path / f"termed-{i}").read_text()) for i in range(3)]
        assert max(termed) - min(termed) < 0.5, termed  # a grace (1 s) apart, one by one
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                assert pipe is not None
                pipe.close()
        ledger.close()


def _die(ledger: Ledger) -> None:
    """As the death of the ledger's worker process (with no warden) would:
    its locks go."""
    os.close(ledger._fd)
    os.close(ledger._alive)


class _Holder:
    """A process holding some locks (as a live worker, or a warden, would)
    until :meth:`let_go`."""

    def __init__(self, *locks: Path) -> None:
        self.proc = subprocess.Popen(
            [PY, "-c", "import fcntl, os, sys\n"
             "for path in sys.argv[1:]:\n"
             "    fcntl.flock(os.open(path, os.O_RDWR), fcntl.LOCK_EX)\n"
             "print('held', flush=True)\n"
             "sys.stdin.read()\n", *map(str, locks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "held\n"

    def let_go(self) -> None:
        assert self.proc.stdin is not None
        if not self.proc.stdin.closed:
            self.proc.stdin.close()

    def close(self) -> None:
        self.let_go()
        self.proc.wait()
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _dead_ledger(work: Path, worker_id: str) -> Path:
    """A ledger as a worker that died left it: named after a pid no process has."""
    dead = Ledger(work)
    dead.set_worker_id(worker_id)
    _die(dead)
    gone = dead.dir.with_name(f"{2**22 + 1}-{dead.dir.name.split('-')[1]}")  # past pid_max
    dead.dir.rename(gone)
    return gone


def test_a_ledger_locked_by_a_live_process_is_passed_over_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A live worker, whose pid may not be seen from here (another pid
    namespace on a shared home), holds both its ledger's locks: the next
    worker does not wait for it, nor take it over."""
    work = tmp_path / "work"
    other = _dead_ledger(work, "1m8otherworker")
    holder = _Holder(other / "lock", other / "alive")
    heir = Ledger(work)
    try:
        with caplog.at_level(logging.INFO, logger="gpulayer.worker.ledger"):
            assert heir.recover(grace=0.5) is None
        assert not [r for r in caplog.records if "warden" in r.getMessage()]
        assert other.exists()
    finally:
        holder.close()
        heir.close()


def test_the_next_worker_waits_for_a_dead_workers_warden(tmp_path: Path) -> None:
    """Its warden holds a dead worker's ledger while it ends its tasks (the
    "alive" lock went with the worker): the next worker waits for it, for as
    long as it said it may take, then takes the ledger over."""
    work = tmp_path / "work"
    dead = _dead_ledger(work, "1m8deadworker0")
    (dead / "warden-time").write_text("60.0")
    holder = _Holder(dead / "lock")

    class LetGo(logging.Handler):  # the moment the heir waits: the warden is done
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for the warden" in record.getMessage():
                holder.let_go()

    heir = Ledger(work)
    handler = LetGo()
    logger = logging.getLogger("gpulayer.worker.ledger")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        assert heir.recover(grace=0.5) == "1m8deadworker0"
        assert not dead.exists()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        holder.close()
        heir.close()


def test_heirs_waiting_together_for_a_warden_stop_when_one_took_the_ledger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two workers start on the home while a dead worker's warden is at
    work: one takes the ledger over, and the other stops waiting then, not
    at the warden's deadline."""
    work = tmp_path / "work"
    dead = _dead_ledger(work, "1m8deadworker0")
    (dead / "warden-time").write_text("60.0")
    holder = _Holder(dead / "lock")
    waiting = threading.Semaphore(0)

    class Counted(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for the warden" in record.getMessage():
                waiting.release()

    heirs = [Ledger(work), Ledger(work)]
    adopted: list[str | None] = []
    handler = Counted()
    logger = logging.getLogger("gpulayer.worker.ledger")
    logger.addHandler(handler)
    threads = [
        threading.Thread(target=lambda h=h: adopted.append(h.recover(grace=0.5))) for h in heirs
    ]
    try:
        with caplog.at_level(logging.INFO, logger="gpulayer.worker.ledger"):
            for thread in threads:
                thread.start()
            for _ in heirs:
                assert waiting.acquire(timeout=30)
            holder.let_go()  # the warden is done
            for thread in threads:
                thread.join(30)
                assert not thread.is_alive(), "an heir waits on for a ledger already taken over"
        assert sorted(adopted, key=str) == ["1m8deadworker0", None]
        assert not [r for r in caplog.records if "did not finish" in r.getMessage()]
    finally:
        logger.removeHandler(handler)
        holder.close()
        for heir in heirs:
            heir.close()


def test_a_warden_that_cannot_be_forked_leaves_no_descriptor(tmp_path: Path) -> None:
    """A fork refused (EAGAIN: too many processes) raises, and leaves no
    pipe behind for a program that embeds a worker and tries again."""
    script = (
        "import errno, os, sys\n"
        "from pathlib import Path\n"
        "from gpulayer.worker.ledger import Ledger\n"
        "from gpulayer.worker.warden import Warden\n"
        "ledger = Ledger(Path(sys.argv[1]))\n"
        "before = len(os.listdir('/proc/self/fd'))\n"
        "def refused():\n"
        "    raise OSError(errno.EAGAIN, 'no more processes')\n"
        "os.fork = refused\n"
        "try:\n"
        "    Warden(ledger, grace=0.1)\n"
        "except OSError:\n"
        "    print(len(os.listdir('/proc/self/fd')) - before)\n"
    )
    done = subprocess.run(
        [PY, "-c", script, str(tmp_path / "work")], capture_output=True, text=True, timeout=60
    )
    assert done.stdout == "0\n", done.stderr
