"""Every default GPUlayer uses, in one place, each with the reason for its value.

Precedence everywhere: explicit argument, then environment variable, then this
module's default.
"""

from __future__ import annotations

# Where state lives when neither an argument nor $GPULAYER_HOME says otherwise.
HOME_DIRNAME = ".gpulayer"
HOME_ENV = "GPULAYER_HOME"
# A file that marks a directory as a GPUlayer home, so bundles never ship one.
HOME_MARKER = ".gpulayer-home"
DB_FILENAME = "gpulayer.db"
# The key that seals job secrets at rest, beside the job store in the home
# (a copy of the database without it reveals no secret); made on first use.
SECRETS_KEY_FILENAME = "secrets.key"

# Where a process finds its API token, and a file holding one. A worker takes
# them out of its jobs' environment (a token is the worker's, not its jobs').
TOKEN_ENV = "GPULAYER_TOKEN"
TOKEN_FILE_ENV = "GPULAYER_TOKEN_FILE"

# Outputs and logs fetched by a client land beside the user's script here.
RUNS_DIRNAME = "gpulayer_runs"

# How long a worker's long poll waits before it returns empty and loops. Long
# enough to cost nothing when idle, short enough to notice a stop request.
ACQUIRE_TIMEOUT_S = 30.0

# The log sender batches lines for this long, so a chatty job costs one write
# per quarter second instead of one per line, and never waits on the network.
LOG_BATCH_INTERVAL_S = 0.25
# Lines waiting to be sent, per task. At half of this the sender goes at once
# instead of waiting out the interval; beyond it (the control plane cannot
# keep up) the oldest unsent lines are dropped and the drop is reported in the
# log, so memory stays bounded.
LOG_BUFFER_MAX_LINES = 50_000
# How long a full buffer holds a job's output back while the control plane
# is answering but behind, before lines are dropped after all.
LOG_BACKPRESSURE_MAX_S = 5.0
# A single line longer than this is cut (a job printing a 1 GB line must not
# take 1 GB of the worker's memory).
LOG_LINE_MAX_BYTES = 64 * 1024
# A worker sends a task's waiting lines in requests whose JSON takes at most
# this much: under the body limit of a proxy in front of the server (nginx
# takes 1 MiB unless told otherwise, and may refuse a bigger body by closing
# at once).
LOG_BATCH_MAX_BYTES = 960 * 1024
# The largest JSON request body the server reads (blobs are streamed, and
# have no such limit); what can be longer is sent in parts.
JSON_BODY_MAX_BYTES = 1024 * 1024
# What the server reads of each kind of worker report; a body past its limit
# is refused (413) on its Content-Length, or as soon as it streams past it,
# never read further. Register, heartbeat, started and rendezvous carry ids
# and numbers: about 30 bytes per slot or task, so 1 MiB holds a worker of
# some 35,000 busy slots.
REPORT_MAX_BYTES = 1024 * 1024
# A batch of log lines: the sender keeps each within LOG_BATCH_MAX_BYTES; this
# leaves room for the batch's own fields.
LOG_REPORT_MAX_BYTES = 2 * 1024 * 1024
# A task's result: its outputs take an entry (about 100 bytes and the path)
# per file a glob matched, so 16 MiB holds some 100,000 files (a folder output
# is one entry). A worker whose result would not fit reports the task failed
# instead, saying why (see transport/http.py).
RESULT_REPORT_MAX_BYTES = 16 * 1024 * 1024
# A submit: a spec is at most 256 KiB of JSON (spec.MAX_SPEC_BYTES); this
# leaves room for JSON escapes, so most refused specs are refused with the
# field named.
SUBMIT_MAX_BYTES = 2 * 1024 * 1024
# Digests asked about in one request for the blobs a server lacks.
MISSING_BLOBS_PER_REQUEST = 50_000
# ...whose request body is then at most this (a digest and its quotes, 67 bytes).
BLOB_LIST_MAX_BYTES = 4 * 1024 * 1024
# Jobs in one listing: each may be a 256 KiB spec, so a listing is bounded.
LIST_JOBS_MAX = 1000
# Jobs `gpulayer jobs` lists unless --limit says otherwise: a screenful or two.
JOBS_LISTED = 50
# How many trailing stderr lines a failed job's error message carries.
STDERR_TAIL_LINES = 20
# ...each cut at this many characters.
STDERR_TAIL_LINE_MAX = 1000

# A job's retry (``max_retries``) waits this long after its first failed
# attempt, twice as long after the next, and so on up to the cap: a job that
# fails at once (a missing file, a dependency down) does not spin through
# its retries in a second. A job's ``retry_delay`` replaces the first wait
# (0: retry at once); the cap holds unless that first wait is longer.
RETRY_DELAY_S = 1.0
RETRY_DELAY_MAX_S = 300.0

# Fair share (scheduler.py): a project's usage is GPU-seconds, halved every
# half-life (a day: yesterday's big run still counts, last week's hardly).
FAIR_SHARE_HALF_LIFE_S = 86400.0
# What holding a GPU now adds to its project's usage while ranking, so that
# one placement pass shares free GPUs out between equal projects.
FAIR_SHARE_ENTRY_S = 60.0

# Cancel and timeout: SIGTERM, then this long to exit cleanly, then SIGKILL.
KILL_GRACE_S = 10.0
# After a job's main process exits, what it left running gets SIGTERM, and
# this long (to leave, or to close the pipes it holds) before SIGKILL.
PIPE_DRAIN_S = 2.0
# How a worker keeps every process a task starts, to end them all with it:
# "cgroup" (a cgroup v2 per task; an error where it cannot make one),
# "subreaper" (orphans come back to the worker), or "auto": the first that
# works. A Worker's own option wins over this variable.
CONTAINMENT_ENV = "GPULAYER_CONTAINMENT"
# A subreaper worker reaps its running tasks' dead orphans this often: each
# holds a pid until reaped, so a job making orphans fast holds at most what
# it makes in this time (a scan costs some 20 us when there are none).
ORPHAN_REAP_S = 0.05

# A bundle or input above this size gets a warning: it is uploaded at every
# launch unless unchanged.
LARGE_BUNDLE_BYTES = 100 * 1024 * 1024
# Materialising a bundle file or an input into a workspace: smaller files are
# copied (as cheap as a clone), larger ones cloned (copy-on-write) where the
# filesystem can, else copied too: the job's user owns the copy and may edit
# it, never the cache's blob. Only where the job's user cannot write the blob
# (run as another Unix user) are they hard-linked to it instead, read-only:
# a link shares the blob's inode, and its owner could chmod it and edit every
# later job's bytes. Executables are always copied (a link cannot carry their
# own mode).
LINK_MIN_BYTES = 1024 * 1024
# A foreground `gpulayer run` whose job has not started after this long says
# why it waits, then looks again this often and says so when the reason changes.
WAIT_NOTICE_S = 2.0
WAIT_RECHECK_S = 1.0
# Storing more than this many new bytes shows a progress bar in the CLI.
PROGRESS_MIN_BYTES = 8 * 1024 * 1024

# Following logs of a job run by another process (embedded mode) re-reads the
# store this often; within one process, appends wake followers at once.
FOLLOW_RECHECK_S = 0.25
# Final records of recently ended jobs the control plane keeps in memory, so
# that waiting on a job that has just ended reads no store.
FINISHED_JOBS_KEPT = 4096
# Waiting on one job also asks about up to this many of the client's other
# unfinished jobs (oldest first), whose ends come with the reply.
WAIT_ALSO_MAX = 64
# Blob digests listed in recent manifests that the server keeps, to check
# workers' fetches without reading a tree's manifest again for each file
# (about 150 bytes each).
MANIFEST_DIGESTS_KEPT = 200_000

# Server mode.
SERVER_PORT = 8585
# The user an embedded home's jobs belong to when the OS login name is not a
# valid user name (see access.py); embedded, that user sees every job.
LOCAL_USER = "local"
# Workers heartbeat this often; one silent for the timeout is declared lost
# and its tasks retried elsewhere (within their budget) or ended ``lost``.
HEARTBEAT_INTERVAL_S = 5.0
HEARTBEAT_TIMEOUT_S = 30.0
# A killed worker's warden tells the server it is gone in one try this long
# (else the server finds out when its heartbeats stop).
WARDEN_GOODBYE_TIMEOUT_S = 3.0
# A worker that cannot reach the server retries with backoff up to this.
RECONNECT_MAX_S = 10.0
# A client's long poll (following a job's logs, waiting for a job) rides out
# a server that is away (restarting, a dropped connection) this long in all,
# trying again with back-off, before it gives up with ServerUnreachable:
# long enough for a server's restart or a short network cut, short enough
# that a script whose server is gone for good ends. Set it with
# GPULAYER_RECONNECT_GIVE_UP_S or Client(reconnect_give_up=...).
RECONNECT_GIVE_UP_S = 300.0
# The pause between those tries doubles from the first, up to the most (or
# as long as the server's Retry-After asks, within the most).
RECONNECT_PAUSE_FIRST_S = 0.25
RECONNECT_PAUSE_MAX_S = 5.0
# The Retry-After (whole seconds) a server that is shutting down answers its
# open long polls and new requests with: about what a restart takes.
SHUTDOWN_RETRY_AFTER_S = 2
# Instructions sent to a worker over HTTP and not yet acknowledged, kept to
# send again; beyond this many (a worker that never acknowledges), the oldest go.
UNACKED_MAX = 10_000
# A task that ends while the server is unreachable keeps trying to store its
# outputs this long before it is reported as failed.
OUTPUT_UPLOAD_PATIENCE_S = 600.0
# The most a job's declared outputs may total (apparent sizes: a sparse file
# counts in full, as it is stored and downloaded in full); beyond it the job
# fails and nothing is stored. Every byte goes to the control plane's disk,
# and by default to the client's on download. 10 GiB holds the bf16 weights
# of a 5-billion-parameter model, or the whole training state (fp32 weights
# and Adam moments, 12 bytes a parameter) of one of 900 million, while one
# runaway job cannot fill a server's disk unnoticed. Bigger files belong on
# shared storage. `gpulayer worker start --max-output-bytes` sets it.
MAX_OUTPUT_BYTES = 10 * 1024**3
# The most files, folders and links a job's outputs may hold, all together.
# Each file is a blob to store (a sync each) and, on download, one to fetch
# (a request each over HTTP), and a folder's manifest (about 150 bytes an
# entry) is read whole by the worker and each client: 100,000 tiny files
# are a 15 MB manifest, 55 s to store and 5 s to download embedded (one
# core). A million-file output (a preprocessed dataset) is plausible, but
# belongs in shards (tar, webdataset) or on shared storage.
MAX_OUTPUT_ENTRIES = 100_000
# The most folders deep an output's path may be, from the workspace. Real
# trees are a few levels deep, rarely 30 (build trees, packages); the walk
# holds one descriptor per level, and several tasks may collect at once
# under the worker's one limit (1,024 by default): 16 at 64 deep is 1,040.
MAX_OUTPUT_DEPTH = 64
# The longest an output's path may be, from the workspace (UTF-8 bytes): a
# client writes it under its download folder, and PATH_MAX is 4,096 bytes
# on Linux, its NUL included: 3,840 leaves 255 for the download folder. No
# name in it may be longer than NAME_MAX, 255 bytes.
MAX_OUTPUT_PATH_BYTES = 3840
MAX_OUTPUT_NAME_BYTES = 255
# The server freezes long-lived objects out of the garbage collector's view
# this often, and runs a real full collection this often (see http/server.py).
GC_FREEZE_INTERVAL_S = 1.0  # gc.freeze() itself costs nothing: it moves a list
GC_FULL_INTERVAL_S = 600.0
# A remote worker reports a task's start once it has run this long; a task
# that ends sooner reports its start with its end, saving a request per job.
REPORT_STARTED_AFTER_S = 0.5

# `gpulayer gc`: jobs that ended longer ago than this are deleted, with their
# logs, unless --older-than says otherwise; then the blobs no job left names.
HOME_GC_OLDER_THAN_S = 7 * 86400.0
# What gc keeps whatever its age says: a blob stored or looked up this
# recently (a submit in flight may be about to name it: every submit looks up
# the blobs it names, see artifacts.USED_MARK_S), and a temp file written
# this recently (a blob being stored). No upload takes a day.
HOME_GC_RECENT_S = 86400.0
# Blobs to remove before `gpulayer gc` shows a progress bar.
HOME_GC_PROGRESS_MIN_BLOBS = 1000
