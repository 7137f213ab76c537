"""Ending an attempt: taking its result to the job's next state.

:class:`Endings` holds the steps that end an attempt (a worker's report, a
node of several ending, a job given back unrun, a worker declared lost): the
job finishes, or is queued again (a retry after its back-off, or uncounted,
when it was given back or preempted); the line a retry or a preemption
writes in the job's log; and telling the job's waiters and log followers
once its end is stored. :func:`refuse_unsafe_outputs` checks a result's
outputs before it applies. The state these change, and the placing that
follows, are :class:`~.core.PlaneCore`'s, which declares these steps for the
parts that call them. Every method here is called with ``self._lock`` held.
"""

from __future__ import annotations

import contextlib

import msgspec

from .. import defaults, jobs
from ..errors import StoreError
from ..jobs import JobInfo, LogLine, TaskResult
from ..outputs import UnsafeOutputError, check_result
from ..scheduler import retry_wait
from ..secretbox import redacted
from ..store import Transaction
from .core import PlaneCore
from .state import (
    NodeTask,
    Pending,
    Running,
    decisive,
    failures,
    never_taken,
    request_of,
    task_infos,
)

# The reason a retry's log line gives is cut to this many characters.
_RETRY_WHY_MAX = 200


class Endings(PlaneCore):
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
