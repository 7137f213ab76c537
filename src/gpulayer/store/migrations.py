"""The SQLite schema, as numbered migrations.

``PRAGMA user_version`` records how many have been applied. A migration is
never edited once released: add a new one. A database newer than this code is
refused rather than misread.
"""

from __future__ import annotations

# Each migration is a tuple of statements, run in one transaction.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: jobs, their logs and outputs, workers.
    (
        """
        CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        seq INTEGER NOT NULL,
        name TEXT,
        state TEXT NOT NULL,
        priority INTEGER NOT NULL,
        spec BLOB NOT NULL,
        attempt INTEGER NOT NULL DEFAULT 0,
        owner TEXT,
        worker TEXT,
        slots TEXT NOT NULL DEFAULT '[]',
        gpus TEXT NOT NULL DEFAULT '[]',
        exit_code INTEGER,
        reason TEXT,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        pid INTEGER,
        pid_created REAL,
        marks TEXT NOT NULL DEFAULT '{}'
        )
        """,
        """
        CREATE INDEX jobs_by_seq ON jobs (seq)
        """,
        """
        -- Only jobs that are not final need finding by owner (recovery): a
        -- partial index keeps every other write from paying for it.
        CREATE INDEX jobs_active_by_owner ON jobs (owner) WHERE state IN ('queued', 'running')
        """,
        """
        -- Logs are kept in the batches workers send them in (one row per
        -- batch, lines encoded together): a job printing a million lines
        -- costs a few dozen rows, not a million. A batch re-sent with more
        -- lines after a lost reply replaces the first (same first_seq).
        CREATE TABLE log_batches (
        job_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        first_seq INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        lines BLOB NOT NULL,
        PRIMARY KEY (job_id, attempt, first_seq)
        ) WITHOUT ROWID
        """,
        """
        CREATE TABLE outputs (
        job_id TEXT NOT NULL,
        path TEXT NOT NULL,
        kind TEXT NOT NULL,
        digest TEXT NOT NULL,
        size INTEGER NOT NULL,
        PRIMARY KEY (job_id, path)
        ) WITHOUT ROWID
        """,
        """
        CREATE TABLE workers (
        id TEXT PRIMARY KEY,
        instance TEXT,
        info BLOB NOT NULL
        )
        """,
    ),
    # 2: API tokens for server mode (only their sha256 is kept).
    (
        """
        CREATE TABLE tokens (
            digest TEXT PRIMARY KEY,
            role TEXT NOT NULL,
            name TEXT,
            created REAL NOT NULL
        )
        """,
    ),
    # 3: the tasks of jobs of several nodes (JSON, one entry per node).
    (
        """
        ALTER TABLE jobs ADD COLUMN tasks TEXT
        """,
    ),
    # 4: which node of a job of several sent each log batch, and the last
    # line of it in that node's own numbering (the server numbers the lines
    # anew): a restarted server must know which lines a node re-sends.
    (
        """
        ALTER TABLE log_batches ADD COLUMN node INTEGER NOT NULL DEFAULT 0
        """,
        """
        ALTER TABLE log_batches ADD COLUMN node_last INTEGER
        """,
    ),
    # 5: attempts given back unrun by a stopping worker, which do not count
    # against a job's retries (a node of a job of several).
    (
        """
        ALTER TABLE jobs ADD COLUMN given_back INTEGER NOT NULL DEFAULT 0
        """,
    ),
    # 6: the sha256 of the token that registered each worker (NULL without
    # auth): after a restart no other worker token acts for it, and revoking
    # the token removes it. Written and deleted with the worker's row.
    (
        """
        ALTER TABLE workers ADD COLUMN token_digest TEXT
        """,
    ),
    # 7: when a token stops being valid (seconds since the epoch; NULL: never).
    (
        """
        ALTER TABLE tokens ADD COLUMN expires REAL
        """,
    ),
    # 8: a worker token adds log lines only to tasks placed on its worker
    # while it was registered with that token, late ones included (its
    # worker cut off, declared lost, its job retried): which worker ran each
    # node of an attempt that ended in a retry, and when it was placed (the
    # job's row holds only its current attempt's); and the token each worker
    # last registered with, since when, kept after the worker is gone.
    (
        """
        CREATE TABLE past_tasks (
            job_id  TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            node    INTEGER NOT NULL,
            worker  TEXT NOT NULL,
            placed  REAL,
            PRIMARY KEY (job_id, attempt, node)
        ) WITHOUT ROWID
        """,
        """
        CREATE TABLE worker_tokens (
            worker_id    TEXT PRIMARY KEY,
            token_digest TEXT NOT NULL,
            since        REAL NOT NULL
        ) WITHOUT ROWID
        """,
        """
        INSERT INTO worker_tokens (worker_id, token_digest, since)
        SELECT id, token_digest, CAST(strftime('%s', 'now') AS REAL) FROM workers
        WHERE token_digest IS NOT NULL
        """,
    ),
    # 9: ownership. Each job keeps the user who submitted it, and each token
    # the user it acts as. Jobs from before have no user (NULL): which token
    # made them was never kept, so only admins see them. A user token from
    # before becomes a user of its own, "legacy-<its id>", never one that
    # sees every job; an admin can make its holder a token with a real user.
    # (``user_name``, not ``user``: a reserved word in PostgreSQL.)
    (
        """
        ALTER TABLE jobs ADD COLUMN user_name TEXT
        """,
        """
        -- A user's listing reads only that user's jobs, newest first.
        CREATE INDEX jobs_by_user ON jobs (user_name, seq)
        """,
        """
        ALTER TABLE tokens ADD COLUMN user_name TEXT
        """,
        """
        UPDATE tokens SET user_name = 'legacy-' || substr(digest, 1, 12) WHERE role = 'user'
        """,
    ),
    # 10: who may read each blob, beside admins (and workers, for their
    # tasks): a user who uploaded its bytes, or whose job produced it. A
    # digest alone is no right to read: it can be guessed. ``reader`` is a
    # user name, or ``~worker:`` and the sha256 of a worker token, for the
    # blobs that token uploaded (the only outputs its results may name for
    # a user to read). Nothing is taken over from before: users' jobs start
    # with 9, and a blob stored earlier becomes a user's once they upload it.
    (
        """
        CREATE TABLE IF NOT EXISTS blob_readers (
            reader TEXT NOT NULL,
            digest TEXT NOT NULL,
            PRIMARY KEY (reader, digest)
        ) WITHOUT ROWID
        """,
    ),
    # 11: how the current attempt's processes started: "warm" (forked from
    # the worker's ready interpreter) or "cold: <why>" (jobs.job_start). Jobs
    # from before, and from workers that do not say, have NULL: not known.
    # A job of several nodes keeps each node's in its task's entry too.
    (
        """
        ALTER TABLE jobs ADD COLUMN start TEXT
        """,
    ),
    # 12: projects (projects.py): the teams an admin makes, each with its
    # quota (NULL: no limit), its members in the order they were added, and
    # its recent usage for fair share (decayed GPU-seconds as of ``at``).
    # Each job keeps its project; NULL is the default project (every job
    # from before, and every one submitted where none is set up).
    (
        """
        CREATE TABLE projects (
            name       TEXT PRIMARY KEY,
            gpu_quota  INTEGER NULL,
            slot_quota INTEGER NULL,
            created    REAL NOT NULL
        )
        """,
        """
        CREATE TABLE project_members (
            project   TEXT NOT NULL,
            user_name TEXT NOT NULL,
            added     REAL NOT NULL,
            PRIMARY KEY (project, user_name)
        )
        """,
        """
        CREATE TABLE project_usage (
            project TEXT PRIMARY KEY,
            usage   REAL NOT NULL,
            at      REAL NOT NULL
        )
        """,
        """
        ALTER TABLE jobs ADD COLUMN project TEXT
        """,
        """
        -- A member's listing reads the jobs of the user's projects, newest
        -- first, beside its own (jobs_by_user); and a project's, to delete it.
        CREATE INDEX jobs_by_project ON jobs (project, seq)
        """,
    ),
    # 13: usage by project over a window (``gpulayer usage``): when each job
    # became final, a real column (the marks are JSON, which no index
    # reads); when its current attempt was placed; and the GPUs it holds
    # while it runs (its spec's gpus x nodes). One index on when it became
    # final covers what the usage query reads, so the jobs that ended in
    # the last week are a range of the index, never a read of their rows.
    # And when each attempt that ended in a retry or a preemption ended
    # (``past_tasks`` kept only where it ran). Jobs from before get theirs
    # from their marks and spec; their earlier attempts' ends were never
    # kept (NULL: not counted).
    (
        """
        ALTER TABLE jobs ADD COLUMN finished REAL
        """,
        """
        ALTER TABLE jobs ADD COLUMN began REAL
        """,
        """
        ALTER TABLE jobs ADD COLUMN gpu_demand INTEGER NOT NULL DEFAULT 0
        """,
        """
        UPDATE jobs SET
            began = json_extract(marks, '$.placed'),
            finished = CASE WHEN state IN ('queued', 'running') THEN NULL
                ELSE json_extract(marks, '$.finished') END,
            gpu_demand = COALESCE(json_extract(CAST(spec AS TEXT), '$.gpus'), 0)
                * COALESCE(json_extract(CAST(spec AS TEXT), '$.nodes'), 1)
        """,
        """
        -- Partial: a job not final yet (NULL) has no entry, and every
        -- comparison on finished implies NOT NULL, so a range query uses it.
        CREATE INDEX jobs_by_finished ON jobs (finished, gpu_demand, project, user_name, began)
        WHERE finished IS NOT NULL
        """,
        """
        ALTER TABLE past_tasks ADD COLUMN ended REAL
        """,
        """
        CREATE INDEX past_tasks_by_ended ON past_tasks (ended, node, placed)
        WHERE ended IS NOT NULL
        """,
    ),
    # 14: what a job's last attempt left in its scratch folder (a folder
    # ArtifactRef as JSON), for its next attempt, through a restart of the
    # control plane; NULL: nothing kept. Cleared when the job ends.
    (
        """
        ALTER TABLE jobs ADD COLUMN scratch TEXT
        """,
    ),
    # 15: arrays (arrays.py). A task's row names its array and its index
    # there; an array's own row, how many tasks it has (NULL: not an array).
    # One index finds an array's tasks, by index.
    (
        """
        ALTER TABLE jobs ADD COLUMN array_of TEXT
        """,
        """
        ALTER TABLE jobs ADD COLUMN array_index INTEGER
        """,
        """
        ALTER TABLE jobs ADD COLUMN array_size INTEGER
        """,
        """
        CREATE INDEX jobs_in_array ON jobs (array_of, array_index) WHERE array_of IS NOT NULL
        """,
    ),
)

LATEST = len(MIGRATIONS)
