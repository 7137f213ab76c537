"""Preemption (scheduler rule 9): a job marked preemptible is stopped for a
job of higher priority that cannot run otherwise, and queued again without
using a retry. Driven through the control plane, then end to end."""

from __future__ import annotations

import signal
from pathlib import Path

import gpulayer
from gpulayer.jobs import CancelTask, RunTask
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from teams_kit import gpu_worker, report


def test_a_preemptible_job_makes_room_and_runs_again_without_using_a_retry(
    plane: ControlPlane,
) -> None:
    w = gpu_worker(plane, 2)
    low = plane.submit(parse_spec({"command": ["train"], "gpus": 2, "preemptible": True}))
    (task,) = plane.take_instructions(w)
    assert isinstance(task, RunTask) and task.job_id == low.id
    urgent = plane.submit(parse_spec({"command": ["eval"], "gpus": 1, "priority": 5}))
    assert plane.take_instructions(w) == [CancelTask(job_id=low.id, attempt=1, preempt=True)]
    assert plane.get(urgent.id).state == "queued"
    # A job that is not preemptible, even of low priority, is never stopped:
    # and nothing is stopped twice.
    plane.submit(parse_spec({"command": ["x"], "gpus": 1, "priority": 9}))
    assert plane.take_instructions(w) == []
    # The worker stopped it (SIGTERM, grace): the job waits again, unfailed,
    # and the urgent job takes the room it left.
    report(plane, task, w, "preempted", -15)
    again = plane.get(low.id)
    assert again.state == "queued" and again.given_back == 1 and again.attempt == 1
    assert plane.get(urgent.id).state == "running"
    lines = [line.text for line in plane.read_logs(low.id).lines]
    assert f"gpulayer: attempt 1 preempted to make room for job {urgent.id}; " in lines[-1]


def test_a_cancel_wins_over_a_preemption(plane: ControlPlane) -> None:
    w = gpu_worker(plane, 1)
    low = plane.submit(parse_spec({"command": ["x"], "gpus": 1, "preemptible": True}))
    (task,) = plane.take_instructions(w)
    plane.submit(parse_spec({"command": ["y"], "gpus": 1, "priority": 1}))
    plane.cancel(low.id)
    assert isinstance(task, RunTask)
    report(plane, task, w, "preempted", -15)
    assert plane.get(low.id).state == "cancelled"


def test_a_preempted_script_gets_sigterm_with_notice_and_finishes_on_its_next_attempt(
    home: Path, tmp_path: Path
) -> None:
    root = tmp_path / "project"
    root.mkdir()
    # It says how much notice it has, and leaves cleanly on SIGTERM, once.
    (root / "long.py").write_text(
        "import os, signal, sys, time\n"
        "attempt = os.environ['GPULAYER_ATTEMPT']\n"
        "print('notice', os.environ.get('GPULAYER_PREEMPT_NOTICE'), 'attempt', attempt, flush=True)\n"
        "if attempt != '1':\n"
        "    sys.exit(0)\n"
        "def leave(signum, frame):\n"
        "    print('got SIGTERM', signum, flush=True)\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, leave)\n"
        "time.sleep(60)\n"
    )
    (root / "urgent.py").write_text("print('urgent ran')\n")
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(1, kill_grace=5)
        low = c.submit(root / "long.py", source=root, preemptible=True)
        next(iter(low.stream_logs(follow=True)))  # it runs, and said its notice
        urgent = c.submit(root / "urgent.py", source=root, priority=5)
        assert urgent.wait(timeout=60) == "succeeded"
        assert low.wait(timeout=60) == "succeeded"
        info = low.info
        text = [line.text for line in low.stream_logs(follow=False)]
    assert info.given_back == 1
    assert "notice 5 attempt 1" in text and f"got SIGTERM {int(signal.SIGTERM)}" in text
    assert "notice 5 attempt 2" in text
    assert any("preempted to make room for job" in t for t in text)
