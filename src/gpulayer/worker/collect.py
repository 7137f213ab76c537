"""A task's declared outputs, collected from its workspace and stored.

Outputs are collected without following a symbolic link: every path is
opened from the workspace one component at a time with ``O_NOFOLLOW``, so
neither a link the job made nor one swapped in meanwhile leads out of it.
Each folder is opened from its parent's descriptor, kept open while what is
inside is walked (one per level, bounded by defaults.MAX_OUTPUT_DEPTH): a
deep tree costs one open per folder. What is measured against the limits is
what a client writes on download: each path, once.
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
from ..spec import ArtifactRef
from ..transport import Transport

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
    entries: list[bundle.Entry] = field(default_factory=list)  # a folder's, unhashed


@dataclass(frozen=True)
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


def _split(name: str) -> tuple[list[str], str]:
    *parents, last = name.split("/")
    return parents, last


def _tree_order(path: str) -> list[str]:
    """A sort key that puts a folder's whole subtree together, after it (a
    plain string sort puts ``a/b-c`` between ``a/b`` and ``a/b/x``)."""
    return path.split("/")


class _Limits:
    """What one job's outputs may be beyond their size: how many entries, and
    paths a client can write (depth, length, name length), checked as found."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.entries = 0

    def count(self) -> None:
        """One more file, folder or link (counted before it is kept)."""
        self.entries += 1
        if self.entries > self.max_entries:
            raise outputs.OutputLimitError.too_many(self.max_entries)

    @staticmethod
    def check(path: str, *, last: str | None = None) -> None:
        """Refuse ``path`` (from the workspace) if no client could write it.
        ``last``: only that name in it is new (the folder above was checked)."""
        if path.count("/") > defaults.MAX_OUTPUT_DEPTH:  # in that many folders
            raise outputs.OutputLimitError.too_deep(path, defaults.MAX_OUTPUT_DEPTH)
        size = len(path.encode("utf-8", "surrogateescape"))
        if size > defaults.MAX_OUTPUT_PATH_BYTES:
            raise outputs.OutputLimitError.too_long(path, size, defaults.MAX_OUTPUT_PATH_BYTES)
        if size > defaults.MAX_OUTPUT_NAME_BYTES:  # else no name in it can be
            for part in path.split("/") if last is None else [last]:
                n = len(part.encode("utf-8", "surrogateescape"))
                if n > defaults.MAX_OUTPUT_NAME_BYTES:
                    raise outputs.OutputLimitError.name_too_long(
                        path, n, defaults.MAX_OUTPUT_NAME_BYTES
                    )


class _Cursor:
    """Paths under the workspace, each folder opened from the one before it
    (``O_NOFOLLOW``), never through a link. The folders on the way to the
    last path stay open: paths taken in tree order (:func:`_tree_order`) cost
    one open per folder, not one per folder above each path. At most one
    descriptor per level is open (see defaults.MAX_OUTPUT_DEPTH)."""

    def __init__(self, root: int) -> None:
        self._fds = [root]  # the root is the caller's
        self._parts: list[str] = []

    def folder(self, parts: Sequence[str]) -> int:
        """A descriptor on the folder ``parts``, the cursor's own (valid until
        its next call). Raises _Skipped through a link, OSError if none."""
        keep = 0
        while keep < min(len(parts), len(self._parts)) and parts[keep] == self._parts[keep]:
            keep += 1
        while len(self._parts) > keep:
            self._parts.pop()
            os.close(self._fds.pop())
        for i in range(keep, len(parts)):
            at, part = self._fds[-1], parts[i]
            st = os.stat(part, dir_fd=at, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise _Skipped(_THROUGH_LINK)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a folder", "/".join(parts[: i + 1]))
            # O_NOFOLLOW: a link swapped in since the stat fails (ELOOP).
            self._fds.append(os.open(part, _DIR_FLAGS, dir_fd=at))
            self._parts.append(part)
        return self._fds[-1]

    def lstat(self, name: str) -> os.stat_result:
        parents, last = _split(name)
        return os.stat(last, dir_fd=self.folder(parents), follow_symlinks=False)

    def open_file(self, name: str) -> int:
        """A descriptor (the caller's) on the regular file ``name``."""
        parents, last = _split(name)
        fd = os.open(last, _FILE_FLAGS, dir_fd=self.folder(parents))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _Skipped("not a regular file")
        return fd

    def close(self) -> None:
        while len(self._fds) > 1:
            os.close(self._fds.pop())
        self._parts.clear()


def _names(fd: int, only: frozenset[str] | None) -> Iterator[tuple[str, bool]]:
    """The folder ``fd``'s children, each with whether it is a folder (a link
    is not); with ``only``, just those of these names that are there."""
    if only is not None:
        for name in sorted(only):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            yield name, stat.S_ISDIR(st.st_mode)
        return
    with os.scandir(fd) as it:
        for e in it:
            yield e.name, e.is_dir(follow_symlinks=False)


def _expand(root: int, pattern: str, limits: _Limits) -> list[str]:
    """What glob ``pattern`` matches under ``root`` (as :mod:`gpulayer.outputs`
    defines it), never looking inside a linked folder. A link it matches is
    listed: it is then reported as not collected, and why.

    One walk of the folders the pattern may match inside, each opened from
    its parent's descriptor and listed once, with the set of the pattern's
    parts it has reached (several, through ``**``). Refuses (OutputLimitError)
    a walk that needs to go deeper, or to more paths, than outputs may have.
    """
    parts = outputs.glob_parts(pattern)
    n = len(parts)

    def closed(states: set[int]) -> frozenset[int]:
        out = set(states)
        for i in states:  # a ** may match no folder at all
            while i < n and parts[i] == "**":
                i += 1
                out.add(i)
        return frozenset(out)

    def step(states: frozenset[int], name: str, is_dir: bool) -> tuple[frozenset[int], bool]:
        """The parts reached after one more component ``name``, and whether
        the pattern matches the path it ends."""
        reached: set[int] = set()
        for i in states:
            if i == n:
                continue
            if parts[i] == "**":
                if name.startswith("."):
                    continue  # as glob: ** does not match hidden names
                if is_dir:
                    reached.add(i)  # one folder more
                elif i == n - 1:
                    reached.add(n)  # a trailing ** matches files too
            elif outputs.part_matches(parts[i], name):
                reached.add(i + 1)
        after = closed(reached)
        # A file ends the pattern only at its last part; a folder also where
        # a ** after it matches no folder (ckpt/** matches ckpt).
        return after, n in (after if is_dir else reached)

    found: list[str] = []
    looked = 0

    def listed(fd: int, at: str, states: frozenset[int]) -> list[tuple[str, frozenset[int]]]:
        """Of folder ``fd`` (path ``at``), the children to look inside; its matches go in ``found``."""
        nonlocal looked
        heads = {parts[i] for i in states if i < n}
        literal = None if any(outputs.is_glob(p) for p in heads) else frozenset(heads)
        inside = []
        for name, is_dir in _names(fd, literal):
            after, match = step(states, name, is_dir)
            deeper = is_dir and any(i < n for i in after)
            if not (match or deeper):
                continue
            looked += 1
            if looked > limits.max_entries:
                raise outputs.OutputLimitError.too_many(limits.max_entries, looked=True)
            path = f"{at}/{name}" if at else name
            limits.check(path, last=name)  # a match, or a folder one may be in: writable?
            if match:
                found.append(path)
            if deeper:
                inside.append((name, after))
        return inside

    stack: list[tuple[int, str, Iterator[tuple[str, frozenset[int]]]]] = []
    try:
        top = os.dup(root)
        try:
            stack.append((top, "", iter(listed(top, "", closed({0})))))
        except BaseException as exc:
            os.close(top)
            if isinstance(exc, OSError):
                return []  # the workspace cannot be listed: nothing matches
            raise
        while stack:
            fd, at, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                os.close(fd)
                continue
            name, states = child
            path = f"{at}/{name}" if at else name
            try:
                # O_NOFOLLOW: a link swapped in since the listing fails (ELOOP).
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue  # gone, or a link now: nothing to match inside it
            try:
                inside = listed(sub, path, states)
            except BaseException as exc:
                os.close(sub)
                if isinstance(exc, OSError):
                    continue  # unreadable: nothing to match inside it
                raise
            stack.append((sub, path, iter(inside)))
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return sorted(found)


def _listing(fd: int, limits: _Limits) -> list[_Child]:
    """The entries of folder ``fd``, with their lstat (and a link's target),
    each counted against the limit as it is read (a folder of millions is
    refused at the limit, not read whole first)."""
    found = []
    with os.scandir(fd) as it:
        for e in it:
            limits.count()
            try:
                st = e.stat(follow_symlinks=False)
                target = os.readlink(e.name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else None
            except FileNotFoundError:
                continue  # gone since it was listed
            found.append(_Child(e.name, st, target))
    return found


def _walk(top: int, name: str, skipped: list[str], limits: _Limits) -> _Found:
    """The folder output ``name``, open at ``top`` (not closed here), measured.

    Depth first, each folder opened from its parent's descriptor
    (``O_NOFOLLOW``), and closed once its entries are done: one descriptor
    open per level, one open per folder. What is left out goes in ``skipped``.
    """
    found = _Found("dir")
    links: dict[str, str] = {}
    try:
        stack: list[tuple[int, str, Iterator[_Child]]] = [(top, "", iter(_listing(top, limits)))]
    except OSError as exc:
        raise _Skipped(f"the folder cannot be read: {exc.strerror}") from None
    try:
        while stack:
            fd, prefix, children = stack[-1]
            c = next(children, None)
            if c is None:
                stack.pop()
                if fd != top:
                    os.close(fd)
                continue
            rel, mode = prefix + c.name, c.st.st_mode
            try:
                outputs.check_name(rel)  # a backslash, say: a client could not write it
            except outputs.UnsafeOutputError as exc:
                skipped.append(f"{name}/{rel} ({exc.reason})")
                continue
            limits.check(f"{name}/{rel}", last=c.name)
            if stat.S_ISLNK(mode):
                assert c.target is not None
                links[rel] = c.target
            elif stat.S_ISDIR(mode):
                try:
                    # O_NOFOLLOW: a link swapped in since the listing fails (ELOOP).
                    sub = os.open(c.name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    skipped.append(f"{name}/{rel} (cannot be opened: {exc.strerror})")
                    continue
                try:
                    inside = _listing(sub, limits)
                except BaseException as exc:
                    os.close(sub)
                    if not isinstance(exc, OSError):
                        raise
                    skipped.append(f"{name}/{rel} (cannot be read: {exc.strerror})")
                    continue
                found.entries.append(bundle.Entry(rel, "dir", mode=0o755))
                stack.append((sub, rel + "/", iter(inside)))
            elif stat.S_ISREG(mode):
                exe = 0o755 if mode & 0o100 else 0o644
                found.entries.append(bundle.Entry(rel, "file", size=c.st.st_size, mode=exe))
            else:
                skipped.append(f"{name}/{rel} (not a regular file, folder or link)")
    finally:
        for fd, _, _ in stack:
            if fd != top:
                os.close(fd)
    # A link in the folder is kept as a link if it stays inside the folder.
    for rel in sorted(bundle.links_out(links)):
        skipped.append(f"{name}/{rel} (a symbolic link to {links.pop(rel)!r}, outside {name!r})")
    found.entries.extend(bundle.Entry(rel, "symlink", target=t) for rel, t in links.items())
    found.entries.sort(key=lambda e: e.path)
    return found


def _find(cursor: _Cursor, name: str, skipped: list[str], limits: _Limits) -> _Found | None:
    """The output ``name``, measured; None if there is none. Raises _Skipped
    for one that is not collected (a link, say); what is left out of a
    folder goes in ``skipped``."""
    limits.check(name)  # before it is looked for: a folder open per level
    try:
        st = cursor.lstat(name)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise _Skipped(_LINKED)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise _Skipped("not a regular file or folder")
    limits.count()
    if stat.S_ISREG(st.st_mode):
        return _Found("file", size=st.st_size)
    try:
        top = cursor.folder(name.split("/"))
    except OSError:
        return None  # gone since the lstat
    return _walk(top, name, skipped, limits)


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
    """Bytes against the limit, each path at its apparent size: what a client
    writes on download (a hard link is a file of its own there, a sparse file
    is written in full)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0

    def add(self, size: int, *, check: bool = True) -> None:
        self.total += size
        if check:
            self.check()

    def check(self) -> None:
        if self.total > self.limit:
            raise outputs.OutputLimitError(self.total, self.limit)


def _within(name: str, folders: dict[str, _Found]) -> str | None:
    """The folder of ``folders`` that ``name`` is inside, if any."""
    at = name
    while "/" in at:
        at = at.rpartition("/")[0]
        if at in folders:
            return at
    return None


def collect_outputs(
    patterns: list[str],
    cwd: Path,
    transport: Transport,
    *,
    max_bytes: int = defaults.MAX_OUTPUT_BYTES,
    max_entries: int = defaults.MAX_OUTPUT_ENTRIES,
) -> tuple[dict[str, ArtifactRef], list[str]]:
    """Store each declared output (a file, a folder, or a glob of them).

    Returns what was stored, by name (normalised: ``./out/`` is ``out``), and
    what was not, each with why unless it is simply missing. A symbolic
    link is never followed: one declared or matched is not stored, one in a
    stored folder is kept as a link if it stays inside that folder. A path
    inside a stored folder is stored with it, not again on its own (so
    ``ckpt/**`` stores one folder, ``ckpt``): no stored name is inside another.

    Before a byte is stored, the outputs are measured: every path as a client
    writes it on download (a file at its apparent size, once per path: a
    sparse file counts in full, each hard link as a file of its own). Over
    ``max_bytes`` in all, or ``max_entries`` files, folders and links, or a
    path deeper or longer than a client can write (defaults.MAX_OUTPUT_*),
    OutputLimitError names the limit, and nothing is stored.
    """
    missing: list[str] = []
    if not patterns:
        return {}, []
    try:
        root = os.open(cwd, _DIR_FLAGS)
    except OSError as exc:  # the job replaced its workspace (with a link, say)
        return {}, [f"{p} (the workspace cannot be opened: {exc.strerror})" for p in patterns]
    limits = _Limits(max_entries)
    cursor = _Cursor(root)
    with _opened(root):
        try:
            declared: dict[str, str] = {}  # each path to collect -> the pattern naming it
            for pattern in patterns:
                name = outputs.normalise(pattern)
                try:
                    outputs.check_name(name)
                except outputs.UnsafeOutputError as exc:
                    missing.append(f"{pattern} ({exc.reason})")
                    continue
                names = _expand(root, name, limits) if outputs.is_glob(name) else [name]
                if not names:
                    missing.append(pattern)
                for match in names:
                    declared.setdefault(match, pattern)
            found: dict[str, _Found] = {}
            folders: dict[str, _Found] = {}
            held: dict[str, set[str]] = {}  # a folder's paths, when asked
            for match in sorted(declared, key=_tree_order):  # a folder before what is in it
                folder = _within(match, folders)
                if folder is not None:  # stored with it, if it is there
                    if folder not in held:
                        held[folder] = {e.path for e in folders[folder].entries}
                    if match[len(folder) + 1 :] not in held[folder]:
                        missing.append(declared[match])
                    continue
                try:
                    outputs.check_name(match)  # a name a glob matched: a backslash, say
                    item = _find(cursor, match, missing, limits)
                except outputs.UnsafeOutputError as exc:
                    missing.append(f"{match} ({exc.reason})")
                    continue
                except _Skipped as exc:
                    missing.append(f"{match} ({exc})")
                    continue
                if item is None:
                    missing.append(declared[match])
                    continue
                found[match] = item
                if item.kind == "dir":
                    folders[match] = item
            measured = _Budget(max_bytes)  # all of it, before a byte is stored
            for item in found.values():
                measured.add(item.size, check=False)
                for e in item.entries:
                    measured.add(e.size, check=False)
            measured.check()
            read = _Budget(max_bytes)  # and again as they are read: one may have grown
            stored = {
                name: _store(cursor, name, item, transport, read) for name, item in found.items()
            }
        finally:
            cursor.close()
    return stored, missing


def _store(
    cursor: _Cursor, name: str, item: _Found, transport: Transport, budget: _Budget
) -> ArtifactRef:
    if item.kind == "file":
        with _opened(cursor.open_file(name)) as fd:
            digest, size = _hash(fd)
            budget.add(size)
            if transport.missing_blobs([digest]):
                os.lseek(fd, 0, os.SEEK_SET)
                transport.upload_blob(_fd_path(fd), digest)
        return ArtifactRef(kind="file", digest=digest, size=size)
    files = sorted((e for e in item.entries if e.kind == "file"), key=lambda e: _tree_order(e.path))
    hashed: dict[str, bundle.Entry] = {}
    digests: dict[str, str] = {}
    for e in files:
        with _opened(cursor.open_file(f"{name}/{e.path}")) as fd:
            digest, size = _hash(fd)
        budget.add(size)
        hashed[e.path] = bundle.Entry(e.path, "file", size=size, mode=e.mode, digest=digest)
        digests[e.path] = digest
    manifest = bundle.Manifest(tuple(hashed.get(e.path, e) for e in item.entries))
    bundle.validate(manifest)
    missing = transport.missing_blobs(set(digests.values()))
    for e in files:  # in tree order again: one open per folder
        digest = digests[e.path]
        if digest in missing:
            missing.discard(digest)
            with _opened(cursor.open_file(f"{name}/{e.path}")) as fd:
                transport.upload_blob(_fd_path(fd), digest)
    digest = transport.upload_bytes(msgspec.json.encode(manifest))
    return ArtifactRef(kind="dir", digest=digest, size=manifest.total_size)
