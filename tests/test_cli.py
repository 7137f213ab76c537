"""The gpulayer command, run for real in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

GPULAYER = [sys.executable, "-m", "gpulayer.cli"]


def gl(*args: str, home: Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPULAYER_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run(
        [*GPULAYER, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )


def test_run_streams_logs_and_downloads_outputs(home: Path, project: Path, tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("cli data")
    done = gl(
        "run",
        str(project / "train.py"),
        "x",
        "--input",
        f"data={data}",
        "--output",
        "out/result.json",
        home=home,
    )
    assert done.returncode == 0, done.stderr
    assert "hello x" in done.stdout
    assert "succeeded" in done.stderr and "source bundle" in done.stderr
    runs = list((project / "gpulayer_runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "out" / "result.json").exists()

    job_id = runs[0].name
    listed = gl("jobs", home=home)
    assert job_id in listed.stdout and "succeeded" in listed.stdout
    shown = gl("show", job_id[:9], home=home)
    assert shown.returncode == 0
    for word in ("timings", "dispatch", "prepare", "run", "total", "out/result.json"):
        assert word in shown.stdout
    assert gl("logs", job_id, home=home).stdout == "hello x\n"
    assert "running" not in gl("workers", home=home).stdout


def test_run_exits_with_the_jobs_exit_code(home: Path) -> None:
    done = gl(
        "run",
        "--",
        sys.executable,
        "-c",
        "import sys; print('oops', file=sys.stderr); sys.exit(7)",
        home=home,
    )
    assert done.returncode == 7
    assert "oops" in done.stderr and "failed" in done.stderr


def test_run_a_yaml_job(home: Path, project: Path) -> None:
    (project / "job.yaml").write_text(
        "script: train.py\nargs: [from, yaml]\nname: yamljob\nenv: {A: b}\n"
    )
    done = gl("run", "-f", str(project / "job.yaml"), home=home)
    assert done.returncode == 0, done.stderr
    assert "hello from yaml" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--gpus", "-1", "x.py"], "gpus"),
        (["run", "--input", "nonsense", "--", "true"], "NAME=VALUE"),
        (["show", "nosuchjob"], "no job with id"),
        (["run"], "give a script or command"),
        (["run", "--slots", "0", "--", "true"], "at least one slot"),
    ],
)
def test_bad_input_gets_a_clear_error(
    home: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "x.py").write_text("pass\n")
    done = gl(*args, home=home, cwd=tmp_path)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_show_says_which_attempts_were_given_back(home: Path) -> None:
    from gpulayer.home import Home
    from gpulayer.ids import new_id
    from gpulayer.jobs import JobInfo
    from gpulayer.spec import JobSpec
    from gpulayer.store.sqlite import SqliteStore

    job_id = new_id()  # a client refuses a record whose id GPUlayer did not make
    store = SqliteStore(Home(home).db)
    with store.transaction() as tx:
        job = JobInfo(
            id=job_id, spec=JobSpec(command=["true"], nodes=2), seq=1, marks={"submitted": 1.0}
        )
        tx.insert_job(job)
        tx.requeue(job_id, reason=None, owner="gone", attempt=1, given_back=1)
    store.close()
    shown = gl("show", job_id, home=home)
    assert "1 (1 given back unrun, not counted)" in shown.stdout, shown.stderr


def test_show_says_why_a_job_waits(home: Path) -> None:
    import gpulayer

    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1)
        job = client.submit(command=["true"], gpus=4)
        shown = gl("show", job.id, home=home)
        assert "queued" in shown.stdout
        assert "why it waits" in shown.stdout and "no worker has that many" in shown.stdout
        job.cancel()


def test_a_stop_signal_wakes_the_worker_and_takes_no_lock() -> None:
    """A handler runs between two bytecodes of the main thread, wherever it
    is: with an Event, a signal inside its ``wait()`` or ``set()`` (a
    second SIGTERM, as Client.close() sends) waited for ever on the lock
    the main thread held. The stop request takes none: a handler run
    inside another, or thousands of times, returns at once."""
    import signal
    import threading

    from gpulayer.cli.worker import _stop_on_signal, _StopRequest

    stop = _StopRequest()
    handler = _stop_on_signal(stop, lambda: True)
    wakeup = stop.wake_on_signals()
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        main = threading.main_thread().ident
        assert main == threading.get_ident()
        sender = threading.Thread(target=signal.pthread_kill, args=(main, signal.SIGUSR1))
        sender.start()
        stop.wait()  # woken by the handler, whenever the signal came
        sender.join()
        for _ in range(100_000):  # more than a pipe holds: never blocks
            handler(signal.SIGUSR1, None)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.set_wakeup_fd(wakeup)
        stop.close()


def test_a_stop_signal_before_the_worker_serves_exits_at_once() -> None:
    import signal

    from gpulayer.cli.worker import _stop_on_signal, _StopRequest

    handler = _stop_on_signal(_StopRequest(), lambda: False)
    with pytest.raises(SystemExit) as exited:
        handler(signal.SIGINT, None)
    assert exited.value.code == 128 + signal.SIGINT
