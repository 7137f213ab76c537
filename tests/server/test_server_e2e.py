"""Server mode end to end: a real server, real worker processes, loopback HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

import gpulayer
from gpulayer.jobs import WORKER_DIED
from gpulayer.worker.gpus import GPUS_HELP
from server.conftest import ServerProc, free_port, said, worker_start_refused

from helpers import PY, pids_alive, run_2x2_allreduce


def follow_until(job: gpulayer.Job, prefix: str) -> str:
    for line in job.stream_logs():
        if line.text.startswith(prefix):
            return line.text
    raise AssertionError(f"no line starting {prefix!r}: {job.logs()}")


def request(
    url: str, *, token: str | None = None, method: str = "GET", body: bytes | None = None
) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, data=body, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as e:
        raw = e.read()
        e.close()
        return e.code, json.loads(raw) if raw else {}


def test_script_job_with_inputs_outputs_and_logs(
    server: ServerProc, tmp_path: Path, project: Path
) -> None:
    server.start_worker(tmp_path / "w1")
    data = tmp_path / "data.txt"
    data.write_text("over http")
    with server.client() as client:
        job = client.submit(
            project / "train.py", args=["net"], inputs={"data": data}, outputs=["out/result.json"]
        )
        assert job.wait(timeout=60) == "succeeded", job.info.reason
        assert "hello net" in job.logs()
        out = job.download_outputs(tmp_path / "dl")
        assert json.loads((out / "out/result.json").read_text()) == {
            "args": ["net"],
            "data": "over http",
        }
        assert set(job.timings) >= {"dispatch", "prepare", "run", "finish"}


def test_cancel_and_timeout_over_http(server: ServerProc, tmp_path: Path) -> None:
    server.start_worker(tmp_path / "w1", slots=2)
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('child', c.pid, flush=True); time.sleep(60)\n"
    )
    with server.client() as client:
        slow = client.submit(command=[PY, "-c", code])
        timed = client.submit(command=[PY, "-c", "import time; time.sleep(60)"], timeout=0.5)
        grandchild = int(follow_until(slow, "child").split()[1])
        slow.cancel()
        assert slow.wait(timeout=30) == "cancelled"
        assert pids_alive(grandchild) == []
        assert timed.wait(timeout=30) == "timed_out"


def test_auth_rules(server: ServerProc) -> None:
    jobs = f"{server.url}/api/v1/jobs"
    assert request(jobs)[0] == 401
    assert request(jobs, token="glt_u_not-a-real-token")[0] == 401
    worker = server.token("worker")
    user = server.token("user")
    status, body = request(
        jobs, token=worker, method="POST", body=b'{"spec": {"command": ["true"]}}'
    )
    assert status == 403 and "worker token cannot" in str(body["error"])
    assert worker not in str(body)
    assert request(jobs, token=user)[0] == 200
    assert (
        request(
            f"{server.url}/api/v1/tokens", token=user, method="POST", body=b'{"role": "admin"}'
        )[0]
        == 403
    )
    assert request(f"{server.url}/healthz")[0] == 200


def test_a_worker_token_acts_only_for_the_workers_it_registered(server: ServerProc) -> None:
    mine, other = server.token("worker"), server.token("worker")
    workers = f"{server.url}/api/v1/workers"
    info = b'{"worker": {"id": "", "name": "w", "host": "h", "slot_gpus": [null]}}'
    status, registered = request(workers, token=mine, method="POST", body=info)
    assert status == 201, registered
    wid = registered["id"]
    beat = f"{workers}/{wid}/heartbeat"
    assert request(beat, token=mine, method="POST", body=b'{"running": []}')[0] == 204
    status, body = request(beat, token=other, method="POST", body=b'{"running": []}')
    assert status == 403 and "registered with another token" in str(body["error"])
    assert other not in str(body) and mine not in str(body)
    status, _ = request(f"{workers}/{wid}/acquire?timeout=0", token=other, method="POST", body=b"")
    assert status == 403
    # Coming back under that id needs the token it registered with...
    again = info.replace(b'"id": ""', f'"id": "{wid}"'.encode())
    assert request(workers, token=other, method="POST", body=again)[0] == 403
    assert request(workers, token=mine, method="POST", body=again)[0] == 201
    # ...and an admin acts for any worker.
    assert request(beat, token=server.admin, method="POST", body=b'{"running": []}')[0] == 204


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/api/v1/jobs", b"{not json", 400, "not valid JSON"),
        ("POST", "/api/v1/jobs", b'{"spec": {"command": ["x"], "gpus": -1}}', 422, "gpus"),
        ("POST", "/api/v1/jobs", b'{"spec": {"command": ["x"]}, "id": "short"}', 422, "id"),
        ("GET", "/api/v1/jobs?limit=zero", None, 422, "limit"),
        ("GET", "/api/v1/jobs?state=done", None, 422, "unknown state"),
        ("GET", "/api/v1/jobs/nosuchjob", None, 404, "no job"),
        ("POST", "/api/v1/jobs/nosuchjob/wait?timeout=-1", None, 404, "no job"),
        ("GET", "/api/v1/blobs/xyz", None, 400, "digest"),
        ("POST", "/api/v1/workers/nope/acquire", None, 409, "not registered"),
        ("POST", "/api/v1/workers", b'{"worker": {"id": 3}}', 422, "worker"),
    ],
)
def test_malformed_requests_get_4xx_naming_the_problem(
    server: ServerProc, method: str, path: str, body: bytes | None, status: int, words: str
) -> None:
    got, data = request(f"{server.url}{path}", token=server.admin, method=method, body=body)
    assert got == status, data
    assert words in json.dumps(data)


def test_metrics_and_openapi(server: ServerProc, tmp_path: Path) -> None:
    server.start_worker(tmp_path / "w1")
    with server.client() as client:
        assert client.submit(command=[PY, "-c", "pass"]).wait(timeout=60) == "succeeded"
    req = urllib.request.Request(
        f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.admin}"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    assert 'gpulayer_jobs{state="succeeded"} 1.0' in text
    assert "gpulayer_workers" in text and "gpulayer_dispatch_seconds_count 1.0" in text
    status, doc = request(f"{server.url}/openapi.json")
    assert status == 200 and "/api/v1/jobs" in doc["paths"]  # type: ignore[operator]


def test_server_killed_mid_burst_loses_nothing_and_runs_nothing_twice(
    server: ServerProc, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    server.start_worker(tmp_path / "w1", slots=2)
    code = f"import os, sys, time; open(os.path.join({str(marks)!r}, os.environ['GPULAYER_JOB_ID'] + '.' + os.environ['GPULAYER_ATTEMPT']), 'w').close(); time.sleep(0.3)"
    with server.client() as client:
        jobs = [client.submit(command=[PY, "-c", code]) for _ in range(12)]
        server.kill(signal.SIGKILL)
        server.proc = None
        server.start()  # same home, same port
        for job in jobs:
            assert job.wait(timeout=120) == "succeeded", job.refresh()
    ran = sorted(p.name for p in marks.iterdir())
    assert sorted(f"{j.id}.1" for j in jobs) == ran, "every job ran exactly once"


def test_worker_killed_mid_task_is_retried_elsewhere(tmp_path: Path) -> None:
    srv = ServerProc(tmp_path / "home", free_port(), heartbeat_timeout=1.0)
    srv.start()
    try:
        doomed = srv.start_worker(tmp_path / "w1", name="doomed")
        with srv.client() as client:
            job = client.submit(
                command=[
                    PY,
                    "-c",
                    "import os, time; print('on', os.getpid(), flush=True); time.sleep(60)",
                ],
                max_retries=1,
                # At once: a busy worker heartbeats every 5 s, past this server's 1 s.
                retry_delay=0,
            )
            follow_until(job, "on")
            lost = client.submit(command=[PY, "-c", "import time; time.sleep(60)"])
            # Its warden too (as a SIGKILL to the process group would): no
            # one says it is gone, the heartbeat timeout finds out.
            _warden_of(doomed).kill()
            doomed.send_signal(signal.SIGKILL)
            doomed.wait()
            srv.start_worker(tmp_path / "w2", name="spare", slots=2)
            # The retried job starts again on the spare worker.
            for line in job.stream_logs():
                if line.text.startswith("on") and job.refresh().attempt == 2:
                    break
            info = job.refresh()
            assert (
                info.attempt == 2
                and info.state == "running"
                and "stopped heartbeating" in (info.reason or "")
            )
            job.cancel()
            assert job.wait(timeout=30) == "cancelled"
            lost.cancel()
    finally:
        srv.stop()


def _warden_of(worker: subprocess.Popen[str]) -> psutil.Process:
    """A worker process's warden: the child forked from it (its tasks are
    children too, but run other programs)."""
    parent = psutil.Process(worker.pid)
    (warden,) = [c for c in parent.children() if c.cmdline() == parent.cmdline()]
    return warden


_STUBBORN = (  # ignores SIGTERM: ends at SIGKILL, the kill grace after
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('pid', os.getpid(), flush=True)\n"
    "time.sleep(600)\n"
)


def _killed_mid_task(
    client: gpulayer.Client, worker: subprocess.Popen[str], code: str = _STUBBORN, gpus: int = 0
) -> tuple[gpulayer.Job, str]:
    """Run ``code`` (it prints "pid ..."), then SIGKILL its worker: the job,
    and the line it printed."""
    job = client.submit(command=[PY, "-c", code], gpus=gpus)
    line = follow_until(job, "pid")
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    return job, line


def test_a_killed_workers_warden_ends_the_task_trees_it_left(
    server: ServerProc, tmp_path: Path
) -> None:
    """SIGKILL gives a worker no chance to end its tasks, which run in
    sessions of their own: its warden ends them (a grandchild too) at once,
    rather than the next worker on the home, which may never come. Then it
    tells the server, so the job does not wait out the heartbeat timeout."""
    doomed = server.start_worker(tmp_path / "w", name="doomed")
    warden = _warden_of(doomed)
    code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('pids', os.getpid(), child.pid, flush=True)\n"
        "time.sleep(600)"
    )
    with server.client() as client:
        job, line = _killed_mid_task(client, doomed, code)
        pids = [int(p) for p in line.split()[1:]]
        # (The count may include a ready interpreter's spare child caught as
        # it was being forked, still in the worker's session: it goes too.)
        said(doomed, "task process tree(s) it left running")
        warden.wait(timeout=30)  # not our child: no exit code to see
        assert pids_alive(*pids) == [], "the task and its child outlived their worker"
        info = job.refresh()
        assert info.state == "lost", info  # no retries left; and no heartbeat timeout (30 s) yet
        assert info.reason == WORKER_DIED, info.reason
        assert [w.name for w in client.workers()] == []


def test_a_worker_that_stops_takes_its_warden_along(server: ServerProc, tmp_path: Path) -> None:
    worker = server.start_worker(tmp_path / "w")
    warden = _warden_of(worker)
    # It holds stdin and stdout (/dev/null), stderr, its pipe and the
    # ledger's lock: no socket to the server, nor a pipe another process
    # waits to see closed.
    assert warden.num_fds() == 5, warden.open_files()
    assert warden.net_connections() == []
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    warden.wait(timeout=30)  # raises if it is still there then
    assert worker.stderr is not None
    assert "warden" not in worker.stderr.read()  # it had nothing to end
    assert not list((tmp_path / "w" / "workers" / "live").iterdir())


def test_refuses_non_loopback_without_auth(tmp_path: Path) -> None:
    from gpulayer.errors import GPUlayerError
    from gpulayer.http.server import Server

    with pytest.raises(GPUlayerError, match="without auth"):
        Server(tmp_path / "h", host="0.0.0.0", auth_enabled=False)


def test_admin_token_file_is_private(server: ServerProc) -> None:
    assert (server.home / "admin-token").stat().st_mode & 0o777 == 0o600
    assert os.environ.get("GPULAYER_TOKEN") != server.admin


def test_a_worker_cut_off_delivers_its_results_afterwards(
    server: ServerProc, tmp_path: Path
) -> None:
    gate, done = tmp_path / "gate", tmp_path / "done"
    os.mkfifo(gate)
    os.mkfifo(done)
    worker = server.start_worker(tmp_path / "w1")
    code = (
        f"print('before', flush=True); open({str(gate)!r}).read()\n"
        f"print('during the outage', flush=True)\n"
        f"open('result.txt', 'w').write('kept')\n"
        f"open({str(done)!r}, 'w').write('x')\n"
    )
    with server.client() as client:
        job = client.submit(command=[PY, "-c", code], outputs=["result.txt"])
        follow_until(job, "before")
        server.kill(signal.SIGKILL)  # the worker is cut off
        with open(gate, "w") as g:
            g.write("go")
        with open(done) as d:  # the job has finished while nobody listened
            assert d.read() == "x"
        said(worker, "keeping them to send later")  # it could not deliver, and kept them
        server.proc = None
        server.start()
        assert job.wait(timeout=60) == "succeeded", job.info.reason
        assert job.logs() == "before\nduring the outage\n"
        out = job.download_outputs(tmp_path / "dl")
        assert (out / "result.txt").read_text() == "kept"


def test_a_result_kept_through_a_killed_worker_is_delivered_by_the_next(
    server: ServerProc, tmp_path: Path
) -> None:
    """A task ends while the server is down, and its worker is killed before
    the server is back: the next worker on the same home delivers the
    result it kept on disk, so the job ends as it ran, not lost. One started
    with a token the server does not take (a typo in its unit file) cannot
    register, and keeps the result for the next try. With a worker token: its
    kept log lines name the worker that ran them, since the next one delivers
    them before it registers."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    token = server.token("worker")
    doomed = server.start_worker(tmp_path / "w", name="doomed", token=token)
    code = (
        f"print('before', flush=True); open({str(gate)!r}).read()\n"
        "print('during the outage', flush=True); raise SystemExit(3)"
    )
    with server.client() as client:
        job = client.submit(command=[PY, "-c", code])
        follow_until(job, "before")
        server.kill(signal.SIGKILL)
        with open(gate, "w") as g:
            g.write("go")
        said(doomed, f"kept the result of job {job.id}")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        server.proc = None
        server.start()
        typo = {**os.environ, "GPULAYER_TOKEN": "not-a-token"}
        refused = worker_start_refused(tmp_path / "w", server.url, typo)
        assert list((tmp_path / "w" / "workers" / "live").glob("*/results/*")), refused.stderr
        server.start_worker(tmp_path / "w", name="heir", token=token)
        assert job.wait(timeout=60) == "failed"
        info = job.refresh()
        assert (info.exit_code, info.attempt) == (3, 1), info.reason
        assert job.logs() == "before\nduring the outage\n"  # kept with the result


def test_workers_advertise_the_address_they_reach_the_server_from(
    server: ServerProc, tmp_path: Path
) -> None:
    server.start_worker(tmp_path / "w1", name="adv")
    with server.client() as client:
        (info,) = [w for w in client.workers() if w.name == "adv"]
    assert info.address == "127.0.0.1"


def _server_start(home: Path) -> subprocess.CompletedProcess[str]:
    """`gpulayer server start` on ``home``, expected to refuse (it would serve for ever)."""
    port = str(free_port())
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulayer.cli",
            "--home",
            str(home),
            "server",
            "start",
            "--port",
            port,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_server_home_is_its_own(server: ServerProc, tmp_path: Path) -> None:
    from gpulayer.errors import GPUlayerError

    # Embedded use of a server's home would end the jobs its workers run.
    with pytest.raises(GPUlayerError, match="server's home"):
        gpulayer.Client(home=server.home)
    # A second server on the same home is refused.
    second = _server_start(server.home)
    assert second.returncode != 0 and "another GPUlayer server" in second.stderr
    # Stopped, it is a server's home still.
    server.stop()  # and waited for
    assert server.proc is not None and server.proc.poll() is not None
    with pytest.raises(GPUlayerError, match="server's home"):
        gpulayer.Client(home=server.home)


def test_a_server_will_not_share_its_home_with_an_embedded_client(tmp_path: Path) -> None:
    """The server holds its store alone: on a home an embedded client is
    using, it refuses to start, soon and saying why."""
    home = tmp_path / "home"
    with gpulayer.Client(home=home, auto_worker=False) as client:
        client.submit(command=[PY, "-c", "pass"])  # the store is open and in use
        refused = _server_start(home)
    assert refused.returncode != 0
    assert "another process is using the job store" in refused.stderr


def test_run_detach_returns_the_job_id(server: ServerProc, tmp_path: Path) -> None:
    server.start_worker(tmp_path / "w1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulayer.cli",
            "--server",
            server.url,
            "--token",
            server.admin,
            "run",
            "--detach",
            "--",
            PY,
            "-c",
            "print('detached')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    with server.client() as client:
        job = client.job(job_id)
        assert job.wait(timeout=60) == "succeeded"
        assert job.logs() == "detached\n"


def test_ensure_local_workers_starts_worker_processes(server: ServerProc) -> None:
    with server.client() as client:
        workers = client.ensure_local_workers(2, slots=1, kill_grace=0.5)
        assert len(workers) == 2 and len({w.id for w in workers}) == 2
        assert len(client.ensure_local_workers(2)) == 2  # already running: none added
        # Two threads asking for a third at once start one between them.
        threads = [threading.Thread(target=client.ensure_local_workers, args=(3,)) for _ in "ab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(client.workers()) == 3
        job = client.submit(command=[PY, "-c", "print('local')"])
        assert job.wait(timeout=60) == "succeeded"
        assert job.info.worker in {w.id for w in workers}
    with server.client() as other:
        assert other.workers() == [], "closing the client stopped its workers"


@pytest.fixture
def three_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine shows three NVIDIA GPUs to the test and the worker processes
    it starts: an nvidia-smi of the test's own first on PATH, and NVML hidden."""
    bin_dir, hide_nvml = tmp_path / "bin", tmp_path / "no-nvml"
    bin_dir.mkdir()
    hide_nvml.mkdir()
    rows = "".join(f"{i}, NVIDIA Test GPU, 1024, GPU-{i}\n" for i in range(3))
    (bin_dir / "nvidia-smi").write_text(f"#!{sys.executable}\nprint({rows!r}, end='')\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    (hide_nvml / "pynvml.py").write_text("raise ImportError('hidden by the test')\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", f"{hide_nvml}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setitem(sys.modules, "pynvml", None)


@pytest.mark.usefixtures("three_gpus")
def test_local_worker_processes_split_the_gpus_between_them(server: ServerProc) -> None:
    show = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    with server.client() as client:
        two = client.ensure_local_workers(2, slots=3)
        assert sorted(w.slot_gpus for w in two) == [[0, 2], [1]]  # none offered twice
        three = client.ensure_local_workers(3, slots=3)
        assert [w.slot_gpus for w in three if w.id not in {v.id for v in two}] == [[None] * 3]
        job = client.submit(command=[PY, "-c", show], gpus=2)
        assert job.wait(timeout=60) == "succeeded", job.logs()
        assert job.logs() == "0,2\n" and job.info.gpus == [0, 2]


@pytest.mark.usefixtures("three_gpus")
def test_workers_started_apart_never_offer_one_gpu_twice(
    server: ServerProc, tmp_path: Path
) -> None:
    first = server.start_worker(tmp_path / "w1", name="first", gpus="nvidia:1")
    env = {**os.environ, "GPULAYER_TOKEN": server.admin}
    refused = worker_start_refused(tmp_path / "w2", server.url, env, "--gpus", "0,1")
    assert (
        f"another GPUlayer worker on this machine offers nvidia GPU 1 (pid {first.pid})"
        in refused.stderr
    )
    server.start_worker(tmp_path / "w3", name="rest", gpus="all")  # those left: 0 and 2
    refused = worker_start_refused(tmp_path / "w4", server.url, env, "--gpus", "all")
    assert "another GPUlayer worker on this machine offers every GPU this one would" in (
        refused.stderr
    )
    with server.client() as client:
        (local,) = client.ensure_local_workers(1, slots=2)  # none left for it either
        assert local.slot_gpus == [None, None]
        assert {w.name: w.slot_gpus for w in client.workers() if w.id != local.id} == {
            "first": [1],
            "rest": [0, 2],
        }
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
        server.start_worker(tmp_path / "w2", name="again", gpus="1")
        assert {w.name: w.slot_gpus for w in client.workers()}["again"] == [1]


@pytest.mark.usefixtures("three_gpus")
def test_a_local_worker_that_fails_to_start_gives_its_gpus_back(server: ServerProc) -> None:
    with server.client() as client:
        with pytest.raises(gpulayer.WorkerError, match="before registering"):
            client.ensure_local_workers(1, worker_token="not-a-token")
        again = client.ensure_local_workers(1)
        assert [w.slot_gpus for w in again] == [[0, 1, 2]]


@pytest.mark.usefixtures("three_gpus")
def test_a_local_worker_that_ended_is_replaced_under_a_new_name(server: ServerProc) -> None:
    client = server.client()
    with client:
        first = {w.name: w for w in client.ensure_local_workers(2)}
        gone = next(n for n, w in first.items() if w.slot_gpus == [0, 2])
        (proc,) = [
            p
            for p in psutil.Process().children()
            if gone in p.cmdline() and "worker" in p.cmdline()
        ]
        proc.kill()
        proc.wait(timeout=30)
        again = client.ensure_local_workers(2)
        assert len({w.name for w in again}) == 2 and gone not in {w.name for w in again}
        assert sorted(w.slot_gpus for w in again) == [[0, 2], [1]]  # its GPUs, offered again
    with pytest.raises(gpulayer.GPUlayerError, match="this client is closed"):
        client.ensure_local_workers(1)


def _ensure_one_local_worker_meanwhile(
    client: gpulayer.Client,
) -> tuple[threading.Thread, list[BaseException]]:
    """``ensure_local_workers(1)`` on a thread of its own (started), and the
    GPUlayer errors it raises."""
    failed: list[BaseException] = []

    def start() -> None:
        try:
            client.ensure_local_workers(1)
        except gpulayer.GPUlayerError as exc:
            failed.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    return starting, failed


def test_close_ends_a_local_worker_start_that_an_unresponsive_server_holds() -> None:
    """The start waits for its worker to register, holding the client's lock;
    close() ends that worker first, rather than wait for it to give up."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # takes connections, never answers
        client = gpulayer.Client(f"http://127.0.0.1:{mute.getsockname()[1]}", token="t")
        starting, failed = _ensure_one_local_worker_meanwhile(client)
        mute.settimeout(60)
        registering, _ = mute.accept()  # the worker's registration, never answered
        closing = threading.Thread(target=client.close)
        closing.start()
        closing.join(20)  # the worker would give up after its 30 s timeout at the soonest
        starting.join(20)
        registering.close()
        assert not closing.is_alive() and not starting.is_alive()
        assert [str(exc) for exc in failed] == ["this client is closed"]
        assert [p for p in psutil.Process().children() if "worker" in p.cmdline()] == []


def test_close_stops_a_serving_local_worker_gently_while_its_start_still_reads(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start reads its workers' "serving" lines one after another, so a
    worker may serve (and run a job) before the client knows it registered:
    close() ends its job, not just the worker, whose job would run on."""
    import gpulayer.client as client_module

    reading = threading.Event()
    real = client_module._await_registration

    def held_up(proc: subprocess.Popen[str]) -> tuple[str, threading.Thread]:
        reading.wait(60)  # as if reading another worker's line first
        return real(proc)

    monkeypatch.setattr(client_module, "_await_registration", held_up)
    client = server.client()
    starting, failed = _ensure_one_local_worker_meanwhile(client)
    with server.client() as other:
        code = "import os, time; print('on', os.getpid(), flush=True); time.sleep(600)"
        job = other.submit(command=[PY, "-c", code])
        on, pid = next(line.text for line in job.stream_logs()).split()  # it runs there
        assert on == "on"
        closing = threading.Thread(target=client.close)
        closing.start()
        assert job.wait(timeout=60) == "lost", job.info.reason
        reading.set()
        closing.join(60)
        starting.join(60)
    assert not closing.is_alive() and not starting.is_alive()
    assert [str(exc) for exc in failed] == ["this client is closed"]
    assert pids_alive(int(pid)) == []


def test_local_workers_of_two_clients_and_a_failed_start(
    server: ServerProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    with server.client() as a, server.client() as b:
        (mine,) = a.ensure_local_workers(1)
        (theirs,) = b.ensure_local_workers(1)  # its own, not a's too
        assert mine.id != theirs.id and mine.name != theirs.name
        # A start that fails part-way leaves nothing running once the client closes.
        real, calls = subprocess.Popen, []

        def second_fails(*args: Any, **kwargs: Any) -> subprocess.Popen[str]:
            calls.append(args)
            if len(calls) == 2:
                raise OSError(24, "Too many open files")
            return real(*args, **kwargs)

        monkeypatch.setattr(subprocess, "Popen", second_fails)
        with pytest.raises(OSError, match="Too many open files"):
            a.ensure_local_workers(3)
        monkeypatch.setattr(subprocess, "Popen", real)
    with server.client() as other:
        assert other.workers() == [], "closing the clients stopped every worker they started"


def test_worker_start_names_gpus_it_cannot_offer(server: ServerProc, tmp_path: Path) -> None:
    # Were one started, it would serve (and the check below time out), not fail.
    env = {**os.environ, "GPULAYER_TOKEN": server.admin}
    for choice, message in [
        ("99", "--gpus 99: this machine has no GPU 99"),
        ("amd:99", "--gpus amd:99: this machine has no amd GPU 99"),
        ("0,x", f"--gpus takes {GPUS_HELP}; got '0,x'"),
        ("intel:0", "got 'intel:0'"),
        ("1,1", "--gpus lists a GPU twice: '1,1'"),
    ]:
        refused = worker_start_refused(tmp_path / "w", server.url, env, "--gpus", choice)
        assert message in refused.stderr
    with server.client() as client:
        assert client.workers() == []


def test_a_distributed_job_across_worker_processes(server: ServerProc, tmp_path: Path) -> None:
    """2x2 over HTTP: node 0's port reaches node 1 through the server, the
    ranks all-reduce across the two worker processes, logs come back tagged."""
    server.start_worker(tmp_path / "w1")
    server.start_worker(tmp_path / "w2")
    with server.client() as client:
        job = run_2x2_allreduce(client, tmp_path / "dl")
        assert len({t.worker for t in job.refresh().tasks}) == 2


def test_a_killed_workers_processes_are_ended_by_the_next_on_its_home(
    server: ServerProc, tmp_path: Path
) -> None:
    """SIGKILL to the worker and its warden (as to their process group)
    leaves a task's tree running; the next worker started on the same home
    ends it, and comes back under the dead worker's id so that the server
    ends the job at once instead of after the heartbeat timeout."""
    doomed = server.start_worker(tmp_path / "w", name="doomed")
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "print('pids', c.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    with server.client() as client:
        job = client.submit(command=[PY, "-c", code])
        grandchild = int(follow_until(job, "pids").split()[1])
        old_worker = job.refresh().worker
        _warden_of(doomed).kill()
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        assert pids_alive(grandchild), "a task's tree outlives its killed worker"
        server.start_worker(tmp_path / "w", name="reborn")
        assert pids_alive(grandchild) == []  # ended before the new worker served
        assert job.wait(timeout=30) == "lost"
        assert "came back without it" in (job.info.reason or "")
        assert {w.id for w in client.workers()} == {old_worker}


def test_missing_blobs_are_asked_about_in_parts(
    server: ServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    from gpulayer import defaults
    from gpulayer.transport.http import HttpTransport

    monkeypatch.setattr(defaults, "MISSING_BLOBS_PER_REQUEST", 2)
    stored = tmp_path / "stored.bin"
    stored.write_bytes(b"stored")
    here = hashlib.sha256(b"stored").hexdigest()
    absent = [f"{i:064x}" for i in range(4)]
    transport = HttpTransport(server.url, token=server.admin)
    asked: list[int] = []
    call = transport._call

    def counted(method: str, path: str, kind: Any, **kwargs: Any) -> Any:
        if path == "/api/v1/blobs/missing":
            asked.append(len(json.loads(kwargs["body"])["digests"]))
        return call(method, path, kind, **kwargs)

    transport._call = counted  # type: ignore[method-assign]
    try:
        transport.upload_blob(stored, here)
        assert transport.missing_blobs([*absent, here]) == set(absent)
    finally:
        transport.close()
    assert asked == [2, 2, 1]


@pytest.mark.parametrize(
    ("refused", "seen"),
    [
        # Before died= and gen=: every query refused, a plain goodbye then.
        ("?", ["?died=1&gen=17", "?died=1", ""]),
        # Before gen= only: died= still goes, for the jobs' reason.
        ("gen=", ["?died=1&gen=17", "?died=1"]),
    ],
)
def test_a_dead_workers_goodbye_to_an_older_server_says_what_it_takes(
    refused: str, seen: list[str]
) -> None:
    """An older server refuses (422) the query parameters it does not know:
    the goodbye is sent again without them, so the jobs still go elsewhere
    at once."""
    import http.server

    from gpulayer.transport.http import HttpTransport

    paths: list[str] = []

    class OldServer(http.server.BaseHTTPRequestHandler):
        def do_DELETE(self) -> None:
            paths.append(self.path)
            if refused in self.path:
                body = b'{"error": "unknown query parameter"}'
                self.send_response(422)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(204)
                self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OldServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        transport = HttpTransport(f"http://127.0.0.1:{httpd.server_address[1]}", retries=1)
        transport.unregister_worker("1m8worker00001", died=True, generation="17")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert paths == [f"/api/v1/workers/1m8worker00001{query}" for query in seen]


def test_a_worker_stopped_while_registering_is_unregistered_by_its_warden(
    tmp_path: Path,
) -> None:
    """A signal while the registration is on its way (the server may have
    stored it, the reply not read yet): the worker exits at once, and its
    warden unregisters the id it registered under, which the worker made
    before sending, so no ghost of it waits out the heartbeat timeout."""
    import http.server
    import queue

    registering: queue.Queue[str] = queue.Queue()
    goodbyes: queue.Queue[str] = queue.Queue()
    release = threading.Event()

    class Stuck(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the registration: read, never answered
            body = self.rfile.read(int(self.headers["Content-Length"]))
            registering.put(json.loads(body)["worker"]["id"])
            release.wait(60)

        def do_DELETE(self) -> None:
            goodbyes.put(self.path)
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stuck)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    argv = [sys.executable, "-m", "gpulayer.cli", "--home", str(tmp_path / "w"), "--server", url]
    worker = subprocess.Popen(
        [*argv, "worker", "start", "--gpus", "none"],
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        worker_id = registering.get(timeout=60)
        assert worker_id, "the worker names its id as it registers"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 128 + signal.SIGTERM
        assert goodbyes.get(timeout=30) == f"/api/v1/workers/{worker_id}?died=1"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        assert worker.stderr is not None
        worker.stderr.close()
        release.set()
        httpd.shutdown()
        httpd.server_close()


def test_a_worker_started_with_stdin_and_stdout_closed_still_has_a_warden(
    server: ServerProc, tmp_path: Path
) -> None:
    """With 0 and 1 closed, the ledger's lock or the warden's pipe would be
    made on them, and the warden's /dev/null put over them: a warden with
    no lock, or one that read end-of-file at once and left."""
    doomed = server.start_worker(tmp_path / "w", shell="<&- >&-")
    warden = _warden_of(doomed)
    assert [f.path for f in warden.open_files() if f.path.endswith("/lock")], "it holds the lock"
    with server.client() as client:
        _, line = _killed_mid_task(client, doomed)
        pid = int(line.split()[1])
        warden.wait(timeout=30)
        assert pids_alive(pid) == []


def test_the_next_worker_on_the_home_waits_for_a_dead_workers_warden(
    server: ServerProc, tmp_path: Path
) -> None:
    """Started while the dead worker's warden still ends a task that ignores
    SIGTERM (or says goodbye), the next worker waits for it and then takes
    the dead worker's ledger over (its id, its kept results): skipped, they
    would wait for a later worker process."""
    doomed = server.start_worker(tmp_path / "w", name="doomed", kill_grace=5.0)
    warden = _warden_of(doomed)
    with server.client() as client:
        (old_worker,) = [w.id for w in client.workers()]
        job, line = _killed_mid_task(client, doomed)
        pid = int(line.split()[1])
        server.start_worker(tmp_path / "w", name="heir")
        assert pids_alive(warden.pid, pid) == []  # a zombie is gone enough
        assert {w.id for w in client.workers()} == {old_worker}, "the heir took the id over"
        assert job.refresh().reason == WORKER_DIED


@pytest.mark.usefixtures("three_gpus")
def test_a_gpu_worker_restarted_after_a_kill_offers_its_gpus_once_its_tasks_are_gone(
    server: ServerProc, tmp_path: Path
) -> None:
    """A supervisor restarts a killed worker at once, on its home: the new
    one claims every GPU (the warden holds none), waits for the warden to
    end the task that ignores SIGTERM, and only then serves, under the dead
    worker's id: no job of its shares a GPU with the dying task."""
    doomed = server.start_worker(tmp_path / "w", name="doomed", gpus="all", kill_grace=3.0)
    warden = _warden_of(doomed)
    with server.client() as client:
        (old_worker,) = [w.id for w in client.workers()]
        _, line = _killed_mid_task(client, doomed, gpus=1)
        pid = int(line.split()[1])
        server.start_worker(tmp_path / "w", name="again", gpus="all")
        assert pids_alive(warden.pid, pid) == []  # a zombie is gone enough
        (again,) = client.workers()
        assert (again.id, again.slot_gpus) == (old_worker, [0, 1, 2])


def test_a_second_stop_signal_ends_a_slow_stop_at_once(server: ServerProc, tmp_path: Path) -> None:
    """The first SIGTERM stops a worker gently, which can take minutes with a
    server that stopped answering; the second ends it at once, and its
    warden ends the task it left."""
    worker = server.start_worker(tmp_path / "w")
    warden = _warden_of(worker)
    assert server.proc is not None
    with server.client() as client:
        job = client.submit(command=[PY, "-c", _STUBBORN])
        pid = int(follow_until(job, "pid").split()[1])
    server.proc.send_signal(signal.SIGSTOP)  # takes connections, answers nothing
    try:
        worker.send_signal(signal.SIGTERM)
        said(worker, "stopping")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 128 + signal.SIGTERM
        warden.wait(timeout=30)
        assert pids_alive(pid) == []
    finally:
        server.proc.send_signal(signal.SIGCONT)
