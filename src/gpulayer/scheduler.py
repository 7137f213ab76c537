"""Placement: which waiting jobs run where. Pure functions, no I/O.

The service calls :func:`place` on submit and whenever capacity frees. Rules:

1. Higher priority first; first come, first served within a priority.
2. A job fits a worker when the worker has enough free slots: ``gpus=N`` needs
   N free GPU slots, ``gpus=0`` needs one free slot of any kind.
3. Among the workers a job fits, take the one with the fewest free slots (best
   fit), keeping large holes for large jobs.
4. No starvation: when a job does not fit now but could fit some worker once
   it drains, that worker is reserved for it; later jobs may not take slots on
   it, so a stream of small jobs cannot keep a large one waiting forever.
   Jobs that no worker could ever hold reserve nothing (they would block it
   for good) and :func:`explain` says why they wait.
5. A job of ``nodes=N`` needs N distinct workers at once (a gang), or waits.
6. A retried job waits out its back-off (:func:`retry_wait`): until its
   ``not_before`` time it is passed over, and holds no worker for itself.
7. Quotas: a project's running jobs hold at most its quota of GPUs, and of
   CPU slots (a GPU job's slots count as its GPUs). A job that would take its
   project past the quota waits, and so do the later jobs of its project of
   the same kind (GPU jobs, or CPU jobs): first come, first served within a
   project, so a stream of small jobs cannot keep its own project's big one
   waiting (the price: what is left of the quota may stay unused while the
   big one waits, as a reserved worker's slots do under rule 4). A job
   bigger than the whole quota blocks nothing: it can never run
   (:func:`explain` says so). A quota-bound job reserves no worker.
8. Fair share: among jobs of equal priority, the project with the least
   recent usage goes first. Usage is decayed GPU-seconds (:class:`Shares`,
   kept by the caller), plus, for what a project holds now, ``entry_s``
   seconds of each GPU it holds: a project that has just been given GPUs in
   this pass is charged for them at once, so one pass shares the free GPUs
   out instead of giving them all to the project that led (as Kueue charges
   an admission penalty, and Slurm's fair-share factor ranks by decayed usage).

9. Preemption (:func:`preempt`): when the highest-ranked job that waits for
   room (not for its quota, not backing off) cannot be placed, and stopping
   running jobs marked preemptible of lower priority would make room for
   it, the fewest such jobs are chosen, lowest priority first and, among
   equals, the most recently started. The workers they free are held for
   the job that asked (``held_for``) until it is placed.

The queue is a :class:`Waiting`: the waiting jobs of each project and shape,
in rank order, so a pass reads only the head of each, however long the queue.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from . import defaults
from .projects import DEFAULT_PROJECT


@dataclass(frozen=True, slots=True)
class Request:
    """A waiting job's demand."""

    job_id: str
    priority: int
    seq: int  # submission order
    gpus: int = 0
    nodes: int = 1
    # A retry's back-off: not placed before this time (seconds since the
    # epoch, the service's clock); 0: at once.
    not_before: float = 0.0
    project: str = DEFAULT_PROJECT

    @property
    def demand(self) -> tuple[int, int]:
        """What it holds once running, against its project's quota: (GPUs,
        CPU slots)."""
        return (self.gpus * self.nodes, 0) if self.gpus else (0, self.nodes)


@dataclass(frozen=True, slots=True)
class Quota:
    """The most a project's running jobs hold at once (None: no limit)."""

    gpus: int | None = None
    slots: int | None = None

    def exceeded_by(self, demand: tuple[int, int]) -> str | None:
        """``"gpus"`` or ``"slots"`` when ``demand`` alone is over the quota."""
        if self.gpus is not None and demand[0] > self.gpus:
            return "gpus"
        if self.slots is not None and demand[1] > self.slots:
            return "slots"
        return None


NO_QUOTA = Quota()
# One GPU weighs as much as this many CPU slots in fair-share usage (as
# Kueue's resource weights): a project of CPU jobs still has usage.
CPU_SLOT_WEIGHT = 0.1


def weight(gpus: int, slots: int) -> float:
    """Fair-share weight of holding ``gpus`` GPUs and ``slots`` CPU slots."""
    return gpus + CPU_SLOT_WEIGHT * slots


@dataclass(frozen=True)
class Shares:
    """What rules 7 and 8 need, from the caller: each project's quota, what
    its running jobs hold now (GPUs, CPU slots), and its recent usage
    (decayed weighted GPU-seconds). A project not named has no quota,
    holds nothing and has no usage."""

    quotas: Mapping[str, Quota] = field(default_factory=dict)
    held: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    usage: Mapping[str, float] = field(default_factory=dict)
    entry_s: float = defaults.FAIR_SHARE_ENTRY_S


NO_SHARES = Shares()


def retry_wait(retry_delay: float | None, failed: int) -> float:
    """Seconds a job waits before its next attempt, after ``failed`` attempts
    that count against its retries: ``retry_delay * 2**(failed - 1)``, from
    :data:`~gpulayer.defaults.RETRY_DELAY_S` when the job sets none, and at
    most :data:`~gpulayer.defaults.RETRY_DELAY_MAX_S` (or ``retry_delay``
    itself, if that is longer)."""
    base = defaults.RETRY_DELAY_S if retry_delay is None else retry_delay
    cap = max(defaults.RETRY_DELAY_MAX_S, base)
    return min(base * 2.0 ** max(0, min(failed - 1, 64)), cap)


@dataclass(frozen=True, slots=True)
class Capacity:
    """A worker's slots. ``slot_gpus[i]`` is slot i's GPU index, or None on a CPU slot."""

    worker_id: str
    slot_gpus: tuple[int | None, ...]
    free: frozenset[int] = field(default_factory=frozenset)
    # Derived once, so that a placement pass over thousands of idle workers
    # allocates nothing per worker (see place()).
    free_cpu: tuple[int, ...] = field(init=False)
    free_gpu: tuple[int, ...] = field(init=False)
    total_gpus: int = field(init=False)

    def __post_init__(self) -> None:
        gpus = self.slot_gpus
        object.__setattr__(self, "free_cpu", tuple(sorted(s for s in self.free if gpus[s] is None)))
        object.__setattr__(
            self, "free_gpu", tuple(sorted(s for s in self.free if gpus[s] is not None))
        )
        object.__setattr__(self, "total_gpus", sum(1 for g in gpus if g is not None))


@dataclass(frozen=True, slots=True)
class Assignment:
    job_id: str
    worker_id: str
    slots: tuple[int, ...]
    gpus: tuple[int, ...]


def order(requests: Iterable[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: (-r.priority, r.seq))


Shape = tuple[str, int, int]  # (project, GPUs, nodes)


class Waiting:
    """The queue: waiting jobs by project and shape, each in rank order
    (highest priority first, then submission order). Adding or removing a
    job costs a search and a move of pointers in its shape's list; a
    placement pass reads each shape's head only. Not thread-safe."""

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._by_id: dict[str, Request] = {}
        self._shapes: dict[Shape, list[tuple[int, int, str]]] = {}
        for req in requests:
            self.add(req)

    @staticmethod
    def _shape(req: Request) -> Shape:
        return (req.project, req.gpus, req.nodes)

    def add(self, req: Request) -> None:
        if req.job_id in self._by_id:
            raise ValueError(f"job {req.job_id} is already waiting")
        self._by_id[req.job_id] = req
        rank = (-req.priority, req.seq, req.job_id)
        bisect.insort(self._shapes.setdefault(self._shape(req), []), rank)

    def remove(self, job_id: str) -> Request:
        req = self._by_id.pop(job_id)
        shape = self._shape(req)
        ranks = self._shapes[shape]
        del ranks[bisect.bisect_left(ranks, (-req.priority, req.seq, job_id))]
        if not ranks:
            del self._shapes[shape]
        return req

    def get(self, job_id: str) -> Request | None:
        return self._by_id.get(job_id)

    def top_priority(self) -> int | None:
        """The highest priority of a waiting job (None: none waits); a look
        at each shape's head."""
        if not self._shapes:
            return None
        return -min(ranks[0][0] for ranks in self._shapes.values())

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting job, in rank order (not fair-share order)."""
        by_id = self._by_id
        return (by_id[r[2]] for r in heapq.merge(*self._shapes.values()))

    def shapes(self) -> Mapping[Shape, Sequence[tuple[int, int, str]]]:
        return self._shapes


def _split(cap: Capacity, used: set[int] | None) -> tuple[Sequence[int], Sequence[int]]:
    """Free (CPU, GPU) slots, less those ``used`` earlier in this pass."""
    if not used:
        return cap.free_cpu, cap.free_gpu
    return [s for s in cap.free_cpu if s not in used], [s for s in cap.free_gpu if s not in used]


def _could_ever_fit(cap: Capacity, gpus: int) -> bool:
    return cap.total_gpus >= gpus if gpus else bool(cap.slot_gpus)


class _Projects:
    """One pass's view of each project: its quota, what it holds (as the
    pass places more), and the fair-share rank of its jobs."""

    __slots__ = ("blocked", "held", "quotas", "shares")

    def __init__(self, shares: Shares) -> None:
        self.shares = shares
        self.quotas = shares.quotas
        self.held = dict(shares.held)
        # Set by place() on the job it was just given when that job's quota
        # holds it back: the project's later jobs of its kind (GPU or CPU)
        # then wait behind it (rule 7).
        self.blocked = False

    def key(self, project: str) -> float:
        gpus, slots = self.held.get(project, (0, 0))
        return self.shares.usage.get(project, 0.0) + self.shares.entry_s * weight(gpus, slots)

    def over(self, req: Request) -> bool:
        """Whether placing ``req`` would take its project past its quota."""
        quota = self.quotas.get(req.project, NO_QUOTA)
        if quota is NO_QUOTA:
            return False
        gpus, slots = self.held.get(req.project, (0, 0))
        want_gpus, want_slots = req.demand
        return (quota.gpus is not None and gpus + want_gpus > quota.gpus) or (
            quota.slots is not None and slots + want_slots > quota.slots
        )

    def take(self, req: Request) -> None:
        gpus, slots = self.held.get(req.project, (0, 0))
        want_gpus, want_slots = req.demand
        self.held[req.project] = (gpus + want_gpus, slots + want_slots)


def _fair_order(waiting: Waiting, projects: _Projects) -> Iterator[Request]:
    """The waiting jobs in the order a pass considers them (rules 1, 7, 8).

    Two levels of heaps: in each project, the heads of its shapes by rank;
    over projects, each project's best head by (priority, fair-share key,
    submission). A project's key changes only when one of its jobs is
    placed, which happens only while it is the one popped, so no entry in
    the heap over projects is ever stale. The caller sets
    ``projects.blocked`` when the job it was given is held back by its
    quota: the project's shapes of that kind (GPU jobs, or CPU jobs) leave
    this pass, so its later jobs of that kind wait behind it (rule 7).
    """
    by_id = waiting._by_id
    inner: dict[str, list[tuple[int, int, int, Shape]]] = {}
    for shape, ranks in waiting.shapes().items():
        first = ranks[0]
        inner.setdefault(shape[0], []).append((first[0], first[1], 0, shape))
    outer: list[tuple[int, float, int, str]] = []
    for project, heads in inner.items():
        heapq.heapify(heads)
        outer.append((heads[0][0], projects.key(project), heads[0][1], project))
    heapq.heapify(outer)
    shapes = waiting.shapes()
    while outer:
        _, _, _, project = heapq.heappop(outer)
        heads = inner[project]
        _, _, index, shape = heapq.heappop(heads)
        ranks = shapes[shape]
        projects.blocked = False
        yield by_id[ranks[index][2]]
        if projects.blocked:
            gpu_kind = shape[1] > 0
            heads[:] = [h for h in heads if (h[3][1] > 0) != gpu_kind]
            heapq.heapify(heads)
        elif index + 1 < len(ranks):
            nxt = ranks[index + 1]
            heapq.heappush(heads, (nxt[0], nxt[1], index + 1, shape))
        if heads:
            heapq.heappush(outer, (heads[0][0], projects.key(project), heads[0][1], project))


def place(
    requests: Waiting | Iterable[Request],
    capacities: Sequence[Capacity],
    now: float | None = None,
    shares: Shares = NO_SHARES,
    held_for: Mapping[str, str] | None = None,
) -> list[Assignment]:
    """Assign as many waiting jobs as the rules allow. Never over-commits a
    slot, and never takes a project past its quota.

    ``held_for``: worker id -> the job it is held for, while preempted jobs
    leave it (rule 9): only that job may be placed there.

    ``now``: the time, against which a retry's ``not_before`` is held (None:
    none is held back). ``shares``: quotas and usage (rules 7 and 8).

    ``requests``: the queue (a :class:`Waiting`; any other iterable is
    taken into one first). Placement stops reading it as soon as every
    worker is full or reserved, however long the queue. A pass allocates
    nothing per worker it merely looks at: with ten thousand idle workers,
    garbage from placement would otherwise set off full collections that
    stall the server.
    """
    waiting = requests if isinstance(requests, Waiting) else Waiting(requests)
    projects = _Projects(shares)
    used: dict[str, set[int]] = {}  # slots given out in this pass
    held = held_for or {}
    result: list[Assignment] = []
    # The workers not reserved, in the order given (a dict: one removed is
    # gone in O(1)), and a count of them by free GPUs, so that a job too big
    # for every one of them now costs no look at each (a busy fleet has a
    # hole on every worker, and a queue of big jobs that reserve them).
    live = {c.worker_id: c for c in capacities}
    free_gpus = {c.worker_id: len(c.free_gpu) for c in capacities}
    by_free: dict[int, int] = {}
    for n in free_gpus.values():
        by_free[n] = by_free.get(n, 0) + 1
    open_n = sum(1 for c in capacities if c.free)

    def most_free() -> int:
        return max((n for n, count in by_free.items() if count), default=0)

    def forget(cap: Capacity) -> None:
        """``cap`` as it was counted leaves the counts (used, or reserved)."""
        nonlocal open_n
        by_free[free_gpus[cap.worker_id]] -= 1
        if len(cap.free) > len(used.get(cap.worker_id, ())):
            open_n -= 1

    def count(cap: Capacity) -> None:
        nonlocal open_n
        n = len(_split(cap, used.get(cap.worker_id))[1])
        free_gpus[cap.worker_id] = n
        by_free[n] = by_free.get(n, 0) + 1
        if len(cap.free) > len(used.get(cap.worker_id, ())):
            open_n += 1

    for req in _fair_order(waiting, projects):
        if now is not None and req.not_before > now:
            continue  # backing off: it reserves nothing meanwhile (rule 6)
        if projects.over(req):
            quota = projects.quotas.get(req.project, NO_QUOTA)
            if quota.exceeded_by(req.demand) is None:
                projects.blocked = True  # its project's later jobs of its kind wait behind it
            continue  # bigger than the whole quota: it blocks nothing (rule 7)
        if not open_n:
            break  # every worker is full or held for an earlier job
        # Best fit: CPU jobs on CPU slots first, then the fewest free slots.
        best: list[tuple[tuple[bool, int, str], Capacity]] = []
        if not req.gpus or most_free() >= req.gpus:
            for w, cap in live.items():
                if held.get(w, req.job_id) != req.job_id:
                    continue  # (held for another job: open, for that one)
                cpu, gpu = _split(cap, used.get(w))
                if not cpu and not gpu:
                    continue
                if req.gpus:
                    if len(gpu) < req.gpus:
                        continue
                    key = (False, len(cpu) + len(gpu), w)
                else:
                    key = (not cpu, len(cpu) + len(gpu), w)
                if len(best) < req.nodes or key < best[-1][0]:
                    best.append((key, cap))
                    best.sort(key=lambda kc: kc[0])
                    del best[req.nodes :]
        if len(best) == req.nodes:
            projects.take(req)
            for _, cap in best:
                w = cap.worker_id
                cpu, gpu = _split(cap, used.get(w))
                slots = tuple(gpu[: req.gpus]) if req.gpus else ((cpu or gpu)[0],)
                forget(cap)
                used.setdefault(w, set()).update(slots)
                count(cap)
                gpus = tuple(g for s in slots if (g := cap.slot_gpus[s]) is not None)
                result.append(Assignment(req.job_id, w, slots, gpus if req.gpus else ()))
            continue
        # It does not fit now: hold the workers it could drain into, fullest-free first.
        able = [
            c
            for w, c in live.items()
            if held.get(w, req.job_id) == req.job_id and _could_ever_fit(c, req.gpus)
        ]
        if len(able) >= req.nodes:
            for cap in heapq.nsmallest(
                req.nodes,
                able,
                key=lambda c: (-(len(c.free) - len(used.get(c.worker_id, ()))), c.worker_id),
            ):
                forget(cap)  # reserved: out of every count, and of live
                del live[cap.worker_id]
    return result


@dataclass(frozen=True, slots=True)
class Victim:
    """A running job that could be preempted: where it runs, what it holds."""

    job_id: str
    priority: int
    started: float  # when its current attempt was placed
    slots: Mapping[str, tuple[int, ...]]  # worker id -> its slots there


@dataclass(frozen=True, slots=True)
class Preemption:
    """Jobs to stop so that ``for_job`` fits, and the workers to hold for it."""

    for_job: str
    victims: tuple[str, ...]
    workers: tuple[str, ...]


def preempt(
    requests: Waiting | Iterable[Request],
    capacities: Sequence[Capacity],
    victims: Sequence[Victim],
    now: float | None = None,
    shares: Shares = NO_SHARES,
    held_for: Mapping[str, str] | None = None,
) -> Preemption | None:
    """Rule 9: what to stop for the highest-ranked job that waits for room,
    when nothing can be placed for it as things are. Call it after
    :func:`place` placed what it could (``capacities`` as they are then).

    ``victims``: the running jobs marked preemptible, less any already
    being stopped. Only jobs of lower priority than the waiting one are
    stopped. None: nothing to stop (no waiting job would fit if it did).
    """
    if not victims:
        return None
    waiting = requests if isinstance(requests, Waiting) else Waiting(requests)
    lowest = min(v.priority for v in victims)
    held = held_for or {}
    projects = _Projects(shares)
    caps = {c.worker_id: c for c in capacities}
    on: dict[str, list[Victim]] = {}
    for victim in victims:
        for worker_id in victim.slots:
            on.setdefault(worker_id, []).append(victim)
    for req in _fair_order(waiting, projects):
        if req.priority <= lowest:
            return None  # (rank order: no later job outranks a victim either)
        if (now is not None and req.not_before > now) or projects.over(req):
            continue  # it waits for time or its quota, which stopping nothing helps
        if req.job_id in held.values():
            return None  # room is being made for it already
        if sum(1 for c in capacities if _could_ever_fit(c, req.gpus)) < req.nodes:
            continue  # no worker could ever hold it: it waits for none (rule 5)
        choice = _room_for(req, caps, on, held)
        if choice is not None:
            chosen, workers = choice
            return Preemption(req.job_id, chosen, workers)
        return None  # the first job that waits for room decides; the rest wait behind it
    return None


def _room_for(
    req: Request,
    caps: Mapping[str, Capacity],
    on: Mapping[str, list[Victim]],
    held: Mapping[str, str],
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The fewest victims whose stopping lets ``req`` fit on ``req.nodes``
    workers, and those workers; None if no such set."""
    options: list[tuple[tuple[int, int, float], tuple[str, ...], str]] = []
    for worker_id, cap in caps.items():
        if held.get(worker_id, req.job_id) != req.job_id:
            continue
        gpu_slot = [g is not None for g in cap.slot_gpus]
        free_gpu = sum(1 for s in cap.free if gpu_slot[s])
        free_any = len(cap.free)
        need = req.gpus if req.gpus else 1
        have = free_gpu if req.gpus else free_any
        if have >= need:
            options.append(((0, 0, 0.0), (), worker_id))  # fits here once others move
            continue
        if not _could_ever_fit(cap, req.gpus):
            continue
        # Lowest priority first, then the most recently started.
        ranked = sorted(
            (v for v in on.get(worker_id, ()) if v.priority < req.priority),
            key=lambda v: (v.priority, -v.started, v.job_id),
        )
        chosen: list[Victim] = []
        for victim in ranked:
            if have >= need:
                break
            slots = victim.slots[worker_id]
            have += sum(1 for s in slots if gpu_slot[s]) if req.gpus else len(slots)
            chosen.append(victim)
        if have >= need and chosen:
            worst = max(v.priority for v in chosen)
            latest = min(v.started for v in chosen)
            options.append(
                ((len(chosen), worst, -latest), tuple(v.job_id for v in chosen), worker_id)
            )
    if len(options) < req.nodes:
        return None
    options.sort()
    picked = options[: req.nodes]
    victims = tuple(dict.fromkeys(j for _, ids, _ in picked for j in ids))
    if not victims:
        return None  # it fits without stopping anything: place() holds workers for it
    return victims, tuple(w for _, _, w in picked)


def _amount(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def explain_quota(req: Request, shares: Shares) -> str | None:
    """Why its project's quota holds ``req`` back, or None if it does not."""
    quota = shares.quotas.get(req.project, NO_QUOTA)
    if quota is NO_QUOTA:
        return None
    held = shares.held.get(req.project, (0, 0))
    want = req.demand
    for i, limit, unit in ((0, quota.gpus, "GPU"), (1, quota.slots, "CPU slot")):
        if limit is None or held[i] + want[i] <= limit:
            continue
        if want[i] > limit:
            return (
                f"needs {_amount(want[i], unit)}, more than project {req.project}'s quota of "
                f"{_amount(limit, unit)}: it cannot run unless an admin raises the quota"
            )
        return (
            f"project {req.project} is at its quota of {_amount(limit, unit)} "
            f"({held[i]} in use, this job needs {want[i]})"
        )
    return None


def explain(
    req: Request,
    capacities: Sequence[Capacity],
    now: float | None = None,
    shares: Shares = NO_SHARES,
) -> str:
    """Why a waiting job is not running, in words for `gpulayer show`."""
    if now is not None and req.not_before > now:
        return f"waiting {req.not_before - now:.1f} s more before retrying (back-off)"
    quota = explain_quota(req, shares)
    if quota is not None:
        return quota
    if not capacities:
        return "no workers are connected"
    unit = f"{req.gpus} GPU{'s' if req.gpus != 1 else ''}" if req.gpus else "a free slot"
    able = [c for c in capacities if _could_ever_fit(c, req.gpus)]
    if len(able) < req.nodes:
        most = max(c.total_gpus for c in capacities)
        if req.nodes > 1:
            return f"needs {req.nodes} workers with {unit} each; only {len(able)} can hold that"
        return f"needs {unit} but no worker has that many (largest has {most} GPUs)"
    where = "a worker" if req.nodes == 1 else f"{req.nodes} workers"
    if req.gpus:
        return f"waiting for {unit} to be free on {where} (all busy, or held for an earlier job)"
    return f"waiting for a slot to be free on {where} (all busy, or held for an earlier job)"
