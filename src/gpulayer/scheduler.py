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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Request:
    """A waiting job's demand."""

    job_id: str
    priority: int
    seq: int  # submission order
    gpus: int = 0
    nodes: int = 1


@dataclass(frozen=True, slots=True)
class Capacity:
    """A worker's slots. ``slot_gpus[i]`` is slot i's GPU index, or None on a CPU slot."""

    worker_id: str
    slot_gpus: tuple[int | None, ...]
    free: frozenset[int] = field(default_factory=frozenset)

    @property
    def total_gpus(self) -> int:
        return sum(1 for gpu in self.slot_gpus if gpu is not None)


@dataclass(frozen=True, slots=True)
class Assignment:
    job_id: str
    worker_id: str
    slots: tuple[int, ...]
    gpus: tuple[int, ...]


def order(requests: Iterable[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: (-r.priority, r.seq))


def _pick_slots(cap: Capacity, free: set[int], gpus: int) -> tuple[int, ...] | None:
    if gpus == 0:
        # Prefer a CPU slot so GPU slots stay free for jobs that need them.
        cpu = [s for s in free if cap.slot_gpus[s] is None]
        pool = cpu or sorted(free)
        return (min(pool),) if pool else None
    gpu_slots = sorted(s for s in free if cap.slot_gpus[s] is not None)
    return tuple(gpu_slots[:gpus]) if len(gpu_slots) >= gpus else None


def _could_ever_fit(cap: Capacity, gpus: int) -> bool:
    return cap.total_gpus >= gpus if gpus else bool(cap.slot_gpus)


def place(requests: Iterable[Request], capacities: Sequence[Capacity]) -> list[Assignment]:
    """Assign as many waiting jobs as the rules allow. Never over-commits a slot.

    ``requests`` come highest rank first (see :func:`order`); the caller keeps
    its queue in that order, so placement stops reading it as soon as every
    worker is full or reserved, however long the queue.
    """
    free = {cap.worker_id: set(cap.free) for cap in capacities}
    caps = {cap.worker_id: cap for cap in capacities}
    reserved: set[str] = set()
    result: list[Assignment] = []
    for req in requests:
        open_workers = [w for w in caps if w not in reserved and free[w]]
        if not open_workers:
            break  # every worker is full or held for an earlier job
        fits: list[tuple[bool, int, str, tuple[int, ...]]] = []
        for worker_id in open_workers:
            slots = _pick_slots(caps[worker_id], free[worker_id], req.gpus)
            if slots is not None:
                # A CPU job takes a GPU slot only where no CPU slot is free.
                on_gpu = not req.gpus and caps[worker_id].slot_gpus[slots[0]] is not None
                fits.append((on_gpu, len(free[worker_id]), worker_id, slots))
        if len(fits) >= req.nodes:
            for _, _, worker_id, slots in sorted(fits)[: req.nodes]:
                free[worker_id].difference_update(slots)
                gpus = tuple(g for s in slots if (g := caps[worker_id].slot_gpus[s]) is not None)
                result.append(Assignment(req.job_id, worker_id, slots, gpus if req.gpus else ()))
            continue
        # It does not fit now: hold the workers it could drain into, fullest-free first.
        able = [w for w in caps if w not in reserved and _could_ever_fit(caps[w], req.gpus)]
        if len(able) >= req.nodes:
            able.sort(key=lambda w: (-len(free[w]), w))
            reserved.update(able[: req.nodes])
    return result


def explain(req: Request, capacities: Sequence[Capacity]) -> str:
    """Why a waiting job is not running, in words for `gpulayer show`."""
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
