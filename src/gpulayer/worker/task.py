"""One task on a worker, from its instruction to its reported end.

The steps, each timestamped for the job's timings:

1. prepare: a fresh workspace with the bundle and inputs (``workspace.py``);
2. launch: the process, in its own session and process group, with the
   task's GPUs visible and no others;
3. run: this thread watches the pipes, the exit and the deadline at once
   (``watch.py``), shipping output line by line; at the timeout it ends the
   process tree;
4. finish: stray processes left in the group are ended, the last log lines
   flushed, declared outputs stored, and the result reported.

Cancel and timeout end the whole process tree: SIGTERM, a grace period,
then SIGKILL (``process.terminate_tree``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from .. import defaults
from ..artifacts import ArtifactStore
from ..errors import ServerUnreachable
from ..jobs import Outcome, RunTask, TaskResult, TaskStarted
from ..spec import ArtifactRef
from ..transport import Transport
from .gpus import Vendor, visible_devices_env
from .logs import LogSender, TaskLog
from .process import process_create_time, spawn, terminate_tree
from .watch import watch
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
        base_env: dict[bytes, bytes],
        kill_grace: float,
        acquired: float,
        on_done: Callable[[TaskRun], None],
        report: Callable[[Callable[[], None]], None] = lambda deliver: deliver(),
        defer_started: float | None = None,
    ) -> None:
        self.task = task
        self.worker_id = worker_id
        self.transport = transport
        self.logs = logs
        self.cache = cache
        self.dir = task_dir
        self.gpu_vendor = gpu_vendor
        self.base_env = base_env
        self.kill_grace = kill_grace
        self.marks = {"acquired": acquired}
        self.on_done = on_done
        self.report = report  # delivers a report now, or later if the server is away
        # Over a network, a task's start is reported only once it has run this
        # long (a short task's start goes with its end: one request fewer).
        # In-process it is reported at once: the pid in the store is what lets
        # a crashed control plane's successor end the task's processes.
        self.defer_started = defer_started
        self._lock = threading.Lock()
        self._ending: Outcome | None = None  # why we are ending it early, if we are
        self._proc: subprocess.Popen[bytes] | None = None
        self._tasklog: TaskLog | None = None
        self._early: TaskResult | None = None  # the result when it never ran
        self._terminator: threading.Thread | None = None  # ending the tree on cancel/timeout
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
            self._terminator = threading.Thread(
                target=terminate_tree, args=(proc,), kwargs={"grace": self.kill_grace}, daemon=True
            )
            self._terminator.start()

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
        if self._terminator is not None:
            # Report "cancelled" only once the whole tree is gone.
            self._terminator.join()
        tasklog = self._tasklog
        self.logs.close_task(tasklog)
        if tasklog.pending:  # the server is away: its last lines go before its result
            self.report(lambda: self.logs.deliver_rest(tasklog))
        try:
            self.report(lambda: self.transport.task_finished(result))
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
        # Bytes end to end: decoding the worker's whole environment and
        # encoding it back for every task cost more than the rest of the launch.
        env = self.base_env.copy()
        env.setdefault(b"PYTHONUNBUFFERED", b"1")  # logs arrive as printed, not at exit
        for extra in (
            spec.env,
            ws.env,
            visible_devices_env(self.gpu_vendor, self.task.gpus),
            {"GPULAYER_JOB_ID": self.task.job_id, "GPULAYER_ATTEMPT": str(self.task.attempt)},
        ):
            for key, value in extra.items():
                env[os.fsencode(key)] = os.fsencode(value)
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
        started = TaskStarted(
            job_id=self.task.job_id,
            attempt=self.task.attempt,
            worker_id=self.worker_id,
            acquired=self.marks["acquired"],
            prepared=self.marks["prepared"],
            started=self.marks["started"],
            pid=proc.pid,
            pid_created=process_create_time(proc.pid),
        )

        def report_started() -> None:
            self.report(lambda: self.transport.task_started(started))

        if self.defer_started is None:
            report_started()
        tail = self._stderr_tail

        def emit(stream: str, text: str) -> None:
            tasklog.add(stream, text)
            if stream == "stderr":
                tail.append(text)

        deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
        code, exited = watch(
            proc,
            emit,
            deadline=deadline,
            on_deadline=lambda: self.stop("timed_out"),
            # A short task's start is told with its end, in the same report.
            still_running_at=None
            if self.defer_started is None
            else time.monotonic() + self.defer_started,
            on_still_running=report_started,
        )
        self.marks["exited"] = exited
        outputs, missing = self._collect_outputs()
        with self._lock:
            ending = self._ending
        return self._result(
            ending or "exited", exit_code=code, outputs=outputs, missing_outputs=missing
        )

    def _collect_outputs(self) -> tuple[dict[str, ArtifactRef], list[str]]:
        """Store the declared outputs, waiting out a server that is away."""
        backoff = 0.05
        deadline = time.monotonic() + defaults.OUTPUT_UPLOAD_PATIENCE_S
        while True:
            try:
                return collect_outputs(self.task.spec.outputs, self._cwd, self.transport)
            except ServerUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(backoff)  # retry backoff while the server is unreachable
                backoff = min(backoff * 2, defaults.RECONNECT_MAX_S)
