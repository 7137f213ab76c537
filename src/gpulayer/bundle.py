"""Bundles: a directory tree shipped as a manifest of content-addressed blobs.

Each file is its own blob; the bundle is a JSON manifest (one blob) listing
every file, directory and symlink with its mode and digest. Identical trees
give byte-identical manifests, hence identical digests, and a file that did
not change is never stored twice (:func:`store` skips blobs already present).

1. :func:`scan` walks a directory: skips ``.git``, virtual environments (a
   directory holding ``pyvenv.cfg``), ``gpulayer_runs/``, ``__pycache__``,
   GPUlayer homes, what training leaves beside a script (DEFAULT_IGNORES,
   which ``.gpulayerignore`` may take back with ``!``) and what
   ``.gpulayerignore`` names; records symlinks without following them;
   hashes files (cached per process).
2. :func:`store` puts the missing file blobs and the manifest.
3. :func:`load` fetches and validates a manifest; :func:`materialize` checks
   every entry (:func:`validate`) before writing anything into a workspace.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from gpulayer import defaults
from gpulayer.artifacts import ArtifactStore, DigestCache, clone_file, copy_file, hard_link
from gpulayer.errors import ArtifactError, BundleError, UnsafePathError

if TYPE_CHECKING:
    import pathspec

log = logging.getLogger(__name__)

IGNORE_FILE = ".gpulayerignore"
_VENV_MARKER = "pyvenv.cfg"
_SKIP_DIRS = frozenset({"gpulayer_runs", "__pycache__"})
# What a training run leaves beside its script, left out of a bundle by
# default (gitignore syntax): logger and tracker folders and checkpoints.
# Shipped with every later job, they would grow each one's bundle by a run's
# output; a `.gpulayerignore` line such as `!checkpoints/` takes one back.
DEFAULT_IGNORES = (
    "lightning_logs/",
    "wandb/",
    "mlruns/",
    "runs/",
    "outputs/",
    "multirun/",
    "checkpoints/",
    ".ipynb_checkpoints/",
    "*.ckpt",
)
# The same, matched without pathspec where there is no ignore file to
# combine them with (most bundles): folder names, file suffixes.
_DEFAULT_DIRS = frozenset(p[:-1] for p in DEFAULT_IGNORES if p.endswith("/"))
_DEFAULT_SUFFIXES = tuple(p[1:] for p in DEFAULT_IGNORES if p.startswith("*."))
_KINDS = ("file", "dir", "symlink")
_HEX = frozenset("0123456789abcdef")
_Progress = Callable[[int], None] | None


class Entry(msgspec.Struct, frozen=True, omit_defaults=True):
    path: str  # POSIX relative path inside the bundle
    kind: Literal["file", "dir", "symlink"]
    size: int = 0
    mode: int = 0o644  # 0o644 or 0o755 from scan: only the executable bit is kept
    digest: str | None = None  # for files
    target: str | None = None  # for symlinks, as read; checked by validate()


class Manifest(msgspec.Struct, frozen=True):
    entries: tuple[Entry, ...]  # sorted by path: identical trees encode identically

    @property
    def file_count(self) -> int:
        return sum(1 for e in self.entries if e.kind == "file")

    @property
    def total_size(self) -> int:
        return sum(e.size for e in self.entries if e.kind == "file")


class BundleSummary(msgspec.Struct, frozen=True):
    files: int
    bytes: int
    largest: tuple[tuple[str, int], ...]  # (path, size), biggest first, at most 5


class PackedPath(msgspec.Struct, frozen=True):
    """A packed input: one file (digest of its blob) or a directory (digest of its manifest)."""

    kind: Literal["file", "dir"]
    digest: str
    size: int


# Digests of scanned files, for this process: re-scanning an unchanged tree reads nothing.
_DIGESTS = DigestCache()


# -- scan ---------------------------------------------------------------------


def _digest(path: str, st: os.stat_result) -> str:
    try:
        return _DIGESTS.digest(path, st)
    except FileNotFoundError:
        raise  # gone since listed: the caller leaves it out
    except OSError as e:
        raise BundleError(f"cannot read {path}: {e.strerror}; list it in {IGNORE_FILE}") from e


def file_digest(path: Path) -> str:
    """sha256 of one file, from this process's cache when the file is unchanged."""
    p = os.path.abspath(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise BundleError(f"cannot read {path}: {e.strerror}") from e
    return _digest(p, st)


def _listdir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError as e:
        raise BundleError(f"cannot read directory {path}: {e.strerror}") from e


def _ignore_spec(root: str) -> pathspec.GitIgnoreSpec | None:
    """The default ignores and the root's ignore file, as one spec (its
    lines last: a `!` line takes a default back); None with no file."""
    try:
        with open(os.path.join(root, IGNORE_FILE), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise BundleError(f"cannot read {IGNORE_FILE} in {root}: {e}") from e
    import pathspec  # only bundles that have an ignore file pay its import

    return pathspec.GitIgnoreSpec.from_lines([*DEFAULT_IGNORES, *lines])


class _Ignored:
    """Whether a path of the tree is left out: by the spec where the root
    has an ignore file, else by the default ignores alone."""

    def __init__(self, root: str) -> None:
        self.spec = _ignore_spec(root)
        self.by_default: list[str] = []  # what a default left out: said, to be taken back

    def dir(self, rel: str, name: str) -> bool:
        default = name in _DEFAULT_DIRS
        out = default if self.spec is None else self.spec.match_file(rel + "/")
        if out and default:
            self.by_default.append(rel + "/")
        return out

    def file(self, rel: str, name: str) -> bool:
        default = name.endswith(_DEFAULT_SUFFIXES)
        out = default if self.spec is None else self.spec.match_file(rel)
        if out and default:
            self.by_default.append(rel)
        return out

    def link(self, rel: str) -> bool:
        return self.spec is not None and self.spec.match_file(rel)


def scan(root: Path, *, home: Path | None = None) -> Manifest:
    """The manifest of the tree under ``root`` (see the module docstring for what is skipped)."""
    top = os.path.abspath(root)
    if not os.path.isdir(top):
        raise BundleError(f"cannot bundle {root}: not a directory")
    skip_rel = ""
    if home is not None:
        rel = os.path.relpath(Path(home).resolve(), Path(top).resolve())
        if rel != "." and not rel.startswith(".."):
            skip_rel = rel.replace(os.sep, "/")
    ignored = _Ignored(top)
    entries: list[Entry] = []
    # Depth-first with an explicit stack: no recursion limit on deep trees.
    stack = [("", _listdir(top))]
    while stack:
        prefix, children = stack.pop()
        for de in children:
            name = de.name
            rel = prefix + name
            if name == ".git":
                continue
            if de.is_symlink():
                if not ignored.link(rel):
                    entries.append(Entry(rel, "symlink", target=os.readlink(de.path)))
            elif de.is_dir(follow_symlinks=False):
                if name in _SKIP_DIRS or rel == skip_rel:
                    continue
                if ignored.dir(rel, name):
                    continue
                sub = _listdir(de.path)
                if any(c.name in (_VENV_MARKER, defaults.HOME_MARKER) for c in sub):
                    continue
                entries.append(Entry(rel, "dir", mode=0o755))
                stack.append((rel + "/", sub))
            elif de.is_file(follow_symlinks=False):
                if ignored.file(rel, name):
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                    digest = _digest(de.path, st)
                except FileNotFoundError:
                    continue  # removed since the folder was listed: not part of it now
                mode = 0o755 if st.st_mode & 0o100 else 0o644
                entries.append(Entry(rel, "file", size=st.st_size, mode=mode, digest=digest))
            # Sockets, FIFOs and devices have no content to ship: skipped.
    if ignored.by_default:
        shown = sorted(ignored.by_default)
        log.info(
            "left out of the bundle of %s by default: %s (a line such as !%s in %s ships it)",
            root,
            ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else ""),
            shown[0],
            IGNORE_FILE,
        )
    entries.sort(key=lambda e: e.path)
    manifest = Manifest(tuple(entries))
    try:
        validate(manifest)
    except BundleError as e:
        raise type(e)(
            f"{e} (in {root}); remove or rename it, or list it in {IGNORE_FILE}"
        ) from None
    return manifest


# -- validation ----------------------------------------------------------------


def _unsafe(path: object, why: str) -> UnsafePathError:
    return UnsafePathError(f"bundle entry {path!r}: {why}")


def _check_path(path: str) -> None:
    if not isinstance(path, str) or not path:
        raise _unsafe(path, "empty path")
    if path.startswith("/"):
        raise _unsafe(path, "absolute path")
    if "\\" in path or "\0" in path:
        raise _unsafe(path, "backslash or NUL in path")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise _unsafe(path, f"path component {part!r} not allowed")
    if not path.isascii():
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise _unsafe(path, "name is not valid UTF-8") from None


def _escapes(link: str, target: str, links: dict[str, str]) -> bool:
    """Whether symlink ``link -> target`` resolves outside the bundle root.

    Resolved within the manifest as the OS would resolve it, following the
    bundle's own symlinks: a purely lexical check is fooled by ``x ->
    sub/up/..`` where ``sub/up -> ..``.
    """
    todo = link.split("/")[:-1] + target.split("/")
    todo.reverse()
    stack: list[str] = []
    hops = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                return True
            stack.pop()
            continue
        stack.append(part)
        via = links.get("/".join(stack))
        if via is not None:
            hops += 1
            if hops > 64:  # a loop: the OS gives up (ELOOP) after 40, it points nowhere
                return False
            if via.startswith("/"):
                return True
            stack.pop()
            todo.extend(reversed(via.split("/")))
    return False


def links_out(links: dict[str, str]) -> set[str]:
    """Those of the symlinks ``links`` (path -> target) that point outside
    their root, resolved through one another as :func:`validate` does; also
    once those are left out (a link through one of them then leads nowhere)."""
    inside = dict(links)
    out: set[str] = set()
    while True:
        escaping = {
            p for p, t in inside.items() if not t or t.startswith("/") or _escapes(p, t, inside)
        }
        if not escaping:
            return out
        out |= escaping
        for p in escaping:
            del inside[p]


def validate(manifest: Manifest) -> None:
    """Refuse any entry that could write, or point, outside the directory it unpacks into.

    Raises UnsafePathError naming the entry, or BundleError for a malformed one.
    """
    kinds: dict[str, str] = {}
    links: dict[str, str] = {}
    for e in manifest.entries:
        path = e.path
        _check_path(path)
        if e.kind not in _KINDS:
            raise _unsafe(path, f"unknown kind {e.kind!r} (expected one of {', '.join(_KINDS)})")
        if path in kinds:
            raise _unsafe(path, "duplicate path")
        kinds[path] = e.kind
        if not isinstance(e.mode, int) or not 0 <= e.mode <= 0o777:
            raise BundleError(f"bundle entry {path!r}: bad mode {e.mode!r}")
        if e.kind == "file":
            d = e.digest
            if not (isinstance(d, str) and len(d) == 64 and _HEX.issuperset(d)):
                raise BundleError(f"bundle entry {path!r}: bad digest {d!r}")
            if not isinstance(e.size, int) or e.size < 0:
                raise BundleError(f"bundle entry {path!r}: bad size {e.size!r}")
        elif e.kind == "symlink":
            t = e.target
            if not isinstance(t, str) or not t or "\0" in t:
                raise _unsafe(path, f"bad symlink target {t!r}")
            if t.startswith("/"):
                raise _unsafe(path, f"symlink to absolute path {t!r}")
            links[path] = t
    for path in kinds:
        parent = path
        while "/" in parent:
            parent = parent.rpartition("/")[0]
            kind = kinds.get(parent)
            if kind is not None and kind != "dir":
                raise _unsafe(path, f"its parent {parent!r} is a {kind}, not a directory")
    for path, target in links.items():
        if _escapes(path, target, links):
            raise _unsafe(path, f"symlink to {target!r} points outside the bundle")


# -- store, load ---------------------------------------------------------------


def _encode(manifest: Manifest) -> bytes:
    return msgspec.json.encode(manifest)


def manifest_digest(manifest: Manifest) -> str:
    """The digest the manifest gets when stored, without storing it."""
    return hashlib.sha256(_encode(manifest)).hexdigest()


def store(
    root: Path,
    manifest: Manifest,
    artifacts: ArtifactStore,
    *,
    on_progress: _Progress = None,
) -> str:
    """Put the file blobs not yet stored, then the manifest; return the manifest's digest.

    ``on_progress`` calls sum to ``manifest.total_size`` (a bar knows its
    total up front): files already stored count at once, without being read.
    """
    missing: dict[str, Path] = {}  # digest -> source file
    for e in manifest.entries:
        if e.kind != "file" or e.digest is None:
            continue
        if e.digest in missing or artifacts.has(e.digest):
            if on_progress is not None and e.size:
                on_progress(e.size)
        else:
            missing[e.digest] = Path(root, e.path)
    try:
        artifacts.put_files(missing, on_progress=on_progress)
    except OSError as e:
        raise BundleError(f"cannot store {e.filename} from {root}: {e.strerror}") from e
    return artifacts.put_bytes(_encode(manifest))


_DECODER = msgspec.json.Decoder(Manifest)


def load(source: ArtifactStore | Callable[[str], bytes], digest: str) -> Manifest:
    """Fetch manifest ``digest`` (from a store, or a ``digest -> bytes`` reader) and validate it."""
    data = source.read_bytes(digest) if isinstance(source, ArtifactStore) else source(digest)
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise ArtifactError(f"manifest bytes do not match: expected {digest}, found {actual}")
    try:
        manifest = _DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise BundleError(f"artifact {digest} is not a bundle manifest: {e}") from None
    validate(manifest)
    return manifest


# -- materialize -----------------------------------------------------------------


def _place(src: str, dst: str, entry: Entry, link_blobs: bool) -> None:
    # See defaults.LINK_MIN_BYTES for why small files are copied, large ones
    # cloned, and linked only where the reader cannot write the blob.
    mode = entry.mode & 0o777
    if entry.size >= defaults.LINK_MIN_BYTES:
        if clone_file(src, dst, mode):
            return
        if link_blobs and not mode & 0o111 and hard_link(src, dst):
            return
    copy_file(src, dst, mode)


def materialize(
    manifest: Manifest,
    dest: Path,
    blob_path: Callable[[str], Path],
    *,
    link_blobs: bool = False,
) -> None:
    """Lay the bundle out in ``dest``, a new or empty directory.

    Every entry is validated before anything is written. Directories are
    created first (0755), then files, and symlinks last, so no write ever
    goes through a link the bundle made, even on a case-insensitive disk.

    Each file is private to ``dest``'s user (a copy, or a clone of 1 MiB and
    more where the filesystem can), who may edit it without changing the
    blob. ``link_blobs`` hard-links large files to their blobs instead where
    no clone is possible: only for a reader who cannot write the blobs (a
    job run as another Unix user than theirs), or an edit in place would
    change them for every later reader.
    """
    validate(manifest)
    top = os.path.abspath(dest)
    os.makedirs(top, exist_ok=True)
    if _listdir(top):
        raise BundleError(f"cannot materialise a bundle into {dest}: it is not empty")
    made = {top}
    phase = {"dir": 0, "file": 1, "symlink": 2}
    for e in sorted(manifest.entries, key=lambda e: (phase[e.kind], e.path)):
        path = os.path.join(top, e.path)
        parent = path if e.kind == "dir" else os.path.dirname(path)
        if parent not in made:  # parents without an entry of their own are made too
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        if e.kind == "dir":
            os.chmod(path, 0o755)  # whatever the umask
        elif e.kind == "symlink":
            os.symlink(str(e.target), path)
        else:
            src = str(blob_path(str(e.digest)))
            try:
                _place(src, path, e, link_blobs)
            except FileNotFoundError:
                if os.path.exists(src):
                    raise
                raise ArtifactError(
                    f"blob {e.digest} of bundle entry {e.path!r} is missing (looked in {src})"
                ) from None


# -- summaries and single paths --------------------------------------------------


def summarize(manifest: Manifest) -> BundleSummary:
    files = [e for e in manifest.entries if e.kind == "file"]
    top = heapq.nsmallest(5, files, key=lambda e: (-e.size, e.path))
    return BundleSummary(
        files=len(files),
        bytes=sum(e.size for e in files),
        largest=tuple((e.path, e.size) for e in top),
    )


def is_large(summary: BundleSummary) -> bool:
    """Whether the bundle is big enough to warn about (see defaults.LARGE_BUNDLE_BYTES)."""
    return summary.bytes >= defaults.LARGE_BUNDLE_BYTES


def pack_path(
    path: Path,
    artifacts: ArtifactStore,
    *,
    home: Path | None = None,
    on_progress: _Progress = None,
) -> PackedPath:
    """Store an input: a file as one blob, a directory as a bundle. Symlinks are followed."""
    p = os.path.abspath(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise BundleError(f"cannot pack {path}: {e.strerror}") from e
    if stat.S_ISDIR(st.st_mode):
        manifest = scan(Path(p), home=home)
        digest = store(Path(p), manifest, artifacts, on_progress=on_progress)
        return PackedPath("dir", digest, manifest.total_size)
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"cannot pack {path}: not a regular file or directory")
    # Hash (cached in this process), then copy only if missing: an unchanged
    # input is never copied again.
    digest = _digest(p, st)
    if artifacts.has(digest):
        if on_progress is not None and st.st_size:
            on_progress(st.st_size)
    else:
        artifacts.put_file(Path(p), digest=digest, on_progress=on_progress)
    return PackedPath("file", digest, st.st_size)


def unpack_path(
    packed: PackedPath, dest: Path, artifacts: ArtifactStore, *, link_blobs: bool = False
) -> None:
    """Lay out a packed input at ``dest``: the file itself, or the directory's
    tree (``link_blobs`` as for :func:`materialize`)."""
    if packed.kind == "file":
        artifacts.materialize(packed.digest, dest, link=link_blobs)
    elif packed.kind == "dir":
        materialize(load(artifacts, packed.digest), dest, artifacts.path, link_blobs=link_blobs)
    else:
        raise BundleError(f"unknown packed kind {packed.kind!r} (expected file or dir)")
