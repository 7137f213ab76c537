"""The life of a job, end to end, with real worker threads and real processes.

Every test runs twice (the ``start`` fixture): with every job cold, and with
script jobs forked from their worker's zygote, which each test that runs
one checks in its record. The jobs are scripts where they can be, so that
they start warm; a command job always starts cold.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import gpulayer
from gpulayer.errors import InvalidStateError, SpecError

from helpers import PY, Start, pids_alive, refuse_commits, script_file

pytestmark = pytest.mark.usefixtures("start")  # set up before any client
# Why a command job starts cold even where the workers start jobs warm.
COMMAND = "a command job, not a Python script"


def wait_for_line(job: gpulayer.Job, prefix: str) -> str:
    """Follow the job's logs until a line starts with ``prefix``."""
    for line in job.stream_logs(follow=True):
        if line.text.startswith(prefix):
            return line.text
    raise AssertionError(f"job ended ({job.status}) without printing {prefix!r}:\n{job.logs()}")


def test_script_job_with_input_and_output(
    start: Start, client: gpulayer.Client, project: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data.txt"
    data.write_text("42 apples")
    job = client.submit(
        project / "train.py", args=["a", "b"], inputs={"data": data}, outputs=["out/result.json"]
    )
    assert job.wait(timeout=60) == "succeeded"
    assert job.exit_code == 0
    # What wait() hands back is exactly what the store holds.
    assert job.info == client.transport.get_job(job.id)
    assert "hello a b" in job.logs()
    out = job.download_outputs()
    assert out == project / "gpulayer_runs" / job.id
    assert json.loads((out / "out/result.json").read_text()) == {
        "args": ["a", "b"],
        "data": "42 apples",
    }
    assert "hello a b" in (out / "logs.txt").read_text()
    start.check(job)


def test_inputs_are_reachable_under_their_names(
    start: Start, client: gpulayer.Client, tmp_path: Path
) -> None:
    folder = tmp_path / "dataset"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "x.csv").write_text("1,2\n")
    code = "import os; print(open('dataset/sub/x.csv').read().strip(), os.listdir(os.environ['GPULAYER_INPUTS']))"
    job = client.submit(script_file(tmp_path, code), inputs={"dataset": folder})
    assert job.wait(timeout=60) == "succeeded", job.info.reason
    assert "1,2 ['dataset']" in job.logs()
    start.check(job)


def test_failure_carries_exit_code_and_stderr_tail(
    start: Start, client: gpulayer.Client, tmp_path: Path
) -> None:
    code = "import sys; print('working'); print('boom: bad things', file=sys.stderr); sys.exit(3)"
    job = client.submit(script_file(tmp_path, code))
    assert job.wait(timeout=60) == "failed"
    start.check(job)
    assert job.info == client.transport.get_job(job.id)
    assert job.exit_code == 3
    assert job.info.reason is not None
    assert "exited with code 3" in job.info.reason and "boom: bad things" in job.info.reason


def test_a_missing_program_fails_with_the_reason(start: Start, client: gpulayer.Client) -> None:
    job = client.submit(command=["/nonexistent/program"])
    assert job.wait(timeout=60) == "failed"
    assert "could not run" in (job.info.reason or "") and "nonexistent" in (job.info.reason or "")
    start.check(job, cold_because=COMMAND)


def test_missing_declared_output_is_reported(
    start: Start, client: gpulayer.Client, tmp_path: Path
) -> None:
    job = client.submit(script_file(tmp_path, "pass\n"), outputs=["model.pt"])
    assert job.wait(timeout=60) == "succeeded"
    assert "declared outputs not found: model.pt" in (job.info.reason or "")
    start.check(job)


def test_timeout_ends_the_whole_tree(start: Start, client: gpulayer.Client, tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('pids', child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    job = client.submit(script_file(tmp_path, code), timeout=1.0)
    grandchild = int(wait_for_line(job, "pids").split()[1])
    assert job.wait(timeout=30) == "timed_out"
    assert pids_alive(grandchild) == []
    start.check(job)


def test_cancel_kills_a_grandchild_that_ignores_sigterm(
    start: Start, client: gpulayer.Client, tmp_path: Path
) -> None:
    code = (
        "import subprocess, sys, time\n"
        "grand = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(\"ok\", flush=True); time.sleep(60)'\n"
        "child = subprocess.Popen([sys.executable, '-c', grand], stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"
        "print('pids', child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    job = client.submit(script_file(tmp_path, code))
    grandchild = int(wait_for_line(job, "pids").split()[1])
    assert job.cancel() in ("running", "cancelled")
    assert job.wait(timeout=30) == "cancelled"
    assert pids_alive(grandchild) == []
    start.check(job)
    with pytest.raises(InvalidStateError, match="already cancelled"):
        job.cancel()


def test_cancel_a_queued_job(client: gpulayer.Client) -> None:
    job = client.submit(command=[PY, "-c", "pass"], gpus=64)
    assert job.cancel() == "cancelled"
    assert job.wait(timeout=5) == "cancelled"


def test_a_job_too_big_for_any_worker_waits_and_says_why(client: gpulayer.Client) -> None:
    job = client.submit(command=[PY, "-c", "pass"], gpus=8)
    info = job.refresh()
    assert info.state == "queued"
    largest = max(sum(g is not None for g in w.slot_gpus) for w in client.workers())
    assert largest < 8  # 0 on a machine without GPUs
    assert info.reason == f"needs 8 GPUs but no worker has that many (largest has {largest} GPUs)"
    with pytest.raises(gpulayer.WaitTimeout, match=job.id):
        job.wait(timeout=0.05)
    # Meanwhile other jobs run.
    assert client.submit(command=[PY, "-c", "pass"]).wait(timeout=60) == "succeeded"
    job.cancel()


def test_burst_on_several_workers_every_outcome_right(
    start: Start, home: Path, tmp_path: Path
) -> None:
    code = "import sys\ni = int(sys.argv[1])\nprint(i)\nraise SystemExit(i % 3)\n"
    script = script_file(tmp_path, code)
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(4)
        jobs = [client.submit(script, [str(i)]) for i in range(40)]
        for i, job in enumerate(jobs):
            assert job.wait(timeout=120) == ("succeeded" if i % 3 == 0 else "failed")
            assert job.exit_code == i % 3
            assert job.logs() == f"{i}\n"
            assert job.info.attempt == 1
            start.check(job)
        assert len({j.info.worker for j in jobs}) > 1, "the burst should spread over workers"


def test_priority_runs_first_when_capacity_frees(start: Start, home: Path, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    quick = script_file(tmp_path, "pass\n")
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1)
        blocker = client.submit(
            script_file(tmp_path, f"print('in', flush=True); open({str(gate)!r}).read()\n", "b.py")
        )
        wait_for_line(blocker, "in")
        low = client.submit(quick, priority=0)
        high = client.submit(quick, priority=10)
        with open(gate, "w") as f:
            f.write("go")
        for job in (blocker, low, high):
            assert job.wait(timeout=60) == "succeeded"
            start.check(job)
        assert high.info.marks["started"] < low.info.marks["started"]


def test_retry_within_budget(start: Start, client: gpulayer.Client, tmp_path: Path) -> None:
    marker = tmp_path / "tried"
    code = f"import os, sys; p={str(marker)!r}\nif not os.path.exists(p): open(p, 'w').close(); sys.exit(1)"
    job = client.submit(script_file(tmp_path, code), max_retries=1)
    assert job.wait(timeout=60) == "succeeded"
    assert job.info.attempt == 2
    start.check(job)  # the second attempt's start


def test_bad_spec_stores_nothing(
    client: gpulayer.Client, project: Path, home: Path, tmp_path: Path
) -> None:
    with pytest.raises(SpecError) as info:
        client.submit(project / "train.py", gpus=-1)
    assert info.value.field == "gpus"
    with pytest.raises(SpecError) as info:
        client.submit(project / "train.py", inputs={"data": tmp_path / "nope"})
    assert info.value.field == "inputs.data"
    with pytest.raises(SpecError) as info:
        client.submit(project / "missing.py")
    assert info.value.field == "script"
    assert client.jobs() == []
    blobs = home / "artifacts"
    assert not blobs.exists() or not any(p.is_file() for p in blobs.rglob("*"))


def test_timings_cover_every_stage(start: Start, client: gpulayer.Client, tmp_path: Path) -> None:
    job = client.submit(script_file(tmp_path, "pass\n"))
    job.wait(timeout=60)
    start.check(job)
    timings = job.timings
    assert set(timings) == {"queue", "dispatch", "prepare", "launch", "run", "finish", "total"}
    assert all(v >= 0 for v in timings.values())
    parts = sum(v for k, v in timings.items() if k != "total")
    assert parts == pytest.approx(timings["total"], abs=1e-3)


def test_gpu_slots_are_isolated(start: Start, home: Path, tmp_path: Path) -> None:
    from gpulayer.worker.gpus import Gpu
    from gpulayer.worker.worker import Worker

    with gpulayer.Client(home=home, auto_worker=False) as client:
        embedded = client._embedded
        assert embedded is not None
        fake = [Gpu(index=i, vendor="nvidia", name="Fake GPU") for i in range(4)]
        worker = Worker(
            client.transport, cache=embedded.artifacts, work_dir=home / "workers", gpus=fake
        )
        worker.start()
        try:
            # At the C level too, where a GPU runtime reads it.
            show = (
                "import ctypes, os\n"
                "libc = ctypes.CDLL(None)\n"
                "libc.getenv.restype = ctypes.c_char_p\n"
                "seen = os.environ.get('CUDA_VISIBLE_DEVICES')\n"
                "assert (libc.getenv(b'CUDA_VISIBLE_DEVICES') or b'').decode() == (seen or '')\n"
                "print(repr(seen))\n"
            )
            script = script_file(tmp_path, show)
            two = client.submit(script, gpus=2)
            none = client.submit(script, gpus=0)
            assert two.wait(timeout=60) == "succeeded" and none.wait(timeout=60) == "succeeded"
            start.check(two)
            start.check(none)
            seen = two.logs().strip().strip("'").split(",")
            assert len(seen) == 2 and set(seen) <= {"0", "1", "2", "3"}
            assert seen == [str(g) for g in two.info.gpus]
            assert none.logs().strip() == "''"
        finally:
            worker.stop()


def test_embedded_workers_leave_a_gpu_another_process_offers(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpulayer.worker.gpulocks import claim_gpus
    from gpulayer.worker.gpus import Gpu

    fake = [Gpu(index=i, vendor="nvidia", name="Fake GPU", uuid=f"GPU-{i}") for i in range(3)]
    monkeypatch.setattr("gpulayer.embedded.detect_gpus", lambda: fake)
    elsewhere = claim_gpus(fake[1:2])  # as a `gpulayer worker start --gpus 1` would
    try:
        with gpulayer.Client(home=home, auto_worker=False) as client:
            embedded = client._embedded
            assert embedded is not None
            workers = embedded.ensure_local_workers(2)
            assert sorted(g.index for w in workers for g in w.gpus) == [0, 2]
    finally:
        elsewhere.release()


def test_a_long_line_is_cut_and_output_is_complete(
    start: Start, client: gpulayer.Client, tmp_path: Path
) -> None:
    code = "print('x' * 200_000); [print(i) for i in range(20_000)]"
    job = client.submit(script_file(tmp_path, code))
    assert job.wait(timeout=60) == "succeeded"
    start.check(job)
    lines = job.logs().splitlines()
    assert lines[0].startswith("x" * 1000) and lines[0].endswith("cut at 65536 bytes]")
    assert lines[1:] == [str(i) for i in range(20_000)]


def test_jobs_and_lookup_by_prefix(client: gpulayer.Client, tmp_path: Path) -> None:
    job = client.submit(script_file(tmp_path, "pass\n"), name="named", labels={"k": "v"})
    job.wait(timeout=60)
    assert client.job(job.id[:10]).id == job.id
    assert [j.id for j in client.jobs(state="succeeded")] == [job.id]
    with pytest.raises(gpulayer.JobNotFoundError):
        client.job("zzzzzz")


def test_workers_are_listed(client: gpulayer.Client) -> None:
    workers = client.workers()
    assert len(workers) == 2 and all(len(w.slot_gpus) == 1 for w in workers)


def test_wait_wakes_promptly(start: Start, client: gpulayer.Client, tmp_path: Path) -> None:
    # Not a benchmark: a guard that completion wakes the waiter (no polling
    # interval hides in the path). A 1 s bound is 100x the expected time.
    job = client.submit(script_file(tmp_path, "pass\n"))
    job.wait(timeout=60)
    start.check(job)
    assert job.info.timings()["finish"] < 1.0
    assert time.time() - job.info.marks["finished"] < 60


def test_large_uploads_show_progress_and_large_bundles_warn(
    start: Start,
    home: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from contextlib import contextmanager

    from gpulayer import defaults

    bars: list[tuple[int, str, int]] = []

    @contextmanager
    def progress(total: int, label: str):  # type: ignore[no-untyped-def]
        seen = [0]
        yield lambda n: seen.__setitem__(0, seen[0] + n)
        bars.append((total, label, seen[0]))

    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(defaults.PROGRESS_MIN_BYTES + 1))
    script_dir = tmp_path / "proj"
    script_dir.mkdir()
    (script_dir / "run.py").write_text("import os; print(os.path.getsize('big'))\n")
    (script_dir / "weights.bin").write_bytes(b"w" * 2000)
    monkeypatch.setattr(defaults, "LARGE_BUNDLE_BYTES", 1000)
    with gpulayer.Client(home=home, progress=progress) as client:
        client.ensure_local_workers(1)
        with caplog.at_level("WARNING", logger="gpulayer"):
            job = client.submit(script_dir / "run.py", inputs={"big": big})
        assert job.wait(timeout=60) == "succeeded"
        assert job.logs().strip() == str(big.stat().st_size)
        start.check(job)
    assert bars == [(big.stat().st_size, "storing input big.bin", big.stat().st_size)]
    assert any(
        "weights.bin" in r.message and ".gpulayerignore" in r.message for r in caplog.records
    )


def test_downloaded_outputs_are_private_copies(
    start: Start, client: gpulayer.Client, tmp_path: Path
) -> None:
    code = (
        "import os; os.makedirs('ckpt', exist_ok=True)\n"
        "open('ckpt/a.pt', 'wb').write(os.urandom(2 << 20)); open('ckpt/b.pt', 'wb').write(b'b')\n"
        "open('log.txt', 'w').write('x')\n"
    )
    job = client.submit(script_file(tmp_path, code), outputs=["ckpt", "*.txt"])
    assert job.wait(timeout=60) == "succeeded"
    start.check(job)
    assert set(job.info.outputs) == {"ckpt", "log.txt"}
    out = job.download_outputs(tmp_path / "dl")
    big = out / "ckpt" / "a.pt"
    assert big.stat().st_size == 2 << 20 and big.stat().st_nlink == 1
    big.write_bytes(b"edited")  # the user's copy: editing it touches nothing else
    again = job.download_outputs(tmp_path / "dl2")
    assert (again / "ckpt" / "a.pt").stat().st_size == 2 << 20
    assert (again / "log.txt").read_text() == "x"


def test_a_flood_of_output_is_kept_whole_and_in_order(
    start: Start, client: gpulayer.Client, tmp_path: Path
) -> None:
    n = 300_000
    code = f"import sys\nfor i in range({n}): sys.stdout.write(f'{{i}}\\n')"
    job = client.submit(script_file(tmp_path, code))
    assert job.wait(timeout=120) == "succeeded"
    start.check(job)
    texts = [line.text for line in job.stream_logs(follow=False)]
    assert len(texts) == n and texts[0] == "0" and texts[-1] == str(n - 1)
    assert texts == [str(i) for i in range(n)]


def test_a_write_the_store_refuses_delays_a_report_and_loses_nothing(
    start: Start, client: gpulayer.Client, tmp_path: Path
) -> None:
    assert client._embedded is not None
    store = client._embedded.store
    job = client.submit(script_file(tmp_path, "print('done')\n"))
    refuse_commits(store)  # the next write fails
    assert job.wait(timeout=60) == "succeeded"  # its worker's report went again
    assert job.logs().strip() == "done"
    start.check(job)


def test_a_job_does_not_get_its_workers_token(
    start: Start, home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker's token (in its environment, as docs/server.md starts one) is
    not its jobs': a job printing it would hand it to every reader of its logs.
    Nor is it in a warm job's memory, a copy of its zygote's."""
    token = "glt_w_not-for-jobs"
    monkeypatch.setenv("GPULAYER_TOKEN", token)
    probe = (  # what the job's environment says, and what its process was started with
        "import os\n"
        "print('token=' + os.environ.get('GPULAYER_TOKEN', 'unset'))\n"
        "print('environ', b'GPULAYER_TOKEN=' in open('/proc/self/environ', 'rb').read())\n"
    )
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1)
        shell = client.submit(command=["sh", "-c", 'echo "token=${GPULAYER_TOKEN-unset}"'])
        assert shell.wait(timeout=60) == "succeeded"
        assert shell.logs() == "token=unset\n"
        start.check(shell, cold_because=COMMAND)
        job = client.submit(script_file(tmp_path, probe))
        assert job.wait(timeout=60) == "succeeded"
        assert job.logs() == "token=unset\nenviron False\n"
        start.check(job)
        zygotes = client._embedded.workers[0]._warm  # type: ignore[union-attr]
        for zygote in [] if zygotes is None else zygotes.zygotes:
            try:
                with open(f"/proc/{zygote.proc.pid}/environ", "rb") as environ:
                    assert token.encode() not in environ.read()
            except PermissionError:
                continue  # not dumpable: closed to its own user too (but to root)
