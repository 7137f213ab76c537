"""What torch reads as it is imported, in a warm process: the same as cold
(issue 19, point 3). And, made certain, what the parity suites meet by
chance: a warm process that ends before its task watches it (a rank of
several, done while the next is started), or before its task has taken its
status socket; and objects whose attributes are looked at as a warm job ends
(the last two defects, for the lead: see helpers.py).

libgomp reads ``OMP_NUM_THREADS`` once, as torch loads it, so a process
forked from a zygote has the zygote's thread counts, whatever its own
environment says. A warm rank (``OMP_NUM_THREADS=1``, the direct launcher's)
and a warm job with its own ``OMP_NUM_THREADS`` must each come from a zygote
made for those values, and see what a cold start of theirs sees.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gpulayer
from gpulayer.worker import warm

from helpers import script_file

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not warm.supported(), reason="warm start needs Linux pidfds"),
]

# What each process (or rank) says of its threads, as one JSON line. The
# parallel_info text is torch's own account (omp_get_max_threads() at the C
# level, the variables it read, its backend).
THREADS = """\
import json, os
import torch

print(json.dumps({
    "rank": os.environ.get("RANK"),
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    "threads": torch.get_num_threads(),
    "interop": torch.get_num_interop_threads(),
    "parallel_info": torch.__config__.parallel_info(),
}), flush=True)
"""


@pytest.fixture
def warm_client(home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[gpulayer.Client]:
    """One worker whose zygotes (its own settings', its ranks') have
    imported torch before it serves."""
    monkeypatch.setenv("GPULAYER_WARM", "ready")
    monkeypatch.setenv("GPULAYER_PRELOAD", "torch,numpy")
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(1, kill_grace=0.5)
        yield c


def _all_ready(client: gpulayer.Client) -> None:
    """Wait for every zygote the worker has made (or begun) to be ready."""
    workers = client._embedded.workers  # type: ignore[union-attr]
    assert all(w._warm is not None and w._warm.wait_ready(120) for w in workers)


def _threads(job: gpulayer.Job) -> dict[int | None, dict[str, object]]:
    """Each rank's (or the one process's, under None) account of its threads."""
    assert job.wait(timeout=120) == "succeeded", job.logs()
    return {line.rank: json.loads(line.text) for line in job.stream_logs(follow=False)}


def test_a_warm_rank_has_a_cold_ranks_threads(warm_client: gpulayer.Client, tmp_path: Path) -> None:
    script = script_file(tmp_path, THREADS, "threads.py")
    cold = warm_client.submit(script, nodes=1, procs_per_node=2, warm=False)
    seen_cold = _threads(cold)
    hot = warm_client.submit(script, nodes=1, procs_per_node=2)
    seen_hot = _threads(hot)
    assert cold.refresh().start == "cold: the job asked for a cold start"
    assert hot.refresh().start == "warm", hot.info.start
    assert sorted(seen_hot) == [0, 1]
    assert seen_hot == seen_cold
    for rank, seen in seen_hot.items():
        assert seen["rank"] == str(rank)
        # The launcher's one thread per rank, in torch's pool as in the variable.
        assert (seen["OMP_NUM_THREADS"], seen["threads"]) == ("1", 1), seen
        assert "omp_get_max_threads() : 1" in str(seen["parallel_info"]), seen


# None: the worker's own settings' zygote; "1": its ranks' (ready at once,
# and one thread, not the machine's count, tells them apart); "3": one made
# for the job once it has run.
@pytest.mark.parametrize("threads", [None, "1", "3"])
def test_a_warm_job_has_its_own_thread_count(
    warm_client: gpulayer.Client, tmp_path: Path, threads: str | None
) -> None:
    script = script_file(tmp_path, THREADS, "threads.py")
    env = {} if threads is None else {"OMP_NUM_THREADS": threads}
    first = warm_client.submit(script, env=env)
    seen_first = _threads(first)
    if threads == "3":
        # No zygote of the worker's has read 3: this job starts cold, and
        # has one made for it once it has run.
        assert first.refresh().start is not None
        assert "OMP_NUM_THREADS=3" in first.info.start, first.info.start
        _all_ready(warm_client)
        zygotes = warm_client._embedded.workers[0]._warm.zygotes  # type: ignore[union-attr]
        assert [dict(z.key).get(b"OMP_NUM_THREADS") for z in zygotes].count(b"3") == 1
        hot = warm_client.submit(script, env=env)
        seen_hot = _threads(hot)
    else:
        hot, seen_hot = first, seen_first
    assert hot.refresh().start == "warm", hot.info.start
    cold = warm_client.submit(script, env=env, warm=False)
    seen_cold = _threads(cold)
    assert cold.refresh().start == "cold: the job asked for a cold start"
    assert seen_hot == seen_cold == seen_first
    (seen,) = seen_hot.values()
    assert seen["OMP_NUM_THREADS"] == threads
    if threads is not None:
        # torch takes at most the machine's cores (2 here: then 3 reads as 2).
        assert seen["threads"] == min(int(threads), os.cpu_count() or 1), seen


def test_a_warm_process_that_ends_before_it_is_watched_is_not_lost(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # What happens by chance to a quick rank 0 while rank 1 starts, or to a
    # quick script on a busy machine, made certain: the process has ended,
    # and its end been told by its zygote, before its task watches it (its
    # pidfd closed, exit_fd once failed and the task with it).
    monkeypatch.setenv("GPULAYER_WARM", "ready")
    release = warm.WarmProcess.release

    def release_and_end(self: warm.WarmProcess) -> None:
        release(self)
        assert self.wait(timeout=30) == 4

    monkeypatch.setattr(warm.WarmProcess, "release", release_and_end)
    script = script_file(tmp_path, "print('done')\nraise SystemExit(4)\n")
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1, kill_grace=0.5)
        job = client.submit(script)
        assert job.wait(timeout=60) == "failed"
        assert job.refresh().start == "warm"
        assert (job.info.exit_code, job.logs()) == (4, "done\n"), job.info.reason


def test_a_warm_job_ends_without_looking_into_its_objects(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # As torch.distributed.reduce_op, which warns when looked at: a cold
    # interpreter's exit never reads its attributes.
    monkeypatch.setenv("GPULAYER_WARM", "ready")
    loud = (
        "class Loud:\n"
        "    def __getattribute__(self, name):\n"
        "        print('looked at', name, flush=True)\n"
        "        return object.__getattribute__(self, name)\n"
        "\n"
        "kept = Loud()\n"
        "print('done')\n"
    )
    script = script_file(tmp_path, loud, "loud.py")
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1, kill_grace=0.5)
        cold = client.submit(script, warm=False)
        hot = client.submit(script)
        assert cold.wait(timeout=60) == hot.wait(timeout=60) == "succeeded"
        assert hot.refresh().start == "warm"
        assert cold.logs() == "done\n"
        assert hot.logs() == cold.logs()


def test_a_warm_process_that_ends_as_it_is_released_leaves_no_socket_open(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Made certain: the child said "go", ran, ended, and its zygote's report
    # of its end was handled, all before release() goes on.
    monkeypatch.setenv("GPULAYER_WARM", "ready")
    released: list[warm.WarmProcess] = []
    receive = warm.protocol.receive

    def receive_then_end(sock: socket.socket, *args: Any) -> Any:
        got = receive(sock, *args)
        caller = sys._getframe(1)
        child = caller.f_locals.get("self")
        if caller.f_code.co_name == "release" and isinstance(child, warm.WarmProcess):
            released.append(child)
            assert child._exited.wait(30)  # its end handled (WarmProcess._ended)
        return got

    monkeypatch.setattr(warm.protocol, "receive", receive_then_end)
    script = script_file(tmp_path, "print('done')\n")
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1, kill_grace=0.5)
        job = client.submit(script)
        assert job.wait(timeout=60) == "succeeded"
        assert job.refresh().start == "warm" and job.logs() == "done\n"
    # The worker has stopped: every socket of its tasks' closed by now.
    (child,) = released
    status = child._status
    left_open = status is not None and status.fileno() != -1
    if status is not None:
        status.close()  # not left for the collector to warn of
    assert not left_open, "its status socket is still open"
