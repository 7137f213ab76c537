"""Bundles on real trees: skip rules, digests, store, and hostile manifests."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpulayer.artifacts as artifacts_mod
from gpulayer import bundle, defaults
from gpulayer.artifacts import ArtifactStore
from gpulayer.bundle import (
    BundleSummary,
    Entry,
    Manifest,
    PackedPath,
)
from gpulayer.errors import ArtifactError, BundleError, UnsafePathError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(root: Path, files: dict[str, bytes | str]) -> Path:
    """Create files (bytes) and symlinks (``"-> target"`` strings) under root."""
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            assert content.startswith("-> ")
            p.symlink_to(content[3:])
        else:
            p.write_bytes(content)
    return root


def paths(manifest: Manifest) -> set[str]:
    return {e.path for e in manifest.entries}


def snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Everything observable about a tree: kinds, content, exec bits, link targets."""
    out: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("symlink", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.read_bytes(), bool(p.stat().st_mode & 0o100))
    return out


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the digest cache trust files written a moment ago (no racy window)."""
    monkeypatch.setattr(artifacts_mod, "_RACY_NS", -(10**18))


# -- scan ----------------------------------------------------------------------


def test_scan_records_files_dirs_and_exec_bits(tmp_path: Path) -> None:
    root = write(tmp_path / "src", {"train.py": b"print(1)\n", "pkg/util.py": b"x = 1\n"})
    (root / "empty").mkdir()
    (root / "run.sh").write_bytes(b"#!/bin/sh\n")
    (root / "run.sh").chmod(0o750)
    (root / "train.py").chmod(0o600)
    m = bundle.scan(root)
    assert [e.path for e in m.entries] == sorted(paths(m))
    by = {e.path: e for e in m.entries}
    assert by["train.py"] == Entry("train.py", "file", 9, 0o644, sha(b"print(1)\n"))
    assert by["run.sh"].mode == 0o755
    assert by["pkg"] == Entry("pkg", "dir", mode=0o755)
    assert by["empty"].kind == "dir"
    assert (m.file_count, m.total_size) == (3, 9 + 6 + 10)


def test_manifest_encoding_is_pinned(tmp_path: Path) -> None:
    root = write(tmp_path / "src", {"a": b"x", "d/b": b"", "l": "-> a"})
    m = bundle.scan(root)
    assert msgspec.json.encode(m) == (
        b'{"entries":[{"path":"a","kind":"file","size":1,"digest":"%s"},'
        b'{"path":"d","kind":"dir","mode":493},'
        b'{"path":"d/b","kind":"file","digest":"%s"},'
        b'{"path":"l","kind":"symlink","target":"a"}]}' % (sha(b"x").encode(), sha(b"").encode())
    )
    assert bundle.manifest_digest(m) == sha(msgspec.json.encode(m))


def test_identical_trees_give_identical_digests(tmp_path: Path) -> None:
    files: dict[str, bytes | str] = {f"d{i % 3}/f{i}.py": b"%d" % i for i in range(20)}
    files["link"] = "-> d0"
    a = write(tmp_path / "a", files)
    b = write(tmp_path / "b", dict(reversed(files.items())))  # other creation order
    (b / "d1" / "f1.py").chmod(0o600)  # another umask: only the exec bit counts
    os.utime(b / "d2" / "f2.py", ns=(10**18, 10**18))
    assert bundle.manifest_digest(bundle.scan(a)) == bundle.manifest_digest(bundle.scan(b))
    (b / "d0" / "f0.py").write_bytes(b"changed")
    assert bundle.manifest_digest(bundle.scan(a)) != bundle.manifest_digest(bundle.scan(b))
    (b / "d0" / "f0.py").write_bytes(b"0")
    (b / "d0" / "f0.py").chmod(0o755)
    assert bundle.manifest_digest(bundle.scan(a)) != bundle.manifest_digest(bundle.scan(b))


def test_skip_rules(tmp_path: Path) -> None:
    home = tmp_path / "src" / "myhome"
    root = write(
        tmp_path / "src",
        {
            "train.py": b"",
            ".git/HEAD": b"ref",
            "sub/.git": b"gitdir: ../.git/modules/sub",  # a submodule's .git file
            "sub/code.py": b"",
            ".venv/pyvenv.cfg": b"home = /usr",
            ".venv/lib/site.py": b"",
            "tools/myenv/pyvenv.cfg": b"",  # any name: the marker decides
            "tools/myenv/bin/python": b"",
            "tools/keep.py": b"",
            "gpulayer_runs/job1/out.txt": b"",
            "sub/gpulayer_runs/x": b"",
            "pkg/__pycache__/m.cpython-311.pyc": b"",
            "pkg/m.py": b"",
            "otherhome/.gpulayer-home": b"",
            "otherhome/gpulayer.db": b"",
            "myhome/gpulayer.db": b"",  # a home without marker, passed as home=
        },
    )
    m = bundle.scan(root, home=home)
    assert paths(m) == {
        "train.py",
        "sub",
        "sub/code.py",
        "tools",
        "tools/keep.py",
        "pkg",
        "pkg/m.py",
    }
    # The home argument only matters when it is inside the tree.
    assert "myhome/gpulayer.db" in paths(bundle.scan(root, home=tmp_path / "elsewhere"))


def test_root_itself_is_never_skipped(tmp_path: Path) -> None:
    root = write(tmp_path / "proj", {"pyvenv.cfg": b"", "a.py": b""})
    assert paths(bundle.scan(root)) == {"pyvenv.cfg", "a.py"}


def test_gpulayerignore_with_negation_as_in_git(tmp_path: Path) -> None:
    root = write(
        tmp_path / "src",
        {
            ".gpulayerignore": b"# data and logs stay home\n*.log\n!keep.log\ndata/\n"
            b"!data/wanted.txt\n/build\ncache/*\n!cache/kept.bin\n",
            "a.py": b"",
            "run.log": b"",
            "keep.log": b"",
            "sub/deep.log": b"",
            "sub/keep.log": b"",
            "data/big.bin": b"",
            "data/wanted.txt": b"",  # git cannot re-include inside an excluded dir
            "sub/data/x": b"",  # "data/" matches at any depth
            "build/out.o": b"",
            "sub/build/out.o": b"",  # "/build" is anchored at the root
            "cache/a.bin": b"",
            "cache/kept.bin": b"",
            "cache/sub/b.bin": b"",
        },
    )
    assert paths(bundle.scan(root)) == {
        ".gpulayerignore",
        "a.py",
        "keep.log",
        "sub",
        "sub/keep.log",
        "sub/build",
        "sub/build/out.o",
        "cache",
        "cache/kept.bin",
    }


def test_pathspec_is_imported_only_for_an_ignore_file(tmp_path: Path) -> None:
    plain = write(tmp_path / "plain", {"a.py": b""})
    ignoring = write(tmp_path / "ignoring", {"a.py": b"", ".gpulayerignore": b"*.log\n"})
    code = (
        "import sys; from pathlib import Path; from gpulayer import bundle\n"
        "assert 'pathspec' not in sys.modules, 'imported by gpulayer.bundle'\n"
        f"bundle.scan(Path({str(plain)!r}))\n"
        "assert 'pathspec' not in sys.modules, 'imported without an ignore file'\n"
        f"bundle.scan(Path({str(ignoring)!r}))\n"
        "assert 'pathspec' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_symlinks_are_recorded_not_followed(tmp_path: Path) -> None:
    root = write(
        tmp_path / "src",
        {"sub/a.py": b"a", "to_dir": "-> sub", "to_file": "-> sub/a.py", "dangling": "-> nowhere"},
    )
    by = {e.path: e for e in bundle.scan(root).entries}
    assert set(by) == {"sub", "sub/a.py", "to_dir", "to_file", "dangling"}
    assert by["to_dir"] == Entry("to_dir", "symlink", target="sub")
    assert by["dangling"].target == "nowhere"


def test_symlink_out_of_the_tree_is_refused_at_scan(tmp_path: Path) -> None:
    write(tmp_path, {"secret": b"s"})
    root = write(tmp_path / "src", {"a.py": b"", "data": "-> ../secret", "abs": f"-> {tmp_path}"})
    with pytest.raises(UnsafePathError, match=r"'abs'.*\.gpulayerignore"):
        bundle.scan(root)
    (root / ".gpulayerignore").write_text("abs\ndata\n")
    assert paths(bundle.scan(root)) == {"a.py", ".gpulayerignore"}


def test_special_files_are_skipped_and_bad_names_refused(tmp_path: Path) -> None:
    root = write(tmp_path / "src", {"a.py": b""})
    os.mkfifo(root / "fifo")
    assert paths(bundle.scan(root)) == {"a.py"}
    with open(os.path.join(os.fsencode(root), b"bad\xff.py"), "wb"):
        pass
    with pytest.raises(UnsafePathError, match="UTF-8"):
        bundle.scan(root)


def test_scan_errors(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not a directory"):
        bundle.scan(tmp_path / "missing")


def test_rescan_of_unchanged_tree_reads_no_file(tmp_path: Path, settled: None) -> None:
    root = write(tmp_path / "src", {f"f{i}": b"%d" % i for i in range(10)})
    first = bundle.scan(root)
    hits = bundle._DIGESTS.hits
    misses = bundle._DIGESTS.misses
    assert bundle.scan(root) == first
    assert (bundle._DIGESTS.hits - hits, bundle._DIGESTS.misses - misses) == (10, 0)
    (root / "f3").write_bytes(b"X")  # same size: the stat key still changes
    os.utime(root / "f3", ns=(10**18, 10**18))
    assert {e.path: e.digest for e in bundle.scan(root).entries}["f3"] == sha(b"X")
    assert bundle._DIGESTS.misses - misses == 1


# -- store ---------------------------------------------------------------------


def test_unchanged_tree_is_never_copied_twice(tmp_path: Path, store: ArtifactStore) -> None:
    root = write(tmp_path / "src", {f"d/f{i}": os.urandom(1000 + i) for i in range(8)})
    manifest = bundle.scan(root)
    digest = bundle.store(root, manifest, store)
    assert bundle.load(store, digest) == manifest
    blob_files = sorted(p for p in store.root.rglob("*") if p.is_file())
    assert len(blob_files) == 8 + 1
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in blob_files}
    # Proof that no source file is read, let alone copied: they are gone.
    for e in manifest.entries:
        if e.kind == "file":
            (root / e.path).unlink()
    progress: list[int] = []
    assert bundle.store(root, manifest, store, on_progress=progress.append) == digest
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_ctime_ns) for p in blob_files}
    assert after == before
    assert sorted(p for p in store.root.rglob("*") if p.is_file()) == blob_files
    assert sum(progress) == manifest.total_size


def test_store_shares_blobs_and_progress_sums_to_total(
    tmp_path: Path, store: ArtifactStore
) -> None:
    big = os.urandom(2 * 1024 * 1024 + 7)
    v1 = write(tmp_path / "v1", {"model.py": b"v1", "weights.bin": big, "same.txt": b"same"})
    v2 = write(tmp_path / "v2", {"model.py": b"v2", "weights.bin": big, "copy.txt": b"same"})
    bundle.store(v1, bundle.scan(v1), store)
    m2 = bundle.scan(v2)
    progress: list[int] = []
    bundle.store(v2, m2, store, on_progress=progress.append)
    assert sum(progress) == m2.total_size == 4 + 2 + len(big)
    # copy.txt and weights.bin are stored already: reported at once, unread.
    assert progress == [4, len(big), 2]
    file_blobs = [p for p in (store.root / "sha256").rglob("*") if p.is_file()]
    assert len(file_blobs) == 4 + 2  # v1, v2, big, same + two manifests


def test_file_changed_after_scan_is_refused(tmp_path: Path, store: ArtifactStore) -> None:
    root = write(tmp_path / "src", {"a.py": b"one"})
    manifest = bundle.scan(root)
    (root / "a.py").write_bytes(b"two")
    with pytest.raises(ArtifactError, match="change"):
        bundle.store(root, manifest, store)
    (root / "a.py").unlink()
    with pytest.raises(BundleError, match=r"a\.py"):
        bundle.store(root, manifest, store)


# -- load ----------------------------------------------------------------------


def test_load_validates(store: ArtifactStore) -> None:
    garbage = store.put_bytes(b"\x00not json")
    with pytest.raises(BundleError, match="not a bundle manifest"):
        bundle.load(store, garbage)
    wrong_shape = store.put_bytes(b'{"entries": [{"path": 1, "kind": "file"}]}')
    with pytest.raises(BundleError, match="not a bundle manifest"):
        bundle.load(store, wrong_shape)
    hostile = store.put_bytes(b'{"entries": [{"path": "../x", "kind": "dir"}]}')
    with pytest.raises(UnsafePathError, match=r"'\.\./x'"):
        bundle.load(store, hostile)
    good = Manifest((Entry("a", "dir"),))
    d = store.put_bytes(msgspec.json.encode(good))
    assert bundle.load(store.read_bytes, d) == good
    with pytest.raises(ArtifactError, match="do not match"):
        bundle.load(lambda _: b'{"entries": []}', d)


# -- materialize ----------------------------------------------------------------


def test_materialize_round_trip(tmp_path: Path, store: ArtifactStore) -> None:
    big = os.urandom(defaults.LINK_MIN_BYTES)
    root = write(
        tmp_path / "src",
        {"a.py": b"a", "pkg/b.py": b"b", "data.bin": big, "tool": big + b"!", "l": "-> pkg"},
    )
    (root / "empty").mkdir()
    (root / "tool").chmod(0o755)
    (root / "run.sh").write_bytes(b"#!/bin/sh\n")
    (root / "run.sh").chmod(0o700)
    manifest = bundle.scan(root)
    digest = bundle.store(root, manifest, store)
    dest = tmp_path / "ws"
    bundle.materialize(bundle.load(store, digest), dest, store.path)
    assert snapshot(dest) == snapshot(root)
    assert bundle.manifest_digest(bundle.scan(dest)) == digest
    for d in ("pkg", "empty"):
        assert stat.S_IMODE((dest / d).stat().st_mode) == 0o755

    def mode(p: str) -> int:
        return stat.S_IMODE((dest / p).stat().st_mode)

    def shares_blob(p: str) -> bool:
        digest = {e.path: e.digest for e in manifest.entries}[p]
        assert digest is not None
        return (dest / p).stat().st_ino == store.path(digest).stat().st_ino

    # Small files and executables: private copies with their own mode.
    assert (mode("a.py"), mode("run.sh"), mode("tool")) == (0o644, 0o755, 0o755)
    assert not shares_blob("a.py") and not shares_blob("tool")
    (dest / "a.py").write_bytes(b"edited by the job")
    assert store.read_bytes(sha(b"a")) == b"a"
    # Large files: private too (a clone where the filesystem can, else a copy),
    # with their own mode: the job's user may edit them, never the blob.
    assert not shares_blob("data.bin") and mode("data.bin") == 0o644
    # Linked read-only to the blob only when asked (a reader who cannot write
    # the blob), and then still cloned where the filesystem can.
    linked = tmp_path / "linked"
    bundle.materialize(bundle.load(store, digest), linked, store.path, link_blobs=True)
    can_clone = artifacts_mod.clone_file(root / "a.py", tmp_path / "probe", 0o644)
    big_ino = (linked / "data.bin").stat().st_ino
    assert (big_ino == store.path(sha(big)).stat().st_ino) is not can_clone


def test_materialize_refuses_a_non_empty_dest(tmp_path: Path, store: ArtifactStore) -> None:
    dest = write(tmp_path / "ws", {"already": b""})
    with pytest.raises(BundleError, match="not empty"):
        bundle.materialize(Manifest((Entry("a", "dir"),)), dest, store.path)
    assert os.listdir(dest) == ["already"]


def test_materialize_missing_blob(tmp_path: Path, store: ArtifactStore) -> None:
    m = Manifest((Entry("a.py", "file", 1, digest=sha(b"never stored")),))
    with pytest.raises(ArtifactError, match=r"'a\.py'"):
        bundle.materialize(m, tmp_path / "ws", store.path)


D = sha(b"blob")


def f(path: str) -> Entry:
    return Entry(path, "file", 4, digest=D)


def link(path: str, target: str) -> Entry:
    return Entry(path, "symlink", target=target)


HOSTILE: dict[str, tuple[list[Entry], str]] = {
    "absolute": ([f("/etc/passwd")], "/etc/passwd"),
    "dotdot": ([f("../evil")], "../evil"),
    "dotdot inside": ([Entry("a", "dir"), f("a/../../evil")], "a/../../evil"),
    "empty": ([f("")], ""),
    "empty component": ([f("a//b")], "a//b"),
    "dot component": ([f("./a")], "./a"),
    "trailing dot": ([f("a/.")], "a/."),
    "trailing slash": ([f("a/")], "a/"),
    "backslash": ([f("..\\evil")], "..\\evil"),
    "nul": ([f("a\x00b")], "a\x00b"),
    "duplicate": ([f("a"), f("a")], "a"),
    "file and dir": ([Entry("a", "dir"), f("a")], "a"),
    "link up": ([link("l", "../outside")], "l"),
    "link absolute": ([link("l", "/etc")], "l"),
    "link deep up": ([Entry("a", "dir"), link("a/l", "../../x")], "a/l"),
    "link via link": ([Entry("sub", "dir"), link("sub/up", ".."), link("x", "sub/up/..")], "x"),
    "link empty target": ([link("l", "")], "l"),
    "through symlink": ([Entry("sub", "dir"), link("l", "sub"), f("l/x")], "l/x"),
    "through file": ([f("a"), f("a/x")], "a/x"),
    "unknown kind": ([Entry("dev", "fifo")], "dev"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("entries, culprit", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_manifest_writes_nothing(
    tmp_path: Path, store: ArtifactStore, entries: list[Entry], culprit: str
) -> None:
    assert store.put_bytes(b"blob") == D
    before = sorted(tmp_path.rglob("*"))
    dest = tmp_path / "ws"
    with pytest.raises(UnsafePathError) as exc:
        bundle.materialize(Manifest(tuple(entries)), dest, store.path)
    assert repr(culprit) in str(exc.value)
    assert not dest.exists()
    assert sorted(tmp_path.rglob("*")) == before
    hostile = store.put_bytes(msgspec.json.encode(Manifest(tuple(entries))))
    with pytest.raises(BundleError):  # an unknown kind fails decoding, the rest validation
        bundle.load(store, hostile)


def test_links_inside_the_bundle_are_allowed(tmp_path: Path, store: ArtifactStore) -> None:
    m = Manifest(
        (
            Entry("a", "dir"),
            Entry("a/b", "dir"),
            link("a/b/root", "../.."),
            link("a/b/up", "../c"),
            link("dot", "."),
            link("loop1", "loop2"),  # resolves nowhere (ELOOP), not outside
            link("loop2", "loop1"),
            link("via", "a/b/root/a"),
        )
    )
    dest = tmp_path / "ws"
    bundle.materialize(m, dest, store.path)
    assert os.readlink(dest / "a/b/root") == "../.."
    assert (dest / "via" / "b").is_dir()


# -- summaries and single paths ---------------------------------------------------


def test_summarize_and_is_large(tmp_path: Path) -> None:
    root = write(tmp_path / "src", {f"f{i}": b"x" * i for i in range(8)})
    s = bundle.summarize(bundle.scan(root))
    assert s == BundleSummary(
        files=8, bytes=28, largest=(("f7", 7), ("f6", 6), ("f5", 5), ("f4", 4), ("f3", 3))
    )
    assert not bundle.is_large(s)
    assert bundle.is_large(
        BundleSummary(1, defaults.LARGE_BUNDLE_BYTES, (("x", defaults.LARGE_BUNDLE_BYTES),))
    )
    assert not bundle.is_large(BundleSummary(1, defaults.LARGE_BUNDLE_BYTES - 1, ()))


def test_pack_and_unpack_paths(tmp_path: Path, store: ArtifactStore) -> None:
    data = write(tmp_path / "data", {"train.csv": b"1,2\n", "val/v.csv": b"3\n"})
    packed_dir = bundle.pack_path(data, store)
    assert packed_dir == PackedPath("dir", bundle.manifest_digest(bundle.scan(data)), 6)
    packed_file = bundle.pack_path(data / "train.csv", store)
    assert packed_file == PackedPath("file", sha(b"1,2\n"), 4)
    blob = store.path(packed_file.digest).stat()
    assert bundle.pack_path(data / "train.csv", store) == packed_file
    assert store.path(packed_file.digest).stat().st_ino == blob.st_ino  # not stored again

    bundle.unpack_path(packed_dir, tmp_path / "in_dir", store)
    assert snapshot(tmp_path / "in_dir") == snapshot(data)
    bundle.unpack_path(packed_file, tmp_path / "in.csv", store)
    assert (tmp_path / "in.csv").read_bytes() == b"1,2\n"
    with pytest.raises(BundleError, match="missing"):
        bundle.pack_path(tmp_path / "missing", store)
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(BundleError, match="not a regular file"):
        bundle.pack_path(tmp_path / "fifo", store)


# -- property: any small tree round-trips --------------------------------------

names = st.text(alphabet="abAB01_-.", min_size=1, max_size=5).filter(lambda s: s not in (".", ".."))
leaves = st.one_of(
    st.tuples(st.just("file"), st.binary(max_size=200), st.booleans()),
    st.tuples(st.just("link"), names),
)
trees = st.dictionaries(
    names,
    st.recursive(leaves, lambda kids: st.dictionaries(names, kids, max_size=4), max_leaves=12),
)


def build(root: Path, tree: dict[str, Any]) -> None:
    root.mkdir(exist_ok=True)
    for name, node in tree.items():
        p = root / name
        if isinstance(node, dict):
            build(p, node)
        elif node[0] == "file":
            p.write_bytes(node[1])
            p.chmod(0o755 if node[2] else 0o644)
        else:
            p.symlink_to(node[1])


# Examples are many and tiny: on tmpfs where there is one, the disk's fsync
# and unlink costs would be most of the test's time.
FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@settings(max_examples=100, deadline=None)
@given(tree=trees)
def test_any_tree_round_trips(tree: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(dir=FAST_TMP) as tmp:
        base = Path(tmp)
        build(base / "a", tree)
        build(base / "b", tree)
        store = ArtifactStore(base / "store")
        manifest = bundle.scan(base / "a")
        digest = bundle.store(base / "a", manifest, store)
        assert bundle.manifest_digest(bundle.scan(base / "b")) == digest
        bundle.materialize(bundle.load(store, digest), base / "ws", store.path)
        assert snapshot(base / "ws") == snapshot(base / "a")
        assert bundle.manifest_digest(bundle.scan(base / "ws")) == digest


def test_file_digest(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"data")
    assert bundle.file_digest(tmp_path / "f") == sha(b"data")
    with pytest.raises(BundleError, match="cannot read"):
        bundle.file_digest(tmp_path / "missing")


def test_unreadable_ignore_file_is_a_bundle_error(tmp_path: Path) -> None:
    root = write(tmp_path / "src", {"a.py": b"", ".gpulayerignore": b"\xff\xfe bad"})
    with pytest.raises(BundleError, match=r"\.gpulayerignore"):
        bundle.scan(root)
