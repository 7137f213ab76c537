"""The embedded control plane: the service, the store and local workers, all
in the user's process, with state in the GPUlayer home.

Opening one claims a fresh instance id (a lock held for the process's life)
and recovers what any dead instance on the same home left behind: each job
it had not finished is marked ``lost`` (the processes of those running
killed), never run here (ADR-0021).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from . import defaults
from .artifacts import ArtifactStore
from .home import Home
from .ids import new_id
from .service import ControlPlane
from .store.sqlite import SqliteStore
from .transport.inprocess import InProcessTransport
from .worker.gpulocks import unclaimed
from .worker.gpus import Gpu, detect_gpus, share_gpus
from .worker.worker import Worker

log = logging.getLogger(__name__)


def _kill_orphan(pid: int, created: float | None) -> None:
    from .worker.process import kill_orphans

    if created is not None:
        kill_orphans(pid, created, grace=defaults.KILL_GRACE_S)


class Embedded:
    def __init__(self, home_path: Path) -> None:
        self.home = Home(home_path)
        self.home.check_not_server()
        self.instance_id = new_id()
        self.home.claim_instance(self.instance_id)
        self.store = SqliteStore(self.home.db)
        self.artifacts = ArtifactStore(self.home.artifacts)
        self.plane = ControlPlane(
            self.store, instance_id=self.instance_id, kill_orphan=_kill_orphan
        )
        self.transport = InProcessTransport(self.plane, self.artifacts)
        self.workers: list[Worker] = []
        self._lock = threading.Lock()
        self._gpus: list[Gpu] | None = None
        self.recover()

    def recover(self) -> list[str]:
        recovered: list[str] = []
        for owner in sorted(self.store.owners() - {self.instance_id}):
            fd = self.home.lock_if_dead(owner)
            if fd is None:
                continue  # alive: another process on this home runs those jobs
            try:
                recovered += self.plane.recover(owner)
            finally:
                self.home.forget_instance(owner, fd)
        if recovered:  # said once: they are final now, and never taken over again
            shown = ", ".join(recovered[:5]) + (", ..." if len(recovered) > 5 else "")
            log.warning(
                "%d job(s) of GPUlayer processes that ended before them are marked lost, "
                "not run: %s (an embedded job runs only while the process that submitted "
                "it does; use a server for jobs that outlive their command)",
                len(recovered),
                shown,
            )
        return recovered

    def ensure_local_workers(
        self, count: int, *, slots: int | None = None, kill_grace: float = defaults.KILL_GRACE_S
    ) -> list[Worker]:
        """Start workers in this process until ``count`` run.

        The machine's GPUs are split among the workers started together, so
        no GPU is offered twice; workers beyond the GPU count offer CPU slots.
        """
        with self._lock:
            missing = count - len(self.workers)
            if missing <= 0:
                return list(self.workers)
            if self._gpus is None:
                self._gpus = detect_gpus()
            claimed = {(g.vendor, g.index) for w in self.workers for g in w.gpus}
            # Nor one that a worker of another process offers.
            free = unclaimed([g for g in self._gpus if (g.vendor, g.index) not in claimed])
            for share in share_gpus(free, missing):
                worker = Worker(
                    self.transport,
                    cache=self.artifacts,  # same machine: the home's store is the cache
                    work_dir=self.home.path / "workers",
                    slots=None if share else slots,
                    gpus=share,
                    kill_grace=kill_grace,
                )
                worker.start()
                self.workers.append(worker)
            return list(self.workers)

    def close(self) -> None:
        with self._lock:
            workers, self.workers = self.workers, []
        # First stop all placement, so a job retried off one stopping worker
        # is not placed on the next one to stop.
        self.plane.close_workers()
        for worker in workers:
            worker.stop()
        self.store.close()
        self.home.release_instance(self.instance_id)
