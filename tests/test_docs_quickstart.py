"""Every shell command the Quickstart shows, run as it is shown.

Each ``$ `` line of the page's ``console`` blocks runs in bash, in order, in
a folder holding a copy of ``examples/`` and the files the page's examples
name (``train.py``, ``prod.env``, ``job.yaml``), as a reader following the
page would have them. What the page shows after a command is checked: the
program's own output lines exactly, an error line exactly. Three changes
are made to the commands, so that the test can run beside others: the
page's ``/tmp/`` paths go under the test's folder, its port 8585 is a free
one (given to ``server start`` with ``--port``), and a command the page says to run in a terminal of its own (``server
start``, ``worker start``) runs in the background until the test ends. A
command that asks for a GPU this machine may not have is run until it says
what it waits for, then cancelled, and the arguments its job got are
checked against what the page says the job gets.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from server.conftest import free_port, said

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "docs" / "quickstart.md"


@dataclass
class Command:
    line: str  # as the page shows it, without the "$ "
    shown: list[str] = field(default_factory=list)  # the lines the page shows after it


def commands(text: str) -> list[Command]:
    found: list[Command] = []
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.DOTALL):
        current = None
        for line in block.splitlines():
            if line.startswith("$ "):
                current = Command(line[2:])
                found.append(current)
            elif current is not None and line.strip():
                current.shown.append(line)
    return found


def _job_gets(line: str) -> list[str] | None:
    match = re.search(r"#\s*job gets: (.*)$", line)
    return shlex.split(match[1]) if match else None


def _program_lines(shown: list[str]) -> list[str]:
    """What the page shows the job itself printing (not GPUlayer's own
    lines, which name ids, paths and times that differ on every run)."""
    return [line for line in shown if not line.startswith(("gpulayer:", "glt_"))]


def test_every_command_the_quickstart_shows_runs_as_shown(tmp_path: Path) -> None:
    listed = commands(QUICKSTART.read_text())
    assert len(listed) >= 12, "the Quickstart's commands were not found"
    work = tmp_path / "repo"
    shutil.copytree(ROOT / "examples", work / "examples")
    (work / "train.py").write_text("import sys\nprint(sys.argv[1:])\n")
    (work / "prod.env").write_text("DB_PASSWORD=hunter2\n")
    (work / "job.yaml").write_text("command: [env]\nenv: {THREADS: 4}\n")
    port = str(free_port())
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")},
        "GPULAYER_HOME": str(tmp_path / "home"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "COLUMNS": "200",
    }
    background: list[subprocess.Popen[str]] = []
    try:
        for command in listed:
            line = command.line.replace("/tmp/", f"{tmp_path}/").replace("8585", port)
            if line.startswith("export "):
                env = _exported(line, env, work)
            elif " server start" in line or " worker start" in line:
                if " server start" in line and "--port" not in line:
                    line += f" --port {port}"  # the page's default, 8585, may be taken here
                background.append(_in_background(line, env, work))
            elif _job_gets(line) is not None and "--gpus" in line:
                _run_until_it_waits(line, env, work, _job_gets(line) or [])
            else:
                _run_and_check(command, line, env, work)
    finally:
        for proc in reversed(background):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()


def _exported(line: str, env: dict[str, str], cwd: Path) -> dict[str, str]:
    """The environment after ``line`` (an ``export``), as bash makes it."""
    done = subprocess.run(
        ["bash", "-c", f"{line}\nenv -0"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return dict(item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)


def _in_background(line: str, env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {line}"],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    said(proc, "serving")
    return proc


def _run_and_check(command: Command, line: str, env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(
        ["bash", "-c", line], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )
    errors = [s for s in command.shown if s.startswith("gpulayer: error:")]
    if errors:
        assert done.returncode == 2, (line, done.stderr)
        for error in errors:
            assert error in done.stderr.splitlines(), (line, done.stderr)
        return
    assert done.returncode == 0, (line, done.stdout, done.stderr)
    shown = _program_lines(command.shown)
    if shown:  # the page shows stdout and stderr as a terminal does, together
        printed = _program_lines(done.stdout.splitlines() + done.stderr.splitlines())
        assert sorted(printed) == sorted(shown), (line, done.stdout, done.stderr)
    gets = _job_gets(command.line)
    if gets is not None:
        assert done.stdout.strip() == repr(gets), (line, done.stdout)


def _run_until_it_waits(line: str, env: dict[str, str], cwd: Path, gets: list[str]) -> None:
    """A command that asks for a GPU: on a machine without one it waits and
    says why; its job's arguments are what the page says."""
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {line.split('#')[0]}"],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:
            said(proc, "waits:" if not _has_gpu() else "succeeded")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    finally:
        for pipe in (proc.stdout, proc.stderr):
            assert pipe is not None
            pipe.close()
    listed = subprocess.run(
        ["gpulayer", "jobs", "--json", "--limit", "1"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (job,) = json.loads(listed.stdout)
    assert job["spec"]["args"] == gets, (line, job["spec"])


def _has_gpu() -> bool:
    from gpulayer.worker.gpus import detect_gpus

    return bool(detect_gpus())
