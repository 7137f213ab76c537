"""Jobs that wait for other jobs: ``after`` (to succeed) and ``after_any``
(to end, whatever way).

A job with a dependency that is not final is queued but held back: in the
queue (it is listed, shown, cancelled like any queued job) and out of
placement's :class:`~gpulayer.scheduler.Waiting`. When a job it waits for
ends, it joins placement once none is left; when one of its ``after``
jobs ends other than succeeded, it can never run as asked and is cancelled,
saying why (which may cancel the jobs after it in turn).

A job's end is noted where it is signalled (``_signal_done``, sometimes
inside the transaction that ends it); what follows from it is done by the
back-off timer's pass a moment later, in a transaction of its own, the
placement pass that follows included. Dependencies are on jobs this control
plane runs (a server's, or one embedded process's): a job another process
on the same home runs ends unseen here, and what waits for it waits until
this process looks again (a restart).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from .. import jobs
from ..errors import InvalidStateError, JobNotFoundError, SpecError
from ..jobs import JobInfo
from ..spec import JobSpec
from .core import PlaneCore
from .state import Pending


class Dependencies(PlaneCore):
    def _resolve_dependencies(self, spec: JobSpec, resolve: Callable[[str], str]) -> JobSpec:
        """``spec`` with the jobs it waits for named by their full ids, as
        ``resolve`` finds them among those its submitter may see (else
        JobNotFoundError, as for any id it may not see). A job ``after`` one
        that has already failed is refused: it could never run."""
        if not spec.after and not spec.after_any:
            return spec

        def named(field: str, ids: list[str]) -> list[str]:
            found = []
            for index, job_id in enumerate(ids):
                try:
                    found.append(resolve(job_id))
                except JobNotFoundError as exc:  # (one it may not see, too)
                    raise SpecError(f"{field}[{index}]", f"{exc}: nothing to wait for") from None
            return list(dict.fromkeys(found))

        after, after_any = named("after", spec.after), named("after_any", spec.after_any)
        for job_id in after:
            state = self._final_state(job_id)
            if state is not None and state != jobs.SUCCEEDED:
                raise InvalidStateError(
                    f"job {job_id} has already ended {state}: a job after it (--after) "
                    "could never run; use --after-any to run after it whatever its end"
                )
        if (after, after_any) == (spec.after, spec.after_any):
            return spec
        return msgspec.structs.replace(spec, after=after, after_any=after_any)

    def _final_state(self, job_id: str) -> str | None:
        """The state ``job_id`` ended in; None while it is not final."""
        if job_id in self._queue or job_id in self._running:
            return None
        final: JobInfo | None = self._finished.get(job_id)
        if final is None:
            final = self.store.get_job(job_id)
        if final is None:  # deleted by gc: it ended long ago, how is not known
            return jobs.LOST
        return final.state if final.done else None

    def _held_back(self, pending: Pending) -> bool:
        """Whether ``pending`` waits for jobs not final yet (or is doomed by
        one that ended badly): then it stays out of placement."""
        spec = pending.spec
        if not spec.after and not spec.after_any:
            return False
        job_id = pending.request.job_id
        unmet: set[str] = set()
        for dep in [*spec.after, *spec.after_any]:
            state = self._final_state(dep)
            if state is None:
                unmet.add(dep)
            elif dep in spec.after and state != jobs.SUCCEEDED:
                self._doomed[job_id] = (
                    f"cancelled: job {dep}, which it was to run after (--after), "
                    f"ended {state}; it can no longer run as asked"
                )
                self._arm_retry(self._clock())  # cancelled by the next pass
                return True
        if not unmet:
            return False
        self._unmet[job_id] = unmet
        for dep in unmet:
            self._dependents.setdefault(dep, set()).add(job_id)
        return True

    def _ended(self, job_id: str) -> None:
        """``job_id`` is final: what waits for it is seen to by the next pass."""
        if job_id in self._dependents:
            self._settle.add(job_id)
            self._arm_retry(self._clock())

    def _settle_dependencies(self, now: float) -> None:
        """What the jobs that ended lately release or doom (see module)."""
        ended, self._settle = self._settle, set()
        for dep in ended:
            # By arrival: an array's tasks are released by index.
            released = self._dependents.pop(dep, set())
            for job_id in sorted(released, key=lambda j: self._seq_of(j)):
                unmet = self._unmet.get(job_id)
                pending = self._queue.get(job_id)
                if unmet is None or pending is None:
                    continue  # cancelled meanwhile
                unmet.discard(dep)
                state = self._final_state(dep)
                if dep in pending.spec.after and state != jobs.SUCCEEDED:
                    self._doomed[job_id] = (
                        f"cancelled: job {dep}, which it was to run after (--after), "
                        f"ended {state}; it can no longer run as asked"
                    )
                elif not unmet:
                    del self._unmet[job_id]
                    self._admit(pending)
        if not self._doomed:
            return
        doomed = {j: why for j, why in self._doomed.items() if j in self._queue}
        with self.store.transaction() as tx:  # a refusal keeps them doomed, for the next pass
            for job_id, reason in doomed.items():
                self._finish_no_result(tx, job_id, jobs.CANCELLED, reason, now)
        self._doomed = {}
        for job_id in doomed:
            self._dequeue(job_id)
        for job_id in doomed:
            self._signal_done(job_id)  # (and what waits for it, in turn)

    def _seq_of(self, job_id: str) -> int:
        pending = self._queue.get(job_id)
        return pending.request.seq if pending is not None else 0

    def _waits_for(self, job_id: str) -> str | None:
        """Why a held-back job waits, in words; None if it does not."""
        unmet = self._unmet.get(job_id)
        pending = self._queue.get(job_id)
        if not unmet or pending is None:
            return None
        first = sorted(unmet)[0]
        how = "to succeed" if first in pending.spec.after else "to end"
        more = f" (and {len(unmet) - 1} more)" if len(unmet) > 1 else ""
        return f"waiting for job {first} {how}{more}"


__all__ = ["Dependencies"]
