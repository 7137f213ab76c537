"""The control plane's shared state and the steps every part of it takes.

:class:`PlaneCore` holds the state (queue, running jobs, workers, waiters)
and the internal steps that change it: placing, recording placements,
dispatching them to workers, releasing slots and ending an attempt. The
public operations are in :mod:`.fleet` (what workers do), :mod:`.recovery`
(taking over after a crash) and :mod:`.plane` (what clients do). Every
method here is called with ``self._lock`` held.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from .. import defaults, jobs
from ..errors import StoreError
from ..jobs import CancelTask, JobInfo, LogLine, RunTask, TaskResult
from ..outputs import UnsafeOutputError, check_result
from ..scheduler import Assignment, Shares, Waiting, place, preempt, retry_wait
from ..secretbox import SecretBox, redacted
from ..signals import Signal
from ..store import Store, Transaction
from .sharing import USAGE_SAVE_S, Sharing
from .state import (
    ArrayRun,
    Done,
    ListedBlobs,
    LiveWorker,
    NodeTask,
    Pending,
    Running,
    by_job,
    decisive,
    failures,
    never_taken,
    request_of,
    task_infos,
)

log = logging.getLogger(__name__)

# A back-off timer never fires sooner than this (a clock a test holds still,
# a wait already over): it cannot spin.
_RETRY_TIMER_MIN_S = 0.01
# After the store refused placing what a back-off released, try again in this.
_RETRY_STORE_AGAIN_S = 1.0
# The reason a retry's log line gives is cut to this many characters.
_RETRY_WHY_MAX = 200


class PlaneCore:
    def __init__(
        self,
        store: Store,
        *,
        instance_id: str,
        clock: Callable[[], float] = time.time,
        kill_orphan: Callable[[int, float | None], None] | None = None,
        secrets: SecretBox | None = None,
        fair_share_half_life: float = defaults.FAIR_SHARE_HALF_LIFE_S,
    ) -> None:
        self.store = store
        # Seals jobs' secrets before they are stored, opens them for their
        # workers; the key is the home's, beside the store (secretbox.py).
        self.secrets = secrets if secrets is not None else SecretBox.beside(store)
        self.instance_id = instance_id
        self._clock = clock
        self._kill_orphan = kill_orphan
        self._lock = threading.Lock()
        # A worker whose report is taking what is placed on it (see
        # Fleet.finish_and_take): its long poll is not woken for that.
        self._taking: str | None = None
        self._logs: dict[str, Signal] = {}  # job id -> followers of its logs
        self._queue: dict[str, Pending] = {}
        # The queue by project and shape in rank order, so placement reads
        # only the heads (scheduler.Waiting).
        self._waiting = Waiting()
        self._running: dict[str, Running] = {}
        # Dependencies (see dependencies.py): each held-back job's jobs not
        # final yet, and the reverse; jobs ended lately whose dependents the
        # next pass sees to; jobs to cancel there, with why.
        self._unmet: dict[str, set[str]] = {}
        self._dependents: dict[str, set[str]] = {}
        self._settle: set[str] = set()
        self._doomed: dict[str, str] = {}
        # Arrays (see arrays.py): each not final yet, what array each of
        # their tasks not final yet is of, and those whose last task ended.
        self._arrays: dict[str, ArrayRun] = {}
        self._array_of: dict[str, str] = {}
        self._arrays_ended: set[str] = set()
        self._arrays_to_check: set[str] = set()  # a task ended cancelled: was the array?
        # Projects, their quotas and usage, and preemption's bookkeeping.
        self._sharing = Sharing(store, fair_share_half_life, clock)
        self._memberships = self._sharing.memberships
        self._accounts = self._sharing.accounts
        self._workers: dict[str, LiveWorker] = {}
        self._done: dict[str, Done] = {}
        # The final records of the jobs that ended here lately: a client
        # waiting on a burst of jobs asks about many that have just ended,
        # and a final record never changes.
        self._finished: OrderedDict[str, JobInfo] = OrderedDict()
        self._listed = ListedBlobs(defaults.MANIFEST_DIGESTS_KEPT)  # see may_fetch
        # Retries backing off (see _arm_retry): when each may be placed (a
        # heap), and the one timer, for the earliest.
        self._wakeups: list[float] = []
        self._retry_timer: threading.Timer | None = None
        self._retry_due = math.inf
        self._timers_stopped = False
        self._seq = max((j.seq for j in store.list_jobs(limit=1)), default=0)

    def _conclude(
        self, job_id: str, run: Running, result: TaskResult, now: float, *, undo: bool = False
    ) -> bool:
        """The attempt ended with ``result``: finish the job or queue it again.
        Returns whether the job is final.

        ``undo``: for a worker's report, which it sends again if this fails. A
        write the store refuses then leaves memory as it was, so the report
        applies when it comes again. Without it (a node declared lost: no one
        sends that again) memory moves on, and the store catches up with the
        job's next step."""
        cancel = run.cancel_requested
        if not cancel and not (result.outcome == "exited" and result.exit_code == 0):
            # A cancel from another process on this home is only in the store.
            stored = self.store.get_job(job_id)
            cancel = cancel or bool(stored and stored.cancel_requested)
        # A node of a job of several given back unrun by its stopping worker
        # (the others were then ended): the job could not run, through no
        # fault of its own. It goes again, under a new attempt number (the
        # old one may still be on its way from other workers), uncounted.
        # A job preempted goes again too, uncounted (unless it was being
        # cancelled as well: then the cancel wins).
        # (A worker from before preemption reads the request as a cancel.)
        preempted = not cancel and (
            result.outcome == "preempted"
            or (result.outcome == "cancelled" and run.preempted_for is not None)
        )
        given_back = run.given_back + (1 if result.outcome == "returned" or preempted else 0)
        if preempted:
            state, again = jobs.QUEUED, True
        else:
            state, again = jobs.next_state(
                result,
                cancel_requested=cancel,
                attempt=run.attempt - given_back,
                max_retries=run.spec.max_retries,
            )
        reason = "cancelled" if state == jobs.CANCELLED else jobs.describe_failure(result)
        if preempted:
            reason = f"preempted for job {run.preempted_for}" if run.preempted_for else "preempted"
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
        given_back_before = run.given_back
        # A retry that counts backs off; one given back unrun goes at once.
        retry_at = None
        if again and given_back == given_back_before:
            retry_at = now + retry_wait(run.spec.retry_delay, run.attempt - given_back)
        if again:
            run.given_back = given_back
            self._requeue(job_id, run, not_before=retry_at or 0.0)
        # How each node started, where its result says (else its start
        # report's holds); for the final record below, a job of one node
        # whose result says needs no read of what the store made of it.
        ended = run.results if len(run.tasks) > 1 else [result]
        starts = {r.node: r.start for r in ended if r.start is not None}
        start, node_starts = result.start, dict(starts)
        try:
            assignments = self._plan()
            with self.store.transaction() as tx:
                if again:
                    tx.requeue(
                        job_id,
                        reason=(
                            f"queued again after attempt {run.attempt}, not counted as one: {reason}"
                            if given_back > given_back_before
                            else f"retrying after attempt {run.attempt} {state}: {reason}"
                            + _backing_off(retry_at, now)
                        ),
                        owner=self.instance_id,
                        given_back=given_back,
                        retry_at=retry_at,
                        at=now,
                        scratch=run.scratch,
                    )
                    if retry_at is not None:
                        self._say_retry(tx, job_id, run, reason or state, retry_at - now, now)
                    elif preempted:
                        self._say_preempted(tx, job_id, run, now)
                else:
                    tx.finish(
                        job_id,
                        state=state,
                        exit_code=result.exit_code,
                        reason=reason,
                        marks=marks,
                        outputs=result.outputs,
                        starts=starts,
                    )
                    if run.spec.distributed or start is None:
                        start, node_starts = tx.starts(job_id)
                self._record(tx, assignments, now)
        except StoreError:
            if undo:
                run.given_back = given_back_before
                self._unrelease(job_id, run, requeued=again)
            raise
        self._dispatch(assignments, now)
        if not again:
            first = run.tasks[0]
            tasks = task_infos(run.tasks) if run.spec.distributed else []
            for info in tasks:
                info.start = node_starts.get(info.node)
            final = JobInfo(
                id=job_id,
                spec=run.spec,
                state=state,
                seq=run.seq,
                attempt=run.attempt,
                given_back=run.given_back,
                owner=self.instance_id,
                user=run.user,
                worker=first.worker_id,
                slots=list(first.slots),
                gpus=list(first.gpus),
                exit_code=result.exit_code,
                reason=reason,
                cancel_requested=cancel,
                marks={**run.marks, **marks},
                outputs=result.outputs,
                tasks=tasks,
                start=start,
            )
            self._signal_done(job_id, final)
        return not again

    def _task_ended(
        self,
        job_id: str,
        run: Running,
        task: NodeTask,
        result: TaskResult,
        now: float,
        *,
        undo: bool = False,
    ) -> bool:
        """One node of a job of several ended. The first failure ends the
        other nodes; the job ends with its last node. Returns whether the job
        is final. ``undo`` as for :meth:`_conclude`."""
        task.ended = True
        self._release_task(job_id, task)
        run.results.append(result)
        failed = not (result.outcome == "exited" and result.exit_code == 0)
        first_failure = failed and result.outcome != "cancelled" and len(failures(run)) == 1
        try:
            if all(t.ended for t in run.tasks):
                return self._conclude(job_id, run, decisive(run), now, undo=undo)
            # Kept, so that a restarted server knows this node is done and how;
            # and its slots are free: something else may fit now.
            assignments = self._plan()
            with self.store.transaction() as tx:
                tx.task_ended(job_id, task.node, result)
                self._record(tx, assignments, now)
        except StoreError:  # not stored: this node runs on, as far as anyone knows
            if undo:
                task.ended = False
                run.results.remove(result)
                self._occupy(job_id, task)
            raise
        self._dispatch(assignments, now)
        if first_failure:  # the job's other nodes end too; told once the failure is stored
            self._cancel_tasks(job_id, run)
        return False

    def _give_back(self, job_id: str, run: Running, now: float) -> None:
        """A job its worker never ran (given back as it stopped): queued
        again, and not counted as an attempt; unless it is being cancelled.

        Only for a job of one node: its worker takes no more work, so the
        attempt number, used again, cannot meet the old task on a worker.
        """
        self._release(job_id)
        run.attempt -= 1
        cancelled = False
        try:
            with self.store.transaction() as tx:
                # Read in the transaction: another process on this home may have
                # asked for a cancel an instant ago.
                cancelled = tx.cancel_requested(job_id)
                if cancelled:
                    self._finish_no_result(tx, job_id, jobs.CANCELLED, "cancelled", now)
                else:
                    self._requeue(job_id, run)
                    tx.requeue(job_id, reason=None, owner=self.instance_id, attempt=run.attempt)
                assignments = self._plan()
                self._record(tx, assignments, now)
        except StoreError:  # only for a worker's report, which it sends again
            run.attempt += 1
            self._unrelease(job_id, run, requeued=job_id in self._queue)
            raise
        self._dispatch(assignments, now)
        if cancelled:
            self._signal_done(job_id)

    @staticmethod
    def _finish_no_result(
        tx: Transaction, job_id: str, state: str, reason: str, now: float
    ) -> None:
        """End a job that has no result of its own (cancelled or lost): no
        exit code, no outputs."""
        tx.finish(
            job_id, state=state, exit_code=None, reason=reason, marks={"finished": now}, outputs={}
        )

    def _node_lost(
        self,
        job_id: str,
        worker_id: str,
        reason: str,
        now: float,
        *,
        undo: bool = False,
    ) -> None:
        """One node's worker is gone. A node it never took (still in its
        inbox) never ran: given back, not lost."""
        run = self._running.get(job_id)
        task = run.task_on(worker_id) if run is not None else None
        if run is None or task is None or task.ended:
            return
        unrun = never_taken(task)
        result = TaskResult(
            job_id=job_id,
            attempt=run.attempt,
            worker_id=worker_id,
            outcome="returned" if unrun else "lost",
            error=None if unrun else reason,
            node=task.node,
        )
        self._task_ended(job_id, run, task, result, now, undo=undo)

    def _cancel_tasks(self, job_id: str, run: Running) -> None:
        for task in run.tasks:
            worker = self._workers.get(task.worker_id)
            if worker is not None and not task.ended:
                worker.inbox.append(CancelTask(job_id=job_id, attempt=run.attempt))
                worker.wake.fire()

    # ---- internals (call with self._lock held) -------------------------

    def _enqueue(self, pending: Pending) -> None:
        req = pending.request
        self._queue[req.job_id] = pending
        if not self._held_back(pending):
            self._admit(pending)
        if req.not_before > self._clock():
            self._arm_retry(req.not_before)

    def _admit(self, pending: Pending) -> None:
        """``pending`` waits for nothing: into placement, unless its array
        has as many tasks out as it may."""
        if not self._array_holds(pending):
            self._waiting.add(pending.request)

    def _arm_retry(self, at: float) -> None:
        """Run a placement pass at ``at``, when a retry's back-off ends.

        Placement otherwise runs only on events (a submit, a task's end, a
        worker's arrival); a job backing off is passed over by each (see
        scheduler rule 6), so nothing polls for it: one timer, for the
        earliest back-off to end, places it then."""
        if self._timers_stopped:
            return
        heapq.heappush(self._wakeups, at)
        if self._retry_timer is not None:
            if self._retry_due <= at:
                return
            self._retry_timer.cancel()
        delay = max(_RETRY_TIMER_MIN_S, at - self._clock())
        timer = threading.Timer(delay, self._back_off_ended)
        timer.args = (timer,)
        # A control plane left open (a test's) must not keep its process alive.
        timer.daemon = True
        self._retry_timer, self._retry_due = timer, at
        timer.start()

    def _back_off_ended(self, timer: threading.Timer) -> None:
        with self._lock:
            if self._retry_timer is not timer or self._timers_stopped:
                return  # replaced by an earlier one, or shutting down
            self._retry_timer, self._retry_due = None, math.inf
            now = self._clock()
            while self._wakeups and self._wakeups[0] <= now:
                heapq.heappop(self._wakeups)
            try:
                self._settle_dependencies(now)
                self._settle_arrays(now)
                assignments = self._plan()
                if assignments:
                    with self.store.transaction() as tx:
                        self._record(tx, assignments, now)
                self._dispatch(assignments, now)
            except StoreError as exc:
                log.warning(
                    "placing jobs whose retry back-off ended failed: %s; trying again in %g s",
                    exc,
                    _RETRY_STORE_AGAIN_S,
                )
                heapq.heappush(self._wakeups, now + _RETRY_STORE_AGAIN_S)
            except Exception as exc:  # a store closed under it: this thread must not die loud
                log.warning("placing jobs whose retry back-off ended failed: %s", exc)
            # The later back-offs still end when they are due, whatever became of this one.
            if self._wakeups:
                self._arm_retry(heapq.heappop(self._wakeups))

    def _stop_timers(self) -> threading.Timer | None:
        """No more back-off timers (the control plane is shutting down); the
        one pending, cancelled, for the caller to join once it has let go of
        the lock."""
        self._timers_stopped = True
        timer, self._retry_timer = self._retry_timer, None
        if timer is not None:
            timer.cancel()
        return timer

    def _dequeue(self, job_id: str) -> Pending:
        pending = self._queue.pop(job_id)
        if job_id in self._waiting:
            self._waiting.remove(job_id)
        else:  # held back for its dependencies
            for dep in self._unmet.pop(job_id, ()):
                self._dependents.get(dep, set()).discard(job_id)
        self._sharing.dequeued(job_id)
        return pending

    def _open_workers(self) -> list[LiveWorker]:
        return [w for w in self._workers.values() if w.connected and not w.closed]

    def _plan(self) -> list[Assignment]:
        if not self._queue:
            return []
        caps = [w.capacity() for w in self._open_workers() if w.free]
        if not caps:
            return []
        now = self._clock()
        sharing = self._sharing
        sharing.prune_holds(self._running, self._waiting, self._workers)
        return place(self._waiting, caps, now, sharing.shares(now), sharing.held_for)

    def _shares(self, now: float) -> Shares:
        return self._sharing.shares(now)

    def _quota_changed(self) -> None:
        """A project's quota changed: what it allows now is placed at once
        (a lower quota stops nothing; it holds back what comes next)."""
        with self._lock:
            now = self._clock()
            assignments = self._plan()
            if assignments:
                with self.store.transaction() as tx:
                    self._record(tx, assignments, now)
            self._dispatch(assignments, now)

    def _began(self, job_id: str, run: Running) -> None:
        """``run`` holds its slots from now (placed, or taken over)."""
        self._running[job_id] = run
        self._sharing.began(job_id, run, self._clock())

    def _preempt(self, now: float) -> None:
        """Rule 9: stop the preemptible jobs that make room for the
        highest-ranked job waiting for it, and hold their workers for it."""
        sharing = self._sharing
        if not self._queue:
            return
        victims = sharing.victims(self._running, self._waiting)
        if not victims:
            return
        sharing.prune_holds(self._running, self._waiting, self._workers)
        caps = [w.capacity() for w in self._open_workers()]
        choice = preempt(self._waiting, caps, victims, now, sharing.shares(now), sharing.held_for)
        if choice is None:
            return
        for worker_id in choice.workers:
            sharing.held_for[worker_id] = choice.for_job
        for job_id in choice.victims:
            run = self._running[job_id]
            run.preempted_for = choice.for_job
            log.info("preempting job %s for job %s", job_id, choice.for_job)
            for task in run.tasks:
                worker = self._workers.get(task.worker_id)
                if worker is not None and not task.ended:
                    worker.inbox.append(
                        CancelTask(job_id=job_id, attempt=run.attempt, preempt=True)
                    )
                    if task.worker_id != self._taking:
                        worker.wake.fire()

    def _save_usage(self, now: float, every: float = USAGE_SAVE_S) -> None:
        self._sharing.save_usage(self.store, now, every)

    def _record(self, tx: Transaction, assignments: list[Assignment], now: float) -> None:
        """Store placements. One whose job is no longer queued in the store (a
        cancel from another process) is dropped from the queue and from
        ``assignments``, so it is not dispatched."""
        for group in by_job(assignments):
            a = group[0]
            pending = self._queue[a.job_id]
            unopened = self.secrets.cannot_open(pending.spec) if pending.spec.secrets else None
            if unopened is not None:  # sealed with another key: it cannot run as asked
                tx.finish(
                    a.job_id,
                    state=jobs.FAILED,
                    exit_code=None,
                    reason=f"could not run: {unopened}",
                    marks={"finished": now},
                    outputs={},
                )
                for gone in group:
                    assignments.remove(gone)
                self._dequeue(a.job_id)
                self._signal_done(a.job_id)
                continue
            placed = tx.place(
                a.job_id,
                worker=a.worker_id,
                slots=a.slots,
                gpus=a.gpus,
                attempt=pending.attempt + 1,
                at=now,
                tasks=task_infos(group) if pending.spec.distributed else (),
            )
            if not placed:
                for gone in group:
                    assignments.remove(gone)
                also = self._placement_refused(tx, a.job_id, now)
                self._dequeue(a.job_id)
                for job_id in (a.job_id, *also):
                    self._signal_done(job_id)
            else:
                self._placing(tx, a.job_id, now)

    def _dispatch(self, assignments: list[Assignment], now: float) -> None:
        """Apply committed placements in memory and wake the chosen workers."""
        for group in by_job(assignments):
            job_id = group[0].job_id
            pending = self._dequeue(job_id)
            attempt = pending.attempt + 1
            spec = pending.spec
            # Its worker gets the secrets' values (it starts the job with
            # them); memory and the store keep them sealed. Checked openable
            # as the placement was recorded.
            opened = self.secrets.open(spec) if spec.secrets else spec
            tasks = [NodeTask(node, a.worker_id, a.slots, a.gpus) for node, a in enumerate(group)]
            self._began(
                job_id,
                Running(
                    attempt,
                    spec,
                    pending.request.seq,
                    tasks,
                    {"submitted": pending.submitted, "placed": now},
                    given_back=pending.given_back,
                    user=pending.user,
                    scratch=pending.scratch,
                ),
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
                        spec=opened,
                        slots=list(task.slots),
                        gpus=list(task.gpus),
                        node=task.node,
                        master_addr=master,
                        scratch=pending.scratch,
                    )
                )
                if task.worker_id != self._taking:
                    worker.wake.fire()
        self._preempt(now)

    def _release(self, job_id: str) -> Running:
        run = self._running.pop(job_id)
        for task in run.tasks:
            if not task.ended:
                self._release_task(job_id, task)
        now = self._clock()
        self._sharing.ended(job_id, run, now)
        self._save_usage(now)
        return run

    def _unrelease(self, job_id: str, run: Running, *, requeued: bool) -> None:
        """Undo :meth:`_release` (and a requeue) when the store refused the
        write that ended the attempt: memory matches the store again (still
        running), so the worker's report, sent again, applies then."""
        if requeued:
            self._dequeue(job_id)
        self._began(job_id, run)
        for task in run.tasks:
            if not task.ended:
                self._occupy(job_id, task)

    def _occupy(self, job_id: str, task: NodeTask) -> None:
        worker = self._workers.get(task.worker_id)
        if worker is not None:
            worker.free.difference_update(task.slots)
            worker.running.add(job_id)

    def _release_task(self, job_id: str, task: NodeTask) -> None:
        worker = self._workers.get(task.worker_id)
        if worker is not None:
            # Only slots it still has: it may have come back with fewer.
            count = len(worker.info.slot_gpus)
            worker.free.update(s for s in task.slots if s < count)
            worker.running.discard(job_id)

    def _requeue(self, job_id: str, run: Running, *, not_before: float = 0.0) -> None:
        spec = run.spec
        request = request_of(job_id, spec, run.seq, not_before)
        submitted = run.marks["submitted"]
        self._enqueue(
            Pending(request, spec, run.attempt, submitted, run.given_back, run.user, run.scratch)
        )

    def _say_preempted(self, tx: Transaction, job_id: str, run: Running, now: float) -> None:
        """The line in the job's log that says it was preempted: its
        history keeps each preemption, and where the next attempt begins."""
        why = f" to make room for job {run.preempted_for}" if run.preempted_for else ""
        text = (
            f"gpulayer: attempt {run.attempt} preempted{why}; queued again, not counted as a retry"
        )
        tx.append_logs(job_id, run.attempt + 1, [LogLine(0, now, "system", text)])

    def _say_retry(
        self, tx: Transaction, job_id: str, run: Running, why: str, wait: float, now: float
    ) -> None:
        """The line that opens a retry's attempt in the job's log (a follower
        sees where one attempt ends and the next begins, and why)."""
        after = why.splitlines()[0] if why.strip() else "it failed"
        if len(after) > _RETRY_WHY_MAX:
            after = after[: _RETRY_WHY_MAX - 3] + "..."
        text = (
            f"gpulayer: attempt {run.counted + 1} of {run.spec.max_retries + 1} (after: {after}), "
            + (f"waiting {wait:.1f} s" if wait > 0 else "at once")
        )
        # Numbered 0: the attempt's own lines (its worker's) start at 1.
        tx.append_logs(job_id, run.attempt + 1, [LogLine(0, now, "system", text)])

    def _end_lost(
        self,
        tx: Transaction,
        run: Running,
        job_id: str,
        reason: str,
        now: float,
        ended: list[str],
    ) -> None:
        """A job whose worker is gone: retried, or ended (its id added to
        ``ended``, for the caller to tell waiters once the write is stored)."""
        # Being cancelled (here, or by another process on this home, which
        # only the store knows): that is how it ends.
        run.cancel_requested = run.cancel_requested or tx.cancel_requested(job_id)
        if run.cancel_requested:
            self._finish_no_result(
                tx, job_id, jobs.CANCELLED, f"cancelled ({reason} before it confirmed)", now
            )
            ended.append(job_id)
            return
        if run.counted <= run.spec.max_retries:
            retry_at = now + retry_wait(run.spec.retry_delay, run.counted)
            self._requeue(job_id, run, not_before=retry_at)
            tx.requeue(
                job_id,
                reason=f"retrying: {reason}{_backing_off(retry_at, now)}",
                owner=self.instance_id,
                retry_at=retry_at,
                at=now,
            )
            self._say_retry(tx, job_id, run, reason, retry_at - now, now)
        else:
            self._finish_no_result(tx, job_id, jobs.LOST, reason, now)
            ended.append(job_id)

    def _signal_done(self, job_id: str, final: JobInfo | None = None) -> None:
        if final is not None:
            final = redacted(final)  # kept to hand out: no secret's value
        done = self._done.pop(job_id, None)
        if done is not None:
            # Hand waiters the record (saves each a read of the store). The
            # end is stored already: a read that fails now must not keep them
            # waiting; they read the record themselves.
            if final is None:
                with contextlib.suppress(StoreError):
                    final = self.store.get_job(job_id)
                    final = None if final is None else redacted(final)
            done.job, done.fired = final, True
            done.signal.fire()
        if final is not None and final.done:
            self._finished[job_id] = final
            if len(self._finished) > defaults.FINISHED_JOBS_KEPT:
                self._finished.popitem(last=False)
        logs = self._logs.pop(job_id, None)
        if logs is not None:
            logs.fire()
        self._ended(job_id)

    # Dependencies (dependencies.py) fill these in: a plane without them
    # holds nothing back.

    def _held_back(self, pending: Pending) -> bool:
        return False

    def _ended(self, job_id: str) -> None:
        return None

    def _settle_dependencies(self, now: float) -> None:
        return None

    # And arrays (arrays.py): a plane without them holds no task back.

    def _array_holds(self, pending: Pending) -> bool:
        return False

    def _placing(self, tx: Transaction, job_id: str, now: float) -> None:
        return None

    def _placement_refused(self, tx: Transaction, job_id: str, now: float) -> list[str]:
        return []

    def _settle_arrays(self, now: float) -> None:
        return None

    def _rebuild_arrays(self) -> None:
        return None


def _backing_off(retry_at: float | None, now: float) -> str:
    """What a queued job's reason adds while it waits out a retry's back-off."""
    if retry_at is None or retry_at <= now:
        return ""
    return f" (back-off: placed again after {retry_at - now:.1f} s)"


def refuse_unsafe_outputs(
    result: TaskResult, declared: list[str]
) -> tuple[TaskResult, UnsafeOutputError | None]:
    """``result`` as it may be applied, and why its outputs were refused if they were.

    An output must be a relative, normalised path the job declared (by name
    or glob): a client writes it there. A result naming one that is not
    stores no output at all, and ends its attempt as an error naming it, so
    the job does not wait on a report its worker will not send again.
    """
    try:
        check_result(declared, result.outputs)
    except UnsafeOutputError as exc:
        error = f"its worker reported an output that was refused ({exc}); no output was stored"
        outcome = "error" if result.outcome == "exited" else result.outcome
        return msgspec.structs.replace(result, outcome=outcome, error=error, outputs={}), exc
    return result, None
