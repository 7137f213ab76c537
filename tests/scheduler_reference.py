"""The placement pass as it was before projects (scheduler.py at cf614c1):
the oracle the fair-share scheduler must match when every job is in one
project and no quota applies."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpulayer.scheduler import Assignment, Capacity, Request


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
