"""The control plane: jobs in, placements out, results back, waiters woken.

One :class:`ControlPlane` serves clients (submit, wait, cancel, logs) and
workers (register, acquire, started, logs, finished) through a transport. Its
in-memory view (the queue, the live workers and their free slots, the running
jobs) drives placement; the store is the durable record, written in one
transaction per step. Every wait here is a condition or an event that the step
which ends it signals: nothing on the dispatch path sleeps or polls.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from . import defaults, jobs
from .artifacts import ArtifactStore
from .errors import GPUlayerError, InvalidStateError, JobNotFoundError
from .ids import check_id, new_id
from .jobs import (
    CancelTask,
    Instruction,
    JobInfo,
    LogChunk,
    LogLine,
    Rendezvous,
    RunTask,
    TaskInfo,
    TaskResult,
    TaskStarted,
    WorkerInfo,
)
from .scheduler import Assignment, Capacity, Request, explain, place
from .signals import Signal, Unsubscribe, wait_on
from .spec import JobSpec, parse_spec
from .store import Store, Transaction

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: Request
    spec: JobSpec
    attempt: int  # attempts made so far
    submitted: float


@dataclass
class _Task:
    """One node's share of a running job (a job of one node has one)."""

    node: int
    worker_id: str
    slots: tuple[int, ...]
    gpus: tuple[int, ...]
    delivered: bool = False  # its worker took the instruction
    started: bool = False  # its worker reported the process started
    ended: bool = False  # its worker reported its end (or was lost)


@dataclass
class _Running:
    attempt: int
    spec: JobSpec
    seq: int
    tasks: list[_Task]
    marks: dict[str, float]  # submitted, placed; for gangs the latest start marks
    cancel_requested: bool = False
    # Jobs of several nodes end when every node has: meanwhile, the results
    # so far (the earliest failure decides), the port node 0 reserved, and
    # the numbering of log lines that arrive from several workers.
    results: list[TaskResult] = field(default_factory=list)
    master_port: int | None = None
    log_seq: int = 0
    log_seen: dict[int, int] = field(default_factory=dict)  # node -> its last line

    @property
    def worker_id(self) -> str:
        return self.tasks[0].worker_id

    @property
    def started(self) -> bool:
        """Whether it may have run: a worker took it (a short task's start is
        reported only with its end) or said it started."""
        return any(t.started or t.delivered for t in self.tasks)

    def task_on(self, worker_id: str) -> _Task | None:
        for task in self.tasks:
            if task.worker_id == worker_id:
                return task
        return None


class _Done:
    """What waiters on a job block on: fired when it is final, with its record."""

    def __init__(self) -> None:
        self.signal = Signal()
        self.job: JobInfo | None = None


@dataclass
class _LiveWorker:
    info: WorkerInfo
    free: set[int]
    inbox: deque[Instruction]
    wake: Signal = field(default_factory=Signal)
    running: set[str] = field(default_factory=set)
    closed: bool = False
    # A worker known from before a restart is not connected until it
    # registers again; it gets the heartbeat timeout to do so.
    connected: bool = True
    last_seen: float = 0.0

    _capacity: Capacity | None = None  # cached until its free slots change

    def capacity(self) -> Capacity:
        if self._capacity is None or self._capacity.free != self.free:
            self._capacity = Capacity(
                self.info.id, tuple(self.info.slot_gpus), frozenset(self.free)
            )
        return self._capacity


@dataclass(frozen=True)
class Snapshot:
    queued: int
    workers: int
    connected_workers: int
    free_slots: int


class ControlPlane:
    def __init__(
        self,
        store: Store,
        *,
        instance_id: str,
        clock: Callable[[], float] = time.time,
        kill_orphan: Callable[[int, float | None], None] | None = None,
    ) -> None:
        self.store = store
        self.instance_id = instance_id
        self._clock = clock
        self._kill_orphan = kill_orphan
        self._lock = threading.Lock()
        self._logs: dict[str, Signal] = {}  # job id -> followers of its logs
        self._queue: dict[str, _Pending] = {}
        # The queue's keys in rank order, so placement reads only its head.
        self._order: list[tuple[int, int, str]] = []
        self._running: dict[str, _Running] = {}
        self._workers: dict[str, _LiveWorker] = {}
        self._done: dict[str, _Done] = {}
        self._seq = max((j.seq for j in store.list_jobs(limit=1)), default=0)

    # ---- clients -------------------------------------------------------

    def submit(self, spec: JobSpec, job_id: str | None = None) -> JobInfo:
        """Store and place a job. ``job_id`` (made by the client) makes a retried
        submit idempotent: the same id and spec return the job already stored."""
        spec = parse_spec(spec)
        if job_id is not None:
            check_id("id", job_id)
            existing = self.store.get_job(job_id)
            if existing is not None:
                if existing.spec != spec:
                    raise InvalidStateError(f"job {job_id} already exists with a different spec")
                return existing
        now = self._clock()
        with self._lock:
            seq = self._seq + 1
            job = JobInfo(
                id=job_id or new_id(),
                spec=spec,
                seq=seq,
                owner=self.instance_id,
                marks={"submitted": now},
            )
            request = Request(job.id, spec.priority, seq, spec.gpus, spec.nodes)
            self._enqueue(_Pending(request, spec, 0, now))
            try:
                assignments = self._plan()
                mine = [a for a in assignments if a.job_id == job.id]
                if mine:  # placed at once: stored placed, in one statement
                    first = mine[0]
                    job.state, job.worker, job.attempt = jobs.RUNNING, first.worker_id, 1
                    job.slots, job.gpus = list(first.slots), list(first.gpus)
                    job.marks["placed"] = now
                    if spec.distributed:
                        job.tasks = _task_infos(mine)
                with self.store.transaction() as tx:
                    tx.insert_job(job)
                    others = [a for a in assignments if a.job_id != job.id]
                    self._record(tx, others, now)
                    assignments = [a for a in assignments if a.job_id == job.id] + others
            except BaseException:
                self._dequeue(job.id)
                raise
            self._seq = seq
            self._dispatch(assignments, now)
        return job

    def resolve(self, job_id: str) -> str:
        """A full id from an id or a unique prefix of one."""
        with self._lock:
            if job_id in self._queue or job_id in self._running:
                return job_id
        found = self.store.find_job(job_id)
        if job_id in found:
            return job_id
        if len(found) == 1:
            return found[0]
        if not found:
            raise JobNotFoundError(f"no job with id {job_id!r}")
        raise JobNotFoundError(f"{job_id!r} matches several jobs; give more of the id")

    def get(self, job_id: str) -> JobInfo:
        job = self.store.get_job(job_id) or self.store.get_job(self.resolve(job_id))
        assert job is not None
        if job.state == jobs.QUEUED and job.reason is None:
            job.reason = self._why_waiting(job)
        return job

    def _why_waiting(self, job: JobInfo) -> str:
        with self._lock:
            pending = self._queue.get(job.id)
            if pending is not None:
                return explain(pending.request, [w.capacity() for w in self._open_workers()])
        # Queued by another process on this home: judge by the workers on record.
        spec = job.spec
        caps = [
            Capacity(w.id, tuple(w.slot_gpus), frozenset(range(len(w.slot_gpus))))
            for w in self.store.list_workers()
        ]
        return explain(Request(job.id, spec.priority, job.seq, spec.gpus, spec.nodes), caps)

    def list_jobs(self, *, states: Iterable[str] = (), limit: int | None = None) -> list[JobInfo]:
        return self.store.list_jobs(states=states, limit=limit)

    def wait(self, job_id: str, timeout: float | None = None) -> JobInfo:
        """Block until the job is final (or ``timeout``), then return it."""
        job_id = self.resolve(job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            final, done = self.watch_job(job_id)
            if final is not None:
                return final
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return self.get(job_id)
            with self._lock:
                if done is None:  # run by another process on this home: it cannot signal us
                    signal = self._logs.setdefault(job_id, Signal())
                    wait_on(self._lock, signal, min(defaults.FOLLOW_RECHECK_S, left or 1e9))
                elif done.job is None:
                    wait_on(self._lock, done.signal, left)
                if done is not None and done.job is not None:
                    return done.job

    def watch_job(self, job_id: str) -> tuple[JobInfo | None, _Done | None]:
        """The job if it is final; else what fires when it becomes final.

        ``(None, None)`` means another process on this home runs it: nothing
        here will fire, and the caller must look again later.
        """
        with self._lock:
            if job_id in self._queue or job_id in self._running:
                return None, self._done.setdefault(job_id, _Done())
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFoundError(f"no job with id {job_id!r}")
        return (job, None) if job.done else (None, None)

    def cancel(self, job_id: str) -> JobInfo:
        job_id = self.resolve(job_id)
        now = self._clock()
        with self._lock:
            if job_id in self._queue:
                self._dequeue(job_id)
                with self.store.transaction() as tx:
                    tx.request_cancel(job_id)
                    tx.finish(
                        job_id,
                        state=jobs.CANCELLED,
                        exit_code=None,
                        reason="cancelled while queued",
                        marks={"finished": now},
                        outputs={},
                    )
                    # It may have held a worker for itself: others may fit now.
                    assignments = self._plan()
                    self._record(tx, assignments, now)
                self._dispatch(assignments, now)
                self._signal_done(job_id)
            elif job_id in self._running:
                run = self._running[job_id]
                run.cancel_requested = True
                with self.store.transaction() as tx:
                    tx.request_cancel(job_id)
                self._cancel_tasks(job_id, run)
            else:
                job = self.store.get_job(job_id)
                assert job is not None
                if job.done:
                    raise InvalidStateError(
                        f"job {job_id} is already {job.state}; there is nothing to cancel"
                    )
                # Owned by another live process on this home. Queued there: end
                # it in the store (its owner's placement checks the state).
                # Running there: flag it and end the process tree ourselves;
                # its owner records the outcome.
                with self.store.transaction() as tx:
                    queued = tx.cancel_queued(job_id, now)
                    if not queued:
                        tx.request_cancel(job_id)
                # Committed first: the owner reads the flag when the job ends.
                if not queued and self._kill_orphan is not None:
                    for pid, created in job.processes():
                        self._kill_orphan(pid, created)
        return self.get(job_id)

    def read_logs(
        self, job_id: str, after: tuple[int, int] = (0, 0), timeout: float = 0.0
    ) -> LogChunk:
        """Lines after ``after``; with ``timeout``, wait that long for some."""
        deadline = time.monotonic() + timeout
        while True:
            # Subscribe before looking, so a line appended in between still wakes us.
            grown = threading.Event()
            unsubscribe = self.watch_logs(job_id, grown.set)
            try:
                chunk = self.logs_after(job_id, after)
                left = deadline - time.monotonic()
                if chunk.lines or chunk.done or left <= 0:
                    return chunk
                with self._lock:
                    ours = job_id in self._queue or job_id in self._running
                grown.wait(left if ours else min(left, defaults.FOLLOW_RECHECK_S))
            finally:
                self.unsubscribe(unsubscribe)

    def logs_after(self, job_id: str, after: tuple[int, int]) -> LogChunk:
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFoundError(f"no job with id {job_id!r}")
        rows = self.store.read_logs(job_id, after)
        cursor = (rows[-1][0], rows[-1][1].seq) if rows else after
        return LogChunk(
            lines=[line for _, line in rows],
            attempt=cursor[0],
            cursor=cursor,
            # The job was final before the read, so the read saw every line.
            done=job.done and len(rows) < 10_000,
        )

    def subscribe_done(self, done: _Done, callback: Callable[[], None]) -> Unsubscribe | None:
        """Call ``callback`` once when the job behind ``done`` ends (None: it has)."""
        with self._lock:
            return None if done.job is not None else done.signal.subscribe(callback)

    def unsubscribe(self, unsubscribe: Unsubscribe) -> None:
        """Drop a subscription (under the lock that guards every signal)."""
        with self._lock:
            unsubscribe()

    def may_fetch(self, worker_id: str, digest: str, artifacts: ArtifactStore) -> bool:
        """Whether ``digest`` belongs to a task placed on ``worker_id``: its
        bundle, an input, or a file inside either."""
        from . import bundle

        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                return False
            specs = [self._running[j].spec for j in worker.running if j in self._running]
        roots = []
        for spec in specs:
            if spec.bundle is not None:
                roots.append(spec.bundle)
            roots += [ref.digest for ref in spec.inputs.values()]
            if digest in roots:
                return True
        for root in roots:
            try:
                manifest = bundle.load(artifacts, root)
            except GPUlayerError:
                continue  # a file input, not a manifest
            if any(e.digest == digest for e in manifest.entries):
                return True
        return False

    def watch_logs(self, job_id: str, callback: Callable[[], None]) -> Unsubscribe:
        """Call ``callback`` once when the job's logs grow or it ends."""
        with self._lock:
            return self._logs.setdefault(job_id, Signal()).subscribe(callback)

    def list_workers(self) -> list[WorkerInfo]:
        with self._lock:
            live = {w.info.id: w for w in self._workers.values()}
        found = self.store.list_workers()
        for info in found:
            worker = live.get(info.id)
            if worker is not None:  # what only memory holds: its tasks, its last word
                info.running = sorted(worker.running)
                info.last_seen = worker.last_seen
        return found

    def snapshot(self) -> Snapshot:
        with self._lock:
            connected = [w for w in self._workers.values() if w.connected and not w.closed]
            return Snapshot(
                queued=len(self._queue),
                workers=len(self._workers),
                connected_workers=len(connected),
                free_slots=sum(len(w.free) for w in connected),
            )

    # ---- workers -------------------------------------------------------

    def register_worker(
        self, info: WorkerInfo, running: Iterable[tuple[str, int]] = ()
    ) -> WorkerInfo:
        """Add a worker, or re-attach one that was here before (same id).

        A returning worker names the tasks it still runs (job id, attempt):
        those stay running; the ones it no longer has end as lost (or are
        retried); ones this control plane has already given up on are
        cancelled on the worker.
        """
        now = self._clock()
        info.id = info.id or new_id()
        info.instance = self.instance_id
        info.started = info.last_seen = now
        reported = set(running)
        with self._lock:
            worker = self._workers.get(info.id)
            lost: dict[str, _Running] = {}
            gang_lost: list[str] = []  # tasks of jobs of several nodes it no longer has
            if worker is None:
                worker = _LiveWorker(info=info, free=set(range(len(info.slot_gpus))), inbox=deque())
                self._workers[info.id] = worker
            else:
                worker.info, worker.connected, worker.closed = info, True, False
                for job_id in list(worker.running):
                    run = self._running[job_id]
                    if (job_id, run.attempt) in reported:
                        continue
                    if len(run.tasks) == 1:
                        lost[job_id] = self._release(job_id)
                    else:
                        gang_lost.append(job_id)
                # Its slots are what it says now (it may have fewer), less
                # those its re-attached tasks hold.
                held = {
                    s
                    for job_id in worker.running
                    for task in self._running[job_id].tasks
                    if task.worker_id == info.id
                    for s in task.slots
                }
                worker.free = set(range(len(info.slot_gpus))) - held
                worker._capacity = None
            worker.last_seen = now
            for job_id, attempt in reported:
                held_run = self._running.get(job_id)
                if (
                    held_run is None
                    or held_run.attempt != attempt
                    or held_run.task_on(info.id) is None
                ):
                    worker.inbox.append(CancelTask(job_id=job_id, attempt=attempt))
            with self.store.transaction() as tx:
                for job_id, run in lost.items():
                    if run.started:
                        self._end_lost(tx, run, job_id, "its worker came back without it", now)
                    else:  # placed, but it never reached the worker: not an attempt
                        run.attempt -= 1
                        self._requeue(job_id, run)
                        tx.requeue(job_id, reason=None, owner=self.instance_id)
                tx.upsert_worker(info)
                assignments = self._plan()
                self._record(tx, assignments, now)
            self._dispatch(assignments, now)
            for job_id in gang_lost:
                self._node_lost(job_id, info.id, "its worker came back without it", now)
            if worker.inbox:
                worker.wake.fire()
        return info

    def heartbeat(self, worker_id: str) -> None:
        """A worker is alive (any request from it counts as one too)."""
        with self._lock:
            self._live(worker_id).last_seen = self._clock()

    def reap(self, timeout: float) -> list[str]:
        """Declare lost the workers silent for ``timeout`` seconds; their ids."""
        now = self._clock()
        with self._lock:
            silent = [w for w in self._workers.values() if now - w.last_seen > timeout]
        for worker in silent:
            quiet = now - worker.last_seen
            self.unregister_worker(
                worker.info.id,
                reason=f"its worker {worker.info.name} stopped heartbeating ({quiet:.0f} s without a word)",
            )
        return [w.info.id for w in silent]

    def unregister_worker(self, worker_id: str, reason: str = "its worker stopped") -> None:
        """Detach a worker; jobs it still runs are retried or end lost."""
        with self._lock:
            worker = self._workers.pop(worker_id, None)
            if worker is None:
                return
            worker.closed = True
            worker.wake.fire()
            now = self._clock()
            gangs = [j for j in worker.running if len(self._running[j].tasks) > 1]
            for job_id in gangs:
                self._node_lost(job_id, worker_id, reason, now)
            worker.running.difference_update(gangs)
            lost = {job_id: self._release(job_id) for job_id in list(worker.running)}
            with self.store.transaction() as tx:
                for job_id, run in lost.items():
                    self._end_lost(tx, run, job_id, reason, now)
                assignments = self._plan()
                tx.delete_worker(worker_id)
                self._record(tx, assignments, now)
            self._dispatch(assignments, now)

    def close_workers(self) -> None:
        """Place nothing more on any worker (the control plane is shutting down)."""
        with self._lock:
            for worker in self._workers.values():
                worker.closed = True
                worker.wake.fire()

    def acquire(
        self, worker_id: str, timeout: float = defaults.ACQUIRE_TIMEOUT_S
    ) -> list[Instruction]:
        """The worker's long poll: returns at once when work is placed on it."""
        with self._lock:
            worker = self._live(worker_id)
            worker.last_seen = self._clock()
            if not worker.inbox and not worker.closed:
                wait_on(self._lock, worker.wake, timeout)
            return self._drain(worker)

    def watch_worker(
        self, worker_id: str, callback: Callable[[], None]
    ) -> tuple[list[Instruction], Unsubscribe | None]:
        """Instructions waiting for the worker, or a subscription for the next ones."""
        with self._lock:
            worker = self._live(worker_id)
            worker.last_seen = self._clock()
            if worker.inbox or worker.closed:
                return self._drain(worker), None
            return [], worker.wake.subscribe(callback)

    def take_instructions(self, worker_id: str) -> list[Instruction]:
        with self._lock:
            return self._drain(self._live(worker_id))

    def _live(self, worker_id: str) -> _LiveWorker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise InvalidStateError(f"worker {worker_id} is not registered with this control plane")
        if not worker.connected:
            # Known from before a restart: it must say what it still runs.
            raise InvalidStateError(
                f"worker {worker_id} is not registered with this control plane since it restarted"
            )
        return worker

    def _drain(self, worker: _LiveWorker) -> list[Instruction]:
        items = list(worker.inbox)
        worker.inbox.clear()
        for item in items:
            if type(item) is RunTask:
                run = self._running.get(item.job_id)
                task = run.task_on(worker.info.id) if run is not None else None
                if task is not None:
                    task.delivered = True
        return items

    def task_started(self, report: TaskStarted) -> None:
        with self._lock:
            run = self._running.get(report.job_id)
            if run is None or run.attempt != report.attempt:
                return  # a stale report from an attempt that already ended
            task = run.task_on(report.worker_id)
            if task is None or task.ended:
                return
            task.started = True
            marks = {
                "acquired": report.acquired,
                "prepared": report.prepared,
                "started": report.started,
            }
            node = None
            if len(run.tasks) > 1:
                # The job's stages end when its last node's do.
                for key, value in marks.items():
                    marks[key] = run.marks[key] = max(run.marks.get(key, value), value)
            if run.spec.distributed:
                node = task.node
            with self.store.transaction() as tx:
                tx.start(
                    report.job_id,
                    marks=marks,
                    pid=report.pid,
                    pid_created=report.pid_created,
                    node=node,
                    procs=report.procs,
                )

    def task_rendezvous(self, job_id: str, attempt: int, worker_id: str, port: int) -> None:
        """Node 0 of a distributed job reserved ``port``: tell the other nodes."""
        with self._lock:
            run = self._running.get(job_id)
            if run is None or run.attempt != attempt or run.worker_id != worker_id:
                return
            run.master_port = port
            for task in run.tasks[1:]:
                worker = self._workers.get(task.worker_id)
                if worker is not None and not task.ended:
                    worker.inbox.append(
                        Rendezvous(job_id=job_id, attempt=attempt, master_port=port)
                    )
                    worker.wake.fire()

    def append_logs(self, job_id: str, attempt: int, lines: list[LogLine], node: int = 0) -> None:
        if not lines:
            return
        with self._lock:
            run = self._running.get(job_id)
            gang = run is not None and len(run.tasks) > 1
        if gang or node:
            self._append_node_logs(job_id, attempt, lines, node)
            return
        if run is None:
            job = self.store.get_job(job_id)
            if job is not None and job.spec.nodes > 1:
                return  # see _append_node_logs
        self.store.append_logs(job_id, attempt, lines)
        with self._lock:
            signal = self._logs.get(job_id)
            if signal is not None:
                signal.fire()

    def _append_node_logs(self, job_id: str, attempt: int, lines: list[LogLine], node: int) -> None:
        """Lines from one node of a job of several: numbered here, in the order
        they arrive, so that a reader's cursor never skips a slower node's.
        A batch sent again (its reply was lost) is recognised by the node's
        own numbering and not stored twice."""
        with self._lock:
            run = self._running.get(job_id)
            if run is None or run.attempt != attempt:
                # The attempt is over: its nodes were ended and reported, or
                # declared lost; what a lost node says now is not kept.
                log.debug(
                    "dropping %d log lines of ended attempt %s/%d", len(lines), job_id, attempt
                )
                return
            seen = run.log_seen.get(node, 0)
            fresh = [line for line in lines if line.seq > seen]
            if not fresh:
                return
            run.log_seen[node] = fresh[-1].seq
            base = run.log_seq
            numbered = [
                LogLine(base + i, line.ts, line.stream, line.text, line.rank)
                for i, line in enumerate(fresh, 1)
            ]
            run.log_seq = base + len(numbered)
            self.store.append_logs(job_id, attempt, numbered)
            signal = self._logs.get(job_id)
            if signal is not None:
                signal.fire()

    def task_finished(self, result: TaskResult, *, yield_to_waiters: bool = True) -> None:
        now = self._clock()
        with self._lock:
            run = self._running.get(result.job_id)
            if run is None or run.attempt != result.attempt:
                return  # already ended (e.g. declared lost); never apply twice
            if len(run.tasks) == 1:
                if run.worker_id != result.worker_id:
                    return
                final = self._conclude(result.job_id, run, result, now)
            else:
                task = run.task_on(result.worker_id)
                if task is None or task.ended:
                    return
                final = self._task_ended(result.job_id, run, task, result, now)
        if final and yield_to_waiters:
            # Hand the interpreter to the woken client now rather than after
            # this worker's own tidying up: the client is the one waiting.
            os.sched_yield()

    def _conclude(self, job_id: str, run: _Running, result: TaskResult, now: float) -> bool:
        """The attempt ended with ``result``: finish the job or queue it again.
        Returns whether the job is final."""
        cancel = run.cancel_requested
        if not cancel and not (result.outcome == "exited" and result.exit_code == 0):
            # A cancel from another process on this home is only in the store.
            stored = self.store.get_job(job_id)
            cancel = cancel or bool(stored and stored.cancel_requested)
        state, again = jobs.next_state(
            result,
            cancel_requested=cancel,
            attempt=run.attempt,
            max_retries=run.spec.max_retries,
        )
        reason = "cancelled" if state == jobs.CANCELLED else jobs.describe_failure(result)
        marks = dict(result.marks)
        if len(run.tasks) > 1:
            # Its stages span every node: started when the last started,
            # exited when the last exited.
            marks.update(
                {k: run.marks[k] for k in ("acquired", "prepared", "started") if k in run.marks}
            )
            exits = [r.marks["exited"] for r in run.results if "exited" in r.marks]
            if exits:
                marks["exited"] = max(exits)
        marks["finished"] = now
        self._release(job_id)
        if again:
            self._requeue(job_id, run)
        assignments = self._plan()
        with self.store.transaction() as tx:
            if again:
                tx.requeue(
                    job_id,
                    reason=f"retrying after attempt {run.attempt} {state}: {reason}",
                    owner=self.instance_id,
                )
            else:
                tx.finish(
                    job_id,
                    state=state,
                    exit_code=result.exit_code,
                    reason=reason,
                    marks=marks,
                    outputs=result.outputs,
                )
            self._record(tx, assignments, now)
        self._dispatch(assignments, now)
        if not again:
            first = run.tasks[0]
            final = JobInfo(
                id=job_id,
                spec=run.spec,
                state=state,
                seq=run.seq,
                attempt=run.attempt,
                owner=self.instance_id,
                worker=first.worker_id,
                slots=list(first.slots),
                gpus=list(first.gpus),
                exit_code=result.exit_code,
                reason=reason,
                cancel_requested=cancel,
                marks={**run.marks, **marks},
                outputs=result.outputs,
                tasks=_task_infos(run.tasks) if run.spec.distributed else [],
            )
            self._signal_done(job_id, final)
        return not again

    def _task_ended(
        self, job_id: str, run: _Running, task: _Task, result: TaskResult, now: float
    ) -> bool:
        """One node of a job of several ended. The first failure ends the
        other nodes; the job ends with its last node. Returns whether the job
        is final."""
        task.ended = True
        self._release_task(job_id, task)
        run.results.append(result)
        failed = not (result.outcome == "exited" and result.exit_code == 0)
        if failed and result.outcome != "cancelled" and len(_failures(run)) == 1:
            self._cancel_tasks(job_id, run)
        if all(t.ended for t in run.tasks):
            return self._conclude(job_id, run, _decisive(run), now)
        # Its slots are free: something else may fit now.
        assignments = self._plan()
        if assignments:
            with self.store.transaction() as tx:
                self._record(tx, assignments, now)
            self._dispatch(assignments, now)
        return False

    def _node_lost(self, job_id: str, worker_id: str, reason: str, now: float) -> None:
        run = self._running.get(job_id)
        task = run.task_on(worker_id) if run is not None else None
        if run is None or task is None or task.ended:
            return
        result = TaskResult(
            job_id=job_id,
            attempt=run.attempt,
            worker_id=worker_id,
            outcome="lost",
            error=reason,
            node=task.node,
        )
        self._task_ended(job_id, run, task, result, now)

    def _cancel_tasks(self, job_id: str, run: _Running) -> None:
        for task in run.tasks:
            worker = self._workers.get(task.worker_id)
            if worker is not None and not task.ended:
                worker.inbox.append(CancelTask(job_id=job_id, attempt=run.attempt))
                worker.wake.fire()

    # ---- recovery ------------------------------------------------------

    def recover(self, dead_instance: str, *, workers_outlive: bool = False) -> list[str]:
        """Take over the jobs of a control plane that died; returns their ids.

        Its queued jobs queue here. Its running jobs depend on where they ran:
        on workers inside the dead process (embedded), they died with it, so
        their process trees are ended and they are retried within budget or
        end ``lost``. On remote workers (a server restart, ``workers_outlive``)
        they may still be running: they stay running here, and their workers
        have the heartbeat timeout to come back and say so.
        """
        now = self._clock()
        touched: list[str] = []
        with self._lock:
            running = self.store.list_jobs(states=[jobs.RUNNING], owner=dead_instance)
            if workers_outlive:
                self._adopt_workers(dead_instance, running, now)
            elif self._kill_orphan is not None:
                for job in running:
                    for pid, created in job.processes():
                        self._kill_orphan(pid, created)
            with self.store.transaction() as tx:
                for job in running:
                    touched.append(job.id)
                    if workers_outlive:
                        continue
                    reason = f"the GPUlayer process running it died (instance {dead_instance})"
                    if job.attempt <= job.spec.max_retries:
                        tx.requeue(job.id, reason=f"retrying: {reason}", owner=self.instance_id)
                    else:
                        tx.finish(
                            job.id,
                            state=jobs.LOST,
                            exit_code=None,
                            reason=reason,
                            marks={"finished": now},
                            outputs={},
                        )
                touched += tx.adopt(dead_instance, self.instance_id, workers=workers_outlive)
            for job in self.store.list_jobs(states=[jobs.QUEUED], owner=self.instance_id):
                if job.id not in self._queue:
                    request = Request(
                        job.id, job.spec.priority, job.seq, job.spec.gpus, job.spec.nodes
                    )
                    self._enqueue(
                        _Pending(request, job.spec, job.attempt, job.marks.get("submitted", now))
                    )
            assignments = self._plan()
            with self.store.transaction() as tx:
                self._record(tx, assignments, now)
            self._dispatch(assignments, now)
        return touched

    def _adopt_workers(self, dead_instance: str, running: list[JobInfo], now: float) -> None:
        """Known-but-disconnected workers holding the slots of the jobs they run."""
        known = {w.id: w for w in self.store.list_workers() if w.instance == dead_instance}
        for job in running:
            if job.worker is None:
                continue
            placed = job.tasks or [
                TaskInfo(node=0, worker=job.worker, slots=job.slots, gpus=job.gpus, pid=job.pid)
            ]
            tasks = []
            for placement in placed:
                info = known.get(placement.worker)
                if info is None:  # no record: enough slots to hold what it ran
                    info = WorkerInfo(
                        id=placement.worker,
                        name=placement.worker,
                        host="?",
                        slot_gpus=[None] * (max(placement.slots, default=0) + 1),
                    )
                    known[placement.worker] = info
                worker = self._workers.get(info.id)
                if worker is None:
                    info.instance = self.instance_id
                    worker = _LiveWorker(
                        info=info,
                        free=set(range(len(info.slot_gpus))),
                        inbox=deque(),
                        connected=False,
                        last_seen=now,
                    )
                    self._workers[info.id] = worker
                worker.free.difference_update(placement.slots)
                worker.running.add(job.id)
                tasks.append(
                    _Task(
                        placement.node,
                        info.id,
                        tuple(placement.slots),
                        tuple(placement.gpus),
                        started=placement.pid is not None or "started" in job.marks,
                    )
                )
            run = _Running(
                job.attempt,
                job.spec,
                job.seq,
                tasks,
                {k: v for k, v in job.marks.items() if k in ("submitted", "placed")},
            )
            if len(tasks) > 1:  # go on numbering its log lines after those stored
                run.log_seq = self.store.last_log_seq(job.id, job.attempt)
            self._running[job.id] = run
        for info in known.values():
            if info.id not in self._workers:
                info.instance = self.instance_id
                self._workers[info.id] = _LiveWorker(
                    info=info,
                    free=set(range(len(info.slot_gpus))),
                    inbox=deque(),
                    connected=False,
                    last_seen=now,
                )

    # ---- internals (call with self._lock held) -------------------------

    def _enqueue(self, pending: _Pending) -> None:
        req = pending.request
        self._queue[req.job_id] = pending
        bisect.insort(self._order, (-req.priority, req.seq, req.job_id))

    def _dequeue(self, job_id: str) -> _Pending:
        pending = self._queue.pop(job_id)
        req = pending.request
        key = (-req.priority, req.seq, job_id)
        del self._order[bisect.bisect_left(self._order, key)]
        return pending

    def _open_workers(self) -> list[_LiveWorker]:
        return [w for w in self._workers.values() if w.connected and not w.closed]

    def _plan(self) -> list[Assignment]:
        if not self._queue:
            return []
        caps = [w.capacity() for w in self._open_workers() if w.free]
        if not caps:
            return []
        return place((self._queue[key[2]].request for key in self._order), caps)

    def _record(self, tx: Transaction, assignments: list[Assignment], now: float) -> None:
        """Store placements. One whose job is no longer queued in the store (a
        cancel from another process) is dropped from the queue and from
        ``assignments``, so it is not dispatched."""
        for group in _by_job(assignments):
            a = group[0]
            pending = self._queue[a.job_id]
            placed = tx.place(
                a.job_id,
                worker=a.worker_id,
                slots=a.slots,
                gpus=a.gpus,
                attempt=pending.attempt + 1,
                at=now,
                tasks=_task_infos(group) if pending.spec.distributed else (),
            )
            if not placed:
                for gone in group:
                    assignments.remove(gone)
                self._dequeue(a.job_id)
                self._signal_done(a.job_id)

    def _dispatch(self, assignments: list[Assignment], now: float) -> None:
        """Apply committed placements in memory and wake the chosen workers."""
        for group in _by_job(assignments):
            job_id = group[0].job_id
            pending = self._dequeue(job_id)
            attempt = pending.attempt + 1
            spec = pending.spec
            tasks = [_Task(node, a.worker_id, a.slots, a.gpus) for node, a in enumerate(group)]
            self._running[job_id] = _Running(
                attempt,
                spec,
                pending.request.seq,
                tasks,
                {"submitted": pending.submitted, "placed": now},
            )
            # Rank 0 listens on node 0, at the address its worker advertises.
            master = None
            if spec.distributed:
                master = (
                    self._workers[tasks[0].worker_id].info.address if len(tasks) > 1 else None
                ) or "127.0.0.1"
            for task in tasks:
                worker = self._workers[task.worker_id]
                worker.free.difference_update(task.slots)
                worker.running.add(job_id)
                worker.inbox.append(
                    RunTask(
                        placed=now,
                        job_id=job_id,
                        attempt=attempt,
                        spec=spec,
                        slots=list(task.slots),
                        gpus=list(task.gpus),
                        node=task.node,
                        master_addr=master,
                    )
                )
                worker.wake.fire()

    def _release(self, job_id: str) -> _Running:
        run = self._running.pop(job_id)
        for task in run.tasks:
            if not task.ended:
                self._release_task(job_id, task)
        return run

    def _release_task(self, job_id: str, task: _Task) -> None:
        worker = self._workers.get(task.worker_id)
        if worker is not None:
            worker.free.update(task.slots)
            worker.running.discard(job_id)

    def _requeue(self, job_id: str, run: _Running) -> None:
        spec = run.spec
        request = Request(job_id, spec.priority, run.seq, spec.gpus, spec.nodes)
        self._enqueue(_Pending(request, spec, run.attempt, run.marks["submitted"]))

    def _end_lost(
        self, tx: Transaction, run: _Running, job_id: str, reason: str, now: float
    ) -> None:
        if run.attempt <= run.spec.max_retries:
            self._requeue(job_id, run)
            tx.requeue(job_id, reason=f"retrying: {reason}", owner=self.instance_id)
        else:
            tx.finish(
                job_id,
                state=jobs.LOST,
                exit_code=None,
                reason=reason,
                marks={"finished": now},
                outputs={},
            )
            self._signal_done(job_id)

    def _signal_done(self, job_id: str, final: JobInfo | None = None) -> None:
        done = self._done.pop(job_id, None)
        if done is not None:
            # Hand waiters the record (saves each a read of the store).
            done.job = final or self.store.get_job(job_id)
            done.signal.fire()
        logs = self._logs.pop(job_id, None)
        if logs is not None:
            logs.fire()


def _by_job(assignments: list[Assignment]) -> list[list[Assignment]]:
    """Assignments grouped by job: a gang's tasks come together, node 0 first."""
    groups: list[list[Assignment]] = []
    for a in assignments:
        if groups and groups[-1][0].job_id == a.job_id:
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


def _task_infos(placed: Sequence[Assignment | _Task]) -> list[TaskInfo]:
    return [
        TaskInfo(node=node, worker=item.worker_id, slots=list(item.slots), gpus=list(item.gpus))
        for node, item in enumerate(placed)
    ]


def _failures(run: _Running) -> list[TaskResult]:
    """Node results that can have ended the job: not its own success, and
    not an end it was sent (a cancel)."""
    return [
        r
        for r in run.results
        if not (r.outcome == "exited" and r.exit_code == 0) and r.outcome != "cancelled"
    ]


def _decisive(run: _Running) -> TaskResult:
    """The result a job of several nodes ends with.

    The first failure is the cause: when one rank dies its peers usually fail
    after it (a connection closed under them) or are ended by us. A node
    whose worker vanished comes first, since its ranks' end is unknown.
    """
    failures = _failures(run)
    if failures:
        return min(
            failures, key=lambda r: (r.outcome != "lost", r.marks.get("exited", float("inf")))
        )
    cancelled = [r for r in run.results if r.outcome == "cancelled"]
    if cancelled:
        return cancelled[0]
    return next(r for r in run.results if r.node == 0)
