"""Outputs: unsafe names, links out of the workspace, and outputs too large.

Each test makes the attack first: a worker reporting outputs named to land
outside the download folder, a server record or folder manifest doing the
same, links planted in the download folder, a job declaring links to
``/etc/passwd`` and ``/``, a job writing a sparse file past the limit. Then it
checks that nothing happened: sentinels at the targets are still there byte
for byte, nothing was stored, the job ended with a reason naming the output.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import gpulayer
from gpulayer import bundle
from gpulayer.artifacts import ArtifactStore
from gpulayer.errors import UnsafePathError
from gpulayer.jobs import JobInfo, RunTask, TaskResult, WorkerInfo
from gpulayer.outputs import OutputLimitError, UnsafeOutputError, check_result, matches
from gpulayer.service import ControlPlane
from gpulayer.spec import ArtifactRef, parse_spec
from gpulayer.transport.http import HttpTransport
from gpulayer.worker.collect import collect_outputs
from server.conftest import ServerProc, worker_start_refused
from server.rawhttp import request

MiB = 1024 * 1024
PLANTED = b"planted by a hostile worker"


# -- sentinels: what must still be there, byte for byte --------------------------


def _plant(target: Path) -> dict[Path, bytes]:
    """A folder with a file at ``target`` (where an attack would write, or
    rmtree), and what it holds."""
    target.mkdir(parents=True)
    (target / "keep").write_bytes(b"the user's own file " + os.urandom(8))
    return _snapshot(target)


def _snapshot(top: Path) -> dict[Path, bytes]:
    found: dict[Path, bytes] = {}
    for root, dirs, files in os.walk(top):
        for name in files + dirs:
            p = Path(root, name)
            found[p] = p.read_bytes() if p.is_file() and not p.is_symlink() else b"<dir>"
    return found


def _blobs(store_root: Path) -> set[str]:
    return {p.name for p in (store_root / "sha256").glob("*/*")}


# -- the control plane refuses them ------------------------------------------------


def _take(transport: HttpTransport, worker_id: str) -> RunTask:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for item in transport.acquire(worker_id, 5):
            if isinstance(item, RunTask):
                return item
    raise AssertionError("no task was placed on the worker in 30 s")


@pytest.mark.parametrize(
    "name", ["<absolute>", "../../x", "a/../../x", "a/./b", "a\\..\\..\\x", "elsewhere.txt"]
)
def test_a_worker_reporting_an_unsafe_output_gets_a_422_and_nothing_is_stored(
    server: ServerProc, tmp_path: Path, name: str
) -> None:
    if name == "<absolute>":
        name = str(tmp_path / "victim" / "x")
    dl = tmp_path / "runs" / "dl"
    target = Path(os.path.normpath(dl / name))  # where today's download would write
    escapes = name.startswith("/") or ".." in name.split("/")
    before = _plant(target) if escapes else {}
    worker_token = server.token("worker")
    hostile = HttpTransport(server.url, token=worker_token)
    me = hostile.register_worker(WorkerInfo(id="", name="hostile", host="h", slot_gpus=[None]))
    blobs_before = _blobs(server.home / "artifacts")
    with server.client() as admin, contextlib.closing(hostile):
        job = admin.submit(command=["true"], outputs=["x", "out/*.txt"])
        task = _take(hostile, me.id)
        digest = hashlib.sha256(PLANTED).hexdigest()
        result = TaskResult(
            job_id=task.job_id,
            attempt=task.attempt,
            worker_id=me.id,
            outcome="exited",
            exit_code=0,
            outputs={name: ArtifactRef(kind="file", digest=digest, size=len(PLANTED))},
        )
        status, body, _ = request(
            server,
            "POST",
            "/api/v1/tasks/finished",
            raw=msgspec.json.encode(result),
            token=worker_token,
        )
        assert status == 422, body
        assert repr(name) in body["error"] and "refused" in body["error"]
        # The job does not wait for a report that will not come again.
        assert job.wait(timeout=30) == "failed"
        assert repr(name) in (job.info.reason or "") and job.info.outputs == {}
        out = job.download_outputs(dl)
        assert sorted(os.listdir(out)) == ["logs.txt"]
    assert _blobs(server.home / "artifacts") == blobs_before
    if escapes:
        assert _snapshot(target) == before


def _register(plane: ControlPlane) -> str:
    return plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[None])).id


def _result(task: RunTask, worker: str, outputs: dict[str, ArtifactRef]) -> TaskResult:
    return TaskResult(
        job_id=task.job_id,
        attempt=task.attempt,
        worker_id=worker,
        outcome="exited",
        exit_code=0,
        outputs=outputs,
    )


def test_the_control_plane_refuses_unsafe_outputs_in_process_too(plane: ControlPlane) -> None:
    wid = _register(plane)
    ref = ArtifactRef(kind="file", digest="0" * 64, size=1)
    job = plane.submit(parse_spec({"command": ["true"], "outputs": ["out/*.txt"]}))
    (task,) = [i for i in plane.acquire(wid, 5) if isinstance(i, RunTask)]
    with pytest.raises(UnsafeOutputError, match=r"'out/../../x' refused: a '\.\.' component"):
        plane.task_finished(_result(task, wid, {"out/a.txt": ref, "out/../../x": ref}))
    final = plane.get(job.id)
    assert final.state == "failed" and final.outputs == {}
    assert "exited with code 0, but its worker reported an output that was refused" in str(
        final.reason
    )
    stored = plane.store.get_job(job.id)
    assert stored is not None and stored.outputs == {}
    # What a job declared is accepted: the refusal is not of every result.
    job = plane.submit(parse_spec({"command": ["true"], "outputs": ["./out/*.txt", "m.pt"]}))
    (task,) = [i for i in plane.acquire(wid, 5) if isinstance(i, RunTask)]
    plane.task_finished(_result(task, wid, {"out/a.txt": ref, "m.pt": ref}))
    assert plane.get(job.id).state == "succeeded"
    assert set(plane.get(job.id).outputs) == {"out/a.txt", "m.pt"}


@pytest.mark.parametrize(
    ("declared", "name", "ok"),
    [
        ("out/*.txt", "out/a.txt", True),
        ("out/*.txt", "out/sub/a.txt", False),
        ("out/*.txt", "out/.hidden.txt", False),
        ("**/*.pt", "a/b/c.pt", True),
        ("**/*.pt", "c.pt", True),
        ("**/*.pt", ".git/c.pt", False),
        ("ckpt/**", "ckpt", True),
        ("ckpt/**", "ckpt/x/y", True),
        ("./model.pt", "model.pt", True),
        ("model.pt", "./model.pt", False),
        ("ep[12].pt", "ep1.pt", True),
    ],
)
def test_what_a_declared_glob_collects(declared: str, name: str, ok: bool) -> None:
    assert matches(declared, name) is ok
    if ok:
        check_result([declared], [name])
    else:
        with pytest.raises(UnsafeOutputError):
            check_result([declared], [name])


# -- the client checks again -------------------------------------------------------


@pytest.fixture
def embedded(home: Path) -> Iterator[gpulayer.Client]:
    with gpulayer.Client(home=home, auto_worker=False) as c:
        yield c


def _record(client: gpulayer.Client, outputs: dict[str, ArtifactRef]) -> JobInfo:
    """A final job record as an old or hostile server could send it, for a
    job of the store (queued: no worker takes it) whose log can be read."""
    job = client.submit(command=["true"])
    return JobInfo(id=job.id, spec=job.info.spec, state="succeeded", outputs=outputs)


@pytest.mark.parametrize("name", ["<absolute>", "../../x", "a/../../x", "a\\x", ""])
def test_download_refuses_unsafe_names_in_a_record_and_touches_nothing(
    embedded: gpulayer.Client, tmp_path: Path, name: str
) -> None:
    if name == "<absolute>":
        name = str(tmp_path / "victim" / "x")
    dl = tmp_path / "runs" / "dl"
    escapes = name.startswith("/") or ".." in name.split("/")
    target = Path(os.path.normpath(dl / name)) if escapes else tmp_path / "runs" / "other"
    before = _plant(target)
    ref = ArtifactRef(kind="file", digest=embedded.transport.upload_bytes(PLANTED), size=27)
    job = gpulayer.Job(embedded, _record(embedded, {"fine.txt": ref, name: ref}))
    with pytest.raises(UnsafeOutputError, match="refused"):
        job.download_outputs(dl)
    assert not dl.exists()  # not even the good output: refused before anything is written
    assert _snapshot(target) == before


@pytest.mark.parametrize(
    "entries",
    [
        [bundle.Entry("../../x", "file", size=27, digest=hashlib.sha256(PLANTED).hexdigest())],
        [
            bundle.Entry("l", "symlink", target="../../.."),
            bundle.Entry("l/x", "file", size=27, digest=hashlib.sha256(PLANTED).hexdigest()),
        ],
        [bundle.Entry("l", "symlink", target=os.sep + "tmp")],
    ],
    ids=["dotdot", "through-link", "absolute-link"],
)
def test_download_refuses_a_folder_manifest_that_leaves_it(
    embedded: gpulayer.Client, tmp_path: Path, entries: list[bundle.Entry]
) -> None:
    embedded.transport.upload_bytes(PLANTED)
    manifest = embedded.transport.upload_bytes(msgspec.json.encode(bundle.Manifest(tuple(entries))))
    dl = tmp_path / "dl"
    before = _plant(dl / "d")  # an earlier download of the folder: not removed either
    outside = _plant(tmp_path / "x")  # where dl/d/../../x lands
    job = gpulayer.Job(embedded, _record(embedded, {"d": ArtifactRef(kind="dir", digest=manifest)}))
    with pytest.raises(UnsafePathError, match="bundle entry"):
        job.download_outputs(dl)
    assert _snapshot(dl / "d") == before and os.listdir(dl) == ["d"]
    assert _snapshot(tmp_path / "x") == outside


def test_download_never_writes_through_a_link_in_the_folder(
    embedded: gpulayer.Client, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    before = _plant(victim / "dir")
    (victim / "notes.txt").write_bytes(b"my notes")
    dl = tmp_path / "dl"
    dl.mkdir()
    (dl / "out").symlink_to(victim / "dir")  # planted: out/x.txt would land in victim/dir
    (dl / "logs.txt").symlink_to(victim / "notes.txt")
    (dl / "model.pt").symlink_to(victim / "notes.txt")
    ref = ArtifactRef(kind="file", digest=embedded.transport.upload_bytes(PLANTED), size=27)
    job = gpulayer.Job(embedded, _record(embedded, {"out/x.txt": ref}))
    with pytest.raises(UnsafeOutputError, match="symbolic link"):
        job.download_outputs(dl)
    assert not (victim / "dir" / "x.txt").exists()
    # A link where an output or the log goes is replaced, never written through;
    # a name from before names were normalised is written where it means.
    job = gpulayer.Job(embedded, _record(embedded, {"model.pt": ref, "./new/m.txt": ref}))
    job.download_outputs(dl)
    assert (dl / "model.pt").read_bytes() == PLANTED and not (dl / "model.pt").is_symlink()
    assert (dl / "new" / "m.txt").read_bytes() == PLANTED
    assert not (dl / "logs.txt").is_symlink()
    assert (victim / "notes.txt").read_bytes() == b"my notes"
    assert {p: b for p, b in _snapshot(victim).items() if p in before} == before


# -- links out of the workspace ----------------------------------------------------

PLANT_LINKS = """
set -e
ln -s /etc/passwd secret
ln -s / root
mkdir -p d/sub
echo ok > d/ok.txt
ln -s ok.txt d/inside
ln -s /etc/passwd d/passwd
ln -s ../../.. d/sub/up
mkfifo fifo d/pipe
"""


def test_declared_outputs_never_follow_links_out_of_the_workspace(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    declared = ["secret", "root", "root/etc/passwd", "root/*", "**/passwd", "fifo", "d"]
    job = client.submit(command=["sh", "-c", PLANT_LINKS], outputs=declared)
    assert job.wait(timeout=60) == "succeeded", job.info.reason
    reason = job.info.reason or ""
    assert set(job.info.outputs) == {"d"}, reason
    for said in (
        "secret (a symbolic link: outputs never follow links)",
        "root (a symbolic link: outputs never follow links)",
        "root/etc/passwd (inside a linked folder: outputs never follow links)",
        "root/*",
        "d/passwd (a symbolic link",
        "d/sub/up (a symbolic link to '../../..', outside 'd')",
        "fifo (not a regular file or folder)",
        "d/pipe (not a regular file, folder or link)",
    ):
        assert said in reason, reason
    passwd = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    store = ArtifactStore(client.home / "artifacts")
    assert not store.has(passwd)
    manifest = bundle.load(store, job.info.outputs["d"].digest)
    assert {e.path: e.kind for e in manifest.entries} == {
        "ok.txt": "file",
        "inside": "symlink",
        "sub": "dir",
    }
    out = job.download_outputs(tmp_path / "dl")
    assert (out / "d" / "inside").read_text() == "ok\n"
    assert not os.path.lexists(out / "d" / "passwd") and not os.path.lexists(out / "secret")


# -- the size limit ----------------------------------------------------------------

SPARSE = "open('big', 'wb').truncate({size}); open('small', 'wb').write(b'x' * 1000)"


def test_outputs_over_the_default_limit_fail_the_job_and_store_nothing(
    client: gpulayer.Client,
) -> None:
    blobs = _blobs(client.home / "artifacts")
    code = SPARSE.format(size=11 * 1024**3)  # sparse: no space taken on the worker
    job = client.submit(command=[sys.executable, "-c", code], outputs=["big", "small"])
    assert job.wait(timeout=60) == "failed"
    assert job.info.outputs == {} and job.info.exit_code == 0
    total = 11 * 1024**3 + 1000
    assert job.info.reason == (
        f"exited with code 0, but its outputs total 11.0 GiB ({total} bytes), over the "
        "limit of 10.0 GiB (10737418240 bytes) a job may store (set by its worker's "
        "--max-output-bytes); nothing was stored"
    )
    assert _blobs(client.home / "artifacts") == blobs


def _worker_with(server: ServerProc, home: Path, *options: str) -> subprocess.Popen[str]:
    """A worker process started with ``options`` (as ServerProc.start_worker)."""
    argv = [sys.executable, "-m", "gpulayer.cli", "--home", str(home), "--server", server.url]
    argv += ["worker", "start", "--gpus", "none", "--kill-grace", "0.5", *options]
    env = {**os.environ, "GPULAYER_TOKEN": server.admin}
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    server.workers.append(proc)  # stopped with the server
    assert proc.stderr is not None
    said = []
    for line in proc.stderr:
        said.append(line)
        if "serving" in line:
            return proc
    raise AssertionError("the worker ended before serving:\n" + "".join(said))


def test_a_workers_max_output_bytes_ends_a_job_over_it_with_the_reason(
    server: ServerProc, tmp_path: Path
) -> None:
    _worker_with(server, tmp_path / "worker", "--max-output-bytes", "1M")
    blobs = _blobs(server.home / "artifacts")
    with server.client() as c:
        code = SPARSE.format(size=2 * 10**9)
        job = c.submit(command=[sys.executable, "-c", code], outputs=["big", "small"])
        assert job.wait(timeout=60) == "failed"
        assert job.info.outputs == {}
        assert "outputs total 1.9 GiB (2000001000 bytes), over the limit of 1.0 MiB" in str(
            job.info.reason
        )
        # Within the limit, the same worker stores them.
        ok = c.submit(command=[sys.executable, "-c", SPARSE.format(size=1000)], outputs=["big"])
        assert ok.wait(timeout=60) == "succeeded" and ok.info.outputs["big"].size == 1000
    assert len(_blobs(server.home / "artifacts") - blobs) == 1  # only the second job's


@pytest.mark.parametrize("size", ["0", "-5", "1.5G", "lots"])
def test_a_bad_max_output_bytes_is_refused(tmp_path: Path, size: str) -> None:
    env = {**os.environ, "GPULAYER_TOKEN": "x"}
    done = worker_start_refused(
        tmp_path / "home", "http://127.0.0.1:9", env, "--gpus", "none", f"--max-output-bytes={size}"
    )
    assert "--max-output-bytes" in done.stderr and repr(size) in done.stderr


# -- what a download writes is what was counted ------------------------------------


def _collect(
    client: gpulayer.Client, ws: Path, declared: list[str], **limits: int
) -> tuple[dict[str, ArtifactRef], list[str]]:
    """The worker's collection of ``declared`` in ``ws``, into ``client``'s real store."""
    return collect_outputs(declared, ws, client.transport, **limits)


def _written(top: Path) -> int:
    """Bytes a download wrote under ``top`` (each path its own file)."""
    return sum(p.stat().st_size for p in top.rglob("*") if p.is_file() and not p.is_symlink())


def test_hard_links_count_once_per_path_against_the_limit(
    embedded: gpulayer.Client, tmp_path: Path
) -> None:
    # A 1 MiB file and 199 hard links to it: 1 MiB on the worker's disk, but
    # 200 files, 200 MiB, in the manifest and so on every client's disk.
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f0").write_bytes(os.urandom(MiB))
    for i in range(1, 200):
        os.link(ws / "d" / "f0", ws / "d" / f"f{i}")
    (ws / "one").write_bytes(os.urandom(MiB + MiB // 2))
    os.link(ws / "one", ws / "two")  # two declared outputs, one inode
    blobs = _blobs(embedded.home / "artifacts")
    with pytest.raises(OutputLimitError, match=r"total 200\.0 MiB \(209715200 bytes\), over"):
        _collect(embedded, ws, ["d"], max_bytes=2 * MiB)
    with pytest.raises(OutputLimitError, match=r"total 3\.0 MiB \(3145728 bytes\), over"):
        _collect(embedded, ws, ["one", "two"], max_bytes=2 * MiB)
    assert _blobs(embedded.home / "artifacts") == blobs
    # Within the limit, what is recorded is what a download writes.
    for i in range(2, 200):
        os.unlink(ws / "d" / f"f{i}")
    stored, missing = _collect(embedded, ws, ["d", "one", "two"], max_bytes=5 * MiB)
    assert missing == [] and stored["d"].size == 2 * MiB
    out = gpulayer.Job(embedded, _record(embedded, stored)).download_outputs(tmp_path / "dl")
    written = _written(out) - (out / "logs.txt").stat().st_size
    assert written == sum(ref.size for ref in stored.values()) == 5 * MiB


def _chain(top: Path, depth: int, part: str = "a") -> None:
    """``top`` and ``depth`` folders ``part`` nested in it, a file at the bottom
    (made with descriptors: the whole path may be longer than PATH_MAX)."""
    top.mkdir(parents=True)
    at = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir(part, dir_fd=at)
        child = os.open(part, os.O_RDONLY | os.O_DIRECTORY, dir_fd=at)
        os.close(at)
        at = child
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=at))
    os.close(at)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_deep_tree_costs_one_open_per_folder_and_leaks_no_descriptor(
    embedded: gpulayer.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    depth = 60  # within the limit
    _chain(tmp_path / "ws" / "d", depth)
    opens = 0
    real_open = os.open

    def counting(*args: Any, **kwargs: Any) -> int:
        nonlocal opens
        opens += 1
        return real_open(*args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    fds = _open_fds()
    for declared in (["d"], ["d/**/f"]):
        opens = 0
        stored, missing = _collect(embedded, tmp_path / "ws", declared)
        assert missing == [] and stored, declared
        # Each folder opened from its parent: a few opens per folder, not one
        # per folder above it (depth**2 / 2 = 1,800 here).
        assert opens < 4 * depth, (declared, opens)
        assert _open_fds() == fds
    monkeypatch.undo()


TOO_DEEP = """
import os
def chain(top, depth, part):
    os.mkdir(top)
    at = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir(part, dir_fd=at)
        child = os.open(part, os.O_RDONLY, dir_fd=at)
        os.close(at)
        at = child
    os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=at))
chain("deep", {depth}, "a")
chain("long", {long}, "x" * 200)
open("ok.txt", "w").write("ok")
"""


@pytest.mark.parametrize(
    ("declared", "said"),
    [
        (["ok.txt", "deep"], "its output 'deep/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/a/"),
        (["ok.txt", "deep"], "is more than 64 folders deep, the most a job's outputs may be"),
        (["deep/**/f"], "is more than 64 folders deep"),
        (["ok.txt", "long"], "bytes long, over the 3840 bytes an output's path may be"),
    ],
    ids=["deep-names-it", "deep", "deep-glob", "long"],
)
def test_outputs_too_deep_or_too_long_to_write_end_the_job_with_the_limit(
    client: gpulayer.Client, declared: list[str], said: str
) -> None:
    blobs = _blobs(client.home / "artifacts")
    code = TOO_DEEP.format(depth=200, long=20)  # 'long': 20 names of 200 bytes
    job = client.submit(command=[sys.executable, "-c", code], outputs=declared)
    assert job.wait(timeout=60) == "failed"
    reason = job.info.reason or ""
    assert job.info.outputs == {} and job.info.exit_code == 0, reason
    assert said in reason and reason.endswith("; nothing was stored"), reason
    assert _blobs(client.home / "artifacts") == blobs


def test_more_entries_than_the_limit_end_the_collection_with_it(
    embedded: gpulayer.Client, tmp_path: Path
) -> None:
    ws = tmp_path / "ws"
    (ws / "d" / "sub").mkdir(parents=True)
    for i in range(30):
        (ws / "d" / f"{i}.txt").write_text(str(i))
        (ws / "d" / "sub" / f"{i}.txt").write_text(str(i))
    blobs = _blobs(embedded.home / "artifacts")
    for declared in (["d"], ["d/**/*.txt"]):
        with pytest.raises(OutputLimitError, match="more than 50 files, folders and links"):
            _collect(embedded, ws, declared, max_entries=50)
    assert _blobs(embedded.home / "artifacts") == blobs
    stored, _ = _collect(embedded, ws, ["d"], max_entries=62)  # 60 files, 2 folders
    assert bundle.load(ArtifactStore(embedded.home / "artifacts"), stored["d"].digest)


def test_a_glob_over_a_folder_stores_the_folder_once(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    code = "import os; os.makedirs('ckpt/sub'); open('ckpt/a', 'w'); open('ckpt/sub/b', 'w')"
    job = client.submit(command=[sys.executable, "-c", code], outputs=["ckpt/**", "ckpt/a"])
    assert job.wait(timeout=60) == "succeeded", job.info.reason
    assert set(job.info.outputs) == {"ckpt"}  # not ckpt/a, ckpt/sub, ... again
    out = job.download_outputs(tmp_path / "dl")
    assert {p.relative_to(out).as_posix() for p in out.rglob("*")} == {
        "ckpt",
        "ckpt/a",
        "ckpt/sub",
        "ckpt/sub/b",
        "logs.txt",
    }


# -- a download checks its whole plan before it writes -----------------------------


def _file(client: gpulayer.Client, data: bytes = PLANTED) -> ArtifactRef:
    return ArtifactRef(kind="file", digest=client.transport.upload_bytes(data), size=len(data))


def _folder(client: gpulayer.Client, files: dict[str, bytes]) -> ArtifactRef:
    entries = [
        bundle.Entry(p, "file", size=len(b), digest=client.transport.upload_bytes(b))
        for p, b in sorted(files.items())
    ]
    manifest = bundle.Manifest(tuple(entries))
    digest = client.transport.upload_bytes(msgspec.json.encode(manifest))
    return ArtifactRef(kind="dir", digest=digest, size=manifest.total_size)


@pytest.mark.parametrize(
    ("outputs", "said"),
    [
        ({"a": "file", "a/b": "file"}, "'a/b' refused: inside output 'a', which is a file"),
        ({"a/b": "file", "a": "file"}, "'a/b' refused: inside output 'a', which is a file"),
        ({"x": "file", "a": "file", "a/b/c": "dir"}, "inside output 'a', which is a file"),
        ({"x": "file", "./a": "file", "a": "dir"}, "the same output as './a' once normalised"),
        ({"x": "file", "logs.txt/a": "file"}, "the job's log is written at logs.txt"),
        ({"x": "file", "logs.txt": "dir"}, "the job's log is written at logs.txt"),
    ],
    ids=["file-then-inside", "inside-then-file", "folder-in-file", "duplicate", "log-1", "log-2"],
)
def test_download_refuses_outputs_that_collide_before_writing_anything(
    embedded: gpulayer.Client, tmp_path: Path, outputs: dict[str, str], said: str
) -> None:
    dl = tmp_path / "dl"
    _plant(dl / "a")  # the user's: dl/a/keep, removed to write a file 'a'
    before = _snapshot(dl)
    refs = {
        name: _file(embedded) if kind == "file" else _folder(embedded, {"f": PLANTED})
        for name, kind in outputs.items()
    }
    job = gpulayer.Job(embedded, _record(embedded, refs))
    with pytest.raises(UnsafeOutputError) as refused:
        job.download_outputs(dl)
    assert _snapshot(dl) == before  # nothing written (not even 'x'), nothing removed
    assert said in str(refused.value)


def test_download_refuses_paths_the_client_cannot_write_before_writing(
    embedded: gpulayer.Client, tmp_path: Path
) -> None:
    dl = tmp_path / "dl"
    fine = _file(embedded)
    for files, said in (
        ({"n" * 300: b"x"}, "a name of 300 bytes, over the 255"),
        ({"/".join(["p" * 200] * 21): b"x"}, "bytes long, over the 4095"),
    ):
        refs = {"fine.txt": fine, "d": _folder(embedded, files)}
        job = gpulayer.Job(embedded, _record(embedded, refs))
        with pytest.raises(UnsafeOutputError, match=re.escape(said)):
            job.download_outputs(dl)
        assert not dl.exists()


def test_an_output_inside_a_folder_output_is_written_once_with_it(
    embedded: gpulayer.Client, tmp_path: Path
) -> None:
    # What a worker before outputs were checked stored for 'ckpt/**': the
    # folder, and again each path in it.
    refs = {
        "ckpt": _folder(embedded, {"a": b"A", "sub/b": b"B"}),
        "ckpt/a": _file(embedded, b"A"),
        "ckpt/sub/b": _file(embedded, b"B"),
    }
    out = gpulayer.Job(embedded, _record(embedded, refs)).download_outputs(tmp_path / "dl")
    assert (out / "ckpt" / "a").read_bytes() == b"A"
    assert (out / "ckpt" / "sub" / "b").read_bytes() == b"B"


def _everything(root: Path) -> dict[str, object]:
    """Every path under ``root``: a folder, a link's target, or a file's bytes."""
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = ("link", os.readlink(path))
        elif path.is_dir():
            found[key] = "dir"
        else:
            found[key] = path.read_bytes()
    return found


def _hostile_server(record: dict[str, object], blob: bytes) -> Any:
    """A fake server (stdlib http.server) that answers every job request with ``record``."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: bytes, kind: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path.startswith("/api/v1/blobs/"):
                self._send(blob, "application/octet-stream")
            elif path.endswith("/logs"):
                chunk = {"lines": [], "attempt": 1, "cursor": [1, 0], "done": True}
                self._send(json.dumps(chunk).encode())
            else:
                self._send(json.dumps(record).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("hostile_id", ["{victim}", "../../victim", "0123456789abcz/../../victim"])
def test_a_server_naming_a_job_by_a_path_writes_and_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hostile_id: str
) -> None:
    """The default download folder is gpulayer_runs/<job id>: a server that
    answered with the id '/home/you' (or '../..') had the client replace
    the user's folder there with its own file (found by a reviewer)."""
    victim = tmp_path / "victim"
    (victim / "project").mkdir(parents=True)
    (victim / "project" / "precious.py").write_text("the user's source\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    blob = b"replaced by the server\n"
    record = {
        "id": hostile_id.format(victim=victim),
        "spec": {"command": ["true"]},
        "state": "succeeded",
        "outputs": {
            "project": {"kind": "file", "digest": hashlib.sha256(blob).hexdigest(), "size": 23}
        },
    }
    before = _everything(tmp_path)
    server = _hostile_server(record, blob)
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        with (
            gpulayer.Client(url, token="x", home=tmp_path / "home", auto_worker=False) as client,
            pytest.raises(gpulayer.TransportError, match="not one GPUlayer makes"),
        ):
            client.job("0123456789abcd").download_outputs()
    finally:
        server.shutdown()
        server.server_close()
    after = {k: v for k, v in _everything(tmp_path).items() if not k.startswith("home")}
    assert after == {k: v for k, v in before.items() if not k.startswith("home")}
