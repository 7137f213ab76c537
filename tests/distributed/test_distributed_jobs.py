"""Distributed jobs end to end, embedded: N tasks on N workers, their ranks
wired up by the direct launcher or torchrun, real processes throughout.

Every test runs twice (the ``start``/``torch_start`` fixtures): every rank
cold, and every direct-launcher rank forked from its worker's zygote, which
each test checks in the job's record (torchrun's ranks are always cold).
The jobs are scripts, not ``python -c`` commands, so that they can start warm.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer

from helpers import (
    ALLREDUCE,
    Start,
    pids_alive,
    run_2x2_allreduce,
    script_file,
)

LAUNCHERS = ["direct", "torchrun"]
# Why a torchrun job starts cold even where the workers start jobs warm.
TORCHRUN = "torchrun starts the ranks"

# Each rank prints its wiring as one JSON line.
PRINT_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k in "
    "('RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','NODE_RANK','GROUP_RANK',"
    "'MASTER_ADDR','MASTER_PORT','OMP_NUM_THREADS') or k.startswith('TORCHELASTIC')}))\n"
)
# Each rank says it is ready with its pid, then blocks until ended; the
# rank named by FAIL_RANK fails once the test opens the FIFO it waits on.
HOLD = (
    "import os, sys, time\n"
    "print('ready', os.getpid(), flush=True)\n"
    "if os.environ['RANK'] == os.environ.get('FAIL_RANK'):\n"
    "    open(sys.argv[1]).read()\n"
    "    print('rank', os.environ['RANK'], 'gives up', file=sys.stderr, flush=True)\n"
    "    sys.exit(3)\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def cluster(home: Path) -> Iterator[gpulayer.Client]:
    """Two one-slot workers: one node each (ask for a start fixture first)."""
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(2, kill_grace=0.5)
        yield c


def ready_pids(job: gpulayer.Job, count: int) -> list[int]:
    pids = []
    for line in job.stream_logs(follow=True):
        if line.text.startswith("ready"):
            pids.append(int(line.text.split()[1]))
            if len(pids) == count:
                return pids
    raise AssertionError(f"job ended ({job.status}) before {count} ranks were ready:\n{job.logs()}")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_rank_gets_its_wiring(
    start: Start, cluster: gpulayer.Client, launcher: str, tmp_path: Path
) -> None:
    job = cluster.submit(
        script_file(tmp_path, PRINT_ENV), nodes=2, procs_per_node=2, launcher=launcher
    )
    assert job.wait(timeout=60) == "succeeded", job.logs()
    start.check(job, cold_because=TORCHRUN if launcher == "torchrun" else None)
    # Each rank's line; torchrun's agents may add warnings of their own (a
    # store closed as the other node's agent left).
    seen = {
        line.rank: json.loads(line.text)
        for line in job.stream_logs(follow=False)
        if line.text.startswith("{")
    }
    assert sorted(seen) == [0, 1, 2, 3]
    ports = {env["MASTER_PORT"] for env in seen.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for rank, env in seen.items():
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank % 2)
        # Both launchers: torchrun sets GROUP_RANK, the worker NODE_RANK.
        assert env["NODE_RANK"] == env["GROUP_RANK"] == str(rank // 2), env
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["OMP_NUM_THREADS"] == "1"
        elastic = [k for k in env if k.startswith("TORCHELASTIC")]
        assert bool(elastic) == (launcher == "torchrun"), elastic
    info = job.refresh()
    assert [t.node for t in info.tasks] == [0, 1]
    assert len({t.worker for t in info.tasks}) == 2  # distinct workers
    assert "[rank 3] {" in job.logs()


def test_the_jobs_own_thread_count_is_kept(
    start: Start, cluster: gpulayer.Client, tmp_path: Path
) -> None:
    job = cluster.submit(
        script_file(tmp_path, PRINT_ENV), nodes=1, procs_per_node=2, env={"OMP_NUM_THREADS": "3"}
    )
    assert job.wait(timeout=60) == "succeeded", job.logs()
    # No zygote was made for 3 threads yet (tests/distributed/test_warm_ranks.py).
    start.check(job, cold_because="OMP_NUM_THREADS=3")
    seen = [json.loads(line.text) for line in job.stream_logs(follow=False)]
    assert [env["OMP_NUM_THREADS"] for env in seen] == ["3", "3"]
    assert {env["MASTER_ADDR"] for env in seen} == {"127.0.0.1"}


def test_a_2x2_gloo_all_reduce(
    torch_start: Start, cluster: gpulayer.Client, tmp_path: Path
) -> None:
    job = run_2x2_allreduce(cluster, tmp_path / "out", "direct")
    torch_start.check(job)  # warm: gloo in a fork of a zygote that imported torch


def test_a_2x2_gloo_all_reduce_under_torchrun(
    start: Start, cluster: gpulayer.Client, tmp_path: Path
) -> None:
    # torchrun's ranks never fork from a zygote: one that preloads torch
    # would only cost seconds here.
    job = run_2x2_allreduce(cluster, tmp_path / "out", "torchrun")
    start.check(job, cold_because=TORCHRUN)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_fails_the_job_and_ends_every_rank(
    start: Start, cluster: gpulayer.Client, launcher: str, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    os.mkfifo(go)
    job = cluster.submit(
        script_file(tmp_path, HOLD),
        [str(go)],
        nodes=2,
        procs_per_node=2,
        launcher=launcher,
        env={"FAIL_RANK": "3"},
    )
    pids = ready_pids(job, 4)
    with open(go, "w") as fifo:
        fifo.write("go")
    assert job.wait(timeout=120) == "failed", job.logs()
    info = job.refresh()
    assert info.exit_code == 3
    assert info.reason is not None
    assert info.reason.startswith("rank 3 (node 1"), info.reason
    assert "exited with code 3" in info.reason
    assert "rank 3 gives up" in info.reason
    assert pids_alive(*pids) == []
    start.check(job, cold_because=TORCHRUN if launcher == "torchrun" else None)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_cancel_reaches_every_node(
    start: Start, cluster: gpulayer.Client, tmp_path: Path, launcher: str
) -> None:
    job = cluster.submit(
        script_file(tmp_path, HOLD), [str(tmp_path)], nodes=2, procs_per_node=2, launcher=launcher
    )
    pids = ready_pids(job, 4)
    assert job.cancel() in ("running", "cancelled")
    assert job.wait(timeout=30) == "cancelled"
    assert pids_alive(*pids) == []
    start.check(job, cold_because=TORCHRUN if launcher == "torchrun" else None)


def test_a_gang_that_cannot_fit_waits_without_holding_slots(
    start: Start, cluster: gpulayer.Client, tmp_path: Path
) -> None:
    blocker = cluster.submit(script_file(tmp_path, HOLD), [str(tmp_path)], env={"RANK": "0"})
    ready_pids(blocker, 1)
    gang = cluster.submit(script_file(tmp_path, PRINT_ENV, "env.py"), nodes=2)
    info = gang.refresh()
    assert info.state == "queued"
    assert info.reason is not None and "2 workers" in info.reason
    busy = {w.id: w.running for w in cluster.workers()}
    assert sorted(len(r) for r in busy.values()) == [0, 1]  # the free worker holds nothing
    blocker.cancel()
    assert gang.wait(timeout=60) == "succeeded", gang.logs()
    start.check(blocker)
    start.check(gang)


def test_two_distributed_jobs_at_once_get_distinct_working_ports(start: Start, home: Path) -> None:
    # Zygotes that preload nothing: eight that import torch (two for each
    # of four workers) would cost more than the test; gloo in a fork of one
    # that did is test_a_2x2_gloo_all_reduce's. Here the ranks import torch
    # after the fork, which shows a defect: a warning after each rank's line.
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(4)
        jobs = [
            c.submit(str(ALLREDUCE), args=["sum.json"], nodes=2, launcher="direct")
            for _ in range(2)
        ]
        ports = set()
        for job in jobs:
            assert job.wait(timeout=120) == "succeeded", job.logs()
            said = [line.text.split() for line in job.stream_logs(follow=False)]
            assert sorted(words[:4] for words in said) == [
                ["rank", "0/2", "sum", "3"],
                ["rank", "1/2", "sum", "3"],
            ]
            ports |= {words[-1] for words in said}
            start.check(job)
        assert len(ports) == 2  # one port per job, each shared by its ranks
