"""What GPUlayer adds around a job that does nothing (`python -c pass`).

Everything is measured in one run, so the ratios compare like with like on a
noisy machine:

1. bare: `subprocess.run([sys.executable, "-c", "pass"])`, the floor;
2. one job: submit until `wait()` returns, on an idle local worker;
   (1) and (2) alternate, and each reports the median of `--repeat` runs;
3. bare throughput: `--jobs` such processes on `--workers` runner threads;
4. GPUlayer throughput: `--jobs` jobs on `--workers` local workers;
   (3) and (4) alternate for `--rounds` bursts each, medians reported;
5. submits per second into the embedded store, with no worker taking them;
6. import time of `gpulayer` and of the worker's import path.

    python benchmarks/dispatch.py --jobs 40 --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gpulayer

NOOP = [sys.executable, "-c", "pass"]


def bare_once() -> float:
    start = time.perf_counter()
    subprocess.run(NOOP, check=True)
    return time.perf_counter() - start


def gpulayer_once(client: gpulayer.Client) -> tuple[float, dict[str, float]]:
    start = time.perf_counter()
    job = client.submit(command=NOOP)
    status = job.wait()
    elapsed = time.perf_counter() - start
    assert status == "succeeded", job.info.reason
    return elapsed, job.info.timings()


def single(repeat: int) -> dict[str, object]:
    bare, ours, stages = [], [], []
    with tempfile.TemporaryDirectory() as home, gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1)
        for _ in range(3):  # warm up both paths
            bare_once()
            gpulayer_once(client)
        for _ in range(repeat):
            bare.append(bare_once())
            took, timings = gpulayer_once(client)
            ours.append(took)
            stages.append(timings)
    median_stages = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    return {
        "bare_ms": statistics.median(bare) * 1e3,
        "gpulayer_ms": statistics.median(ours) * 1e3,
        "ratio": statistics.median(ours) / statistics.median(bare),
        "stages_ms": {k: round(v * 1e3, 3) for k, v in median_stages.items()},
    }


def throughput(jobs: int, workers: int, rounds: int) -> dict[str, float]:
    """Bare and GPUlayer bursts alternate; each reports its median round."""
    bare, ours = [], []
    with (
        tempfile.TemporaryDirectory() as home,
        gpulayer.Client(home=home) as client,
        ThreadPoolExecutor(workers) as pool,
    ):
        client.ensure_local_workers(workers)
        gpulayer_once(client)  # warm
        for _ in range(rounds):
            start = time.perf_counter()
            list(pool.map(lambda _: subprocess.run(NOOP, check=True), range(jobs)))
            bare.append(jobs / (time.perf_counter() - start))
            start = time.perf_counter()
            handles = [client.submit(command=NOOP) for _ in range(jobs)]
            states = [h.wait() for h in handles]
            ours.append(jobs / (time.perf_counter() - start))
            assert states == ["succeeded"] * jobs
    b, o = statistics.median(bare), statistics.median(ours)
    return {"bare_jobs_per_s": b, "gpulayer_jobs_per_s": o, "ratio": o / b}


def submits(count: int) -> dict[str, float]:
    with (
        tempfile.TemporaryDirectory() as home,
        gpulayer.Client(home=home, auto_worker=False) as client,
    ):
        client.submit(command=NOOP)  # open and warm the store
        start = time.perf_counter()
        for _ in range(count):
            client.submit(command=NOOP)
        rate = count / (time.perf_counter() - start)
    return {"submits_per_s": rate}


def import_ms(module: str, repeat: int = 7) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    runs = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(repeat)
    ]
    return statistics.median(runs) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--repeat", type=int, default=30, help="runs of the single-job measure (median)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="bursts of each kind (median)")
    parser.add_argument("--submits", type=int, default=3000)
    parser.add_argument(
        "--json", type=Path, default=Path(__file__).parent / "results" / "dispatch.json"
    )
    args = parser.parse_args()

    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"machine: {machine}", file=sys.stderr)
    print("measuring one job ...", file=sys.stderr)
    one = single(args.repeat)
    print(f"measuring {args.jobs} jobs on {args.workers} workers ...", file=sys.stderr)
    burst = throughput(args.jobs, args.workers, args.rounds)
    print("measuring submits ...", file=sys.stderr)
    store = submits(args.submits)
    imports = {m: import_ms(m) for m in ("gpulayer", "gpulayer.worker.worker", "gpulayer.cli")}

    rows = [
        ("python -c pass (bare)", f"{one['bare_ms']:.2f} ms", ""),
        (
            "one job, submit -> wait()",
            f"{one['gpulayer_ms']:.2f} ms",
            f"{one['ratio']:.3f}x bare (target <= 1.10)",
        ),
        (
            f"bare, {args.jobs} on {args.workers} threads",
            f"{burst['bare_jobs_per_s']:.1f} jobs/s",
            "",
        ),
        (
            f"gpulayer, {args.jobs} on {args.workers} workers",
            f"{burst['gpulayer_jobs_per_s']:.1f} jobs/s",
            f"{burst['ratio']:.3f}x bare (target >= 0.90)",
        ),
        ("submits, embedded store", f"{store['submits_per_s']:.0f} /s", "target >= 5000"),
    ] + [(f"import {m}", f"{ms:.1f} ms", "") for m, ms in imports.items()]
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    print(
        "stages of one job (median ms): "
        + ", ".join(f"{k} {v}" for k, v in one["stages_ms"].items())
    )  # type: ignore[attr-defined]

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "machine": machine,
                "args": vars(args) | {"json": str(args.json)},
                "single": one,
                "burst": burst,
                "store": store,
                "import_ms": imports,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
