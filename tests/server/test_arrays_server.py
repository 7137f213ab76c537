"""Arrays against a real server: one request submits 10,000 tasks; tasks run
on a worker, JOB:7 names one over HTTP; another user sees none of it."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

import pytest
from test_labels_api import get

from gpulayer.errors import JobNotFoundError
from server.conftest import ServerProc


def test_an_array_runs_on_a_worker_and_its_tasks_are_named_job_colon_index(
    server: ServerProc, tmp_path: Path
) -> None:
    carol, dave = server.token("user", "carol"), server.token("user", "dave")
    server.start_worker(tmp_path / "w", slots=2)
    with server.client(carol) as c, server.client(dave) as d:
        array = c.submit(
            command=["sh", "-c", "echo $GPULAYER_ARRAY_INDEX"], array="0-5%2", name="sweep"
        )
        assert array.wait(timeout=120) == "succeeded"
        assert array.info.array_states == {"succeeded": 6}
        task = c.job(f"{array.id}:4")
        assert task.logs() == "4\n"
        assert [j.id for j in c.jobs()] == [array.id]
        assert len(c.jobs(array=array.id)) == 6
        with pytest.raises(JobNotFoundError):
            d.job(f"{array.id}:4")
        with pytest.raises(JobNotFoundError):
            d.jobs(array=array.id)
        assert d.jobs() == []
    # The raw query: one array only, and a task's name quoted in the path.
    status, body = get(f"{server.url}/api/v1/jobs?array={array.id}&array={array.id}", carol)
    assert status == 422 and "give one array" in str(body)
    status, body = get(f"{server.url}/api/v1/jobs/{urllib.parse.quote(array.id + ':4')}", carol)
    assert status == 200 and body["id"] == task.id  # type: ignore[index]


def test_a_ten_thousand_task_array_is_one_request_and_one_cancel(server: ServerProc) -> None:
    # (How long it takes is benchmarks/arrays.py's to measure.)
    with server.client(server.token("user", "carol")) as c:
        array = c.submit(command=["true"], array=range(10_000), max_parallel=8)
        assert array.info.state == "queued"  # no worker yet
        assert c.job(array.id).info.array_states == {"queued": 10_000}
        array.cancel()
        assert array.wait(timeout=60) == "cancelled"
        assert c.job(array.id).info.array_states == {"cancelled": 10_000}
