"""Arrays (sweeps): one job id, a task per index, at most N running at once.

An array is stored as one row that never runs (the array: its spec lists
the indices) and one job per index (its tasks: the array's spec without
the list, with ``array_task`` set), all in the submit's transaction, in
one statement. Each task is an ordinary job from then on: placed, retried,
preempted, cancelled, logged like any other, in its project, by fair share.

``max_parallel`` is kept here, outside the scheduler, as Slurm keeps its
``%N``: an array has at most that many tasks *released* (in placement's
:class:`~gpulayer.scheduler.Waiting`, or running, or backing off before a
retry); the others are queued but held back, and the next (by index) is
released when one ends. So the scheduler never sees more of an array than
it may run, and a 10,000-task array costs placement what 8 jobs do.

The array's row follows its tasks: running once one is placed, and final
once every one is, succeeded if every one succeeded, failed if any failed
(or timed out, or was lost), else cancelled. Its end is noted when its
last task's is (``_ended``) and stored by the back-off timer's pass that
follows (``_settle_arrays``), as dependencies are; a restart finds it
again from the tasks' rows (``_rebuild_arrays``).
"""

from __future__ import annotations

import msgspec

from .. import jobs
from ..access import Viewer
from ..arrays import span, tally
from ..errors import JobNotFoundError, StoreError
from ..ids import new_id
from ..jobs import JobInfo
from ..spec import ArrayTask
from ..store import Transaction
from .core import PlaneCore
from .state import ArrayRun, Pending, Running, request_of


class Arrays(PlaneCore):
    def _open_array(self, array: JobInfo, now: float) -> list[JobInfo]:
        """The tasks of ``array`` (a new job whose spec lists indices), each
        queued here; their seqs follow the array's. Undone by
        :meth:`_drop_array` if the array is not stored."""
        spec = array.spec
        base = msgspec.structs.replace(spec, array=[], max_parallel=None)
        tasks = []
        for offset, index in enumerate(spec.array, start=1):
            task_spec = msgspec.structs.replace(base, array_task=ArrayTask(array.id, index))
            tasks.append(
                JobInfo(
                    id=new_id(),
                    spec=task_spec,
                    seq=array.seq + offset,
                    owner=array.owner,
                    user=array.user,
                    marks={"submitted": now},
                )
            )
        run = ArrayRun([t.id for t in tasks], spec.max_parallel, len(tasks))
        assert array.id not in self._arrays  # (a retried submit is answered before)
        self._arrays[array.id] = run
        for task in tasks:
            self._array_of[task.id] = array.id
            self._enqueue(
                Pending(request_of(task.id, task.spec, task.seq), task.spec, 0, now, user=task.user)
            )
        return tasks

    def _drop_array(self, array_id: str) -> None:
        """Undo :meth:`_open_array` (the array was not stored)."""
        run = self._arrays.pop(array_id)
        for task_id in run.tasks:
            self._array_of.pop(task_id, None)
            if task_id in self._queue:
                self._dequeue(task_id)

    def _held_by_array(self, pending: Pending) -> str | None:
        """Why a task its array holds back waits, in words; None if it is not held."""
        task = pending.spec.array_task
        run = None if task is None else self._arrays.get(task.array)
        if run is None or pending.request.job_id in run.released:
            return None
        return f"held by its array {task.array}: at most {run.limit} of its tasks at once"  # type: ignore[union-attr]

    def _array_holds(self, pending: Pending) -> bool:
        task = pending.spec.array_task
        if task is None:
            return False
        run = self._arrays.get(task.array)
        job_id = pending.request.job_id
        if run is None or job_id in run.released:
            return False  # (an array not run here: nothing to hold it to)
        if run.limit is None or len(run.released) < run.limit:
            run.released.add(job_id)
            return False
        run.held.append(job_id)
        return True

    def _placement_refused(self, tx: Transaction, job_id: str, now: float) -> list[str]:
        """A task's placement was refused: it is no longer queued in the
        store. If its array was cancelled by another process on this home,
        so was every task it holds back: they leave the queue now (returned,
        to be signalled ended), not one placement pass each."""
        array_id = self._array_of.get(job_id)
        run = None if array_id is None else self._arrays.get(array_id)
        if array_id is None or run is None or run.cancelled:
            return []
        if not tx.cancel_requested(array_id):
            return []
        run.cancelled = True
        held = [t for t in run.held if t in self._queue and t != job_id]
        run.held.clear()
        for task_id in held:
            tx.cancel_queued(task_id, now)  # (cancelled there already, as a rule)
            self._dequeue(task_id)
        return held

    def _placing(self, tx: Transaction, job_id: str, now: float) -> None:
        array_id = self._array_of.get(job_id)
        if array_id is not None:
            run = self._arrays.get(array_id)
            if run is not None and not run.started:
                tx.array_started(array_id, now)

    def _began(self, job_id: str, run: Running) -> None:
        super()._began(job_id, run)
        array_id = self._array_of.get(job_id)
        if array_id is not None and array_id in self._arrays:
            self._arrays[array_id].started = True

    def _ended(self, job_id: str) -> None:
        array_id = self._array_of.pop(job_id, None)
        if array_id is not None and array_id in self._arrays:
            run = self._arrays[array_id]
            run.left -= 1
            run.released.discard(job_id)
            final = self._finished.get(job_id)
            if not run.cancelled and (final is None or final.state == jobs.CANCELLED):
                # Perhaps by a cancel of the whole array from another process
                # on this home: the next pass looks (_settle_arrays).
                self._arrays_to_check.add(array_id)
                self._arm_retry(self._clock())
            while (
                run.held
                and not run.cancelled
                and (run.limit is None or len(run.released) < run.limit)
            ):
                next_id = run.held.popleft()
                pending = self._queue.get(next_id)
                if pending is not None and next_id not in self._waiting:
                    run.released.add(next_id)
                    self._waiting.add(pending.request)
                    self._arm_retry(self._clock())  # placed by the next pass
            if run.left <= 0:
                self._arrays_ended.add(array_id)
                self._arm_retry(self._clock())
        super()._ended(job_id)

    def _settle_arrays(self, now: float) -> None:
        """End the tasks of each array cancelled from another process, then
        store the end of each array whose last task has ended."""
        for array_id in sorted(self._arrays_to_check):
            run = self._arrays.get(array_id)
            row = None if run is None or run.cancelled else self.store.get_job(array_id)
            if run is not None and row is not None and row.cancel_requested:
                self._end_cancelled_elsewhere(array_id, run, now)
            self._arrays_to_check.discard(array_id)
        for array_id in sorted(self._arrays_ended):
            counts = self.store.array_counts([array_id])[array_id]
            state, reason = _outcome(counts)
            with self.store.transaction() as tx:  # refused: kept, for the next pass
                self._finish_no_result(tx, array_id, state, reason, now)
            self._arrays_ended.discard(array_id)
            self._arrays.pop(array_id, None)
            final = self.store.get_job(array_id)
            if final is not None:
                final.array_states = counts
            self._signal_done(array_id, final)

    def _end_cancelled_elsewhere(self, array_id: str, run: ArrayRun, now: float) -> None:
        """Another process cancelled this array in the store: its tasks still
        queued here leave the queue (ended there, or here now)."""
        queued = [t for t in run.tasks if t in self._queue]
        with self.store.transaction() as tx:
            for task_id in queued:
                tx.cancel_queued(task_id, now)
        run.cancelled = True
        run.held.clear()
        for task_id in queued:
            self._dequeue(task_id)
        for task_id in queued:
            self._signal_done(task_id)

    def _rebuild_arrays(self) -> None:
        """The arrays this plane owns (after a restart), from their tasks'
        rows: which are released (running), which end is due."""
        for array in self.store.list_jobs(
            states=[jobs.QUEUED, jobs.RUNNING], owner=self.instance_id, top_level=True
        ):
            if not array.spec.array or array.id in self._arrays:
                continue
            members = self.store.array_members(array.id)
            run = ArrayRun([i for i, _ in members], array.spec.max_parallel, 0)
            run.started = array.state == jobs.RUNNING
            for task_id, state in members:
                if state not in jobs.FINAL_STATES:
                    run.left += 1
                    self._array_of[task_id] = array.id
                    if state == jobs.RUNNING:
                        run.released.add(task_id)
            self._arrays[array.id] = run
            if run.left == 0:
                self._arrays_ended.add(array.id)
                self._arm_retry(self._clock())

    def _array_reason(self, array: JobInfo) -> str:
        """Why an array is not final, in words: its tasks by state."""
        limit = array.spec.max_parallel
        return f"tasks: {tally(array.array_states) or 'none stored'}" + (
            f" (at most {limit} at once)" if limit else ""
        )

    def _cancel_array(self, array_id: str, viewer: Viewer) -> None:
        """Cancel every task of an array not final yet (its row ends with
        its last task's end). One transaction for those still queued."""
        now = self._clock()
        with self._lock:
            run = self._arrays.get(array_id)
            if run is None:
                self._cancel_array_elsewhere(array_id)
                return
            run.cancelled = True
            queued = [t for t in run.tasks if t in self._queue]
            running = [t for t in run.tasks if t in self._running]
            pendings = [self._dequeue(t) for t in queued]
            try:
                with self.store.transaction() as tx:
                    tx.request_cancel(array_id)
                    for task_id in queued:
                        tx.request_cancel(task_id)
                        self._finish_no_result(
                            tx,
                            task_id,
                            jobs.CANCELLED,
                            "cancelled with its array, while queued",
                            now,
                        )
                    for task_id in running:
                        tx.request_cancel(task_id)
                    assignments = self._plan()
                    self._record(tx, assignments, now)
            except StoreError:  # not stored: it all stays as it was
                run.cancelled = False
                for pending in pendings:
                    self._enqueue(pending)  # (its dependencies and its array's hold too)
                raise
            self._dispatch(assignments, now)
            for task_id in running:
                task_run = self._running[task_id]
                task_run.cancel_requested = True
                self._cancel_tasks(task_id, task_run)
            for task_id in queued:
                self._signal_done(task_id)
            if array_id in self._arrays_ended:
                try:  # at once, so the reply says cancelled; else the next pass does
                    self._settle_arrays(now)
                except StoreError:
                    self._arm_retry(now + 1.0)

    def _cancel_array_elsewhere(self, array_id: str) -> None:
        """An array another live process on this home runs (embedded): its
        tasks are cancelled in the store, as :meth:`cancel` does a job there;
        that process ends the array when it sees its last task end."""
        now = self._clock()
        members = [t for t, s in self.store.array_members(array_id) if s not in jobs.FINAL_STATES]
        with self.store.transaction() as tx:
            tx.request_cancel(array_id)
            running = [t for t in members if not tx.cancel_queued(t, now)]
            for task_id in running:
                tx.request_cancel(task_id)
        if self._kill_orphan is not None:
            for task_id in running:
                job = self.store.get_job(task_id)
                for pid, created in job.processes() if job is not None else ():
                    self._kill_orphan(pid, created)

    def _task_of(self, array_id: str, index: int) -> str:
        """The id of task ``index`` of the array ``array_id`` (a full id)."""
        found = self.store.array_task(array_id, index)
        if found is not None:
            return found
        array = self.store.get_job(array_id)
        if array is None or not array.spec.array:
            raise JobNotFoundError(f"job {array_id} is not an array: it has no task {index}")
        raise JobNotFoundError(
            f"array {array_id} has no task {index} (its indices: {span(array.spec.array)})"
        )


def _outcome(counts: dict[str, int]) -> tuple[str, str]:
    """An array's final state and reason, from its tasks' final states."""
    total = sum(counts.values())
    bad = sum(counts.get(s, 0) for s in (jobs.FAILED, jobs.TIMED_OUT, jobs.LOST))
    if bad:
        return jobs.FAILED, f"{bad} of {total} tasks did not succeed ({tally(counts)})"
    cancelled = counts.get(jobs.CANCELLED, 0)
    if cancelled:
        return jobs.CANCELLED, f"{cancelled} of {total} tasks cancelled ({tally(counts)})"
    return jobs.SUCCEEDED, f"all {total} tasks succeeded"


__all__ = ["Arrays"]
