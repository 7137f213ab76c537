"""The public client: submit jobs, wait for them, read their logs and outputs."""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import msgspec

from . import bundle, defaults
from .arrays import MAX_ARRAY_TASKS, parse_array
from .errors import (
    ArtifactError,
    GPUlayerError,
    InvalidStateError,
    SpecError,
    TransportError,
    UnsafePathError,
    WaitTimeout,
    WorkerError,
)
from .home import resolve_home
from .ids import is_job_id
from .jobs import QUEUED, RUNNING, JobInfo, LogLine, WorkerInfo
from .outputs import UnsafeOutputError, shorten, tidy
from .projects import ProjectUsage
from .spec import ArtifactRef, JobSpec, check_input_name, parse_spec
from .transport import Transport, check_job_filter

if TYPE_CHECKING:
    from .embedded import Embedded
    from .worker.gpus import Gpu

log = logging.getLogger(__name__)

# progress(total_bytes) -> a context manager yielding an advance(nbytes) callable
Progress = Callable[[int, str], AbstractContextManager[Callable[[int], None]]]


def _no_progress(total: int, label: str) -> AbstractContextManager[Callable[[int], None]]:
    return nullcontext(lambda n: None)


def _give_up(given: float | None) -> float:
    """How long a long poll rides out a server that is away (see Client)."""
    name = "GPULAYER_RECONNECT_GIVE_UP_S"
    where = "reconnect_give_up"
    if given is None:
        raw = os.environ.get(name, "")
        if not raw.strip():
            return defaults.RECONNECT_GIVE_UP_S
        where = f"${name}"
        try:
            given = float(raw)
        except ValueError:
            raise GPUlayerError(f"{where} must be a number of seconds, got {raw!r}") from None
    if not 0 <= given < math.inf:  # NaN fails this too
        raise GPUlayerError(f"{where} must be a number of seconds, 0 or more, got {given!r}")
    return given


class Client:
    """A connection to a control plane: embedded (the default) or a server.

    ``Client()`` runs the control plane in this process with its state under
    the GPUlayer home (``home``, else ``$GPULAYER_HOME``, else ``~/.gpulayer``).
    With ``auto_worker`` (the default) an embedded client starts one local
    worker at its first submit if none runs; ``ensure_local_workers`` starts more.

    Against a server, waiting for a job and following its logs ride out the
    server restarting or a dropped connection for ``reconnect_give_up``
    seconds in all (else ``$GPULAYER_RECONNECT_GIVE_UP_S``, else
    ``defaults.RECONNECT_GIVE_UP_S``), then raise ServerUnreachable.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        home: str | os.PathLike[str] | None = None,
        auto_worker: bool = True,
        progress: Progress | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        reconnect_give_up: float | None = None,
    ) -> None:
        url = url or os.environ.get("GPULAYER_SERVER")
        self._progress = progress or _no_progress
        self._auto_worker = auto_worker
        # Worker processes started against a server (ensure_local_workers).
        self._local_workers: list[_LocalWorker] = []
        self._local_lock = threading.Lock()
        self._forwarders: list[threading.Thread] = []
        self._gpus: list[Gpu] | None = None  # this machine's, once local workers need them
        self._closed = False
        # Set as close() begins, before it waits for a start under way.
        self._closing = threading.Event()
        self.url = url
        self.home = resolve_home(home)
        self._embedded: Embedded | None = None
        # Handles on jobs not known to be final, oldest first: waiting on
        # one asks about these too (see Job.wait).
        self._unfinished: weakref.WeakValueDictionary[str, Job] = weakref.WeakValueDictionary()
        self._unfinished_lock = threading.Lock()
        if url:
            from .transport.http import HttpTransport

            self._token = token or os.environ.get("GPULAYER_TOKEN")
            ca = ca_file or os.environ.get("GPULAYER_CA_FILE")
            self._ca_file = str(ca) if ca else None
            self._transport: Transport = HttpTransport(
                url,
                token=self._token,
                ca_file=self._ca_file,
                reconnect_give_up=_give_up(reconnect_give_up),
            )
            return
        from .embedded import Embedded

        embedded = self._embedded = Embedded(self.home)
        self.home = embedded.home.path
        self._transport = embedded.transport

    # ---- lifecycle ----

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop local workers (their running jobs end as lost or are retried) and release the home."""
        if self._embedded is not None:
            self._embedded.close()
            self._embedded = None
        self._closing.set()
        signalled = set()
        for worker in list(self._local_workers):
            # Before the lock, which a start under way holds while it waits
            # for them (an unresponsive server, say): one not serving yet
            # exits at once, one serving ends its tasks first.
            if worker.proc.poll() is None:
                worker.proc.terminate()
                signalled.add(worker.proc.pid)
        with self._local_lock:
            self._closed = True
            procs = [w.proc for w in self._local_workers]
            for proc in procs:
                # Once each: a second SIGTERM stops a worker at once, leaving
                # its tasks to its warden (see cli.worker_start).
                if proc.pid not in signalled:
                    proc.terminate()
            for proc in procs:
                proc.wait()
            for thread in self._forwarders:
                thread.join()  # the worker exited: its stderr is at its end
            for proc in procs:
                if proc.stderr is not None:
                    proc.stderr.close()
            self._local_workers.clear()
            self._forwarders.clear()
        self._transport.close()

    @property
    def transport(self) -> Transport:
        return self._transport

    def ensure_local_workers(
        self,
        count: int,
        *,
        slots: int | None = None,
        kill_grace: float = defaults.KILL_GRACE_S,
        worker_token: str | None = None,
    ) -> list[WorkerInfo]:
        """Start workers on this machine until ``count`` run; returns them.

        Embedded, they are threads of this process. Against a server, they are
        ``gpulayer worker start`` processes connected to it (with
        ``worker_token``, else this client's token, which must then be an
        admin's), stopped when this client closes. ``slots`` sets a CPU-only
        worker's slot count (GPU workers have one per GPU); ``kill_grace`` is
        how long a cancelled or timed-out job gets between SIGTERM and SIGKILL.
        """
        if count < 0:
            raise GPUlayerError(f"ensure_local_workers needs a count of 0 or more, got {count}")
        if slots is not None and slots < 1:
            raise GPUlayerError(f"a worker needs at least one slot, got slots={slots}")
        if self._embedded is not None:
            workers = self._embedded.ensure_local_workers(count, slots=slots, kill_grace=kill_grace)
            return [w.info for w in workers]
        if self.url is None:
            raise GPUlayerError("this client is closed")
        return self._start_worker_processes(count, slots, kill_grace, worker_token or self._token)

    def _start_worker_processes(
        self, count: int, slots: int | None, kill_grace: float, token: str | None
    ) -> list[WorkerInfo]:
        import sys

        with self._local_lock:
            if self._closed:
                raise GPUlayerError("this client is closed")
            self._forget_ended_workers()
            missing = count - len(self._local_workers)
            if missing > 0:
                # As embedded: the machine's GPUs are split among the workers
                # started together, so that no two worker processes offer one.
                from .worker.gpulocks import unclaimed
                from .worker.gpus import detect_gpus, gpus_option, share_gpus

                if self._gpus is None:
                    self._gpus = detect_gpus()
                claimed = {(g.vendor, g.index) for w in self._local_workers for g in w.gpus}
                # Nor one that a worker started otherwise offers.
                free = unclaimed([g for g in self._gpus if (g.vendor, g.index) not in claimed])
                started = []
                for share in share_gpus(free, missing):
                    # Never a name in use: not after a worker ended and another replaces
                    # it, nor by another client of this process.
                    name = f"{socket.gethostname()}-local-{os.getpid()}-{next(_LOCAL_SERIALS)}"
                    argv = [sys.executable, "-m", "gpulayer.cli", "--server", str(self.url),
                            "worker", "start", "--name", name, "--kill-grace", str(kill_grace),
                            "--gpus", gpus_option(share)]  # fmt: skip
                    if not share and slots is not None:
                        argv += ["--slots", str(slots)]
                    env = dict(os.environ)
                    if token:
                        env["GPULAYER_TOKEN"] = token
                    if self._ca_file:
                        env["GPULAYER_CA_FILE"] = self._ca_file
                    proc = subprocess.Popen(
                        argv, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                    )
                    started.append(_LocalWorker(proc, share))
                    self._local_workers.append(started[-1])  # at once: close() stops it
                if self._closing.is_set():  # close() began meanwhile: these too
                    for worker in started:
                        worker.proc.terminate()
                failed = []
                for worker in started:  # each, so that every one that runs has its stderr read
                    try:
                        worker.id, forwarder = _await_registration(worker.proc)
                        self._forwarders.append(forwarder)
                    except WorkerError as exc:
                        failed.append(exc)
                if self._closing.is_set():
                    raise GPUlayerError("this client is closed")
                if failed:
                    self._forget_ended_workers()  # their GPUs may be offered again
                    raise failed[0]
            ids = {w.id for w in self._local_workers}
        return [w for w in self._transport.list_workers() if w.id in ids]

    def _forget_ended_workers(self) -> None:
        """Worker processes that ended count no more, and their GPUs are free."""
        self._local_workers = [w for w in self._local_workers if w.proc.poll() is None]

    # ---- jobs ----

    def submit(
        self,
        script: str | os.PathLike[str] | None = None,
        args: Sequence[str] = (),
        *,
        command: Sequence[str] | None = None,
        source: str | os.PathLike[str] | None = None,
        inputs: Mapping[str, str | os.PathLike[str]] | None = None,
        outputs: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
        gpus: int = 0,
        nodes: int = 1,
        procs_per_node: int = 1,
        launcher: str | None = None,
        priority: int = 0,
        max_retries: int = 0,
        timeout: float | None = None,
        name: str | None = None,
        labels: Mapping[str, str] | None = None,
        retry_delay: float | None = None,
        warm: bool = True,
        project: str | None = None,
        preemptible: bool = False,
        after: Sequence[Job | str] = (),
        after_any: Sequence[Job | str] = (),
        array: Iterable[int] | str | None = None,
        max_parallel: int | None = None,
    ) -> Job:
        """Validate, store and place a job. Nothing is stored if the spec is bad.

        ``secrets`` join the job's environment like ``env``, but their values
        are stored encrypted and never shown back: its record names them only.
        ``retry_delay``: seconds a retry waits (``max_retries``), doubled at
        each one (default: ``defaults.RETRY_DELAY_S``, doubling up to
        ``defaults.RETRY_DELAY_MAX_S``; 0 retries at once).
        ``warm=False``: the script starts in a new interpreter, never forked
        from the worker's ready one (docs/performance.md, "Warm start").
        ``project``: the project it goes into, one of its user's (default:
        the user's first; docs/operations.md, "Projects and quotas").
        ``preemptible``: it may be stopped for a job of higher priority and
        queued again, without using a retry (docs/operations.md, "Preemption").
        ``after``: jobs (or their ids) it waits for, to succeed: it is
        cancelled, saying why, if one fails. ``after_any``: jobs it waits
        for to end, whatever way (docs/scheduling.md, "Dependencies").
        ``array``: a sweep, one task per index (``range(100)``, or Slurm's
        ``"0-99%8"``), each reading its index as ``GPULAYER_ARRAY_INDEX``;
        ``max_parallel``: at most that many running at once
        (docs/scheduling.md, "Arrays").
        """
        fields: dict[str, Any] = {
            "args": [str(a) for a in args] if not isinstance(args, str) else args,
            "outputs": list(outputs) if not isinstance(outputs, str) else outputs,
            "env": dict(env or {}),
            "secrets": dict(secrets or {}),
            "gpus": gpus,
            "nodes": nodes,
            "procs_per_node": procs_per_node,
            "launcher": launcher,
            "priority": priority,
            "max_retries": max_retries,
            "timeout": timeout,
            "name": name,
            "labels": dict(labels or {}),
        }
        if retry_delay is not None:  # left out otherwise: a server before it refuses the field
            fields["retry_delay"] = retry_delay
        if warm is not True:  # as retry_delay: only when asked for (a non-bool is refused)
            fields["warm"] = warm
        if project is not None:
            fields["project"] = project
        if preemptible is not False:  # (a non-bool is refused, naming it)
            fields["preemptible"] = preemptible
        if array is not None:
            fields.update(_array_fields(array, max_parallel))
        elif max_parallel is not None:
            fields["max_parallel"] = max_parallel  # refused, naming it
        for key, jobs in (("after", after), ("after_any", after_any)):
            if jobs:
                fields[key] = _job_ids(key, jobs)
        if command is not None:
            fields["command"] = (
                [str(c) for c in command] if not isinstance(command, str) else command
            )
        source_dir = self._resolve_source(script, source, fields)
        # Validate everything before storing a byte (placeholders for artifacts).
        placeholder = "0" * 64
        draft = dict(fields)
        if source_dir is not None:
            draft["bundle"] = placeholder
        input_paths = self._check_inputs(inputs or {})
        draft["inputs"] = {n: {"kind": "file", "digest": placeholder} for n in input_paths}
        spec = parse_spec(draft)
        if source_dir is not None or input_paths:  # the real digests replace the placeholders
            if source_dir is not None:
                fields["bundle"], _ = self._pack_tree(source_dir, "source")
            fields["inputs"] = {name: self._pack_input(path) for name, path in input_paths.items()}
            spec = parse_spec(fields)
        return self._submit_spec(spec, source_dir)

    def _submit_spec(self, spec: JobSpec, source_dir: Path | None = None) -> Job:
        info = self._transport.submit(spec)
        if self._embedded is not None and self._auto_worker and not self._embedded.workers:
            self._embedded.ensure_local_workers(1)
        return Job(self, info, source_dir)

    def rerun(self, job_id: str, *, secrets: Mapping[str, str] | None = None) -> Job:
        """Submit a new job with the spec of job ``job_id`` (an id or a unique
        prefix): the same bundle, inputs, command, env, labels and limits.

        A secret's value is never handed back (a record names it only), so a
        job that had secrets is rerun only with each given again in
        ``secrets``; else SpecError naming them, and nothing is submitted.
        The bundle and inputs must still be stored (not freed since). A task
        of an array (``JOB:7``) is rerun as an array of that one index.
        """
        old = self._transport.get_job(job_id)
        spec = old.spec
        given = dict(secrets or {})
        missing = sorted(set(spec.secrets) - set(given))
        if missing:
            raise SpecError(
                "secrets",
                f"job {old.id} had the secret(s) {', '.join(missing)}, whose values are never "
                "handed back, so a rerun cannot carry them; give each again (gpulayer rerun "
                f"{old.id} --secret NAME, or rerun(secrets=...)); nothing was submitted",
            )
        extra = sorted(set(given) - set(spec.secrets))
        if extra:
            raise SpecError(
                f"secrets.{extra[0]}",
                f"job {old.id} had no secret {extra[0]}; a rerun runs the same spec "
                f"(its secrets: {', '.join(sorted(spec.secrets)) or 'none'})",
            )
        if given:
            spec = msgspec.structs.replace(spec, secrets=given)
        if spec.array_task is not None:  # one task again: an array of that one index
            spec = msgspec.structs.replace(spec, array=[spec.array_task.index], array_task=None)
        stored = [ref.digest for ref in spec.inputs.values()]
        if spec.bundle is not None:
            stored.append(spec.bundle)
        gone = self._transport.missing_blobs(stored)
        if not gone:
            # And each file their manifests list: a lookup also tells a
            # concurrent `gpulayer gc` that the blob is in use (gc.py).
            trees = [spec.bundle] if spec.bundle is not None else []
            trees += [ref.digest for ref in spec.inputs.values() if ref.kind == "dir"]
            files = {e.digest for d in trees for e in self._manifest(d).entries if e.digest}
            if self._transport.missing_blobs(files):
                gone = set(trees)
        if gone:
            raise ArtifactError(
                f"job {old.id}'s {'bundle' if spec.bundle in gone else 'inputs'} are no longer "
                "stored (freed since it ran?); submit it again from its files; nothing was submitted"
            )
        return self._submit_spec(parse_spec(spec))

    def _manifest(self, digest: str) -> bundle.Manifest:
        """The bundle manifest ``digest``, fetched into this client's cache if need be."""
        from .artifacts import ArtifactStore

        cache = ArtifactStore(self.home / "artifacts")
        self._transport.download_blob(digest, cache)
        return bundle.load(cache, digest)

    def _resolve_source(
        self,
        script: str | os.PathLike[str] | None,
        source: str | os.PathLike[str] | None,
        fields: dict[str, Any],
    ) -> Path | None:
        if script is not None and "command" in fields:
            raise SpecError("command", "give a script or a command, not both")
        src = Path(source).resolve() if source is not None else None
        if src is not None and not src.is_dir():
            raise SpecError("source", f"{source} is not a directory")
        if script is None:
            return src
        path = Path(script).resolve()
        if not path.is_file():
            raise SpecError("script", f"{script} does not exist or is not a file")
        src = src or path.parent
        try:
            fields["script"] = path.relative_to(src).as_posix()
        except ValueError:
            raise SpecError(
                "script", f"{script} is not inside the source directory {src}"
            ) from None
        return src

    def _check_inputs(self, inputs: Mapping[str, str | os.PathLike[str]]) -> dict[str, Path]:
        found = {}
        for name, raw in inputs.items():
            check_input_name(name)
            path = Path(raw).resolve()
            if not path.exists():
                raise SpecError(f"inputs.{name}", f"{raw} does not exist")
            found[name] = path
        return found

    def _pack_tree(self, root: Path, label: str) -> tuple[str, int]:
        manifest = bundle.scan(root, home=self.home)
        summary = bundle.summarize(manifest)
        log.info("%s bundle %s: %d files, %s", label, root, summary.files, _size(summary.bytes))
        if bundle.is_large(summary):
            biggest = ", ".join(f"{p} ({_size(s)})" for p, s in summary.largest)
            log.warning(
                "the %s bundle of %s is %s (largest: %s); list data in .gpulayerignore and pass it as an input",
                label,
                root,
                _size(summary.bytes),
                biggest,
            )
        files = {e.digest: root / e.path for e in manifest.entries if e.kind == "file" and e.digest}
        sizes = {e.digest: e.size for e in manifest.entries if e.kind == "file" and e.digest}
        missing = self._transport.missing_blobs(files)
        self._upload(missing, files, sizes, f"storing {label} {root.name}")
        return self._transport.upload_bytes(msgspec.json.encode(manifest)), summary.bytes

    def _pack_input(self, path: Path) -> ArtifactRef:
        if path.is_dir():
            digest, size = self._pack_tree(path, "input")
            return ArtifactRef(kind="dir", digest=digest, size=size)
        digest = bundle.file_digest(path)
        size = path.stat().st_size
        self._upload(
            self._transport.missing_blobs([digest]),
            {digest: path},
            {digest: size},
            f"storing input {path.name}",
        )
        return ArtifactRef(kind="file", digest=digest, size=size)

    def _upload(
        self,
        digests: Iterable[str],
        paths: Mapping[str, Path],
        sizes: Mapping[str, int],
        label: str,
    ) -> None:
        todo = {d: paths[d] for d in sorted(digests)}
        total = sum(sizes[d] for d in todo)
        bar = self._progress if total >= defaults.PROGRESS_MIN_BYTES else _no_progress
        with bar(total, label) as advance:
            self._transport.upload_blobs(todo, on_progress=advance)

    def job(self, job_id: str) -> Job:
        return Job(self, self._transport.get_job(job_id))

    def _track(self, job: Job) -> None:
        with self._unfinished_lock:
            self._unfinished[job.id] = job

    def _wait(self, job: Job, timeout: float | None) -> JobInfo:
        """Wait for ``job``; the reply also brings the records of other
        handles' jobs that ended meanwhile, so waiting on a batch of jobs one
        by one costs about one request per batch of ends, not one per job."""
        with self._unfinished_lock:
            also = list(itertools.islice(self._unfinished.keys(), defaults.WAIT_ALSO_MAX + 1))
        if job.id in also:
            also.remove(job.id)
        del also[defaults.WAIT_ALSO_MAX :]
        info, others, unknown = self._transport.wait_also(job.id, also, timeout)
        with self._unfinished_lock:
            for other in others:
                handle = self._unfinished.pop(other.id, None)
                if handle is not None:
                    handle.info = other
            for job_id in unknown:  # not this server's: asking again is no use
                self._unfinished.pop(job_id, None)
            if info.done:
                self._unfinished.pop(job.id, None)
        return info

    def jobs(
        self,
        *,
        state: str | Iterable[str] | None = None,
        limit: int | None = None,
        labels: Mapping[str, str] | None = None,
        array: Job | str | None = None,
    ) -> list[Job]:
        """Jobs newest first (a user's own, against a server), an array as
        its one row; with ``state``, only those in it (or in one of them);
        with ``labels``, only those carrying every label given, key and
        value exactly; with ``array`` (an array, or its id), its tasks by
        index. An unknown state raises GPUlayerError, embedded and against
        a server alike."""
        states = [state] if isinstance(state, str) else list(state or [])
        wanted = dict(labels or {})
        check_job_filter(states, wanted)  # the same words embedded and against a server
        of = array.id if isinstance(array, Job) else array
        if of is not None and limit is None:  # every task, embedded and against a server
            limit = MAX_ARRAY_TASKS
        found = self._transport.list_jobs(
            states=states, limit=limit, labels=wanted or None, **({"array": of} if of else {})
        )
        return [Job(self, info) for info in found]

    def cancel_jobs(self, *, labels: Mapping[str, str]) -> list[Job]:
        """Cancel every queued or running job (of the caller's) carrying every
        one of ``labels``; returns those cancelled, or whose cancel was asked
        for (a running job ends once its worker has ended it). A job that
        ended meanwhile is left out."""
        wanted = dict(labels)
        if not wanted:  # no filter would be every job: never by accident
            raise GPUlayerError("cancel_jobs needs at least one label to select jobs by")
        done: dict[str, Job] = {}
        # A listing holds at most LIST_JOBS_MAX, newest first: list again
        # until none is new (a running one stays running until its worker
        # has ended it, so it is known by id).
        while True:
            found = [
                job
                for job in self.jobs(
                    state=(QUEUED, RUNNING), labels=wanted, limit=defaults.LIST_JOBS_MAX
                )
                if job.id not in done
            ]
            if not found:
                return list(done.values())
            for job in found:
                try:
                    job.cancel()
                except InvalidStateError:  # it ended between the listing and now
                    continue
                done[job.id] = job

    def workers(self) -> list[WorkerInfo]:
        return self._transport.list_workers()

    def usage(self) -> list[ProjectUsage]:
        """Usage by project: GPU-hours over the last day and week, jobs
        running and waiting, GPUs held and quotas. Against a server, the
        projects your user belongs to, and your own jobs in the default
        project (an admin token: every project); embedded, one row,
        ``default``."""
        return self._transport.usage()


_LOCAL_SERIALS = itertools.count()  # numbers the local workers' names, in this process


@dataclass
class _LocalWorker:
    """A ``gpulayer worker start`` process this client started."""

    proc: subprocess.Popen[str]
    gpus: list[Gpu]
    id: str | None = None  # once it registered


_SERVING = re.compile(r"gpulayer: worker (\S+) \(.*\) serving ")


def _await_registration(proc: subprocess.Popen[str]) -> tuple[str, threading.Thread]:
    """Block until a worker process says it has registered; its id, and the
    thread that passes its further messages on to our stderr."""
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:  # "gpulayer: worker ID (N slots) serving URL" once registered
        serving = _SERVING.match(line)
        if serving:
            break
        said.append(line)
    else:
        code = proc.wait()
        proc.stderr.close()
        raise WorkerError(
            f"a local worker exited with code {code} before registering: {''.join(said)[-2000:]}"
        )
    import sys

    stream = proc.stderr

    def forward_lines() -> None:
        with stream:  # closed at its end, also if the worker ends before the client closes
            for line in stream:
                sys.stderr.write(line)

    forward = threading.Thread(target=forward_lines, daemon=True)
    forward.start()
    return serving.group(1), forward


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _array_fields(array: Iterable[int] | str, max_parallel: int | None) -> dict[str, Any]:
    """A spec's ``array`` and ``max_parallel`` from ``range(100)`` or ``"0-99%8"``."""
    if isinstance(array, str):
        indices, limit = parse_array(array)
        if limit is not None and max_parallel is not None and limit != max_parallel:
            raise SpecError(
                "max_parallel", f"{max_parallel} here, but the array says %{limit}: give one"
            )
        max_parallel = limit if max_parallel is None else max_parallel
    elif isinstance(array, Mapping) or not isinstance(array, Iterable):
        raise SpecError(
            "array", f"give indices as a list, a range or words such as 0-99%8, not {array!r}"
        )
    else:
        indices = list(array)
        if not indices:
            raise SpecError("array", "an array needs at least one index")
    fields: dict[str, Any] = {"array": indices}
    if max_parallel is not None:
        fields["max_parallel"] = max_parallel
    return fields


def _job_ids(field: str, jobs: object) -> list[str]:
    """``jobs`` (a Job, an id, or a list of them) as ids; SpecError naming
    ``field`` for anything else."""
    from .errors import SpecError

    if isinstance(jobs, (str, Job)):
        jobs = [jobs]
    if not isinstance(jobs, (list, tuple)):
        raise SpecError(field, f"give a job, a job id or a list of them, not {jobs!r}")
    ids = []
    for index, job in enumerate(jobs):
        if not isinstance(job, (str, Job)):
            raise SpecError(f"{field}[{index}]", f"give a job or a job id, not {job!r}")
        ids.append(job.id if isinstance(job, Job) else job)
    return ids


class Job:
    """A handle on a submitted job. Properties read the latest state."""

    def __init__(self, client: Client, info: JobInfo, source_dir: Path | None = None) -> None:
        self._client = client
        # The id names the folder its outputs are downloaded into: one from
        # a hostile or broken server ("/home/you", "../..") must go no further.
        if not is_job_id(info.id):
            raise TransportError(
                f"the control plane answered with {shorten(info.id)!r} as a job id, which is "
                "not one GPUlayer makes (a broken or hostile server?); nothing was done with it"
            )
        self.id = info.id
        self.info = info
        self._source_dir = source_dir
        if not info.done:
            client._track(self)

    @property
    def info(self) -> JobInfo:
        """The job's record, as last read."""
        return self._info

    @info.setter
    def info(self, info: JobInfo) -> None:
        if info.id != self.id:
            raise TransportError(
                f"asked about job {self.id}, the server answered about {shorten(info.id)!r}"
            )
        self._info = info

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.info.state}>"

    def refresh(self) -> JobInfo:
        self.info = self._client.transport.get_job(self.id)
        return self.info

    @property
    def status(self) -> str:
        return self.refresh().state

    @property
    def user(self) -> str | None:
        """Who submitted it (a token's user; embedded, the local user). None:
        a job from before jobs had users, or an admin's token without one."""
        return self.info.user

    @property
    def exit_code(self) -> int | None:
        return self.info.exit_code if self.info.done else self.refresh().exit_code

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent in each stage of the job's life (see ``jobs.STAGES``)."""
        return (self.info if self.info.done else self.refresh()).timings()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the job ends; return its final status.

        A final record never changes: a job already known to have ended (its
        end came with the reply to a wait on another job) costs no request.
        Against a server, it rides out the server restarting (see Client).
        """
        if not self.info.done:
            self.info = self._client._wait(self, timeout)
        if not self.info.done:
            raise WaitTimeout(f"job {self.id} is still {self.info.state} after waiting {timeout} s")
        return self.info.state

    def cancel(self) -> str:
        self.info = self._client.transport.cancel(self.id)
        return self.info.state

    def stream_logs(self, *, follow: bool = True, poll: float = 30.0) -> Iterator[LogLine]:
        """Yield log lines; with ``follow``, until the job ends (riding out a
        server restart: each line still comes once, see ``reconnect_give_up``)."""
        cursor = (0, 0)
        while True:
            chunk = self._client.transport.read_logs(self.id, cursor, poll if follow else 0.0)
            yield from chunk.lines
            cursor = chunk.cursor
            if chunk.done or (not follow and not chunk.lines):
                return

    def logs(self) -> str:
        """The job's output so far, as text (stdout and stderr interleaved)."""
        return "".join(line.render() + "\n" for line in self.stream_logs(follow=False))

    def download_outputs(self, dest: str | os.PathLike[str] | None = None) -> Path:
        """Copy the job's outputs (and its log) into ``gpulayer_runs/<job id>/``; return that path.

        Without ``dest``, the folder is beside the submitted script (or in the
        current directory for command jobs and jobs from elsewhere).

        Nothing is written or removed outside that folder, whatever the
        server's record says, and nothing at all unless every output can be
        written there: the whole plan is checked first. Every output's name,
        and every entry of a folder output, must be a relative path inside
        it, reached through no symbolic link, no longer than this system
        allows; no two outputs may be the same once normalised, nor one be
        inside an output that is a file, or at the log's ``logs.txt``. (One
        inside a folder output is written with that folder: workers before
        outputs were checked stored ``ckpt/**`` as the folder and again each
        path in it.) The first that is not raises UnsafeOutputError (or
        UnsafePathError, for a folder's entry) naming it, before anything
        is written. The folder itself must not be a symbolic link
        (UnsafePathError), and the job must have ended (InvalidStateError).
        """
        info = self.info if self.info.done else self.refresh()
        if not info.done:  # its outputs are stored as it ends
            raise InvalidStateError(
                f"job {self.id} is {info.state}: its outputs can be downloaded once it has ended"
            )
        base = (
            Path(dest)
            if dest is not None
            else (self._source_dir or Path.cwd()) / defaults.RUNS_DIRNAME / self.id
        )
        if base.is_symlink():
            raise UnsafePathError(
                f"{base} is a symbolic link: nothing is written through one; give the folder "
                f"it leads to ({os.path.realpath(base)}) if that is where the outputs go"
            )
        plan = _plan_outputs(info.outputs)  # before anything is written
        transport = self._client.transport
        from .artifacts import ArtifactStore, copy_file

        cache = ArtifactStore(self._client.home / "artifacts")
        manifests = {}
        for name, ref in plan.items():
            transport.download_blob(ref.digest, cache)
            if ref.kind == "dir":  # checked: no entry leaves its folder
                manifests[name] = bundle.load(cache, ref.digest)
        _check_room(base, plan, manifests)
        base.mkdir(parents=True, exist_ok=True)
        for name, ref in plan.items():  # none is inside another: each has its own room
            target = _make_room(base, name)
            if ref.kind == "file":
                blob = transport.download_blob(ref.digest, cache)
                copy_file(blob, target, 0o644)  # a private copy: the user may edit it
            else:
                bundle.materialize(
                    manifests[name], target, lambda d: transport.download_blob(d, cache)
                )
        _write_new(base / _LOG_NAME, self.logs())
        return base


_LOG_NAME = "logs.txt"  # a job's log, in its download folder


def _plan_outputs(outputs: Mapping[str, ArtifactRef]) -> dict[str, ArtifactRef]:
    """The outputs of a record to write, by normalised name, none inside
    another (one inside a folder output is left to that folder);
    UnsafeOutputError for a name that is unsafe, or that collides with
    another: the same once normalised, inside a file output, at the log."""
    names: dict[str, str] = {}  # normalised -> as the record has it
    for rel in outputs:
        name = tidy(rel)
        if name in names:
            raise UnsafeOutputError(
                rel, f"the same output as {names[name]!r} once normalised ({name!r})"
            )
        names[name] = rel
    folders = {name for name, rel in names.items() if outputs[rel].kind == "dir"}
    plan: dict[str, ArtifactRef] = {}
    for name in sorted(names, key=lambda n: n.split("/")):
        if name.split("/")[0] == _LOG_NAME and (name != _LOG_NAME or name in folders):
            raise UnsafeOutputError(names[name], f"the job's log is written at {_LOG_NAME}")
        within = None
        at = name
        while "/" in at:
            at = at.rpartition("/")[0]
            if at in names and at not in folders:
                raise UnsafeOutputError(names[name], f"inside output {at!r}, which is a file")
            within = at if at in folders else within
        if within is None:
            plan[name] = outputs[names[name]]
    return plan


def _path_limits(top: str) -> tuple[int, int]:
    """PATH_MAX (its NUL included) and NAME_MAX, in bytes, where ``top`` is
    (or would be made)."""
    at = top
    while not os.path.exists(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    try:
        path_max, name_max = os.pathconf(at, "PC_PATH_MAX"), os.pathconf(at, "PC_NAME_MAX")
    except (AttributeError, OSError, ValueError):  # no pathconf (Windows), or no answer
        return 4096, 255
    return (path_max if path_max > 0 else 1 << 30), (name_max if name_max > 0 else 1 << 30)


def _check_room(
    base: Path, plan: Mapping[str, ArtifactRef], manifests: Mapping[str, bundle.Manifest]
) -> None:
    """Refuse, before anything is written, an output that could not be
    written in ``base``: through a symbolic link or a file already there,
    or at a path longer than this system allows."""
    top = os.path.abspath(base)
    path_max, name_max = _path_limits(top)
    for name, ref in plan.items():
        at = Path(top)
        for part in name.split("/")[:-1]:
            at = at / part
            if at.is_symlink():
                raise UnsafeOutputError(
                    name, f"{at} is a symbolic link: nothing is written through one"
                )
            if not os.path.lexists(at):
                break  # made on the way: nothing in the way below it
            if not at.is_dir():
                raise UnsafeOutputError(name, f"{at} is a file, not a folder")
        paths = [name]
        if ref.kind == "dir":
            paths += [f"{name}/{e.path}" for e in manifests[name].entries]
        for rel in paths:
            size = len(os.fsencode(f"{top}/{rel}"))
            if size >= path_max:
                raise UnsafeOutputError(
                    name,
                    f"{shorten(rel)!r} in {shorten(top)} would be {size} bytes long, over "
                    f"the {path_max - 1} bytes this system allows a path",
                )
            for part in rel.split("/"):
                if len(part) * 4 > name_max and len(os.fsencode(part)) > name_max:
                    raise UnsafeOutputError(
                        name,
                        f"{shorten(rel)!r} has a name of {len(os.fsencode(part))} bytes, over "
                        f"the {name_max} this system allows a name",
                    )


def _make_room(base: Path, name: str) -> Path:
    """Where output ``name`` goes in ``base``, with nothing there any more.

    What was there (a file, a folder, a symbolic link: inside ``base``) is
    removed; a link is removed itself, never what it points to. Refuses a
    path through a symbolic link, which could lead out of ``base``.
    """
    *parents, last = name.split("/")
    at = base
    for part in parents:
        at = at / part
        if at.is_symlink():
            raise UnsafeOutputError(
                name, f"{at} is a symbolic link: nothing is written through one"
            )
        if not at.exists():
            at.mkdir()
        elif not at.is_dir():
            raise UnsafeOutputError(name, f"{at} is a file, not a folder")
    target = at / last
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.is_dir():
        shutil.rmtree(target)  # it removes links inside, never what they point to
    elif os.path.lexists(target):
        target.unlink()  # a FIFO or socket
    return target


def _write_new(path: Path, text: str) -> None:
    """Write ``path`` anew: a link or file there is replaced, never written through."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    with open(tmp, "x", encoding="utf-8") as f:
        f.write(text)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
