"""What GPUlayer adds around a job that does nothing (`python -c pass`).

Everything is measured in one run, so the ratios compare like with like on a
noisy machine:

1. bare: `subprocess.run([sys.executable, "-c", "pass"])`, the floor;
2. one job: submit until `wait()` returns, on an idle local worker;
   a command job, ``python -c pass`` itself;
2a. a trivial script job (a ``.py`` file holding ``print()``), warm: forked
   from the worker's ready interpreter (the worker is started with
   ``GPULAYER_WARM=ready``, so it is made and waited for first;
   ``GPULAYER_PRELOAD`` as set, default torch and numpy);
   it imports nothing, so it forks from the *light* zygote (no preload);
2b. the same script job cold (``warm=False``), for comparison;
2c. where numpy is preloaded, a script job of ``import numpy`` and
   ``print()``, warm: forked from the full zygote;
   (1), (2), (2a), (2b) and (2c) alternate, and each reports the median of
   `--repeat` runs, its ratio to bare, and the quartiles of its ratio to the
   bare run just before it; each script job's record must say the start it
   was measured as (``warm``, or ``cold: <why>``), or the benchmark stops;
3. bare throughput: `--jobs` such processes on `--workers` runner threads;
4. GPUlayer throughput: `--jobs` jobs on `--workers` local workers;
   (3) and (4) alternate for `--rounds` bursts each, medians reported;
5. submits per second into the embedded store, with no worker taking them;
6. import time of `gpulayer` and of the worker's import path;
7. prepare on a cache hit: a task's workspace laid out from blobs already in
   the worker's cache (a bundle of small source files and two 4 MiB files,
   plus one input of ``--prepare-mib``), median of ``--repeat`` runs;
8. with ``--server``, the CPU time the server, the workers and the client
   spend per job during the GPUlayer bursts.

With ``--server`` the same figures (1-5) go through a real `gpulayer server`
process and real `gpulayer worker` processes on loopback, started in a
temporary home and stopped at the end (on error and Ctrl-C too); submits are
counted over HTTP from one client, with no worker taking them.

    python benchmarks/dispatch.py --jobs 40 --workers 4
    python benchmarks/dispatch.py --server --jobs 40 --workers 4
    python benchmarks/dispatch.py --single --repeat 15    # (1)-(2c) only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import Announced, exit_on_sigterm, free_port, stop

import gpulayer

NOOP = [sys.executable, "-c", "pass"]
TRIVIAL_SCRIPT = "print()\n"
FULL_SCRIPT = "import numpy\nprint()\n"  # preloaded: its fork is the full zygote's
# Warm script job over bare `python -c pass`, at most: faster than starting
# an interpreter at all (over HTTP, two requests' worth more).
TARGET_WARM = {"embedded": 0.5, "server": 0.7}
# What the workers of the single-job measure are started with (warm/).
WARM_READY = {"GPULAYER_WARM": "ready"}


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


def script_once(
    client: gpulayer.Client, script: Path, warm: bool
) -> tuple[float, dict[str, float]]:
    """The trivial script job, submit until ``wait()`` returns; it must have
    started as asked (warm: forked from the ready interpreter)."""
    start = time.perf_counter()
    job = client.submit(script, warm=warm)
    status = job.wait()
    elapsed = time.perf_counter() - start
    if status != "succeeded":
        raise RuntimeError(f"script job {job.id} {status}: {job.info.reason}\n{job.logs()}")
    if (job.info.start == "warm") != warm:
        raise RuntimeError(
            f"script job {job.id} started {job.info.start!r}, not {'warm' if warm else 'cold'}: "
            "its figure would be mislabelled"
        )
    return elapsed, job.info.timings()


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment while the block runs: an
    embedded worker reads ``GPULAYER_WARM`` as it starts."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def single(repeat: int) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as home,
        gpulayer.Client(home=home) as client,
        environment(WARM_READY),
    ):
        client.ensure_local_workers(1)
        return measure_single(client, repeat, TARGET_WARM["embedded"])


def measure_single(client: gpulayer.Client, repeat: int, warm_target: float) -> dict[str, Any]:
    """Bare, one command job, the trivial script job warm and cold alternate
    on ``client``'s idle worker; medians of each."""
    preload = os.environ.get("GPULAYER_PRELOAD", "torch,numpy")
    with tempfile.TemporaryDirectory(prefix="gpulayer-trivial-") as src:
        (Path(src) / "light").mkdir()
        (Path(src) / "full").mkdir()
        script = Path(src) / "light" / "trivial.py"  # alone in its folder: a one-file bundle
        script.write_text(TRIVIAL_SCRIPT)
        full = Path(src) / "full" / "numpy_trivial.py"
        full.write_text(FULL_SCRIPT)
        jobs: dict[str, Callable[[], tuple[float, dict[str, float]]]] = {
            "gpulayer": lambda: gpulayer_once(client),
            "warm": lambda: script_once(client, script, warm=True),
            "cold_script": lambda: script_once(client, script, warm=False),
        }
        if "numpy" in preload.split(","):
            jobs["warm_full"] = lambda: script_once(client, full, warm=True)
        runs: dict[str, list[float]] = {"bare": [], **{name: [] for name in jobs}}
        stages: dict[str, list[dict[str, float]]] = {name: [] for name in jobs}
        for _ in range(3):  # warm up every path
            bare_once()
            for once in jobs.values():
                once()
        for _ in range(repeat):
            runs["bare"].append(bare_once())
            for name, once in jobs.items():
                took, timings = once()
                runs[name].append(took)
                stages[name].append(timings)
    bare = statistics.median(runs["bare"])
    out: dict[str, Any] = {"bare_ms": bare * 1e3, "warm_target": warm_target}
    for name in jobs:
        prefix = "" if name == "gpulayer" else f"{name}_"
        median_stages = {k: statistics.median(s[k] for s in stages[name]) for k in stages[name][0]}
        out[f"{name}_ms"] = statistics.median(runs[name]) * 1e3
        out[f"{prefix}ratio"] = statistics.median(runs[name]) / bare
        # Each job against the bare start just before it: how far one run's
        # figure can move on this machine by noise alone.
        out[f"{prefix}pair_ratio_quartiles"] = _quartiles(
            [o / b for o, b in zip(runs[name], runs["bare"], strict=True)]
        )
        out[f"{prefix}stages_ms"] = {k: round(v * 1e3, 3) for k, v in median_stages.items()}
    out["warm_ok"] = out["warm_ratio"] <= warm_target
    out["preload"] = preload
    return out


def _quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles (both the one value when there is one)."""
    if len(values) < 2:
        return values * 2
    q1, _, q3 = statistics.quantiles(values, n=4)
    return [q1, q3]


def throughput(jobs: int, workers: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as home, gpulayer.Client(home=home) as client:
        client.ensure_local_workers(workers)
        return measure_burst(client, jobs, workers, rounds)


def measure_burst(
    client: gpulayer.Client,
    jobs: int,
    workers: int,
    rounds: int,
    processes: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """Bare and GPUlayer bursts alternate; each reports its median round.

    ``processes`` (name -> pids; "client" is this process) get their CPU time
    over the GPUlayer bursts reported per job, as ``cpu_ms_per_job_<name>``.
    """
    import psutil

    procs = {name: [psutil.Process(p) for p in pids] for name, pids in (processes or {}).items()}

    def cpu() -> dict[str, float]:
        return {n: sum(sum(p.cpu_times()[:2]) for p in ps) for n, ps in procs.items()}

    bare, ours = [], []
    spent = dict.fromkeys(procs, 0.0)
    with ThreadPoolExecutor(workers) as pool:
        gpulayer_once(client)  # warm
        for _ in range(rounds):
            start = time.perf_counter()
            list(pool.map(lambda _: subprocess.run(NOOP, check=True), range(jobs)))
            bare.append(jobs / (time.perf_counter() - start))
            before = cpu()
            start = time.perf_counter()
            handles = [client.submit(command=NOOP) for _ in range(jobs)]
            states = [h.wait() for h in handles]
            ours.append(jobs / (time.perf_counter() - start))
            for name, seconds in cpu().items():
                spent[name] += seconds - before[name]
            assert states == ["succeeded"] * jobs
    b, o = statistics.median(bare), statistics.median(ours)
    # Each GPUlayer burst against the bare burst just before it.
    paired = [ours_i / bare_i for ours_i, bare_i in zip(ours, bare, strict=True)]
    result: dict[str, Any] = {
        "bare_jobs_per_s": b,
        "gpulayer_jobs_per_s": o,
        "ratio": o / b,
        "round_ratios": paired,
    }
    for name, seconds in spent.items():
        result[f"cpu_ms_per_job_{name}"] = 1000 * seconds / (jobs * rounds)
    return result


def submits(count: int) -> dict[str, float]:
    with (
        tempfile.TemporaryDirectory() as home,
        gpulayer.Client(home=home, auto_worker=False) as client,
    ):
        return measure_submits(client, count)


def measure_submits(client: gpulayer.Client, count: int) -> dict[str, float]:
    client.submit(command=NOOP)  # open and warm the store (and the connection)
    start = time.perf_counter()
    for _ in range(count):
        client.submit(command=NOOP)
    return {"submits_per_s": count / (time.perf_counter() - start)}


class _CacheHit:
    """The one transport call prepare() makes: every blob is already cached."""

    def download_blob(self, digest: str, cache: Any) -> Path:
        return Path(cache.path(digest))


def prepare_hit(repeat: int, input_mib: int) -> dict[str, Any]:
    """workspace.prepare() on a cache hit, median ms (see item 7 of the docstring).

    Files of 1 MiB and more are what changes with the cache's mechanism (hard
    link, clone or copy: see defaults.LINK_MIN_BYTES); the small source files
    are copied either way.
    """
    import inspect
    import shutil

    from gpulayer import bundle
    from gpulayer.artifacts import ArtifactStore
    from gpulayer.jobs import RunTask
    from gpulayer.spec import ArtifactRef, JobSpec
    from gpulayer.worker import workspace

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "src"
        (src / "pkg").mkdir(parents=True)
        for i in range(40):
            (src / "pkg" / f"mod{i}.py").write_bytes(os.urandom(4096))
        for i in range(2):
            (src / f"vocab{i}.bin").write_bytes(os.urandom(4 << 20))
        data = root / "data.bin"
        data.write_bytes(os.urandom(input_mib << 20))
        cache = ArtifactStore(root / "cache")
        digest = bundle.store(src, bundle.scan(src), cache)
        spec = JobSpec(
            command=["true"],
            bundle=digest,
            inputs={"data": ArtifactRef("file", cache.put_file(data), input_mib << 20)},
        )
        task = RunTask(job_id="bench", attempt=1, spec=spec, slots=[0], gpus=[])
        # The mechanisms prepare() offers: hard links only where the job's
        # user cannot write the cache's blobs (another Unix user). Looked up,
        # so that this measure also runs on versions from before the choice,
        # to compare with in alternated runs.
        variants: dict[str, dict[str, bool]] = {"default": {}}
        hit: Any = _CacheHit()
        if "link_blobs" in inspect.signature(workspace.prepare).parameters:
            variants["link_blobs"] = {"link_blobs": True}
        figures: dict[str, Any] = {"input_mib": input_mib, "bundle_files": 42}
        for name, options in variants.items():
            times = []
            for i in range(repeat + 2):  # the first two warm the page cache
                task_dir = workspace.make_spare(root / "tasks" / f"{name}-{i}")
                start = time.perf_counter()
                workspace.prepare(task, task_dir, hit, cache, **options)
                times.append(time.perf_counter() - start)
                shutil.rmtree(task_dir)
            figures[f"{name}_ms"] = round(statistics.median(times[2:]) * 1e3, 3)
        return figures


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


# ---- server mode: a real server process and real worker processes on loopback ----


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "gpulayer.cli", *argv]


class LoopbackServer:
    """`gpulayer server start` on 127.0.0.1 in a temporary home, and its workers.

    Each is waited for by its "serving" line, and its output is copied to a
    file in the home; ``close`` stops the workers, then the server, and
    removes the home, whatever happened before.
    """

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="gpulayer-bench-")
        self.root = Path(self._tmp.name)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> LoopbackServer:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(
        self, argv: list[str], log: Path, what: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start a process and block until it says "serving" (its output goes
        to ``log``). Own session: a Ctrl-C reaches only the benchmark, which
        stops the workers before the server, in order. Stdout is left out:
        the server prints its admin token there (read from the home instead).
        """
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert proc.stderr is not None
        Announced(proc.stderr, log).wait(f"{what} did not start")
        return proc

    def _start(self) -> None:
        home, log = self.root / "server", self.root / "server.log"
        argv = _cli(
            "--home", str(home), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)
        )
        self.proc = self._spawn(argv, log, "the server")
        self.admin = (home / "admin-token").read_text().strip()

    def start_workers(self, count: int, env: dict[str, str] | None = None) -> None:
        """``count`` one-slot CPU worker processes, each registered when this
        returns; with this process's environment, and ``env`` over it."""
        env = {**os.environ, **(env or {}), "GPULAYER_TOKEN": self.admin}
        for _ in range(count):
            i = len(self.workers)
            argv = _cli(
                "--home",
                str(self.root / f"worker-{i}"),
                "--server",
                self.url,
                "worker",
                "start",
                "--gpus",
                "none",  # CPU jobs, measured alike on a machine with GPUs
                "--slots",
                "1",
                "--name",
                f"bench-{i}",
            )
            self.workers.append(
                self._spawn(argv, self.root / f"worker-{i}.log", f"worker {i}", env)
            )

    def client(self) -> gpulayer.Client:
        return gpulayer.Client(self.url, token=self.admin)

    def close(self) -> None:
        try:
            for proc in self.workers:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in self.workers:
                stop(proc)
            if self.proc is not None:
                stop(self.proc)
        finally:
            self._tmp.cleanup()


def server_single(repeat: int) -> dict[str, Any]:
    with LoopbackServer() as srv, srv.client() as client:
        srv.start_workers(1, WARM_READY)
        return measure_single(client, repeat, TARGET_WARM["server"])


def server_throughput(jobs: int, workers: int, rounds: int) -> dict[str, Any]:
    with LoopbackServer() as srv, srv.client() as client:
        srv.start_workers(workers)
        assert srv.proc is not None
        processes = {
            "server": [srv.proc.pid],
            "workers": [w.pid for w in srv.workers],
            "client": [os.getpid()],
        }
        return measure_burst(client, jobs, workers, rounds, processes)


def server_submits(count: int) -> dict[str, float]:
    with LoopbackServer() as srv, srv.client() as client:  # no worker: nothing takes them
        return measure_submits(client, count)


def ratio_note(figures: dict[str, Any], target: str, prefix: str = "") -> str:
    """A ratio, the range this run's noise gave it (the quartiles of the
    single jobs' pairs, or the lowest and highest of the bursts') and its
    target; ``prefix`` picks a single job's kind ("warm_", "cold_script_")."""
    if "round_ratios" in figures:
        label, values = "rounds", figures["round_ratios"]
    else:
        label, values = "pairs' quartiles", figures[f"{prefix}pair_ratio_quartiles"]
    return (
        f"{figures[f'{prefix}ratio']:.3f}x bare ({label} {min(values):.3f}-{max(values):.3f}; "
        f"target {target})"
    )


def script_rows(one: dict[str, Any], over: str) -> list[tuple[str, str, str]]:
    """The trivial script job's rows, warm against its target, and cold."""
    target = one["warm_target"]
    verdict = "met" if one["warm_ok"] else "NOT met"
    rows = [
        (
            f"trivial script job{over}, warm",
            f"{one['warm_ms']:.2f} ms",
            ratio_note(one, f"<= {target:.2f}: {verdict}", "warm_"),
        ),
        (
            f"trivial script job{over}, cold",
            f"{one['cold_script_ms']:.2f} ms",
            ratio_note(one, "none, for comparison", "cold_script_"),
        ),
    ]
    if "warm_full_ms" in one:
        rows.append(
            (
                f"numpy script job{over}, warm (full zygote)",
                f"{one['warm_full_ms']:.2f} ms",
                ratio_note(one, "none, for comparison", "warm_full_"),
            )
        )
    return rows


def print_stages(one: dict[str, Any]) -> None:
    for label, key in (
        ("one job", "stages_ms"),
        ("the warm script job", "warm_stages_ms"),
        ("the cold script job", "cold_script_stages_ms"),
        ("the numpy script job (full zygote)", "warm_full_stages_ms"),
    ):
        if key not in one:
            continue
        print(
            f"stages of {label} (median ms): " + ", ".join(f"{k} {v}" for k, v in one[key].items())
        )


def print_rows(rows: list[tuple[str, str, str]]) -> None:
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")


def single_only(args: argparse.Namespace, machine: str, one: dict[str, Any], over: str) -> None:
    """``--single``: the single-job rows and stages, and their JSON."""
    print_rows(
        [
            ("python -c pass (bare)", f"{one['bare_ms']:.2f} ms", ""),
            (
                f"one job{over}, submit -> wait()",
                f"{one['gpulayer_ms']:.2f} ms",
                ratio_note(one, "<= 1.20" if args.server else "<= 1.10"),
            ),
            *script_rows(one, over),
        ]
    )
    print_stages(one)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "machine": machine,
                "mode": "server" if args.server else "embedded",
                "args": vars(args) | {"json": str(args.json)},
                "single": one,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}", file=sys.stderr)


def main_server(args: argparse.Namespace, machine: str) -> None:
    exit_on_sigterm()
    print("server mode: a server process and worker processes on 127.0.0.1", file=sys.stderr)
    print("measuring one job ...", file=sys.stderr)
    one = server_single(args.repeat)
    if args.single:
        single_only(args, machine, one, " over HTTP")
        return
    print(f"measuring {args.jobs} jobs on {args.workers} worker processes ...", file=sys.stderr)
    burst = server_throughput(args.jobs, args.workers, args.rounds)
    print("measuring submits over HTTP ...", file=sys.stderr)
    http = server_submits(args.submits)
    print_rows(
        [
            ("python -c pass (bare)", f"{one['bare_ms']:.2f} ms", ""),
            (
                "one job over HTTP, submit -> wait()",
                f"{one['gpulayer_ms']:.2f} ms",
                ratio_note(one, "<= 1.20"),
            ),
            *script_rows(one, " over HTTP"),
            (
                f"bare, {args.jobs} on {args.workers} threads",
                f"{burst['bare_jobs_per_s']:.1f} jobs/s",
                "",
            ),
            (
                f"gpulayer, {args.jobs} on {args.workers} worker processes",
                f"{burst['gpulayer_jobs_per_s']:.1f} jobs/s",
                ratio_note(burst, ">= 0.85"),
            ),
            ("submits over HTTP, one client", f"{http['submits_per_s']:.0f} /s", "target >= 1000"),
            (
                "CPU per job in the burst",
                f"server {burst['cpu_ms_per_job_server']:.2f} ms",
                f"workers {burst['cpu_ms_per_job_workers']:.2f} ms, "
                f"client {burst['cpu_ms_per_job_client']:.2f} ms",
            ),
        ]
    )
    print_stages(one)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "machine": machine,
                "mode": "server",
                "args": vars(args) | {"json": str(args.json)},
                "single": one,
                "burst": burst,
                "submits": http,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}", file=sys.stderr)


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
        "--prepare-mib", type=int, default=16, help="size of the input in the prepare measure"
    )
    parser.add_argument(
        "--single",
        action="store_true",
        help="only the single-job measures (1 to 2c), embedded or with --server",
    )
    parser.add_argument(
        "--server",
        action="store_true",
        help="through a server process and worker processes on 127.0.0.1",
    )
    parser.add_argument(
        "--json",
        type=Path,
        help="where to write the figures (default results/dispatch.json, "
        "results/dispatch-server.json with --server)",
    )
    args = parser.parse_args()
    for option in ("jobs", "workers", "repeat", "rounds", "submits"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1, got {getattr(args, option)}")
    name = "dispatch-server.json" if args.server else "dispatch.json"
    args.json = args.json or Path(__file__).parent / "results" / name

    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"machine: {machine}", file=sys.stderr)
    if args.server:
        main_server(args, machine)
        return
    print("measuring one job ...", file=sys.stderr)
    one = single(args.repeat)
    if args.single:
        single_only(args, machine, one, "")
        return
    print(f"measuring {args.jobs} jobs on {args.workers} workers ...", file=sys.stderr)
    burst = throughput(args.jobs, args.workers, args.rounds)
    print("measuring submits ...", file=sys.stderr)
    store = submits(args.submits)
    imports = {m: import_ms(m) for m in ("gpulayer", "gpulayer.worker.worker", "gpulayer.cli")}
    print("measuring prepare on a cache hit ...", file=sys.stderr)
    hit = prepare_hit(args.repeat, args.prepare_mib)

    rows = [
        ("python -c pass (bare)", f"{one['bare_ms']:.2f} ms", ""),
        (
            "one job, submit -> wait()",
            f"{one['gpulayer_ms']:.2f} ms",
            ratio_note(one, "<= 1.10"),
        ),
        *script_rows(one, ""),
        (
            f"bare, {args.jobs} on {args.workers} threads",
            f"{burst['bare_jobs_per_s']:.1f} jobs/s",
            "",
        ),
        (
            f"gpulayer, {args.jobs} on {args.workers} workers",
            f"{burst['gpulayer_jobs_per_s']:.1f} jobs/s",
            ratio_note(burst, ">= 0.90"),
        ),
        ("submits, embedded store", f"{store['submits_per_s']:.0f} /s", "target >= 5000"),
    ] + [(f"import {m}", f"{ms:.1f} ms", "") for m, ms in imports.items()]
    rows += [
        (
            f"prepare on a cache hit ({name})",
            f"{hit[f'{name}_ms']:.2f} ms",
            f"42 bundle files, 8 MiB of them in two files; a {hit['input_mib']} MiB input",
        )
        for name in ("default", "link_blobs")
        if f"{name}_ms" in hit
    ]
    print_rows(rows)
    print_stages(one)

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
                "prepare_hit": hit,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
