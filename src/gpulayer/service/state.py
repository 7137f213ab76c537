"""The control plane's in-memory records, and the pure rules over them.

The store is the durable record of every job; these are what the running
control plane keeps beside it to place and follow jobs without a query:
the queue, each running job's tasks (one per node), the live workers and
their free slots, and the waiters on each job.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from ..jobs import (
    MAX_TELEMETRY_GPUS,
    GpuStats,
    Instruction,
    JobInfo,
    TaskInfo,
    TaskResult,
    WorkerInfo,
)
from ..projects import DEFAULT_PROJECT
from ..scheduler import Assignment, Capacity, Request
from ..signals import Signal
from ..spec import ArtifactRef, JobSpec


@dataclass(frozen=True)
class Delivery:
    """Instructions for a worker; numbered ``first``, ``first + 1``, ... when
    taken over HTTP (0 when in-process, where nothing is lost on the way)."""

    first: int
    items: list[Instruction]
    resent: int = 0  # the first ones were sent before (their reply may have been lost)


def request_of(job_id: str, spec: JobSpec, seq: int, not_before: float = 0.0) -> Request:
    """What placement needs of a waiting job."""
    project = spec.project or DEFAULT_PROJECT
    return Request(job_id, spec.priority, seq, spec.gpus, spec.nodes, not_before, project)


@dataclass
class Pending:
    request: Request
    spec: JobSpec
    attempt: int  # attempts made so far
    submitted: float
    given_back: int = 0  # of those, given back unrun (not counted against retries)
    user: str | None = None  # who submitted it (see access.py)
    scratch: ArtifactRef | None = None  # what its last attempt kept (workspace.SCRATCH)


@dataclass
class ArrayRun:
    """An array this control plane runs, while it is not final."""

    tasks: list[str]  # its tasks' ids, by index
    limit: int | None  # max_parallel
    left: int  # tasks not final yet
    released: set[str] = field(default_factory=set)
    held: deque[str] = field(default_factory=deque)  # queued, not released yet, by index
    started: bool = False  # its row says running
    cancelled: bool = False


@dataclass
class NodeTask:
    """One node's share of a running job (a job of one node has one)."""

    node: int
    worker_id: str
    slots: tuple[int, ...]
    gpus: tuple[int, ...]
    # Its worker took the instruction; None: unknown (placed before a restart
    # of the control plane, which kept this in memory only).
    delivered: bool | None = False
    started: bool = False  # its worker reported the process started
    ended: bool = False  # its worker reported its end (or was lost)


def never_taken(task: NodeTask) -> bool:
    """Known not to have reached its worker: not taken, not started (and
    not unknown, as after a restart of the control plane)."""
    return task.delivered is False and not task.started


@dataclass
class Running:
    attempt: int
    spec: JobSpec
    seq: int
    tasks: list[NodeTask]
    marks: dict[str, float]  # submitted, placed; for gangs the latest start marks
    cancel_requested: bool = False
    given_back: int = 0  # earlier attempts given back unrun (see JobInfo)
    # Jobs of several nodes end when every node has: meanwhile, the results
    # so far (the earliest failure decides), the port node 0 reserved, and
    # the numbering of log lines that arrive from several workers.
    results: list[TaskResult] = field(default_factory=list)
    master_port: int | None = None
    log_seq: int = 0
    log_seen: dict[int, int] = field(default_factory=dict)  # node -> its last line
    user: str | None = None  # who submitted it (see access.py)
    # Being stopped to make room for this waiting job (scheduler rule 9).
    preempted_for: str | None = None
    scratch: ArtifactRef | None = None  # what its last attempt kept, for its next

    @property
    def worker_id(self) -> str:
        return self.tasks[0].worker_id

    @property
    def counted(self) -> int:
        """Its attempts that count against its retries, this one included."""
        return self.attempt - self.given_back

    @property
    def started(self) -> bool:
        """Whether it may have run: a worker took it (a short task's start is
        reported only with its end) or said it started."""
        return any(t.started or t.delivered for t in self.tasks)

    def task_on(self, worker_id: str) -> NodeTask | None:
        for task in self.tasks:
            if task.worker_id == worker_id:
                return task
        return None


class Done:
    """What waiters on a job block on: fired when it is final, with its record."""

    def __init__(self) -> None:
        self.signal = Signal()
        self.fired = False
        # The final record, when it could be read (else waiters read it).
        self.job: JobInfo | None = None


class ListedBlobs:
    """The blobs listed in recent manifests (bundles, folder inputs), to check
    a worker's fetches: it fetches a tree's files one by one, and a manifest
    never changes (its digest names it). Bounded by the digests held, not by
    manifests, since one tree may list a million files. Not thread-safe: the
    control plane calls it under its lock."""

    def __init__(self, max_digests: int) -> None:
        self.max_digests = max_digests
        self._by_root: OrderedDict[str, frozenset[str]] = OrderedDict()
        self.held = 0  # digests, over every manifest kept

    def get(self, root: str) -> frozenset[str] | None:
        listed = self._by_root.get(root)
        if listed is not None:
            self._by_root.move_to_end(root)
        return listed

    def put(self, root: str, listed: frozenset[str]) -> None:
        if root in self._by_root:  # (another thread read it too)
            return
        self._by_root[root] = listed
        self.held += len(listed)
        while self._by_root and self.held > self.max_digests:
            _, dropped = self._by_root.popitem(last=False)
            self.held -= len(dropped)


# A GPU's figures are kept for the last hour, for the dashboard's charts: at
# most one every GPU_HISTORY_STEP_S (the latest of those that came within
# that step of the first), in a ring of 800 entries of five 8-byte numbers: 32 KB for each GPU, however often
# its worker sends. A worker's latest figures older than GPU_STATS_FRESH_S
# (its sampler stopped, say) are no longer shown as its GPUs' now.
GPU_HISTORY_S = 3600.0
GPU_HISTORY_STEP_S = 4.5
GPU_STATS_FRESH_S = 60.0
_HISTORY_LEN = 800  # GPU_HISTORY_S / GPU_HISTORY_STEP_S
# With the time, in this order (the ring's columns after it).
_KEPT = ("memory_used", "utilization", "temperature", "power")


class GpuHistory:
    """One GPU's figures: the latest as its worker sent them, and a ring of
    the last hour's (time and each of ``_KEPT``; NaN where not reported)."""

    def __init__(self) -> None:
        self.latest: GpuStats | None = None
        self._columns = [array("d", [math.nan]) * _HISTORY_LEN for _ in range(1 + len(_KEPT))]
        self._next = 0  # the entry the next one goes in
        self._count = 0
        self._opened = -math.inf  # when the last entry's step began

    def add(self, stats: GpuStats) -> None:
        """Keep ``stats``, stamped (its ``time``) by the caller."""
        if 0 <= stats.time - self._opened < GPU_HISTORY_STEP_S:
            slot = (self._next - 1) % _HISTORY_LEN  # within the last entry's step: in its place
        else:
            slot, self._next = self._next, (self._next + 1) % _HISTORY_LEN
            self._count = min(self._count + 1, _HISTORY_LEN)
            self._opened = stats.time
        self._columns[0][slot] = stats.time
        for column, name in zip(self._columns[1:], _KEPT, strict=True):
            value = getattr(stats, name)
            column[slot] = math.nan if value is None else value
        self.latest = stats

    def copy(self) -> GpuHistory:
        """A copy to read outside the lock (a few kilobytes copied)."""
        other = GpuHistory.__new__(GpuHistory)
        other.latest, other._next, other._count = self.latest, self._next, self._count
        other._opened = self._opened
        other._columns = [array("d", column) for column in self._columns]
        return other

    def samples(self, since: float) -> list[GpuStats]:
        """Those kept from ``since`` on, oldest first (uuid, name and total
        memory as the latest has them)."""
        latest = self.latest
        if latest is None:
            return []
        times, used, *floats = self._columns
        found = []
        for back in range(self._count, 0, -1):
            slot = (self._next - back) % _HISTORY_LEN
            if times[slot] < since:
                continue
            utilization, temperature, power = (_figure(column[slot]) for column in floats)
            memory = used[slot]
            found.append(
                GpuStats(
                    index=latest.index,
                    uuid=latest.uuid,
                    name=latest.name,
                    utilization=utilization,
                    memory_used=None if math.isnan(memory) else int(memory),
                    memory_total=latest.memory_total,
                    temperature=temperature,
                    power=power,
                    time=times[slot],
                )
            )
        return found


def _figure(value: float) -> float | None:
    return None if math.isnan(value) else value


@dataclass
class LiveWorker:
    info: WorkerInfo
    free: set[int]
    inbox: deque[Instruction]
    wake: Signal = field(default_factory=Signal)
    running: set[str] = field(default_factory=set)
    closed: bool = False
    # It said goodbye, but the store refused to record it: when the reaper
    # declares it lost later, that is as a goodbye (what it never took was
    # never an attempt).
    said_goodbye: bool = False
    # A worker known from before a restart is not connected until it
    # registers again; it gets the heartbeat timeout to do so.
    connected: bool = True
    last_seen: float = 0.0
    # Each registration starts a generation: a long poll left open by the
    # worker's previous process (killed, its request still held here) must
    # not take what is meant for the new one.
    generation: int = 0
    # Numbered deliveries (over HTTP): the last number given, and what was
    # sent but not yet acknowledged, re-sent when the worker's next long
    # poll says it did not get it (a reply lost on the way).
    seq: int = 0
    unacked: deque[tuple[int, Instruction]] = field(default_factory=deque)
    # Its GPUs' figures, by GPU index: only of GPUs it offers, MAX_TELEMETRY_GPUS at most.
    gpus: dict[int, GpuHistory] = field(default_factory=dict)

    _capacity: Capacity | None = None  # cached until its free slots change

    def record_gpus(self, figures: Sequence[GpuStats], now: float) -> None:
        """Keep a heartbeat's GPU figures, stamped ``now``; those of a GPU it
        does not offer are not kept."""
        if not figures:
            return
        offered = {g for g in self.info.slot_gpus if g is not None}
        for stats in figures:
            history = self.gpus.get(stats.index)
            if history is None:
                if stats.index not in offered or len(self.gpus) >= MAX_TELEMETRY_GPUS:
                    continue
                history = self.gpus[stats.index] = GpuHistory()
            history.add(msgspec.structs.replace(stats, time=now))

    def gpu_stats(self, now: float) -> list[GpuStats]:
        """Its GPUs' latest figures, by index; those not fresh left out."""
        fresh = now - GPU_STATS_FRESH_S
        found = [h.latest for _, h in sorted(self.gpus.items())]
        return [s for s in found if s is not None and s.time >= fresh]

    def capacity(self) -> Capacity:
        if self._capacity is None or self._capacity.free != self.free:
            self._capacity = Capacity(
                self.info.id, tuple(self.info.slot_gpus), frozenset(self.free)
            )
        return self._capacity


@dataclass(frozen=True)
class Snapshot:
    queued: int
    workers: int
    connected_workers: int
    free_slots: int


def by_job(assignments: list[Assignment]) -> list[list[Assignment]]:
    """Assignments grouped by job: a gang's tasks come together, node 0 first."""
    groups: list[list[Assignment]] = []
    for a in assignments:
        if groups and groups[-1][0].job_id == a.job_id:
            groups[-1].append(a)
        else:
            groups.append([a])
    return groups


def task_infos(placed: Sequence[Assignment | NodeTask]) -> list[TaskInfo]:
    return [
        TaskInfo(node=node, worker=item.worker_id, slots=list(item.slots), gpus=list(item.gpus))
        for node, item in enumerate(placed)
    ]


def failures(run: Running) -> list[TaskResult]:
    """Node results that can have ended the job: not its own success, and
    not an end it was sent (a cancel)."""
    return [
        r
        for r in run.results
        if not (r.outcome == "exited" and r.exit_code == 0) and r.outcome != "cancelled"
    ]


def decisive(run: Running) -> TaskResult:
    """The result a job of several nodes ends with.

    The first failure is the cause: when one rank dies its peers usually fail
    after it (a connection closed under them) or are ended by us. A node
    whose worker vanished comes first, since its ranks' end is unknown; a
    node given back unrun comes last, so that it decides (and the attempt
    goes uncounted) only when nothing else failed.
    """
    failed = failures(run)
    if failed:
        return min(
            failed,
            key=lambda r: (
                r.outcome != "lost",
                r.outcome == "returned",
                r.marks.get("exited", float("inf")),
            ),
        )
    cancelled = [r for r in run.results if r.outcome == "cancelled"]
    if cancelled:
        return cancelled[0]
    return next(r for r in run.results if r.node == 0)
