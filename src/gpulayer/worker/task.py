"""One task on a worker, from its instruction to its reported end.

The steps, each timestamped for the job's timings:

1. prepare: a fresh workspace with the bundle and inputs (``workspace.py``),
   made the job's user's where the worker runs jobs as another user;
2. launch: the process, in its own session and process group, with the
   task's GPUs visible and no others, in the task's box (``containment.py``),
   which keeps whatever it starts, however that detaches;
3. run: this thread watches the pipes, the exit and the deadline at once
   (``watch.py``), shipping output line by line; at the timeout it ends the
   box;
4. finish: what the task left running gets SIGTERM as it exits, and SIGKILL
   ``PIPE_DRAIN_S`` later; the last log lines are flushed, declared outputs
   stored, and the result reported, with what the box used (CPU time, peak
   memory) where it is known. Nothing of the task runs on once it is reported.

Cancel and timeout end the whole box: SIGTERM, a grace period, then SIGKILL
(``process.terminate_tree``).

A task of a distributed job starts its node's ranks (``launch.py``): all of
them directly, or one torchrun agent. Node 0 reserves the master port before
it prepares and reports it, so the other nodes, preparing meanwhile, learn it
from the control plane. When a rank fails, the node's other ranks are ended
and the task reports that rank, its exit code and its stderr.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from .. import defaults
from ..artifacts import ArtifactStore
from ..errors import GPUlayerError, ServerUnreachable
from ..jobs import LogLine, Outcome, RunTask, TaskResult, TaskStarted
from ..outputs import OutputLimitError
from ..spec import ArtifactRef
from ..transport import Transport
from .collect import collect_outputs
from .containment import Box, Containment, TreeBox
from .gpus import Vendor, visible_devices_env
from .launch import (
    RANK_ZERO_WAIT_S,
    listening,
    network_env,
    rank_env,
    reserve_port,
    split_rank,
    torchrun_argv,
    torchrun_env,
    torchrun_failure,
)
from .logs import LogSender, TaskLog
from .process import KILL_WAIT_S, RunAs, Starter, TaskProcess, spawn, terminate_tree
from .warm import WarmProcess, WarmStarts, WarmUnavailable
from .watch import watch_all
from .workspace import SCRATCH, prepare

log = logging.getLogger(__name__)

# A task's thread reports its end, and the reply may bring the worker's next
# task (ADR-0012). That task's process starts at once; the reporting thread
# then supervises it too, once done with its own, rather than starting a
# thread for it: one thread start (and its handshake) and one exit fewer per
# job in a stream of short jobs.
_successor = threading.local()


class Report(Protocol):
    """Delivers a report now, or later if the server is away; ``keep`` runs
    if it has to wait (the worker's outbox)."""

    def __call__(
        self, deliver: Callable[[], None], keep: Callable[[], None] | None = None
    ) -> None: ...


def _deliver_now(deliver: Callable[[], None], keep: Callable[[], None] | None = None) -> None:
    deliver()


def _tail(lines: deque[str]) -> list[str]:
    """The stderr lines a result carries (for its job's reason), each cut
    short: a report stays small enough for any proxy before the server."""
    limit = defaults.STDERR_TAIL_LINE_MAX
    return [line if len(line) <= limit else line[:limit] + " [cut]" for line in lines]


def _runs_a_script(argv: list[str]) -> bool:
    """Whether a command is ``<the worker's python> script.py ...``, which
    starts as a script does."""
    if len(argv) < 2 or argv[1].startswith("-") or not argv[1].endswith(".py"):
        return False
    # The very path: a venv's python and the one it links to resolve alike,
    # but each has its own site-packages.
    return argv[0] == sys.executable


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
        on_spawned: Callable[[TaskRun, list[tuple[int, float]]], None] | None = None,
        report: Report = _deliver_now,
        finish: Callable[[TaskResult], object] | None = None,
        keep: Callable[[TaskResult, list[LogLine]], None] | None = None,
        defer_started: float | None = None,
        interface: str | None = None,
        max_output_bytes: int = defaults.MAX_OUTPUT_BYTES,
        containment: Containment | None = None,
        run_as: RunAs | None = None,
        warm: WarmStarts | None = None,
    ) -> None:
        self.task = task
        self.max_output_bytes = max_output_bytes  # what its outputs may total
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
        self.on_spawned = on_spawned  # told each process's (pid, start time) once started
        self.interface = interface  # where ranks of a job of several nodes talk (launch.py)
        self.report = report  # delivers a report now, or later if the server is away
        # Reports the result (and acts on what the reply brings); by default
        # the transport's report alone.
        self.finish = finish or transport.task_finished
        # Writes down a result that has to wait for the server, with its last
        # lines not yet delivered (the ledger).
        self.keep = keep
        # Over a network, a task's start is reported only once it has run this
        # long (a short task's start goes with its end: one request fewer).
        # In-process it is reported at once: the pid in the store is what lets
        # a crashed control plane's successor end the task's processes.
        self.defer_started = defer_started
        self._lock = threading.Lock()
        self._ending: Outcome | None = None  # why we are ending it early, if we are
        self._procs: list[TaskProcess] = []  # its process, or its node's ranks
        self._ranks: list[int | None] = [None]  # the rank each of them runs
        self._tasklog: TaskLog | None = None
        self._early: TaskResult | None = None  # the result when it never ran
        self._terminators: list[threading.Thread] = []  # ending trees on cancel/timeout/failure
        self._cwd = task_dir
        self._stderr_tail: deque[str] = deque(maxlen=defaults.STDERR_TAIL_LINES)
        self._rank_tails: dict[int, deque[str]] = {}
        # Distributed jobs: the master port (reserved here on node 0, given
        # by a Rendezvous elsewhere) and the first rank of this node to fail.
        self._port_sock: socket.socket | None = None
        self._master_port: int | None = None
        self._rendezvous = threading.Event()
        self._failed: tuple[int | None, int] | None = None
        self._proc_times: list[tuple[int, float]] = []
        self._starts: list[tuple[list[str], Path, dict[bytes, bytes]]] = []  # each one's
        # Where its processes are kept, made as the first starts: a
        # TaskRun made without a worker's containment keeps today's tree.
        self._containment = containment
        self._box: Box | None = None
        self.run_as = run_as  # the Unix user the job runs as, if not the worker's
        # Its processes fork from the worker's ready interpreter where they
        # can (warm/); ``start_mode`` says whether they all did, or why not.
        self.warm = warm
        self.start_mode: str | None = None
        # Its own thread, if it gets one (a task handed to the thread that
        # reported the previous one does not).
        self.thread: threading.Thread | None = None

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
        if spec.bundle is None and not spec.inputs and not spec.distributed:
            self._launch_guarded()
        if getattr(_successor, "open", False) and _successor.run is None:
            _successor.run = self  # this thread reports its task's end: it takes this one on
            return
        self._start_thread()

    def _start_thread(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self.thread.start()

    @property
    def _thread_name(self) -> str:
        return f"gpulayer-task-{self.task.job_id}"

    def stop(self, why: Outcome) -> None:
        """End the task early: ``cancelled``, ``timed_out`` or ``lost``."""
        with self._lock:
            if self._ending is not None:
                return
            self._ending = why
            procs = list(self._procs)
        self._rendezvous.set()  # a node waiting for its master port waits no more
        self._terminate(procs)

    def set_master_port(self, port: int) -> None:
        """Node 0 of this job reserved ``port`` (a Rendezvous arrived)."""
        self._master_port = port
        self._rendezvous.set()

    def _terminate(self, procs: list[TaskProcess]) -> None:
        """End these process trees, all at once, each with its grace period:
        the whole box (every process of the task, wherever it went)."""
        for proc in procs:
            thread = threading.Thread(
                target=terminate_tree,
                args=(proc,),
                kwargs={"grace": self.kill_grace, "box": self._box},
                daemon=True,
            )
            thread.start()  # listed once started: _run_one joins what it lists
            self._terminators.append(thread)

    def _result(self, outcome: Outcome, **fields: object) -> TaskResult:
        fields.setdefault("stderr_tail", _tail(self._stderr_tail))
        return TaskResult(
            job_id=self.task.job_id,
            attempt=self.task.attempt,
            worker_id=self.worker_id,
            outcome=outcome,
            marks=self.marks,
            node=self.task.node,
            start=self.start_mode,
            **fields,  # type: ignore[arg-type]
        )

    def _launch_guarded(self) -> None:
        self._tasklog = self.logs.open(self.task.job_id, self.task.attempt, self.task.node)
        try:
            self._launch()
        except Exception as exc:  # prepare or spawn failed: the job could not run
            log.debug("task %s could not run", self.task.job_id, exc_info=True)
            self._early = self._result("error", error=f"{type(exc).__name__}: {exc}")

    def _run(self) -> None:
        """Supervise this task to its reported end; then any task that came
        with the report's reply and was handed to this thread."""
        run: TaskRun | None = self
        while run is not None:
            _successor.open, _successor.run = False, None
            try:
                run._run_one()
            except Exception:  # tidying up failed (a full disk, say): the next one still runs
                log.exception("task %s: ending it failed", run.task.job_id)
            except BaseException:
                successor, _successor.run = _successor.run, None
                if successor is not None:  # on a thread of its own, as it would have been
                    successor._start_thread()
                raise
            run, _successor.run = _successor.run, None
            if run is not None:
                threading.current_thread().name = run._thread_name

    def _run_one(self) -> None:
        if self._tasklog is None:
            self._launch_guarded()
        assert self._tasklog is not None
        result = self._early
        if result is None:
            try:
                result = self._supervise(self._tasklog)
            except Exception as exc:
                log.exception("task %s: supervising failed", self.task.job_id)
                # Unwatched, its processes must not run on: end them (joined
                # below), and close what is left of their pipes.
                self._terminate([p for p in self._procs if p.returncode is None])
                for proc in self._procs:
                    for pipe in (proc.stdout, proc.stderr):
                        if pipe is not None:
                            pipe.close()
                result = self._result("error", error=f"{type(exc).__name__}: {exc}")
        tasklog = self._tasklog
        try:
            for terminator in self._terminators:
                # Report "cancelled" only once the whole tree is gone.
                terminator.join()
            result = self._with_usage(result)
            if self._port_sock is not None:
                self._port_sock.close()
            self.logs.close_task(tasklog)
        except Exception:  # the result must still go, or the job runs on forever
            log.exception("task %s: tidying up after it failed", self.task.job_id)

        def deliver() -> None:
            self.finish(result)

        def keep() -> None:
            if self.keep is not None:
                self.keep(result, self.logs.waiting(tasklog))

        _successor.open = True  # a task in the reply is handed to this thread
        try:
            # The server is away: its last lines (waiting, or in a send that
            # may yet fail) go before its result.
            if self.logs.unsent(tasklog):
                tries = 0

                def rest() -> None:
                    # Here, not waiting for a send of them under way on
                    # another thread (it may hang): the outbox waits for it.
                    nonlocal tries
                    tries += 1
                    self.logs.deliver_rest(tasklog, wait=tries > 1)

                try:
                    self.report(rest)
                except Exception:  # refused (a revoked token, say): the result still goes
                    log.warning("task %s: its last log lines were refused", self.task.job_id)
            self.report(deliver, keep)
        finally:
            _successor.open = False
            self.on_done(self)

    def _with_usage(self, result: TaskResult) -> TaskResult:
        """``result``, once nothing of the task runs any more, with what its
        processes used where that is known. Also kept in its marks, which the
        control plane stores with the job whatever it knows of results."""
        if self._box is None:
            return result
        usage = self._box.close()
        if usage.cpu_s is None and usage.peak_memory is None:
            return result
        marks = dict(result.marks)
        if usage.cpu_s is not None:
            marks["cpu_s"] = usage.cpu_s
        if usage.peak_memory is not None:
            marks["peak_memory"] = float(usage.peak_memory)
        return msgspec.structs.replace(
            result, cpu_s=usage.cpu_s, peak_memory=usage.peak_memory, marks=marks
        )

    def _launch(self) -> None:
        """Prepare the workspace and start the process(es), unless ended first."""
        spec = self.task.spec
        task = self.task
        if spec.distributed and self._master_port is None and task.node == 0:
            # Before preparing: the other nodes prepare while the port travels.
            self._port_sock = reserve_port()
            port = self._master_port = self._port_sock.getsockname()[1]
            if spec.nodes > 1:
                self.report(
                    lambda: self.transport.task_rendezvous(
                        task.job_id, task.attempt, self.worker_id, port
                    )
                )
        # A job run as another user cannot write the cache's blobs: they may
        # be hard links, read-only to it, rather than copies.
        ws = prepare(
            self.task, self.dir, self.transport, self.cache, link_blobs=self.run_as is not None
        )
        self._cwd = ws.cwd
        if self.run_as is not None:
            torchrun = spec.distributed and spec.launcher == "torchrun"
            inputs = self.dir / "inputs"
            self.run_as.give(
                ws.cwd,
                *([self.dir / "torchrun"] if torchrun else []),
                inputs=inputs if spec.inputs else None,
            )
            self.run_as.give(self.dir / SCRATCH)  # the job's to write, as its workspace
        argv = (
            [sys.executable, spec.script, *spec.args]
            if spec.script
            else [*(spec.command or []), *spec.args]
        )
        # Bytes end to end: decoding the worker's whole environment and
        # encoding it back for every task cost more than the rest of the launch.
        env = self.base_env.copy()
        env.setdefault(b"PYTHONUNBUFFERED", b"1")  # logs arrive as printed, not at exit
        if self.run_as is not None:
            env.update(self.run_as.env())
        for extra in (
            spec.env,
            ws.env,
            visible_devices_env(self.gpu_vendor, self.task.gpus),
            {"GPULAYER_JOB_ID": self.task.job_id, "GPULAYER_ATTEMPT": str(self.task.attempt)},
            # A task of an array: its index there, and the array's id (arrays.py).
            {}
            if spec.array_task is None
            else {
                "GPULAYER_ARRAY_INDEX": str(spec.array_task.index),
                "GPULAYER_ARRAY_JOB_ID": spec.array_task.array,
            },
            # From the start, so that its code can prepare (the Trainer
            # checkpoints when SIGTERM comes within that many seconds).
            {"GPULAYER_PREEMPT_NOTICE": f"{self.kill_grace:g}"} if spec.preemptible else {},
        ):
            for key, value in extra.items():
                env[os.fsencode(key)] = os.fsencode(value)
        self.marks["prepared"] = time.time()
        if spec.distributed and self._master_port is None:
            self._rendezvous.wait()  # node 0's port comes through the control plane
        with self._lock:
            if self._ending is not None:
                self._early = self._result(self._ending)
                return
            if spec.distributed:
                self._spawn_ranks(argv, ws.cwd, env)
            else:
                self._spawn(argv, ws.cwd, env)
        self.marks["started"] = time.time()
        if self.on_spawned is not None:
            self.on_spawned(self, self._proc_times)

    def _spawn(
        self, argv: list[str], cwd: Path, env: dict[bytes, bytes], *, hold: bool = False
    ) -> None:
        """Start one of the task's processes, noting its pid and start time
        (the clock just before the spawn, as process.spawn says). ``hold``:
        a zygote's child waits for :meth:`_let_go` before it runs."""
        starter = self._starter(argv, cwd, env)
        at = time.time()
        if self._box is None:
            self._box = TreeBox() if self._containment is None else self._containment.box()
        try:
            proc = self._box.spawn(argv, cwd=cwd, env=env, run_as=self.run_as, starter=starter)
            if isinstance(proc, WarmProcess) and not hold:
                self._release(proc)
        except WarmUnavailable as exc:
            proc, at = self._cold_instead(exc, argv, cwd, env), time.time()
        self._procs.append(proc)
        self._proc_times.append((proc.pid, at))
        self._starts.append((argv, cwd, env))

    def _cold_instead(
        self, exc: Exception, argv: list[str], cwd: Path, env: dict[bytes, bytes]
    ) -> TaskProcess:
        """The zygote failed (killed, stopped, gone): the task is not its to
        fail. The process starts cold, and the task's record says why."""
        log.warning("task %s: starting cold: %s", self.task.job_id, exc)
        self.start_mode = f"cold: the ready interpreter failed ({exc})"
        assert self._box is not None
        return self._box.spawn(argv, cwd=cwd, env=env, run_as=self.run_as)

    def _let_go(self, index: int) -> None:
        """Release the held process ``index`` (or start it cold)."""
        proc = self._procs[index]
        if not isinstance(proc, WarmProcess) or proc._channel is None:
            return
        try:
            self._release(proc)
        except WarmUnavailable as exc:
            argv, cwd, env = self._starts[index]
            at = time.time()
            cold = self._cold_instead(exc, argv, cwd, env)
            self._procs[index], self._proc_times[index] = cold, (cold.pid, at)

    @staticmethod
    def _release(proc: WarmProcess) -> None:
        """Let a zygote's child, in its box now, run; if it cannot, it ends."""
        try:
            proc.release()
        except BaseException:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_WAIT_S)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            raise

    def _starter(self, argv: list[str], cwd: Path, env: dict[bytes, bytes]) -> Starter:
        """A zygote's fork for a script (or a direct launcher's rank), where
        one is ready for this task's settings; else a cold start. Notes why."""
        spec = self.task.spec
        why: str | None
        if spec.script is None and not _runs_a_script(argv):
            why = "a command job, not a Python script run by the worker's Python"
        elif spec.distributed and spec.launcher == "torchrun":
            why = "torchrun starts the ranks"
        elif not spec.warm:
            why = "the job asked for a cold start"
        elif self.warm is None:
            why = "the worker starts jobs cold (--no-warm, or no fork server on this system)"
        else:
            zygote, why = self.warm.choose(argv, cwd=cwd, env=env, run_as=self.run_as)
            if zygote is not None:
                self.start_mode = self.start_mode or "warm"
                return zygote.spawn
        if self.start_mode is None or self.start_mode == "warm":
            self.start_mode = f"cold: {why}"  # one cold process makes the task's start cold
        return spawn

    def _spawn_ranks(self, argv: list[str], cwd: Path, env: dict[bytes, bytes]) -> None:
        """This node's ranks (direct launcher) or its torchrun agent."""
        spec, task = self.task.spec, self.task
        assert self._master_port is not None
        addr = task.master_addr or "127.0.0.1"
        env = env.copy()
        for key, value in network_env(spec, self.interface).items():
            env[os.fsencode(key)] = os.fsencode(value)
        if spec.launcher == "torchrun":
            program = (
                [spec.script, *spec.args] if spec.script else [*(spec.command or []), *spec.args]
            )
            agent_env = env.copy()
            for key, value in torchrun_env(spec, node=task.node).items():
                agent_env[os.fsencode(key)] = os.fsencode(value)
            agent = torchrun_argv(
                spec,
                program,
                node=task.node,
                master_addr=addr,
                master_port=self._master_port,
                log_dir=str(self.dir / "torchrun"),
            )
            self._spawn(agent, cwd, agent_env)
            return
        self._ranks = []
        try:
            for local_rank in range(spec.procs_per_node):
                rank_vars = rank_env(
                    spec,
                    node=task.node,
                    local_rank=local_rank,
                    master_addr=addr,
                    master_port=self._master_port,
                )
                own = env.copy()
                for key, value in rank_vars.items():
                    own[os.fsencode(key)] = os.fsencode(value)
                # Node 0's other ranks wait for rank 0 (see _rank_zero_first).
                self._spawn(argv, cwd, own, hold=task.node == 0 and local_rank > 0)
                self._ranks.append(int(rank_vars["RANK"]))
            self._rank_zero_first()
        except BaseException:
            for proc in self._procs:
                if isinstance(proc, WarmProcess) and proc._channel is not None:
                    proc.close_unreleased()
            self._terminate(self._procs)
            raise

    def _rank_zero_first(self) -> None:
        """Release node 0's held ranks once rank 0 listens on the master port.

        Forked ranks reach ``init_process_group`` within a millisecond of
        each other. A rank that connects before rank 0's store listens is
        refused, and torch's client waits out a back-off (0.4 to 0.7 s,
        measured) before it tries again: more than the whole warm start.
        So they go once the port listens, or after ``RANK_ZERO_WAIT_S`` (a
        script with a long set-up before its ``init_process_group``)."""
        held = [
            i
            for i, proc in enumerate(self._procs)
            if isinstance(proc, WarmProcess) and proc._channel is not None
        ]
        if not held:
            return
        if self._master_port is not None and self._procs[0].returncode is None:
            listening(self._master_port, RANK_ZERO_WAIT_S)
        for index in held:
            self._let_go(index)

    def _supervise(self, tasklog: TaskLog) -> TaskResult:
        procs, box = self._procs, self._box
        assert procs and box is not None
        spec = self.task.spec
        started = TaskStarted(
            job_id=self.task.job_id,
            attempt=self.task.attempt,
            worker_id=self.worker_id,
            acquired=self.marks["acquired"],
            prepared=self.marks["prepared"],
            started=self.marks["started"],
            pid=procs[0].pid,
            pid_created=self._proc_times[0][1],
            node=self.task.node,
            # A copy, as the report types it (its start times may be unknown).
            procs=[(pid, at) for pid, at in self._proc_times] if len(procs) > 1 else [],
            start=self.start_mode,
        )

        def report_started() -> None:
            self.report(lambda: self.transport.task_started(started))

        if self.defer_started is None:
            report_started()
        tail, rank_tails, ranks = self._stderr_tail, self._rank_tails, self._ranks
        torchrun = spec.distributed and spec.launcher == "torchrun"
        if torchrun:  # room for the agent's summary of a failed rank
            tail = self._stderr_tail = deque(maxlen=defaults.STDERR_TAIL_LINES * 4)

        def emit(index: int, stream: str, text: str) -> None:
            rank = ranks[index]
            if torchrun:
                rank, text = split_rank(text)
            tasklog.add(stream, text, rank)
            if stream == "stderr":
                if rank is None:
                    tail.append(text)
                else:
                    rank_tail = rank_tails.get(rank)
                    if rank_tail is None:
                        rank_tail = rank_tails[rank] = deque(maxlen=defaults.STDERR_TAIL_LINES)
                    rank_tail.append(text)

        def on_exit(index: int, code: int) -> None:
            # One rank failed: its node's others go too (the job's other
            # nodes are ended by the control plane when this task reports).
            if code == 0 or len(procs) == 1:
                return
            with self._lock:
                if self._failed is not None or self._ending is not None:
                    return
                self._failed = (ranks[index], code)
            self._terminate([p for i, p in enumerate(procs) if i != index])

        deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
        ended = watch_all(
            procs,
            emit,
            deadline=deadline,
            on_deadline=lambda: self.stop("timed_out"),
            # A short task's start is told with its end, in the same report.
            still_running_at=None
            if self.defer_started is None
            else time.monotonic() + self.defer_started,
            on_still_running=report_started,
            on_exit=on_exit,
            rest=box.signal_rest,
        )
        self.marks["exited"] = max(exited for _, exited in ended)
        # What it left got SIGTERM as it exited: until PIPE_DRAIN_S after
        # that to leave, then SIGKILL. Before its outputs are read, and its
        # GPUs offered again.
        box.end(max(0.0, self.marks["exited"] + defaults.PIPE_DRAIN_S - time.time()))
        refused = None
        if self.task.node == 0:
            outputs, missing, refused = self._collect_outputs()
        else:  # a distributed job's outputs are rank 0's, on node 0
            outputs, missing = {}, []
        with self._lock:
            ending = self._ending
        rank, code = self._decide([code for code, _ in ended])
        fields: dict[str, object] = {}
        if self.task.node == 0 and self._may_run_again(ending, code):
            fields["scratch"] = self._keep_scratch()
        if refused is not None:  # it fails, with why, whatever its exit code
            ending, fields["error"] = ending or "error", refused
        if rank is not None:
            fields["rank"] = rank
            if rank in rank_tails:
                fields["stderr_tail"] = _tail(rank_tails[rank])
        return self._result(
            ending or "exited", exit_code=code, outputs=outputs, missing_outputs=missing, **fields
        )

    def _may_run_again(self, ending: Outcome | None, code: int) -> bool:
        """Whether the job may have another attempt after this one, which
        would then get its scratch folder: not if it succeeded or was
        cancelled; else if it may be retried or preempted."""
        if ending == "cancelled" or (ending is None and code == 0):
            return False
        spec = self.task.spec
        return spec.max_retries > 0 or spec.preemptible or ending == "preempted"

    def _keep_scratch(self) -> ArtifactRef | None:
        """Store the scratch folder as it is, for the next attempt (None: it
        could not be, and the next attempt gets the last one stored). As an
        output is, never through a link, and within the outputs' limit."""
        try:
            found, _ = collect_outputs(
                [SCRATCH], self.dir, self.transport, max_bytes=self.max_output_bytes
            )
        except (OutputLimitError, GPUlayerError, OSError) as exc:
            log.warning("task %s: its scratch folder was not kept: %s", self.task.job_id, exc)
            return None
        return found.get(SCRATCH)

    def _decide(self, codes: list[int]) -> tuple[int | None, int]:
        """The rank (if any) and exit code the task reports."""
        if self._failed is not None:
            return self._failed
        if self.task.spec.distributed and self.task.spec.launcher == "torchrun" and codes[0]:
            found = torchrun_failure(self._stderr_tail)
            if found is not None:
                return found
        failed = [(rank, code) for rank, code in zip(self._ranks, codes, strict=True) if code]
        return failed[0] if failed else (None, codes[0])

    def _collect_outputs(self) -> tuple[dict[str, ArtifactRef], list[str], str | None]:
        """Store the declared outputs, waiting out a server that is away.
        The third value: why none were stored (over the size limit), if so."""
        backoff = 0.05
        deadline = time.monotonic() + defaults.OUTPUT_UPLOAD_PATIENCE_S
        while True:
            try:
                found, missing = collect_outputs(
                    self.task.spec.outputs,
                    self._cwd,
                    self.transport,
                    max_bytes=self.max_output_bytes,
                )
                return found, missing, None
            except OutputLimitError as exc:
                return {}, [], str(exc)
            except ServerUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(backoff)  # retry backoff while the server is unreachable
                backoff = min(backoff * 2, defaults.RECONNECT_MAX_S)
