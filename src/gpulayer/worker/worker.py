"""The worker: offers slots, takes tasks by long poll, runs them, reports back.

Its life, in steps:

1. Detect GPUs (one slot per GPU) or take ``slots`` CPU slots; set up how
   it keeps every process its tasks start (``containment.py``).
2. Register with the control plane; get an id.
3. Loop: ``acquire`` (a long poll that returns the moment work is placed
   here) and act on each instruction: start a :class:`TaskRun` thread for a
   task, or stop one that was cancelled.
4. On stop: end running tasks (they are reported ``lost`` and retried within
   their budget), flush their logs, and unregister.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import secrets
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from .. import defaults
from ..artifacts import ArtifactStore
from ..errors import (
    AccessDenied,
    GPUlayerError,
    InvalidStateError,
    ServerUnreachable,
    UntrustedServer,
    WorkerError,
)
from ..ids import new_id
from ..jobs import CancelTask, Instruction, Outcome, Rendezvous, RunTask, TaskResult, WorkerInfo
from ..transport import Transport
from .containment import Containment, acquire_containment, release_containment
from .gpulocks import GpuClaim, claim_gpus
from .gpus import MIXED_VENDORS, Gpu, detect_gpus
from .launch import interface_of
from .ledger import Kept, Ledger
from .logs import LogSender, in_batches
from .outbox import Outbox
from .process import RunAs
from .task import TaskRun
from .telemetry import SAMPLE_INTERVAL_S, Sampler, open_sampler
from .warden import Warden, open_stdio
from .warm import WarmStarts
from .warm import from_environment as warm_starts
from .workspace import Remover, make_spare, reuse_if_empty

log = logging.getLogger(__name__)

_EARLY_MAX = 1024  # instructions kept for tasks not (yet) here
# How long a stopping worker waits for its acquire loop to end (its long poll
# ends as the server hears it is stopping; longer only if it did not hear).
_LOOP_END_S = 5.0
# How long a stopping worker keeps trying to deliver reports left in its outbox,
# when not told otherwise.
_OUTBOX_STOP_S = 10.0
# How long a worker whose start failed after registering waits for its goodbye.
_GOODBYE_WAIT_S = 3.0
# Under --run-as, the folders between the worker's home and a job's own:
# gone through by the job, never listed (so no other task's is found).
_THROUGH_ONLY = 0o711


class Worker:
    def __init__(
        self,
        transport: Transport,
        *,
        cache: ArtifactStore,
        work_dir: Path,
        name: str | None = None,
        slots: int | None = None,
        gpus: list[Gpu] | None = None,
        kill_grace: float = defaults.KILL_GRACE_S,
        heartbeat_interval: float | None = None,
        address: str | None = None,
        ledger: bool = False,
        warden: bool = False,
        warden_goodbye: Callable[[str, str | None], None] | None = None,
        on_give_up: Callable[[], None] | None = None,
        gpu_claim: GpuClaim | None = None,
        max_output_bytes: int = defaults.MAX_OUTPUT_BYTES,
        containment: str | None = None,
        run_as: str | None = None,
        warm: bool | None = None,
        preload: Sequence[str] | None = None,
        telemetry: bool = True,
    ) -> None:
        """``telemetry``: sample its GPUs' figures and send them with its
        heartbeats (see telemetry.py); a worker offering GPUs then heartbeats
        even in the control plane's own process. ``warm``: fork script tasks from a ready interpreter that has
        imported ``preload`` (see warm/; None: ``GPULAYER_WARM``,
        ``GPULAYER_PRELOAD``, else on, with torch and numpy).
        ``containment``: how it keeps every process a task starts
        (``GPULAYER_CONTAINMENT`` if None; see ``containment.py``).
        ``run_as``: the Unix user its jobs run as (the worker must be root),
        or a comma-separated list of one per slot, each slot's jobs run as
        its own (see ``RunAs.for_slots``)."""
        if slots is not None and slots < 1:
            raise WorkerError(f"a worker needs at least one slot, got slots={slots}")
        if max_output_bytes < 1:
            raise WorkerError(
                f"a job's outputs need a limit of at least 1 byte, got {max_output_bytes}"
            )
        self.max_output_bytes = max_output_bytes
        self.transport = transport
        self.cache = cache
        self.work_dir = work_dir
        self.kill_grace = kill_grace
        self.gpus = detect_gpus() if gpus is None else gpus
        vendors = {g.vendor for g in self.gpus}
        if len(vendors) > 1:
            raise WorkerError(MIXED_VENDORS)
        self.vendor = vendors.pop() if vendors else None
        if self.gpus and slots is not None and slots != len(self.gpus):
            raise WorkerError(
                f"this worker offers {len(self.gpus)} GPUs, so it has one slot per GPU, not "
                f"{slots}; a worker offering no GPUs (--gpus none) takes a slot count"
            )
        slot_gpus: list[int | None] = (
            [g.index for g in self.gpus] if self.gpus else [None] * (slots or 1)
        )
        # The user of each slot, by slot index; a job runs as its first slot's.
        self.run_as = None if run_as is None else _run_as(run_as, work_dir, cache, len(slot_gpus))
        self.info = WorkerInfo(
            id="",
            name=name or f"{socket.gethostname()}-{os.getpid()}",
            host=socket.gethostname(),
            slot_gpus=slot_gpus,
            gpu_vendor=self.vendor,
            gpu_names=[g.name for g in self.gpus],
            address=address,
        )
        self._tasks: dict[tuple[str, int], TaskRun] = {}
        self._tasks_lock = threading.Lock()
        self._idle = threading.Condition(self._tasks_lock)
        self._remover = Remover()
        self._stopping = threading.Event()
        # Why the worker cannot go on (the server refused its token), once it
        # cannot; ``on_give_up`` is told then (the CLI stops the worker).
        self.gave_up: str | None = None
        self._on_give_up = on_give_up
        self._outbox = Outbox()
        # Remote workers heartbeat; one in the control plane's own process
        # needs not (it cannot outlive it).
        self.heartbeat_interval = heartbeat_interval
        self._telemetry = telemetry
        self._sampler: Sampler | None = None  # once serving, where its GPUs can be read
        self._beats: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._spares: list[Path] = []
        # The environment every task starts from, taken once (see TaskRun).
        self._base_env = dict(os.environb)
        # The worker's token is its own, not its jobs': a job that printed it
        # would hand it to every reader of its logs. A job gets no credential.
        for name in (defaults.TOKEN_ENV, defaults.TOKEN_FILE_ENV):
            self._base_env.pop(os.fsencode(name), None)
        self._dir_numbers = itertools.count(1)
        self._warm_choice = (warm, preload)
        self._warm: WarmStarts | None = None  # made as it starts serving
        if warden and not ledger:
            raise WorkerError("a worker's warden ends what its ledger lists: ledger=True")
        if warden:
            open_stdio()  # before the ledger's lock and the warden's pipe are made
        # A worker process of its own keeps a ledger of its tasks' processes,
        # for the next one on this home to end if it dies (see ledger.py).
        self._ledger = Ledger(work_dir) if ledger else None
        self._interface: str | None = None  # of its advertised address (launch.py)
        # Held while registering again, and while a finished report's reply
        # is acted on (see _finish); re-entrant: a task handed back as the
        # worker stops is reported from inside _finish.
        self._registering = threading.RLock()
        # Cancels and master ports that came before their task (see _handle).
        self._early: dict[tuple[str, int], list[Instruction]] = {}
        # With one --run-as user per slot: the uid each running task holds,
        # and tasks waiting for a uid a task still holds (see _start_task).
        self._uids: dict[tuple[str, int], int] = {}
        self._held: dict[int, list[tuple[RunTask, float]]] = {}
        self._registered = False  # by start(), which may yet fail after it
        self.tasks_dir: Path | None = None  # once registered: its tasks' folders
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._warden: Warden | None = None
        own_claim: GpuClaim | None = None
        self._containment: Containment | None = None
        try:
            # Before the warden's fork, which it must reach, and before any
            # thread: a cgroup's set-up moves this process.
            self._containment = acquire_containment(containment)
            self.info.containment = self._containment.kind
            # Machine-wide: no other worker, however started, offers these
            # GPUs while this one does (see gpulocks.py).
            if gpu_claim is not None and gpu_claim.gpus != self.gpus:
                raise WorkerError("a worker offers exactly the GPUs of the claim it is given")
            self._claim = gpu_claim if gpu_claim is not None else claim_gpus(self.gpus)
            own_claim = None if gpu_claim is not None else self._claim
            if warden:
                assert self._ledger is not None
                # It ends the tasks as soon as the worker dies (warden.py):
                # forked here, before the worker has a thread.
                self._warden = Warden(
                    self._ledger,
                    grace=kill_grace,
                    goodbye=warden_goodbye,
                    containment=self._containment,
                )
            self._logs = LogSender(transport.append_logs)  # a thread: after the warden's fork
        except BaseException:
            if self._ledger is not None:
                self._ledger.close()
            if self._warden is not None:
                self._warden.release()
            if own_claim is not None:  # its own: let go of it
                own_claim.release()
            self._release_containment()
            raise

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def serving(self) -> bool:
        """Whether it takes tasks (its acquire loop has started)."""
        return self._thread is not None and self._thread.ident is not None

    def start(self) -> None:
        if self._stopping.is_set() or self._thread is not None:
            raise WorkerError("a worker starts once: make another one")
        try:
            self._start()
        except BaseException:
            if self.serving:
                # Its loop runs, and may have taken tasks: stopped as stop()
                # does (its tasks end first, then the GPUs go), on a thread,
                # for as long as ending a task takes: not for the transport's
                # every try on a server that stopped answering.
                self._stop_soon(self.kill_grace + _LOOP_END_S + _GOODBYE_WAIT_S)
                raise
            # Not serving (stopped by a signal, say). Registered already, it
            # says goodbye, so that a task placed on it goes elsewhere now
            # rather than after the heartbeat timeout (the server ended what
            # an adopted id held as it registered).
            try:
                self._stopping.set()
                if self._registered:
                    self._goodbye_soon()
                # Its ledger stays as it is, for the next worker process on
                # this home: an id adopted and not registered is for that
                # one to adopt in turn.
                self._logs.stop()
            finally:
                self._claim.release()  # its GPUs are free for another worker
                if self._warden is not None:  # it took no task to end
                    self._warden.release()
                self._release_containment()
            raise

    def _stop_soon(self, wait: float) -> None:
        """stop() after a failed start, waited for ``wait`` s at most."""
        self._waited_for("stopping", lambda: self.stop(timeout=wait), wait + _GOODBYE_WAIT_S)

    def _goodbye_soon(self) -> None:
        """Unregister after a failed start, waited for a few seconds at most."""

        def goodbye() -> None:
            with self._registering:  # after a registration under way, as in stop()
                self._goodbye()

        self._waited_for("saying goodbye", goodbye, _GOODBYE_WAIT_S)

    def _goodbye(self) -> None:
        """Unregister; should it come late, it is for this registration only,
        not for one the next worker process on the home makes under the id."""
        self.transport.unregister_worker(self.info.id, generation=self.transport.generation())

    def _registered_as(self, info: WorkerInfo) -> None:
        self.info = info
        if self._ledger is not None:  # for the warden's goodbye
            self._ledger.set_worker_id(info.id, self.transport.generation())

    def _waited_for(self, what: str, step: Callable[[], None], wait: float) -> None:
        """``step`` on a thread of its own, waited for ``wait`` s at most: a
        start that failed (a signal asked the worker to go) must not wait out
        the transport's tries on a server that stopped answering. What it
        raises is logged: the failure that led here is the one to raise."""

        def run() -> None:
            try:
                step()
            except Exception:
                log.warning("worker %s: %s after a failed start", self.info.id, what, exc_info=True)

        thread = threading.Thread(target=run, name="gpulayer-after-start", daemon=True)
        thread.start()
        thread.join(wait)

    def _start(self) -> None:
        adopted = False
        if self._ledger is not None:
            previous = self._ledger.recover(grace=self.kill_grace)
            if previous and not self.info.id:
                # Come back as the dead worker: the server learns at once
                # that its tasks are gone, not after the heartbeat timeout.
                self.info.id, adopted = previous, True
            elif not self.info.id:
                # Made here rather than by the server: should this process
                # die with its registration on its way (a signal, say), its
                # warden can still say it is gone.
                self.info.id = new_id()
            # Should this process die before it registers, the next one
            # adopts the id in turn.
            self._ledger.set_worker_id(self.info.id)
            self._deliver_kept(self._ledger)
        warm, preload = self._warm_choice
        # A worker of its own lives long: its zygotes are made now, before
        # it can be given a job. Embedded, once a first script has run (see
        # WarmStarts).
        self._warm = warm_starts(
            self._base_env,
            warm=warm,
            preload=preload,
            eager=self.heartbeat_interval is not None,
            users=[None] if self.run_as is None else list(self.run_as),
        )
        self._registered_as(self.transport.register_worker(self.info, adopted=adopted))
        self._registered = True
        if self._ledger is not None and self._ledger.holds_results():
            # Refused with a token the server now took: no longer worth
            # failing the start for; what the server does not take now stays kept.
            with contextlib.suppress(ServerUnreachable):
                self._deliver_kept(self._ledger, last_try=True)
        self._interface = interface_of(self.info.address)
        self.tasks_dir = self.work_dir / self.info.id
        self._spares = [self._spare() for _ in self.info.slot_gpus[:4]]
        if self.run_as is not None:  # its jobs go down to their folders in it
            self.tasks_dir.chmod(_THROUGH_ONLY)
        self._thread = threading.Thread(
            target=self._loop, name=f"gpulayer-worker-{self.info.id}", daemon=True
        )
        self._thread.start()
        if self._telemetry:
            self._sampler = open_sampler(self.gpus)
        # Embedded, its heartbeats are for its GPUs' figures only.
        beat = self.heartbeat_interval or (SAMPLE_INTERVAL_S if self._sampler else None)
        if beat:
            beats = threading.Thread(
                target=self._heartbeat_loop,
                args=(beat,),
                name=f"gpulayer-heartbeat-{self.info.id}",
                daemon=True,
            )
            beats.start()
            self._beats = beats

    def _deliver_kept(self, ledger: Ledger, *, last_try: bool = False) -> None:
        """Deliver the results a worker process kept on disk (the server was
        away when their tasks ended). Before registering: after it, the server
        takes those tasks for lost.

        Raises ServerUnreachable, with them still kept, while the server is
        away. A token the server refuses (AccessDenied) stops the delivery,
        with them still kept, unless ``last_try`` (the worker has registered
        since, so its token is good: what is still refused is not its to
        deliver). Any other refusal is of the result itself, which is then
        dropped."""
        for kept in ledger.kept():
            result = kept.result
            try:
                self._deliver_kept_lines(kept)
                self.transport.task_finished(result, take=False)
            except ServerUnreachable:
                raise
            except AccessDenied as exc:
                if not last_try:
                    return
                self._refused_kept(result, exc)
            except GPUlayerError as exc:
                self._refused_kept(result, exc)
            else:
                log.warning(
                    "delivered the kept result of job %s (attempt %d)",
                    result.job_id,
                    result.attempt,
                )
            ledger.drop(result)

    def _deliver_kept_lines(self, kept: Kept) -> None:
        """The last lines kept with a result go before it (the server stores
        each line once, by its number: ones it had already are not doubled).
        Lines it refuses (other than for the token) do not hold the result."""
        result = kept.result
        try:
            for batch in in_batches(kept.lines, defaults.LOG_BATCH_MAX_BYTES):
                self.transport.append_logs(result.job_id, result.attempt, batch, result.node)
        except (ServerUnreachable, AccessDenied):
            raise
        except GPUlayerError as exc:
            log.warning("the kept log lines of job %s were refused: %s", result.job_id, exc)

    @staticmethod
    def _refused_kept(result: TaskResult, exc: Exception) -> None:
        log.warning(
            "a kept result of job %s (attempt %d) was refused: %s",
            result.job_id,
            result.attempt,
            exc,
        )

    def _loop(self) -> None:
        backoff = 0.05
        untrusted = False  # said once per spell, not on every try
        away = False  # the server is (restarting, out of reach): said once, as is its return
        while not self._stopping.is_set():
            try:
                instructions = self.transport.acquire(self.info.id, defaults.ACQUIRE_TIMEOUT_S)
            except InvalidStateError:
                # The server does not know us: it restarted, or gave us up
                # for lost. Register again, naming the tasks still running.
                # Outside this handler: its errors are the loop's to handle.
                instructions = None
            except ServerUnreachable as exc:
                if isinstance(exc, UntrustedServer) and not untrusted:
                    # Its certificate changed: an operator must act. Until
                    # then the worker keeps its reports and tries again.
                    log.error("worker %s: %s", self.info.id, exc)
                    untrusted = True
                elif not away:
                    # A restart, say: waited out, quietly (no traceback).
                    log.warning("worker %s: %s; waiting for it", self.info.id, exc)
                away = True
                # A server shutting down says when to ask again (Retry-After).
                asked = min(exc.retry_after or 0.0, defaults.RECONNECT_MAX_S)
                if self._stopping.wait(max(backoff, asked)):
                    return
                backoff = min(backoff * 2, defaults.RECONNECT_MAX_S)
                continue
            except AccessDenied as exc:
                self._give_up(exc)
                return
            except Exception:  # a reply it could not read, say: not the end of the worker
                log.exception("worker %s: asking for work failed", self.info.id)
                if self._stopping.wait(backoff):
                    return
                backoff = min(backoff * 2, defaults.RECONNECT_MAX_S)
                continue
            if away:  # it answered (perhaps that it knows us no more: registered again below)
                away = False
                log.warning("worker %s: the server answers again", self.info.id)
            if instructions is None:
                if self._stopping.is_set():
                    continue
                try:
                    registered = self._reregister()
                except AccessDenied as exc:
                    self._give_up(exc)
                    return
                except Exception:
                    log.exception("worker %s: registering again failed", self.info.id)
                    registered = False
                if not registered:
                    if self._stopping.wait(backoff):  # unanswered: not again at once
                        return
                    backoff = min(backoff * 2, defaults.RECONNECT_MAX_S)
                continue
            backoff, untrusted = 0.05, False
            self._handle(instructions)

    def _give_up(self, refused: AccessDenied) -> None:
        """The server refused the worker's token (revoked, say): it cannot go
        on. Say why, once, and tell whoever runs it."""
        why = f"the server refused this worker's token: {refused}"
        with self._tasks_lock:
            if self.gave_up is not None:
                return
            self.gave_up = why
        log.error("worker %s: %s", self.info.id, why)
        if self._on_give_up is not None:
            self._on_give_up()

    def _handle(self, instructions: list[Instruction]) -> None:
        """Act on instructions from a long poll, or from a finished report's reply.

        The two arrive on different threads and connections, so a task's
        cancel or master port can come before the task itself: it is kept,
        and applied when the task arrives.
        """
        now = time.time()
        for instruction in instructions:
            if isinstance(instruction, RunTask):
                self._start_task(instruction, now)
                continue
            key = (instruction.job_id, instruction.attempt)
            with self._tasks_lock:
                run = self._tasks.get(key)
                if run is None:
                    self._early.setdefault(key, []).append(instruction)
                    while len(self._early) > _EARLY_MAX:  # cancels of tasks long ended
                        del self._early[next(iter(self._early))]
                    continue
            self._apply(run, instruction)

    @staticmethod
    def _apply(run: TaskRun, instruction: Instruction) -> None:
        if isinstance(instruction, CancelTask):
            run.stop("preempted" if instruction.preempt else "cancelled")
        elif isinstance(instruction, Rendezvous):
            run.set_master_port(instruction.master_port)

    def _finish(self, result: TaskResult) -> None:
        """Report a task's end, and act on what the reply brings (its next task).

        Not while the worker registers again: the tasks it names as running
        must include one that came this way, or the server gives it up.
        A stopping worker takes nothing: it would only hand it back.
        """
        with self._registering:
            take = not self._stopping.is_set()
            try:
                instructions = self.transport.task_finished(result, take=take)
            except ServerUnreachable:
                raise  # it stays kept, and the outbox tries again
            except BaseException:
                self._drop_kept(result)  # refused: the outbox drops it
                raise
            self._drop_kept(result)
            self._handle(instructions)

    def _drop_kept(self, result: TaskResult) -> None:
        if self._ledger is not None:
            self._ledger.drop(result)

    def _reregister(self) -> bool:
        """Register again (the server restarted, or gave us up), naming the
        tasks still running; False if the server did not answer. Only the
        acquire loop does this."""
        # Results kept while the server was away go first: a task that ended
        # meanwhile must be reported finished, not missing. Not all through
        # yet: not registering now, or the server would take a task whose end
        # is still on its way for one that never reached us.
        self._outbox.retry_now()  # the server answered: what waits goes now
        if not self._outbox.flush(timeout=defaults.RECONNECT_MAX_S):
            return False  # the acquire loop backs off and tries again
        with self._registering:
            with self._tasks_lock:
                running = [run.key for run in self._tasks.values()]
            # A task may have ended since the flush, its report refused: it is
            # no longer named, and its end is not through (checked after the
            # look at the tasks: a task leaves them after its report is queued).
            if self._outbox.pending():
                return False
            if self._stopping.is_set():  # its goodbye is on its way (see stop)
                return False
            try:
                self._registered_as(self.transport.register_worker(self.info, running))
            except ServerUnreachable:
                return False  # the acquire loop backs off and tries again
        log.warning(
            "worker %s: registered again with %d running task(s)", self.info.id, len(running)
        )
        return True

    def _heartbeat_loop(self, interval: float) -> None:
        wait = interval
        if self._sampler is not None:
            # Its GPUs' first figures go as soon as they are read, not an interval later.
            self._sampler.ready.wait(interval)
            wait = 0.0
        while not self._stopping.wait(wait):
            wait = interval
            gpus = self._sampler.latest() if self._sampler is not None else []
            try:
                self.transport.heartbeat(self.info.id, gpus=gpus)
            except (InvalidStateError, ServerUnreachable):
                pass  # reconnecting and registering again are the acquire loop's job
            except AccessDenied as exc:  # said here too: the long poll may be open for a while
                self._give_up(exc)
                return
            except Exception:
                log.exception("worker %s: heartbeat failed", self.info.id)

    def _spare(self) -> Path:
        """A new task folder, with its empty workspace (see make_spare).

        Under --run-as jobs may run as the same user, and each must reach
        its own folder only: the folders of the tasks cannot be listed
        (``_THROUGH_ONLY``), and each is named with a random part, which no
        other job can guess. Its workspace is the job's alone once given to
        it (0700: whatever the umask, no other local user's)."""
        assert self.tasks_dir is not None
        number = next(self._dir_numbers)
        if self.run_as is None:
            return make_spare(self.tasks_dir / f"task-{number}")
        spare = make_spare(self.tasks_dir / f"task-{number}-{secrets.token_hex(8)}")
        spare.chmod(_THROUGH_ONLY)
        (spare / "workspace").chmod(0o700)
        return spare

    def _user_of(self, task: RunTask) -> RunAs | None:
        """The user ``task`` runs as under --run-as: its first slot's; None
        if it names a slot this worker does not offer."""
        assert self.run_as is not None
        first = min(task.slots, default=-1)
        return self.run_as[first] if 0 <= first < len(self.run_as) else None

    def _end_unrun(self, task: RunTask, outcome: Outcome, error: str | None = None) -> None:
        """Report ``task`` ended without running it."""
        result = TaskResult(
            job_id=task.job_id,
            attempt=task.attempt,
            worker_id=self.info.id,
            outcome=outcome,
            node=task.node,
            error=error,
        )
        keep = None if self._ledger is None else functools.partial(self._ledger.keep, result)
        self._outbox.send(lambda: self._finish(result), keep)

    def _start_task(self, task: RunTask, acquired: float) -> None:
        if self._stopping.is_set():  # placed as we stopped: hand it back, unrun
            self._end_unrun(task, "returned")
            return
        user = None
        if self.run_as is not None:
            user = self._user_of(task)
            if user is None:  # a server's mistake, or a hostile one's
                log.warning("task %s: placed on slots %s, not offered", task.job_id, task.slots)
                self._end_unrun(
                    task, "error", f"placed on slots {task.slots}, which this worker does not offer"
                )
                return
            if len(set(self.run_as)) > 1:
                # One user per slot: a task of the slot's last job may still be
                # ending (cancelled as the server took its slot back, say): this
                # one starts once it is gone, so no two running jobs share a uid.
                with self._tasks_lock:
                    if user.uid in self._uids.values():
                        self._held.setdefault(user.uid, []).append((task, acquired))
                        return
                    self._uids[(task.job_id, task.attempt)] = user.uid
        if task.spec.secrets:
            # A job's environment is made from its spec's env (task.py): its
            # secrets (names checked apart from env's) join it here.
            spec = task.spec
            env = {**spec.env, **spec.secrets}
            task = msgspec.structs.replace(task, spec=msgspec.structs.replace(spec, env=env))
        with self._tasks_lock:
            task_dir = self._spares.pop() if self._spares else self._spare()
        run = TaskRun(
            task,
            worker_id=self.info.id,
            transport=self.transport,
            logs=self._logs,
            cache=self.cache,
            task_dir=task_dir,
            gpu_vendor=self.vendor,
            base_env=self._base_env,
            kill_grace=self.kill_grace,
            acquired=acquired,
            on_done=self._task_done,
            on_spawned=None if self._ledger is None else self._task_spawned,
            interface=self._interface,
            report=self._outbox.send,
            finish=self._finish,
            keep=None if self._ledger is None else self._ledger.keep,
            defer_started=defaults.REPORT_STARTED_AFTER_S if self.heartbeat_interval else None,
            max_output_bytes=self.max_output_bytes,
            containment=self._containment,
            run_as=user,
            warm=self._warm,
        )
        with self._tasks_lock:
            self._tasks[run.key] = run
            early = self._early.pop(run.key, [])
        for instruction in early:
            self._apply(run, instruction)
        run.start()

    def _task_spawned(self, run: TaskRun, procs: list[tuple[int, float]]) -> None:
        assert self._ledger is not None
        self._ledger.record(f"{run.task.job_id}-{run.task.attempt}", procs)

    def _task_done(self, run: TaskRun) -> None:
        # Called on the task's thread after its result is reported: tidying
        # up here costs the job nothing.
        if self._ledger is not None:
            self._ledger.forget(f"{run.task.job_id}-{run.task.attempt}")
        if self._warm is not None:
            self._warm.task_done()  # a zygote this task wanted is made now, not during it
        if self.run_as is not None:
            # What the task left (its inputs, its workspace) is out of every
            # later job's reach at once, while it is being removed.
            with contextlib.suppress(OSError):
                run.dir.chmod(0o700)
        spare = None
        if not self._stopping.is_set():
            # A workspace its job's user owned is never reused: another job
            # of that user could plant links in it before the next prepare.
            reused = None if self.run_as is not None else reuse_if_empty(run.dir)
            spare = reused or self._spare()
        if spare != run.dir:
            # Off this thread: it may go on to supervise the next task, whose
            # pipes must not wait for a big workspace to be deleted.
            self._remover.remove(run.dir)
        with self._tasks_lock:
            if self._tasks.get(run.key) is run:  # not a newer task of the same key
                del self._tasks[run.key]
            if spare is not None:
                self._spares.append(spare)
            uid = self._uids.pop(run.key, None)
            waiting = self._held.get(uid, []) if uid is not None else []
            released = waiting.pop(0) if waiting else None
            if uid is not None and not waiting:
                self._held.pop(uid, None)
            self._idle.notify_all()
        if released is not None:  # its processes are gone: the next job of its user starts
            self._start_task(*released)

    def _release_containment(self) -> None:
        warm, self._warm = self._warm, None
        if warm is not None:  # its zygotes go; their children were tasks, ended by now
            warm.close()
        held, self._containment = self._containment, None
        if held is not None:  # its warden, let go of already, leaves with it
            release_containment(held, leaving=[] if self._warden is None else [self._warden.pid])

    def running(self) -> int:
        with self._tasks_lock:
            return len(self._tasks)

    def stop(self, timeout: float | None = None) -> None:
        """End running tasks (reported lost), then leave the control plane.
        Once stopped, again is nothing (a stop that failed may be tried again)."""
        with self._stop_lock:
            if self._stopped:
                return
            all_ended = False
            try:
                all_ended = self._stop(timeout)
                # A task that outlived the wait: stop() again, once it has
                # ended, tidies up what is left.
                self._stopped = all_ended
            finally:
                # A task that outlived the wait still uses its GPUs: they stay
                # claimed while this worker object lives.
                if all_ended or not self.serving:
                    self._claim.release()

    def _stop(self, timeout: float | None) -> bool:
        self._stopping.set()
        if self.info.id:  # first, so nothing more is placed here while the tasks end
            with contextlib.suppress(GPUlayerError):  # not heard: handed back (see _start_task)
                self.transport.heartbeat(self.info.id, stopping=True)
        if self.serving:
            assert self._thread is not None
            # Its long poll ends now; what that brought is handed back first.
            self._thread.join(_LOOP_END_S if timeout is None else min(timeout, _LOOP_END_S))
        with self._tasks_lock:
            runs = list(self._tasks.values())
        for run in runs:
            run.stop("lost")
        with self._tasks_lock:
            all_ended = self._idle.wait_for(lambda: not self._tasks, timeout)
        self._logs.stop()
        if self._sampler is not None:
            self._sampler.stop()
        if self._beats is not None:  # ends as it sees _stopping, unless a beat is on its way
            self._beats.join(1.0)
        # Reports the server (or, embedded, the store) would not take yet: a
        # while to go, not forever (the next process on the home recovers
        # what they were about).
        if not self._outbox.flush(_OUTBOX_STOP_S if timeout is None else timeout):
            log.warning(
                "worker %s: stopping with %d report(s) undelivered",
                self.info.id,
                self._outbox.pending(),
            )
        self._outbox.stop()
        # Results still kept go now if the server is back. If not, no goodbye:
        # the server would take their tasks for lost, and the next worker on
        # this home would deliver them too late.
        goodbye = True
        if self._ledger is not None:
            with contextlib.suppress(ServerUnreachable):
                self._deliver_kept(self._ledger)
            goodbye = not self._ledger.holds_results()
        # If the server is away, it declares us lost when our heartbeats stop.
        # After any registration the acquire loop has under way, not before it.
        if goodbye:
            with self._registering, contextlib.suppress(GPUlayerError):
                self._goodbye()
        if all_ended:
            self._remover.wait(timeout)
            if self.tasks_dir is not None:
                shutil.rmtree(self.tasks_dir, ignore_errors=True)
            if self._ledger is not None:
                self._ledger.close()
            if self._warden is not None:
                self._warden.release()
            self._release_containment()
        # Else a task outlived the wait: its folder and the ledger stay, for
        # the next worker on this home to end what is left and tidy up.
        return all_ended


def _run_as(user: str, work_dir: Path, cache: ArtifactStore, slots: int = 1) -> tuple[RunAs, ...]:
    """The user of each of the ``slots`` slots (``--run-as``, one user or
    one per slot), once it is known their jobs can run: WorkerError if not.

    Its jobs go down through the worker's folders to their own, and may
    list or read nothing else of the worker's: the folder of the workers'
    task folders lets them through only, and the cache and the ledger
    (``live/``) are the worker's alone. Each mode is set, not left to the
    umask."""
    users = RunAs.for_slots(user, slots)
    if work_dir.resolve().is_relative_to(cache.root.resolve()):
        raise WorkerError(
            f"--run-as {user}: the cache {cache.root} holds the workers' folder {work_dir}; "
            "a cache is closed to the jobs: give it a folder of its own (--cache)"
        )
    if not work_dir.parent.exists():  # the home: made to be gone through
        work_dir.parent.mkdir(parents=True, exist_ok=True)
        work_dir.parent.chmod(_THROUGH_ONLY)
    work_dir.mkdir(exist_ok=True)
    work_dir.chmod(_THROUGH_ONLY)
    cache.close_to_others()
    for run_as in dict.fromkeys(users):
        blocked = run_as.can_reach(work_dir)
        if blocked is not None:
            raise WorkerError(
                f"--run-as {user}: its jobs could not reach their folders in {work_dir}: "
                f"{blocked} does not let {run_as.name} through; use a home it can go down to "
                "(folders of mode 0711 or 0755 above it)"
            )
        if run_as.can_reach(Path(sys.executable).parent) is not None:
            log.warning(
                "--run-as %s: %s cannot reach this worker's Python (%s), which runs script "
                "jobs; command jobs naming another interpreter still run",
                user,
                run_as.name,
                sys.executable,
            )
    return users
