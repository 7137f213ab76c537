"""Review: bad input for the new spec fields (project, preemptible, after,
after_any) through client.submit and `gpulayer run -f job.yaml`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer
from gpulayer.errors import SpecError


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("GPULAYER_HOME", str(home))
    monkeypatch.setenv("GPULAYER_GPU_LOCKS", str(tmp_path / "gpu-locks"))
    monkeypatch.delenv("GPULAYER_SERVER", raising=False)
    monkeypatch.setenv("GPULAYER_PRELOAD", "")
    return home


@pytest.fixture
def client(_env: Path) -> Iterator[gpulayer.Client]:
    with gpulayer.Client(home=_env) as c:
        c.ensure_local_workers(1, kill_grace=0.5)
        yield c


def _gl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
        cwd=tmp_path,
    )


def _done_jobs(client: gpulayer.Client, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        job = client.submit(command=["true"])
        assert job.wait(timeout=60) == "succeeded"
        ids.append(job.id)
    return ids


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"after": 5}, "after"),
        ({"after_any": 5}, "after_any"),
        ({"preemptible": "no"}, "preemptible"),
        ({"preemptible": "false"}, "preemptible"),
    ],
)
def test_client_submit_refuses_bad_new_fields_naming_them(
    client: gpulayer.Client, kwargs: dict[str, object], field: str
) -> None:
    """A SpecError naming the field (nothing stored), as for every other
    field of submit: not a TypeError, and never a string taken as True."""
    with pytest.raises(SpecError) as refused:
        client.submit(command=["true"], **kwargs)  # type: ignore[arg-type]
    assert refused.value.field.startswith(field)
    assert client.jobs() == []


def test_a_job_file_s_after_string_joins_the_command_line_s_after(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    """job.yaml `after: A` (one id, a string: client.submit takes one) and
    `--after B`: the job waits for A and B. run.py splices the string into
    its characters, each taken as a job-id prefix."""
    a, b = _done_jobs(client, 2)
    client.close()
    (tmp_path / "job.yaml").write_text(f"command: [echo, hi]\nafter: {a}\n")
    done = _gl(tmp_path, "run", "-f", "job.yaml", "--after", b)
    assert done.returncode == 0, done.stderr
    with gpulayer.Client() as again:
        newest = [j for j in again.jobs() if j.id not in (a, b)]
        assert [j.info.spec.after for j in newest] == [[a, b]]


@pytest.mark.parametrize(
    ("text", "extra", "field"),
    [
        ("after: 5\n", [], "after"),
        ("after: 5\n", ["--after", "0"], "after"),
        ("after:\n", ["--after", "0zzzzzzzzzzzzz"], "after"),
        ("after_any: {x: 1}\n", ["--after-any", "0"], "after_any"),
        ('preemptible: "no"\n', [], "preemptible"),
    ],
)
def test_a_bad_job_file_field_is_refused_in_words_exit_2(
    tmp_path: Path, text: str, extra: list[str], field: str
) -> None:
    (tmp_path / "job.yaml").write_text("command: [echo, hi]\n" + text)
    done = _gl(tmp_path, "run", "-f", "job.yaml", *extra)
    assert "Traceback" not in done.stderr, done.stderr[-800:]
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr[-800:])
    assert field in done.stderr, done.stderr
