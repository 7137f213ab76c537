"""What clients do: submit, look, wait, follow logs, cancel.

:class:`ControlPlane` is the whole control plane: these operations, the
workers' (:class:`~.fleet.Fleet`) and recovery (:class:`~.recovery.Recovery`)
over one shared state (:class:`~.core.PlaneCore`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from .. import defaults, jobs
from ..access import Viewer, local_viewer, may_see, sees_all
from ..arrays import split_task
from ..artifacts import ArtifactStore
from ..errors import GPUlayerError, InvalidStateError, JobNotFoundError, SpecError, StoreError
from ..ids import check_id, new_id
from ..jobs import JobInfo, LogChunk, WorkerInfo
from ..projects import DEFAULT_PROJECT
from ..scheduler import Capacity, explain
from ..secretbox import redacted
from ..signals import Signal, Unsubscribe, wait_on
from ..spec import JobSpec, parse_spec
from ..transport import check_job_filter
from .arrays import Arrays
from .dependencies import Dependencies
from .endings import Endings
from .fleet import Fleet
from .projects import ProjectAdmin
from .recovery import Recovery
from .state import Done, Pending, Snapshot, request_of, task_infos


class _Stored(Exception):
    """A submit's id names a job stored already (its transaction is rolled back)."""


class ControlPlane(Fleet, Recovery, ProjectAdmin, Arrays, Dependencies, Endings):
    # ---- clients -------------------------------------------------------

    def submit(
        self, spec: JobSpec, job_id: str | None = None, *, viewer: Viewer | None = None
    ) -> JobInfo:
        """Store and place a job, as ``viewer``'s (embedded: the local user's).
        ``job_id`` (made by the client) makes a retried submit idempotent: the
        same id and spec return the job already stored."""
        # Sealed from here on (stored so, kept so): only its worker gets the values.
        spec = self.secrets.seal(parse_spec(spec))
        if spec.array_task is not None:
            raise SpecError(
                "array_task", "is set by GPUlayer on the tasks of an array; submit an array (array)"
            )
        viewer = viewer or local_viewer()
        if job_id is not None:
            check_id("id", job_id)
        spec = self._into_project(spec, viewer)
        spec = self._resolve_dependencies(spec, lambda j: self.resolve(j, viewer))
        job = self._submit(spec, job_id, viewer)
        if job is None:
            # The id names a job the submitter may not see: it was only a key
            # against storing a retry twice, and telling that it is taken
            # would tell that the job exists. The job gets an id of its own.
            job = self._submit(spec, None, viewer)
            assert job is not None  # a new id names no job
        return redacted(job)

    def _submit(self, spec: JobSpec, job_id: str | None, viewer: Viewer) -> JobInfo | None:
        """:meth:`submit`; None if ``job_id`` names a job ``viewer`` may not see."""
        now = self._clock()
        with self._lock:
            if job_id is not None and (
                job_id in self._queue
                or job_id in self._running
                or job_id in self._finished
                or job_id in self._arrays
            ):
                # A retried submit of a job this plane holds: answered before
                # anything in memory is touched (its queue entry stays whole).
                return self._stored(job_id, spec, viewer)
            seq = self._seq + 1
            job = JobInfo(
                id=job_id or new_id(),
                spec=spec,
                seq=seq,
                owner=self.instance_id,
                user=viewer.user,
                marks={"submitted": now},
            )
            tasks: list[JobInfo] = []
            if spec.array:  # its tasks queue; the array itself never runs
                tasks = self._open_array(job, now)
                seq += len(tasks)
            else:
                request = request_of(job.id, spec, seq)
                self._enqueue(Pending(request, spec, 0, now, user=viewer.user))
            try:
                assignments = self._plan()
                mine = [a for a in assignments if a.job_id == job.id]
                if mine:  # placed at once: stored placed, in one statement
                    first = mine[0]
                    job.state, job.worker, job.attempt = jobs.RUNNING, first.worker_id, 1
                    job.slots, job.gpus = list(first.slots), list(first.gpus)
                    job.marks["placed"] = now
                    if spec.distributed:
                        job.tasks = task_infos(mine)
                with self.store.transaction() as tx:
                    if not tx.insert_job(job):  # a retried submit: the id is stored already
                        raise _Stored
                    if tasks:
                        tx.insert_tasks(tasks)
                    others = [a for a in assignments if a.job_id != job.id]
                    self._record(tx, others, now)
                    assignments = [a for a in assignments if a.job_id == job.id] + others
            except _Stored:
                self._unqueue(job.id, tasks)
                return self._stored(job.id, spec, viewer)
            except BaseException:
                self._unqueue(job.id, tasks)
                raise
            if tasks and {a.job_id for a in assignments} & {t.id for t in tasks}:
                job.state = jobs.RUNNING
            self._seq = seq
            self._dispatch(assignments, now)
        return job

    def _unqueue(self, job_id: str, tasks: list[JobInfo]) -> None:
        """Undo a submit's queueing: its job's, or its array's tasks'."""
        if tasks:
            self._drop_array(job_id)
        else:
            self._dequeue(job_id)

    def _into_project(self, spec: JobSpec, viewer: Viewer) -> JobSpec:
        """``spec`` with the project it goes into: the one it names, which
        must be one of its user's (an admin: any project); else the user's
        first. The default project (stored as None) takes the jobs of users
        in no project, and of admins: a member of a project cannot escape
        its quota there."""
        with self._lock:
            mine = self._memberships.of(viewer.user)
            asked = spec.project
            if asked is None:
                chosen = mine[0] if mine else None
            elif asked == DEFAULT_PROJECT:
                if mine and not viewer.admin:
                    raise GPUlayerError(
                        f"you belong to project{'s' if len(mine) > 1 else ''} "
                        f"{', '.join(mine)}: submit into {'one of them' if len(mine) > 1 else 'it'}"
                        f", not into the default project"
                    )
                chosen = None
            elif asked in mine or (viewer.admin and self._memberships.get(asked) is not None):
                chosen = asked
            else:
                # The same words whether it exists or not: a name is no secret
                # worth keeping, but no one learns it by guessing either.
                theirs = f"your projects are {', '.join(mine)}" if mine else "you belong to none"
                raise GPUlayerError(f"no project {asked!r} that you belong to ({theirs})")
        if chosen == spec.project:
            return spec
        return msgspec.structs.replace(spec, project=chosen)

    def _stored(self, job_id: str, spec: JobSpec, viewer: Viewer) -> JobInfo | None:
        """The job a retried submit made: the same spec, or an error; None if
        it is not one ``viewer`` may see (not its retry, then)."""
        existing = self.store.get_job(job_id)
        if existing is None:  # not a job store deletes from: cannot happen
            raise InvalidStateError(f"job {job_id} could not be stored; submit it again")
        if not self._sees(viewer, existing.user, existing.spec.project):
            return None
        if not self._same_spec(existing.spec, spec):
            raise InvalidStateError(f"job {job_id} already exists with a different spec")
        return existing

    def _same_spec(self, stored: JobSpec, sealed: JobSpec) -> bool:
        """Whether two sealed specs say the same (each seal of a value differs)."""
        if not (stored.secrets or sealed.secrets):
            return stored == sealed
        try:
            return self.secrets.open(stored) == self.secrets.open(sealed)
        except GPUlayerError:  # sealed with another key: not known to be the same
            return False

    def _user_in_memory(self, job_id: str) -> tuple[bool, str | None, str | None]:
        """Whether this plane holds the job (queued, running, lately ended)
        and, if so, whose it is and its project. Call with the lock held."""
        held = self._queue.get(job_id) or self._running.get(job_id)
        if held is not None:
            return True, held.user, held.spec.project
        final = self._finished.get(job_id)
        if final is not None:
            return True, final.user, final.spec.project
        return False, None, None

    def _sees(self, viewer: Viewer, user: str | None, project: str | None) -> bool:
        """:func:`~gpulayer.access.may_see`, with the viewer's projects. Call
        with the lock held, or without (a read of a dict another thread may
        replace an entry of, never one that is half changed)."""
        return may_see(viewer, user, project, self._memberships.of(viewer.user))

    def _only(self, viewer: Viewer) -> dict[str, Any]:
        """The store's filter for the jobs ``viewer`` may see."""
        if viewer.only is None:
            return {}
        projects = self._memberships.of(viewer.user)
        return {"user": viewer.only, "projects": projects} if projects else {"user": viewer.only}

    def resolve(self, job_id: str, viewer: Viewer | None = None) -> str:
        """A full id from an id or a unique prefix of one, among the jobs
        ``viewer`` may see (embedded: every job). A job it may not see is
        answered for as one that does not exist, also in time: a store read,
        as for an id of no job."""
        viewer = viewer or local_viewer()
        base, index = split_task(job_id)
        if index is not None:  # JOB:7, the task of array JOB with index 7
            return self._task_of(self.resolve(base, viewer), index)
        with self._lock:
            held, user, project = self._user_in_memory(job_id)
            visible = held and self._sees(viewer, user, project)
        if visible:
            return job_id
        found = self.store.find_job(job_id, **self._only(viewer))
        if job_id in found:
            return job_id
        if len(found) == 1:
            return found[0]
        if not found:
            raise JobNotFoundError(f"no job with id {job_id!r}")
        raise JobNotFoundError(f"{job_id!r} matches several jobs; give more of the id")

    def get(self, job_id: str, viewer: Viewer | None = None) -> JobInfo:
        viewer = viewer or local_viewer()
        only = self._only(viewer)
        job = self.store.get_job(job_id, **only)
        if job is None:  # a prefix, or not the viewer's
            job = self.store.get_job(self.resolve(job_id, viewer), **only)
            if job is None:  # (it went, or is no longer the viewer's, meanwhile)
                raise JobNotFoundError(f"no job with id {job_id!r}")
        if job.spec.array:
            self._tally([job])
        elif job.state == jobs.QUEUED and job.reason is None:
            job.reason = self._why_waiting(job)
        return redacted(job)

    def _tally(self, arrays: list[JobInfo]) -> None:
        """Each array's tasks by state, and (not final) that as its reason."""
        counts = self.store.array_counts([a.id for a in arrays])
        for array in arrays:
            array.array_states = counts.get(array.id, {})
            if not array.done:
                array.reason = self._array_reason(array)

    def _why_waiting(self, job: JobInfo) -> str:
        with self._lock:
            pending = self._queue.get(job.id)
            if pending is not None:
                waits = self._waits_for(job.id) or self._held_by_array(pending)
                if waits is not None:
                    return waits
                caps = [w.capacity() for w in self._open_workers()]
                now = self._clock()
                return explain(pending.request, caps, now, self._shares(now))
        # Queued by another process on this home: judge by the workers on record.
        spec = job.spec
        caps = [
            Capacity(w.id, tuple(w.slot_gpus), frozenset(range(len(w.slot_gpus))))
            for w in self.store.list_workers()
        ]
        retry_at = job.marks.get("retry_at", 0.0)
        request = request_of(job.id, spec, job.seq, retry_at)
        return explain(request, caps, self._clock())

    def list_jobs(
        self,
        *,
        states: Iterable[str] = (),
        limit: int | None = None,
        viewer: Viewer | None = None,
        labels: Mapping[str, str] | None = None,
        array: str | None = None,
        submitter: str | None = None,
        project: str | None = None,
        text: str | None = None,
        offset: int = 0,
    ) -> list[JobInfo]:
        """The jobs ``viewer`` may see, newest first, an array as its one
        row; with ``labels``, only those carrying every one; with ``array``
        (an array's id or its start), that array's tasks by index; with
        ``submitter``, ``project`` and ``text``, only that user's, that
        project's, those whose name, script or command holds it; ``offset``:
        after passing over that many (a page). A filter that cannot match
        (an unknown state) is an error, not an empty list."""
        states = list(states)
        labels = dict(labels or {})
        check_job_filter(states, labels)
        viewer = viewer or local_viewer()
        only = self._only(viewer)
        array_id = None if array is None else self.resolve(array, viewer)
        found = self.store.list_jobs(
            states=states,
            limit=limit,
            labels=labels,
            array=array_id,
            top_level=array_id is None,
            submitter=submitter,
            project=project,
            text=text,
            offset=offset,
            **only,
        )
        arrays = [job for job in found if job.spec.array]
        if arrays:
            self._tally(arrays)
        for job in found:  # why each queued one waits, as get() says it
            if job.state == jobs.QUEUED and job.reason is None:
                job.reason = self._why_waiting(job)
        return [redacted(j) for j in found]

    def wait(
        self, job_id: str, timeout: float | None = None, viewer: Viewer | None = None
    ) -> JobInfo:
        """Block until the job is final (or ``timeout``), then return it."""
        viewer = viewer or local_viewer()
        job_id = self.resolve(job_id, viewer)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            final, done = self.watch_job(job_id)
            if final is not None:
                return final
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return self.get(job_id, viewer)
            with self._lock:
                if done is None:  # run by another process on this home: it cannot signal us
                    signal = self._logs.setdefault(job_id, Signal())
                    wait_on(self._lock, signal, min(defaults.FOLLOW_RECHECK_S, left or 1e9))
                elif not done.fired:
                    wait_on(self._lock, done.signal, left)
                fired = done is not None and done.fired
            if done is not None and fired:
                # Its record, or (if reading it failed then) read now, unlocked.
                return done.job or self.get(job_id, viewer)

    def finals(
        self, job_ids: Iterable[str], viewer: Viewer | None = None
    ) -> tuple[list[JobInfo], list[str]]:
        """The final records of those of ``job_ids`` (full ids) that are final,
        and the ids of no job at all, or of one ``viewer`` may not see.

        The viewer's jobs queued or running here cost no store read, nor do
        those that ended here lately. Another user's cost one, as an id of
        no job does: the reply takes as long for either.
        """
        viewer = viewer or local_viewer()
        everyone = sees_all(viewer)  # no check per job: this loop is on every wait's path
        found: list[JobInfo] = []
        unknown: list[str] = []
        unsure = []
        with self._lock:
            for job_id in job_ids:
                held = self._queue.get(job_id) or self._running.get(job_id)
                if held is not None:
                    if not (everyone or self._sees(viewer, held.user, held.spec.project)):
                        unsure.append(job_id)
                    continue
                final = self._finished.get(job_id)
                if final is not None and (
                    everyone or self._sees(viewer, final.user, final.spec.project)
                ):
                    found.append(final)
                else:
                    unsure.append(job_id)
        only = self._only(viewer)
        for job_id in dict.fromkeys(unsure):  # each id read once, however often it is asked
            job = self.store.get_job(job_id, **only)
            if job is None:
                unknown.append(job_id)
            elif job.done:
                found.append(redacted(job))
        arrays = [job for job in found if job.spec.array and not job.array_states]
        if arrays:
            self._tally(arrays)
        return found, unknown

    def watch_job(self, job_id: str) -> tuple[JobInfo | None, Done | None]:
        """The job if it is final; else what fires when it becomes final.

        ``(None, None)`` means another process on this home runs it: nothing
        here will fire, and the caller must look again later.
        """
        with self._lock:
            if job_id in self._queue or job_id in self._running or job_id in self._arrays:
                return None, self._done.setdefault(job_id, Done())
            final = self._finished.get(job_id)
        if final is not None:
            return final, None
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFoundError(f"no job with id {job_id!r}")
        if job.done and job.spec.array:
            self._tally([job])
        return (redacted(job), None) if job.done else (None, None)

    def cancel(self, job_id: str, viewer: Viewer | None = None) -> JobInfo:
        viewer = viewer or local_viewer()
        job_id = self.resolve(job_id, viewer)  # nothing happens to a job it may not see
        if self._is_array(job_id):
            self._cancel_array(job_id, viewer)
            return self.get(job_id, viewer)
        now = self._clock()
        with self._lock:
            if job_id in self._queue:
                pending = self._dequeue(job_id)
                try:
                    with self.store.transaction() as tx:
                        tx.request_cancel(job_id)
                        self._finish_no_result(
                            tx, job_id, jobs.CANCELLED, "cancelled while queued", now
                        )
                        # It may have held a worker for itself: others may fit now.
                        assignments = self._plan()
                        self._record(tx, assignments, now)
                except StoreError:  # not stored: it stays queued, here too
                    self._enqueue(pending)
                    raise
                self._dispatch(assignments, now)
                self._signal_done(job_id)
            elif job_id in self._running:
                run = self._running[job_id]
                with self.store.transaction() as tx:
                    tx.request_cancel(job_id)
                run.cancel_requested = True
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
        return self.get(job_id, viewer)

    def _is_array(self, job_id: str) -> bool:
        """Whether ``job_id`` (a full id) is an array, not final or final."""
        with self._lock:
            if job_id in self._arrays:
                return True
            if job_id in self._queue or job_id in self._running:
                return False
        job = self.store.get_job(job_id)
        if job is None or not job.spec.array:
            return False
        if job.done:
            raise InvalidStateError(
                f"array {job.id} is already {job.state}; there is nothing to cancel"
            )
        return True

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

    def subscribe_done(self, done: Done, callback: Callable[[], None]) -> Unsubscribe | None:
        """Call ``callback`` once when the job behind ``done`` ends (None: it has)."""
        with self._lock:
            return None if done.fired else done.signal.subscribe(callback)

    def unsubscribe(self, unsubscribe: Unsubscribe) -> None:
        """Drop a subscription (under the lock that guards every signal)."""
        with self._lock:
            unsubscribe()

    def may_fetch(self, worker_id: str, digest: str, artifacts: ArtifactStore) -> bool:
        """Whether ``digest`` belongs to a task placed on ``worker_id``: its
        bundle, an input, or a file inside either."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                return False
            runs = [self._running[j] for j in worker.running if j in self._running]
        specs = [run.spec for run in runs]
        manifests = []  # the roots of trees: the bundle, folder inputs, scratch
        for run in runs:
            if run.scratch is not None:
                if digest == run.scratch.digest:
                    return True
                manifests.append(run.scratch.digest)
        for spec in specs:
            if spec.bundle is not None:
                if digest == spec.bundle:
                    return True
                manifests.append(spec.bundle)
            for ref in spec.inputs.values():
                if digest == ref.digest:
                    return True
                if ref.kind == "dir":  # a file input is no manifest: never read here
                    manifests.append(ref.digest)
        for root in manifests:
            listed = self._tree(root, artifacts)  # None: gone, or not a manifest after all
            if listed is not None and digest in listed:
                return True
        return False

    def watch_logs(self, job_id: str, callback: Callable[[], None]) -> Unsubscribe:
        """Call ``callback`` once when the job's logs grow or it ends."""
        with self._lock:
            return self._logs.setdefault(job_id, Signal()).subscribe(callback)

    def list_workers(self, viewer: Viewer | None = None) -> list[WorkerInfo]:
        """Every worker; each one's running jobs only those ``viewer`` may see."""
        viewer = viewer or local_viewer()
        with self._lock:
            live = {w.info.id: w for w in self._workers.values()}
            running = {w.info.id: sorted(w.running) for w in live.values()}
            now = self._clock()
            gpu_stats = {w.info.id: w.gpu_stats(now) for w in live.values()}
            if not sees_all(viewer):
                for worker_id, ids in running.items():
                    running[worker_id] = [j for j in ids if self._visible_here(viewer, j)]
        found = self.store.list_workers()
        for info in found:
            # Only memory holds GPU figures: never what a registration stored.
            info.gpu_stats = gpu_stats.get(info.id, [])
            worker = live.get(info.id)
            if worker is not None:  # what only memory holds: its tasks, its last word
                info.running = running[info.id]
                info.last_seen = worker.last_seen
            elif not sees_all(viewer):
                info.running = []
        return found

    def _visible_here(self, viewer: Viewer, job_id: str) -> bool:
        """Whether ``viewer`` may see a job this plane holds. Call with the lock held."""
        held, user, project = self._user_in_memory(job_id)
        return held and self._sees(viewer, user, project)

    def snapshot(self) -> Snapshot:
        with self._lock:
            connected = [w for w in self._workers.values() if w.connected and not w.closed]
            return Snapshot(
                queued=len(self._queue),
                workers=len(self._workers),
                connected_workers=len(connected),
                free_slots=sum(len(w.free) for w in connected),
            )
