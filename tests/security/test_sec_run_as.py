"""``gpulayer worker start --run-as USER``: jobs run as another Unix user.

A job ran as its worker's user (root, on a shared machine set up as one
usually is): it could write the worker's cache and home, read any file the
worker can, signal the worker and leave its cgroup. Here a real worker runs
as root with ``--run-as nobody``, and its jobs try each of those; they must
run as uid 65534 and be refused every one, and nothing of the worker's
changes. A worker that cannot run jobs as the user says so at start.

Root's own Python lives under a 0700 home, which ``nobody`` cannot reach,
so the worker runs on ``/usr/bin/python3.11`` with the checkout's sources
and packages on ``PYTHONPATH``: its script jobs run that interpreter too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

import gpulayer
from gpulayer import defaults

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3.11"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason=f"needs root (to run jobs as nobody) and {SYSTEM_PYTHON}",
)

# The job's attempts, each reported as what it got ("refused: ..." or "DONE").
ATTEMPTS = r"""
import json, os, signal, sys
cache, home, secret, input_path, cgroup = sys.argv[1:6]
report = {"ids": [os.getuid(), os.getgid(), sorted(os.getgroups())],
          "env": [os.environ.get("HOME"), os.environ.get("USER")]}

def attempt(name, act):
    try:
        act()
        report[name] = "DONE"
    except OSError as exc:
        report[name] = f"refused: {exc.strerror}"

attempt("write in the cache", lambda: open(os.path.join(cache, "planted"), "w").write("x"))
attempt("write in the worker's home", lambda: open(os.path.join(home, "planted"), "w").write("x"))
attempt("read a root 0600 file", lambda: open(secret).read())
attempt("make its input writable", lambda: os.chmod(input_path, 0o644))
attempt("edit its input in place", lambda: open(input_path, "r+b").write(b"TAMPERED"))
attempt("signal the worker", lambda: os.kill(os.getppid(), signal.SIGTERM))
# Its task's folder is the worker's: a link planted there, or a workspace
# swapped for one, would lead the worker's next prepare (as root) elsewhere.
task_dir = os.path.dirname(os.getcwd())
attempt("swap its workspace for a link", lambda: os.rename(os.getcwd(), os.getcwd() + "-moved"))
attempt("plant a link beside its workspace", lambda: os.symlink("/etc", task_dir + "/planted"))
if cgroup:
    attempt("leave its cgroup", lambda: open(cgroup, "w").write(str(os.getpid())))
open("report.json", "w").write(json.dumps(report))
print(json.dumps(report))
"""


def _src_path() -> str:
    """Where the system interpreter finds gpulayer and its packages."""
    return os.pathsep.join(
        [str(Path(gpulayer.__file__).parents[1]), str(Path(msgspec.__file__).parents[1])]
    )


@pytest.fixture(scope="module")
def place() -> Iterator[Path]:
    """A folder nobody may go down into (pytest's tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gpulayer-sec-run-as-"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _worker(server: object, home: Path, *options: str) -> subprocess.Popen[str]:
    from server.conftest import ServerProc, said

    assert isinstance(server, ServerProc)
    argv = [SYSTEM_PYTHON, "-m", "gpulayer.cli", "--home", str(home), "--server", server.url]
    argv += ["worker", "start", "--gpus", "none", "--name", "as-nobody", "--kill-grace", "0.5"]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": _src_path(),
        "GPULAYER_TOKEN": server.admin,
        "GPULAYER_GPU_LOCKS": str(home / "gpu-locks"),
    }
    proc = subprocess.Popen(
        [*argv, *options], env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    server.workers.append(proc)  # stopped with the server
    said(proc, "serving")
    return proc


def _cgroup_procs_above() -> str:
    """The cgroup.procs of this process's cgroup v2 (a job would move there)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            for mount in Path("/proc/self/mounts").read_text().splitlines():
                _, point, kind, *_ = mount.split()
                if kind == "cgroup2":
                    return f"{point}{line[3:].rstrip('/')}/cgroup.procs"
    return ""


def test_jobs_run_as_nobody_and_reach_nothing_of_the_workers(server: object, place: Path) -> None:
    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    home = place / "worker-home"
    home.mkdir()
    home.chmod(0o711)
    _worker(server, home, "--run-as", "nobody")
    cache = home / "worker-cache"
    secret = place / "secret"
    secret.write_text("root's alone")
    secret.chmod(0o600)
    data = place / "data.bin"
    data.write_bytes(os.urandom(2 * defaults.LINK_MIN_BYTES))  # linked from the cache
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    before = sorted(p.name for p in home.iterdir())
    with server.client() as client:
        job = client.submit(
            command=[
                SYSTEM_PYTHON,
                "-c",
                ATTEMPTS,
                str(cache),
                str(home),
                str(secret),
                "data",
                _cgroup_procs_above(),
            ],
            inputs={"data": str(data)},
        )
        assert job.wait(timeout=120) == "succeeded", job.info.reason
        report = json.loads(job.logs().strip().splitlines()[-1])
    assert report.pop("ids") == [NOBODY, NOBODY, [NOBODY]]
    assert report.pop("env") == ["/nonexistent", "nobody"]
    assert len(report) >= 8, report
    for name, got in report.items():
        assert got.startswith("refused"), f"a job run as nobody could {name}: {got}"
    # Nothing of the worker's changed: no file planted, the blob intact.
    assert not (cache / "planted").exists() and not (home / "planted").exists()
    assert sorted(p.name for p in home.iterdir() if p != cache) == before  # the cache: made by now
    blobs = [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size == data.stat().st_size]
    assert blobs, "the input is not in the worker's cache"
    for blob in blobs:
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest
        assert blob.stat().st_uid == 0


def test_a_script_job_run_as_nobody_writes_its_workspace_and_outputs(
    server: object, place: Path, tmp_path: Path
) -> None:
    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    home = place / "worker-home-2"
    home.mkdir()
    home.chmod(0o711)
    _worker(server, home, "--run-as", "nobody")
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(
        "import os\nos.makedirs('out', exist_ok=True)\n"
        "open('out/who', 'w').write(str(os.getuid()))\nprint('wrote')\n"
    )
    with server.client() as client:
        job = client.submit(project / "train.py", source=project, outputs=["out"])
        assert job.wait(timeout=120) == "succeeded", job.info.reason
        assert "out" in job.info.outputs


@pytest.mark.parametrize(
    ("user", "as_root", "said"),
    [
        ("no-such-user-here", True, "there is no such Unix user"),
        ("root", True, "that is root"),
        ("nobody", False, "only a worker started as root"),
    ],
)
def test_a_worker_that_cannot_run_jobs_as_the_user_says_so_at_start(
    place: Path, user: str, as_root: bool, said: str
) -> None:
    home = place / f"refused-{user}-{as_root}"
    home.mkdir()
    home.chmod(0o777)
    argv = [SYSTEM_PYTHON, "-m", "gpulayer.cli", "--home", str(home)]
    argv += ["--server", "http://127.0.0.1:9", "worker", "start", "--gpus", "none"]
    argv += ["--run-as", user]
    if not as_root:
        if shutil.which("setpriv") is None:
            pytest.skip("needs setpriv to start a worker as nobody")
        argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    done = subprocess.run(
        argv,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": _src_path(), "HOME": str(home)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert said in done.stderr, done.stderr
    assert "--run-as" in done.stderr
    assert sorted(os.listdir(home)) == [], "a refused worker made something"


def test_a_process_spawned_as_the_user_runs_as_it(tmp_path: Path) -> None:
    """The spawn itself (CPython forks rather than vforks once it changes
    ids): the process runs as the user, with its groups, not root's."""
    from gpulayer.worker.process import RunAs, spawn

    run_as = RunAs.lookup("nobody")
    code = "import os; print(os.getuid(), os.getgid(), os.getgroups())"
    proc = spawn([SYSTEM_PYTHON, "-c", code], cwd=tmp_path, env={}, run_as=run_as)
    assert proc.stdout is not None and proc.stderr is not None
    out = proc.stdout.read()
    proc.stderr.close()
    proc.stdout.close()
    assert proc.wait() == 0
    assert out.split() == [b"65534", b"65534", b"[65534]"]
