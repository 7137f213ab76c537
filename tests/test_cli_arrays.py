"""`gpulayer run --array`, `jobs` (one row, tasks by state), `show`, `logs`
and `cancel` of an array or of one task (JOB:7), in real subprocesses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gpulayer
from test_cli_actions import gl

PY = sys.executable


def test_run_array_runs_each_index_and_jobs_shows_it_as_one_row(home: Path) -> None:
    done = gl(
        "run", "--array", "1-4%2", "--", "sh", "-c", 'echo "task $GPULAYER_ARRAY_INDEX"', home=home
    )
    assert done.returncode == 0, done.stderr
    assert "4 tasks (1-4), at most 2 at once" in done.stderr
    assert "4 succeeded" in done.stderr
    listed = json.loads(gl("jobs", "--json", home=home).stdout)
    assert len(listed) == 1
    (array,) = listed
    assert array["state"] == "succeeded"
    assert array["array"] == {
        "size": 4,
        "indices": [1, 2, 3, 4],
        "max_parallel": 2,
        "tasks": {"succeeded": 4},
    }
    table = gl("jobs", home=home).stdout
    assert "4 succeeded" in table and "[4 tasks]" in table
    tasks = json.loads(gl("jobs", "--array", array["id"][:8], "--json", home=home).stdout)
    assert [t["array_task"] for t in tasks] == [
        {"array": array["id"], "index": i} for i in (1, 2, 3, 4)
    ]
    one = gl("logs", f"{array['id'][:8]}:3", home=home)
    assert one.returncode == 0 and one.stdout == "task 3\n", one.stderr
    every = gl("logs", array["id"], home=home)
    assert every.stdout.splitlines() == [f"[{i}] task {i}" for i in (1, 2, 3, 4)]
    shown = gl("show", array["id"], home=home).stdout
    assert "4 tasks (1-4), at most 2 at once" in shown
    follow = gl("logs", "-f", array["id"], home=home)
    assert follow.returncode == 2 and f"follow one of its tasks ({array['id']}:1)" in follow.stderr


def test_a_failing_task_fails_the_array_and_run_exits_non_zero(home: Path) -> None:
    done = gl("run", "--array", "0,1", "--", "sh", "-c", 'exit "$GPULAYER_ARRAY_INDEX"', home=home)
    assert done.returncode == 1, done.stderr
    assert "1 of 2 tasks did not succeed (1 succeeded, 1 failed)" in done.stderr


def test_bad_array_words_are_refused_and_nothing_is_stored(home: Path) -> None:
    for words, said in (
        ("0-x", "'0-x' is neither an index nor a range"),
        ("5-1", "ends before it starts"),
        ("0-3%0", "after % comes how many tasks may run at once"),
    ):
        done = gl("run", "--array", words, "--", "true", home=home)
        assert done.returncode != 0 and said in done.stderr, done.stderr
    both = gl("run", "--array", "0-3%2", "--max-parallel", "3", "--", "true", home=home)
    assert "3 here, but the array says %2" in both.stderr
    assert json.loads(gl("jobs", "--json", home=home).stdout) == []
    missing = gl("logs", "0123456789abcd:x", home=home)
    assert missing.returncode != 0 and "as in 1m8tw4bp:7" in missing.stderr


def test_cancel_of_an_array_from_another_process_cancels_its_tasks(
    client: gpulayer.Client, home: Path
) -> None:
    array = client.submit(
        command=[PY, "-c", "import time; time.sleep(60)"], array=range(4), max_parallel=1
    )
    done = gl("cancel", array.id, home=home)
    assert done.returncode == 0, done.stderr
    assert array.wait(timeout=60) == "cancelled"
    states = {t.info.state for t in client.jobs(array=array)}
    assert states == {"cancelled"}
