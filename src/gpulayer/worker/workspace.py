"""A task's directory: its bundle and inputs laid out, its outputs collected.

::

    <task dir>/
      workspace/          the job's working directory: the bundle's files,
                          plus a symlink per input
      inputs/<name>       each input, as a file or a directory tree

Blobs come through the transport into the worker's cache; a cache hit copies
no bytes over the network. Every file the job gets is its own (a copy, or a
clone where the filesystem can): a job that edits one in place never changes
a cached blob another job will read. Hard links to the blobs are only for a
job that cannot write them (run as another Unix user; see ``link_blobs``).

Outputs are collected without following a symbolic link: every path is
opened from the workspace one component at a time with ``O_NOFOLLOW``, so
neither a link the job made nor one swapped in meanwhile leads out of it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .. import bundle, defaults, outputs
from ..artifacts import ArtifactStore
from ..jobs import RunTask
from ..spec import ArtifactRef
from ..transport import Transport


@dataclass(frozen=True)
class Workspace:
    cwd: Path
    env: dict[str, str]


def prepare(
    task: RunTask,
    task_dir: Path,
    transport: Transport,
    cache: ArtifactStore,
    *,
    link_blobs: bool = False,
) -> Workspace:
    """Lay out ``task_dir``, made by :func:`make_spare`, for ``task``.

    ``link_blobs``: the job's Unix user cannot write the cache's blobs (it
    runs as another user than the worker's), so files of 1 MiB and more may
    be hard links to them where no clone is possible, instead of copies.
    """
    spec = task.spec
    cwd = task_dir / "workspace"

    def blob(digest: str) -> Path:
        return transport.download_blob(digest, cache)

    if spec.bundle is not None:
        blob(spec.bundle)
        bundle.materialize(bundle.load(cache, spec.bundle), cwd, blob, link_blobs=link_blobs)
    env = {"GPULAYER_WORKSPACE": str(cwd)}
    if spec.inputs:
        inputs = task_dir / "inputs"
        inputs.mkdir()
        env["GPULAYER_INPUTS"] = str(inputs)
        for name, ref in spec.inputs.items():
            target = inputs / name
            blob(ref.digest)
            if ref.kind == "file":
                # Read-only: inputs are data (a job writes new files). The
                # mode is a hint, not a guard: the file is the job's own.
                cache.materialize(ref.digest, target, link=link_blobs)
            else:
                manifest = bundle.load(cache, ref.digest)
                bundle.materialize(manifest, target, blob, link_blobs=link_blobs)
            link = cwd / name
            if not os.path.lexists(link):  # a bundle file of that name wins
                link.symlink_to(target)
    return Workspace(cwd=cwd, env=env)


def make_spare(task_dir: Path) -> Path:
    """An empty task directory, made before it is needed.

    Creating directories costs a tenth of a millisecond or more on some
    filesystems; a worker keeps one ready per slot so a task's start does not
    wait for it.
    """
    (task_dir / "workspace").mkdir(parents=True)
    return task_dir


def reuse_if_empty(task_dir: Path) -> Path | None:
    """``task_dir`` again when its task left it as it was made (nothing written)."""
    try:
        if os.listdir(task_dir) == ["workspace"] and not os.listdir(task_dir / "workspace"):
            return task_dir
    except OSError:
        pass
    return None


# -- outputs ---------------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO the job left where a file was must not hang the worker.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1024 * 1024
_LINKED = "a symbolic link: outputs never follow links"
_THROUGH_LINK = "inside a linked folder: outputs never follow links"


class _Skipped(Exception):
    """A path that is not collected, with why (it goes in ``missing``)."""


@dataclass
class _Found:
    """A declared output as found: one file, or a folder's entries."""

    kind: str  # "file" or "dir"
    size: int = 0  # a file's
    key: tuple[int, int] = (0, 0)  # a file's (device, inode)
    entries: list[bundle.Entry] = field(default_factory=list)  # a folder's, unhashed
    keys: dict[str, tuple[int, int]] = field(default_factory=dict)  # its files'


@dataclass
class _Child:
    name: str
    st: os.stat_result
    target: str | None  # a link's


@contextmanager
def _opened(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _open_dir(root: int, parts: Sequence[str]) -> int:
    """A descriptor on the folder ``parts`` under ``root``, never through a link."""
    fd = os.dup(root)
    try:
        for i, part in enumerate(parts):
            st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise _Skipped(_THROUGH_LINK)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a folder", "/".join(parts[: i + 1]))
            # O_NOFOLLOW: a link swapped in since the stat fails (ELOOP).
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _split(name: str) -> tuple[list[str], str]:
    *parents, last = name.split("/")
    return parents, last


def _lstat(root: int, name: str) -> os.stat_result:
    parents, last = _split(name)
    with _opened(_open_dir(root, parents)) as parent:
        return os.stat(last, dir_fd=parent, follow_symlinks=False)


def _open_file(root: int, name: str) -> int:
    """A descriptor on the regular file ``name`` under ``root``, never through a link."""
    parents, last = _split(name)
    with _opened(_open_dir(root, parents)) as parent:
        fd = os.open(last, _FILE_FLAGS, dir_fd=parent)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _Skipped("not a regular file")
    return fd


def _children(root: int, parts: Sequence[str]) -> list[_Child]:
    """The entries of folder ``parts``, with their lstat (and a link's target)."""
    with _opened(_open_dir(root, parts)) as fd, os.scandir(fd) as it:
        found = []
        for e in it:
            st = e.stat(follow_symlinks=False)
            target = os.readlink(e.name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
            found.append(_Child(e.name, st, target))
    return found


def _expand(root: int, pattern: str) -> list[str]:
    """What glob ``pattern`` matches under ``root`` (as :mod:`gpulayer.outputs`
    defines it), never looking inside a linked folder. A link it matches is
    listed: it is then reported as not collected, and why."""
    found: set[str] = set()
    stack: list[tuple[tuple[str, ...], tuple[str, ...]]] = [((), outputs.glob_parts(pattern))]
    seen: set[tuple[tuple[str, ...], int]] = set()  # a folder is looked at once per part
    while stack:
        at, parts = stack.pop()
        if (at, len(parts)) in seen:
            continue
        seen.add((at, len(parts)))
        if not parts:
            if at:
                found.add("/".join(at))
            continue
        head, rest = parts[0], parts[1:]
        if not outputs.is_glob(head):
            stack.append(((*at, head), rest))  # whether it exists is checked at the end
            continue
        try:
            children = _children(root, at)
        except (OSError, _Skipped):
            continue  # gone, a file, or a link: nothing to match inside it
        if head == "**":
            stack.append((at, rest))  # no folder at all
            for c in children:
                if c.name.startswith("."):
                    continue  # as glob: ** does not match hidden names
                if stat.S_ISDIR(c.st.st_mode):
                    stack.append(((*at, c.name), parts))  # one folder more
                elif all(p == "**" for p in rest):
                    found.add("/".join((*at, c.name)))
            continue
        stack.extend(((*at, c.name), rest) for c in children if outputs.part_matches(head, c.name))
    return sorted(name for name in found if _exists(root, name))


def _exists(root: int, name: str) -> bool:
    try:
        _lstat(root, name)
    except (OSError, _Skipped):
        return False
    return True


def _find(root: int, name: str, skipped: list[str]) -> _Found | None:
    """The output ``name``, measured; None if there is none. Raises _Skipped
    for one that is not collected (a link, say); what is left out of a
    folder goes in ``skipped``."""
    try:
        st = _lstat(root, name)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _Skipped(_LINKED)
    if stat.S_ISREG(st.st_mode):
        return _Found("file", size=st.st_size, key=(st.st_dev, st.st_ino))
    if not stat.S_ISDIR(st.st_mode):
        raise _Skipped("not a regular file or folder")
    found = _Found("dir")
    links: dict[str, str] = {}
    stack = [""]
    while stack:
        prefix = stack.pop()
        for c in _children(root, f"{name}/{prefix}".rstrip("/").split("/")):
            rel, mode = prefix + c.name, c.st.st_mode
            try:
                outputs.check_name(rel)  # a backslash, say: a client could not write it
            except outputs.UnsafeOutputError as exc:
                skipped.append(f"{name}/{rel} ({exc.reason})")
                continue
            if stat.S_ISLNK(mode):
                assert c.target is not None
                links[rel] = c.target
            elif stat.S_ISDIR(mode):
                found.entries.append(bundle.Entry(rel, "dir", mode=0o755))
                stack.append(rel + "/")
            elif stat.S_ISREG(mode):
                exe = 0o755 if mode & 0o100 else 0o644
                found.entries.append(bundle.Entry(rel, "file", size=c.st.st_size, mode=exe))
                found.keys[rel] = (c.st.st_dev, c.st.st_ino)
            else:
                skipped.append(f"{name}/{rel} (not a regular file, folder or link)")
    # A link in the folder is kept as a link if it stays inside the folder.
    for rel in sorted(bundle.links_out(links)):
        skipped.append(f"{name}/{rel} (a symbolic link to {links.pop(rel)!r}, outside {name!r})")
    found.entries.extend(bundle.Entry(rel, "symlink", target=t) for rel, t in links.items())
    found.entries.sort(key=lambda e: e.path)
    return found


def _fd_path(fd: int) -> Path:
    """A path that opens the file of ``fd`` itself, whatever its name leads to now."""
    return Path(f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}")


def _hash(fd: int) -> tuple[str, int]:
    """sha256 and size of the whole file of ``fd``."""
    h = hashlib.sha256()
    size = 0
    while chunk := os.read(fd, _CHUNK):
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


class _Budget:
    """Bytes against the limit; each file (device, inode) counted once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self._seen: set[tuple[int, int]] = set()

    def add(self, key: tuple[int, int], size: int, *, check: bool = True) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.total += size
            if check:
                self.check()

    def check(self) -> None:
        if self.total > self.limit:
            raise outputs.OutputLimitError(self.total, self.limit)


def collect_outputs(
    patterns: list[str],
    cwd: Path,
    transport: Transport,
    *,
    max_bytes: int = defaults.MAX_OUTPUT_BYTES,
) -> tuple[dict[str, ArtifactRef], list[str]]:
    """Store each declared output (a file, a folder, or a glob of them).

    Returns what was stored, by name (normalised: ``./out/`` is ``out``), and
    what was not, each with why unless it is simply missing. A symbolic
    link is never followed: one declared or matched is not stored, one in a
    stored folder is kept as a link if it stays inside that folder. Before a
    byte is stored, the sizes are added up (each file once, at its apparent
    size, so a sparse file counts in full): over ``max_bytes``,
    OutputLimitError, and nothing is stored.
    """
    found: dict[str, _Found] = {}
    missing: list[str] = []
    if not patterns:
        return {}, []
    try:
        root = os.open(cwd, _DIR_FLAGS)
    except OSError as exc:  # the job replaced its workspace (with a link, say)
        return {}, [f"{p} (the workspace cannot be opened: {exc.strerror})" for p in patterns]
    with _opened(root):
        for pattern in patterns:
            name = outputs.normalise(pattern)
            try:
                outputs.check_name(name)
            except outputs.UnsafeOutputError as exc:
                missing.append(f"{pattern} ({exc.reason})")
                continue
            names = _expand(root, name) if outputs.is_glob(name) else [name]
            if not names:
                missing.append(pattern)
            for match in names:
                if match in found:
                    continue
                try:
                    outputs.check_name(match)  # a name a glob matched: a backslash, say
                    item = _find(root, match, missing)
                except outputs.UnsafeOutputError as exc:
                    missing.append(f"{match} ({exc.reason})")
                    continue
                except _Skipped as exc:
                    missing.append(f"{match} ({exc})")
                    continue
                if item is None:
                    missing.append(pattern)
                else:
                    found[match] = item
        measured = _Budget(max_bytes)  # all of it, before a byte is stored
        for item in found.values():
            if item.kind == "file":
                measured.add(item.key, item.size, check=False)
            for e in item.entries:
                if e.kind == "file":
                    measured.add(item.keys[e.path], e.size, check=False)
        measured.check()
        read = _Budget(max_bytes)  # and again as they are read: one may have grown
        stored = {name: _store(root, name, item, transport, read) for name, item in found.items()}
    return stored, missing


def _store(
    root: int, name: str, item: _Found, transport: Transport, budget: _Budget
) -> ArtifactRef:
    if item.kind == "file":
        with _opened(_open_file(root, name)) as fd:
            digest, size = _hash(fd)
            budget.add(item.key, size)
            if transport.missing_blobs([digest]):
                os.lseek(fd, 0, os.SEEK_SET)
                transport.upload_blob(_fd_path(fd), digest)
        return ArtifactRef(kind="file", digest=digest, size=size)
    entries = []
    for e in item.entries:
        if e.kind == "file":
            with _opened(_open_file(root, f"{name}/{e.path}")) as fd:
                digest, size = _hash(fd)
            budget.add(item.keys[e.path], size)
            e = bundle.Entry(e.path, "file", size=size, mode=e.mode, digest=digest)
        entries.append(e)
    manifest = bundle.Manifest(tuple(entries))
    bundle.validate(manifest)
    paths = {e.digest: e.path for e in entries if e.kind == "file" and e.digest}
    for digest in sorted(transport.missing_blobs(paths)):
        with _opened(_open_file(root, f"{name}/{paths[digest]}")) as fd:
            transport.upload_blob(_fd_path(fd), digest)
    digest = transport.upload_bytes(msgspec.json.encode(manifest))
    return ArtifactRef(kind="dir", digest=digest, size=manifest.total_size)
