"""Shipping a task's output to the control plane without ever blocking it.

Reader threads hand each line to a :class:`TaskLog`; one :class:`LogSender`
thread per worker collects lines for :data:`~gpulayer.defaults.LOG_BATCH_INTERVAL_S`
after the first arrives (sooner when a buffer is half full), then sends every
task's batch in one call each. A task's last lines are flushed synchronously
when it ends, so a client that wakes on the job's end sees all of its
output. Each task buffers at most ``max_lines`` unsent lines. When a buffer
is full and the control plane answers, the reader waits briefly for room
(the job blocks on its pipe: nothing is lost); when it does not answer, the
oldest lines are dropped and a system line says how many, so a job never
waits on a network that is down and cannot exhaust memory. Lines the
control plane refuses (it answered, and said no) are dropped, with a
warning, rather than sent again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec

from .. import defaults
from ..errors import (
    AccessDenied,
    InvalidStateError,
    JobNotFoundError,
    ServerUnreachable,
    SpecError,
    TransportError,
)
from ..jobs import LogLine

log = logging.getLogger(__name__)
_json = msgspec.json.encode

# (job id, attempt, lines[, node]): the node only for a job of several nodes.
Send = Callable[..., None]


class TaskLog:
    def __init__(self, sender: LogSender, job_id: str, attempt: int, node: int = 0) -> None:
        self.sender = sender
        self.job_id = job_id
        self.attempt = attempt
        self.node = node
        self.pending: deque[LogLine] = deque()
        self.seq = 0
        self.dropped = 0
        self.closed = False
        self._send_lock = threading.Lock()  # one batch of this task in flight at a time
        self.sending: list[LogLine] = []  # that batch (under the sender's lock)

    def add(self, stream: str, text: str, rank: int | None = None) -> None:
        sender = self.sender
        with sender.cond:
            if len(self.pending) >= sender.max_lines and sender.healthy:
                # The control plane is reachable but behind: hold the job's
                # output (it blocks on its pipe) rather than lose lines, for a
                # bounded time. A sender that cannot deliver gets no wait.
                sender.urgent = True
                sender.cond.notify_all()
                if not sender.room.wait_for(
                    lambda: len(self.pending) < sender.max_lines or not sender.healthy,
                    timeout=sender.backpressure,
                ):
                    sender.healthy = False  # stalled: drop until a delivery succeeds
            if len(self.pending) >= sender.max_lines:
                self.pending.popleft()
                self.dropped += 1
            # Numbered once it is in the buffer: a note taken while this line
            # waited for room must not carry a number after it.
            self.seq += 1
            self.pending.append(LogLine(self.seq, time.time(), stream, text, rank))  # type: ignore[arg-type]
            if not sender.dirty:
                sender.dirty = True
                sender.cond.notify()
            elif len(self.pending) == sender.max_lines // 2 and not sender.urgent:
                # Half full before the interval is up: send now rather than drop.
                sender.urgent = True
                sender.cond.notify()

    def flush(self) -> None:
        """Send everything buffered now (called as the task ends)."""
        self.sender.send_task(self)

    def take(self) -> list[LogLine]:
        """Pending lines (caller holds the sender's lock)."""
        lines = list(self.pending)
        self.pending.clear()
        if self.dropped:
            self.seq += 1
            note = f"[gpulayer] {self.dropped} lines dropped: output came faster than it could be shipped"
            lines.append(LogLine(self.seq, time.time(), "system", note))
            self.dropped = 0
        return lines


class LogSender:
    def __init__(
        self,
        send: Send,
        *,
        interval: float = defaults.LOG_BATCH_INTERVAL_S,
        max_lines: int = defaults.LOG_BUFFER_MAX_LINES,
        backpressure: float = defaults.LOG_BACKPRESSURE_MAX_S,
    ) -> None:
        self._send = send
        self.interval = interval
        self.max_lines = max_lines
        self.backpressure = backpressure
        lock = threading.RLock()
        self.cond = threading.Condition(lock)  # the sender thread waits on it for lines
        # Readers held back by a full buffer wait on this one (same lock), so
        # the room every task's last send makes wakes nobody else.
        self.room = threading.Condition(lock)
        self.dirty = False
        self.urgent = False  # a buffer is filling: do not wait out the interval
        self.healthy = True  # the last delivery succeeded
        self._tasks: set[TaskLog] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="gpulayer-log-sender", daemon=True)
        self._thread.start()

    def open(self, job_id: str, attempt: int, node: int = 0) -> TaskLog:
        task = TaskLog(self, job_id, attempt, node)
        with self.cond:
            self._tasks.add(task)
        return task

    def close_task(self, task: TaskLog) -> None:
        """The task ended: send what is left. Lines that cannot go now stay
        queued (the task stays known) until a later batch delivers them."""
        self.send_task(task)
        with self.cond:
            task.closed = True
            if not task.pending:
                self._tasks.discard(task)

    def unsent(self, task: TaskLog) -> bool:
        """Whether some of a task's lines are not delivered yet (waiting, or
        in a send under way that may still fail)."""
        with self.cond:
            return bool(task.pending or task.sending)

    def waiting(self, task: TaskLog) -> list[LogLine]:
        """A closed task's lines not delivered yet, those in a send under way
        included (it may still fail), to keep on disk with its result."""
        with self.cond:  # not the send lock: a send may hang for minutes
            return [*task.sending, *task.pending]

    def deliver_rest(self, task: TaskLog, *, wait: bool = True) -> None:
        """Send a closed task's remaining lines or raise (for the worker's outbox,
        which retries it in order, before the task's result). Unless ``wait``,
        a send of them already under way (it may hang) raises ServerUnreachable
        rather than being waited for."""
        if not task._send_lock.acquire(blocking=wait):
            raise ServerUnreachable("a send of the task's lines is under way")
        try:
            with self.cond:
                lines = task.sending = task.take()
            if lines:
                try:
                    self._deliver_now(task, lines)
                except Exception as exc:
                    with self.cond:
                        task.sending = []
                        if not _refused(exc):
                            self._restore(task, lines)
                    raise
                with self.cond:
                    task.sending = []
        finally:
            task._send_lock.release()
        with self.cond:
            if not task.pending:
                self._tasks.discard(task)

    def send_task(self, task: TaskLog) -> None:
        with task._send_lock:
            with self.cond:
                lines = task.sending = task.take()
                self.room.notify_all()  # room again for a reader held back
            if lines:
                self._deliver(task, lines)

    def _deliver_now(self, task: TaskLog, lines: list[LogLine]) -> None:
        # In requests a proxy before the server takes too (see
        # LOG_BATCH_MAX_BYTES), in order. If one fails, all go again: the
        # server stores each line once, by its number.
        for batch in in_batches(lines, defaults.LOG_BATCH_MAX_BYTES):
            if task.node:
                self._send(task.job_id, task.attempt, batch, task.node)
            else:
                self._send(task.job_id, task.attempt, batch)

    def _deliver(self, task: TaskLog, lines: list[LogLine]) -> None:
        try:
            self._deliver_now(task, lines)
            self.healthy = True
            with self.cond:
                task.sending = []
        except Exception as exc:
            if _refused(exc):
                # Sent again, they would be refused again: the server answered.
                log.warning(
                    "the server refused %d log lines of job %s; dropping them: %s",
                    len(lines),
                    task.job_id,
                    exc,
                )
                with self.cond:
                    task.sending = []
                    self.healthy = True
                return
            # Keep the lines (within the bound) for the next batch; say so
            # once per outage, not at every retry.
            if self.healthy:
                log.warning(
                    "could not send %d log lines of job %s (%s); keeping them to send later",
                    len(lines),
                    task.job_id,
                    exc,
                    exc_info=not isinstance(exc, ServerUnreachable),
                )
            with self.cond:
                self.healthy = False
                task.sending = []
                self._restore(task, lines)
                self.dirty = True
                self.cond.notify_all()
                self.room.notify_all()  # readers wait no more for a sender that cannot send

    def _restore(self, task: TaskLog, lines: list[LogLine]) -> None:
        """Lines a send failed to deliver wait again (caller holds the lock),
        within the bound: those cut are counted in the next note."""
        task.dropped += max(0, len(lines) - self.max_lines)
        task.pending.extendleft(reversed(lines[-self.max_lines :]))

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.dirty and not self._stopped:
                    self.cond.wait()
                if self._stopped:
                    return
            # Let a batch build up: one send per interval, not one per line.
            with self.cond:
                self.cond.wait_for(lambda: self._stopped or self.urgent, timeout=self.interval)
                self.dirty = self.urgent = False
                tasks = list(self._tasks)
            for task in tasks:
                self.send_task(task)
                with self.cond:
                    if task.closed and not task.pending:
                        self._tasks.discard(task)

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            tasks = list(self._tasks)
            self.cond.notify_all()
        self._thread.join()
        for task in tasks:
            self.send_task(task)


def _refused(exc: BaseException) -> bool:
    """The server (or a proxy before it) answered, and said no to these
    lines for good: a 4xx, but for "too slow" (408) and "too many" (429).
    After those, and a server's own failure (5xx), they go again with the
    next batch."""
    if isinstance(exc, (AccessDenied, InvalidStateError, JobNotFoundError, SpecError)):
        return True
    status = exc.status if isinstance(exc, TransportError) else None
    return status is not None and 400 <= status < 500 and status not in (408, 429)


# A line's JSON beside its text: seq, time, stream, rank and punctuation.
_LINE_JSON = 80


def in_batches(lines: list[LogLine], limit: int) -> list[list[LogLine]]:
    """``lines`` in consecutive batches whose JSON takes at most ``limit``
    bytes: each line's text as JSON escapes and encodes it (a control
    character takes 6 bytes), and its other fields. A line is cut at
    LOG_LINE_MAX_BYTES, far below: each batch has one."""
    batches: list[list[LogLine]] = []
    batch: list[LogLine] = []
    size = 0
    for line in lines:
        cost = len(_json(line.text)) + _LINE_JSON
        if batch and size + cost > limit:
            batches.append(batch)
            batch, size = [], 0
        batch.append(line)
        size += cost
    if batch:
        batches.append(batch)
    return batches
