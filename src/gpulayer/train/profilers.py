"""Profilers: where a ``fit``/``validate``/``test``/``predict`` call spends
its time, as Lightning's ``Trainer(profiler=...)`` reports it.

``gpulayer.train.profilers`` stands in for ``lightning.pytorch.profilers``::

    Profiler                 the base: start/stop/profile(action), summary(), describe()
    ├── PassThroughProfiler  records nothing: the Trainer's default
    ├── SimpleProfiler       wall time of each action (time.perf_counter)
    └── AdvancedProfiler     cProfile of each action, reported by pstats

Lightning's ``PyTorchProfiler`` and ``XLAProfiler`` are refused where a port
imports them (``from gpulayer.train.profilers import PyTorchProfiler``),
saying what to use instead.

The Trainer names its actions as Lightning does (``run_training_epoch``,
``[LightningModule]Net.on_train_batch_end``, ``[Callback]<state_key>.<hook>``,
``[Strategy]SingleDeviceStrategy.training_step``...). Timing is on the host
only: nothing here waits for the device, so on a GPU an action's time is the
time to *launch* its work.

A Trainer without a profiler pays nothing per step: :func:`active` is None
for a PassThroughProfiler, and then :func:`timed`, :func:`timed_hook`,
:func:`timed_step` and :func:`timed_iter` hand back the very callable or
iterable they were given, which the loops bind once per epoch.
"""

from __future__ import annotations

import cProfile
import functools
import io
import marshal
import math
import os
import pstats
import re
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from gpulayer.train.callbacks import Callback
from gpulayer.train.datamodule import LightningDataModule
from gpulayer.train.errors import TrainerError

if TYPE_CHECKING:
    from gpulayer.train.fit import Run

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

#: Lightning's other ``Trainer(profiler="...")`` names, refused with what to do instead.
_REFUSED_NAMES = {
    "pytorch": "PyTorchProfiler",
    "xla": "XLAProfiler",
}
#: Characters Lightning replaces in report file names; GPUlayer refuses them
#: in ``filename`` (a path separator would write outside ``dirpath``).
_UNSAFE = re.compile(r"[\\/:*?\"<>|\x00-\x1f]")


def _check_filename(filename: object) -> str | None:
    if filename is None:
        return None
    if not isinstance(filename, str) or not filename or _UNSAFE.search(filename):
        raise TrainerError(
            f"filename={filename!r} must be a plain file name (no path separators, no "
            f'\\ / : * ? " < > | or control characters) or None; the report goes to '
            f"dirpath/<stage>-<filename>.txt, so give the folder as dirpath"
        )
    if filename.strip(". ") == "":
        raise TrainerError(f"filename={filename!r} must be a file name, not dots or spaces")
    return filename


def _check_dirpath(dirpath: object) -> Path | None:
    if dirpath is None:
        return None
    if not isinstance(dirpath, str | Path) or str(dirpath) == "" or "\x00" in str(dirpath):
        raise TrainerError(f"dirpath={dirpath!r} must be a local folder (a str or Path) or None")
    if "://" in str(dirpath):
        raise TrainerError(
            f"dirpath={dirpath!r} is a remote URL; GPUlayer's profilers write to a local "
            f"folder only: give one, and copy the report yourself"
        )
    return Path(dirpath)


def _append_text(path: Path, text: str) -> None:
    """Append to ``path``, never through a symbolic link planted there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise TrainerError(f"cannot write the profiler report {path}: {exc}") from exc
    with os.fdopen(fd, "a", encoding="utf-8") as out:
        out.write(text)


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise TrainerError(
            f"the profiler report {path} is a symbolic link; GPUlayer does not write "
            f"through links: remove it or choose another dirpath or filename"
        )


class Profiler(ABC):
    """Records actions by name; :meth:`describe` reports them.

    Subclass it for a profiler of your own: ``start(action)`` and
    ``stop(action)`` are called around each action (never nested under the
    same name), ``summary()`` returns the report. With ``filename``, the
    report is appended to ``dirpath/<stage>-<filename>.txt`` (``dirpath``
    defaults to the Trainer's ``log_dir``), one file per rank when
    distributed (``-<global rank>`` added); without it, global rank 0 prints it.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        self.dirpath: Path | None = _check_dirpath(dirpath)
        self.filename: str | None = _check_filename(filename)
        self._stage: str | None = None
        self._local_rank: int | None = None
        # Set by the Trainer (see attach): files are named by the global rank,
        # so that nodes writing to one shared folder do not share a file.
        self._global_rank: int | None = None

    @abstractmethod
    def start(self, action_name: str) -> None:
        """Start recording ``action_name``."""

    @abstractmethod
    def stop(self, action_name: str) -> None:
        """Stop recording ``action_name``, started before."""

    def summary(self) -> str:
        """The report of what was recorded; empty if there is nothing to say."""
        return ""

    @contextmanager
    def profile(self, action_name: str) -> Iterator[str]:
        """``with profiler.profile("load"):`` records the block as ``"load"``."""
        self.start(action_name)
        try:
            yield action_name
        finally:
            self.stop(action_name)

    def setup(
        self, stage: str, local_rank: int | None = None, log_dir: str | Path | None = None
    ) -> None:
        """Called by the Trainer when a call starts (``stage``: "fit", "validate"...)."""
        self._stage = stage
        self._local_rank = local_rank
        if self.dirpath is None and log_dir is not None:
            self.dirpath = Path(log_dir)

    def teardown(self, stage: str | None) -> None:  # noqa: B027 - optional, as in Lightning
        """Called by the Trainer when a call ends (also after a failure)."""

    def describe(self) -> None:
        """Write the report (the file) or print it (rank 0), as the Trainer does at a
        call's end; it can also be called directly."""
        text = self.summary()
        path = self.report_path()
        if text and path is not None:
            _append_text(path, text)
        elif text and self._global_rank in (None, 0):
            print(text)
        self.teardown(self._stage)

    def report_path(self) -> Path | None:
        """The file :meth:`describe` appends to, or None when it prints."""
        if not (self.filename and self.dirpath):
            return None
        return self.dirpath / self._prepare_filename()

    def _prepare_filename(self, action_name: str | None = None, extension: str = ".txt") -> str:
        parts = [p for p in (self._stage, self.filename) if p]
        if self._global_rank is not None:
            parts.append(str(self._global_rank))
        if action_name is not None:
            parts.append(action_name)
        # Action names come from code (and from profile("...") calls): made safe.
        base = re.sub(r"_+", "_", _UNSAFE.sub("_", "-".join(parts))).strip(" .")
        return (base or "profile") + extension

    @property
    def local_rank(self) -> int:
        return 0 if self._local_rank is None else self._local_rank


class PassThroughProfiler(Profiler):
    """Records nothing; the Trainer skips timing altogether with it."""

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass


class SimpleProfiler(Profiler):
    """The wall time of each action, measured with ``time.perf_counter`` on the host.

    The report is Lightning's table: Action, Mean duration (s), Num calls,
    Total time (s), Percentage % of the time since the profiler was made
    (``extended=False``: Action, Mean duration, Total time). As in Lightning,
    the durations add up over the calls a Trainer makes.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        extended: bool = True,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        if not isinstance(extended, bool):
            raise TrainerError(f"extended={extended!r} must be True or False")
        self.extended = extended
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: defaultdict[str, list[float]] = defaultdict(list)
        self.start_time = time.perf_counter()

    def start(self, action_name: str) -> None:
        if action_name in self.current_actions:
            raise TrainerError(
                f"profiler action {action_name!r} was started again before it stopped; "
                f"give nested actions different names"
            )
        self.current_actions[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        end = time.perf_counter()
        started = self.current_actions.pop(action_name, None)
        if started is None:
            raise TrainerError(f"profiler action {action_name!r} was stopped but never started")
        self.recorded_durations[action_name].append(end - started)

    def teardown(self, stage: str | None) -> None:
        # A call that failed may leave actions open; the next call starts clean.
        self.current_actions.clear()

    def summary(self) -> str:
        sep = os.linesep
        title = f"{self._stage.upper()} " if self._stage else ""
        out = f"{title}Profiler Report{sep}"
        if not self.recorded_durations:
            return out + f"{sep}(no actions recorded){sep}"
        width = max(len(k) for k in self.recorded_durations)

        def row(*cells: str) -> str:
            first, rest = cells[0], cells[1:]
            return f"{sep}|  {first:<{width}s}\t|" + "".join(f"  {c:<15}\t|" for c in rest)

        if self.extended:
            header = row(
                "Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %"
            )
        else:
            header = row("Action", "Mean duration (s)", "Total time (s)")
        rule = sep + "-" * len(header.expandtabs())
        out += rule + header + rule
        if self.extended:
            total = time.perf_counter() - self.start_time
            rows = [
                (a, math.fsum(d) / len(d), len(d), math.fsum(d), 100.0 * math.fsum(d) / total)
                for a, d in self.recorded_durations.items()
            ]
            rows.sort(key=lambda r: r[4], reverse=True)
            calls = sum(r[2] for r in rows)
            out += row("Total", "-", f"{calls}", f"{total:.5}", "100 %") + rule
            for action, mean, count, summed, share in rows:
                out += row(action, f"{mean:.5}", f"{count}", f"{summed:.5}", f"{share:.5}")
        else:
            short = [
                (a, math.fsum(d) / len(d), math.fsum(d)) for a, d in self.recorded_durations.items()
            ]
            short.sort(key=lambda r: r[1], reverse=True)
            for action, mean, summed in short:
                out += row(action, f"{mean:.5}", f"{summed:.5}")
        return out + rule + sep


class AdvancedProfiler(Profiler):
    """``cProfile`` per action: each action's functions, sorted by cumulative time.

    ``line_count_restriction`` limits the functions listed per action: an int
    (that many) or a fraction in [0, 1]. ``dump_stats=True`` also writes each
    action's raw profile to ``dirpath/<stage>-<filename>-<action>.prof``
    (``pstats.Stats(path)`` reads it). Only one ``cProfile`` runs at a time,
    so an action started inside another pauses it until it stops (Lightning
    leaves the outer one paused). Each call's report covers that call.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        line_count_restriction: float = 1.0,
        dump_stats: bool = False,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        limit = line_count_restriction
        if isinstance(limit, bool) or not (
            (isinstance(limit, int) and limit >= 0)
            or (isinstance(limit, float) and 0.0 <= limit <= 1.0)
        ):
            raise TrainerError(
                f"line_count_restriction={limit!r} must be an int >= 0 (functions per "
                f"action) or a float in [0.0, 1.0] (a fraction of them)"
            )
        if not isinstance(dump_stats, bool):
            raise TrainerError(f"dump_stats={dump_stats!r} must be True or False")
        self.line_count_restriction = limit
        self.dump_stats = dump_stats
        self.profiled_actions: dict[str, cProfile.Profile] = {}
        self._running: list[str] = []

    def start(self, action_name: str) -> None:
        if action_name in self._running:
            raise TrainerError(
                f"profiler action {action_name!r} was started again before it stopped; "
                f"give nested actions different names"
            )
        if self._running:
            self.profiled_actions[self._running[-1]].disable()
        self._running.append(action_name)
        self.profiled_actions.setdefault(action_name, cProfile.Profile()).enable()

    def stop(self, action_name: str) -> None:
        if action_name not in self._running:
            raise TrainerError(f"profiler action {action_name!r} was stopped but never started")
        self.profiled_actions[action_name].disable()
        self._running.remove(action_name)
        if self._running:
            self.profiled_actions[self._running[-1]].enable()

    def summary(self) -> str:
        sep = os.linesep
        title = f"{self._stage.upper()} " if self._stage else ""
        parts = [f"{title}Profiler Report"]
        rank = f" rank: {self._global_rank}" if self._global_rank is not None else ""
        for action, prof in self.profiled_actions.items():
            if self.dump_stats:
                self._dump(action, prof)
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text).strip_dirs().sort_stats("cumulative")
            stats.print_stats(self.line_count_restriction)
            parts += [f"Profile stats for: {action}{rank}", text.getvalue()]
        return sep.join(parts)

    def _dump(self, action: str, prof: cProfile.Profile) -> None:
        if self.dirpath is None:
            raise TrainerError(
                "AdvancedProfiler(dump_stats=True) needs a folder: give dirpath=, or run "
                "it under a Trainer (which gives its log_dir)"
            )
        path = self.dirpath / self._prepare_filename(action_name=action, extension=".prof")
        _refuse_link(path)
        raw = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        self.dirpath.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        # What pstats.Stats.dump_stats writes, without following a planted link.
        with os.fdopen(os.open(path, flags, 0o644), "wb") as out:
            marshal.dump(raw, out)

    def teardown(self, stage: str | None) -> None:
        for prof in self.profiled_actions.values():
            prof.disable()
        self.profiled_actions.clear()
        self._running.clear()


def _refused(name: str) -> TrainerError:
    return TrainerError(
        f"{name} is a Lightning profiler GPUlayer does not provide: use "
        f"profiler='simple' or 'advanced', or run torch.profiler.profile() yourself "
        f"(around fit(), or started and stopped in a Callback's hooks)"
    )


def __getattr__(name: str) -> Any:
    # `from gpulayer.train.profilers import PyTorchProfiler` in a ported script
    # fails here, naming the profiler, rather than with a bare ImportError.
    if name in _REFUSED_NAMES.values():
        raise _refused(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_profiler(value: object) -> Profiler:
    """``Trainer(profiler=...)``: None, "simple", "advanced" or a Profiler."""
    if value is None:
        return PassThroughProfiler()
    if isinstance(value, Profiler):
        return value
    if isinstance(value, str):
        name = value.lower()  # as Lightning
        if name == "simple":
            return SimpleProfiler()
        if name == "advanced":
            return AdvancedProfiler()
        if name in _REFUSED_NAMES:
            raise TrainerError(f"Trainer(profiler={value!r}): {_refused(_REFUSED_NAMES[name])}")
    kind = type(value)
    if kind.__module__.startswith("lightning") or kind.__module__.startswith("pytorch_lightning"):
        raise TrainerError(
            f"profiler={kind.__name__}(...) is Lightning's own object; import it from "
            f"gpulayer.train.profilers instead"
        )
    raise TrainerError(
        f"profiler={value!r} is not supported; valid values: 'simple', 'advanced', "
        f"a gpulayer.train.profilers.Profiler, or None"
    )


def active(profiler: Profiler) -> Profiler | None:
    """The profiler the loops should time with, or None when it records nothing."""
    return None if type(profiler) is PassThroughProfiler else profiler


def attach(
    profiler: Profiler, stage: str, local_rank: int, global_rank: int, world: int, log_dir: Path
) -> None:
    """Set the profiler up for a call, as Lightning's Trainer does."""
    distributed = world > 1
    profiler._global_rank = global_rank if distributed else None
    profiler.setup(stage=stage, local_rank=local_rank if distributed else None, log_dir=log_dir)
    path = profiler.report_path()
    if path is not None:
        _refuse_link(path)  # before any work, not after hours of training


# -- what the loops call ------------------------------------------------------


def timed(profiler: Profiler | None, action: str, fn: F) -> F:
    """``fn`` itself without a profiler; else ``fn`` recorded as ``action``."""
    if profiler is None:
        return fn
    start, stop = profiler.start, profiler.stop

    def recorded(*args: Any, **kwargs: Any) -> Any:
        start(action)
        try:
            return fn(*args, **kwargs)
        finally:
            stop(action)

    # Its name for tracebacks; not its __dict__ (fn may be a DDP-wrapped module).
    return cast(F, functools.update_wrapper(recorded, fn, updated=()))


def timed_iter(profiler: Profiler | None, action: str, iterable: Iterable[T]) -> Iterable[T]:
    """``iterable`` itself without a profiler; else each ``next()`` recorded as ``action``
    (the last one too, that finds the end)."""
    if profiler is None:
        return iterable
    # iter() now, where the loop would call it: a DataLoader draws its seed there.
    return _timed_iter(profiler, action, iter(iterable))


def _timed_iter(profiler: Profiler, action: str, iterator: Iterator[T]) -> Iterator[T]:
    while True:
        profiler.start(action)
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            profiler.stop(action)
        yield item


def action_name(owner: object, name: str) -> str:
    """Lightning's name for hook ``name`` of ``owner``."""
    if isinstance(owner, Callback):
        return f"[Callback]{owner.state_key}.{name}"
    if isinstance(owner, LightningDataModule):
        return f"[LightningDataModule]{type(owner).__name__}.{name}"
    return f"[LightningModule]{type(owner).__name__}.{name}"


def timed_hook(run: Run, name: str, owner: object = None) -> Callable[..., Any]:
    """The bound hook ``name`` of ``owner`` (the run's module by default), timed
    under Lightning's name when the run has a profiler."""
    target = run.module if owner is None else owner
    fn: Callable[..., Any] = getattr(target, name)
    if run.profiler is None:
        return fn
    return timed(run.profiler, action_name(target, name), fn)


def timed_step(run: Run, name: str, fn: F) -> F:
    """``fn`` timed as Lightning's strategy step ``name`` (training_step, backward...)."""
    if run.profiler is None:
        return fn
    kind = "DDPStrategy" if run.env.distributed else "SingleDeviceStrategy"
    return timed(run.profiler, f"[Strategy]{kind}.{name}", fn)
