"""The content-addressed blob store, on real files."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

import pytest

from gpulayer.artifacts import ArtifactStore, DigestCache, sha256_file
from gpulayer.errors import ArtifactError, GPUlayerError


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


def blobs(store: ArtifactStore) -> list[Path]:
    return sorted(p for p in (store.root / "sha256").rglob("*") if p.is_file())


def leftovers(store: ArtifactStore) -> list[Path]:
    tmp = store.root / "tmp"
    return list(tmp.iterdir()) if tmp.exists() else []


def test_root_is_created_lazily(tmp_path: Path) -> None:
    s = ArtifactStore(tmp_path / "store")
    assert not s.has(sha(b"x"))
    assert not (tmp_path / "store").exists()
    s.put_bytes(b"x")
    assert (tmp_path / "store").is_dir()


def test_put_bytes_layout_mode_and_digest_stability(store: ArtifactStore) -> None:
    d = store.put_bytes(b"hello")
    assert d == sha(b"hello") == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert store.path(d) == store.root / "sha256" / "2c" / d
    assert store.read_bytes(d) == b"hello"
    assert stat.S_IMODE(store.path(d).stat().st_mode) == 0o444
    with store.open(d) as f:
        assert f.read() == b"hello"
    assert store.put_bytes(b"hello") == d
    assert blobs(store) == [store.path(d)]
    assert leftovers(store) == []


def test_empty_blob(store: ArtifactStore, tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    assert store.put_file(tmp_path / "empty") == sha(b"") == store.put_bytes(b"")
    assert store.read_bytes(sha(b"")) == b""


@pytest.mark.parametrize(
    "bad", ["", "abc", "A" * 64, "g" * 64, "0" * 63, "0" * 65, "../" + "0" * 61, "0" * 62 + "/x"]
)
def test_path_rejects_bad_digests(store: ArtifactStore, bad: str) -> None:
    with pytest.raises(ArtifactError, match="64 lowercase hex"):
        store.path(bad)
    with pytest.raises(ArtifactError):
        store.has(bad)


def test_missing_blob_is_an_artifact_error(store: ArtifactStore, tmp_path: Path) -> None:
    d = sha(b"nope")
    for call in (store.read_bytes, store.open):
        with pytest.raises(ArtifactError, match=d):
            call(d)
    with pytest.raises(ArtifactError, match=d):
        store.materialize(d, tmp_path / "out")
    assert issubclass(ArtifactError, GPUlayerError)


def test_put_file_streams_large_file_with_progress(store: ArtifactStore, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 123)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    calls: list[int] = []
    d = store.put_file(src, on_progress=calls.append)
    assert d == sha(data) == sha256_file(src)
    assert sum(calls) == len(data) and len(calls) == 4
    assert store.read_bytes(d) == data
    assert leftovers(store) == []


def test_put_file_with_known_digest_never_reads_src(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"content")
    d = store.put_file(src)
    before = store.path(d).stat()
    src.unlink()  # proof that src is not opened: it no longer exists
    calls: list[int] = []
    assert store.put_file(src, digest=d, on_progress=calls.append) == d
    after = store.path(d).stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_ctime_ns,
    )
    assert calls == []


def test_put_existing_content_keeps_the_existing_blob(store: ArtifactStore, tmp_path: Path) -> None:
    d = store.put_bytes(b"same")
    before = store.path(d).stat()
    (tmp_path / "f").write_bytes(b"same")
    assert store.put_file(tmp_path / "f") == d
    after = store.path(d).stat()
    assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)
    assert leftovers(store) == []


def test_digest_mismatch_leaves_nothing_behind(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"actual content")
    claimed = sha(b"claimed content")
    with pytest.raises(ArtifactError) as exc:
        store.put_file(src, digest=claimed)
    assert claimed in str(exc.value) and sha(b"actual content") in str(exc.value)
    assert not store.has(claimed) and not store.has(sha(b"actual content"))
    assert blobs(store) == [] and leftovers(store) == []


def test_failed_read_leaves_nothing_behind(store: ArtifactStore, tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError):
        store.put_file(tmp_path)
    with pytest.raises(FileNotFoundError):
        store.put_file(tmp_path / "missing")
    assert blobs(store) == [] and leftovers(store) == []


def test_concurrent_writers_of_one_digest_all_succeed(store: ArtifactStore, tmp_path: Path) -> None:
    data = os.urandom(2 * 1024 * 1024)
    src = tmp_path / "f"
    src.write_bytes(data)
    barrier = threading.Barrier(8)
    results: list[str] = []
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            barrier.wait()
            results.append(store.put_file(src) if i % 2 else store.put_bytes(data))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [sha(data)] * 8
    assert store.read_bytes(sha(data)) == data
    assert blobs(store) == [store.path(sha(data))] and leftovers(store) == []


def test_materialize_is_private_unless_linking_is_asked(
    store: ArtifactStore, tmp_path: Path
) -> None:
    d = store.put_bytes(b"blob")
    dest = tmp_path / "out"
    store.materialize(d, dest)
    assert dest.read_bytes() == b"blob"
    # Its own file: its owner may chmod and edit it, and the blob stays as it was.
    assert dest.stat().st_ino != store.path(d).stat().st_ino
    assert stat.S_IMODE(dest.stat().st_mode) == 0o444
    dest.chmod(0o644)
    dest.write_bytes(b"edited")
    assert store.read_bytes(d) == b"blob"
    dest.unlink()
    store.materialize(d, dest, link=True)  # for a reader who cannot write the blob
    assert dest.stat().st_ino == store.path(d).stat().st_ino
    assert stat.S_IMODE(dest.stat().st_mode) == 0o444
    # An existing file at dest is replaced, not written through.
    other = tmp_path / "other"
    other.write_bytes(b"keep me")
    dest.unlink()
    dest.symlink_to(other)
    store.materialize(d, dest)
    assert not dest.is_symlink() and dest.read_bytes() == b"blob"
    assert other.read_bytes() == b"keep me"


def _other_device_dir(tmp_path: Path) -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a second filesystem (/dev/shm) to test cross-device fallbacks")
    return shm


def test_cross_device_materialize_and_link_from_copy(tmp_path: Path) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir=_other_device_dir(tmp_path)) as other:
        store = ArtifactStore(tmp_path / "store")
        d = store.put_bytes(b"across")
        dest = Path(other) / "out"
        store.materialize(d, dest)
        assert dest.read_bytes() == b"across"
        assert stat.S_IMODE(dest.stat().st_mode) == 0o444
        far = ArtifactStore(Path(other) / "cache")
        far.link_from(store.path(d), d)
        assert far.read_bytes(d) == b"across"
        assert far.path(d).stat().st_ino != store.path(d).stat().st_ino
        assert stat.S_IMODE(far.path(d).stat().st_mode) == 0o444


def test_link_from_shares_the_inode(tmp_path: Path) -> None:
    plane = ArtifactStore(tmp_path / "plane")
    cache = ArtifactStore(tmp_path / "cache")
    d = plane.put_bytes(b"shared")
    cache.link_from(plane.path(d), d)
    assert cache.path(d).stat().st_ino == plane.path(d).stat().st_ino
    cache.link_from(plane.path(d), d)  # already there: a no-op
    with pytest.raises(ArtifactError, match="does not exist"):
        cache.link_from(tmp_path / "missing", sha(b"missing"))


def test_digest_cache_reuses_unchanged_and_rehashes_changed(tmp_path: Path) -> None:
    cache = DigestCache()
    f = tmp_path / "f"
    f.write_bytes(b"one")
    os.utime(f, ns=(10**18, 10**18))  # far from "now", but ctime is still recent
    assert cache.digest(str(f), f.stat()) == sha(b"one")
    assert cache.digest(str(f), f.stat()) == sha(b"one")
    # ctime is now: a racy entry, never trusted from the cache.
    assert (cache.hits, cache.misses) == (0, 2)


def test_digest_cache_hits_for_settled_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpulayer.artifacts as artifacts

    monkeypatch.setattr(artifacts, "_RACY_NS", -(10**18))  # every file counts as settled
    cache = DigestCache()
    f = tmp_path / "f"
    f.write_bytes(b"one")
    os.utime(f, ns=(10**18, 10**18))
    assert cache.digest(str(f), f.stat()) == sha(b"one")
    assert cache.digest(str(f), f.stat()) == sha(b"one")
    assert (cache.hits, cache.misses) == (1, 1)
    f.write_bytes(b"two")  # same size, same inode: the timestamps must catch it
    os.utime(f, ns=(10**18, 10**18 + 1))
    assert cache.digest(str(f), f.stat()) == sha(b"two")
    assert (cache.hits, cache.misses) == (1, 2)


def test_put_files_stores_many_at_once(store: ArtifactStore, tmp_path: Path) -> None:
    contents = [os.urandom(100 + i) for i in range(20)]
    sources = {}
    for i, data in enumerate(contents):
        (tmp_path / f"f{i}").write_bytes(data)
        sources[sha(data)] = tmp_path / f"f{i}"
    progress: list[int] = []
    store.put_files(sources, on_progress=progress.append)
    assert all(store.read_bytes(sha(d)) == d for d in contents)
    assert sum(progress) == sum(len(d) for d in contents)
    assert leftovers(store) == []


def test_put_files_failure_leaves_no_wrong_blob(store: ArtifactStore, tmp_path: Path) -> None:
    sources = {}
    for i in range(6):
        (tmp_path / f"f{i}").write_bytes(b"%d" % i)
        sources[sha(b"%d" % i)] = tmp_path / f"f{i}"
    sources[sha(b"claimed")] = tmp_path / "f0"
    with pytest.raises(ArtifactError, match=sha(b"claimed")):
        store.put_files(sources)
    assert not store.has(sha(b"claimed"))
    assert leftovers(store) == []
