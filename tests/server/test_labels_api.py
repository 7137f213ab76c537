"""Jobs by label against a real server: listing, cancelling, checked filters;
and `download` and `rerun` of a detached job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from server.conftest import ServerProc

PY = sys.executable
# Characters that would matter to SQL, JSON, a JSON path or a query string.
HOSTILE = "x' OR '1'='1\" ]}$.*&label=team=a%"


def gl(
    server: ServerProc, token: str, *args: str, home: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPULAYER_TOKEN": token, "COLUMNS": "200"}
    if home is None:
        env["GPULAYER_SERVER"] = server.url
    else:  # embedded, on its own home
        env.pop("GPULAYER_SERVER", None)
        env["GPULAYER_HOME"] = str(home)
    return subprocess.run(
        [PY, "-m", "gpulayer.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def get(url: str, token: str) -> tuple[int, dict[str, object] | list[object]]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_label_filter_lists_only_the_callers_jobs_with_every_label(server: ServerProc) -> None:
    carol, dave = server.token("user", "carol"), server.token("user", "dave")
    with server.client(carol) as c, server.client(dave) as d, server.client() as admin:
        both = c.submit(command=["true"], labels={"team": "a", "run": "1"}).id
        team = c.submit(command=["true"], labels={"team": "a"}).id
        odd = c.submit(command=["true"], labels={"team": HOSTILE, "q": "a=b&c"}).id
        daves = d.submit(command=["true"], labels={"team": "a", "run": "1"}).id

        def ids(client: object, **labels: str) -> list[str]:
            return [j.id for j in client.jobs(labels=labels)]  # type: ignore[attr-defined]

        assert ids(c, team="a") == [team, both]  # newest first, only carol's
        assert ids(c, team="a", run="1") == [both]
        assert ids(d, team="a") == [daves]
        assert sorted(ids(admin, team="a", run="1")) == sorted([both, daves])
        # Matched exactly as given, never read as SQL, a JSON path or more query.
        assert ids(c, team=HOSTILE) == [odd] and ids(c, q="a=b&c") == [odd]
        assert ids(c, team="a' OR '1'='1") == [] and ids(c, team="A") == []
        assert ids(c, **{HOSTILE: "a"}) == [] and ids(d, team=HOSTILE) == []


def test_filters_are_checked_in_the_same_words_embedded_and_against_a_server(
    server: ServerProc, tmp_path: Path
) -> None:
    jobs = f"{server.url}/api/v1/jobs"
    for query, words in (
        ("label=team", "query parameter label takes KEY=VALUE, got 'team'"),
        ("label=%3Da", "query parameter label takes KEY=VALUE"),
        ("label=a%3D1&label=a%3D2", "given twice"),
        (
            "label=" + urllib.parse.quote("k=" + "v" * 300),
            "its value has 300 characters; a label's value has at most 256",
        ),
        ("state=finished", "unknown state 'finished'; states are: queued, running"),
    ):
        status, body = get(f"{jobs}?{query}", server.admin)
        assert status == 422 and words in str(body), (query, body)
    said = {
        where: gl(server, server.admin, "jobs", "--state", "finished", home=home)
        for where, home in (("server", None), ("embedded", tmp_path / "home"))
    }
    for done in said.values():
        assert done.returncode == 2 and done.stdout == ""
    assert said["server"].stderr == said["embedded"].stderr
    assert "unknown state 'finished'; states are: queued" in said["server"].stderr


def test_cancel_by_label_against_a_server_ends_only_the_callers_jobs(server: ServerProc) -> None:
    carol, dave = server.token("user", "carol"), server.token("user", "dave")
    with server.client(carol) as c, server.client(dave) as d:  # no worker: they stay queued
        hers = [c.submit(command=["true"], labels={"team": "a"}) for _ in range(2)]
        kept = c.submit(command=["true"], labels={"team": "b"})
        his = d.submit(command=["true"], labels={"team": "a"})
        done = gl(server, carol, "cancel", "--label", "team=a")
        assert done.returncode == 0, done.stderr
        assert "cancelled 2 job(s) labelled team=a" in done.stderr
        assert [j.status for j in hers] == ["cancelled", "cancelled"]
        assert kept.status == "queued" and his.status == "queued"
        # Another user's job, by its id: as if there were none, and untouched.
        done = gl(server, carol, "cancel", his.id, kept.id)
        assert done.returncode == 1 and f"no job with id {his.id!r}" in done.stderr
        assert his.status == "queued" and kept.status == "cancelled"


def test_download_and_rerun_a_detached_job(server: ServerProc, tmp_path: Path) -> None:
    server.start_worker(tmp_path / "w1")
    code = "open('o.txt', 'w').write('made'); print('ran')"
    run = ["run", "--detach", "--output", "o.txt", "--label", "k=v", "--", PY, "-c", code]
    done = gl(server, server.admin, *run, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    with server.client() as client:
        assert client.job(job_id).wait(timeout=60) == "succeeded"
        done = gl(server, server.admin, "download", job_id, "--to", str(tmp_path / "dl"))
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "dl" / "o.txt").read_text() == "made"
        assert "ran" in (tmp_path / "dl" / "logs.txt").read_text()

        done = gl(server, server.admin, "rerun", job_id)  # a server's: detached by default
        assert done.returncode == 0, done.stderr
        again = client.job(done.stdout.strip())
        assert again.id != job_id and again.wait(timeout=60) == "succeeded"
        assert again.info.spec == client.job(job_id).info.spec
        deadline = time.monotonic() + 30
        while [j.id for j in client.jobs(labels={"k": "v"})] != [again.id, job_id]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
