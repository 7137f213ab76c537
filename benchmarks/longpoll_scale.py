"""How fast a placement reaches one of N idle workers held in long poll.

One `gpulayer server` process on 127.0.0.1; this process plays N workers of
one slot each, over N keep-alive connections (asyncio streams, hand-written
HTTP/1.1, stdlib only). For each step of ``--workers``:

1. raise this process's open-files limit to its hard limit (the server, our
   child, inherits it); cap N where files or local ports would run out;
2. start the server in a temporary home and read its memory (RSS) idle;
3. register the N workers and hold each in ``acquire?timeout=55``, asked
   again whenever one returns empty; read the server's memory again;
4. ``--samples`` times: submit one job (``command: ["true"]``) on a separate
   connection and time it until the chosen worker's long poll returns it;
   that worker reports it finished, so its slot frees, and polls again;
5. close the connections, stop the server, remove its home.

A step holds when every worker registered, was waiting in long poll, stayed
connected throughout, and every placement reached its worker in time.

    python benchmarks/longpoll_scale.py --workers 1000,10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from harness import Announced, exit_on_sigterm, free_port, stop, tail

POLL_S = 55  # each simulated worker's long poll (the server allows up to 60)
REGISTER_CONCURRENCY = 256  # connections opened at once (the server's backlog is 4096)
FILES_RESERVED = 200  # descriptors kept for everything else in either process
SAMPLE_TIMEOUT_S = 10.0  # a placement not delivered within this counts as lost
TARGET_P99_MS = 100.0


# ---- a minimal HTTP/1.1 client: one keep-alive connection, one request at a time ----


class HttpError(Exception):
    pass


class Connection:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes
    ) -> None:
        self.reader, self.writer, self._head = reader, writer, head

    @classmethod
    async def open(cls, port: int, token: str | None) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        head = f"Host: 127.0.0.1:{port}\r\n{auth}Content-Type: application/json\r\n"
        return cls(reader, writer, head.encode())

    async def request(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        payload = b"" if body is None else json.dumps(body).encode()
        self.writer.write(
            f"{method} {path} HTTP/1.1\r\n".encode()
            + self._head
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await self.writer.drain()
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        headers = {}
        for line in lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip().lower()
        if "content-length" in headers:
            data = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while size := int((await self.reader.readuntil(b"\r\n")).strip(), 16):
                parts.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            await self.reader.readuntil(b"\r\n")
            data = b"".join(parts)
        else:
            data = b""
        if headers.get("connection") == "close":
            self.close()
        return status, data

    async def call(self, method: str, path: str, body: object = None, expect: int = 200) -> object:
        status, data = await self.request(method, path, body)
        if status != expect:
            raise HttpError(f"{method} {path}: {status} {data[:300]!r}")
        return json.loads(data) if data else None

    def close(self) -> None:
        self.writer.close()


# ---- the server under test ----


class ServerProcess:
    """`gpulayer server start` on 127.0.0.1 in a temporary home; ``close`` always cleans up."""

    def __init__(self, heartbeat_timeout: float, auth: bool) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="gpulayer-longpoll-")
        self.root = Path(self._tmp.name)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token: str | None = None
        self.log = self.root / "server.log"
        argv = [sys.executable, "-m", "gpulayer.cli", "--home", str(self.root / "home")]
        argv += ["server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--heartbeat-timeout", str(heartbeat_timeout)]
        if not auth:
            argv.append("--no-auth")
        # Own session: Ctrl-C reaches only us; we stop the server after the workers.
        # Its stdout carries only the admin token, read from the home instead.
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stderr is not None
        try:
            Announced(self.proc.stderr, self.log).wait("the server did not start")
        except BaseException:
            self.close()
            raise
        if auth:
            self.token = (self.root / "home" / "admin-token").read_text().strip()

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def cpu_s(self) -> float:
        times = psutil.Process(self.proc.pid).cpu_times()
        return float(times.user + times.system)

    def close(self) -> None:
        try:
            stop(self.proc, grace=30)
        finally:
            self._tmp.cleanup()


# ---- the simulated workers ----


@dataclass
class Sample:
    submit_ms: float  # the submit request's round trip
    wake_ms: float  # submit sent -> the worker's long poll returned the task
    # The task's ``placed`` stamp -> returned (one machine, one clock). The
    # server stamps it as submit begins, so this includes placement and commit.
    placed_ms: float
    worker: str


@dataclass
class Fleet:
    port: int
    token: str | None
    size: int
    registered: int = 0
    polling: int = 0  # acquire requests sent and not yet answered
    dropped: int = 0
    beats_sent: int = 0  # heartbeats sent and answered
    errors: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    # job id -> (perf_counter, wall clock, placed, worker id) when its worker got it
    woken: dict[str, asyncio.Future[tuple[float, float, float, str]]] = field(default_factory=dict)

    def _future(self, job_id: str) -> asyncio.Future[tuple[float, float, float, str]]:
        return self.woken.setdefault(job_id, asyncio.get_running_loop().create_future())

    async def worker(self, index: int, gate: asyncio.Semaphore) -> None:
        conn = None
        try:
            async with gate:
                conn = await Connection.open(self.port, self.token)
                info = await conn.call(
                    "POST",
                    "/api/v1/workers",
                    {
                        "worker": {
                            "id": "",
                            "name": f"sim-{index}",
                            "host": "127.0.0.1",
                            "slot_gpus": [None],
                        },
                        "running": [],
                    },
                    expect=201,
                )
            worker_id = info["id"]  # type: ignore[index]
            self.ids.append(worker_id)
            self.registered += 1
            acquire = f"/api/v1/workers/{worker_id}/acquire?timeout={POLL_S}"
            while True:
                self.polling += 1
                try:
                    items = await conn.call("POST", acquire)
                finally:
                    self.polling -= 1
                woke, woke_wall = time.perf_counter(), time.time()
                for item in items or []:  # type: ignore[union-attr]
                    if item.get("type") != "run":
                        continue
                    self._future(item["job_id"]).set_result(
                        (woke, woke_wall, item.get("placed", 0.0), worker_id)
                    )
                    result = {
                        "job_id": item["job_id"],
                        "attempt": item["attempt"],
                        "worker_id": worker_id,
                        "outcome": "exited",
                        "exit_code": 0,
                    }
                    await conn.call(
                        "POST", "/api/v1/tasks/finished", result, expect=200
                    )  # plain: []
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.dropped += 1
            if len(self.errors) < 10:
                self.errors.append(f"worker {index}: {type(exc).__name__}: {exc}")
        finally:
            if conn is not None:
                conn.close()

    async def heartbeats(self, interval: float, connections: int) -> None:
        """Every registered worker heartbeats every ``interval`` s, over a few shared connections."""

        async def lane(lane_index: int) -> None:
            conn = await Connection.open(self.port, self.token)
            try:
                while True:
                    mine = self.ids[lane_index::connections]
                    start = time.monotonic()
                    for n, worker_id in enumerate(mine):
                        path = f"/api/v1/workers/{worker_id}/heartbeat"
                        await conn.call("POST", path, {"running": []}, expect=204)
                        self.beats_sent += 1
                        due = start + interval * (n + 1) / len(mine)
                        await asyncio.sleep(max(0.0, due - time.monotonic()))
                    if not mine:
                        await asyncio.sleep(interval)
            finally:
                conn.close()

        await asyncio.gather(*(lane(i) for i in range(connections)))

    async def all_polling(self, deadline: float) -> bool:
        alive = self.size - self.dropped
        while self.polling < alive:
            if time.monotonic() > deadline or self.dropped:
                return False
            await asyncio.sleep(0.005)  # counting our own tasks: nothing to block on
            alive = self.size - self.dropped
        return True

    async def place_one(self, conn: Connection) -> Sample:
        start, start_wall = time.perf_counter(), time.time()
        job = await conn.call("POST", "/api/v1/jobs", {"spec": {"command": ["true"]}}, expect=201)
        submitted = time.perf_counter()
        job_id = job["id"]  # type: ignore[index]
        woke, woke_wall, placed, worker_id = await self._future(job_id)
        del self.woken[job_id]
        return Sample(
            submit_ms=(submitted - start) * 1e3,
            wake_ms=(woke - start) * 1e3,
            placed_ms=(woke_wall - (placed or start_wall)) * 1e3,
            worker=worker_id,
        )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50": round(_pct(values, 50), 3),
        "p90": round(_pct(values, 90), 3),
        "p99": round(_pct(values, 99), 3),
        "max": round(max(values), 3),
        "mean": round(statistics.fmean(values), 3),
    }


async def measure(srv: ServerProcess, n: int, args: argparse.Namespace) -> dict[str, object]:
    fleet = Fleet(srv.port, srv.token, n)
    warm = await Connection.open(srv.port, srv.token)
    try:  # warm the route and the token check
        await asyncio.wait_for(warm.call("GET", "/api/v1/workers"), SAMPLE_TIMEOUT_S)
    finally:
        warm.close()
    rss_idle = srv.rss()
    submitter: Connection | None = None
    step: dict[str, object] = {"workers": n, "server_rss_idle_mb": round(rss_idle / 2**20, 1)}
    gate = asyncio.Semaphore(REGISTER_CONCURRENCY)
    started = time.monotonic()
    tasks = [asyncio.create_task(fleet.worker(i, gate)) for i in range(n)]
    beats: asyncio.Task[None] | None = None
    try:
        held = await fleet.all_polling(started + args.connect_timeout)
        step["connect_s"] = round(time.monotonic() - started, 2)
        step["registered"], step["polling"] = fleet.registered, fleet.polling
        await asyncio.sleep(1.0)  # let the server settle before reading its memory
        rss_full = srv.rss()
        step["server_rss_mb"] = round(rss_full / 2**20, 1)
        step["server_kb_per_worker"] = round((rss_full - rss_idle) / 1024 / max(1, n), 2)
        print(
            f"  {fleet.polling}/{n} workers in long poll after {step['connect_s']} s; "
            f"server RSS {step['server_rss_idle_mb']} -> {step['server_rss_mb']} MB",
            file=sys.stderr,
        )
        sampling_started, cpu_started = time.monotonic(), srv.cpu_s()
        if args.heartbeat_interval > 0:
            beats = asyncio.create_task(
                fleet.heartbeats(args.heartbeat_interval, min(args.heartbeat_connections, n))
            )
        # Opened now: the server closes a connection idle for 5 s (uvicorn's keep-alive).
        submitter = await Connection.open(srv.port, srv.token)
        samples: list[Sample] = []
        lost = 0
        sample_deadline = time.monotonic() + args.sample_budget
        while held and len(samples) + lost < args.samples and time.monotonic() < sample_deadline:
            if submitter.reader.at_eof():  # the server closed it while idle
                submitter.close()
                submitter = await Connection.open(srv.port, srv.token)
            try:
                samples.append(await asyncio.wait_for(fleet.place_one(submitter), SAMPLE_TIMEOUT_S))
            except TimeoutError:
                lost += 1
                submitter.close()  # a reply may still be on its way: start afresh
                submitter = await Connection.open(srv.port, srv.token)
            # The chosen worker reports the task finished and polls again; wait
            # for every live worker to be back in its poll, then a short gap.
            back = await fleet.all_polling(time.monotonic() + SAMPLE_TIMEOUT_S)
            if not back:
                break
            await asyncio.sleep(args.gap)
        if beats is not None:
            # Asked for: one per worker per interval; a shortfall means the server fell behind.
            took = time.monotonic() - sampling_started
            step["heartbeats_per_s"] = round(fleet.beats_sent / took, 1)
            step["heartbeats_per_s_asked"] = round(n / args.heartbeat_interval, 1)
            if beats.done() and beats.exception():
                fleet.errors.append(f"heartbeats: {beats.exception()!r}")
        # The server's CPU while it held the workers and served the samples (one core = 100).
        took = time.monotonic() - sampling_started
        step["server_cpu_pct"] = round((srv.cpu_s() - cpu_started) / took * 100, 1)
        step["samples"], step["lost_placements"] = len(samples), lost
        step["wake_ms"] = _summary([s.wake_ms for s in samples])
        step["placed_to_wake_ms"] = _summary([s.placed_ms for s in samples])
        step["submit_ms"] = _summary([s.submit_ms for s in samples])
        step["distinct_workers_woken"] = len({s.worker for s in samples})
        step["server_rss_end_mb"] = round(srv.rss() / 2**20, 1)
        step["dropped"] = fleet.dropped
        step["held"] = bool(
            held
            and fleet.dropped == 0
            and lost == 0
            and len(samples) == args.samples
            and fleet.polling == n
            and srv.proc.poll() is None
        )
        wake = step["wake_ms"]
        step["target_met"] = bool(step["held"] and wake and wake["p99"] < TARGET_P99_MS)  # type: ignore[index]
        step["errors"] = fleet.errors
        return step
    finally:
        if beats is not None:
            beats.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *([beats] if beats else []), return_exceptions=True)
        if submitter is not None:
            submitter.close()


def raise_file_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def local_ports() -> int:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 1 << 20
    return high - low + 1


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workers",
        default="10000",
        help="simulated workers; a list (1000,10000) runs steps, each on a fresh server",
    )
    parser.add_argument("--samples", type=int, default=200, help="placements timed per step")
    parser.add_argument(
        "--gap",
        type=float,
        default=0.3,
        help="seconds between placements; the default spreads 200 samples over more than "
        "one poll period, so the re-issue of expired polls is part of what is measured",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=0.0,
        help="also heartbeat every worker this often, as real workers do every 5 s "
        "(default 0: long polls only)",
    )
    parser.add_argument(
        "--heartbeat-connections", type=int, default=32, help="connections heartbeats share"
    )
    parser.add_argument("--no-auth", action="store_true", help="run the server with --no-auth")
    parser.add_argument(
        "--connect-timeout", type=float, default=300, help="seconds allowed to connect N workers"
    )
    parser.add_argument(
        "--sample-budget", type=float, default=300, help="seconds allowed for the samples"
    )
    parser.add_argument(
        "--json", type=Path, default=Path(__file__).parent / "results" / "longpoll_scale.json"
    )
    args = parser.parse_args()
    steps = [int(w) for w in args.workers.replace(",", " ").split()]
    exit_on_sigterm()

    files = raise_file_limit()
    ports = local_ports()
    most = min(files, ports) - FILES_RESERVED
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    print(f"machine: {machine}", file=sys.stderr)
    print(
        f"limits: {files} open files per process, {ports} local ports: at most {most} workers",
        file=sys.stderr,
    )
    results = []
    for n in steps:
        if n > most:
            print(f"{n} workers is beyond what the limits allow: capped at {most}", file=sys.stderr)
            n = most
        print(f"step: {n} workers ...", file=sys.stderr)
        # A worker's long poll refreshes its liveness only when it starts, so
        # without heartbeats the server must not reap a worker held 55 s.
        timeout = 30.0 if args.heartbeat_interval > 0 else 10 * POLL_S
        srv = ServerProcess(heartbeat_timeout=timeout, auth=not args.no_auth)
        try:
            step = asyncio.run(measure(srv, n, args))
        except Exception as exc:  # this step failed; a smaller one may still have held
            step = {"workers": n, "held": False, "target_met": False, "errors": [repr(exc)]}
            print(f"  step failed: {exc!r}\n{tail(srv.log)}", file=sys.stderr)
        finally:
            srv.close()
        if srv.proc.returncode not in (0, -signal.SIGTERM):
            step["server_exit"] = srv.proc.returncode
        results.append(step)
        print(f"  {json.dumps(step)}", file=sys.stderr)

    rows = []
    for s in results:
        if "wake_ms" not in s:
            rows.append((f"{s['workers']} workers", "did not hold", f"failed: {s['errors']}"))
            continue
        wake, placed, submit = s["wake_ms"], s["placed_to_wake_ms"], s["submit_ms"]
        note = (
            f"wake p50/p90/p99 {wake.get('p50', 0):.2f}/{wake.get('p90', 0):.2f}/"  # type: ignore[union-attr]
            f"{wake.get('p99', 0):.2f} ms (target p99 < {TARGET_P99_MS:.0f}); "  # type: ignore[union-attr]
            f"submit p99 {submit.get('p99', 0):.2f} ms; "  # type: ignore[union-attr]
            f"placed->wake p99 {placed.get('p99', 0):.2f} ms; "  # type: ignore[union-attr]
            f"server RSS {s['server_rss_idle_mb']} -> {s['server_rss_mb']} MB "
            f"({s['server_kb_per_worker']} KiB/worker); server CPU {s['server_cpu_pct']}%"
        )
        if "heartbeats_per_s" in s:
            note += f"; heartbeats {s['heartbeats_per_s']}/s of {s['heartbeats_per_s_asked']}/s"
        rows.append((f"{s['workers']} workers", "held" if s["held"] else "did not hold", note))
    width = max(len(r[0]) for r in rows)
    for name, state, note in rows:
        print(f"{name:<{width}}  {state:>12}  {note}")
    held = [s["workers"] for s in results if s["held"]]
    print(f"largest that held: {max(held) if held else 'none'}")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "machine": machine,
                "args": vars(args) | {"json": str(args.json)},
                "limits": {"open_files": files, "local_ports": ports, "max_workers": most},
                "steps": results,
                "largest_held": max(held) if held else None,
                "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            indent=2,
        )
    )
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
