"""A process running an embedded control plane dies; the next one cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import gpulayer

from helpers import PY, pids_alive

CRASHER = """
import json, sys, gpulayer
client = gpulayer.Client()
client.ensure_local_workers(2)
code = "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); print('child', c.pid, flush=True); time.sleep(120)"
doomed = client.submit(command=[sys.executable, '-c', code], name='doomed')
retried = client.submit(command=[sys.executable, '-c', code], name='retried', max_retries=1)
waiting = client.submit(command=[sys.executable, '-c', 'print("ran later")'], name='waiting')
pids = []
for job in (doomed, retried):
    for line in job.stream_logs():
        if line.text.startswith('child'):
            pids.append(int(line.text.split()[1]))
            break
print(json.dumps({'doomed': doomed.id, 'retried': retried.id, 'waiting': waiting.id, 'grandchild': pids[0]}), flush=True)
sys.stdin.read()  # hold still until killed
"""


def crash(home: Path, script: str) -> dict[str, Any]:
    """Run ``script`` (an embedded GPUlayer process on ``home``) until it
    prints its JSON line, then SIGKILL it; that line, decoded."""
    env = {**os.environ, "GPULAYER_HOME": str(home)}
    with subprocess.Popen(
        [PY, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    ) as proc:
        try:
            assert proc.stdout is not None
            said: dict[str, Any] = json.loads(proc.stdout.readline())
        finally:
            proc.send_signal(signal.SIGKILL)
    return said


def test_a_crashed_embedded_process_is_recovered(home: Path) -> None:
    """Its jobs end lost, running or queued, retries left or not: the next
    process on the home ends their processes and runs none of them."""
    ids = crash(home, CRASHER)
    assert pids_alive(ids["grandchild"]), (
        "the job's process outlives its control plane until recovery"
    )

    with gpulayer.Client(home=home) as client:
        for name in ("doomed", "retried", "waiting"):
            job = client.job(ids[name])
            assert job.status == "lost", name
            assert "the GPUlayer process that submitted it ended" in (job.info.reason or "")
        assert "while it ran" in (client.job(ids["retried"]).info.reason or "")
        assert "before it started" in (client.job(ids["waiting"]).info.reason or "")
        # Its orphaned processes were ended, not left running.
        assert pids_alive(ids["grandchild"]) == []
        # Workers here run the jobs submitted here, and nothing left before.
        client.ensure_local_workers(2, kill_grace=0.5)
        mine = client.submit(command=[PY, "-c", "print('mine')"])
        assert mine.wait(timeout=60) == "succeeded"
        assert client.job(ids["waiting"]).logs() == ""
        assert client.job(ids["retried"]).info.attempt == 1


def test_jobs_left_by_a_dead_process_are_reported_once(home: Path) -> None:
    """The first command after the crash says which jobs it marked lost;
    the next says nothing: they are final, and no longer anyone's to take."""
    ids = crash(home, CRASHER)
    env = {**os.environ, "GPULAYER_HOME": str(home)}
    first = subprocess.run(
        [PY, "-m", "gpulayer.cli", "jobs"], capture_output=True, text=True, env=env, check=True
    )
    assert "3 job(s) of GPUlayer processes that ended before them are marked lost" in first.stderr
    assert ids["waiting"] in first.stderr
    again = subprocess.run(
        [PY, "-m", "gpulayer.cli", "jobs"], capture_output=True, text=True, env=env, check=True
    )
    assert "marked lost" not in again.stderr, again.stderr


def test_another_live_process_keeps_its_jobs(home: Path) -> None:
    with gpulayer.Client(home=home) as first:
        first.ensure_local_workers(1)
        job = first.submit(
            command=[PY, "-c", "import time; print('up', flush=True); time.sleep(60)"]
        )
        for line in job.stream_logs():
            if line.text == "up":
                break
        with gpulayer.Client(home=home) as second:
            # The second sees the job but does not take it over.
            assert second.job(job.id).status == "running"
            assert [w.id for w in second.workers()] == [w.id for w in first.workers()]
            # A cancel from another process ends it.
            second.job(job.id).cancel()
        assert job.wait(timeout=30) == "cancelled"


def test_a_job_queued_by_another_process_can_be_cancelled(home: Path) -> None:
    with gpulayer.Client(home=home, auto_worker=False) as owner:
        job = owner.submit(command=[PY, "-c", "print('must not run')"])
        with gpulayer.Client(home=home, auto_worker=False) as other:
            assert other.job(job.id).cancel() == "cancelled"
        # The owner would now place it; it must see the cancel instead.
        owner.ensure_local_workers(1)
        assert job.wait(timeout=30) == "cancelled"
        assert job.logs() == ""


GANG_CRASHER = """
import json, sys, gpulayer
client = gpulayer.Client()
client.ensure_local_workers(2)
code = "import os, time; print('ready', os.getpid(), flush=True); time.sleep(120)"
job = client.submit(command=[sys.executable, '-c', code], nodes=2, procs_per_node=2)
pids = []
for line in job.stream_logs():
    if line.text.startswith('ready'):
        pids.append(int(line.text.split()[1]))
        if len(pids) == 4:
            break
# In-process workers record a task's start before its first line is read,
# so both nodes' processes are in the store by now.
print(json.dumps({'job': job.id, 'pids': pids}), flush=True)
sys.stdin.read()  # hold still until killed
"""


def test_every_rank_of_a_crashed_distributed_job_is_ended(home: Path) -> None:
    ids = crash(home, GANG_CRASHER)
    assert len(pids_alive(*ids["pids"])) == 4
    with gpulayer.Client(home=home) as client:
        job = client.job(ids["job"])
        assert job.status == "lost"
        assert pids_alive(*ids["pids"]) == []
