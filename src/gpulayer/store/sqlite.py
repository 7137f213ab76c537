"""The embedded store: one SQLite file in WAL mode under the GPUlayer home.

WAL lets readers (``gpulayer jobs`` in another terminal) run beside the writer.
``synchronous=NORMAL`` makes a commit survive a crash of the process (the case
GPUlayer promises to recover from) without an fsync per job; a power cut may
lose the last moments of history. See ADR-0003.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec
from msgspec import UNSET, UnsetType

from ..errors import InvalidStateError, StoreError
from ..jobs import FINAL_STATES, JobInfo, LogLine, TaskInfo, TaskResult, WorkerInfo, job_start
from ..projects import DEFAULT_PROJECT, ProjectInfo
from ..spec import ArtifactRef, JobSpec
from . import Store, Transaction
from .migrations import LATEST, MIGRATIONS

_encode = msgspec.json.encode
_EXCLUSIVE_WAIT_S = 2.0  # for the lock of a store opened for one process alone
_decode_spec = msgspec.json.Decoder(JobSpec).decode
_decode_marks = msgspec.json.Decoder(dict[str, float]).decode
_decode_ints = msgspec.json.Decoder(list[int]).decode
_decode_worker = msgspec.json.Decoder(WorkerInfo).decode
_decode_lines = msgspec.json.Decoder(list[LogLine]).decode
_decode_tasks = msgspec.json.Decoder(list[TaskInfo]).decode
_decode_ref = msgspec.json.Decoder(ArtifactRef).decode

# What a deleted project's final jobs keep as their project: no project
# name starts so (projects.check_project_name), so no membership, no filter
# and no project made later under the same name matches them.
_DELETED = "~"
_NOT_FINAL = "state NOT IN ({})".format(",".join(f"'{state}'" for state in sorted(FINAL_STATES)))

_JOB_COLUMNS = (
    "id, seq, state, spec, attempt, owner, worker, slots, gpus, exit_code, reason, "
    "cancel_requested, pid, pid_created, marks, tasks, given_back, user_name, start, project"
)


def _seen_by(user: str, projects: Collection[str]) -> tuple[str, list[object]]:
    """The condition (and its parameters) for the jobs ``user`` sees: its own,
    and those in ``projects``. The default project is never one of them (a
    job there is its submitter's alone), whoever passes it."""
    named = [p for p in dict.fromkeys(projects) if p != DEFAULT_PROJECT]
    if not named:
        return "user_name = ?", [user]
    return f"(user_name = ? OR project IN ({','.join('?' * len(named))}))", [user, *named]


def _job_from_row(row: tuple[object, ...], outputs: dict[str, ArtifactRef]) -> JobInfo:
    (
        jid,
        seq,
        state,
        spec,
        attempt,
        owner,
        worker,
        slots,
        gpus,
        code,
        reason,
        cancel,
        pid,
        pcreated,
        marks,
        tasks,
        given_back,
        user,
        start,
        project,
    ) = row
    decoded = _decode_spec(spec)  # type: ignore[arg-type]
    if project is not None and project != decoded.project and str(project).startswith(_DELETED):
        # Its project was deleted: the row says so, and every look at the
        # job goes by that (no member of a project made later sees it).
        decoded = msgspec.structs.replace(decoded, project=str(project))
    return JobInfo(
        id=str(jid),
        seq=int(seq),  # type: ignore[call-overload]
        state=str(state),
        spec=decoded,
        attempt=int(attempt),  # type: ignore[call-overload]
        given_back=int(given_back),  # type: ignore[call-overload]
        owner=owner,  # type: ignore[arg-type]
        user=user,  # type: ignore[arg-type]
        worker=worker,  # type: ignore[arg-type]
        slots=_decode_ints(slots),  # type: ignore[arg-type]
        gpus=_decode_ints(gpus),  # type: ignore[arg-type]
        exit_code=code,  # type: ignore[arg-type]
        reason=reason,  # type: ignore[arg-type]
        cancel_requested=bool(cancel),
        pid=pid,  # type: ignore[arg-type]
        pid_created=pcreated,  # type: ignore[arg-type]
        marks=_decode_marks(marks),  # type: ignore[arg-type]
        outputs=outputs,
        tasks=_decode_tasks(tasks) if tasks else [],  # type: ignore[arg-type]
        start=start,  # type: ignore[arg-type]
    )


_INSERT_JOB = (
    "INSERT INTO jobs (id, seq, name, state, priority, spec, attempt, owner, user_name, worker, "
    "slots, gpus, marks, tasks, project, gpu_demand, began, finished, array_of, array_index, "
    "array_size) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT (id) DO NOTHING"
)


def _job_row(job: JobInfo) -> tuple[object, ...]:
    spec = job.spec
    task = spec.array_task
    return (
        job.id,
        job.seq,
        spec.name,
        job.state,
        spec.priority,
        _encode(spec),
        job.attempt,
        job.owner,
        job.user,
        job.worker,
        _encode(job.slots),
        _encode(job.gpus),
        _encode(job.marks),
        _encode(job.tasks).decode() if job.tasks else None,
        spec.project,  # None: the default project
        # What it holds while it runs; an array itself runs nothing (its tasks do).
        0 if spec.array else spec.gpus * spec.nodes,
        job.marks.get("placed"),
        job.marks.get("finished") if job.state in FINAL_STATES else None,
        None if task is None else task.array,
        None if task is None else task.index,
        len(spec.array) if spec.array else None,
    )


class _SqliteTransaction(Transaction):
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def insert_job(self, job: JobInfo) -> bool:
        return self.db.execute(_INSERT_JOB, _job_row(job)).rowcount == 1

    def insert_tasks(self, tasks: Sequence[JobInfo]) -> None:
        # New ids (ids.new_id): no conflict to look for, one statement for all.
        self.db.executemany(_INSERT_JOB, [_job_row(t) for t in tasks])

    def array_started(self, array_id: str, at: float) -> None:
        self.db.execute(
            "UPDATE jobs SET state='running', began=? WHERE id=? AND state='queued'",
            (at, array_id),
        )

    def save_usage(self, project: str, usage: float, at: float) -> None:
        _save_usage(self.db, project, usage, at)

    def cancel_requested(self, job_id: str) -> bool:
        row = self.db.execute("SELECT cancel_requested FROM jobs WHERE id=?", (job_id,)).fetchone()
        return bool(row and row[0])

    def place(
        self,
        job_id: str,
        *,
        worker: str,
        slots: Sequence[int],
        gpus: Sequence[int],
        attempt: int,
        at: float,
        tasks: Sequence[TaskInfo] = (),
    ) -> bool:
        # Only a job still queued: another process may have cancelled it.
        return (
            self.db.execute(
                "UPDATE jobs SET state='running', worker=?, slots=?, gpus=?, attempt=?, tasks=?, began=?, "
                "exit_code=NULL, start=NULL, marks=json_set(marks, '$.placed', json(?)) WHERE id=? AND state='queued'",
                # Numbers go in as JSON text: SQLite renders bound REALs with 15 digits.
                (
                    worker,
                    _encode(list(slots)),
                    _encode(list(gpus)),
                    attempt,
                    _encode(list(tasks)).decode() if tasks else None,
                    at,
                    _encode(at),
                    job_id,
                ),
            ).rowcount
            == 1
        )

    def start(
        self,
        job_id: str,
        *,
        marks: dict[str, float],
        pid: int,
        pid_created: float | None,
        node: int | None = None,
        procs: Sequence[tuple[int, float | None]] = (),
        start: str | None = None,
    ) -> None:
        if node is None:
            self.db.execute(
                "UPDATE jobs SET pid=?, pid_created=?, start=COALESCE(?, start), "
                "marks=json_patch(marks, ?) WHERE id=?",
                (pid, pid_created, start, _encode(marks), job_id),
            )
            return
        # A node of a distributed job: its process goes in its task's entry.
        path = f"$[{int(node)}]"
        self.db.execute(
            f"UPDATE jobs SET tasks=json_set(tasks, '{path}.pid', ?, '{path}.pid_created', json(?), "
            f"'{path}.procs', json(?)), "
            "pid=CASE WHEN ?=0 THEN ? ELSE pid END, "
            "pid_created=CASE WHEN ?=0 THEN ? ELSE pid_created END, "
            "marks=json_patch(marks, ?) WHERE id=?",
            (
                pid,
                _encode(pid_created).decode(),
                _encode(list(procs)).decode(),
                node,
                pid,
                node,
                pid_created,
                _encode(marks),
                job_id,
            ),
        )
        if start is not None:
            self._set_starts(job_id, {int(node): start})

    def _set_starts(self, job_id: str, starts: Mapping[int, str]) -> None:
        """Each named node's start in its task's entry, and the job's from
        every node's (jobs.job_start); a job without entries (of one node,
        not distributed) has node 0's as its own."""
        row = self.db.execute("SELECT tasks FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            return
        if row[0] is None:
            if 0 in starts:
                self.db.execute("UPDATE jobs SET start=? WHERE id=?", (starts[0], job_id))
            return
        tasks = _decode_tasks(row[0])
        for task in tasks:
            task.start = starts.get(task.node, task.start)
        self.db.execute(
            "UPDATE jobs SET tasks=?, start=? WHERE id=?",
            (_encode(tasks).decode(), job_start(t.start for t in tasks), job_id),
        )

    def finish(
        self,
        job_id: str,
        *,
        state: str,
        exit_code: int | None,
        reason: str | None,
        marks: dict[str, float],
        outputs: dict[str, ArtifactRef],
        starts: Mapping[int, str] | None = None,
    ) -> None:
        # A job of one node takes node 0's start here, in the one statement
        # (the common case); one with task entries, from them all after.
        entries = self.db.execute(
            "UPDATE jobs SET state=?, exit_code=?, reason=?, pid=NULL, pid_created=NULL, "
            "start=CASE WHEN tasks IS NULL THEN COALESCE(?, start) ELSE start END, "
            "finished=COALESCE(?, finished), scratch=NULL, "
            "marks=json_patch(marks, ?) WHERE id=? RETURNING tasks IS NOT NULL",
            (
                state,
                exit_code,
                reason,
                (starts or {}).get(0),
                marks.get("finished"),
                _encode(marks),
                job_id,
            ),
        ).fetchone()
        if starts and entries is not None and entries[0]:
            self._set_starts(job_id, starts)
        if outputs:
            self.db.executemany(
                "INSERT OR REPLACE INTO outputs (job_id, path, kind, digest, size) VALUES (?,?,?,?,?)",
                [(job_id, path, ref.kind, ref.digest, ref.size) for path, ref in outputs.items()],
            )

    def task_ended(self, job_id: str, node: int, result: TaskResult) -> None:
        self.db.execute(
            f"UPDATE jobs SET tasks=json_set(tasks, '$[{int(node)}].result', json(?)) "
            "WHERE id=? AND tasks IS NOT NULL",
            (_encode(result).decode(), job_id),
        )
        if result.start is not None:
            self._set_starts(job_id, {int(node): result.start})

    def starts(self, job_id: str) -> tuple[str | None, dict[int, str]]:
        row = self.db.execute("SELECT start, tasks FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is None:
            return None, {}
        tasks = _decode_tasks(row[1]) if row[1] else []
        return row[0], {t.node: t.start for t in tasks if t.start is not None}

    def set_master_port(self, job_id: str, port: int) -> None:
        self.db.execute(
            "UPDATE jobs SET tasks=json_set(tasks, '$[0].port', ?) WHERE id=? AND tasks IS NOT NULL",
            (port, job_id),
        )

    def requeue(
        self,
        job_id: str,
        *,
        reason: str | None,
        owner: str,
        attempt: int | None = None,
        given_back: int | None = None,
        retry_at: float | None = None,
        at: float | None = None,
        scratch: ArtifactRef | None = None,
    ) -> None:
        if scratch is not None:
            self.db.execute(
                "UPDATE jobs SET scratch=? WHERE id=?", (_encode(scratch).decode(), job_id)
            )
        # Who ran the attempt that ended, for its late log lines (see
        # task_worker): the row names only the current attempt's workers; and
        # when it ended (``at``), for its usage (gpu_seconds). An attempt that
        # never ran (``attempt`` given: its number is used again) has no
        # lines to come.
        if attempt is None:
            self.db.execute(
                "INSERT OR REPLACE INTO past_tasks (job_id, attempt, node, worker, placed, ended) "
                "SELECT id, attempt, 0, worker, json_extract(marks, '$.placed'), ? FROM jobs "
                "WHERE id=? AND tasks IS NULL AND worker IS NOT NULL "
                "UNION ALL SELECT jobs.id, jobs.attempt, json_extract(t.value, '$.node'), "
                "json_extract(t.value, '$.worker'), json_extract(jobs.marks, '$.placed'), ? "
                "FROM jobs, json_each(jobs.tasks) AS t WHERE jobs.id=? AND jobs.tasks IS NOT NULL",
                (at, job_id, at, job_id),
            )
        # Marks after 'submitted' describe the attempt that ended; start afresh.
        self.db.execute(
            "UPDATE jobs SET state='queued', worker=NULL, slots='[]', gpus='[]', pid=NULL, pid_created=NULL, tasks=NULL, start=NULL, began=NULL, finished=NULL, owner=?, "
            "reason=?, attempt=COALESCE(?, attempt), given_back=COALESCE(?, given_back), "
            "marks=json_patch(json_object('submitted', json_extract(marks, '$.submitted')), ?) "
            "WHERE id=?",
            (
                owner,
                reason,
                attempt,
                given_back,
                _encode({} if retry_at is None else {"retry_at": retry_at}).decode(),
                job_id,
            ),
        )

    def append_logs(self, job_id: str, attempt: int, lines: Sequence[LogLine]) -> None:
        if lines:
            self.db.execute(
                "INSERT OR REPLACE INTO log_batches (job_id, attempt, first_seq, last_seq, lines) "
                "VALUES (?,?,?,?,?)",
                (job_id, attempt, lines[0].seq, lines[-1].seq, _encode(lines)),
            )

    def cancel_queued(self, job_id: str, at: float) -> bool:
        return (
            self.db.execute(
                "UPDATE jobs SET state='cancelled', cancel_requested=1, reason='cancelled while queued', "
                "finished=?, marks=json_set(marks, '$.finished', json(?)) WHERE id=? AND state='queued'",
                (at, _encode(at), job_id),
            ).rowcount
            == 1
        )

    def request_cancel(self, job_id: str) -> None:
        self.db.execute("UPDATE jobs SET cancel_requested=1 WHERE id=?", (job_id,))

    def adopt(self, from_owner: str, to_owner: str, *, workers: bool) -> list[str]:
        self.db.execute(
            "UPDATE jobs SET owner=? WHERE state='running' AND owner=?", (to_owner, from_owner)
        )
        rows = self.db.execute(
            "UPDATE jobs SET owner=? WHERE state='queued' AND owner=? RETURNING id",
            (to_owner, from_owner),
        ).fetchall()
        if workers:
            for wid, info in self.db.execute(
                "SELECT id, info FROM workers WHERE instance=?", (from_owner,)
            ).fetchall():
                worker = _decode_worker(info)
                worker.instance = to_owner
                self.db.execute(
                    "UPDATE workers SET instance=?, info=? WHERE id=?",
                    (to_owner, _encode(worker), wid),
                )
        else:
            self.db.execute("DELETE FROM workers WHERE instance=?", (from_owner,))
        return [r[0] for r in rows]

    def upsert_worker(
        self, worker: WorkerInfo, *, token_digest: str | None = None, at: float = 0.0
    ) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO workers (id, instance, info, token_digest) VALUES (?,?,?,?)",
            (worker.id, worker.instance, _encode(worker), token_digest),
        )
        if token_digest is not None:  # kept after the worker is gone (see last_binding)
            self.db.execute(
                "INSERT INTO worker_tokens (worker_id, token_digest, since) VALUES (?,?,?) "
                "ON CONFLICT (worker_id) DO UPDATE SET token_digest=excluded.token_digest, "
                "since=excluded.since WHERE token_digest != excluded.token_digest",
                (worker.id, token_digest, at),
            )
        else:  # without auth: what it runs now is no token's
            self.db.execute("DELETE FROM worker_tokens WHERE worker_id=?", (worker.id,))

    def delete_worker(self, worker_id: str) -> None:
        self.db.execute("DELETE FROM workers WHERE id=?", (worker_id,))

    def delete_workers(self, instance: str) -> None:
        self.db.execute("DELETE FROM workers WHERE instance=?", (instance,))

    def grant_blobs(self, reader: str, digests: Iterable[str]) -> None:
        self.db.executemany(
            "INSERT INTO blob_readers (reader, digest) VALUES (?, ?) ON CONFLICT DO NOTHING",
            [(reader, digest) for digest in digests],
        )

    def delete_jobs_ended_before(self, cutoff: float) -> tuple[int, int]:
        final = ",".join(f"'{state}'" for state in sorted(FINAL_STATES))
        # A final job has its 'finished' mark; one from before marks were
        # kept falls back on when it was submitted. An array's task goes with
        # its array, never while the array runs: its end is one the array's counts.
        ids = [
            row[0]
            for row in self.db.execute(
                f"SELECT id FROM jobs WHERE state IN ({final}) AND COALESCE("
                "json_extract(marks, '$.finished'), json_extract(marks, '$.submitted'), 0) < ? "
                "AND (array_of IS NULL OR NOT EXISTS (SELECT 1 FROM jobs AS a "
                f"WHERE a.id = jobs.array_of AND a.state NOT IN ({final})))",
                (cutoff,),
            )
        ]
        if not ids:
            return 0, 0
        # The ids as one JSON array: any number in one statement each.
        chosen = "(SELECT value FROM json_each(?))"
        listed = _encode(ids)
        # A batch is a JSON array of lines (each an array): its length counts them.
        lines = self.db.execute(
            "SELECT COALESCE(SUM(json_array_length(CAST(lines AS TEXT))), 0) FROM log_batches "
            f"WHERE job_id IN {chosen}",
            (listed,),
        ).fetchone()[0]
        for table in ("log_batches", "outputs", "past_tasks"):
            self.db.execute(f"DELETE FROM {table} WHERE job_id IN {chosen}", (listed,))
        # The state again: a job is never deleted unless final.
        jobs = self.db.execute(
            f"DELETE FROM jobs WHERE id IN {chosen} AND state IN ({final})", (listed,)
        ).rowcount
        return int(jobs), int(lines)

    def artifact_refs(self) -> set[tuple[str, str]]:
        # The spec is JSON text kept as a BLOB: cast (see list_jobs).
        rows = self.db.execute(
            "SELECT 'dir', json_extract(CAST(spec AS TEXT), '$.bundle') FROM jobs "
            "WHERE json_extract(CAST(spec AS TEXT), '$.bundle') IS NOT NULL "
            "UNION SELECT json_extract(i.value, '$.kind'), json_extract(i.value, '$.digest') "
            "FROM jobs, json_each(CAST(jobs.spec AS TEXT), '$.inputs') AS i "
            "UNION SELECT kind, digest FROM outputs "
            # A queued job's scratch: its next attempt lays it out.
            "UNION SELECT 'dir', json_extract(scratch, '$.digest') FROM jobs "
            "WHERE scratch IS NOT NULL"
        ).fetchall()
        return {(str(kind), str(digest)) for kind, digest in rows if digest is not None}


class _Guarded:
    """The store's lock, held around one use of its connection. A failure
    SQLite reports (an I/O error, a full disk, a damaged file) comes out as
    :class:`StoreError`, as a transaction's does: the server answers 503
    for it, and a worker keeps its report to send again."""

    __slots__ = ("_lock", "_path")

    def __init__(self, lock: threading.RLock, path: Path) -> None:
        self._lock = lock
        self._path = path

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        self._lock.release()
        if isinstance(exc, sqlite3.Error):
            raise StoreError(f"the job store at {self._path} failed: {exc}") from exc


class SqliteStore(Store):
    def __init__(self, path: Path, *, exclusive: bool = False) -> None:
        """``exclusive``: no other process will open this file while this
        store is open (a server's home is its own). SQLite then takes its
        locks once rather than around every transaction, and keeps the WAL
        index in memory rather than in a shared file."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # Exclusive: the lock is held from the first access on, so a
            # process using the file now will not let go; no use waiting long.
            self._db = sqlite3.connect(
                path,
                isolation_level=None,
                check_same_thread=False,
                timeout=_EXCLUSIVE_WAIT_S if exclusive else 30.0,
            )
            if exclusive:  # before the first access in WAL mode (SQLite's docs)
                self._db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error as exc:
            if exclusive and "locked" in str(exc):
                raise StoreError(
                    f"another process is using the job store at {path} (an embedded GPUlayer "
                    "client or worker on this home?); stop it first: a server needs its home "
                    "to itself"
                ) from None
            raise StoreError(f"cannot open the job store at {path}: {exc}") from None
        # One connection, used by one thread at a time: the control plane's
        # threads are few and each statement is short.
        self._lock = threading.RLock()
        self._guarded = _Guarded(self._lock, path)
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                version = self._db.execute("PRAGMA user_version").fetchone()[0]
                if version > LATEST:
                    raise StoreError(
                        f"the job store at {self.path} has schema version {version}, newer than "
                        f"this GPUlayer understands ({LATEST}); upgrade GPUlayer to use it"
                    )
                for number in range(version, LATEST):
                    for statement in MIGRATIONS[number]:
                        self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version = {number + 1}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @property
    def schema_version(self) -> int:
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """All or nothing. A write SQLite refuses (a full disk, an I/O error)
        raises :class:`StoreError`, with nothing written."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                yield _SqliteTransaction(self._db)
                self._db.execute("COMMIT")
            except BaseException as exc:
                if self._db.in_transaction:
                    # If even this fails, SQLite rolls back when the
                    # connection next begins, or when it closes.
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"the job store at {self.path} failed: {exc}") from exc
                raise

    def _outputs(self, job_ids: Sequence[str]) -> dict[str, dict[str, ArtifactRef]]:
        found: dict[str, dict[str, ArtifactRef]] = {}
        if not job_ids:
            return found
        marks = ",".join("?" * len(job_ids))
        for jid, path, kind, digest, size in self._db.execute(
            f"SELECT job_id, path, kind, digest, size FROM outputs WHERE job_id IN ({marks})",
            job_ids,
        ):
            found.setdefault(jid, {})[path] = ArtifactRef(kind=kind, digest=digest, size=size)
        return found

    def scratch_of(self, job_id: str) -> ArtifactRef | None:
        with self._guarded:
            row = self._db.execute("SELECT scratch FROM jobs WHERE id=?", (job_id,)).fetchone()
        return _decode_ref(row[0]) if row and row[0] is not None else None

    def get_job(
        self, job_id: str, *, user: str | None = None, projects: Collection[str] = ()
    ) -> JobInfo | None:
        # With ``user``, another user's row is never read: decoding its spec
        # would make "not yours" slower to answer than "no such job".
        sql = f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id=?"
        params: list[object] = [job_id]
        if user is not None:
            seen, more = _seen_by(user, projects)
            sql, params = f"{sql} AND {seen}", [job_id, *more]
        with self._guarded:
            row = self._db.execute(sql, params).fetchone()
            if row is None:
                return None
            return _job_from_row(row, self._outputs([job_id]).get(job_id, {}))

    def find_job(
        self, prefix: str, *, user: str | None = None, projects: Collection[str] = ()
    ) -> list[str]:
        # An array's tasks have ids that start as its own does (made in the
        # same millisecond): a start finds the array, a task only by its
        # whole id (or as JOB:7).
        sql = "SELECT id FROM jobs WHERE id >= ? AND id < ? AND (array_of IS NULL OR id = ?)"
        params: list[object] = [prefix, prefix + "\uffff", prefix]
        if user is not None:
            seen, more = _seen_by(user, projects)
            sql += f" AND {seen}"
            params += more
        with self._guarded:
            rows = self._db.execute(sql + " ORDER BY id LIMIT 2", params).fetchall()
        return [r[0] for r in rows]

    def list_jobs(
        self,
        *,
        states: Iterable[str] = (),
        owner: str | None = None,
        user: str | None = None,
        projects: Collection[str] = (),
        project: str | None = None,
        limit: int | None = None,
        labels: Mapping[str, str] | None = None,
        array: str | None = None,
        top_level: bool = False,
        submitter: str | None = None,
        text: str | None = None,
        offset: int = 0,
    ) -> list[JobInfo]:
        where: list[str] = []
        params: list[object] = []
        if submitter is not None:
            where.append("user_name = ?")
            params.append(submitter)
        if text:
            # Its name, script and command, case aside (ASCII, as LIKE does);
            # the text's own % and _ match only themselves.
            where.append(
                "(COALESCE(name, '') || ' ' || COALESCE(json_extract(CAST(spec AS TEXT), "
                "'$.script'), '') || ' ' || COALESCE(json_extract(CAST(spec AS TEXT), "
                "'$.command'), '')) LIKE ? ESCAPE '\\'"
            )
            escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            params.append(f"%{escaped}%")
        order = "seq DESC"
        if array is not None:
            where.append("array_of = ?")
            params.append(array)
            order = "array_index"
        elif top_level:
            where.append("array_of IS NULL")
        states = tuple(states)
        if states:
            where.append(f"state IN ({','.join('?' * len(states))})")
            params.extend(states)
        if owner is not None:
            where.append("owner = ?")
            params.append(owner)
        if user is not None:
            seen, more = _seen_by(user, projects)
            where.append(seen)
            params.extend(more)
        if project == DEFAULT_PROJECT:  # kept as NULL, or by its name
            where.append("(project IS NULL OR project = ?)")
            params.append(project)
        elif project is not None:
            where.append("project = ?")
            params.append(project)
        for key, value in (labels or {}).items():
            # Keys and values are bound, never spliced into a JSON path: a
            # key may hold any character ('.', '"', ']'). The spec is JSON
            # text kept as a BLOB; cast, since SQLite 3.45 reads a BLOB
            # given to its JSON functions as its binary JSONB.
            where.append(
                "EXISTS (SELECT 1 FROM json_each(CAST(jobs.spec AS TEXT), '$.labels') "
                "WHERE key = ? AND value = ?)"
            )
            params.extend((key, value))
        sql = f"SELECT {_JOB_COLUMNS} FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY {order}"
        if limit is not None or offset:
            sql += f" LIMIT {-1 if limit is None else int(limit)}"
        if offset:
            sql += f" OFFSET {int(offset)}"
        with self._guarded:
            rows = self._db.execute(sql, params).fetchall()
            outputs = self._outputs([r[0] for r in rows])
        return [_job_from_row(r, outputs.get(r[0], {})) for r in rows]

    def next_seq(self) -> int:
        with self._guarded:
            return int(self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0])

    def append_logs(
        self,
        job_id: str,
        attempt: int,
        lines: Sequence[LogLine],
        *,
        node: int = 0,
        node_last: int | None = None,
    ) -> None:
        if not lines:
            return
        with self._guarded:  # one statement: if it fails, nothing was written
            self._db.execute(
                "INSERT OR REPLACE INTO log_batches "
                "(job_id, attempt, first_seq, last_seq, lines, node, node_last) "
                "VALUES (?,?,?,?,?,?,?)",
                (job_id, attempt, lines[0].seq, lines[-1].seq, _encode(lines), node, node_last),
            )

    def node_lines(self, job_id: str, attempt: int) -> dict[int, int]:
        with self._guarded:
            rows = self._db.execute(
                "SELECT node, MAX(node_last) FROM log_batches "
                "WHERE job_id=? AND attempt=? AND node_last IS NOT NULL GROUP BY node",
                (job_id, attempt),
            ).fetchall()
        return {int(node): int(last) for node, last in rows}

    def last_binding(self, worker_id: str) -> tuple[str, float] | None:
        with self._guarded:
            row = self._db.execute(
                "SELECT token_digest, since FROM worker_tokens WHERE worker_id=?", (worker_id,)
            ).fetchone()
        return None if row is None else (str(row[0]), float(row[1]))

    def task_worker(self, job_id: str, attempt: int, node: int = 0) -> tuple[str, float] | None:
        with self._guarded:
            row = self._db.execute(
                "SELECT attempt, worker, tasks, json_extract(marks, '$.placed') FROM jobs WHERE id=?",
                (job_id,),
            ).fetchone()
            if row is None:
                return None
            current, worker, tasks, placed = row
            if current == attempt and (worker is not None or tasks is not None):
                if tasks is not None:
                    worker = next((t.worker for t in _decode_tasks(tasks) if t.node == node), None)
                elif node != 0:
                    worker = None
                return None if worker is None else (str(worker), float(placed or 0.0))
            past = self._db.execute(
                "SELECT worker, placed FROM past_tasks WHERE job_id=? AND attempt=? AND node=?",
                (job_id, attempt, node),
            ).fetchone()
        return None if past is None else (str(past[0]), float(past[1] or 0.0))

    def last_log_seq(self, job_id: str, attempt: int) -> int:
        with self._guarded:
            row = self._db.execute(
                "SELECT MAX(last_seq) FROM log_batches WHERE job_id=? AND attempt=?",
                (job_id, attempt),
            ).fetchone()
        return int(row[0] or 0)

    def read_logs(
        self, job_id: str, after: tuple[int, int] = (0, 0), limit: int = 10_000
    ) -> list[tuple[int, LogLine]]:
        found: list[tuple[int, LogLine]] = []
        with self._guarded:
            cursor = self._db.execute(
                "SELECT attempt, lines FROM log_batches WHERE job_id=? AND (attempt, last_seq) > (?, ?) "
                "ORDER BY attempt, first_seq",
                (job_id, after[0], after[1]),
            )
            for attempt, blob in cursor:
                for line in _decode_lines(blob):
                    if (attempt, line.seq) > after:
                        found.append((attempt, line))
                if len(found) >= limit:
                    break
        return found[:limit]

    def list_workers(self) -> list[WorkerInfo]:
        with self._guarded:
            rows = self._db.execute("SELECT info FROM workers ORDER BY id").fetchall()
        return [_decode_worker(r[0]) for r in rows]

    def owners(self) -> set[str]:
        with self._guarded:
            rows = self._db.execute(
                # Spelled as the partial index's condition, so the index serves it.
                "SELECT DISTINCT owner FROM jobs WHERE state IN ('queued', 'running') AND owner IS NOT NULL "
                "UNION SELECT DISTINCT instance FROM workers WHERE instance IS NOT NULL"
            ).fetchall()
        return {r[0] for r in rows}

    def count_by_state(self) -> dict[str, int]:
        # Jobs that run: an array is counted by its tasks, not as one more.
        with self._guarded:
            rows = self._db.execute(
                "SELECT state, COUNT(*) FROM jobs WHERE array_size IS NULL GROUP BY state"
            ).fetchall()
        return {str(state): int(n) for state, n in rows}

    def array_counts(self, array_ids: Collection[str]) -> dict[str, dict[str, int]]:
        ids = list(dict.fromkeys(array_ids))
        counts: dict[str, dict[str, int]] = {i: {} for i in ids}
        for start in range(0, len(ids), 500):  # within SQLite's bound parameters
            chunk = ids[start : start + 500]
            with self._guarded:
                rows = self._db.execute(
                    "SELECT array_of, state, COUNT(*) FROM jobs WHERE array_of IN "
                    f"({','.join('?' * len(chunk))}) GROUP BY array_of, state",
                    chunk,
                ).fetchall()
            for array_id, state, n in rows:
                counts[str(array_id)][str(state)] = int(n)
        return counts

    def array_task(self, array_id: str, index: int) -> str | None:
        with self._guarded:
            row = self._db.execute(
                "SELECT id FROM jobs WHERE array_of=? AND array_index=?", (array_id, index)
            ).fetchone()
        return None if row is None else str(row[0])

    def array_members(self, array_id: str) -> list[tuple[str, str]]:
        with self._guarded:
            rows = self._db.execute(
                "SELECT id, state FROM jobs WHERE array_of=? ORDER BY array_index", (array_id,)
            ).fetchall()
        return [(str(i), str(s)) for i, s in rows]

    def add_token(
        self,
        digest: str,
        role: str,
        name: str | None,
        created: float,
        expires: float | None = None,
        *,
        user: str | None = None,
    ) -> None:
        with self._guarded:
            self._db.execute(
                "INSERT INTO tokens (digest, role, name, created, expires, user_name) "
                "VALUES (?,?,?,?,?,?)",
                (digest, role, name, created, expires, user),
            )

    def token_role(self, digest: str) -> tuple[str, float | None] | None:
        with self._guarded:
            row = self._db.execute(
                "SELECT role, expires FROM tokens WHERE digest=?", (digest,)
            ).fetchone()
        return None if row is None else (str(row[0]), None if row[1] is None else float(row[1]))

    def token_user(self, digest: str) -> str | None:
        with self._guarded:
            row = self._db.execute(
                "SELECT user_name FROM tokens WHERE digest=?", (digest,)
            ).fetchone()
        return None if row is None or row[0] is None else str(row[0])

    def token_users(self) -> dict[str, str]:
        with self._guarded:
            rows = self._db.execute(
                "SELECT digest, user_name FROM tokens WHERE user_name IS NOT NULL"
            ).fetchall()
        return {str(digest): str(user) for digest, user in rows}

    def count_tokens(self, role: str) -> int:
        with self._guarded:
            return int(
                self._db.execute("SELECT COUNT(*) FROM tokens WHERE role=?", (role,)).fetchone()[0]
            )

    def list_tokens(self) -> list[tuple[str, str, str | None, float, float | None]]:
        with self._guarded:
            rows = self._db.execute(
                "SELECT digest, role, name, created, expires FROM tokens ORDER BY created, digest"
            ).fetchall()
        return [
            (str(d), str(role), name, float(created), None if expires is None else float(expires))
            for d, role, name, created, expires in rows
        ]

    def readable_blobs(self, reader: str, digests: Collection[str]) -> set[str]:
        if not digests:
            return set()
        # The digests as one JSON array: one statement for any number (bound
        # parameters are limited), each looked up in the primary key.
        with self._guarded:
            rows = self._db.execute(
                "SELECT digest FROM blob_readers WHERE reader = ? "
                "AND digest IN (SELECT value FROM json_each(?))",
                (reader, _encode(list(digests))),
            ).fetchall()
        return {str(row[0]) for row in rows}

    def worker_bindings(self) -> dict[str, str]:
        with self._guarded:
            rows = self._db.execute(
                "SELECT id, token_digest FROM workers WHERE token_digest IS NOT NULL"
            ).fetchall()
        return {str(worker): str(digest) for worker, digest in rows}

    def delete_token(self, digest: str, *, keep_last: str | None = None) -> bool:
        with self._guarded:
            return (
                self._db.execute(
                    "DELETE FROM tokens WHERE digest=? AND (role IS NOT ? OR expires IS NOT NULL "
                    "OR (SELECT COUNT(*) FROM tokens WHERE role=? AND expires IS NULL) > 1)",
                    (digest, keep_last, keep_last),
                ).rowcount
                == 1
            )

    def gpu_seconds(
        self, since: Sequence[float], until: float
    ) -> dict[tuple[str, str | None], list[float]]:
        # Two index ranges (jobs_by_finished, which covers every column read
        # here, and past_tasks_by_ended), summed in SQLite: the rows never
        # leave it. An attempt began when it was placed: its GPUs were held
        # from then (one never placed, cancelled while queued, held none).
        if not since:
            return {}
        sums = ", ".join(
            "SUM(gpus * MAX(0.0, MIN(ended, ?) - MAX(COALESCE(began, ended), ?)))" for _ in since
        )
        params: list[object] = []
        for start in since:
            params.extend((until, start))
        low = min(since)
        sql = (
            f"SELECT project, user_name, {sums} FROM ("
            "SELECT project, user_name, gpu_demand AS gpus, finished AS ended, began FROM jobs "
            "WHERE finished >= ? AND finished <= ? AND gpu_demand > 0 "
            "UNION ALL SELECT j.project, j.user_name, j.gpu_demand, p.ended, p.placed "
            "FROM past_tasks AS p JOIN jobs AS j ON j.id = p.job_id "
            "WHERE p.ended >= ? AND p.ended <= ? AND p.node = 0 AND j.gpu_demand > 0"
            ") GROUP BY project, user_name"
        )
        with self._guarded:
            rows = self._db.execute(sql, [*params, low, until, low, until]).fetchall()
        found: dict[tuple[str, str | None], list[float]] = {}
        for project, user, *seconds in rows:
            key = (DEFAULT_PROJECT if project is None else str(project), user)
            got = [float(x or 0.0) for x in seconds]
            if key in found:  # a NULL project and one named "default" (list_jobs allows both)
                got = [a + b for a, b in zip(found[key], got, strict=True)]
            found[key] = got
        return found

    # ---- projects ----

    def create_project(self, info: ProjectInfo) -> bool:
        with self.transaction():
            made = self._db.execute(
                "INSERT INTO projects (name, gpu_quota, slot_quota, created) VALUES (?,?,?,?) "
                "ON CONFLICT (name) DO NOTHING",
                (info.name, info.gpus, info.slots, info.created),
            ).rowcount
            if made != 1:
                return False
            self._db.executemany(
                "INSERT INTO project_members (project, user_name, added) VALUES (?,?,?) "
                "ON CONFLICT DO NOTHING",
                [(info.name, user, info.created) for user in info.members],
            )
        return True

    def set_project_quota(
        self,
        name: str,
        *,
        gpus: int | UnsetType | None = UNSET,
        slots: int | UnsetType | None = UNSET,
    ) -> bool:
        columns = [
            (column, value)
            for column, value in (("gpu_quota", gpus), ("slot_quota", slots))
            if value is not UNSET
        ]
        with self._guarded:
            if not columns:
                return self._project_exists(name)
            assignments = ", ".join(f"{column} = ?" for column, _ in columns)
            return (
                self._db.execute(
                    f"UPDATE projects SET {assignments} WHERE name = ?",
                    [*(value for _, value in columns), name],
                ).rowcount
                == 1
            )

    def _project_exists(self, name: str) -> bool:
        return (
            self._db.execute("SELECT 1 FROM projects WHERE name = ?", (name,)).fetchone()
            is not None
        )

    def add_project_member(self, project: str, user: str, added: float) -> bool:
        with self.transaction():
            if not self._project_exists(project):
                return False
            self._db.execute(
                "INSERT INTO project_members (project, user_name, added) VALUES (?,?,?) "
                "ON CONFLICT DO NOTHING",
                (project, user, added),
            )
        return True

    def remove_project_member(self, project: str, user: str) -> bool:
        with self._guarded:
            return (
                self._db.execute(
                    "DELETE FROM project_members WHERE project = ? AND user_name = ?",
                    (project, user),
                ).rowcount
                == 1
            )

    def delete_project(self, name: str) -> bool:
        with self.transaction():
            if not self._project_exists(name):
                return False
            # jobs_by_project finds its jobs; a job not final keeps the project.
            (active,) = self._db.execute(
                f"SELECT COUNT(*) FROM jobs WHERE project = ? AND {_NOT_FINAL}", (name,)
            ).fetchone()
            if active:
                raise InvalidStateError(
                    f"project {name} has {active} job{'s' if active != 1 else ''} that "
                    f"{'are' if active != 1 else 'is'} not final (queued or running); cancel "
                    "them, or wait for them to end, then delete it"
                )
            self._db.execute(
                "UPDATE jobs SET project = ? || project WHERE project = ?", (_DELETED, name)
            )
            self._db.execute("DELETE FROM project_members WHERE project = ?", (name,))
            self._db.execute("DELETE FROM project_usage WHERE project = ?", (name,))
            self._db.execute("DELETE FROM projects WHERE name = ?", (name,))
        return True

    def list_projects(self) -> list[ProjectInfo]:
        with self._guarded:
            rows = self._db.execute(
                "SELECT name, gpu_quota, slot_quota, created FROM projects ORDER BY created, name"
            ).fetchall()
            members = self.project_members()
        found = {
            str(name): ProjectInfo(
                name=str(name),
                gpus=None if gpus is None else int(gpus),
                slots=None if slots is None else int(slots),
                created=float(created),
                members=[],
            )
            for name, gpus, slots, created in rows
        }
        for name, user in members:
            if name in found:
                found[name].members.append(user)
        return list(found.values())

    def project_members(self) -> list[tuple[str, str]]:
        with self._guarded:
            rows = self._db.execute(
                # rowid: in the order added, also for two added at one time.
                "SELECT project, user_name FROM project_members ORDER BY added, rowid"
            ).fetchall()
        return [(str(project), str(user)) for project, user in rows]

    def load_usage(self) -> dict[str, tuple[float, float]]:
        with self._guarded:
            rows = self._db.execute("SELECT project, usage, at FROM project_usage").fetchall()
        return {str(project): (float(usage), float(at)) for project, usage, at in rows}

    def save_usage(self, project: str, usage: float, at: float) -> None:
        with self._guarded:
            _save_usage(self._db, project, usage, at)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _save_usage(db: sqlite3.Connection, project: str, usage: float, at: float) -> None:
    db.execute(
        "INSERT INTO project_usage (project, usage, at) VALUES (?,?,?) "
        "ON CONFLICT (project) DO UPDATE SET usage = excluded.usage, at = excluded.at",
        (project, usage, at),
    )
