"""One task on a worker, from its instruction to its reported end.

The steps, each timestamped for the job's timings:

1. prepare: a fresh workspace with the bundle and inputs (``workspace.py``);
2. launch: the process, in its own session and process group, with the
   task's GPUs visible and no others;
3. run: two reader threads ship stdout and stderr line by line; this thread
   waits for the exit (a blocking ``waitpid``, no polling); a timer ends the
   process tree at the timeout;
4. finish: stray processes left in the group are ended, the last log lines
   flushed, declared outputs stored, and the result reported.

Cancel and timeout end the whole process tree: SIGTERM, a grace period,
then SIGKILL (``process.terminate_tree``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

from .. import defaults
from ..artifacts import ArtifactStore
from ..jobs import Outcome, RunTask, TaskResult, TaskStarted
from ..transport import Transport
from .gpus import Vendor, visible_devices_env
from .logs import LogSender, TaskLog
from .process import process_create_time, spawn, terminate_tree
from .workspace import collect_outputs, prepare

log = logging.getLogger(__name__)


class TaskRun:
    def __init__(
        self,
        task: RunTask,
        *,
        worker_id: str,
        transport: Transport,
        logs: LogSender,
        cache: ArtifactStore,
        task_dir: Path,
        gpu_vendor: Vendor | None,
        kill_grace: float,
        acquired: float,
        on_done: Callable[[TaskRun], None],
    ) -> None:
        self.task = task
        self.worker_id = worker_id
        self.transport = transport
        self.logs = logs
        self.cache = cache
        self.dir = task_dir
        self.gpu_vendor = gpu_vendor
        self.kill_grace = kill_grace
        self.marks = {"acquired": acquired}
        self.on_done = on_done
        self._lock = threading.Lock()
        self._ending: Outcome | None = None  # why we are ending it early, if we are
        self._proc: subprocess.Popen[bytes] | None = None
        self._tasklog: TaskLog | None = None
        self._early: TaskResult | None = None  # the result when it never ran
        self._cwd = task_dir
        self._stderr_tail: deque[str] = deque(maxlen=defaults.STDERR_TAIL_LINES)
        self.thread = threading.Thread(
            target=self._run, name=f"gpulayer-task-{task.job_id}", daemon=True
        )

    @property
    def key(self) -> tuple[str, int]:
        return (self.task.job_id, self.task.attempt)

    def start(self) -> None:
        """Launch the task and watch it on its own thread.

        A task that needs nothing fetched (no bundle, no inputs) is launched
        right here, on the worker's dispatch thread: the process starts
        without waiting for a new thread to be scheduled first.
        """
        spec = self.task.spec
        if spec.bundle is None and not spec.inputs:
            self._launch_guarded()
        self.thread.start()

    def stop(self, why: Outcome) -> None:
        """End the task early: ``cancelled``, ``timed_out`` or ``lost``."""
        with self._lock:
            if self._ending is not None:
                return
            self._ending = why
            proc = self._proc
        if proc is not None:
            threading.Thread(
                target=terminate_tree, args=(proc,), kwargs={"grace": self.kill_grace}, daemon=True
            ).start()

    def _result(self, outcome: Outcome, **fields: object) -> TaskResult:
        return TaskResult(
            job_id=self.task.job_id,
            attempt=self.task.attempt,
            worker_id=self.worker_id,
            outcome=outcome,
            marks=self.marks,
            stderr_tail=list(self._stderr_tail),
            **fields,  # type: ignore[arg-type]
        )

    def _launch_guarded(self) -> None:
        self._tasklog = self.logs.open(self.task.job_id, self.task.attempt)
        try:
            self._proc = self._launch()
        except Exception as exc:  # prepare or spawn failed: the job could not run
            log.debug("task %s could not run", self.task.job_id, exc_info=True)
            self._early = self._result("error", error=f"{type(exc).__name__}: {exc}")

    def _run(self) -> None:
        if self._tasklog is None:
            self._launch_guarded()
        assert self._tasklog is not None
        result = self._early
        if result is None:
            try:
                result = self._supervise(self._tasklog)
            except Exception as exc:
                log.exception("task %s: supervising failed", self.task.job_id)
                result = self._result("error", error=f"{type(exc).__name__}: {exc}")
        self.logs.close_task(self._tasklog)
        try:
            self.transport.task_finished(result)
        finally:
            self.on_done(self)

    def _launch(self) -> subprocess.Popen[bytes] | None:
        """Prepare the workspace and start the process (None: ended before it started)."""
        spec = self.task.spec
        ws = prepare(self.task, self.dir, self.transport, self.cache)
        self._cwd = ws.cwd
        argv = (
            [sys.executable, spec.script, *spec.args]
            if spec.script
            else [*(spec.command or []), *spec.args]
        )
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # logs arrive as printed, not at exit
        env.update(spec.env)
        env.update(ws.env)
        env.update(visible_devices_env(self.gpu_vendor, self.task.gpus))
        env["GPULAYER_JOB_ID"] = self.task.job_id
        env["GPULAYER_ATTEMPT"] = str(self.task.attempt)
        self.marks["prepared"] = time.time()
        with self._lock:
            if self._ending is not None:
                self._early = self._result(self._ending)
                return None
            proc = spawn(argv, cwd=ws.cwd, env=env)
            self._proc = proc
        self.marks["started"] = time.time()
        return proc

    def _supervise(self, tasklog: TaskLog) -> TaskResult:
        proc = self._proc
        assert isinstance(proc, subprocess.Popen)
        spec = self.task.spec
        readers = [
            threading.Thread(target=self._pump, args=(proc.stdout, "stdout", tasklog), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, "stderr", tasklog), daemon=True),
        ]
        for reader in readers:
            reader.start()
        timer = None
        if spec.timeout is not None:
            timer = threading.Timer(spec.timeout, self.stop, args=("timed_out",))
            timer.daemon = True
            timer.start()
        self.transport.task_started(
            TaskStarted(
                job_id=self.task.job_id,
                attempt=self.task.attempt,
                worker_id=self.worker_id,
                acquired=self.marks["acquired"],
                prepared=self.marks["prepared"],
                started=self.marks["started"],
                pid=proc.pid,
                pid_created=process_create_time(proc.pid),
            )
        )
        code = proc.wait()
        self.marks["exited"] = time.time()
        if timer is not None:
            timer.cancel()
        self._end_strays(proc.pid, readers)
        outputs, missing = collect_outputs(spec.outputs, self._cwd, self.transport)
        with self._lock:
            ending = self._ending
        return self._result(
            ending or "exited", exit_code=code, outputs=outputs, missing_outputs=missing
        )

    def _end_strays(self, pgid: int, readers: list[threading.Thread]) -> None:
        """The main process is gone; end what it left in its group, then drain the pipes."""
        with contextlib.suppress(ProcessLookupError):  # the usual case: nothing left behind
            os.killpg(pgid, signal.SIGTERM)
        for reader in readers:
            reader.join(defaults.PIPE_DRAIN_S)
        if any(r.is_alive() for r in readers):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            for reader in readers:
                reader.join(defaults.PIPE_DRAIN_S)

    def _pump(self, pipe: IO[bytes], stream: str, tasklog: TaskLog) -> None:
        limit = defaults.LOG_LINE_MAX_BYTES
        tail = self._stderr_tail if stream == "stderr" else None
        skipping = False
        with pipe:
            for raw in iter(lambda: pipe.readline(limit), b""):
                if skipping:  # the rest of a line that was too long
                    skipping = not raw.endswith(b"\n")
                    continue
                text = raw.decode("utf-8", "replace").rstrip("\n").rstrip("\r")
                if len(raw) >= limit and not raw.endswith(b"\n"):
                    skipping = True
                    text += f" [gpulayer: line cut at {limit} bytes]"
                tasklog.add(stream, text)
                if tail is not None:
                    tail.append(text)
