"""What the control plane says about its workers."""

from __future__ import annotations

from pathlib import Path

from gpulayer.jobs import WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore


def test_a_workers_last_word_is_its_latest_heartbeat(tmp_path: Path) -> None:
    now = [100.0]
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="test", clock=lambda: now[0])
        info = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None]))
        now[0] = 142.5
        plane.heartbeat(info.id)
        (seen,) = plane.list_workers()
        assert (seen.started, seen.last_seen) == (100.0, 142.5)
    finally:
        store.close()
