"""Where the start-up of a trivial 2 x 2 distributed job goes: the direct
launcher cold and warm, against torchrun.

One job of 2 nodes x 2 ranks per node on 2 one-slot workers. Each rank runs a
script whose very first statement records ``time.time()`` (nothing imported
before it but ``time``), then imports torch, initialises the process group
(gloo on CPU; NCCL with one GPU per rank when CUDA shows 4 GPUs or more, in
embedded mode only, where the local workers split the GPUs between them),
all-reduces one value, destroys the group, reads its own memory (RSS, and
its private part, the USS: ``Private_Clean + Private_Dirty`` in
``/proc/self/smaps_rollup``), and prints its timestamps and memory as one
JSON line; the benchmark reads them from the job's logs and puts them next to
the job's own marks (``submitted``, ``started`` = the latest node's process
start, ``exited`` = the latest node's exit, ``finished``):

=========================  =========================================================
GPUlayer dispatch          submit -> tasks started (``started - submitted``)
launcher start-up          task start -> script running (latest rank's first
                           statement - ``started``)
import torch               per rank, min to max across the ranks
process-group init         per rank, ``init_process_group`` and a first all-reduce
script                     latest rank's first statement -> latest rank's last
launcher shutdown          latest rank's last timestamp (taken just before its
                           interpreter exits) -> ``exited``; includes the rank's
                           own interpreter shutdown
GPUlayer finish            ``exited`` -> ``finished`` (outputs, report)
GPUlayer completion        ``finished`` -> the client's ``wait()`` returns
total                      submit -> the client's ``wait()`` returns
=========================  =========================================================

The first five and the last two add up to the total, less the submit call.
The direct launcher's start-up can come out a millisecond or two below zero:
the worker takes the ``started`` mark once its last rank is spawned, and the
ranks may already be running by then.

A third column, ``bare``, is the floor: the same 4 ranks spawned straight from
the benchmark with ``subprocess.Popen`` and the variables set by hand, no
GPUlayer and no launcher. There "dispatch" is the time to spawn the 4
processes, "launcher start-up" an interpreter's start, and "launcher
shutdown" the ranks' own interpreter exit after importing torch (a cost the
launchers' figures include as well).

The jobs are run three ways: ``direct``, the direct launcher with a cold
start (``warm=False``: each rank a new interpreter); ``warm``, the direct
launcher with a warm start (each rank forked from the worker's ready
interpreter, which has imported torch: see src/gpulayer/worker/warm/); and
``torchrun``. The benchmark sets ``GPULAYER_WARM=ready`` for the workers it
starts, so that their ready interpreters are made, and waited for, before
they take a job; ``GPULAYER_PRELOAD`` is left as it is (default: torch and
numpy). Each job's record must say the start it was measured as (``warm``,
or ``cold: <why>``), or the benchmark stops.

Bare, direct, warm and torchrun take turns, ``--repeat`` runs each (the
order rotated every round), after ``--warmup`` unmeasured runs each; medians
are reported (min-to-max rows: median of each run's minimum to median of its
maximum), and each run's figures are printed as it ends, so the spread shows.
The figures compared are ratios from the same run: direct's total over
torchrun's (target at most 0.65), direct's launcher start-up (target at most
0.1 s), warm's total over direct's (target at most 0.15) and warm's launcher
start-up (target at most 0.05 s).

Memory: each rank's RSS and USS as it ends (a warm rank's USS is what it
adds to its zygote's memory, which it shares; a cold rank's RSS is what it
costs on its own), and each zygote's RSS and USS, read from /proc after the
runs (the zygotes are found among the worker processes' children by
``zygote.py`` in their command line).

Modes:

- default: embedded, one process with 2 local workers;
- ``--server``: a real ``gpulayer server`` process and 2 real ``gpulayer
  worker`` processes on 127.0.0.1, started and stopped by the benchmark;
- ``--netns``: the server and each worker in its own Linux network namespace,
  joined by veth pairs on a bridge (``tests/netns_cluster.py``); needs root.
  The ranks get ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` naming the
  namespace's interface (see that module).

Results go to ``benchmarks/results/distributed_startup[-server|-netns].json``.

    python benchmarks/distributed_startup.py --repeat 3
    python benchmarks/distributed_startup.py --server
    sudo .venv/bin/python benchmarks/distributed_startup.py --netns
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from harness import exit_on_sigterm

import gpulayer
from gpulayer.jobs import MARKS

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
# Each kind of job: its launcher, and whether it may start warm.
JOBS = {"direct": ("direct", False), "warm": ("direct", True), "torchrun": ("torchrun", True)}
KINDS = ("bare", *JOBS)
NODES, PER_NODE = 2, 2
JOB_TIMEOUT_S = 300.0
TARGET_RATIO = 0.65  # direct's total over torchrun's, at most
TARGET_DIRECT_STARTUP_S = 0.1
TARGET_WARM_RATIO = 0.15  # warm's total over cold direct's, at most
TARGET_WARM_STARTUP_S = 0.05
MIB = 1 << 20

RANK_SCRIPT = """\
import time

start = time.time()  # the very first statement: the launcher has handed over
import json
import os

torch0 = time.time()
import torch
import torch.distributed as dist

torch1 = time.time()
backend = os.environ.get("BENCH_BACKEND", "gloo")
device = "cpu"
if backend == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = "cuda"
dist.init_process_group(backend)
value = torch.ones(1, device=device)
dist.all_reduce(value)  # the group works, and every connection is made
pg = time.time()
ok = value.item() == dist.get_world_size()
dist.destroy_process_group()
memory = {}
try:  # Linux: what this rank holds, and what of it is its own (not shared)
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Private_Clean", "Private_Dirty"):
                memory[name] = int(rest.split()[0]) * 1024
    memory = {"rss": memory["Rss"], "uss": memory["Private_Clean"] + memory["Private_Dirty"]}
except (OSError, KeyError):
    memory = {}
report = {"bench": 1, "rank": int(os.environ["RANK"]), "start": start, "torch0": torch0,
          "torch1": torch1, "pg": pg, "ok": ok, **memory}
report["end"] = time.time()  # the last thing before the interpreter exits
print(json.dumps(report), flush=True)
"""


# ---- the floor: the same ranks spawned straight from this process ----


def bare_once(script: Path, env: dict[str, str], backend: str) -> dict[str, Any]:
    """The 4 ranks started with ``subprocess.Popen`` and the variables set by
    hand: no GPUlayer, no launcher. Same stages, where they apply."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = NODES * PER_NODE
    t_submit = time.time()
    procs = []
    for rank in range(world):
        own = {**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(rank % PER_NODE),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(PER_NODE),
               "NODE_RANK": str(rank // PER_NODE), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        if backend == "nccl":  # each "node" its own pair of GPUs, as the workers split them
            first = PER_NODE * (rank // PER_NODE)
            own["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(PER_NODE))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=own,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                # Each in a session of its own, as the worker spawns its ranks:
                # with the kernel's autogroup scheduling a session is a CPU
                # share, and on a busy machine 4 ranks sharing this process's
                # would run slower than the same ranks under a worker.
                start_new_session=True,
            )
        )
    started = time.time()
    outs = [p.communicate(timeout=JOB_TIMEOUT_S) for p in procs]
    exited = time.time()
    if any(p.returncode for p in procs):
        raise RuntimeError("a bare rank failed:\n" + "\n".join(o + e for o, e in outs))
    ranks = [json.loads(line) for o, _ in outs for line in o.splitlines() if '"bench"' in line]
    marks = {"submitted": t_submit, "started": started, "exited": exited}
    return stages(ranks, marks, t_submit, exited) | {"launcher": "bare"}


# ---- one job ----


def run_job(
    client: gpulayer.Client, script: Path, kind: str, env: dict[str, str], gpus: int
) -> dict[str, Any]:
    """Submit the 2 x 2 job, wait for it, and split its time into stages (seconds)."""
    launcher, warm = JOBS[kind]
    t_submit = time.time()
    job = client.submit(
        str(script),
        nodes=NODES,
        procs_per_node=PER_NODE,
        launcher=launcher,
        env=env,
        gpus=gpus,
        timeout=JOB_TIMEOUT_S,
        warm=warm,
    )
    state = job.wait(timeout=JOB_TIMEOUT_S + 30)
    t_seen = time.time()
    if state != "succeeded":
        raise RuntimeError(f"{kind} job {job.id} {state}: {job.info.reason}\n{job.logs()}")
    info = job.refresh()
    # A figure labelled warm must be one: every rank forked from a ready interpreter.
    if (info.start == "warm") != (kind == "warm"):
        raise RuntimeError(
            f"{kind} job {job.id} started {info.start!r}, not "
            f"{'warm' if kind == 'warm' else 'cold'}: its figures would be mislabelled"
        )
    ranks: dict[int, dict[str, Any]] = {}
    for line in job.stream_logs(follow=False):
        if line.text.startswith('{"bench"'):
            report = json.loads(line.text)
            ranks[report["rank"]] = report
    if sorted(ranks) != list(range(NODES * PER_NODE)) or not all(r["ok"] for r in ranks.values()):
        raise RuntimeError(f"{kind} job {job.id}: ranks reported {ranks}\n{job.logs()}")
    return stages(list(ranks.values()), info.marks, t_submit, t_seen) | {
        "job": job.id,
        "kind": kind,
        "launcher": launcher,
        "start": info.start,
        "workers": sorted({t.worker for t in info.tasks}),
    }


def stages(
    ranks: list[dict[str, Any]], marks: dict[str, float], t_submit: float, t_seen: float
) -> dict[str, Any]:
    """The stages of one job (seconds), from its marks and its ranks' reports."""
    first = max(r["start"] for r in ranks)
    last = max(r["end"] for r in ranks)
    imports = [r["torch1"] - r["torch0"] for r in ranks]
    inits = [r["pg"] - r["torch1"] for r in ranks]
    out: dict[str, Any] = {
        "dispatch": marks["started"] - marks["submitted"],
        "launcher_startup": first - marks["started"],
        "import_torch": [min(imports), max(imports)],
        "pg_init": [min(inits), max(inits)],
        "script": last - first,
        "launcher_shutdown": marks["exited"] - last,
        "total": t_seen - t_submit,
        # the time marks, seconds after the submit; the others (the task's
        # CPU seconds and peak memory, where a cgroup measured them) as they are
        "marks": {k: v - t_submit for k, v in marks.items() if k in MARKS},
        "usage": {k: v for k, v in marks.items() if k not in MARKS},
        # each rank's timestamps, seconds after the submit
        "ranks": {
            r["rank"]: {k: r[k] - t_submit for k in ("start", "torch0", "torch1", "pg", "end")}
            for r in sorted(ranks, key=lambda r: r["rank"])
        },
    }
    if "finished" in marks:
        out["finish"] = marks["finished"] - marks["exited"]
        out["completion"] = t_seen - marks["finished"]
    for key in ("rss", "uss"):  # MiB, min to max across the ranks
        if all(key in r for r in ranks):
            values = [r[key] / MIB for r in ranks]
            out[f"{key}_mib"] = [min(values), max(values)]
    return out


def measure(
    client: gpulayer.Client,
    *,
    repeat: int,
    warmup: int,
    env: dict[str, str],
    backend: str,
    gpus: int,
) -> dict[str, list[dict[str, Any]]]:
    """Bare ranks, cold direct, warm direct and torchrun jobs in turn (the
    order rotated each round)."""
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="gpulayer-dist-bench-") as src:
        script = Path(src) / "rank.py"  # alone in its folder: a tiny bundle
        script.write_text(RANK_SCRIPT)
        for i in range(warmup + repeat):
            turn = i % len(KINDS)
            for kind in KINDS[turn:] + KINDS[:turn]:
                if kind == "bare":
                    # On loopback in this namespace: without the cluster's env.
                    run = bare_once(script, {"BENCH_BACKEND": backend}, backend)
                else:
                    run = run_job(client, script, kind, env, gpus)
                    if len(run["workers"]) != NODES:
                        raise RuntimeError(f"the {NODES} nodes did not get distinct workers: {run}")
                label = "warm-up" if i < warmup else f"run {i - warmup + 1}/{repeat}"
                print(
                    f"  {kind:<8} {label}: total {run['total']:.3f} s, "
                    f"launcher start-up {run['launcher_startup']:.3f} s, "
                    f"shutdown {run['launcher_shutdown']:.3f} s",
                    file=sys.stderr,
                )
                if i >= warmup:
                    runs[kind].append(run)
    return runs


# ---- summary ----


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
        elif key in ("import_torch", "pg_init", "rss_mib", "uss_mib"):
            out[key] = [
                statistics.median(r[key][0] for r in runs),
                statistics.median(r[key][1] for r in runs),
            ]
    return out


ROWS = [
    ("dispatch", "GPUlayer dispatch (submit -> tasks started)"),
    ("launcher_startup", "launcher start-up (task start -> script running)"),
    ("import_torch", "import torch, per rank"),
    ("pg_init", "process-group init + first all-reduce, per rank"),
    ("script", "script (latest rank's start -> its end)"),
    ("launcher_shutdown", "launcher shutdown after the script ends"),
    ("finish", "GPUlayer finish (process exit -> job finished)"),
    ("completion", "GPUlayer completion (job finished -> client sees it)"),
    ("total", "total (submit -> client sees the end)"),
]


MEMORY_ROWS = [
    ("rss_mib", "rank RSS as it ends, MiB"),
    ("uss_mib", "rank USS (its own pages), MiB"),
]


def fmt(value: float | list[float] | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return f"{value[0]:.{digits}f} to {value[1]:.{digits}f}"
    return f"{value:.3f}"


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_table(
    summary: dict[str, dict[str, Any]], backend: str, zygotes: list[dict[str, Any]]
) -> dict[str, Any]:
    columns = [summary[kind] for kind in KINDS]
    direct, warm, torchrun = summary["direct"], summary["warm"], summary["torchrun"]
    width = max(len(label) for _, label in ROWS) + len(backend) + 3
    header = "  ".join(f"{kind:>12}" for kind in KINDS)
    print(f"{'stage (seconds, median)':<{width}}  {header}")
    for key, label in ROWS:
        label = label.replace("process-group init", f"process-group init ({backend})")
        cells = "  ".join(f"{fmt(column.get(key)):>12}" for column in columns)
        print(f"{label:<{width}}  {cells}")
    for key, label in MEMORY_ROWS:
        cells = "  ".join(f"{fmt(column.get(key), 0):>12}" for column in columns)
        print(f"{label:<{width}}  {cells}")
    ratio = direct["total"] / torchrun["total"]
    startup = direct["launcher_startup"]
    warm_ratio = warm["total"] / direct["total"]
    warm_startup = warm["launcher_startup"]
    checks = {
        "ratio": ratio,
        "ratio_ok": ratio <= TARGET_RATIO,
        "direct_startup_s": startup,
        "direct_startup_ok": startup <= TARGET_DIRECT_STARTUP_S,
        "direct_over_bare": direct["total"] / summary["bare"]["total"],
        "warm_ratio": warm_ratio,
        "warm_ratio_ok": warm_ratio <= TARGET_WARM_RATIO,
        "warm_startup_s": warm_startup,
        "warm_startup_ok": warm_startup <= TARGET_WARM_STARTUP_S,
        "warm_over_torchrun": warm["total"] / torchrun["total"],
        "zygote_rss_mib": [z["rss_mib"] for z in zygotes],
        "warm_rank_uss_mib": warm.get("uss_mib"),
        "cold_rank_rss_mib": direct.get("rss_mib"),
    }
    print(
        f"total, direct / torchrun: {ratio:.3f} "
        f"(target <= {TARGET_RATIO}: {met(checks['ratio_ok'])}); "
        f"direct / bare: {checks['direct_over_bare']:.3f}"
    )
    print(
        f"direct launcher start-up: {startup:.3f} s "
        f"(target <= {TARGET_DIRECT_STARTUP_S} s: {met(checks['direct_startup_ok'])})"
    )
    print(
        f"total, warm / direct: {warm_ratio:.3f} "
        f"(target <= {TARGET_WARM_RATIO}: {met(checks['warm_ratio_ok'])}); "
        f"warm / torchrun: {checks['warm_over_torchrun']:.3f}"
    )
    print(
        f"warm launcher start-up: {warm_startup:.3f} s "
        f"(target <= {TARGET_WARM_STARTUP_S} s: {met(checks['warm_startup_ok'])})"
    )
    if zygotes:
        print(
            f"ready interpreters: {len(zygotes)}, RSS "
            + ", ".join(f"{z['rss_mib']:.0f}" for z in zygotes)
            + " MiB (their spare children's USS "
            + ", ".join(f"{z['spare_uss_mib']:.0f}" for z in zygotes)
            + " MiB); a warm rank adds its USS, "
            + fmt(warm.get("uss_mib"), 0)
            + " MiB, where a cold rank takes its RSS, "
            + fmt(direct.get("rss_mib"), 0)
            + " MiB"
        )
    else:
        print("ready interpreters: none found among the workers' processes")
    return checks


def zygote_memory(roots: list[int]) -> list[dict[str, Any]]:
    """The memory (MiB) of each ready interpreter under the processes
    ``roots`` (the benchmark itself when the workers are embedded, else the
    worker processes): a process running ``zygote.py`` whose parent does not.
    Its children that run ``zygote.py`` too are the spares it forks ahead
    (to answer the next task at once); they share its pages, so each is
    counted by its USS, and the zygote by its RSS (its own USS would leave
    out what it shares with its spare)."""

    def is_zygote(proc: psutil.Process) -> bool:
        with contextlib.suppress(psutil.Error):
            return any(part.endswith("zygote.py") for part in proc.cmdline())
        return False

    found = []
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            for proc in psutil.Process(root).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    parent = proc.parent()
                    if not is_zygote(proc) or (parent is not None and is_zygote(parent)):
                        continue
                    spares = [c for c in proc.children() if is_zygote(c)]
                    found.append(
                        {
                            "pid": proc.pid,
                            "omp_num_threads": proc.environ().get("OMP_NUM_THREADS"),
                            "rss_mib": proc.memory_info().rss / MIB,
                            "spares": len(spares),
                            "spare_uss_mib": sum(c.memory_full_info().uss for c in spares) / MIB,
                        }
                    )
    return found


# ---- where the workers are ----


@contextlib.contextmanager
def embedded() -> Iterator[tuple[gpulayer.Client, dict[str, str], list[int]]]:
    with (
        tempfile.TemporaryDirectory(prefix="gpulayer-bench-") as home,
        gpulayer.Client(home=home) as client,
    ):
        client.ensure_local_workers(NODES)
        yield client, {}, [os.getpid()]


@contextlib.contextmanager
def loopback_server() -> Iterator[tuple[gpulayer.Client, dict[str, str], list[int]]]:
    sys.path.insert(0, str(HERE))
    from dispatch import LoopbackServer  # the server and worker processes dispatch.py uses

    with LoopbackServer() as srv, srv.client() as client:
        srv.start_workers(NODES)
        yield client, {}, [w.pid for w in srv.workers]


@contextlib.contextmanager
def netns() -> Iterator[tuple[gpulayer.Client, dict[str, str], list[int]]]:
    sys.path.insert(0, str(TESTS))
    from netns_cluster import NetnsCluster, netns_unavailable

    why = netns_unavailable()
    if why is not None:
        raise SystemExit(
            f"--netns needs network namespaces, and {why}.\n"
            "Run it as root (sudo .venv/bin/python benchmarks/distributed_startup.py --netns), "
            "or use --server for real processes on loopback."
        )
    with NetnsCluster(workers=NODES, slots=1) as cluster, cluster.client() as client:
        yield client, {}, [w.pid for w in cluster.workers]


def choose_backend(requested: str, mode: str) -> tuple[str, int]:
    """The process-group backend and the GPUs each node asks for."""
    if requested == "gloo":
        return "gloo", 0
    import torch

    enough = torch.cuda.is_available() and torch.cuda.device_count() >= NODES * PER_NODE
    if requested == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--backend nccl: CUDA is not available")
        return "nccl", PER_NODE
    # auto: NCCL only where the local workers split the GPUs between them (in
    # server modes every worker process on this machine would offer all of them).
    if enough and mode == "embedded":
        return "nccl", PER_NODE
    return "gloo", 0


def torch_version() -> str:
    """Without importing torch here (seconds): from its installed metadata."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3, help="measured jobs per launcher")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured jobs per launcher first")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--server", action="store_true", help="a server process and 2 worker processes on 127.0.0.1"
    )
    where.add_argument(
        "--netns",
        action="store_true",
        help="the server and each worker in its own network namespace (needs root)",
    )
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument(
        "--json",
        type=Path,
        help="where to write the figures (default results/distributed_startup[-MODE].json)",
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    mode = "server" if args.server else "netns" if args.netns else "embedded"
    name = "distributed_startup.json" if mode == "embedded" else f"distributed_startup-{mode}.json"
    args.json = args.json or HERE / "results" / name
    exit_on_sigterm()
    # Read by every worker this process starts (embedded, or its processes,
    # which get this environment): make the ready interpreters now, for the
    # worker's settings and its direct-launcher ranks', and wait for them.
    os.environ["GPULAYER_WARM"] = "ready"
    preload = os.environ.get("GPULAYER_PRELOAD", "torch,numpy")

    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    machine += f", torch {torch_version()}"
    print(f"machine: {machine}", file=sys.stderr)
    backend, gpus = choose_backend(args.backend, mode)
    cluster = {"embedded": embedded, "server": loopback_server, "netns": netns}[mode]
    print(
        f"mode: {mode}; {NODES} x {PER_NODE} ranks, {backend}; "
        f"{args.warmup} warm-up + {args.repeat} measured runs each of {', '.join(KINDS)}; "
        f"ready interpreters preload {preload or 'nothing'!r}",
        file=sys.stderr,
    )
    with cluster() as (client, env, roots):
        runs = measure(
            client,
            repeat=args.repeat,
            warmup=args.warmup,
            env={**env, "BENCH_BACKEND": backend},
            backend=backend,
            gpus=gpus,
        )
        zygotes = zygote_memory(roots)
    summary = {launcher: summarize(r) for launcher, r in runs.items()}
    print(f"{mode} mode, {NODES} x {PER_NODE} {backend} job, median of {args.repeat}:")
    checks = print_table(summary, backend, zygotes)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "machine": machine,
                "mode": mode,
                "backend": backend,
                "preload": preload,
                "args": vars(args) | {"json": str(args.json)},
                "median": summary,
                "checks": checks,
                "zygotes": zygotes,
                "runs": runs,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
