"""Taking over from a control plane that died.

Embedded, the processes of its running jobs outlived it: they are ended, and
every job it had not finished ends ``lost``. A server's workers outlive it: on restart
their jobs stay running, and the workers have the heartbeat timeout to
register again and say what they still run.
"""

from __future__ import annotations

from collections import deque

from .. import jobs
from ..jobs import JobInfo, TaskInfo, TaskResult, WorkerInfo
from .core import PlaneCore
from .state import LiveWorker, NodeTask, Pending, Running, request_of

# Why an embedded job whose process died is lost (see recover).
EMBEDDED_ENDED = (
    "the GPUlayer process that submitted it ended (an embedded job runs only while "
    "that process does)"
)


class Recovery(PlaneCore):
    # ---- recovery ------------------------------------------------------

    def recover(self, dead_instance: str, *, workers_outlive: bool = False) -> list[str]:
        """Take over the jobs of a control plane that died; returns their ids.

        A server's (``workers_outlive``: a restart): its queued jobs queue
        here; its running ones, on remote workers, may still be running:
        they stay running here, and their workers have the heartbeat timeout
        to come back and say so.

        An embedded one's (the process that submitted them): each unfinished
        job ends ``lost``, its process trees ended, and none is retried or
        run here. An embedded job runs only while the process that
        submitted it does; another command on the same home, perhaps much
        later and about something else, must not run it unasked (ADR-0021).
        """
        now = self._clock()
        touched: list[str] = []
        with self._lock:
            running = self.store.list_jobs(states=[jobs.RUNNING], owner=dead_instance)
            if workers_outlive:  # (an array's row runs nothing: its tasks' rows do)
                running = [job for job in running if not job.spec.array]
                self._adopt_workers(dead_instance, running, now)
            elif self._kill_orphan is not None:
                for job in running:
                    for pid, created in job.processes():
                        self._kill_orphan(pid, created)
            with self.store.transaction() as tx:
                if workers_outlive:
                    touched += [job.id for job in running]
                else:
                    queued = self.store.list_jobs(states=[jobs.QUEUED], owner=dead_instance)
                    ended = [(job, "while it ran") for job in running]
                    for job, when in ended + [(job, "before it started") for job in queued]:
                        touched.append(job.id)
                        tx.finish(
                            job.id,
                            state=jobs.LOST,
                            exit_code=None,
                            reason=f"{EMBEDDED_ENDED} {when}",
                            marks={"finished": now},
                            outputs={},
                        )
                touched += tx.adopt(dead_instance, self.instance_id, workers=workers_outlive)
            self._rebuild_arrays()
            queued = self.store.list_jobs(states=[jobs.QUEUED], owner=self.instance_id)
            for job in reversed(queued):  # by arrival: an array's tasks by index
                if job.spec.array:  # it never runs itself: its tasks do
                    continue
                if job.id not in self._queue:
                    spec, retry_at = job.spec, job.marks.get("retry_at", 0.0)  # a back-off holds
                    request = request_of(job.id, spec, job.seq, retry_at)
                    submitted = job.marks.get("submitted", now)
                    scratch = self.store.scratch_of(job.id) if job.attempt else None
                    self._enqueue(
                        Pending(
                            request,
                            job.spec,
                            job.attempt,
                            submitted,
                            job.given_back,
                            job.user,
                            scratch,
                        )
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
            ended: list[TaskResult] = []
            for placement in placed:
                if placement.result is not None:  # this node ended before the restart
                    tasks.append(
                        NodeTask(
                            placement.node,
                            placement.worker,
                            tuple(placement.slots),
                            tuple(placement.gpus),
                            started=True,
                            ended=True,
                        )
                    )
                    ended.append(placement.result)
                    continue
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
                    worker = LiveWorker(
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
                    NodeTask(
                        placement.node,
                        info.id,
                        tuple(placement.slots),
                        tuple(placement.gpus),
                        started=placement.pid is not None or "started" in job.marks,
                        delivered=None,  # kept in memory only: unknown now
                    )
                )
            run = Running(
                job.attempt,
                job.spec,
                job.seq,
                tasks,
                {k: v for k, v in job.marks.items() if k in ("submitted", "placed")},
                results=ended,
                cancel_requested=job.cancel_requested,
                given_back=job.given_back,
                user=job.user,
                # What an earlier attempt kept, for the next one should this fail.
                scratch=self.store.scratch_of(job.id) if job.attempt > 1 else None,
            )
            if len(tasks) == 1:  # the lines stored already are not stored again
                run.log_seen = {0: self.store.last_log_seq(job.id, job.attempt)}
            else:  # go on numbering its log lines after those stored
                run.log_seq = self.store.last_log_seq(job.id, job.attempt)
                # and know the lines each node sent already (it may send them again)
                run.log_seen = self.store.node_lines(job.id, job.attempt)
                run.master_port = job.tasks[0].port
            self._began(job.id, run)
        for info in known.values():
            if info.id not in self._workers:
                info.instance = self.instance_id
                self._workers[info.id] = LiveWorker(
                    info=info,
                    free=set(range(len(info.slot_gpus))),
                    inbox=deque(),
                    connected=False,
                    last_seen=now,
                )
