"""Cleaning a GPUlayer home (``gpulayer gc``): old jobs, and what only they needed.

A home keeps every job, its log and its blobs until told otherwise. A clean:

1. deletes the jobs that ended before the cutoff, with their log lines, in
   one write transaction of the store, and reads in it what the jobs left
   name (:meth:`Transaction.artifact_refs`); never a queued or running job;
2. keeps every blob those name in the home's stores (``artifacts/``, and
   ``worker-cache/`` of ``gpulayer worker start``), every blob a manifest
   among them lists (a bundle, a folder input or output), and every blob
   stored or looked up within ``HOME_GC_RECENT_S``, with what it lists if
   it is a manifest;
3. removes the other blobs, the temp files older than that, and the task
   folders no worker of the home will use again (:func:`leftover_folders`).

:func:`plan` only reads; :func:`apply` removes what a plan lists, checking
each thing again as it goes.

A submit in flight: the client looks up every blob it will name
(``missing_blobs``: :meth:`ArtifactStore.has`), which marks it used (its
mtime) before the job that names it is stored. A blob is removed by moving
it into a folder of this clean's own in ``tmp/`` (one rename), then looking
at its mtime again: marked since, it goes back. A lookup before the rename
is seen; one after it finds nothing, and the submit stores the blob again.

Links: nothing is followed. Folders are opened one component at a time,
relative to the home, with ``O_NOFOLLOW``; only regular files and real
folders are removed, never a symbolic link or what it points to, so
nothing outside the home is ever touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import bundle, defaults
from .artifacts import ArtifactStore
from .errors import GPUlayerError
from .home import take_lock
from .store import Store

# The stores of a home that a clean sweeps: the control plane's, and the
# cache of a `gpulayer worker start` that uses this home (its default).
STORES = ("artifacts", "worker-cache")
# A manifest is JSON that starts so (bundle.Manifest, encoded by msgspec);
# a blob that does not, or is larger than this, is not read as one.
_MANIFEST_START = b'{"entries":['
_MANIFEST_MAX_BYTES = 64 * 1024 * 1024
_HEX2 = re.compile(r"[0-9a-f]{2}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_INSTANCE = re.compile(r"[A-Za-z0-9_-]{1,128}")
_TOMB_PREFIX = "gc-"  # this clean's folder in tmp/ (one a crashed clean left is swept later)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Progress = Callable[[int, str], AbstractContextManager[Callable[[int], None]]]


@dataclass(frozen=True)
class Blob:
    """A blob found in one of the home's stores, as ``lstat`` saw it."""

    store: str  # one of STORES
    name: str  # its digest
    size: int
    mtime_ns: int
    nlink: int
    inode: tuple[int, int]  # (device, inode): links to one file free its bytes once


@dataclass(frozen=True)
class Temp:
    """A leftover in a store's ``tmp/``: a file, or a crashed clean's folder."""

    store: str
    name: str
    size: int
    folder: bool


@dataclass
class Plan:
    """What a clean removes (jobs: what it deleted, or would)."""

    jobs: int = 0
    log_lines: int = 0
    blobs: list[Blob] = field(default_factory=list)
    temps: list[Temp] = field(default_factory=list)
    folders: dict[str, int] = field(default_factory=dict)  # task folder -> bytes
    notes: list[str] = field(default_factory=list)  # what was left alone, and why


@dataclass
class Report:
    """What a clean removed (or, dry, would remove). Sizes are apparent
    sizes; a blob's bytes are freed only with its last link."""

    dry_run: bool
    jobs: int = 0
    log_lines: int = 0
    blobs: int = 0
    blob_bytes: int = 0  # freed: blobs whose last link went
    linked: int = 0  # of the blobs removed, those still linked elsewhere
    linked_bytes: int = 0
    temps: int = 0
    temp_bytes: int = 0
    folders: int = 0
    folder_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: ``removed 12 jobs (3,410 log lines), 85 blobs (1.2 GB), ...``."""
        parts = [
            f"{self.jobs:,} job{_s(self.jobs)} ({self.log_lines:,} log line{_s(self.log_lines)})",
            f"{self.blobs:,} blob{_s(self.blobs)} ({size(self.blob_bytes)})",
        ]
        if self.temps:
            parts.append(f"{self.temps:,} temp file{_s(self.temps)} ({size(self.temp_bytes)})")
        parts.append(f"{self.folders:,} task folder{_s(self.folders)} ({size(self.folder_bytes)})")
        line = ("would remove " if self.dry_run else "removed ") + ", ".join(parts)
        if self.linked:
            line += (
                f"; {self.linked:,} of the blobs ({size(self.linked_bytes)}) "
                f"{'are' if self.dry_run else 'were'} also linked elsewhere (a job's "
                "workspace, another cache), so their bytes stay until that link goes"
            )
        return line


def collect(
    home: Path,
    store: Store,
    *,
    older_than: float = defaults.HOME_GC_OLDER_THAN_S,
    dry_run: bool = False,
    now: float | None = None,
    progress: Progress | None = None,
) -> Report:
    """Clean ``home`` (whose job store is ``store``): :func:`plan`, then,
    unless ``dry_run``, :func:`apply`. ``now`` (seconds since the epoch)
    stands in for the clock in tests."""
    now = time.time() if now is None else now
    found = plan(home, store, older_than=older_than, dry_run=dry_run, now=now)
    if dry_run:
        return _would(found)
    return apply(home, found, now=now, progress=progress)


# -- plan -----------------------------------------------------------------------


class _DryRun(Exception):
    """Rolls the jobs' deletion back, once counted."""


def plan(home: Path, store: Store, *, older_than: float, dry_run: bool, now: float) -> Plan:
    """What a clean removes. The jobs are deleted here (in one transaction
    with reading what the others name), unless ``dry_run``: then they are
    counted, and the transaction rolled back. Nothing else is touched."""
    found = Plan()
    try:
        with store.transaction() as tx:
            found.jobs, found.log_lines = tx.delete_jobs_ended_before(now - older_than)
            refs = tx.artifact_refs()
            if dry_run:
                raise _DryRun
    except _DryRun:
        pass
    recent_ns = int((now - defaults.HOME_GC_RECENT_S) * 1e9)
    home_fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        blobs: list[Blob] = []
        for name in STORES:
            with _opened(home_fd, name) as store_fd:
                if store_fd is None:
                    _note_if_link(home_fd, name, found.notes)
                    continue
                blobs += _blobs(store_fd, name)
                found.temps += _temps(store_fd, name, recent_ns)
        keep = _named(home, refs) | _recent(home, blobs, recent_ns)
        found.blobs = choose_blobs(blobs, keep, recent_ns)
        found.folders = _leftover_folders(home, home_fd, store, found.notes)
    finally:
        os.close(home_fd)
    return found


def choose_blobs(found: Iterable[Blob], keep: Collection[str], recent_ns: int) -> list[Blob]:
    """The blobs to remove: those no job names (``keep``), untouched since ``recent_ns``."""
    return [b for b in found if b.name not in keep and b.mtime_ns < recent_ns]


def freed(blobs: Iterable[Blob], *, removed: bool = False) -> tuple[int, int, int, int]:
    """(blobs whose bytes are freed, those bytes, blobs still linked
    elsewhere, their bytes) once ``blobs`` are removed. A file's bytes go
    with its last link, and count once however many of its links go.
    ``nlink``: each one's link count as planned, or (``removed``) as seen
    just before it was removed (the last link saw 1)."""
    links: dict[tuple[int, int], list[Blob]] = {}
    for blob in blobs:
        links.setdefault(blob.inode, []).append(blob)
    counts = [0, 0, 0, 0]
    for same in links.values():
        gone = min(b.nlink for b in same) <= 1 if removed else len(same) >= same[0].nlink
        counts[0 if gone else 2] += len(same)
        counts[1 if gone else 3] += same[0].size
    return counts[0], counts[1], counts[2], counts[3]


def leftover_folders(
    folders: Iterable[str], ledgers: Mapping[str, str | None], live: Collection[str]
) -> list[str] | None:
    """The task folders (named by worker id) no worker will use again; None
    while a worker is starting (a ledger without its id yet: it may be about
    to take one of these ids over from a dead worker).

    ``ledgers``: each ledger in ``workers/live`` -> the worker id it names.
    A ledger's worker is alive, or dead with what it ran not yet ended by
    the next worker, which removes its folders itself: both kept. ``live``:
    the workers the store has of control planes still running (embedded
    workers keep no ledger)."""
    if any(worker is None for worker in ledgers.values()):
        return None
    named = set(ledgers.values()) | set(live)
    return sorted(f for f in folders if f not in named)


def _would(found: Plan) -> Report:
    report = Report(dry_run=True, jobs=found.jobs, log_lines=found.log_lines, notes=found.notes)
    n, nbytes, linked, linked_bytes = freed(found.blobs)
    report.blobs, report.blob_bytes = n + linked, nbytes
    report.linked, report.linked_bytes = linked, linked_bytes
    report.temps, report.temp_bytes = len(found.temps), sum(t.size for t in found.temps)
    report.folders, report.folder_bytes = len(found.folders), sum(found.folders.values())
    return report


@contextlib.contextmanager
def _opened(parent: int, name: str) -> Iterator[int | None]:
    """The real folder ``name`` in ``parent``, opened; None if it is not one
    (missing, a file, a symbolic link)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except (FileNotFoundError, NotADirectoryError, OSError):
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _note_if_link(parent: int, name: str, notes: list[str]) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            notes.append(f"{name}/ is a symbolic link: left alone, not followed")


def _blobs(store_fd: int, store: str) -> list[Blob]:
    found: list[Blob] = []
    with _opened(store_fd, "sha256") as blobs_fd:
        if blobs_fd is None:
            return found
        for prefix in os.scandir(blobs_fd):
            if not (_HEX2.fullmatch(prefix.name) and prefix.is_dir(follow_symlinks=False)):
                continue
            with _opened(blobs_fd, prefix.name) as prefix_fd:
                if prefix_fd is None:
                    continue
                for entry in os.scandir(prefix_fd):
                    if not (
                        _HEX64.fullmatch(entry.name)
                        and entry.name.startswith(prefix.name)
                        and entry.is_file(follow_symlinks=False)
                    ):
                        continue  # not a blob the store wrote: left alone
                    st = entry.stat(follow_symlinks=False)
                    found.append(
                        Blob(
                            store,
                            entry.name,
                            st.st_size,
                            st.st_mtime_ns,
                            st.st_nlink,
                            (st.st_dev, st.st_ino),
                        )
                    )
    return found


def _temps(store_fd: int, store: str, recent_ns: int) -> list[Temp]:
    found: list[Temp] = []
    with _opened(store_fd, "tmp") as tmp_fd:
        if tmp_fd is None:
            return found
        for entry in os.scandir(tmp_fd):
            st = entry.stat(follow_symlinks=False)
            if st.st_mtime_ns >= recent_ns:
                continue  # a blob being written, or a clean at work
            if stat.S_ISREG(st.st_mode):
                found.append(Temp(store, entry.name, st.st_size, folder=False))
            elif stat.S_ISDIR(st.st_mode) and entry.name.startswith(_TOMB_PREFIX):
                found.append(Temp(store, entry.name, _folder_bytes(tmp_fd, entry.name), True))
    return found


def _named(home: Path, refs: Iterable[tuple[str, str]]) -> set[str]:
    """The blobs ``refs`` name, with every file their manifests list."""
    keep: set[str] = set()
    for kind, digest in refs:
        keep.add(digest)
        if kind == "dir":
            keep |= _listed(home, digest)
    return keep


def _recent(home: Path, blobs: Iterable[Blob], recent_ns: int) -> set[str]:
    """What the recent manifests list: a job about to be submitted (or
    rerun) may name one, and so every file it lists."""
    keep: set[str] = set()
    for blob in blobs:
        if (
            blob.mtime_ns >= recent_ns
            and blob.size <= _MANIFEST_MAX_BYTES
            and _starts_as_manifest(home / blob.store, blob.name)
        ):
            keep |= _listed(home, blob.name)
    return keep


def _starts_as_manifest(root: Path, digest: str) -> bool:
    try:
        fd = os.open(ArtifactStore(root).path(digest), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.read(fd, len(_MANIFEST_START)) == _MANIFEST_START
    finally:
        os.close(fd)


def _listed(home: Path, digest: str) -> set[str]:
    """The files manifest ``digest`` lists, read from whichever store has it."""
    for name in STORES:
        try:
            manifest = bundle.load(ArtifactStore(home / name), digest)
        except GPUlayerError:
            continue  # not there, or not a manifest
        return {e.digest for e in manifest.entries if e.digest is not None}
    return set()


def _leftover_folders(home: Path, home_fd: int, store: Store, notes: list[str]) -> dict[str, int]:
    with _opened(home_fd, "workers") as workers_fd:
        if workers_fd is None:
            _note_if_link(home_fd, "workers", notes)
            return {}
        # The folders first, then who is alive: a folder is made only after
        # its worker is named (in its ledger, or registered in the store).
        folders = [
            e.name
            for e in os.scandir(workers_fd)
            if e.name != "live" and not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
        ]
        if not folders:
            return {}
        ledgers = _ledgers(workers_fd)
        live = {
            w.id
            for w in store.list_workers()
            if w.instance is None or _instance_alive(home, w.instance)
        }
        chosen = leftover_folders(folders, ledgers, live)
        if chosen is None:
            notes.append("a worker is starting on this home: its task folders were left alone")
            return {}
        return {name: _folder_bytes(workers_fd, name) for name in chosen}


def _ledgers(workers_fd: int) -> dict[str, str | None]:
    """Each ledger in ``live/`` -> the worker id it names (None: none yet)."""
    found: dict[str, str | None] = {}
    with _opened(workers_fd, "live") as live_fd:
        if live_fd is None:
            return found
        for entry in os.scandir(live_fd):
            found[entry.name] = (
                None if entry.name.startswith(".") else _worker_id(live_fd, entry.name)
            )
    return found


def _worker_id(live_fd: int, ledger: str) -> str | None:
    with _opened(live_fd, ledger) as fd:
        if fd is None:
            return None
        try:
            file = os.open("worker-id", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            return None
        try:
            return os.read(file, 1024).decode(errors="replace").strip() or None
        finally:
            os.close(file)


def _instance_alive(home: Path, instance: str) -> bool:
    """Whether the control plane ``instance`` of the home still runs (holds its lock)."""
    if not _INSTANCE.fullmatch(instance):
        return True  # no name an instance has: not ours to judge
    path = home / "instances" / f"{instance}.lock"
    fd = take_lock(path, create=False)
    if fd is None:  # held by the live process, or gone with a stopped one
        return path.exists()
    os.close(fd)
    return False


def _folder_bytes(parent: int, name: str) -> int:
    """Apparent size of the regular files under folder ``name``, links not followed."""
    total = 0
    with contextlib.suppress(OSError):
        for _, _, files, fd in os.fwalk(name, dir_fd=parent, follow_symlinks=False):
            for file in files:
                with contextlib.suppress(OSError):
                    st = os.stat(file, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_size
    return total


# -- apply ----------------------------------------------------------------------


def apply(home: Path, found: Plan, *, now: float, progress: Progress | None = None) -> Report:
    """Remove what ``found`` lists, each blob only if still untouched since
    ``HOME_GC_RECENT_S`` before ``now`` (see the module docstring)."""
    report = Report(dry_run=False, jobs=found.jobs, log_lines=found.log_lines, notes=found.notes)
    recent_ns = int((now - defaults.HOME_GC_RECENT_S) * 1e9)
    home_fd = os.open(home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        by_store: dict[str, list[Blob]] = {}
        for blob in found.blobs:
            by_store.setdefault(blob.store, []).append(blob)
        total = sum(b.size for b in found.blobs)
        bar: AbstractContextManager[Callable[[int], None]] = (
            progress(total, "removing blobs")
            if progress is not None and len(found.blobs) >= defaults.HOME_GC_PROGRESS_MIN_BLOBS
            else contextlib.nullcontext(lambda n: None)
        )
        removed: list[Blob] = []
        with bar as advance:
            for name, blobs in by_store.items():
                with _opened(home_fd, name) as store_fd:
                    if store_fd is not None:
                        _remove_blobs(store_fd, blobs, recent_ns, removed, advance)
        n, report.blob_bytes, report.linked, report.linked_bytes = freed(removed, removed=True)
        report.blobs = n + report.linked
        for temp in found.temps:
            with _opened(home_fd, temp.store) as store_fd, _opened_in(store_fd, "tmp") as tmp_fd:
                if tmp_fd is not None and _remove(tmp_fd, temp.name, temp.folder):
                    report.temps += 1
                    report.temp_bytes += temp.size
        with _opened(home_fd, "workers") as workers_fd:
            for folder, nbytes in found.folders.items():
                if workers_fd is not None and _remove(workers_fd, folder, True):
                    report.folders += 1
                    report.folder_bytes += nbytes
                elif workers_fd is not None:
                    report.notes.append(f"could not remove all of workers/{folder}")
    finally:
        os.close(home_fd)
    return report


@contextlib.contextmanager
def _opened_in(parent: int | None, name: str) -> Iterator[int | None]:
    if parent is None:
        yield None
        return
    with _opened(parent, name) as fd:
        yield fd


def _remove_blobs(
    store_fd: int,
    blobs: Sequence[Blob],
    recent_ns: int,
    removed: list[Blob],
    advance: Callable[[int], None],
) -> None:
    with _opened(store_fd, "sha256") as blobs_fd:
        if blobs_fd is None:
            return
        tomb = _tomb(store_fd)
        if tomb is None:
            return
        tomb_name, tmp_fd, tomb_fd = tomb
        try:
            for blob in blobs:
                with _opened(blobs_fd, blob.name[:2]) as prefix_fd:
                    if prefix_fd is not None:
                        _remove_blob(prefix_fd, tomb_fd, blob, recent_ns, removed)
                advance(blob.size)
        finally:
            os.close(tomb_fd)
            with contextlib.suppress(OSError):  # empty, unless a restore failed
                os.rmdir(tomb_name, dir_fd=tmp_fd)
            os.close(tmp_fd)


def _tomb(store_fd: int) -> tuple[str, int, int] | None:
    """A new folder of this clean's own in the store's ``tmp/`` (same file
    system as the blobs: a rename moves one): (name, tmp fd, its fd)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir("tmp", 0o700, dir_fd=store_fd)
    try:
        tmp_fd = os.open("tmp", _DIR_FLAGS, dir_fd=store_fd)
    except OSError:
        return None  # tmp/ is not a real folder: no blob is moved anywhere
    name = f"{_TOMB_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    os.mkdir(name, 0o700, dir_fd=tmp_fd)
    return name, tmp_fd, os.open(name, _DIR_FLAGS, dir_fd=tmp_fd)


def _remove_blob(
    prefix_fd: int, tomb_fd: int, blob: Blob, recent_ns: int, removed: list[Blob]
) -> None:
    name = blob.name
    try:
        st = os.stat(name, dir_fd=prefix_fd, follow_symlinks=False)
    except FileNotFoundError:
        return  # removed meanwhile
    if not stat.S_ISREG(st.st_mode) or st.st_mtime_ns >= recent_ns:
        return  # looked up since the plan: kept
    try:
        os.rename(name, name, src_dir_fd=prefix_fd, dst_dir_fd=tomb_fd)
    except FileNotFoundError:
        return
    st = os.stat(name, dir_fd=tomb_fd, follow_symlinks=False)
    if st.st_mtime_ns >= recent_ns:
        # Looked up between the check and the rename: the lookup said it is
        # there, so it must be. Linked back, unless stored again meanwhile.
        with contextlib.suppress(FileExistsError):
            os.link(name, name, src_dir_fd=tomb_fd, dst_dir_fd=prefix_fd, follow_symlinks=False)
        os.unlink(name, dir_fd=tomb_fd)
        return
    os.unlink(name, dir_fd=tomb_fd)
    # Its link count just before this link went: the last one saw 1.
    removed.append(replace(blob, size=st.st_size, nlink=st.st_nlink))


def _remove(parent: int, name: str, folder: bool) -> bool:
    """Remove file or real folder ``name`` in ``parent`` (links inside it
    removed, never followed); whether it is gone."""
    try:
        if folder:
            # By descriptor: rmtree refuses a link at the top and never
            # follows one inside (it removes the link itself).
            shutil.rmtree(name, ignore_errors=True, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return True
    return False


def size(n: float) -> str:
    """Bytes as people read them: ``1.2 GB`` (decimal units)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _s(n: int) -> str:
    return "" if n == 1 else "s"


__all__ = [
    "Blob",
    "Plan",
    "Report",
    "apply",
    "choose_blobs",
    "collect",
    "freed",
    "leftover_folders",
    "plan",
]
