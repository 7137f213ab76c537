"""A worker's ledger of its tasks' processes, left for the next worker on
its home when its tasks could not all be ended."""

from __future__ import annotations

import os
from pathlib import Path

from gpulayer.embedded import Embedded
from gpulayer.spec import parse_spec
from gpulayer.worker.ledger import Ledger
from gpulayer.worker.worker import Worker

from helpers import PY, pids_alive

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
