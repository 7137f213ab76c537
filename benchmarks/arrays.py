"""Submitting a 10,000-task array to a server: one request, target under 1 s.

A `gpulayer server start` on 127.0.0.1 with no workers (the tasks stay
queued, so only the submit is timed; each array is cancelled after, not
timed). Baseline, in the same run: the same number of tasks as separate
jobs, one submit each, as a sweep without arrays would go (measured on
``--singles`` jobs and scaled per task). Runs alternate (array, singles,
array, ...); each prints its own spread, and the summary is the median of
the runs' medians.

    python benchmarks/arrays.py [--tasks 10000] [--repeat 3] [--singles 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dispatch import LoopbackServer
from harness import exit_on_sigterm


def array_run(client: object, tasks: int, submits: int) -> list[float]:
    """Seconds for each of ``submits`` submits of an array of ``tasks``."""
    took = []
    for _ in range(submits):
        started = time.perf_counter()
        array = client.submit(command=["true"], array=range(tasks), max_parallel=8)  # type: ignore[attr-defined]
        took.append(time.perf_counter() - started)
        array.cancel()
        array.wait(timeout=300)
    return took


def singles_run(client: object, jobs: int) -> list[float]:
    """Seconds for each of ``jobs`` separate submits (then cancelled, untimed)."""
    took, made = [], []
    for _ in range(jobs):
        started = time.perf_counter()
        made.append(client.submit(command=["true"], labels={"bench": "singles"}))  # type: ignore[attr-defined]
        took.append(time.perf_counter() - started)
    client.cancel_jobs(labels={"bench": "singles"})  # type: ignore[attr-defined]
    return took


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return f"p25 {q[0] * 1e3:.1f} ms, median {q[1] * 1e3:.1f} ms, p75 {q[2] * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, alternated")
    parser.add_argument("--submits", type=int, default=3, help="array submits per run")
    parser.add_argument("--singles", type=int, default=1000, help="separate submits per run")
    args = parser.parse_args()
    exit_on_sigterm()
    arrays: list[float] = []
    singles: list[float] = []
    with LoopbackServer() as srv, srv.client() as client:
        client.submit(command=["true"]).cancel()  # connections and caches warm
        for run in range(args.repeat):
            took = array_run(client, args.tasks, args.submits)
            arrays.append(statistics.median(took))
            print(f"run {run + 1}: array of {args.tasks}: {quartiles(took)}", file=sys.stderr)
            each = singles_run(client, args.singles)
            singles.append(statistics.median(each))
            print(f"run {run + 1}: one job per submit: {quartiles(each)}", file=sys.stderr)
    array_s = statistics.median(arrays)
    single_s = statistics.median(singles)
    as_singles = single_s * args.tasks
    print(
        f"array of {args.tasks} tasks, one request: {array_s * 1e3:.0f} ms "
        f"(runs: {', '.join(f'{a * 1e3:.0f}' for a in arrays)} ms; target < 1000 ms)"
    )
    print(
        f"the same as {args.tasks} separate submits: {as_singles:.1f} s "
        f"({single_s * 1e3:.2f} ms each; runs: {', '.join(f'{s * 1e3:.2f}' for s in singles)} ms)"
    )
    print(f"array / separate submits: {array_s / as_singles:.3f}x")


if __name__ == "__main__":
    main()
