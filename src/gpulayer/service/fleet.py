"""What workers do: register, heartbeat, take tasks, report on them.

A worker's long poll (:meth:`Fleet.acquire`, or :meth:`Fleet.watch_worker`
for an event loop) returns the moment work is placed on it. Its reports
(started, the master port of a distributed job, logs, finished) move the
job along; a report from an attempt that already ended changes nothing.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import msgspec

from .. import defaults
from ..errors import InvalidStateError, StoreError
from ..ids import new_id
from ..jobs import (
    WORKER_STOPPED,
    CancelTask,
    GpuStats,
    Instruction,
    LogLine,
    Rendezvous,
    RunTask,
    TaskResult,
    TaskStarted,
    WorkerInfo,
    clip_start,
)
from ..signals import Signal, Unsubscribe, wait_on
from .blobs import BlobReaders
from .core import log
from .endings import refuse_unsafe_outputs
from .state import GPU_HISTORY_S, Delivery, LiveWorker, Running, failures, never_taken


class Fleet(BlobReaders):
    # Registrations are numbered from the clock, so a restarted control
    # plane never reuses an earlier one's numbers.
    _generations = itertools.count(time.time_ns())

    # ---- workers -------------------------------------------------------

    def register_worker(
        self,
        info: WorkerInfo,
        running: Iterable[tuple[str, int]] = (),
        *,
        adopted: bool = False,
        token_digest: str | None = None,
    ) -> WorkerInfo:
        """Add a worker, or re-attach one that was here before (same id).

        ``token_digest``: the sha256 of the token it registered with, stored
        with it (the HTTP layer lets only that token act for it).

        A returning worker names the tasks it still runs (job id, attempt):
        those stay running; the ones it no longer has end as lost (or are
        retried); ones this control plane has already given up on are
        cancelled on the worker. One it never took is queued again, not
        counted; but where this control plane cannot know whether it was
        taken (placed before a restart) and the worker is ``adopted`` (a new
        process, which ended what the dead one ran), it may have run: lost.
        """
        now = self._clock()
        info.id = info.id or new_id()
        info.instance = self.instance_id
        info.started = info.last_seen = now
        reported = set(running)
        with self._lock:
            worker = self._workers.get(info.id)
            lost: dict[str, Running] = {}
            gang_lost: list[str] = []  # tasks of jobs of several nodes it no longer has
            if worker is None:
                worker = LiveWorker(
                    info=info,
                    free=set(range(len(info.slot_gpus))),
                    inbox=deque(),
                    generation=next(self._generations),
                )
                self._workers[info.id] = worker
                before = None
            else:
                # As it was, should the store refuse this registration (below).
                before = (worker.info, worker.connected, worker.closed, set(worker.free))
                worker.info, worker.connected, worker.closed = info, True, False
                # Its previous process's long poll may still be open: end it
                # empty-handed, and start afresh. Instructions not yet taken
                # were for that process; what still holds is re-sent below.
                worker.generation = next(self._generations)
                stale, worker.wake = worker.wake, Signal()
                stale.fire()
                worker.inbox.clear()
                worker.unacked.clear()
                worker.seq = 0  # the new process counts from the start
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
                its = held_run.task_on(info.id) if held_run is not None else None
                if held_run is None or held_run.attempt != attempt or its is None or its.ended:
                    # Given up on (declared lost meanwhile, or its job moved on).
                    worker.inbox.append(CancelTask(job_id=job_id, attempt=attempt))
                    continue
                its.delivered = True  # it has it (unknown after a restart until now)
                if held_run.cancel_requested or failures(held_run):
                    # Being ended (a cancel, or another node failed): it may
                    # have missed that while the server was down.
                    worker.inbox.append(CancelTask(job_id=job_id, attempt=attempt))
                elif its.node > 0 and held_run.master_port is not None:
                    # It may have missed the port (the server restarted in
                    # between); hearing it twice changes nothing.
                    worker.inbox.append(
                        Rendezvous(job_id=job_id, attempt=attempt, master_port=held_run.master_port)
                    )
            ended: list[str] = []
            attempts = {job_id: run.attempt for job_id, run in lost.items()}
            try:
                with self.store.transaction() as tx:
                    for job_id, run in lost.items():
                        unknown = adopted and any(t.delivered is None for t in run.tasks)
                        if (
                            run.started
                            or unknown
                            or run.cancel_requested
                            or tx.cancel_requested(job_id)
                        ):
                            reason = "its worker came back without it"
                            self._end_lost(tx, run, job_id, reason, now, ended)
                        else:  # placed, but it never reached the worker: not an attempt
                            run.attempt -= 1
                            self._requeue(job_id, run)
                            tx.requeue(
                                job_id, reason=None, owner=self.instance_id, attempt=run.attempt
                            )
                    tx.upsert_worker(info, token_digest=token_digest, at=now)
                    assignments = self._plan()
                    self._record(tx, assignments, now)
            except StoreError:
                # The worker registers again (it got a 503): nothing is placed
                # on it meanwhile, and the tasks it came back without go back
                # on it, to be found missing then. A new worker is forgotten:
                # it will come under another id.
                if before is None:
                    del self._workers[info.id]
                else:
                    worker.info, worker.connected, worker.closed, worker.free = before
                    worker._capacity = None
                    for job_id, run in lost.items():
                        run.attempt = attempts[job_id]
                        self._unrelease(job_id, run, requeued=job_id in self._queue)
                raise
            self._dispatch(assignments, now)
            for job_id in ended:
                self._signal_done(job_id)
            for job_id in gang_lost:
                self._node_lost(job_id, info.id, "its worker came back without it", now)
            if worker.inbox:
                worker.wake.fire()
        return info

    def heartbeat(
        self, worker_id: str, *, stopping: bool = False, gpus: Sequence[GpuStats] = ()
    ) -> None:
        """A worker is alive (any request from it counts as one too). A
        ``stopping`` one gets no more work: its long poll ends. ``gpus``: its
        GPUs' latest figures, kept an hour (see state.GpuHistory)."""
        with self._lock:
            worker = self._live(worker_id)
            worker.last_seen = self._clock()
            worker.record_gpus(gpus, worker.last_seen)
            if stopping:
                worker.closed = True
                worker.wake.fire()

    def gpu_stats(self) -> dict[str, list[GpuStats]]:
        """Each live worker's GPUs' latest figures (fresh ones only), by worker id."""
        with self._lock:
            now = self._clock()
            return {w.info.id: w.gpu_stats(now) for w in self._workers.values() if w.gpus}

    def gpu_history(self, worker_id: str, since: float | None = None) -> dict[int, list[GpuStats]]:
        """A live worker's GPUs' figures from ``since`` (default: an hour
        ago) on, oldest first, by GPU index; ``{}`` for a worker not here."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                return {}
            start = self._clock() - GPU_HISTORY_S if since is None else since
            kept = {index: h.copy() for index, h in sorted(worker.gpus.items())}
        return {index: h.samples(start) for index, h in kept.items()}

    def reap(
        self, timeout: float, on_refused: Callable[[str, StoreError], None] | None = None
    ) -> list[str]:
        """Declare lost the workers silent for ``timeout`` seconds; their ids.

        A loss the store refuses leaves that worker registered, to be tried
        again on a later call. With ``on_refused``, it is told there (worker
        id, error) and the other silent workers are still declared lost;
        without, the error is raised."""
        now = self._clock()
        with self._lock:
            silent = [w for w in self._workers.values() if now - w.last_seen > timeout]
        lost = []
        for worker in silent:
            quiet = now - worker.last_seen
            try:
                self.unregister_worker(
                    worker.info.id,
                    reason=f"its worker {worker.info.name} stopped heartbeating ({quiet:.0f} s without a word)",
                )
            except StoreError as exc:
                if on_refused is None:
                    raise
                on_refused(worker.info.id, exc)
                continue
            lost.append(worker.info.id)
        return lost

    def unregister_worker(
        self,
        worker_id: str,
        reason: str = WORKER_STOPPED,
        *,
        said: bool = False,
        generation: int | None = None,
    ) -> bool:
        """Detach a worker; jobs it still runs are retried or end lost. False
        if there was none to detach (none, or not that ``generation``).

        A job still waiting in its inbox was never handed to it, whether it
        ``said`` goodbye (unregistered itself) or went silent: that one is
        queued again, not counted as an attempt.

        ``generation``: the goodbye is for that registration. One that comes
        late, after the worker's id registered again (the next worker process
        on its home took it over: a later number, since numbers grow with the
        clock), changes nothing. A worker known from before a restart has no
        number here (0): any goodbye to it counts.
        """
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                return False
            if generation is not None and generation < worker.generation:
                return False
            was_closed, worker.closed = worker.closed, True  # nothing more placed on it
            said = said or worker.said_goodbye
            now = self._clock()
            # Each node of a job of several is lost in a write of its own. If
            # the store refuses one (or the write below), memory is put back
            # and the worker stays registered: the reaper, or its own goodbye,
            # tries again; what was stored stays done.
            try:
                for job_id in [j for j in worker.running if len(self._running[j].tasks) > 1]:
                    self._node_lost(job_id, worker_id, reason, now, undo=True)
                    worker.running.discard(job_id)
            except StoreError:
                worker.closed, worker.said_goodbye = was_closed, said
                raise
            lost = {job_id: self._release(job_id) for job_id in list(worker.running)}
            attempts = {job_id: run.attempt for job_id, run in lost.items()}
            # Never handed to it (still in its inbox): never ran, not an
            # attempt. One it took but never reported started may have run
            # (starts are reported late over HTTP): that one was lost.
            unrun = {job_id for job_id, run in lost.items() if never_taken(run.tasks[0])}
            ended: list[str] = []
            try:
                with self.store.transaction() as tx:
                    for job_id, run in lost.items():
                        # A job being cancelled ends so (see _end_lost), even unrun.
                        if run.cancel_requested or tx.cancel_requested(job_id):
                            unrun.discard(job_id)
                        if job_id in unrun:
                            run.attempt -= 1
                            self._requeue(job_id, run)
                            tx.requeue(
                                job_id, reason=None, owner=self.instance_id, attempt=run.attempt
                            )
                        else:
                            self._end_lost(tx, run, job_id, reason, now, ended)
                    assignments = self._plan()
                    tx.delete_worker(worker_id)
                    self._record(tx, assignments, now)
            except StoreError:
                for job_id, run in lost.items():
                    run.attempt = attempts[job_id]
                    self._unrelease(job_id, run, requeued=job_id in self._queue)
                worker.closed, worker.said_goodbye = was_closed, said
                raise
            del self._workers[worker_id]
            worker.wake.fire()  # its long poll, if one is open, ends
            self._dispatch(assignments, now)
            for job_id in ended:
                self._signal_done(job_id)
            return True

    def has_worker(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is registered (not declared lost, not gone)."""
        with self._lock:
            return worker_id in self._workers

    def close_worker(self, worker_id: str) -> None:
        """Place nothing more on this worker (no store write: the reaper removes it)."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is not None:
                _close(worker)

    def close_workers(self) -> None:
        """Place nothing more on any worker (the control plane is shutting down)."""
        with self._lock:
            for worker in self._workers.values():
                _close(worker)
            timer = self._stop_timers()
            self._save_usage(self._clock(), every=0)  # what accrued since the last save
        if timer is not None:  # joined unlocked: its callback may be waiting for the lock
            timer.join()

    def acquire(
        self, worker_id: str, timeout: float = defaults.ACQUIRE_TIMEOUT_S
    ) -> list[Instruction]:
        """The worker's long poll: returns at once when work is placed on it."""
        with self._lock:
            worker = self._live(worker_id)
            worker.last_seen = self._clock()
            generation = worker.generation
            if not worker.inbox and not worker.closed:
                wait_on(self._lock, worker.wake, timeout)
            if self._workers.get(worker_id) is not worker or worker.generation != generation:
                # Gone meanwhile (what waits for it is queued again), or
                # registered again: this poll is stale.
                return []
            return self._drain(worker)

    def generation(self, worker_id: str) -> int:
        """The worker's registration: a number no earlier registration had,
        here or before a restart."""
        with self._lock:
            return self._live(worker_id).generation

    def watch_worker(
        self,
        worker_id: str,
        callback: Callable[[], None],
        *,
        numbered: bool = False,
        ack: int | None = None,
        generation: int | None = None,
    ) -> tuple[Delivery, Unsubscribe | None, int]:
        """Instructions waiting for the worker, or a subscription for the next
        ones; and the worker's generation, for :meth:`take_delivery`.

        ``numbered`` deliveries are kept until acknowledged: ``ack`` says the
        worker got every one up to that number, and those after it are sent
        again (the reply that carried them may have been lost). A poll of an
        earlier ``generation`` (registration) gets nothing, at once.
        """
        with self._lock:
            worker = self._live(worker_id)
            worker.last_seen = self._clock()
            if generation is not None and generation != worker.generation:
                return Delivery(0, []), None, worker.generation
            resend = self._acknowledge(worker, ack) if numbered and ack is not None else []
            if resend or worker.inbox or worker.closed:
                return self._deliver(worker, numbered, resend), None, worker.generation
            return Delivery(worker.seq + 1, []), worker.wake.subscribe(callback), worker.generation

    def take_instructions(self, worker_id: str, generation: int | None = None) -> list[Instruction]:
        """What waits for the worker; nothing for a long poll of an earlier
        ``generation`` (the worker has registered again since)."""
        with self._lock:
            worker = self._live(worker_id)
            if generation is not None and generation != worker.generation:
                return []
            return self._drain(worker)

    def finish_and_take(
        self, result: TaskResult, generation: int | None = None, *, ack: int | None = None
    ) -> Delivery | None:
        """:meth:`task_finished`, then :meth:`take_delivery` for the reporting
        worker: what its end placed on it goes back in the reply to its report.

        That placement does not wake the worker's long poll as well: it would
        only find the delivery taken, and wait again (a wasted turn of the
        server per job in a stream of short jobs). If the report cannot take
        it (the worker registered again since), the long poll is woken after all.
        """
        with self._lock:
            self._taking = result.worker_id
        try:
            self.task_finished(result, yield_to_waiters=False)
        finally:
            with self._lock:
                self._taking = None
        delivery = self.take_delivery(result.worker_id, generation, ack=ack)
        if delivery is None:
            with self._lock:
                worker = self._workers.get(result.worker_id)
                if worker is not None and worker.inbox:
                    worker.wake.fire()
        return delivery

    def take_delivery(
        self, worker_id: str, generation: int | None = None, *, ack: int | None = None
    ) -> Delivery | None:
        """What waits for the worker, numbered, after acknowledging ``ack``
        (see :meth:`watch_worker`); None if it is no longer registered, or
        registered again since ``generation``."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None or not worker.connected:
                return None
            if generation is not None and generation != worker.generation:
                return None
            resend = self._acknowledge(worker, ack) if ack is not None else []
            return self._deliver(worker, True, resend)

    def _acknowledge(self, worker: LiveWorker, ack: int) -> list[tuple[int, Instruction]]:
        """Forget deliveries numbered up to ``ack``; the ones left, to send again."""
        unacked = worker.unacked
        while unacked and unacked[0][0] <= ack:
            unacked.popleft()
        return list(unacked)

    def _deliver(
        self, worker: LiveWorker, numbered: bool, resend: list[tuple[int, Instruction]]
    ) -> Delivery:
        items = self._drain(worker)
        if not numbered:
            return Delivery(0, items)
        first = worker.seq + 1
        for item in items:
            worker.seq += 1
            worker.unacked.append((worker.seq, item))
        while len(worker.unacked) > defaults.UNACKED_MAX:  # a worker that never acknowledges
            worker.unacked.popleft()
        if resend:
            return Delivery(resend[0][0], [item for _, item in resend] + items, len(resend))
        return Delivery(first, items)

    def _live(self, worker_id: str) -> LiveWorker:
        worker = self._workers.get(worker_id)
        if worker is None:
            raise InvalidStateError(f"worker {worker_id} is not registered with this control plane")
        if not worker.connected:
            # Known from before a restart: it must say what it still runs.
            raise InvalidStateError(
                f"worker {worker_id} is not registered with this control plane since it restarted"
            )
        return worker

    def _drain(self, worker: LiveWorker) -> list[Instruction]:
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
                    start=clip_start(report.start),  # the worker's text: bounded
                )

    def task_rendezvous(self, job_id: str, attempt: int, worker_id: str, port: int) -> None:
        """Node 0 of a distributed job reserved ``port``: tell the other nodes."""
        with self._lock:
            run = self._running.get(job_id)
            if run is None or run.attempt != attempt or run.worker_id != worker_id:
                return
            run.master_port = port
            with self.store.transaction() as tx:  # a restarted server hands it on too
                tx.set_master_port(job_id, port)
            for task in run.tasks[1:]:
                worker = self._workers.get(task.worker_id)
                if worker is not None and not task.ended:
                    worker.inbox.append(
                        Rendezvous(job_id=job_id, attempt=attempt, master_port=port)
                    )
                    worker.wake.fire()

    def running_on(self, job_id: str, attempt: int, node: int = 0) -> str | None:
        """The worker that runs ``node`` of the job's ``attempt`` now; None if
        it is not running (ended, though the job's other nodes may run on, or
        never ran: the store knows which)."""
        with self._lock:
            run = self._running.get(job_id)
            if run is not None and run.attempt == attempt:
                return next(
                    (t.worker_id for t in run.tasks if t.node == node and not t.ended), None
                )
        return None

    def append_logs(self, job_id: str, attempt: int, lines: list[LogLine], node: int = 0) -> None:
        if not lines:
            return
        with self._lock:
            run = self._running.get(job_id)
            gang = run is not None and len(run.tasks) > 1
            current = run is not None and run.attempt == attempt
            seen = run.log_seen.get(0, 0) if run is not None and current else None
        if gang or node:
            self._append_node_logs(job_id, attempt, lines, node)
            return
        if run is None:
            job = self.store.get_job(job_id)
            if job is not None and job.spec.nodes > 1:
                return  # see _append_node_logs
        # Lines are numbered by their task: what was stored already (a batch
        # sent again, whole or from a later line, after a failure part-way
        # through the worker's requests) is not stored twice.
        if seen is None:
            seen = self.store.last_log_seq(job_id, attempt)
        lines = [line for line in lines if line.seq > seen]
        if not lines:
            return
        self.store.append_logs(job_id, attempt, lines)
        with self._lock:
            if run is not None and current:
                run.log_seen[0] = max(run.log_seen.get(0, 0), lines[-1].seq)
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
            base = run.log_seq
            numbered = [
                LogLine(base + i, line.ts, line.stream, line.text, line.rank)
                for i, line in enumerate(fresh, 1)
            ]
            # Stored first: if the store refuses them, they are not seen, and
            # the worker's log sender sends them again.
            self.store.append_logs(job_id, attempt, numbered, node=node, node_last=fresh[-1].seq)
            run.log_seen[node] = fresh[-1].seq
            run.log_seq = base + len(numbered)
            signal = self._logs.get(job_id)
            if signal is not None:
                signal.fire()

    def task_finished(self, result: TaskResult, *, yield_to_waiters: bool = True) -> None:
        """Apply a task's result. One naming an unsafe or undeclared output
        ends its attempt storing no output, then raises UnsafeOutputError."""
        now = self._clock()
        refused = None
        start = clip_start(result.start)  # the worker's text: bounded
        if start != result.start:
            result = msgspec.structs.replace(result, start=start)
        # Checked outside the lock, as outputs are: what a worker names is its word.
        scratch = self._proved_scratch(result) if result.scratch is not None else None
        if result.outputs:
            # Checked outside the lock (a glob may name a million outputs):
            # a job's spec does not change.
            with self._lock:
                run = self._running.get(result.job_id)
            if run is not None:
                result, refused = refuse_unsafe_outputs(result, run.spec.outputs)
                # Stored before the result is applied: its client, woken by
                # the job's end, fetches the outputs at once.
                self._grant_outputs(result, run)
        with self._lock:
            run = self._running.get(result.job_id)
            if run is None or run.attempt != result.attempt:
                return  # already ended (e.g. declared lost); never apply twice
            # A job's scratch is node 0's, as its outputs are.
            node = run.task_on(result.worker_id)
            if scratch is not None and node is not None and node.node == 0:
                run.scratch = scratch
            if result.outcome == "returned":
                # Its worker is stopping: place nothing more on it.
                worker = self._workers.get(result.worker_id)
                if worker is not None:
                    worker.closed = True
            if len(run.tasks) == 1:
                if run.worker_id != result.worker_id:
                    return
                if result.outcome == "returned" and not run.cancel_requested:
                    self._give_back(result.job_id, run, now)
                    return
                final = self._conclude(result.job_id, run, result, now, undo=True)
            else:
                task = run.task_on(result.worker_id)
                if task is None or task.ended:
                    return
                final = self._task_ended(result.job_id, run, task, result, now, undo=True)
            if refused is not None:
                # The refusal takes no delivery (finish_and_take): what its
                # end placed on the worker goes to its long poll instead.
                worker = self._workers.get(result.worker_id)
                if worker is not None and worker.inbox:
                    worker.wake.fire()
        if refused is not None:
            raise refused  # the worker is told (a 422 over HTTP); the job has ended
        if final and yield_to_waiters:
            # Hand the interpreter to the woken client now rather than after
            # this worker's own tidying up: the client is the one waiting.
            os.sched_yield()


def _close(worker: LiveWorker) -> None:
    worker.closed = True
    worker.wake.fire()  # its long poll, if one is open, ends
