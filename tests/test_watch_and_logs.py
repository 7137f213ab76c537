"""Output handling: line splitting, the log sender's batching and its memory bound."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gpulayer.errors import InvalidStateError, ServerUnreachable, TransportError
from gpulayer.jobs import LogLine, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.worker.logs import LogSender
from gpulayer.worker.process import spawn
from gpulayer.worker.watch import LineSplitter, watch_all

from helpers import PY


def split(chunks: list[bytes], limit: int = 10) -> list[str]:
    got: list[str] = []
    s = LineSplitter("stdout", lambda _, text: got.append(text), limit=limit)
    for chunk in chunks:
        s.feed(chunk)
    s.close()
    return got


def test_lines_across_chunks_and_without_final_newline() -> None:
    assert split([b"ab", b"c\nde", b"f\r\n", b"", b"tail"]) == ["abc", "def", "tail"]


def test_long_lines_are_cut_once_and_the_rest_skipped() -> None:
    got = split([b"0123456789abcdef", b"ghij\nnext\n", b"x" * 25 + b"\nlast"])
    assert got == [
        "0123456789 [gpulayer: line cut at 10 bytes]",
        "next",
        "xxxxxxxxxx [gpulayer: line cut at 10 bytes]",
        "last",
    ]


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    assert split([b"caf\xc3\xa9 \xff\n"], limit=100) == ["café \ufffd"]


def test_watch_reports_exit_and_all_output(tmp_path: Path) -> None:
    code = "import sys\nfor i in range(3): print(i); print('e', i, file=sys.stderr)\nsys.exit(4)"
    proc = spawn([PY, "-c", code], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    lines: list[tuple[str, str]] = []
    ((exit_code, exited_at),) = watch_all(
        [proc], lambda i, stream, text: lines.append((stream, text))
    )
    assert exit_code == 4 and exited_at > 0
    assert [t for s, t in lines if s == "stdout"] == ["0", "1", "2"]
    assert [t for s, t in lines if s == "stderr"] == ["e 0", "e 1", "e 2"]


def test_watch_ends_strays_that_hold_the_pipes(tmp_path: Path) -> None:
    # The main process exits at once; its child keeps stdout open for a minute.
    code = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    proc = spawn([PY, "-c", code], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    ((exit_code, _),) = watch_all([proc], lambda i, s, t: None)
    assert exit_code == 0  # returns promptly: the stray got SIGTERM when the leader exited


def test_watch_calls_the_deadline_once(tmp_path: Path) -> None:
    proc = spawn([PY, "-c", "import time; time.sleep(60)"], cwd=tmp_path, env={})
    calls: list[int] = []

    def on_deadline() -> None:
        calls.append(1)
        proc.terminate()

    import time

    ((code, _),) = watch_all(
        [proc], lambda i, s, t: None, deadline=time.monotonic() + 0.2, on_deadline=on_deadline
    )
    assert calls == [1] and code == -15


class BlockingSend:
    """A transport that blocks until released, like a stalled network."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.batches: list[list[LogLine]] = []

    def __call__(self, job_id: str, attempt: int, lines: list[LogLine]) -> None:
        self.entered.set()
        self.release.wait()
        self.batches.append(lines)


def test_sender_memory_is_bounded_and_drops_are_reported() -> None:
    send = BlockingSend()
    sender = LogSender(send, interval=0.0, max_lines=100, backpressure=0.1)
    task = sender.open("job", 1)
    task.add("stdout", "first")
    assert send.entered.wait(10)  # the sender is now stuck in the network
    for i in range(1000):
        task.add("stdout", f"line {i}")
    assert len(task.pending) == 100
    send.release.set()
    sender.close_task(task)
    sender.stop()
    texts = [line.text for batch in send.batches for line in batch]
    assert texts[0] == "first"
    assert texts[1:101] == [f"line {i}" for i in range(900, 1000)]
    assert texts[-1] == "[gpulayer] 900 lines dropped: output came faster than it could be shipped"
    seqs = [line.seq for batch in send.batches for line in batch]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_a_full_buffer_waits_for_a_slow_but_working_sender() -> None:
    delivered: list[int] = []
    gate = threading.Semaphore(0)

    def slow(job_id: str, attempt: int, lines: list[LogLine]) -> None:
        gate.acquire()
        delivered.extend(line.seq for line in lines)

    sender = LogSender(slow, interval=0.0, max_lines=10, backpressure=30)
    task = sender.open("job", 1)
    release = threading.Thread(target=lambda: [gate.release() for _ in range(1000)])
    release.start()
    for i in range(200):  # far more than the buffer holds: the adder is held back
        task.add("stdout", str(i))
    release.join()
    sender.close_task(task)
    sender.stop()
    assert delivered == list(range(1, 201)), "a working sender loses nothing"


def test_sender_batches_lines_into_few_sends() -> None:
    sent: list[int] = []
    sender = LogSender(lambda j, a, lines: sent.append(len(lines)), interval=0.25)
    task = sender.open("job", 1)
    for i in range(500):
        task.add("stdout", str(i))
    sender.close_task(task)
    sender.stop()
    assert sum(sent) == 500
    assert len(sent) <= 3, f"500 quick lines should go in a batch or two, went in {len(sent)}"


def test_failed_sends_are_retried_not_lost() -> None:
    attempts: list[int] = []
    delivered: list[str] = []

    def flaky(job_id: str, attempt: int, lines: list[LogLine]) -> None:
        attempts.append(len(lines))
        if len(attempts) == 1:
            raise ConnectionError("server away")
        delivered.extend(line.text for line in lines)

    sender = LogSender(flaky, interval=0.0)
    task = sender.open("job", 1)
    task.add("stdout", "a")
    task.add("stdout", "b")
    task.flush()  # fails: kept
    task.flush()  # succeeds
    sender.stop()
    assert delivered == ["a", "b"]


def _answered(status: int, message: str) -> TransportError:
    """As the HTTP transport raises it for ``status``."""
    error = TransportError(message)
    error.status = status
    return error


@pytest.mark.parametrize(
    "failure",
    [
        _answered(500, "the server failed (500): a bug"),
        _answered(429, "the server refused the request (429): too many requests"),
        _answered(408, "the server refused the request (408): request timeout"),
        ServerUnreachable("the server is unavailable (503): the disk is full"),
    ],
)
def test_lines_a_failure_of_the_server_or_a_proxy_held_back_go_again(failure: Exception) -> None:
    sent: list[list[str]] = []

    def fails_once(job_id: str, attempt: int, lines: list[LogLine]) -> None:
        sent.append([line.text for line in lines])
        if len(sent) == 1:
            raise failure

    sender = LogSender(fails_once, interval=60.0)  # only the sends below
    task = sender.open("job", 1)
    task.add("stdout", "a")
    task.flush()
    task.add("stdout", "b")
    task.flush()
    sender.stop()
    assert sent == [["a"], ["a", "b"]]


@pytest.mark.parametrize(
    "refusal",
    [
        InvalidStateError("no worker ran attempt 1 of job job"),
        _answered(413, "the server refused the request (413): request entity too large"),
    ],
)
def test_lines_the_server_refuses_are_dropped_not_sent_again(refusal: Exception) -> None:
    """It (or a proxy) answered no: sending them again would only be refused
    again. The end of a task's lines too."""
    tries: list[str] = []

    def refuse(job_id: str, attempt: int, lines: list[LogLine]) -> None:
        tries.extend(line.text for line in lines)
        raise refusal

    sender = LogSender(refuse, interval=60.0)  # only the sends below
    task, ended = sender.open("job", 1), sender.open("other", 1)
    task.add("stdout", "a")
    task.flush()
    ended.add("stdout", "b")
    ended.closed = True
    with pytest.raises(type(refusal)):
        sender.deliver_rest(ended)  # for the outbox, which gives up on them
    assert not sender.unsent(task) and not sender.unsent(ended)
    sender.stop()  # would send what is left
    assert tries == ["a", "b"]


def test_spawned_processes_get_a_session_of_their_own(tmp_path: Path) -> None:
    import os

    proc = spawn([PY, "-c", "import os; print(os.getsid(0), os.getpgid(0))"], cwd=tmp_path, env={})
    out, _ = proc.communicate()
    sid, pgid = map(int, out.split())
    assert sid == pgid == proc.pid != os.getsid(0)
    assert proc.returncode == 0
    assert isinstance(proc, subprocess.Popen)


@pytest.mark.parametrize(
    "line",
    [
        lambda i: f"{i}",  # many short lines: their fields outweigh their text
        lambda i: "\x1b" * 500,  # control characters: 6 bytes each in JSON
        lambda i: f'{i:04d} "quoted" \\ ' + "é" * 300,  # escapes and 2-byte characters
    ],
)
def test_a_tasks_output_goes_in_requests_a_proxy_takes_by_default(
    monkeypatch: pytest.MonkeyPatch, line: Callable[[int], str]
) -> None:
    """nginx refuses bodies over 1 MiB unless told otherwise, and may do so
    by closing the connection: the worker would only ever send them again."""
    from gpulayer.transport.http import HttpTransport, _encode

    bodies: list[int] = []
    monkeypatch.setattr(
        HttpTransport, "_post", lambda self, path, payload: bodies.append(len(_encode(payload)))
    )
    transport = HttpTransport("http://127.0.0.1:9")
    sender = LogSender(transport.append_logs, interval=60.0)  # only the send below
    task = sender.open("job", 1)
    for i in range(40_000):
        task.add("stdout", line(i))
    sender.close_task(task)
    sender.stop()
    assert len(bodies) > 1 and max(bodies) < 2**20, bodies


def test_a_large_batch_goes_in_requests_the_server_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpulayer import defaults

    monkeypatch.setattr(defaults, "LOG_BATCH_MAX_BYTES", 5 * (80 + 22))  # 5 lines' JSON
    batches: list[list[LogLine]] = []
    gate = threading.Event()

    def send(job_id: str, attempt: int, lines: list[LogLine]) -> None:
        gate.wait(30)  # the first lines pile up meanwhile
        batches.append(lines)

    sender = LogSender(send, interval=0.0)
    task = sender.open("job", 1)
    for i in range(40):
        task.add("stdout", f"line {i:02d} " + "x" * 12)  # 20 bytes of text each
    gate.set()
    sender.close_task(task)
    sender.stop()
    assert [line.text[:7] for batch in batches for line in batch] == [
        f"line {i:02d}" for i in range(40)
    ]
    assert max(len(batch) for batch in batches) == 5


def test_lines_sent_again_from_a_later_line_are_stored_once(plane: ControlPlane) -> None:
    """A worker's requests of one batch fail part-way; what it sends again may
    start at a later line (its buffer dropped the oldest meanwhile)."""
    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    job = plane.submit(parse_spec({"command": ["x"]})).id
    plane.take_instructions(wid)
    lines = [LogLine(i, 1.0, "stdout", f"l{i}") for i in range(1, 7)]
    plane.append_logs(job, 1, lines[:2])  # the first request went through
    plane.append_logs(job, 1, lines[1:])  # all again, from line 2
    plane.append_logs(job, 1, lines[4:])  # and again (a reply lost)
    stored = [line.seq for _, line in plane.store.read_logs(job)]
    assert stored == [1, 2, 3, 4, 5, 6]


def test_lines_sent_again_after_a_restart_are_stored_once(tmp_path: Path) -> None:
    from gpulayer.store.sqlite import SqliteStore

    store = SqliteStore(tmp_path / "db.sqlite")
    first = ControlPlane(store, instance_id="first")
    wid = first.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    job = first.submit(parse_spec({"command": ["x"]})).id
    first.take_instructions(wid)
    lines = [LogLine(i, 1.0, "stdout", f"l{i}") for i in range(1, 5)]
    first.append_logs(job, 1, lines[:3])
    second = ControlPlane(store, instance_id="second")
    second.recover("first", workers_outlive=True)
    second.append_logs(job, 1, lines[1:])
    assert [line.seq for _, line in store.read_logs(job)] == [1, 2, 3, 4]
    store.close()


class _Room(threading.Condition):
    """The sender's room for held-back readers; says when one starts waiting."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__(lock)
        self.held = threading.Event()

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        self.held.set()  # the lock is still held: no send can take lines before the wait
        return super().wait_for(predicate, timeout)


def test_a_line_held_back_by_a_full_buffer_is_numbered_after_the_drop_note(
    plane: ControlPlane,
) -> None:
    """Numbered before it waited for room, a line came before the note of
    drops taken meanwhile, and the server, which stores lines by number,
    threw it away."""
    wid = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id
    job = plane.submit(parse_spec({"command": ["x"]})).id
    plane.take_instructions(wid)
    fail_first, entered, release = [True], threading.Event(), threading.Event()

    def send(job_id: str, attempt: int, lines: list[LogLine]) -> None:
        if fail_first[0]:
            fail_first[0] = False
            raise ServerUnreachable("away")
        if lines[0].text == "a":
            entered.set()
            assert release.wait(30)
        plane.append_logs(job_id, attempt, lines)

    sender = LogSender(send, interval=0.0, max_lines=4, backpressure=30)
    sender.stop()  # no sender thread: the test makes each send itself
    sender.room = room = _Room(sender.cond._lock)  # type: ignore[attr-defined]
    task = sender.open(job, 1)
    task.add("stdout", "a")
    sender.send_task(task)  # fails: the sender is unhealthy
    retry = threading.Thread(target=sender.send_task, args=(task,))
    retry.start()
    assert entered.wait(30)  # "a" in flight
    for text in "bcdef":
        task.add("stdout", text)  # "b" dropped
    release.set()
    retry.join(30)  # healthy again, the drop not reported yet
    assert sender.healthy and task.dropped == 1
    reader = threading.Thread(target=task.add, args=("stdout", "g"))
    reader.start()
    assert room.held.wait(30)  # "g" waits for room
    sender.send_task(task)  # c d e f and the note
    reader.join(30)
    sender.send_task(task)  # g
    stored = [line.text for _, line in plane.store.read_logs(job)]
    assert stored[-1] == "g", stored


def test_a_failed_send_of_a_full_buffer_and_its_note_loses_no_line_uncounted() -> None:
    sent: list[LogLine] = []
    fail = [True]

    def send(job_id: str, attempt: int, lines: list[LogLine]) -> None:
        if fail[0]:
            raise ServerUnreachable("away")
        sent.extend(lines)

    sender = LogSender(send, interval=0.0, max_lines=4, backpressure=30)
    sender.stop()
    task = sender.open("job", 1)
    task.add("stdout", "first")
    sender.send_task(task)  # fails: the sender is unhealthy
    for i in range(6):
        task.add("stdout", str(i))  # "first", 0 and 1 dropped
    sender.send_task(task)  # four lines and the note: fails again
    fail[0] = False
    sender.send_task(task)
    texts = [line.text for line in sent]
    notes = [t for t in texts if t.startswith("[gpulayer]")]
    assert sum(int(t.split()[1]) for t in notes) + len(texts) - len(notes) == 7, texts
