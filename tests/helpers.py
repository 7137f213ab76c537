"""Small helpers shared by tests (importable thanks to pytest's pythonpath)."""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpulayer
from gpulayer.store import Store
from gpulayer.store.sqlite import SqliteStore
from gpulayer.transport import Transport

PY = sys.executable
ALLREDUCE = Path(__file__).parent / "distributed" / "allreduce.py"


def run_2x2_allreduce(
    client: gpulayer.Client,
    out_dir: Path,
    launcher: str | None = None,
    context: Callable[[], str] = lambda: "",
) -> gpulayer.Job:
    """Run the 2x2 gloo all-reduce job (tests/distributed/allreduce.py) and
    check what it must give: the sum rank 0 wrote, and each rank's line,
    tagged with its rank. ``context`` adds to a failure's message."""
    job = client.submit(
        str(ALLREDUCE),
        args=["sum.json"],
        nodes=2,
        procs_per_node=2,
        launcher=launcher,
        outputs=["sum.json"],
        timeout=90,
    )
    assert job.wait(timeout=120) == "succeeded", f"{job.logs()}\n{context()}"
    out = job.download_outputs(out_dir)
    assert json.loads((out / "sum.json").read_text()) == {"sum": 10.0, "world": 4, "env_rank": "0"}
    said = {
        line.rank: line.text.split(" port ")[0]
        for line in job.stream_logs(follow=False)
        if " sum " in line.text
    }
    assert said == {r: f"rank {r}/4 sum 10" for r in range(4)}
    return job


# Each test of the job, distributed and Trainer suites runs twice: with every
# job cold (GPULAYER_WARM=0) and with the workers' zygotes made and waited
# for before they serve (GPULAYER_WARM=ready), so that a script job's first
# run is already warm (issue 19, point 6). See the ``start`` fixtures.
STARTS = {"cold": "0", "warm": "ready"}
# What a job's record says when its worker starts every job cold.
COLD_WORKER = "cold: the worker starts jobs cold (--no-warm, or no fork server on this system)"


@dataclass(frozen=True)
class Start:
    """Which start a parity test's workers give (the ``start`` fixture)."""

    warm: bool

    def check(self, job: gpulayer.Job, *, cold_because: str | None = None) -> None:
        """That ``job`` started as these workers start jobs: warm, or cold
        (GPULAYER_WARM=0). ``cold_because``: a job that starts cold even from
        workers that start jobs warm (a command job, torchrun, settings no
        zygote was made for), and the words its record must give for it."""
        start = job.refresh().start
        if cold_because is None:
            expected = "warm" if self.warm else COLD_WORKER
            assert start == expected, f"{job.id}: start {start!r}, expected {expected!r}"
        else:
            assert start is not None and start.startswith("cold: "), f"{job.id}: {start!r}"
            if self.warm or start != COLD_WORKER:
                assert cold_because in start, f"{job.id}: {start!r} does not say {cold_because!r}"


def script_file(tmp_path: Path, code: str, name: str = "job.py") -> Path:
    """``code`` as a script of its own folder under ``tmp_path`` (a script's
    folder is its job's bundle: tmp_path itself holds the test's home)."""
    folder = tmp_path / f"script-{Path(name).stem}"
    folder.mkdir(exist_ok=True)
    script = folder / name
    script.write_text(code)
    return script


def pids_alive(*pids: int) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie is dead for our purposes.
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    continue
        except FileNotFoundError:
            continue
        alive.append(pid)
    return alive


class Refusing:
    """A store connection whose COMMITs fail, as on a full disk: the next
    ``count`` of them (every one, with None) after ``skip`` that pass; and
    ROLLBACK too if ``rollback_fails``."""

    def __init__(self, db: sqlite3.Connection, count: int | None = 1, *, skip: int = 0) -> None:
        self.db, self.count, self.skip = db, count, skip
        self.rollback_fails = False
        self.reads_fail = False  # and every SELECT, as on a failing disk

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if sql == "ROLLBACK" and self.rollback_fails:
            raise sqlite3.OperationalError("disk I/O error")
        if self.reads_fail and sql.lstrip().startswith("SELECT"):
            raise sqlite3.OperationalError("disk I/O error")
        if sql == "COMMIT" and self.count != 0:
            if self.skip:
                self.skip -= 1
            else:
                if self.count is not None:
                    self.count -= 1
                raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.db, name)


def refuse_commits(store: Store, count: int | None = 1, *, skip: int = 0) -> Refusing:
    """Make ``store`` refuse its next ``count`` commits (see :class:`Refusing`)."""
    assert isinstance(store, SqliteStore)
    refusing = Refusing(store._db, count, skip=skip)
    store._db = refusing  # type: ignore[assignment]
    return refusing


def record_registrations(transport: Transport) -> list[tuple[str, bool]]:
    """(worker id, adopted) of each registration through ``transport`` from
    now on; the registrations still go through."""
    calls: list[tuple[str, bool]] = []
    register = transport.register_worker

    def recorded(info, running=(), *, adopted=False):  # type: ignore[no-untyped-def]
        calls.append((info.id, adopted))
        return register(info, running, adopted=adopted)

    transport.register_worker = recorded  # type: ignore[method-assign]
    return calls
