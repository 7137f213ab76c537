"""The control plane's shared state and the steps every part of it takes.

:class:`PlaneCore` holds the state (queue, running jobs, workers, waiters)
and the internal steps that change it: placing, recording placements,
dispatching them to workers, releasing slots, and the timer that places a
retry once its back-off ends. Ending an attempt is in :mod:`.endings`; the
public operations are in :mod:`.fleet` (what workers do), :mod:`.recovery`
(taking over after a crash) and :mod:`.plane` (what clients do). Every
method here is called with ``self._lock`` held.
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import defaults, jobs
from ..errors import StoreError
from ..jobs import CancelTask, JobInfo, RunTask, TaskResult
from ..scheduler import Assignment, Shares, Waiting, place, preempt
from ..secretbox import SecretBox
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
    task_infos,
)

log = logging.getLogger(__name__)

# A back-off timer never fires sooner than this (a clock a test holds still,
# a wait already over): it cannot spin.
_RETRY_TIMER_MIN_S = 0.01
# After the store refused placing what a back-off released, try again in this.
_RETRY_STORE_AGAIN_S = 1.0


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

    # Ending an attempt (endings.py holds the steps): declared for the type
    # checker only, for the steps above and the parts that end one (fleet,
    # arrays, dependencies, the plane). No stand-ins: a plane composed
    # without Endings fails loud.
    if TYPE_CHECKING:

        def _conclude(
            self, job_id: str, run: Running, result: TaskResult, now: float, *, undo: bool = False
        ) -> bool: ...

        def _task_ended(
            self,
            job_id: str,
            run: Running,
            task: NodeTask,
            result: TaskResult,
            now: float,
            *,
            undo: bool = False,
        ) -> bool: ...

        def _give_back(self, job_id: str, run: Running, now: float) -> None: ...

        def _node_lost(
            self, job_id: str, worker_id: str, reason: str, now: float, *, undo: bool = False
        ) -> None: ...

        def _end_lost(
            self,
            tx: Transaction,
            run: Running,
            job_id: str,
            reason: str,
            now: float,
            ended: list[str],
        ) -> None: ...

        @staticmethod
        def _finish_no_result(
            tx: Transaction, job_id: str, state: str, reason: str, now: float
        ) -> None: ...

        def _requeue(self, job_id: str, run: Running, *, not_before: float = 0.0) -> None: ...

        def _signal_done(self, job_id: str, final: JobInfo | None = None) -> None: ...
