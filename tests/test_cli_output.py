"""What the gpulayer command prints for people and for programs: piped
tables with nothing cut, ``--json``, ``logs --tail``, hostile job names.
Each through the real command in a subprocess."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer
from gpulayer.cli.output import escape
from server.conftest import ServerProc, free_port

GPULAYER = [sys.executable, "-m", "gpulayer.cli"]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "json-output.md"

# The keys docs/json-output.md promises, schema 1.
JOB_KEYS = {
    "schema",
    "id",
    "name",
    "user",
    "project",
    "state",
    "exit_code",
    "reason",
    "attempt",
    "given_back",
    "cancel_requested",
    "worker",
    "slots",
    "gpu_ids",
    "spec",
    "marks",
    "timings",
    "usage",
    "outputs",
    "tasks",
    "start",
    "array",
    "array_task",
}
SPEC_KEYS = {
    "command",
    "script",
    "args",
    "env",
    "secrets",
    "labels",
    "gpus",
    "nodes",
    "procs_per_node",
    "launcher",
    "priority",
    "max_retries",
    "timeout",
    "bundle",
    "inputs",
    "outputs",
}
WORKER_KEYS = {
    "schema",
    "id",
    "name",
    "host",
    "address",
    "slots",
    "slot_gpus",
    "gpu_vendor",
    "gpu_names",
    "containment",
    "started",
    "last_seen",
    "running",
    "gpu_stats",
}
LOG_KEYS = {"schema", "seq", "time", "stream", "rank", "node", "text"}
JOB_COLUMNS = [
    "ID",
    "USER",
    "PROJECT",
    "NAME",
    "STATE",
    "EXIT",
    "GPUS",
    "WORKER",
    "SUBMITTED",
    "TOOK",
    "REASON",
    "TASKS",
]

# A name that tries everything: split a row (tab, newline, carriage return),
# set the terminal's title and clear it (escape sequences, a C1 CSI, BEL),
# reverse the text shown after it, and pass for rich markup.
HOSTILE = "evil\tname\nnext\r\x1b]0;pwned\x07[red]x[/]\x1b[2J\x9b31m\u202eback"


def gl(
    *args: str, home: Path | None = None, server: str | None = None, token: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    if home is not None:
        env["GPULAYER_HOME"] = str(home)
    if server is not None:
        env.update(GPULAYER_SERVER=server, GPULAYER_TOKEN=token or "")
    return subprocess.run(
        [*GPULAYER, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def job_id_of(done: subprocess.CompletedProcess[str]) -> str:
    """The id in ``run``'s "job ID submitted" line."""
    for line in done.stderr.splitlines():
        words = line.split()
        if "submitted" in words:
            return words[words.index("submitted") - 1]
    raise AssertionError(f"no job submitted:\n{done.stderr}")


def rows(stdout: str) -> list[list[str]]:
    """A piped table: one row a line, cells split on tabs, the header checked."""
    lines = stdout.splitlines()
    assert lines and lines[0].split("\t") == JOB_COLUMNS, stdout
    return [line.split("\t") for line in lines[1:]]


@pytest.fixture
def waiting(home: Path) -> Iterator[gpulayer.Job]:
    """A job that waits (more GPUs than any worker has), while its client
    and one local worker live."""
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1)
        job = client.submit(command=["true"], gpus=4, name="waits for gpus")
        yield job
        job.cancel()


def test_a_piped_table_cuts_nothing(home: Path) -> None:
    name = "a-long-job-name-" * 12  # 192 characters; a terminal shows 28
    job_id = job_id_of(gl("run", "--name", name, "--", "true", home=home))
    out = ok(gl("jobs", home=home))
    assert "…" not in out and "\x1b" not in out
    [row] = rows(out)
    assert len(row) == len(JOB_COLUMNS)
    assert row[0] == job_id and row[3] == name and row[4] == "succeeded" and row[5] == "0"
    assert row[10] == "-"  # a reason only for jobs that wait
    # What a shell user types: grep finds the row, awk's first field is the id.
    assert [line for line in out.splitlines() if "succeeded" in line] == ["\t".join(row)]
    assert out.splitlines()[1].split()[0] == job_id
    shown = ok(gl("show", job_id, home=home))
    assert f"name\t{name}\n" in shown and f"id\t{job_id}\n" in shown


def test_jobs_show_why_a_job_waits(home: Path, waiting: gpulayer.Job) -> None:
    [row] = rows(ok(gl("jobs", home=home)))
    assert row[0] == waiting.id and row[4] == "queued"
    reason = waiting.refresh().reason
    assert reason and row[10] == escape(reason)
    [listed] = json.loads(ok(gl("jobs", "--state", "queued", "--json", home=home)))
    assert listed["reason"] == reason and listed["state"] == "queued"
    assert f"why it waits: {escape(reason)}" in ok(gl("show", waiting.id, home=home))


def test_workers_as_a_table_and_as_json(home: Path, waiting: gpulayer.Job) -> None:
    lines = ok(gl("workers", home=home)).splitlines()
    assert lines[0].split("\t") == [
        "ID",
        "NAME",
        "HOST",
        "SLOTS",
        "GPUS",
        "CONTAINMENT",
        "RUNNING",
        "GPU USE",
    ]
    [row] = [line.split("\t") for line in lines[1:]]
    [worker] = json.loads(ok(gl("workers", "--json", home=home)))
    assert set(worker) == WORKER_KEYS and worker["schema"] == 1
    assert row[0] == worker["id"] and row[3] == str(worker["slots"]) == "1"
    assert worker["running"] == [] and worker["gpu_names"] == [] and worker["gpu_stats"] == []


def test_jobs_and_show_as_json(home: Path, tmp_path: Path) -> None:
    ran = gl(
        "run",
        "--name",
        "json job",
        "--label",
        "team=vision",
        "--env",
        "PLAIN=shown",
        "--secret",
        "HF_TOKEN=hush-never-shown",
        "--output",
        "out.txt",
        "--no-download",
        "--",
        "sh",
        "-c",
        "echo hi > out.txt",
        home=home,
    )
    job_id = job_id_of(ran)
    other = job_id_of(gl("run", "--label", "team=audio", "--", "true", home=home))
    listed_text = ok(gl("jobs", "--json", home=home))
    shown_text = ok(gl("show", job_id, "--json", home=home))
    for text in (listed_text, shown_text):
        assert "hush-never-shown" not in text and "redacted" not in text
    listed = json.loads(listed_text)
    assert [j["id"] for j in listed] == [other, job_id]  # newest first
    shown = json.loads(shown_text)
    assert shown == listed[1]  # one object for a job, whichever command gives it
    assert set(shown) == JOB_KEYS and set(shown["spec"]) == SPEC_KEYS
    assert shown["schema"] == 1 and shown["id"] == job_id and shown["name"] == "json job"
    assert shown["state"] == "succeeded" and shown["exit_code"] == 0
    spec = shown["spec"]
    assert spec["command"] == ["sh", "-c", "echo hi > out.txt"] and spec["script"] is None
    assert spec["secrets"] == ["HF_TOKEN"] and spec["env"] == {"PLAIN": "shown"}
    assert spec["labels"] == {"team": "vision"} and spec["outputs"] == ["out.txt"]
    assert set(shown["timings"]) >= {"queue", "run", "total"}
    assert shown["marks"]["submitted"] <= shown["marks"]["finished"]
    out = shown["outputs"]["out.txt"]
    assert out["kind"] == "file" and out["size"] == 3 and len(out["digest"]) == 64
    assert shown["tasks"] == [] and set(shown["usage"]) == {"cpu_seconds", "peak_memory_bytes"}
    # Filtered by label: all given must match; a value with metacharacters matches nothing.
    only = json.loads(ok(gl("jobs", "--label", "team=vision", "--json", home=home)))
    assert [j["id"] for j in only] == [job_id]
    for hostile in ("team=vision' OR '1'='1", 'team=%", "x": "', "team=*"):
        assert json.loads(ok(gl("jobs", "--label", hostile, "--json", home=home))) == []
    refused = gl("jobs", "--label", "team", home=home)
    assert refused.returncode == 2 and "expected K=V, got 'team'" in refused.stderr
    assert json.loads(ok(gl("jobs", "--state", "running", "--json", home=home))) == []


def test_the_docs_name_every_key() -> None:
    text = DOCS.read_text()
    for key in JOB_KEYS | SPEC_KEYS | WORKER_KEYS | LOG_KEYS:
        assert f"| `{key}` |" in text, key


def test_logs_as_json_lines_and_their_tail(home: Path) -> None:
    script = "for i in 1 2 3 4 5; do echo line$i; done; echo oops >&2"
    job_id = job_id_of(gl("run", "--", "sh", "-c", script, home=home))
    lines = [json.loads(line) for line in ok(gl("logs", job_id, "--json", home=home)).splitlines()]
    assert all(set(line) == LOG_KEYS and line["schema"] == 1 for line in lines)
    by_stream = {
        stream: [line["text"] for line in lines if line["stream"] == stream]
        for stream in ("stdout", "stderr")
    }
    assert by_stream == {"stdout": [f"line{i}" for i in range(1, 6)], "stderr": ["oops"]}
    assert all(line["rank"] is None and line["node"] is None for line in lines)
    assert [line["seq"] for line in lines] == sorted(line["seq"] for line in lines)

    # The last two lines of the log, each on its stream (stderr's to stderr).
    tail = gl("logs", job_id, "--tail", "2", home=home)
    last_two = lines[-2:]
    assert tail.stdout.splitlines() == [x["text"] for x in last_two if x["stream"] == "stdout"]
    assert ("oops" in tail.stderr) == any(x["stream"] == "stderr" for x in last_two)
    assert len(ok(gl("logs", job_id, home=home)).splitlines()) == 5
    tail_json = ok(gl("logs", job_id, "--tail", "2", "--json", home=home)).splitlines()
    assert [json.loads(line) for line in tail_json] == lines[-2:]
    assert ok(gl("logs", job_id, "--tail", "0", home=home)) == ""
    refused = gl("logs", job_id, "--tail", "-1", home=home)
    assert refused.returncode == 2 and "--tail" in refused.stderr and refused.stdout == ""


def test_logs_tail_then_follow(home: Path, tmp_path: Path) -> None:
    go = tmp_path / "go"
    script = (
        "for i in 1 2 3 4 5; do echo line$i; done; "
        f"while [ ! -e {go} ]; do sleep 0.05; done; echo after"
    )
    with gpulayer.Client(home=home) as client:
        job = client.submit(command=["sh", "-c", script])
        deadline = time.monotonic() + 30
        while job.logs().count("\n") < 5:  # every line before the wait is stored
            assert time.monotonic() < deadline, job.logs()
            time.sleep(0.05)
        follower = subprocess.Popen(
            [*GPULAYER, "logs", job.id, "--tail", "2", "-f"],
            env={**os.environ, "GPULAYER_HOME": str(home)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert follower.stdout is not None
            assert follower.stdout.readline() == "line4\n"
            assert follower.stdout.readline() == "line5\n"
            go.touch()  # only now does the job print more
            out, err = follower.communicate(timeout=30)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.communicate()
        assert follower.returncode == 0, err
        assert out == "after\n"
        assert job.wait(timeout=30) == "succeeded"


def test_a_hostile_name_cannot_break_a_row_or_reach_the_terminal(home: Path) -> None:
    job_id = job_id_of(gl("run", "--name", HOSTILE, "--", "true", home=home))
    out = ok(gl("jobs", home=home))
    [row] = rows(out)  # one line: the name split nothing
    assert row[0] == job_id and row[4] == "succeeded"
    assert row[3] == ("evil\\tname\\nnext\\r\\x1b]0;pwned\\x07[red]x[/]\\x1b[2J\\x9b31m\\u202eback")
    for raw in ("\x1b", "\x07", "\x9b", "\r", "\u202e"):
        assert raw not in out
    shown = ok(gl("show", job_id, home=home))
    assert f"name\t{row[3]}\n" in shown and "\x1b" not in shown
    # Exact in JSON, and still not a byte a terminal acts on.
    for text in (ok(gl("jobs", "--json", home=home)), ok(gl("show", job_id, "--json", home=home))):
        assert text.isascii() and "\x1b" not in text
        found = json.loads(text)
        assert (found[0] if isinstance(found, list) else found)["name"] == HOSTILE

    # On a terminal, rich draws the table: markup in the name is shown as
    # typed, and its escape sequences arrive as text.
    listed, shown = on_a_terminal("jobs", home=home), on_a_terminal("show", job_id, home=home)
    assert "evil\\tname\\nnext" in listed and "succeeded" in listed  # the name cut to fit
    assert f"{row[3]} " in shown  # shown whole: "[red]x[/]" as typed
    for raw in ("\x1b]0;", "\x1b[2J", "\x07", "\x9b", "\u202e"):
        assert raw not in listed and raw not in shown


def on_a_terminal(*args: str, home: Path) -> str:
    """What the command writes when its stdout is a terminal (a pty)."""
    primary, secondary = pty.openpty()
    env = {**os.environ, "GPULAYER_HOME": str(home), "COLUMNS": "300", "TERM": "xterm"}
    proc = subprocess.Popen(
        [*GPULAYER, *args], stdout=secondary, stderr=subprocess.PIPE, env=env, text=False
    )
    os.close(secondary)
    got = b""
    try:
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: the command ended and closed the terminal
                break
            if not chunk:
                break
            got += chunk
    finally:
        os.close(primary)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return got.decode()


def test_jobs_as_json_against_a_server(tmp_path: Path) -> None:
    server = ServerProc(tmp_path / "server-home", free_port())
    server.start()
    try:
        url, token = server.url, server.admin
        # No worker: the job waits, and the server says why.
        ran = gl("run", "--detach", "--name", HOSTILE, "--", "true", server=url, token=token)
        job_id = job_id_of(ran)
        [listed] = json.loads(ok(gl("jobs", "--json", server=url, token=token)))
        assert set(listed) == JOB_KEYS and set(listed["spec"]) == SPEC_KEYS
        assert listed["id"] == job_id and listed["name"] == HOSTILE
        assert listed["state"] == "queued" and listed["reason"]
        assert json.loads(ok(gl("show", job_id, "--json", server=url, token=token))) == listed
        [row] = rows(ok(gl("jobs", server=url, token=token)))
        assert (
            row[0] == job_id and row[3] == escape(HOSTILE) and row[10] == escape(listed["reason"])
        )
        assert json.loads(ok(gl("workers", "--json", server=url, token=token))) == []
    finally:
        server.stop()
