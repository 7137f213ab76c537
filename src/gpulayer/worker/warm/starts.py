"""A worker's warm starts (:class:`WarmStarts`): its zygotes by user, key
and kind (full or light), made as tasks need them, and the choice, for each
task, of the zygote to fork from or why it starts cold;
:func:`from_environment` reads ``GPULAYER_WARM`` and ``GPULAYER_PRELOAD``."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...errors import WorkerError
from .. import zygote as protocol
from ..process import RunAs
from .handle import Zygote
from .keys import Key, _describe, _not_for_a_zygote, key_of, read_at_start
from .light import imports_only

log = logging.getLogger(__name__)

DEFAULT_PRELOAD = ("torch", "numpy")
WARM_ENV = "GPULAYER_WARM"
WARM_MODES = ("0", "1", "eager", "ready")
# What the direct launcher adds that a zygote reads (launch.cpu_threads).
RANK_SETTINGS = {b"OMP_NUM_THREADS": b"1"}
PRELOAD_ENV = "GPULAYER_PRELOAD"
MAX_ZYGOTES = 3  # per worker and user: each holds its own copy of torch (~200 MB)
MAX_LIGHT = 3  # light ones (no preload, ~10 MB each), per worker and user: a limit of their own
MAX_REMAKES = 5  # a zygote that died this often is not made again
READY_TIMEOUT_S = 300.0  # for the zygote's imports, on a slow disk
STARTED_TIMEOUT_S = 10.0  # for a zygote to be past its start (see WarmStarts)


Slot = tuple[int | None, Key, bool]  # (uid, key, light): one zygote each


class WarmStarts:
    """The zygotes of one worker process, by key, made as tasks need them.

    With a preload, each key may have two: the *full* one, which imported
    it, and a *light* one, which imported nothing (a plain Python of a few
    MB: its forks copy and unmap little). A script that evidently needs
    only the standard library (:func:`imports_only`) is forked from the
    light one. A wrong guess costs time only: a light fork that imports
    torch imports it, as a cold start would."""

    def __init__(
        self,
        base_env: Mapping[bytes, bytes],
        *,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        eager: bool = False,
        users: Sequence[RunAs | None] = (None,),
        max_zygotes: int = MAX_ZYGOTES,
    ) -> None:
        """``eager``: the zygotes for the worker's own settings are made now
        (a worker of its own, which lives long); else once the first script
        task has run (embedded, where the program may run just one job: the
        zygote's imports would only compete with it for the CPU).

        ``users``: whom the jobs run as (``--run-as``; None: the worker's
        user). Each has zygotes of its own, run as it, ``max_zygotes`` full
        ones at most, and ``MAX_LIGHT`` light ones."""
        self.base_env = dict(base_env)
        self.preload = tuple(preload)
        self.max_zygotes = max_zygotes
        self.users = list(dict.fromkeys(users))
        # With nothing preloaded, the full zygote is a light one: one kind.
        self.light = bool(self.preload)
        self._light_imports = frozenset(sys.stdlib_module_names) - {
            name.partition(".")[0] for name in self.preload
        }
        self._lock = threading.Lock()
        self._made = threading.Condition(self._lock)  # as the wanted ones are made
        self._zygotes: dict[Slot, Zygote] = {}
        # To make once the task that wanted it is done.
        self._wanted: list[tuple[Key, RunAs | None, bool]] = []
        self._closed = False
        self._deaths: dict[Slot, int] = {}
        self.default_key = key_of(self.base_env)
        if eager:
            for user in self.users:
                self._make(self.default_key, user)
            # Until each is past its start, its user's processes could read
            # its environment (as for any program, see credentials.py): a
            # worker of its own takes no job before.
            for zygote in self._zygotes.values():
                if zygote.proc is not None:
                    zygote.started.wait(STARTED_TIMEOUT_S)

    def _make(self, key: Key, user: RunAs | None, light: bool = False) -> Zygote | None:
        """Under no lock of a zygote's; with ``_lock`` held or at start. For
        the worker's own settings, both kinds are made together."""
        uid = None if user is None else user.uid
        made = self._make_one(key, user, light)
        if self.light and key == self.default_key and (uid, key, not light) not in self._zygotes:
            self._make_one(key, user, not light)
        return made

    def _make_one(self, key: Key, user: RunAs | None, light: bool) -> Zygote | None:
        uid = None if user is None else user.uid
        if self._count(uid, light) >= self._limit(light):
            return None
        env = {k: v for k, v in self.base_env.items() if not read_at_start(k)}
        env.update(key)
        if user is not None:
            env.update(user.env())
        # It never touches a GPU; should a preloaded module try, it finds none.
        env.update({b"CUDA_VISIBLE_DEVICES": b"", b"HIP_VISIBLE_DEVICES": b"-1"})
        env[b"ROCR_VISIBLE_DEVICES"] = b""
        zygote = Zygote(env, () if light else self.preload, key, user, light=light)
        self._zygotes[(uid, key, light)] = zygote
        return zygote

    def _count(self, uid: int | None, light: bool) -> int:
        return sum(1 for owner, _, kind in self._zygotes if owner == uid and kind == light)

    def _limit(self, light: bool) -> int:
        return MAX_LIGHT if light else self.max_zygotes

    def choose(
        self,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[bytes, bytes],
        run_as: RunAs | None = None,
    ) -> tuple[Zygote | None, str]:
        """The zygote to fork this task's process from, or None and why it
        starts cold: the light one for a script that needs no more, if it
        is ready, else the full one."""
        key = key_of(env)
        uid = None if run_as is None else run_as.uid
        light = self.light and imports_only(Path(cwd, argv[1]), cwd, self._light_imports)
        with self._lock:
            if self._closed:
                return None, "the worker is stopping"
            zygote, why = self._pick(uid, key, run_as, light, want=True) if light else (None, "")
            if zygote is None:
                # A light script takes the full one where it is ready (warm
                # still), but does not have one made for it.
                full, full_why = self._pick(uid, key, run_as, False, want=not light)
                zygote, why = full, (why if light and why else full_why)
        if zygote is None:
            return None, why
        shadow = _shadowed(argv, cwd, env, zygote.modules)
        if shadow is not None:
            return None, shadow
        return zygote, ""

    def _pick(
        self, uid: int | None, key: Key, run_as: RunAs | None, light: bool, *, want: bool
    ) -> tuple[Zygote | None, str]:
        """The ready zygote of this kind, or None and why (asking for it to
        be made, if ``want``); with ``_lock`` held."""
        slot = (uid, key, light)
        zygote = self._zygotes.get(slot)
        if zygote is not None and zygote.state == "dead":
            why = zygote.why or "the ready interpreter died"
            deaths = self._deaths[slot] = self._deaths.get(slot, 0) + 1
            if not zygote.info or deaths > MAX_REMAKES:
                # Died before it was ever ready, or again and again: it
                # would only die again, each time after an import of torch.
                zygote.state = "unready"
                zygote.why = f"{why}; not made again (it died {deaths} times)"
                return None, zygote.why
            # Made again when it dies; the task that finds it dead goes cold.
            del self._zygotes[slot]
            threading.Thread(target=zygote.close, daemon=True).start()
            self._make_one(key, run_as, light)
            return None, f"{why}; a new one is starting"
        if zygote is None:
            unsafe = _not_for_a_zygote(key, self.default_key)
            if unsafe is not None:
                return None, unsafe
            if not want:
                return None, "no ready interpreter for this job's settings"
            wanted = (key, run_as, light)
            mine = self._count(uid, light)
            mine += sum(
                1 for _, user, kind in self._wanted if (user and user.uid) == uid and kind == light
            )
            if mine >= self._limit(light) and wanted not in self._wanted:
                differs = _describe(key, self.default_key)
                return None, f"no ready interpreter for {differs} (at most {self._limit(light)})"
            if wanted not in self._wanted:
                self._wanted.append(wanted)
            if key == self.default_key:
                return None, "the ready interpreter starts once a first job has run"
            differs = _describe(key, self.default_key)
            return None, f"the ready interpreter for {differs} starts once this job has run"
        if zygote.state == "starting":
            return None, "the ready interpreter is still starting"
        if zygote.state != "ready":
            return None, zygote.why or f"the ready interpreter is {zygote.state}"
        return zygote, ""

    def task_done(self) -> None:
        """A task ended: make the zygotes tasks asked for (see ``eager``)."""
        with self._lock:
            if self._closed:
                return
            wanted, self._wanted = self._wanted, []
            for key, user, light in wanted:
                if ((None if user is None else user.uid), key, light) not in self._zygotes:
                    self._make(key, user, light)
            self._made.notify_all()

    def prepare(self, extra: Mapping[bytes, bytes] | None = None) -> list[Zygote]:
        """Make the (full) zygotes for the worker's settings with ``extra``
        over them now, for each of its jobs' users, where there are none
        (benchmarks, tests, a worker told to); for the worker's own
        settings, the light ones too."""
        key = key_of({**self.base_env, **(extra or {})})
        made = []
        with self._lock:
            if self._closed:
                return []
            for user in self.users:
                uid = None if user is None else user.uid
                zygote = self._zygotes.get((uid, key, False)) or self._make(key, user)
                if zygote is not None:
                    made.append(zygote)
        return made

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Whether every zygote made so far, or wanted by a task that ran,
        is ready, its child primed (for tests and benchmarks): waits up to
        ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._made.wait_for(lambda: not self._wanted or self._closed, timeout)
            zygotes = list(self._zygotes.values())
        return all(
            z.ready.wait(max(0.0, deadline - time.monotonic()))
            and z.state == "ready"
            and z.primed(max(0.0, deadline - time.monotonic()))
            for z in zygotes
        )

    @property
    def zygotes(self) -> list[Zygote]:
        with self._lock:
            return list(self._zygotes.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            zygotes, self._zygotes = list(self._zygotes.values()), {}
            self._made.notify_all()
        for zygote in zygotes:
            zygote.close()


def from_environment(
    base_env: Mapping[bytes, bytes],
    *,
    warm: bool | None,
    preload: Sequence[str] | None,
    eager: bool,
    users: Sequence[RunAs | None] = (None,),
) -> WarmStarts | None:
    """The worker's warm starts, or None (cold only): ``warm`` None reads
    ``GPULAYER_WARM`` (on unless "0"), ``preload`` None ``GPULAYER_PRELOAD``
    (a comma-separated list; empty: a zygote that imports nothing)."""
    mode = os.environ.get(WARM_ENV, "1") if warm is None else ("1" if warm else "0")
    if mode not in WARM_MODES:
        raise WorkerError(
            f"{WARM_ENV}={mode!r} is not one of {', '.join(WARM_MODES)} (0: every job starts "
            f"cold; 1: warm, the zygote made once a first job has run in this process, at once "
            f"in a worker of its own; eager: made at once; ready: made at once and waited for)"
        )
    if mode == "0" or not supported():
        return None
    if preload is None:
        listed = os.environ.get(PRELOAD_ENV)
        preload = DEFAULT_PRELOAD if listed is None else [m for m in listed.split(",") if m]
    env = dict(base_env)
    env.setdefault(b"PYTHONUNBUFFERED", b"1")  # as every task's (see TaskRun._launch)
    starts = WarmStarts(
        env, preload=preload, eager=eager or mode in ("eager", "ready"), users=users
    )
    if mode == "ready":
        starts.prepare(RANK_SETTINGS)  # the direct launcher's ranks' too
        if not starts.wait_ready():
            log.warning(
                "the worker's ready interpreters are not ready: %s",
                "; ".join(f"{z.state}: {z.why}" for z in starts.zygotes),
            )
    return starts


def supported() -> bool:
    """Linux's pidfds and /proc, which the worker's side relies on."""
    return (
        hasattr(os, "pidfd_open")
        and hasattr(signal, "pidfd_send_signal")
        and (os.path.isdir("/proc/self/task"))
    )


def _shadowed(
    argv: Sequence[str], cwd: Path, env: Mapping[bytes, bytes], modules: frozenset[str]
) -> str | None:
    """Where a cold start would import a module the zygote has, from the
    script's folder or the task's ``PYTHONPATH``: its own copy, not the
    zygote's."""
    script = Path(cwd, argv[1])
    folders = [os.path.dirname(os.path.realpath(script))]
    pythonpath = os.fsdecode(env.get(b"PYTHONPATH", b""))
    folders += protocol._pythonpath(pythonpath, os.fspath(cwd))
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            stem = name.partition(".")[0]
            if stem in modules and (name == stem or name.endswith((".py", ".so", ".pyc"))):
                return f"{os.path.join(folder, name)} would be imported instead of the preloaded {stem}"
    return None
