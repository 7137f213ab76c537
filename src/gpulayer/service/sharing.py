"""What the control plane keeps to share the machines between teams: each
project's quota and members, its recent usage and what it holds (fair
share, scheduler rules 7 and 8), and preemption's bookkeeping (rule 9):
the running jobs that may be stopped, and the workers held for the job
their stopping makes room for.

The decisions are the scheduler's pure functions; this is their input,
kept up to date as jobs start and end. Not thread-safe: the control plane
calls it under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from ..errors import StoreError
from ..fairshare import Accounts
from ..projects import DEFAULT_PROJECT, Memberships
from ..scheduler import Quota, Shares, Victim, Waiting
from ..store import Store
from .state import LiveWorker, Running

log = logging.getLogger(__name__)

# The projects' usage is stored at most this often (see save_usage).
USAGE_SAVE_S = 60.0


def project_of(run: Running) -> str:
    return run.spec.project or DEFAULT_PROJECT


def demand_of(run: Running) -> tuple[int, int]:
    """What ``run`` holds against its project's quota: (GPUs, CPU slots)."""
    spec = run.spec
    return (spec.gpus * spec.nodes, 0) if spec.gpus else (0, spec.nodes)


class Sharing:
    def __init__(self, store: Store, half_life: float, clock: Callable[[], float]) -> None:
        # Who belongs to which project, and each project's quota (the
        # store's record, kept here: every look at a job asks it).
        self.memberships = Memberships(store.list_projects(), store.project_members())
        # Each project's recent usage and what it holds, for fair share.
        self.accounts = Accounts(half_life, store.load_usage())
        self._saved_at = clock()
        # The running jobs marked preemptible (job id -> its priority), and
        # the workers held for the waiting job that preempted jobs on them
        # make room for (worker id -> that job's id).
        self.preemptible: dict[str, int] = {}
        self.held_for: dict[str, str] = {}

    def shares(self, now: float) -> Shares:
        """Quotas, holdings and usage by project, for placement."""
        quotas = {
            p.name: Quota(p.gpus, p.slots)
            for p in self.memberships.all()
            if p.gpus is not None or p.slots is not None
        }
        return Shares(quotas, self.accounts.held, self.accounts.usage(now))

    def began(self, job_id: str, run: Running, now: float) -> None:
        """``run`` holds its slots from now (placed, or taken over)."""
        self.accounts.start(project_of(run), demand_of(run), now)
        if run.spec.preemptible:
            self.preemptible[job_id] = run.spec.priority

    def ended(self, job_id: str, run: Running, now: float) -> None:
        """``run`` let go of its slots."""
        self.preemptible.pop(job_id, None)
        self.accounts.stop(project_of(run), demand_of(run), now)

    def dequeued(self, job_id: str) -> None:
        """``job_id`` left the queue (placed, or gone): no worker is held for it."""
        if job_id in self.held_for.values():
            self.held_for = {w: j for w, j in self.held_for.items() if j != job_id}

    def prune_holds(
        self, running: Mapping[str, Running], waiting: Waiting, workers: Mapping[str, LiveWorker]
    ) -> None:
        """Workers stay held for a job (rule 9) only while a job preempted
        for it is still stopping, the worker is open, and the job waits: a
        worker that went, a job cancelled, or victims all stopped (the pass
        their end sets off places it, first in line) end the hold; a job its
        quota now holds back cannot keep a worker idle past that either."""
        if not self.held_for:
            return
        stopping = {r.preempted_for for r in running.values() if r.preempted_for}
        self.held_for = {
            worker_id: job_id
            for worker_id, job_id in self.held_for.items()
            if job_id in stopping
            and job_id in waiting
            and (w := workers.get(worker_id)) is not None
            and w.connected
            and not w.closed
        }

    def victims(self, running: Mapping[str, Running], waiting: Waiting) -> list[Victim]:
        """The running jobs that may be stopped now for a waiting one: none
        unless a job waits that outranks some preemptible one (checked
        before looking at each of them: thousands, perhaps)."""
        if not self.preemptible:
            return []
        top = waiting.top_priority()
        if top is None or top <= min(self.preemptible.values()):
            return []
        found = []
        for job_id in self.preemptible:
            run = running[job_id]
            if run.preempted_for is None and not run.cancel_requested:
                slots = {t.worker_id: t.slots for t in run.tasks if not t.ended}
                placed = run.marks.get("placed", 0.0)
                found.append(Victim(job_id, run.spec.priority, placed, slots))
        return found

    def save_usage(self, store: Store, now: float, every: float = USAGE_SAVE_S) -> None:
        """Store the projects' usage, at most once every ``every`` seconds:
        a crash loses at most that much of it (usage is a ranking, not a bill)."""
        if now - self._saved_at < every:
            return
        self._saved_at = now
        try:
            with store.transaction() as tx:
                for project, (usage, at) in self.accounts.saved(now).items():
                    tx.save_usage(project, usage, at)
        except StoreError as exc:
            log.warning("storing the projects' usage failed (kept in memory): %s", exc)


__all__ = ["Sharing", "demand_of", "project_of"]
