"""Jobs as data: states, the records the control plane hands out, and the pure
rules that decide a job's next state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec

from .spec import ArtifactRef, JobSpec

QUEUED = "queued"
RUNNING = "running"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"
TIMED_OUT = "timed_out"
LOST = "lost"
STATES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED, TIMED_OUT, LOST)
FINAL_STATES = frozenset({SUCCEEDED, FAILED, CANCELLED, TIMED_OUT, LOST})

# Why a worker's running jobs were taken from it, when it left the control plane.
WORKER_STOPPED = "its worker stopped"
WORKER_DIED = "its worker process died"

# How a task's processes started (``TaskStarted.start``, ``TaskResult.start``):
# WARM when every one was forked from its worker's ready interpreter, else
# "cold: <why in plain words>". The text is the worker's: it is kept cut to
# START_MAX characters (see clip_start) and escaped where it is shown.
WARM = "warm"
START_MAX = 500

# The moments in a job's life, in order; `timings` are the gaps between them.
MARKS = ("submitted", "placed", "acquired", "prepared", "started", "exited", "finished")
STAGES = {
    "queue": ("submitted", "placed"),  # waiting for capacity
    "dispatch": ("placed", "acquired"),  # the worker learns of its task
    "prepare": ("acquired", "prepared"),  # bundle, inputs, workspace
    "launch": ("prepared", "started"),  # process spawned
    "run": ("started", "exited"),  # the job's own time
    "finish": ("exited", "finished"),  # logs flushed, outputs stored, outcome recorded
    "total": ("submitted", "finished"),
}


class TaskInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One node's share of a distributed job: where it runs and its process."""

    node: int
    worker: str
    slots: list[int] = []
    gpus: list[int] = []
    pid: int | None = None
    pid_created: float | None = None
    procs: list[tuple[int, float | None]] = []  # every rank's (pid, start time)
    port: int | None = None  # node 0's: the master port it reserved
    start: str | None = None  # how its processes started: WARM or "cold: <why>"
    result: TaskResult | None = None  # how it ended, once it has (the job may run on)


class JobInfo(msgspec.Struct, kw_only=True):
    """A job as the store holds it; what clients see.

    ``worker``, ``slots``, ``gpus`` and ``pid`` describe the job's only task,
    or node 0's for a distributed job, whose every task is in ``tasks``.
    """

    id: str
    spec: JobSpec
    state: str = QUEUED
    seq: int = 0
    attempt: int = 0  # how many times it has been placed
    # Attempts a stopping worker gave back before the job could run (a node
    # of a job of several): they do not count against ``spec.max_retries``.
    given_back: int = 0
    owner: str | None = None  # the control-plane instance responsible for it
    # The user who submitted it, who alone (with admins) may see it (see
    # access.py). None: submitted before jobs had users, or with an
    # admin token that has none: only admins see it.
    user: str | None = None
    worker: str | None = None
    slots: list[int] = []
    gpus: list[int] = []
    exit_code: int | None = None
    reason: str | None = None  # why it waits, or why it failed
    cancel_requested: bool = False
    pid: int | None = None
    pid_created: float | None = None
    marks: dict[str, float] = {}
    outputs: dict[str, ArtifactRef] = {}
    tasks: list[TaskInfo] = []  # one per node, for distributed jobs
    # How its current attempt's processes started: WARM, or "cold: <why>"
    # (a job of several nodes: see job_start). None: not started yet, or
    # its worker predates warm starts.
    start: str | None = None
    # An array's tasks by state (arrays.py), as it was read; {} for a job
    # that is not an array.
    array_states: dict[str, int] = {}

    def processes(self) -> set[tuple[int, float | None]]:
        """Every (pid, start time) recorded for its running processes."""
        found = {(self.pid, self.pid_created)} if self.pid is not None else set()
        for task in self.tasks:
            if task.pid is not None:
                found.add((task.pid, task.pid_created))
            found.update((pid, created) for pid, created in task.procs)
        return found

    @property
    def done(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def counted(self) -> int:
        """Its attempts that count against ``spec.max_retries``."""
        return self.attempt - self.given_back

    def timings(self) -> dict[str, float]:
        return {
            stage: round(self.marks[end] - self.marks[start], 6)
            for stage, (start, end) in STAGES.items()
            if start in self.marks and end in self.marks
        }


# GPU figures (see worker/telemetry.py). A worker's token holder can send
# anything, so each figure is bounded to what a GPU can report: a heartbeat
# outside them is refused (the worker's sampler drops such a figure instead).
MAX_TELEMETRY_GPUS = 64  # GPUs a heartbeat reports on; more than any machine has
_Percent = Annotated[float, msgspec.Meta(ge=0, le=100)]
_Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**60)]  # an exbibyte


class GpuStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One GPU's figures at one moment; a figure its GPU does not report is None.

    Sent by its worker with a heartbeat, ``time`` left out: the server
    stamps each with its own clock as it arrives."""

    index: Annotated[int, msgspec.Meta(ge=0, le=1023)]  # as in CUDA_VISIBLE_DEVICES
    uuid: Annotated[str, msgspec.Meta(max_length=128)] | None = None
    name: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    utilization: _Percent | None = None  # of the last sample period the GPU was busy
    memory_used: _Bytes | None = None
    memory_total: _Bytes | None = None
    temperature: Annotated[float, msgspec.Meta(ge=-100, le=300)] | None = None  # °C
    power: Annotated[float, msgspec.Meta(ge=0, le=100_000)] | None = None  # W
    time: Annotated[float, msgspec.Meta(ge=0, le=1e11)] = 0.0  # seconds since the epoch


class WorkerInfo(msgspec.Struct, kw_only=True):
    id: str
    name: str
    host: str
    slot_gpus: list[int | None]
    gpu_vendor: Literal["nvidia", "amd"] | None = None
    gpu_names: list[str] = []
    # Where other machines reach this worker (node 0's is a distributed job's
    # MASTER_ADDR): the address it reaches the server from, unless overridden.
    address: str | None = None
    # How it keeps every process a job starts, to end them with the job:
    # "cgroup v2", "subreaper" or "process tree" (see worker/containment.py).
    containment: str | None = None
    instance: str | None = None
    started: float = 0.0
    last_seen: float = 0.0
    running: list[str] = []  # job ids; filled in by the service
    # Each GPU's latest figures, from its heartbeats; filled in by the service.
    gpu_stats: Annotated[list[GpuStats], msgspec.Meta(max_length=MAX_TELEMETRY_GPUS)] = []


class LogLine(msgspec.Struct, array_like=True, omit_defaults=True):
    seq: int
    ts: float
    stream: Literal["stdout", "stderr", "system"]
    text: str
    rank: int | None = None  # the rank that printed it, in a distributed job

    def render(self) -> str:
        """The line as shown to people: a distributed job's tagged with its rank."""
        return self.text if self.rank is None else f"[rank {self.rank}] {self.text}"


class LogChunk(msgspec.Struct):
    lines: list[LogLine]
    attempt: int
    cursor: tuple[int, int]  # (attempt, seq) of the last line returned
    done: bool  # the job is final and every line has been returned


# Instructions a worker receives from acquire().
class RunTask(msgspec.Struct, tag="run", kw_only=True, omit_defaults=True):
    job_id: str
    attempt: int
    placed: float = 0.0  # when the control plane placed it (for dispatch latency)
    spec: JobSpec
    slots: list[int]
    gpus: list[int]
    # Distributed jobs: this task's node, and the address rank 0 listens at.
    # Node 0's worker reserves the port; the other nodes learn it from a
    # Rendezvous.
    node: int = 0
    master_addr: str | None = None
    # What the job's last attempt left in its scratch folder, laid out in
    # this one's ($GPULAYER_SCRATCH); None: an empty one.
    scratch: ArtifactRef | None = None


class Rendezvous(msgspec.Struct, tag="rendezvous", kw_only=True):
    """The port node 0 reserved, for the other nodes of its job."""

    job_id: str
    attempt: int
    master_port: int


class CancelTask(msgspec.Struct, tag="cancel", kw_only=True, omit_defaults=True):
    job_id: str
    attempt: int
    # Stopped to make room for a job of higher priority (scheduler rule 9):
    # the task ends as "preempted", and its job goes back to the queue.
    # Left out when False: a worker from before it reads it as a cancel.
    preempt: bool = False


Instruction = RunTask | CancelTask | Rendezvous

# "returned": a stopping worker gave the task back without running it.
# "preempted": stopped to make room for a job of higher priority.
Outcome = Literal["exited", "timed_out", "cancelled", "lost", "error", "returned", "preempted"]


class TaskStarted(msgspec.Struct, kw_only=True):
    job_id: str
    attempt: int
    worker_id: str
    acquired: float
    prepared: float
    started: float
    pid: int
    pid_created: float | None = None
    node: int = 0
    # A task of several processes (its ranks): each one's (pid, start time),
    # so that a successor of a crashed control plane can end them all.
    procs: list[tuple[int, float | None]] = []
    # "warm": forked from the worker's ready interpreter; "cold: <why>".
    start: str | None = None


class TaskResult(msgspec.Struct, kw_only=True):
    job_id: str
    attempt: int
    worker_id: str
    outcome: Outcome
    exit_code: int | None = None
    node: int = 0
    rank: int | None = None  # the rank whose exit decided it (distributed jobs)
    error: str | None = None  # why it could not run (prepare or spawn failed)
    stderr_tail: list[str] = []
    outputs: dict[str, ArtifactRef] = {}
    missing_outputs: list[str] = []
    marks: dict[str, float] = {}  # acquired/prepared/started/exited when known
    # What all its processes used, where the worker's containment measures
    # it (a cgroup per task); also in ``marks`` as "cpu_s" and "peak_memory",
    # which the job's record keeps.
    cpu_s: float | None = None  # CPU seconds, user and system
    peak_memory: int | None = None  # bytes, page cache included
    start: str | None = None  # as TaskStarted's; where given, it replaces that one
    # Node 0's scratch folder as it ended, stored, for the job's next attempt
    # (only from an attempt that did not succeed, of a job that may run again).
    scratch: ArtifactRef | None = None


def clip_start(start: str | None) -> str | None:
    """A worker's ``start`` as kept: at most :data:`START_MAX` characters. A
    worker, perhaps a hostile one, writes it; people read it in ``show``."""
    if start is None or len(start) <= START_MAX:
        return start
    return start[: START_MAX - 3] + "..."


def job_start(starts: Iterable[str | None]) -> str | None:
    """A job's start from its tasks' (one per node, in node order): WARM if
    every one's is, else the first cold one's text. None when none is cold
    but one's is not known (not started yet, or a worker that does not say):
    nothing then says the job was warm all through."""
    unknown = False
    seen = False
    for start in starts:
        seen = True
        if start is None:
            unknown = True
        elif start != WARM:
            return start
    return WARM if seen and not unknown else None


def next_state(
    result: TaskResult, *, cancel_requested: bool, attempt: int, max_retries: int
) -> tuple[str, bool]:
    """The job's state after a task ends, and whether to queue it again.
    ``attempt``: the attempts that count against ``max_retries``, this one
    included."""
    if cancel_requested or result.outcome == "cancelled":
        return CANCELLED, False
    if result.outcome == "timed_out":
        state = TIMED_OUT
    elif result.outcome in ("lost", "returned"):
        state = LOST
    elif result.outcome == "exited" and result.exit_code == 0:
        return SUCCEEDED, False
    else:
        state = FAILED
    return state, attempt <= max_retries


def describe_failure(result: TaskResult) -> str | None:
    """The reason line stored with a job that did not succeed."""
    if result.outcome == "exited" and result.exit_code == 0:
        return _missing(result)
    if result.outcome == "error" and result.exit_code is not None:
        # It ran; what followed failed (its outputs were over the limit, say).
        head = f"exited with code {result.exit_code}, but {result.error}"
    elif result.outcome == "error":
        head = f"could not run: {result.error}"
    elif result.outcome == "timed_out":
        head = "ran past its timeout and was terminated"
        if result.error:  # and its outputs were refused
            head += f"; {result.error}"
    elif result.outcome == "cancelled":
        head = "cancelled"
    elif result.outcome == "preempted":
        head = "preempted"
    elif result.outcome == "lost":
        head = result.error or "its worker stopped while it ran"
    elif result.outcome == "returned":
        head = "its worker stopped before it started"
    else:
        head = f"exited with code {result.exit_code}"
    if result.rank is not None:
        head = f"rank {result.rank} (node {result.node}, worker {result.worker_id}) {head}"
    tail = "\n".join(result.stderr_tail)
    missing = _missing(result)
    parts = [head, missing, f"stderr (last lines):\n{tail}" if tail else None]
    return "\n".join(p for p in parts if p)


def _missing(result: TaskResult) -> str | None:
    if not result.missing_outputs:
        return None
    return "declared outputs not found: " + ", ".join(result.missing_outputs)
