"""Content-addressed blob store: every blob is named by the sha256 of its bytes.

Layout under the store's root::

    sha256/<first 2 hex digits>/<64 hex digits>   the blobs, read-only (0444)
    tmp/                                          blobs being written

The root and every folder in it are the owner's alone (0700): see DIR_MODE.

A blob is written to ``tmp/``, flushed with ``fsync`` and renamed into place,
so a reader never sees a half-written blob under its final name, and two
writers of the same content both succeed (the second finds it already there).
Blobs are never modified after the rename (only their mtime, which says
when one was last looked up: see USED_MARK_S). A blob is handed to a job by hard
link only where the job's Unix user cannot write it (see
:meth:`ArtifactStore.materialize`): read-only is no protection against the
blob's owner, who may ``chmod`` it back.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

from gpulayer.errors import ArtifactError

# Blobs are shared by hard link between stores on one machine (a worker
# cache and the control plane's): read-only keeps a slip from editing every
# copy at once. It does not stop their owner, so a job of the same Unix user
# gets a private copy or clone, never a link (see ArtifactStore.materialize).
BLOB_MODE = 0o444
# The store's folders: its owner's alone. A blob is readable by all (above),
# so the folders are what keeps one job's inputs, bundles and outputs from
# another Unix user, and from the later jobs of a worker's --run-as user,
# which would otherwise list the cache and read every earlier job's blobs. A
# job reaches a blob only through the hard link or copy in its own
# workspace: a link is read by its inode's mode, not through the folders of
# the path it was made from.
DIR_MODE = 0o700

# A blob that is looked up (``has``: every submit asks for each blob it
# names) gets its mtime set to now when it is older than this, so ``gc``
# (gc.py), which keeps every blob touched within defaults.HOME_GC_RECENT_S, never
# removes a blob a submit in flight found here and is about to name. Marked
# at most once an hour: a lookup is a stat, not a write, almost always.
USED_MARK_S = 3600

# Read/write granularity when streaming a file into the store or hashing it.
_CHUNK = 1024 * 1024
# Blobs written at once by put_files.
_PUT_THREADS = 8

_HEX = frozenset("0123456789abcdef")


def _check_digest(digest: str) -> str:
    if not (isinstance(digest, str) and len(digest) == 64 and _HEX.issuperset(digest)):
        raise ArtifactError(
            f"invalid artifact digest {digest!r}: expected 64 lowercase hex digits (sha256)"
        )
    return digest


def sha256_file(path: Path | str) -> str:
    """The sha256 hex digest of a file's content, read in 1 MiB chunks."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


# A file changed this recently may change again within one timestamp tick
# without its stat changing ("racy git"): its digest is not cached.
_RACY_NS = 3_000_000_000
_CACHE_MAX = 200_000  # entries; the cache is dropped whole when full


class DigestCache:
    """File digests keyed by path and by what changes when the content does.

    The stat key adds ctime and device to (size, mtime, inode): ctime cannot
    be set back by tools that preserve mtime.
    """

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[int, ...], str]] = {}
        self.hits = 0
        self.misses = 0

    def digest(self, path: str, st: os.stat_result) -> str:
        """sha256 of the file at ``path`` whose ``lstat`` is ``st``."""
        key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        known = self._known.get(path)
        if known is not None and known[0] == key:
            self.hits += 1
            return known[1]
        self.misses += 1
        digest = sha256_file(path)
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _RACY_NS:
            if len(self._known) >= _CACHE_MAX:
                self._known.clear()
            self._known[path] = (key, digest)
        return digest


def copy_file(src: Path | str, dst: Path | str, mode: int) -> None:
    """Copy ``src`` to a new file ``dst`` (which must not exist) with exactly ``mode``.

    ``O_EXCL`` refuses to write through anything already at ``dst``, a symlink
    included; ``fchmod`` sets the mode regardless of the umask.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fsrc = os.open(src, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(dst, flags | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            _copy_bytes(fsrc, fd)
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            os.unlink(dst)
            raise
        os.close(fd)
    finally:
        os.close(fsrc)


_NO_RANGE_COPY: set[int] = set()  # devices where copy_file_range failed once


def _copy_bytes(src: int, dst: int) -> None:
    """Copy the whole of file ``src`` into the empty file ``dst``.

    In the kernel (``copy_file_range``) where it can: no bytes pass through
    this process, about twice as fast as reading and writing (measured 2.5
    against 3.3 ms for 16 MiB on ext4). Else by reading and writing.
    """
    st = os.fstat(src)
    copy_range = getattr(os, "copy_file_range", None)
    done = 0
    if copy_range is not None and st.st_dev not in _NO_RANGE_COPY:
        try:
            while n := copy_range(src, dst, max(st.st_size - done, _CHUNK)):
                done += n
        except OSError as e:
            # Not across these filesystems, or not on one at all (an old
            # kernel, a FUSE filesystem...): read and write, from the start.
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            if e.errno != errno.EXDEV:
                _NO_RANGE_COPY.add(st.st_dev)
            done = 0
            os.ftruncate(dst, 0)
        if done >= st.st_size:
            return
        # Short (some kernels answer 0 for files they cannot range-copy):
        # the rest by reading and writing.
    os.lseek(src, done, os.SEEK_SET)
    os.lseek(dst, done, os.SEEK_SET)
    with open(src, "rb", closefd=False) as fsrc, open(dst, "wb", closefd=False) as fdst:
        shutil.copyfileobj(fsrc, fdst, _CHUNK)


_FICLONE = 0x40049409  # linux/fs.h: clone a whole file
_NO_CLONE: set[int] = set()  # devices where cloning failed once: not tried again


def clone_file(src: Path | str, dst: Path | str, mode: int) -> bool:
    """Reflink ``src`` to a new file ``dst``: a private copy-on-write copy with
    exactly ``mode``, no bytes copied. False where the filesystem cannot
    (anything but btrfs, XFS and a few others); nothing is left at ``dst``.
    """
    if sys.platform != "linux":
        return False
    import fcntl

    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(src, "rb") as f:
        dev = os.fstat(f.fileno()).st_dev
        if dev in _NO_CLONE:
            return False
        fd = os.open(dst, flags, 0o600)
        try:
            fcntl.ioctl(fd, _FICLONE, f.fileno())
        except OSError as e:
            if e.errno != errno.EXDEV:  # the filesystem cannot clone at all
                _NO_CLONE.add(dev)
            os.close(fd)
            os.unlink(dst)
            return False
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return True


class ArtifactStore:
    """Blobs named by the sha256 hex digest of their content, under root/sha256/<first 2 hex>/<digest>."""

    def __init__(self, root: Path) -> None:
        # Nothing is created here: a store that is only read never touches the disk.
        self.root = Path(root)
        self._blobs = self.root / "sha256"
        self._tmp = self.root / "tmp"

    def __repr__(self) -> str:
        return f"ArtifactStore({str(self.root)!r})"

    def path(self, digest: str) -> Path:
        """Where the blob with ``digest`` lives (it may not exist)."""
        _check_digest(digest)
        return self._blobs / digest[:2] / digest

    @property
    def blob_dir(self) -> Path:
        """``sha256/``: the blobs, one folder per first two hex digits."""
        return self._blobs

    @property
    def tmp_dir(self) -> Path:
        """``tmp/``: blobs being written."""
        return self._tmp

    def has(self, digest: str) -> bool:
        """Whether the blob is stored. A blob found here is kept from ``gc``
        for a day (see USED_MARK_S): its mtime is when it was last found."""
        return _mark_used(self.path(digest))

    def close_to_others(self) -> None:
        """Make the root (if missing) and set it to DIR_MODE: a store made
        before its folders were private has 0755 ones, out of reach once
        the root is closed."""
        self._make_dir(self.root)
        os.chmod(self.root, DIR_MODE)

    def _make_dir(self, path: Path) -> None:
        """Make folder ``path`` of the store, and those missing above it up
        to the root, each new one DIR_MODE whatever the umask (which masks
        mkdir's mode; chmod sets it). The folders above the root are not the
        store's: made as mkdir makes them, if missing."""
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            return
        except FileNotFoundError:
            if path == self.root:
                path.parent.mkdir(parents=True, exist_ok=True)
            else:
                self._make_dir(path.parent)
            try:
                os.mkdir(path, DIR_MODE)
            except FileExistsError:
                return  # made meanwhile, by another writer
        os.chmod(path, DIR_MODE)

    # -- writing ------------------------------------------------------------

    def _temp(self) -> tuple[int, str]:
        """A new, empty, private temp file in the store's tree: (fd, path)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        for attempt in range(2):
            name = os.path.join(self._tmp, f"{os.getpid()}-{os.urandom(8).hex()}.tmp")
            try:
                return os.open(name, flags, 0o600), name
            except FileNotFoundError:
                if attempt:
                    raise
                self._make_dir(self._tmp)
        raise AssertionError("unreachable")

    def _commit(self, fd: int, tmp: str, digest: str) -> None:
        """Move a fully written temp file into place as blob ``digest``; consumes fd and tmp."""
        final = self.path(digest)
        try:
            if _mark_used(final):
                # Keep the existing blob (and its inode, which workspaces may
                # link to); ours is a duplicate.
                os.close(fd)
                os.unlink(tmp)
                return
            # fsync before rename: after a crash a blob under its final name
            # has its full content. The directory is not fsynced: a lost
            # rename leaves a blob missing (detected, re-fetched), never wrong.
            os.fchmod(fd, BLOB_MODE)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            self._make_dir(final.parent)
            os.replace(tmp, final)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _unlink_quietly(tmp)
            raise

    def put_bytes(self, data: bytes) -> str:
        """Store ``data``; return its digest. Storing existing content writes nothing."""
        digest = hashlib.sha256(data).hexdigest()
        if self.has(digest):
            return digest
        fd, tmp = self._temp()
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        self._commit(fd, tmp, digest)
        return digest

    def put_file(
        self,
        src: Path,
        *,
        digest: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> str:
        """Stream ``src`` into the store; return its digest.

        With ``digest`` given and that blob already stored, return at once
        without opening ``src``: an unchanged file is never copied twice. If
        the content turns out not to match ``digest``, raise ArtifactError
        and leave nothing behind. ``on_progress(n)`` is called after each
        chunk with the number of bytes just copied (skipped files report
        nothing).
        """
        if digest is not None and self.has(digest):
            return digest
        h = hashlib.sha256()
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        fd, tmp = self._temp()
        try:
            with open(src, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    chunk = view[:n]
                    h.update(chunk)
                    while chunk:
                        chunk = chunk[os.write(fd, chunk) :]
                    if on_progress is not None:
                        on_progress(n)
            actual = h.hexdigest()
            if digest is not None and actual != digest:
                raise ArtifactError(
                    f"content of {src} does not match its digest: expected {digest}, "
                    f"found {actual} (did the file change while it was being stored?)"
                )
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        self._commit(fd, tmp, actual)
        return actual

    def writer(self, expected: str | None = None) -> BlobWriter:
        """A blob written in chunks (from a network stream), verified on commit."""
        if expected is not None:
            _check_digest(expected)
        return BlobWriter(self, expected)

    def put_files(
        self, sources: Mapping[str, Path], *, on_progress: Callable[[int], None] | None = None
    ) -> None:
        """``put_file`` for each ``digest -> src``, several at once.

        In threads because each blob is fsynced, which costs milliseconds on a
        journaled disk, and concurrent fsyncs share journal commits (measured
        7-30x faster for many small files); hashing and copying release the
        GIL. ``on_progress`` is called under a lock: it need not be thread-safe.
        """
        if len(sources) < 2:
            for digest, src in sources.items():
                self.put_file(src, digest=digest, on_progress=on_progress)
            return
        import threading
        from concurrent.futures import ThreadPoolExecutor

        report = on_progress
        if on_progress is not None:
            lock = threading.Lock()

            def report(n: int) -> None:
                with lock:
                    on_progress(n)

        with ThreadPoolExecutor(min(_PUT_THREADS, len(sources))) as pool:
            futures = [
                pool.submit(self.put_file, src, digest=d, on_progress=report)
                for d, src in sources.items()
            ]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise

    def link_from(self, src: Path, digest: str) -> None:
        """Adopt ``src``, a file known to hold ``digest``, without copying its bytes.

        Meant for a blob of another store on the same machine (a worker cache
        taking a blob from the control plane's store): it is hard-linked, so
        it keeps that store's read-only mode. When a link is impossible
        (another filesystem, link count limit...) the file is copied and
        verified instead.
        """
        final = self.path(digest)
        if os.path.exists(final):
            return
        self._make_dir(final.parent)
        try:
            if hard_link(src, final):
                return
        except FileExistsError:
            return  # a concurrent writer stored it first
        except FileNotFoundError:
            raise ArtifactError(f"cannot adopt artifact {digest}: {src} does not exist") from None
        self.put_file(src, digest=digest)

    # -- reading ------------------------------------------------------------

    def _missing(self, digest: str) -> ArtifactError:
        return ArtifactError(f"artifact {digest} is not in the store at {self.root}")

    def read_bytes(self, digest: str) -> bytes:
        try:
            return self.path(digest).read_bytes()
        except FileNotFoundError:
            raise self._missing(digest) from None

    def open(self, digest: str) -> BinaryIO:
        try:
            return open(self.path(digest), "rb")
        except FileNotFoundError:
            raise self._missing(digest) from None

    def materialize(self, digest: str, dest: Path, *, link: bool = False) -> None:
        """Make ``dest`` a read-only (0444) file holding the blob, replacing
        whatever file was there (a symlink is replaced, not written through).

        By default a private file: a clone (copy-on-write, no bytes copied)
        where the filesystem can, else a copy. Whoever owns ``dest`` may
        ``chmod`` and edit it without changing the blob. With ``link`` a hard
        link, which *is* the blob: only for a reader that cannot write the
        blob (a job run as another Unix user than the store's owner; root
        writes anything).
        """
        src = self.path(digest)
        if not os.path.exists(src):
            raise self._missing(digest)
        if os.path.lexists(dest):
            os.unlink(dest)
        if link and hard_link(src, dest):
            return
        if clone_file(src, dest, BLOB_MODE):
            return
        copy_file(src, dest, BLOB_MODE)


# Why a hard link can fail where a copy works (hard_link returns False): another
# filesystem, too many links to one inode, no link support, a policy against it.
_LINK_FALLBACK_ERRNOS = frozenset(
    {errno.EXDEV, errno.EMLINK, errno.EPERM, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP}
)


class BlobWriter:
    """Chunks in, a verified blob out; nothing stays behind on error or abort."""

    def __init__(self, store: ArtifactStore, expected: str | None) -> None:
        self.store = store
        self.expected = expected
        self.size = 0
        self._hash = hashlib.sha256()
        self._fd, self._tmp = store._temp()

    def write(self, chunk: bytes) -> None:
        self._hash.update(chunk)
        self.size += len(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(self._fd, view) :]

    def commit(self) -> str:
        actual = self._hash.hexdigest()
        if self.expected is not None and actual != self.expected:
            self.abort()
            raise ArtifactError(
                f"the bytes received do not match the digest: expected {self.expected}, found {actual}"
            )
        fd, self._fd = self._fd, -1
        self.store._commit(fd, self._tmp, actual)
        return actual

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            _unlink_quietly(self._tmp)


def hard_link(src: Path | str, dst: Path | str) -> bool:
    """Hard-link ``src`` at ``dst``; False where only a copy would do (see below)."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno in _LINK_FALLBACK_ERRNOS:
            return False
        raise
    return True


def _mark_used(path: Path) -> bool:
    """Whether the blob at ``path`` is there; its mtime set to now if it is
    older than USED_MARK_S. One call: if gc takes the blob away meanwhile,
    the mark fails and the blob reads as missing, so it is stored again."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if time.time_ns() - st.st_mtime_ns > USED_MARK_S * 1_000_000_000:
        try:
            os.utime(path, follow_symlinks=False)
        except FileNotFoundError:
            return False  # removed meanwhile (by gc): to be stored again
        except OSError:
            pass  # a store this user may not touch: it reads it, never cleans it
    return True


def _unlink_quietly(path: Path | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
