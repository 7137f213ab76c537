"""Distributed jobs end to end, embedded: N tasks on N workers, their ranks
wired up by the direct launcher or torchrun, real processes throughout."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer

from helpers import ALLREDUCE, PY, pids_alive, run_2x2_allreduce

LAUNCHERS = ["direct", "torchrun"]

# Each rank prints its wiring as one JSON line.
PRINT_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k in "
    "('RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','NODE_RANK','MASTER_ADDR',"
    "'MASTER_PORT','OMP_NUM_THREADS') or k.startswith('TORCHELASTIC')}))"
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
    """Two one-slot workers: one node each."""
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


def test_every_rank_gets_its_wiring(cluster: gpulayer.Client) -> None:
    job = cluster.submit(command=[PY, "-c", PRINT_ENV], nodes=2, procs_per_node=2)
    assert job.wait(timeout=60) == "succeeded", job.logs()
    seen = {line.rank: json.loads(line.text) for line in job.stream_logs(follow=False)}
    assert sorted(seen) == [0, 1, 2, 3]
    ports = {env["MASTER_PORT"] for env in seen.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for rank, env in seen.items():
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank % 2)
        assert env["NODE_RANK"] == str(rank // 2)
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["OMP_NUM_THREADS"] == "1"
        assert not [k for k in env if k.startswith("TORCHELASTIC")]
    info = job.refresh()
    assert [t.node for t in info.tasks] == [0, 1]
    assert len({t.worker for t in info.tasks}) == 2  # distinct workers
    assert "[rank 3] {" in job.logs()


def test_the_jobs_own_thread_count_is_kept(cluster: gpulayer.Client) -> None:
    job = cluster.submit(
        command=[PY, "-c", PRINT_ENV], nodes=1, procs_per_node=2, env={"OMP_NUM_THREADS": "3"}
    )
    assert job.wait(timeout=60) == "succeeded", job.logs()
    seen = [json.loads(line.text) for line in job.stream_logs(follow=False)]
    assert [env["OMP_NUM_THREADS"] for env in seen] == ["3", "3"]
    assert {env["MASTER_ADDR"] for env in seen} == {"127.0.0.1"}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_2x2_gloo_all_reduce(cluster: gpulayer.Client, launcher: str, tmp_path: Path) -> None:
    run_2x2_allreduce(cluster, tmp_path / "out", launcher)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_fails_the_job_and_ends_every_rank(
    cluster: gpulayer.Client, launcher: str, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    os.mkfifo(go)
    job = cluster.submit(
        command=[PY, "-c", HOLD, str(go)],
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


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_cancel_reaches_every_node(cluster: gpulayer.Client, tmp_path: Path, launcher: str) -> None:
    job = cluster.submit(
        command=[PY, "-c", HOLD, str(tmp_path)], nodes=2, procs_per_node=2, launcher=launcher
    )
    pids = ready_pids(job, 4)
    assert job.cancel() in ("running", "cancelled")
    assert job.wait(timeout=30) == "cancelled"
    assert pids_alive(*pids) == []


def test_a_gang_that_cannot_fit_waits_without_holding_slots(
    cluster: gpulayer.Client, tmp_path: Path
) -> None:
    blocker = cluster.submit(command=[PY, "-c", HOLD, str(tmp_path)], env={"RANK": "0"})
    ready_pids(blocker, 1)
    gang = cluster.submit(command=[PY, "-c", PRINT_ENV], nodes=2)
    info = gang.refresh()
    assert info.state == "queued"
    assert info.reason is not None and "2 workers" in info.reason
    busy = {w.id: w.running for w in cluster.workers()}
    assert sorted(len(r) for r in busy.values()) == [0, 1]  # the free worker holds nothing
    blocker.cancel()
    assert gang.wait(timeout=60) == "succeeded", gang.logs()


def test_two_distributed_jobs_at_once_get_distinct_working_ports(home: Path) -> None:
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
        assert len(ports) == 2  # one port per job, each shared by its ranks
