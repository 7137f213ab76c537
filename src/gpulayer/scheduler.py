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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from . import defaults


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


def _split(cap: Capacity, used: set[int] | None) -> tuple[Sequence[int], Sequence[int]]:
    """Free (CPU, GPU) slots, less those ``used`` earlier in this pass."""
    if not used:
        return cap.free_cpu, cap.free_gpu
    return [s for s in cap.free_cpu if s not in used], [s for s in cap.free_gpu if s not in used]


def _could_ever_fit(cap: Capacity, gpus: int) -> bool:
    return cap.total_gpus >= gpus if gpus else bool(cap.slot_gpus)


def place(
    requests: Iterable[Request], capacities: Sequence[Capacity], now: float | None = None
) -> list[Assignment]:
    """Assign as many waiting jobs as the rules allow. Never over-commits a slot.

    ``now``: the time, against which a retry's ``not_before`` is held (None:
    none is held back).

    ``requests`` come highest rank first (see :func:`order`); the caller keeps
    its queue in that order, so placement stops reading it as soon as every
    worker is full or reserved, however long the queue. A pass allocates
    nothing per worker it merely looks at: with ten thousand idle workers,
    garbage from placement would otherwise set off full collections that
    stall the server.
    """
    used: dict[str, set[int]] = {}  # slots given out in this pass
    reserved: set[str] = set()
    result: list[Assignment] = []
    for req in requests:
        if now is not None and req.not_before > now:
            continue  # backing off: it reserves nothing meanwhile (rule 6)
        # Best fit: CPU jobs on CPU slots first, then the fewest free slots.
        best: list[tuple[tuple[bool, int, str], Capacity]] = []
        anything_open = False
        for cap in capacities:
            w = cap.worker_id
            if w in reserved:
                continue
            cpu, gpu = _split(cap, used.get(w))
            if not cpu and not gpu:
                continue
            anything_open = True
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
        if not anything_open:
            break  # every worker is full or held for an earlier job
        if len(best) == req.nodes:
            for _, cap in best:
                cpu, gpu = _split(cap, used.get(cap.worker_id))
                slots = tuple(gpu[: req.gpus]) if req.gpus else ((cpu or gpu)[0],)
                used.setdefault(cap.worker_id, set()).update(slots)
                gpus = tuple(g for s in slots if (g := cap.slot_gpus[s]) is not None)
                result.append(
                    Assignment(req.job_id, cap.worker_id, slots, gpus if req.gpus else ())
                )
            continue
        # It does not fit now: hold the workers it could drain into, fullest-free first.
        able = [
            c for c in capacities if c.worker_id not in reserved and _could_ever_fit(c, req.gpus)
        ]
        if len(able) >= req.nodes:
            able.sort(key=lambda c: (-(len(c.free) - len(used.get(c.worker_id, ()))), c.worker_id))
            reserved.update(c.worker_id for c in able[: req.nodes])
    return result


def explain(req: Request, capacities: Sequence[Capacity], now: float | None = None) -> str:
    """Why a waiting job is not running, in words for `gpulayer show`."""
    if now is not None and req.not_before > now:
        return f"waiting {req.not_before - now:.1f} s more before retrying (back-off)"
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
