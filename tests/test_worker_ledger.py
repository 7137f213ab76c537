"""A worker's ledger of its tasks' processes, left for the next worker on
its home when its tasks could not all be ended."""

from __future__ import annotations

import os
from pathlib import Path

from gpulayer.embedded import Embedded
from gpulayer.spec import parse_spec
from gpulayer.worker.ledger import Ledger, _read
from gpulayer.worker.worker import Worker

from helpers import PY, pids_alive, record_registrations

STUBBORN = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('pid', os.getpid(), flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_task_that_outlives_the_stop_is_left_in_the_ledger(home: Path) -> None:
    embedded = Embedded(home)
    work = home / "ledger-workers"
    worker = Worker(
        embedded.transport,
        cache=embedded.artifacts,
        work_dir=work,
        slots=1,
        kill_grace=60,  # longer than the stop below waits
        ledger=True,
    )
    try:
        worker.start()
        job = embedded.transport.submit(parse_spec({"command": [PY, "-c", STUBBORN]}))
        (line,) = embedded.plane.read_logs(job.id, timeout=30).lines
        pid = int(line.text.split()[1])
        worker.stop(timeout=0.5)  # the task ignores SIGTERM: it is still there
        assert pids_alive(pid) == [pid]
        records = list((work / "live").glob("*/tasks/*"))
        assert len(records) == 1 and records[0].read_text().startswith(f"{pid} ")
        # The worker process ends (its lock goes with it); the next worker
        # process on this home ends what the ledger lists.
        assert worker._ledger is not None
        os.close(worker._ledger._fd)
        Ledger(work).recover(grace=0.2)
        assert pids_alive(pid) == []
    finally:
        embedded.close()


def test_record_files_are_reused_in_place_and_blanked_when_tasks_end(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    try:
        ledger.record("a-1", [(11, 1.5), (12, 2.5)])
        ledger.record("b-1", [(13, 3.5)])
        files = sorted((ledger.dir / "tasks").iterdir())
        assert len(files) == 2

        ledger.forget("a-1")
        ledger.record("c-1", [(14, 4.5)])  # shorter than a-1's: nothing of it may remain

        assert sorted((ledger.dir / "tasks").iterdir()) == files  # no new file
        assert sorted(entry for f in files for entry in _read(f)) == [(13, 3.5), (14, 4.5)]
        ledger.forget("b-1")
        ledger.forget("c-1")
        assert [_read(f) for f in files] == [[], []]
    finally:
        ledger.close()
    assert not ledger.dir.exists()


def test_a_worker_taking_over_a_dead_ones_id_says_it_adopted_it(home: Path) -> None:
    """So the control plane counts what the dead one may have run (see
    test_gangs / test_store_failures for what it does with that)."""
    work = home / "ledger-workers"
    dead = Ledger(work)
    dead.set_worker_id("1m8deadworker0")
    os.close(dead._fd)  # the process died: its lock went with it
    embedded = Embedded(home)
    calls = record_registrations(embedded.transport)
    worker = Worker(
        embedded.transport, cache=embedded.artifacts, work_dir=work, slots=1, ledger=True
    )
    try:
        worker.start()
        assert calls == [("1m8deadworker0", True)]
    finally:
        worker.stop(timeout=5)
        embedded.close()
