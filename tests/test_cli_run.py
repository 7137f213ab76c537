"""`gpulayer run` and the options every command takes, run for real.

A foreground run owns its job: the signals a terminal command usually ends
by (Ctrl-C, SIGTERM, SIGHUP) cancel it. Options go where people type them;
a misspelt one is caught, not handed to the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpulayer
from server.conftest import said

GPULAYER = [sys.executable, "-m", "gpulayer.cli"]
HANGS = "import signal, time\n{ignore}print('up', flush=True)\ntime.sleep(120)"


def _start(home: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*GPULAYER, "--home", str(home), "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def _end(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        assert pipe is not None
        pipe.close()


def _wait_up(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline() == "up\n", "the job did not start"


def _only_job(home: Path) -> gpulayer.JobInfo:
    """The record of the one job on ``home``, read by a process of its own
    (which, as any, first ends what a dead one left)."""
    with gpulayer.Client(home=home, auto_worker=False) as client:
        (job,) = client.jobs()
        return job.info


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_to_a_foreground_run_cancels_its_job(home: Path, sig: signal.Signals) -> None:
    proc = _start(home, "--", sys.executable, "-c", HANGS.format(ignore=""))
    try:
        _wait_up(proc)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
        assert proc.stderr is not None
        assert "cancelled" in proc.stderr.read()
    finally:
        _end(proc)
    info = _only_job(home)
    assert info.state == "cancelled", info.reason


def test_a_second_signal_exits_at_once(home: Path) -> None:
    """The job ignores SIGTERM, so its cancel waits out the kill grace; a
    second signal does not wait for it."""
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    proc = _start(home, "--", sys.executable, "-c", HANGS.format(ignore=ignore))
    try:
        _wait_up(proc)
        proc.send_signal(signal.SIGTERM)
        said(proc, "cancelling job")
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        assert proc.wait(timeout=30) == 130
        assert time.monotonic() - start < 5, "the second signal waited for the cancel"
    finally:
        _end(proc)
    # The next command on the home ends what the exit left behind.
    info = _only_job(home)
    assert info.done and info.state in ("cancelled", "lost"), info.state


def _gl(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPULAYER, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GPULAYER_HOME": str(home)},
        timeout=120,
    )


@pytest.mark.parametrize(
    ("typo", "meant"), [("--gpu", "--gpus"), ("--priorty", "--priority"), ("--inptu", "--input")]
)
def test_a_misspelt_option_before_the_script_is_refused(home: Path, typo: str, meant: str) -> None:
    done = _gl(home, "run", typo, "1", "train.py")
    assert done.returncode == 2
    assert f"no such option: {typo}; did you mean {meant}?" in done.stderr
    with gpulayer.Client(home=home, auto_worker=False) as client:
        assert client.jobs() == [], "a job was stored for a refused command"


def test_a_close_match_after_the_script_is_warned_of_and_still_passed(home: Path) -> None:
    done = _gl(home, "run", "echo", "hi", "--priorty", "5")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hi --priorty 5\n"
    assert "--priorty goes to the job" in done.stderr and "did you mean --priority?" in done.stderr


def test_after_two_dashes_everything_is_the_jobs(home: Path) -> None:
    done = _gl(home, "run", "--", sys.executable, "-c", "import sys; print(sys.argv[1:])", "--gpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "['--gpu']\n" and "warning" not in done.stderr


def test_a_job_that_cannot_start_says_why_it_waits(home: Path) -> None:
    """No GPU here: after about two seconds the run says what it waits for."""
    proc = _start(home, "--gpus", "1", "--", "echo", "hi")
    try:
        line = said(proc, "waits:")
        assert "needs 1 GPU" in line, line
        # Another process on the home (a second terminal) gives the same reason.
        job_id = line.split()[2]
        shown = _gl(home, "show", job_id, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["reason"] == line.split("waits: ", 1)[1].strip()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
    finally:
        _end(proc)


def test_global_options_after_the_command(home: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "other-home"
    ran = _gl(home, "run", "--home", str(elsewhere), "echo", "here")
    assert ran.returncode == 0, ran.stderr
    listed = _gl(home, "jobs", "--home", str(elsewhere))
    assert "echo here" in listed.stdout
    assert "echo here" not in _gl(home, "jobs").stdout, "--home after the command was ignored"
    twice = _gl(home, "--home", str(home), "jobs", "--home", str(elsewhere))
    assert twice.returncode == 2
    assert "--home is given twice" in twice.stderr


def test_a_job_file_error_names_the_file_the_line_and_the_field_meant(
    home: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "job.yaml"
    broken.write_text("command: [echo, hi]\ngpus: 1\n  bad: x\n")
    done = _gl(home, "run", "-f", str(broken))
    assert done.returncode == 2
    assert f"{broken} is not valid YAML: line 3, column 6" in done.stderr, done.stderr
    assert "<unicode string>" not in done.stderr
    misspelt = tmp_path / "typo.yaml"
    misspelt.write_text("comand: [echo, hi]\n")
    done = _gl(home, "run", "-f", str(misspelt))
    assert done.returncode == 2
    assert "comand: unknown field" in done.stderr and "did you mean 'command'?" in done.stderr


def test_a_spec_error_is_said_in_plain_words(home: Path) -> None:
    done = _gl(home, "run", "--gpus", "-1", "echo", "hi")
    assert done.returncode == 2
    assert "gpus: must be a whole number, 0 or more; got -1" in done.stderr, done.stderr
    assert "Expected" not in done.stderr


@pytest.mark.parametrize(
    "job_args",
    [
        ["--token", "hf_third_party_token"],  # a script's own --token (Hugging Face, say)
        ["--home=/data/run1"],  # a script's own --home
        ["--server", "localhost:8000"],  # a script that talks to its own server
    ],
)
def test_a_scripts_own_option_named_like_a_global_one_reaches_the_script(
    home: Path, tmp_path: Path, job_args: list[str]
) -> None:
    """The global options are GPUlayer's before the script; after it, the
    script's (with a warning), as they were before `run` took them."""
    script = tmp_path / "show.py"
    script.write_text("import sys; print('ARGV', sys.argv[1:])\n")
    done = _gl(home, "run", str(script), "--epochs", "3", *job_args, "--priority", "2")
    assert done.returncode == 0, done.stderr
    assert f"ARGV {['--epochs', '3', *job_args]!r}" in done.stdout, (done.stdout, done.stderr)
    flag = job_args[0].split("=")[0]
    assert f"{flag} after the script goes to the job" in done.stderr
    with gpulayer.Client(home=home, auto_worker=False) as client:
        (job,) = client.jobs()
        assert job.info.spec.priority == 2  # GPUlayer's own options after it still count
