"""`gpulayer cancel`, `download` and `rerun`, run for real in subprocesses.

Long jobs are submitted by an embedded client in this process (an embedded
job runs only while the process that submitted it does); the commands act
on them from another process on the same home, as a second terminal would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import gpulayer

PY = sys.executable
SLEEP = [PY, "-c", "import time; time.sleep(60)"]
# Characters that would matter to SQL, JSON or a JSON path, in a label.
HOSTILE = "x' OR '1'='1\" ]}$.*"


def started(*jobs: gpulayer.Job) -> None:
    """Wait until each job's process is on record: another process on the
    home cancels a running job by ending that process."""
    deadline = time.monotonic() + 60
    while not all(job.refresh().pid is not None for job in jobs):
        assert time.monotonic() < deadline, [job.info for job in jobs]
        time.sleep(0.02)


def gl(
    *args: str, home: Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "GPULAYER_HOME": str(home), "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [PY, "-m", "gpulayer.cli", *args],
        capture_output=True,
        text=True,
        env=full,
        cwd=cwd,
        timeout=120,
    )


def test_cancel_by_label_ends_only_the_jobs_with_every_label(
    client: gpulayer.Client, home: Path
) -> None:
    other = client.submit(command=SLEEP, labels={"team": "b"})
    mine = client.submit(command=SLEEP, labels={"team": "a", "run": "1"})  # the second slot
    queued = client.submit(command=SLEEP, labels={"team": "a", "run": "1"})  # no slot: queued
    partly = client.submit(command=SLEEP, labels={"team": "a"})  # lacks run=1
    started(other, mine)
    try:
        # Labels that look like SQL or a JSON path match nothing, and end nothing.
        for hostile in (f"team={HOSTILE}", f"{HOSTILE}=a", "team=a' OR 1=1 --"):
            done = gl("cancel", "--label", hostile, home=home)
            assert done.returncode == 0, done.stderr
            assert "cancelled 0 job(s)" in done.stderr and done.stdout == ""
        assert {j.status for j in (other, mine, queued, partly)} <= {"running", "queued"}

        done = gl("cancel", "--label", "team=a", "--label", "run=1", home=home)
        assert done.returncode == 0, done.stderr
        assert "cancelled 2 job(s) labelled team=a run=1" in done.stderr
        assert sorted(line.split(":")[0] for line in done.stdout.splitlines()) == sorted(
            f"job {j.id}" for j in (mine, queued)
        )
        assert mine.wait(timeout=60) == "cancelled" and queued.wait(timeout=60) == "cancelled"
        assert other.status == "running" and partly.status in ("running", "queued")
    finally:
        for job in (other, mine, queued, partly):
            if not job.refresh().done:
                job.cancel()


def test_cancel_several_names_the_ones_it_could_not_and_still_cancels_the_rest(
    client: gpulayer.Client, home: Path
) -> None:
    first, second = client.submit(command=SLEEP), client.submit(command=SLEEP)
    started(first, second)
    done = gl("cancel", first.id, "1m8nosuchjob00", second.id, home=home)
    assert done.returncode == 1
    assert "no job with id '1m8nosuchjob00'" in done.stderr
    assert first.wait(timeout=60) == "cancelled" and second.wait(timeout=60) == "cancelled"
    assert f"job {first.id}:" in done.stdout and f"job {second.id}:" in done.stdout


def test_a_bare_cancel_is_refused_and_a_bad_label_changes_nothing(
    client: gpulayer.Client, home: Path
) -> None:
    job = client.submit(command=SLEEP, labels={"team": "a"})
    try:
        bare = gl("cancel", home=home)
        assert bare.returncode == 2 and "JOB... or --label K=V" in bare.stderr
        for bad in ("team", "=a"):
            done = gl("cancel", job.id, "--label", bad, home=home)
            assert done.returncode == 2 and "--label takes KEY=VALUE" in done.stderr
        assert job.status == "running"  # not even the id given beside it
    finally:
        job.cancel()


def test_download_fetches_the_outputs_of_a_job_that_ended(home: Path, tmp_path: Path) -> None:
    code = "open('model.txt', 'w').write('weights'); print('trained')"
    ran = gl("run", "--output", "model.txt", "--no-download", "--", PY, "-c", code, home=home)
    assert ran.returncode == 0, ran.stderr
    (job,) = gpulayer_jobs(home)
    done = gl("download", job, "--to", str(tmp_path / "dl"), home=home)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "dl")
    assert (tmp_path / "dl" / "model.txt").read_text() == "weights"
    assert "trained" in (tmp_path / "dl" / "logs.txt").read_text()
    # Without --to: gpulayer_runs/JOB where the command runs.
    done = gl("download", job[:9], home=home, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "gpulayer_runs" / job / "model.txt").read_text() == "weights"


def test_download_writes_nothing_through_a_link_nor_for_a_job_with_nothing(
    client: gpulayer.Client, home: Path, tmp_path: Path
) -> None:
    produced = client.submit(command=[PY, "-c", "open('o.txt', 'w').write('x')"], outputs=["o.txt"])
    empty = client.submit(command=[PY, "-c", "pass"])
    assert produced.wait(timeout=60) == empty.wait(timeout=60) == "succeeded"
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "link").symlink_to(victim)
    done = gl("download", produced.id, "--to", str(tmp_path / "link"), home=home)
    assert done.returncode == 2 and "is a symbolic link" in done.stderr
    assert list(victim.iterdir()) == []

    done = gl("download", empty.id, "--to", str(tmp_path / "dl-empty"), home=home)
    assert done.returncode == 2 and "has no outputs to download" in done.stderr
    assert "declared none" in done.stderr
    assert not (tmp_path / "dl-empty").exists()

    running = client.submit(command=SLEEP, outputs=["o.txt"])
    try:
        done = gl("download", running.id, "--to", str(tmp_path / "dl-run"), home=home)
        assert done.returncode == 2 and "once it has ended" in done.stderr
        assert not (tmp_path / "dl-run").exists()
    finally:
        running.cancel()


def gpulayer_jobs(home: Path) -> list[str]:
    """The ids of every job on the home, newest first."""
    with gpulayer.Client(home=home, auto_worker=False) as c:
        return [j.id for j in c.jobs()]


def test_rerun_runs_the_same_spec_again_as_a_new_job(home: Path, project: Path) -> None:
    ran = gl("run", str(project / "train.py"), "again", "--env", "A=b", "--label", "k=v", home=home)
    assert ran.returncode == 0, ran.stderr
    (first,) = gpulayer_jobs(home)
    (project / "helper.py").write_text("def greet(args):\n    return 'changed'\n")  # not shipped
    done = gl("rerun", first[:9], home=home)  # embedded: it follows the job
    assert done.returncode == 0, done.stderr
    new_id, *printed = done.stdout.splitlines()
    assert printed == ["hello again"]  # the bundle as it was, not the edited source
    assert f"a rerun of {first}" in done.stderr
    assert gpulayer_jobs(home) == [new_id, first]
    with gpulayer.Client(home=home, auto_worker=False) as c:
        old, new = c.job(first).info.spec, c.job(new_id).info.spec
    assert new == old and new.env == {"A": "b"} and new.labels == {"k": "v"}


def test_rerun_of_a_job_with_secrets_needs_them_given_again(
    client: gpulayer.Client, home: Path
) -> None:
    code = "import os; print(len(os.environ['API_TOKEN']))"
    job = client.submit(command=[PY, "-c", code], secrets={"API_TOKEN": "hunter2-value"})
    assert job.wait(timeout=60) == "succeeded"
    refused = gl("rerun", job.id, home=home)
    assert refused.returncode == 2
    assert "API_TOKEN" in refused.stderr and "--secret" in refused.stderr
    assert "hunter2" not in refused.stderr + refused.stdout
    assert len(client.jobs()) == 1  # nothing submitted

    done = gl("rerun", job.id, "--secret", "API_TOKEN", home=home, env={"API_TOKEN": "four"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:] == ["4"]  # the value given now, not the old one
    assert len(client.jobs()) == 2
