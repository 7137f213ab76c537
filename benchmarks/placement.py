"""One placement pass over a big queue: 100,000 waiting jobs in 50 projects
(quotas on half of them, usage on all) and 1,000 workers of 8 GPUs.

Scenarios, each timed as passes of :func:`gpulayer.scheduler.place` over the
same queue (a pass changes nothing, so it can be repeated):

- ``one-frees``: every worker busy but one, whose job of 1 to 8 GPUs has
  just ended: the pass a job's end sets off, the common case on a full
  fleet. Target: under 10 ms.
- ``fragmented``: every worker with one GPU free of 8, as a busy fleet of
  mixed jobs is: big jobs that cannot fit reserve workers, small ones fill
  the holes. No target; its cost is reported.
- ``all-idle``: every worker idle, as when a fleet comes up under a full
  queue: the pass places 8,000 GPUs' worth of jobs. No target; its cost is
  reported.

Baseline, in the same run: the same passes by the scheduler as it was
before projects (``tests/scheduler_reference.py``), over the same jobs in
one queue with no quotas and no fair share. Runs alternate (new, baseline,
new, ...); each prints its own quartiles, and the summary is the median of
the runs' medians.

    python benchmarks/placement.py [--jobs 100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import scheduler_reference
from gpulayer.scheduler import Capacity, Quota, Request, Shares, Waiting, order, place


def queue(jobs: int, projects: int, rng: random.Random) -> list[Request]:
    names = [f"p{i:02d}" for i in range(projects)]
    out = []
    for i in range(jobs):
        gpus = rng.choice((1, 1, 1, 2, 2, 4, 8))
        nodes = 2 if rng.random() < 0.05 else 1
        priority = 1 if rng.random() < 0.1 else 0
        out.append(Request(f"j{i}", priority, i, gpus, nodes, project=rng.choice(names)))
    return out


def shares(projects: int, rng: random.Random) -> Shares:
    names = [f"p{i:02d}" for i in range(projects)]
    quotas = {n: Quota(gpus=rng.choice((8, 16, 64, 160))) for n in names[::2]}
    # Half the projects with a quota are at it (the fleet is full).
    held = {n: (q.gpus or 0, 0) for n, q in list(quotas.items())[::2]}
    for n in names:
        held.setdefault(n, (rng.randint(0, 200), 0))
    usage = {n: rng.uniform(0, 5e6) for n in names}
    return Shares(quotas, held, usage)


def fleet(workers: int, gpus: int, free_on_first: int | None) -> list[Capacity]:
    slots = tuple(range(gpus))
    if free_on_first is None:  # all idle
        return [Capacity(f"w{i:04d}", slots, frozenset(slots)) for i in range(workers)]
    if free_on_first < 0:  # fragmented: one GPU free on every worker
        return [Capacity(f"w{i:04d}", slots, frozenset({0})) for i in range(workers)]
    # As the control plane passes them: only the workers with a free slot.
    return [Capacity("w0000", slots, frozenset(range(free_on_first)))]


def timed(run: Callable[[], object], passes: int) -> list[float]:
    out = []
    gc.collect()
    for _ in range(passes):
        began = time.perf_counter()
        run()
        out.append((time.perf_counter() - began) * 1e3)
    return out


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--projects", type=int, default=50)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8, help="per worker")
    parser.add_argument("--repeat", type=int, default=3, help="alternated runs of each")
    parser.add_argument("--passes", type=int, default=50, help="passes timed per run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    rng = random.Random(2026)
    reqs = queue(args.jobs, args.projects, rng)
    fair = shares(args.projects, rng)
    began = time.perf_counter()
    waiting = Waiting(reqs)
    build_ms = (time.perf_counter() - began) * 1e3
    ranked = order(reqs)
    began = time.perf_counter()
    extra = Request("extra", 0, args.jobs + 1, 1, project="p00")
    for _ in range(1000):
        waiting.add(extra)
        waiting.remove("extra")
    add_remove_us = (time.perf_counter() - began) * 1e3  # per pair, in µs (1000 pairs)
    now = time.time()

    scenarios = {
        "one-frees": [fleet(args.workers, args.gpus, k) for k in (1, 2, 4, 8)],
        "fragmented": [fleet(args.workers, args.gpus, -1)],
        "all-idle": [fleet(args.workers, args.gpus, None)],
    }
    results: dict[str, dict[str, object]] = {}
    for name, cap_sets in scenarios.items():
        passes = args.passes if name != "all-idle" else max(3, args.passes // 10)
        runs: dict[str, list[float]] = {"fair-share": [], "baseline": []}
        placed = {
            "fair-share": len(place(waiting, cap_sets[-1], now, fair)),
            "baseline": len(scheduler_reference.place(ranked, cap_sets[-1], now)),
        }
        for run in range(args.repeat):
            for kind in ("fair-share", "baseline"):
                if kind == "fair-share":
                    samples = [
                        t
                        for caps in cap_sets
                        for t in timed(lambda c=caps: place(waiting, c, now, fair), passes)
                    ]
                else:
                    samples = [
                        t
                        for caps in cap_sets
                        for t in timed(
                            lambda c=caps: scheduler_reference.place(ranked, c, now), passes
                        )
                    ]
                q1, med, q3 = quartiles(samples)
                runs[kind].append(med)
                print(
                    f"{name:9s} run {run + 1} {kind:10s}: median {med:8.3f} ms "
                    f"(quartiles {q1:.3f} to {q3:.3f}, {len(samples)} passes)"
                )
        fair_ms = statistics.median(runs["fair-share"])
        base_ms = statistics.median(runs["baseline"])
        results[name] = {
            "fair_share_ms": fair_ms,
            "baseline_ms": base_ms,
            "ratio": fair_ms / base_ms,
            "runs_fair_share_ms": runs["fair-share"],
            "runs_baseline_ms": runs["baseline"],
            "assignments_last_pass": placed,
        }
        print(
            f"{name}: fair share {fair_ms:.3f} ms, baseline {base_ms:.3f} ms, "
            f"ratio {fair_ms / base_ms:.2f}x; assignments per pass {placed}"
        )
    print(
        f"queue of {args.jobs} jobs built in {build_ms:.0f} ms; "
        f"add + remove of one job: {add_remove_us:.1f} µs"
    )
    if args.json:
        results["queue"] = {"build_ms": build_ms, "add_remove_us": add_remove_us}
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
