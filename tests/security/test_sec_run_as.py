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
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sec_python import nobody_pythonpath

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
    """Where the system interpreter, as root or as nobody, finds gpulayer and
    its packages (a copy of them where the checkout is out of nobody's reach)."""
    return nobody_pythonpath()


@pytest.fixture(scope="module")
def place() -> Iterator[Path]:
    """A folder nobody may go down into (pytest's tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gpulayer-sec-run-as-"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _worker(
    server: object, home: Path, *options: str, umask: int = -1, **extra_env: str
) -> subprocess.Popen[str]:
    """A worker process as root, as the system's Python runs it; ``umask``:
    the one it starts with (-1: this process's); ``extra_env`` over its
    environment."""
    from server.conftest import ServerProc, said

    assert isinstance(server, ServerProc)
    argv = [SYSTEM_PYTHON, "-m", "gpulayer.cli", "--home", str(home), "--server", server.url]
    argv += ["worker", "start", "--gpus", "none", "--name", "as-nobody", "--kill-grace", "0.5"]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": _src_path(),
        "GPULAYER_TOKEN": server.admin,
        "GPULAYER_GPU_LOCKS": str(home / "gpu-locks"),
        **extra_env,
    }
    proc = subprocess.Popen(
        [*argv, *options],
        env=env,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        umask=umask,
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
    before = sorted(p.name for p in home.iterdir() if p != cache)
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
    assert sorted(p.name for p in home.iterdir() if p != cache) == before
    blobs = [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size == data.stat().st_size]
    assert blobs, "the input is not in the worker's cache"
    for blob in blobs:
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest
        assert blob.stat().st_uid == 0


# Job A's own part: it reads its 0600 input and its bundle's file (both
# reach it through its workspace, the cache being closed to it) and says
# where its task's folder is.
OWN = r"""
import json, os
inputs = os.environ["GPULAYER_INPUTS"]
print(json.dumps({"input": open(os.path.join(inputs, "data")).read(),
                  "bundle": open("notes.txt").read(),
                  "task_dir": os.path.dirname(os.getcwd())}))
"""

# Job B, later, run as the same user: looks for anything of A's in the
# worker's home, by listing, by the paths it knows or can guess, and by
# walking all it can reach.
SNOOP = r"""
import json, os, sys
home, cache, ledger, a_task_dir, marker, job_a = sys.argv[1:7]
digests, ledger_files = sys.argv[7].split(","), sys.argv[8].split(",")
report = {"own input": open(os.path.join(os.environ["GPULAYER_INPUTS"], "mine")).read()}
tried = {}

def attempt(name, act):
    try:
        tried[name] = f"DONE: {act()!r}"[:300]
    except OSError as exc:
        tried[name] = f"refused: {exc.strerror}"

def read(path):
    with open(path, "rb") as f:
        return f.read(64)

attempt("list the cache", lambda: os.listdir(cache))
attempt("list the cache's blobs", lambda: os.listdir(os.path.join(cache, "sha256")))
for d in digests:
    attempt(f"read the blob {d[:12]}", lambda d=d: read(os.path.join(cache, "sha256", d[:2], d)))
attempt("list the workers' folder", lambda: os.listdir(os.path.dirname(ledger)))
attempt("list the ledger", lambda: os.listdir(ledger))
for path in ledger_files:
    attempt(f"read the ledger's {os.path.basename(path)}", lambda path=path: read(path))
attempt("list the task folders", lambda: os.listdir(os.path.dirname(a_task_dir)))
attempt("list A's task folder", lambda: os.listdir(a_task_dir))
attempt("read A's input", lambda: read(os.path.join(a_task_dir, "inputs", "data")))
attempt("list A's workspace", lambda: os.listdir(os.path.join(a_task_dir, "workspace")))
attempt("read A's bundle file", lambda: read(os.path.join(a_task_dir, "workspace", "notes.txt")))
mine = os.path.dirname(os.getcwd())  # a neighbour's name, guessed from its own
for n in range(1, 9):
    guess = os.path.join(os.path.dirname(mine), f"task-{n}")
    if guess != mine:
        attempt(f"read {os.path.basename(guess)}'s input", lambda g=guess: read(g + "/inputs/data"))
found = []
places = [home, cache, os.path.dirname(ledger), ledger, os.path.dirname(mine)]
for top, dirs, files in (step for place in places for step in os.walk(place)):
    for name in dirs + files:
        path = os.path.join(top, name)
        if path.startswith(mine):
            continue  # its own task's
        if job_a in name or any(d in name for d in digests):
            found.append(path)
        if name in files:
            try:
                with open(path, "rb") as f:
                    if marker.encode() in f.read(1 << 20):
                        found.append(path)
            except OSError:
                pass
report["tried"] = tried
report["found of A's"] = found
print(json.dumps(report))
"""


def test_a_later_job_finds_nothing_of_an_earlier_jobs_in_the_workers_home(
    server: object, place: Path
) -> None:
    """Under ``--run-as`` every job runs as the same user: job B, later,
    could list the worker's cache and read every earlier job's inputs and
    bundles from it (folders 0755, blobs 0444), and read the ledger. The
    worker's folders now let a job down to its own task's folder only, and
    whatever the umask the worker starts with (here the loosest, 000)."""
    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    home = place / "worker-home-reach"
    home.mkdir()
    home.chmod(0o711)
    _worker(server, home, "--run-as", "nobody", umask=0o000)
    marker = f"ALICE-SECRET-{os.urandom(8).hex()}"
    data = place / "alice-private.bin"
    data.write_text(marker + " input")
    data.chmod(0o600)
    project = place / "alice-project"
    project.mkdir()
    (project / "notes.txt").write_text(marker + " bundle")
    (project / "notes.txt").chmod(0o600)
    mine = place / "bob-input.txt"
    mine.write_text("bob's own")
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (data, project / "notes.txt")]
    cache, workers = home / "worker-cache", home / "workers"
    with server.client() as client:
        a = client.submit(
            command=[SYSTEM_PYTHON, "-c", OWN], source=project, inputs={"data": str(data)}
        )
        assert a.wait(timeout=120) == "succeeded", a.info.reason
        own = json.loads(a.logs().strip().splitlines()[-1])
        assert own["input"] == marker + " input" and own["bundle"] == marker + " bundle"
        ledger_files = [str(p) for p in (workers / "live").rglob("*") if p.is_file()]
        assert ledger_files, "the worker keeps no ledger"
        b = client.submit(
            command=[
                SYSTEM_PYTHON,
                "-c",
                SNOOP,
                str(home),
                str(cache),
                str(workers / "live"),
                own["task_dir"],
                marker,
                a.id,
                ",".join(digests),
                ",".join(ledger_files),
            ],
            inputs={"mine": str(mine)},
        )
        assert b.wait(timeout=120) == "succeeded", b.info.reason
        report = json.loads(b.logs().strip().splitlines()[-1])
    assert report["own input"] == "bob's own"  # its own input still reaches it
    assert len(report["tried"]) >= 12, report["tried"]
    for name, got in report["tried"].items():
        assert got.startswith("refused"), f"a later job could {name}: {got}"
    assert report["found of A's"] == [], "a later job found the earlier job's files"
    # As the worker left them: private, whatever the umask.
    for folder in [cache, *(p for p in cache.rglob("*") if p.is_dir())]:
        assert folder.stat().st_mode & 0o777 == 0o700, f"{folder} is not private"
    for folder in [workers / "live", *(p for p in (workers / "live").rglob("*") if p.is_dir())]:
        assert folder.stat().st_mode & 0o777 == 0o700, f"{folder} is not private"
    assert workers.stat().st_mode & 0o777 == 0o711


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
    # Its first attempt leaves a snapshot in its scratch folder and fails;
    # the second, on a folder laid out anew as the user's, finds it.
    (project / "train.py").write_text(
        "import os, pathlib, sys\nos.makedirs('out', exist_ok=True)\n"
        "open('out/who', 'w').write(str(os.getuid()))\n"
        "scratch = pathlib.Path(os.environ['GPULAYER_SCRATCH'])\n"
        "if os.environ['GPULAYER_ATTEMPT'] == '1':\n"
        "    (scratch / 'snap').write_text('kept')\n"
        "    sys.exit(1)\n"
        "(scratch / 'snap').write_text((scratch / 'snap').read_text() + ' and rewritten')\n"
        "print('scratch', (scratch / 'snap').read_text())\nprint('wrote')\n"
    )
    with server.client() as client:
        job = client.submit(
            project / "train.py", source=project, outputs=["out"], max_retries=1, retry_delay=0
        )
        assert job.wait(timeout=120) == "succeeded", job.info.reason
        assert "out" in job.info.outputs
        assert "scratch kept and rewritten" in job.logs()


_WHO = """\
import ctypes, json, os, signal
libc = ctypes.CDLL(None)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
parent = dict(
    line.split(":", 1) for line in open(f"/proc/{os.getppid()}/status").read().splitlines()
)
print(json.dumps({
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
    "caps": [status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")],
    "dumpable": libc.prctl(3, 0, 0, 0, 0),  # PR_GET_DUMPABLE
    "parent_uid": int(parent["Uid"].split()[1]),
    "no_new_privs": status["NoNewPrivs"].strip(),
}, sort_keys=True))
"""


def test_a_warm_job_run_as_nobody_is_nobody_as_a_cold_one_is(
    server: object, place: Path, tmp_path: Path
) -> None:
    """A warm job is a fork of a zygote that runs as the job's user, never
    root's: its ids, groups and (no) capabilities are a cold job's, and it
    may be debugged by its user (dumpable)."""
    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    home = place / "worker-home-warm"
    home.mkdir()
    home.chmod(0o711)
    _worker(server, home, "--run-as", "nobody", "--preload", "", GPULAYER_WARM="ready")
    project = tmp_path / "who"
    project.mkdir()
    (project / "who.py").write_text(_WHO)
    seen = {}
    with server.client() as client:
        for warm in (False, True):
            job = client.submit(project / "who.py", source=project, warm=warm)
            assert job.wait(timeout=120) == "succeeded", job.logs()
            assert (job.info.start == "warm") is warm, job.info.start
            seen[warm] = json.loads(job.logs())
    nobody = pwd.getpwnam("nobody")
    assert seen[True]["ids"][:4] == [nobody.pw_uid] * 2 + [nobody.pw_gid] * 2
    assert seen[True]["caps"] == ["0000000000000000"] * 4
    assert seen[True]["dumpable"] == 1
    # Its parent is its user's zygote; a cold job's, the worker (root).
    assert seen[True].pop("parent_uid") == nobody.pw_uid
    assert seen[False].pop("parent_uid") == 0
    assert seen[True] == seen[False]


def _refused_at_start(argv: list[str], home: Path, said: str) -> None:
    """``argv`` (a worker start) exits saying ``said`` about --run-as, and
    makes nothing in ``home``."""
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
    _refused_at_start(argv, home, said)


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


def test_a_cache_holding_the_jobs_folders_is_refused_in_plain_words(tmp_path: Path) -> None:
    """The cache is closed to the jobs (0700): one that holds the workers'
    folder would shut every job out of its own. Refused, and nothing is
    made or changed."""
    from gpulayer.artifacts import ArtifactStore
    from gpulayer.errors import WorkerError
    from gpulayer.worker.worker import _run_as

    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    with pytest.raises(WorkerError, match=r"--run-as nobody: the cache .* holds the workers'"):
        _run_as("nobody", home / "workers", ArtifactStore(home))
    assert home.stat().st_mode & 0o777 == 0o755
    assert os.listdir(home) == []


def test_a_job_reaches_its_inputs_under_the_strictest_umask(server: object, place: Path) -> None:
    """A worker started with umask 077 made each task's inputs/ 0700, root's:
    a job run as nobody could not reach its own input."""
    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    home = place / "worker-home-umask"
    home.mkdir()
    home.chmod(0o711)
    _worker(server, home, "--run-as", "nobody", umask=0o077)
    data = place / "input-077.txt"
    data.write_text("reached")
    with server.client() as client:
        job = client.submit(
            command=[SYSTEM_PYTHON, "-c", "print(open('data').read())"], inputs={"data": str(data)}
        )
        assert job.wait(timeout=120) == "succeeded", job.info.reason
        assert job.logs().strip().splitlines()[-1] == "reached"


def _second_user() -> tuple[str, int]:
    """A user of this machine's besides nobody, to give a second slot: an
    existing unprivileged system one (no user is made for the test), of a
    uid and primary group of its own."""
    import pwd

    for name in ("daemon", "bin", "sys", "www-data"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_uid not in (0, NOBODY) and pw.pw_gid not in (0, NOBODY):
            return name, pw.pw_uid
    pytest.skip("needs a second unprivileged user besides nobody (daemon, bin, sys, www-data)")


# Job A: holds a secret in its environment and a file in its workspace, says
# where it is, and runs until job B is done looking (or its deadline).
HOLD = r"""
import json, os, sys, time
rendezvous = sys.argv[1]
open("private.txt", "w").write(os.environ["A_SECRET"])
said = {"pid": os.getpid(), "cwd": os.getcwd(), "uid": os.getuid()}
with open(os.path.join(rendezvous, "a.tmp"), "w") as f:
    f.write(json.dumps(said))
os.rename(os.path.join(rendezvous, "a.tmp"), os.path.join(rendezvous, "a.json"))
deadline = time.monotonic() + 90
while not os.path.exists(os.path.join(rendezvous, "b.done")):
    if time.monotonic() > deadline:
        sys.exit("job B never said it was done")
    time.sleep(0.05)
print(json.dumps(said))
"""

# Job B, at the same time, on the other slot: everything of A's it could reach.
PEEK = r"""
import json, os, signal, sys
rendezvous, secret = sys.argv[1:3]
a = json.load(open(os.path.join(rendezvous, "a.json")))
pid, cwd = a["pid"], a["cwd"]
tried = {}

def attempt(name, act):
    try:
        got = act()
        tried[name] = "LEAKED" if secret.encode() in repr(got).encode() else f"DONE: {got!r}"[:300]
    except OSError as exc:
        tried[name] = f"refused: {exc.strerror}"

def read(path):
    with open(path, "rb") as f:
        return f.read()

attempt("read A's /proc environ", lambda: read(f"/proc/{pid}/environ"))
attempt("read A's memory", lambda: read(f"/proc/{pid}/mem"))
attempt("find A's workspace by /proc", lambda: os.readlink(f"/proc/{pid}/cwd"))
attempt("list A's workspace by /proc", lambda: os.listdir(f"/proc/{pid}/cwd"))
attempt("list A's workspace", lambda: os.listdir(cwd))
attempt("read A's workspace file", lambda: read(os.path.join(cwd, "private.txt")))
attempt("write in A's workspace", lambda: open(os.path.join(cwd, "planted"), "w").write("x"))
attempt("signal A", lambda: os.kill(pid, signal.SIGCONT))
report = {"uid": os.getuid(), "a_alive": os.path.exists(f"/proc/{pid}"), "tried": tried}
open(os.path.join(rendezvous, "b.done"), "w").close()
print(json.dumps(report))
"""


def test_jobs_running_at_once_on_two_slots_never_share_a_user(server: object, place: Path) -> None:
    """Under ``--run-as USER`` every slot's jobs ran as the one user: job B,
    running beside job A, read A's secrets from /proc/<pid>/environ and A's
    workspace. With one user per slot (``--run-as nobody,daemon``), B runs
    as the other one, while A still runs, and is refused every one."""
    from server.conftest import ServerProc

    assert isinstance(server, ServerProc)
    other, other_uid = _second_user()
    home = place / "worker-home-slots"
    home.mkdir()
    home.chmod(0o711)
    _worker(server, home, "--slots", "2", "--run-as", f"nobody,{other}")
    rendezvous = place / "rendezvous"
    rendezvous.mkdir()
    rendezvous.chmod(0o1777)  # both jobs' users write here, neither the other's files
    secret = f"A-SECRET-{os.urandom(8).hex()}"
    with server.client() as client:
        a = client.submit(
            command=[SYSTEM_PYTHON, "-c", HOLD, str(rendezvous)], secrets={"A_SECRET": secret}
        )
        said = rendezvous / "a.json"
        deadline = time.monotonic() + 120
        while not said.exists():  # A runs, and says where
            assert a.info.state not in ("failed", "succeeded", "cancelled"), a.info.reason
            assert time.monotonic() < deadline, "job A never started"
            time.sleep(0.05)
            a.refresh()
        b = client.submit(command=[SYSTEM_PYTHON, "-c", PEEK, str(rendezvous), secret])
        assert b.wait(timeout=120) == "succeeded", b.info.reason
        report = json.loads(b.logs().strip().splitlines()[-1])
        assert a.wait(timeout=120) == "succeeded", a.info.reason
        held = json.loads(a.logs().strip().splitlines()[-1])
    assert report["a_alive"], "job B did not run while job A did"
    assert {held["uid"], report["uid"]} == {NOBODY, other_uid}, (held, report)
    assert len(report["tried"]) == 8, report["tried"]
    for name, got in report["tried"].items():
        assert got.startswith("refused"), f"a job beside another could {name}: {got}"
    assert not os.path.exists(os.path.join(held["cwd"], "planted"))


@pytest.mark.parametrize(
    ("users", "said"),
    [
        ("nobody,{other},nobody", "3 users for a worker of 2 slots"),
        ("nobody,65534", "nobody and 65534 are the same user"),
        ("nobody,root", "that is root"),
        ("nobody,no-such-user-here", "no-such-user-here: there is no such Unix user"),
        ("nobody,", "a user name is empty"),
    ],
)
def test_a_list_of_run_as_users_that_does_not_fit_the_slots_is_refused_at_start(
    place: Path, users: str, said: str
) -> None:
    """Refused before the worker claims or makes anything, in words naming
    what is wrong (both numbers, or the user)."""
    other, _ = _second_user()
    users = users.format(other=other)
    home = place / f"refused-list-{hashlib.sha256(users.encode()).hexdigest()[:8]}"
    home.mkdir()
    home.chmod(0o777)
    argv = [SYSTEM_PYTHON, "-m", "gpulayer.cli", "--home", str(home)]
    argv += ["--server", "http://127.0.0.1:9", "worker", "start", "--gpus", "none"]
    argv += ["--slots", "2", "--run-as", users]
    _refused_at_start(argv, home, said)


# Slow to stop (SIGTERM ignored): given up by the server, it runs on for the
# worker's kill grace; it records its pid, then waits to be killed.
_SLOW = r"""
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + "/x.pid.tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + "/x.pid.tmp", sys.argv[1] + "/x.pid")
time.sleep(120)
"""
# The next job of the same slot: is the one before it still alive as it starts?
_NEXT = r"""
import json, os, sys
pid = int(open(sys.argv[1] + "/x.pid").read())
try:
    os.kill(pid, 0)
    alive = True
except ProcessLookupError:
    alive = False
except PermissionError:  # alive, as another user
    alive = True
print(json.dumps({"uid": os.getuid(), "before_alive": alive}))
"""


def test_a_slots_next_job_waits_until_the_last_one_of_its_user_is_gone(place: Path) -> None:
    """A worker declared lost comes back naming its task X: the server gives
    X up and places the next job Y on X's slot in the same answer. X (slow to
    stop) and Y ran at the same time as that slot's user, and X read Y's
    environment (found by a reviewer). Y now starts once X is gone."""
    import threading
    import time

    from gpulayer.embedded import Embedded
    from gpulayer.spec import parse_spec
    from gpulayer.transport.inprocess import InProcessTransport
    from gpulayer.worker.worker import Worker

    second, _ = _second_user()
    root = place / "slot-race"
    root.mkdir()
    root.chmod(0o711)
    meet = root / "meet"
    meet.mkdir()
    meet.chmod(0o1777)

    class Quiet(InProcessTransport):  # the worker's own long poll takes nothing
        def __init__(self, embedded: Embedded) -> None:
            super().__init__(embedded.plane, embedded.artifacts)
            self.closed = threading.Event()

        def acquire(self, worker_id: str, timeout: float) -> list[object]:  # type: ignore[override]
            self.closed.wait(timeout)
            return []

    embedded = Embedded(root / "home")
    transport = Quiet(embedded)
    worker = Worker(
        transport,
        cache=embedded.artifacts,
        work_dir=root / "w",
        slots=2,
        run_as=f"nobody,{second}",
        kill_grace=0.5,
    )
    try:
        worker.start()
        x = transport.submit(parse_spec({"command": [SYSTEM_PYTHON, "-c", _SLOW, str(meet)]}))
        (task,) = embedded.plane.take_instructions(worker.id)
        worker._handle([task])
        deadline = time.monotonic() + 60
        while not (meet / "x.pid").exists():
            assert time.monotonic() < deadline, "X never started"
            time.sleep(0.02)  # polled, with a deadline: X's start is another process's
        embedded.plane.unregister_worker(worker.id, reason="stopped heartbeating")
        y = transport.submit(parse_spec({"command": [SYSTEM_PYTHON, "-c", _NEXT, str(meet)]}))
        embedded.plane.register_worker(worker.info, [(x.id, 1)])
        answer = embedded.plane.take_instructions(worker.id)
        assert [type(i).__name__ for i in answer] == ["CancelTask", "RunTask"]
        assert answer[1].slots == task.slots  # the same slot, and so the same user
        worker._handle(answer)
        done = embedded.plane.wait(y.id, timeout=60)
        assert done.state == "succeeded", done.reason
        seen = json.loads(embedded.plane.read_logs(y.id, (0, 0), 0).lines[-1].text)
        assert seen == {"uid": NOBODY, "before_alive": False}
    finally:
        transport.closed.set()
        worker.stop(timeout=30)
        embedded.close()


def test_a_task_on_a_slot_the_worker_does_not_offer_never_runs(place: Path) -> None:
    """Such a task (a hostile or broken server's) ran as slot 0's user."""
    from gpulayer.embedded import Embedded
    from gpulayer.jobs import RunTask
    from gpulayer.spec import parse_spec
    from gpulayer.transport.inprocess import InProcessTransport
    from gpulayer.worker.worker import Worker

    second, _ = _second_user()
    root = place / "bad-slots"
    root.mkdir()
    root.chmod(0o711)
    embedded = Embedded(root / "home")
    worker = Worker(
        InProcessTransport(embedded.plane, embedded.artifacts),
        cache=embedded.artifacts,
        work_dir=root / "w",
        slots=2,
        run_as=f"nobody,{second}",
    )
    try:
        spec = parse_spec({"command": ["true"]})
        for slots in ([5], [-1], []):
            task = RunTask(job_id="j", attempt=1, spec=spec, slots=slots, gpus=[])
            assert worker._user_of(task) is None
    finally:
        worker.stop(timeout=30)  # never started: it lets go of its cgroups
        embedded.close()


def _as(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


_SHOW_INPUTS = r"""
import os, sys, time
with open(sys.argv[1] + "/inputs.tmp", "w") as f:
    f.write(os.environ["GPULAYER_INPUTS"])
os.rename(sys.argv[1] + "/inputs.tmp", sys.argv[1] + "/inputs")
print(open(os.environ["GPULAYER_INPUTS"] + "/data").read())
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1] + "/done") and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def test_another_slots_user_cannot_go_through_a_jobs_inputs(place: Path) -> None:
    """A task's inputs/ was 0755: a job of another slot's user that learnt
    its path (any command line naming an input shows it in `ps`) read its
    inputs, hard-linked blobs included (found by a reviewer)."""
    import time

    from gpulayer.embedded import Embedded
    from gpulayer.spec import parse_spec
    from gpulayer.transport.inprocess import InProcessTransport
    from gpulayer.worker.worker import Worker

    second, second_uid = _second_user()
    root = place / "inputs-reach"
    root.mkdir()
    root.chmod(0o711)
    meet = root / "meet"
    meet.mkdir()
    meet.chmod(0o1777)
    data = root / "data.txt"
    data.write_text("A-PRIVATE-INPUT")
    embedded = Embedded(root / "home")
    transport = InProcessTransport(embedded.plane, embedded.artifacts)
    worker = Worker(
        transport, cache=embedded.artifacts, work_dir=root / "w", slots=2, run_as=f"nobody,{second}"
    )
    try:
        worker.start()
        digest = embedded.artifacts.put_file(data)
        spec = parse_spec(
            {
                "command": [SYSTEM_PYTHON, "-c", _SHOW_INPUTS, str(meet)],
                "inputs": {"data": {"kind": "file", "digest": digest, "size": data.stat().st_size}},
            }
        )
        job = transport.submit(spec)
        deadline = time.monotonic() + 60
        while not (meet / "inputs").exists():
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.02)  # polled, with a deadline: the job is another process
        inputs = (meet / "inputs").read_text()
        probe = "import os, sys\ntry:\n    print(os.listdir(sys.argv[1]))\nexcept OSError as e:\n    print(e.strerror)"
        other = subprocess.run(
            [*_as(second_uid), SYSTEM_PYTHON, "-c", probe, inputs],
            capture_output=True,
            text=True,
            timeout=60,
        )
        (meet / "done").write_text("")
        assert other.stdout.strip() == "Permission denied", other.stdout + other.stderr
        done = embedded.plane.wait(job.id, timeout=60)
        assert done.state == "succeeded", done.reason
        assert "A-PRIVATE-INPUT" in embedded.plane.read_logs(job.id, (0, 0), 0).lines[0].text
    finally:
        worker.stop(timeout=30)
        embedded.close()
