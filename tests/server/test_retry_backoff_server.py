"""A retry's back-off against a real server: it holds through a restart, and
the line marking the new attempt reaches a follower."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from server.conftest import ServerProc

PY = sys.executable
# Fails its first attempt, succeeds on the next.
FLAKY = "import os, sys; print('attempt', os.environ['GPULAYER_ATTEMPT']); sys.exit(os.environ['GPULAYER_ATTEMPT'] == '1')"


def test_a_back_off_holds_through_a_server_restart(server: ServerProc, tmp_path: Path) -> None:
    server.start_worker(tmp_path / "w1")
    with server.client() as client:
        job = client.submit(command=[PY, "-c", FLAKY], max_retries=1, retry_delay=4.0)
        deadline = time.monotonic() + 60
        while "retry_at" not in job.refresh().marks:  # its first attempt failed
            assert time.monotonic() < deadline, job.info
            time.sleep(0.05)
        retry_at = job.info.marks["retry_at"]
        assert job.info.state == "queued" and "back-off" in (job.info.reason or "")
        server.kill(signal.SIGKILL)
        server.proc = None
        server.start()  # same home, same port; its worker registers again meanwhile
        assert job.wait(timeout=90) == "succeeded"
        # Placed again only once the back-off it was given before the restart ended.
        assert job.info.attempt == 2 and job.info.marks["placed"] >= retry_at
        texts = [line.text for line in job.stream_logs(follow=False)]
    assert texts == [
        "attempt 1",
        "gpulayer: attempt 2 of 2 (after: exited with code 1), waiting 4.0 s",
        "attempt 2",
    ]
