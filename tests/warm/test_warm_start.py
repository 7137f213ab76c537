"""Warm start: a script forked from the worker's ready interpreter is what a
cold ``python script.py`` is (issue 19, point 2), checked by running the same
probe both ways and comparing what each saw.

The zygote here preloads nothing (``GPULAYER_PRELOAD=""``): these facts do
not depend on torch, and a zygote that imports nothing is ready in
milliseconds. The torch-specific facts are in tests/distributed/.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gpulayer
from gpulayer.worker import warm

pytestmark = pytest.mark.skipif(not warm.supported(), reason="warm start needs Linux pidfds")

PROBE = textwrap.dedent(
    """
    import atexit, ctypes, json, os, pickle, signal, sys

    class Point:
        def __init__(self, x):
            self.x = x

    def facts():
        main = sys.modules["__main__"]
        here = os.getcwd()
        rel = lambda p: os.path.relpath(p, here) if isinstance(p, str) and p.startswith(here) else p
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_char_p
        stdout, stderr = sys.stdout, sys.stderr
        return {
            "argv": sys.argv,
            "orig_argv_tail": sys.orig_argv[1:],
            "path0": rel(sys.path[0]),
            "path1": rel(sys.path[1]),
            "file": rel(__file__),
            "name": __name__,
            "main_keys": sorted(vars(main)),
            "spec": repr(__spec__),
            "loader": type(__loader__).__name__,
            "package": __package__,
            "doc": __doc__,
            "cached": __cached__,
            "own_session": os.getsid(0) == os.getpid(),
            "own_group": os.getpgid(0) == os.getpid(),
            "cwd_is_workspace": os.path.isfile(os.path.join(here, "probe.py")),
            "env_X": os.environ.get("PROBE_X"),
            "c_env_X": (libc.getenv(b"PROBE_X") or b"").decode(),
            "c_cuda": repr(libc.getenv(b"CUDA_VISIBLE_DEVICES")),
            "stdout": [stdout.encoding, stdout.errors, stdout.line_buffering,
                       stdout.write_through, type(stdout.buffer).__name__, stdout.isatty()],
            "stderr": [stderr.encoding, stderr.errors, stderr.line_buffering,
                       stderr.write_through],
            "stdin": [sys.stdin.fileno(), os.readlink("/proc/self/fd/0")],
            "signals": {
                s.name: repr(signal.getsignal(s))
                for s in signal.valid_signals()
                if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)
            },
            "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            "pickled": pickle.loads(pickle.dumps(Point(7))).x,
            "flags": list(sys.flags),
            "first_fd": os.open(os.devnull, os.O_RDONLY),
            "modules_main": sys.modules["__main__"] is main,
        }

    if __name__ == "__main__":
        print(json.dumps(facts(), sort_keys=True))
        atexit.register(lambda: print("atexit ran"))
        log = open("unflushed.txt", "w")
        log.write("written, never closed")
        sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    """
)


def _project(tmp_path: Path, source: str, name: str = "probe.py") -> Path:
    root = tmp_path / "project"
    root.mkdir(exist_ok=True)
    (root / name).write_text(source)
    return root / name


def _all_ready(client: gpulayer.Client) -> None:
    """Wait for every zygote the workers have made (or begun) to be ready."""
    workers = client._embedded.workers  # type: ignore[union-attr]
    assert all(w._warm is not None and w._warm.wait_ready(60) for w in workers)


def _zygotes(client: gpulayer.Client) -> list[warm.Zygote]:
    starts = client._embedded.workers[0]._warm  # type: ignore[union-attr]
    assert starts is not None
    return starts.zygotes


def _has_light(client: gpulayer.Client) -> bool:
    """Whether the worker keeps light zygotes (the "light" warm_client)."""
    return any(z.light for z in _zygotes(client))


def _paths_out(text: str) -> str:
    return re.sub(r"/task-\d+/", "/task-N/", text)


def _run(
    client: gpulayer.Client, script: Path, *args: str, warm: bool, **kw: object
) -> gpulayer.Job:
    job = client.submit(script, list(args), warm=warm, **kw)  # type: ignore[arg-type]
    job.wait(timeout=60)
    return job


def test_a_warm_script_sees_what_a_cold_one_sees(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    script = _project(tmp_path, PROBE)
    env = {"PROBE_X": "from the job"}
    cold = _run(warm_client, script, "3", warm=False, env=env, outputs=["unflushed.txt"])
    hot = _run(warm_client, script, "3", warm=True, env=env, outputs=["unflushed.txt"])
    assert cold.info.start is not None and cold.info.start.startswith("cold")
    assert hot.info.start == "warm", hot.info.start
    seen = {}
    for kind, job in (("cold", cold), ("warm", hot)):
        out = job.logs().splitlines()
        seen[kind] = json.loads(out[0])
        assert out[-1] == "atexit ran", (kind, out)
        assert job.info.exit_code == 3, kind
        assert job.info.state == "failed"
        got = job.download_outputs(tmp_path / f"out-{kind}") / "unflushed.txt"
        assert got.read_text() == "written, never closed", kind
    assert seen["warm"] == seen["cold"]
    # And they are what the probe says a script should see.
    facts = seen["warm"]
    assert facts["argv"] == ["probe.py", "3"] and facts["name"] == "__main__"
    assert facts["own_session"] and facts["own_group"] and facts["cwd_is_workspace"]
    assert facts["env_X"] == facts["c_env_X"] == "from the job"
    assert facts["c_cuda"] == "b''"  # no GPU given: every GPU hidden, at the C level too
    assert facts["signals"]["SIGINT"] == repr(signal.default_int_handler)
    assert facts["blocked"] == [] and facts["pickled"] == 7 and facts["first_fd"] == 3


def test_exits_and_tracebacks_match_a_cold_start(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    cases = {
        "raise.py": "def f():\n    raise ValueError('boom')\nf()\n",
        "message.py": "import sys\nsys.exit('a message')\n",
        "none.py": "raise SystemExit\n",
        "interrupt.py": "raise KeyboardInterrupt\n",
        "big.py": "import sys\nsys.exit(256 + 7)\n",
        "thread.py": (
            "import threading, time\n"
            "def late():\n    time.sleep(0.2)\n    print('thread done', flush=True)\n"
            "threading.Thread(target=late).start()\n"
        ),
    }
    for name, source in cases.items():
        script = _project(tmp_path, source, name)
        cold = _run(warm_client, script, warm=False)
        hot = _run(warm_client, script, warm=True)
        assert hot.info.start == "warm", (name, hot.info.start)
        assert (hot.info.exit_code, hot.info.state) == (cold.info.exit_code, cold.info.state), name
        # The same text, but for the workspace's path (each task its own).
        assert _paths_out(hot.logs()) == _paths_out(cold.logs()), name
        if name == "raise.py":
            assert "ValueError: boom" in hot.logs() and "zygote" not in hot.logs()
        if name == "thread.py":
            assert "thread done" in hot.logs()  # a thread that is not a daemon is waited for


def test_multiprocessing_works_inside_a_warm_job(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    source = textwrap.dedent(
        """
        import multiprocessing as mp

        def square(x):
            return x * x

        if __name__ == "__main__":
            for method in ("spawn", "fork"):
                with mp.get_context(method).Pool(2) as pool:
                    print(method, pool.map(square, [1, 2, 3]))
        """
    )
    job = _run(warm_client, _project(tmp_path, source, "mp.py"), warm=True)
    assert job.info.start == "warm"
    assert job.info.state == "succeeded", job.logs()
    assert job.logs().splitlines() == ["spawn [1, 4, 9]", "fork [1, 4, 9]"]


def test_a_module_of_the_zygote_in_the_workspace_starts_cold(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A cold start imports the job's own json.py (the script's folder comes
    # first); a fork of a zygote that imported json would not.
    monkeypatch.setenv("GPULAYER_WARM", "ready")
    monkeypatch.setenv("GPULAYER_PRELOAD", "json")
    script = _project(tmp_path, "import json\nprint(json.OWN)\n", "main.py")
    (script.parent / "json.py").write_text("OWN = 'the job s own json'\n")
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(1)
        job = _run(c, script, warm=True)
        assert job.info.state == "succeeded", job.logs()
        assert job.logs().strip() == "the job s own json"
        assert job.info.start is not None and "json.py would be imported" in job.info.start


def test_settings_read_at_import_start_from_a_zygote_made_for_them(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    script = _project(tmp_path, "import os\nprint(os.environ['PYTHONHASHSEED'])\n", "seed.py")
    first = _run(warm_client, script, warm=True, env={"PYTHONHASHSEED": "123"})
    assert first.info.start is not None and "PYTHONHASHSEED=123" in first.info.start
    _all_ready(warm_client)
    second = _run(warm_client, script, warm=True, env={"PYTHONHASHSEED": "123"})
    assert second.info.start == "warm", second.info.start
    assert second.logs().strip() == "123"
    check = _project(tmp_path, "print(hash('a') == hash('a'), hash('gpulayer'))\n", "h.py")
    a = _run(warm_client, check, warm=True, env={"PYTHONHASHSEED": "123"})
    b = _run(warm_client, check, warm=False, env={"PYTHONHASHSEED": "123"})
    assert a.info.start == "warm"
    assert a.logs() == b.logs()  # the seed the job asked for, not the worker's


def test_a_job_that_kills_the_zygote_keeps_its_exit_code_and_the_next_is_warm_again(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    killer = _project(
        tmp_path,
        "import os, signal, time\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
        "print('still here')\n"
        "raise SystemExit(5)\n",
        "killer.py",
    )
    job = _run(warm_client, killer, warm=True)
    assert job.info.start == "warm"
    assert job.info.exit_code == 5, job.logs()
    assert "still here" in job.logs()
    plain = _project(tmp_path, "print('ok')\n", "plain.py")
    after = _run(warm_client, plain, warm=True)
    assert after.info.state == "succeeded"
    if _has_light(warm_client):  # the light one died: the full one serves meanwhile
        assert after.info.start == "warm", after.info.start
    else:
        assert after.info.start is not None and "a new one is starting" in after.info.start
    _all_ready(warm_client)
    again = _run(warm_client, plain, warm=True)
    assert again.info.start == "warm" and again.logs().strip() == "ok"


def _memory_count(pid: int, needle: bytes) -> int:
    """How often ``needle`` is in process ``pid``'s readable memory."""
    found = 0
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if "r" not in perms or "[vsyscall]" in line or "[vvar]" in line:
                continue
            lo, hi = (int(x, 16) for x in span.split("-"))
            try:
                mem.seek(lo)
                found += mem.read(hi - lo).count(needle)
            except OSError:
                continue
    return found


def test_the_zygote_never_holds_what_a_job_was_given(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    # Every warm job is a copy of the zygote's memory: what one job was
    # given (its environment, its secrets) must never pass through it, or
    # the next job, another user's, could read it in its own memory.
    secret = "s3cr3t-" + os.urandom(8).hex()
    holder = _project(tmp_path, "import os\nprint(len(os.environ['TOKEN']))\n", "holder.py")
    job = _run(warm_client, holder, warm=True, secrets={"TOKEN": secret}, env={"PLAIN": secret})
    assert job.info.start == "warm" and job.logs().strip() == str(len(secret))
    zygotes = warm_client._embedded.workers[0]._warm.zygotes  # type: ignore[union-attr]
    assert zygotes
    for zygote in zygotes:
        assert _memory_count(zygote.proc.pid, b"zygote.py") > 0  # the scan finds what is there
        assert _memory_count(zygote.proc.pid, secret.encode()) == 0


def test_a_command_running_the_workers_python_on_a_script_starts_warm(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    script = _project(tmp_path, "import sys\nprint(sys.argv)\n", "cmd.py")
    job = warm_client.submit(command=[sys.executable, str(script), "a"])
    job.wait(timeout=60)
    assert job.info.start == "warm", job.info.start
    assert job.logs().strip() == repr([str(script), "a"])
    # Another interpreter, or `python -c`, is not the worker's Python running a script.
    for command in ([sys.executable, "-c", "print(1)"], ["/bin/sh", "-c", "echo 1"]):
        other = warm_client.submit(command=command)
        other.wait(timeout=60)
        assert other.info.start is not None and other.info.start.startswith("cold: a command")


def test_a_job_that_stops_the_zygote_only_makes_the_next_start_cold(
    warm_client: gpulayer.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGSTOP rather than a kill: the zygote lives, but answers no more.
    # Read where it is used: a child's "go" (warm.process), the zygote's answer (warm.handle).
    monkeypatch.setattr(warm.process, "FORK_TIMEOUT_S", 0.5)
    monkeypatch.setattr(warm.handle, "FORK_TIMEOUT_S", 0.5)
    stopper = _project(
        tmp_path,
        "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nprint('stopped it')\n",
        "stopper.py",
    )
    job = _run(warm_client, stopper, warm=True)
    assert job.info.start == "warm" and job.info.state == "succeeded", job.logs()
    plain = _project(tmp_path, "print('ok')\n", "plain.py")
    after = _run(warm_client, plain, warm=True)
    assert after.info.state == "succeeded" and after.logs().strip() == "ok"
    if _has_light(warm_client):  # the light one was ended: the full one serves meanwhile
        assert after.info.start == "warm", after.info.start
    else:
        assert (
            after.info.start is not None and "the ready interpreter was ended" in after.info.start
        )
    _all_ready(warm_client)  # the stuck one was ended, and is made again
    again = _run(warm_client, plain, warm=True)
    assert again.info.start == "warm", again.info.start


@pytest.mark.parametrize(
    "setting",
    [
        {"LD_PRELOAD": "/tmp/evil.so"},
        {"PYTHONHOME": "/tmp/planted"},
        {"PYTHONWARNINGS": "ignore::planted.Warning"},
        {"OMP_NUM_THREADS": "4; touch /tmp/x"},
        {"LANG": "../../tmp/planted"},
    ],
)
def test_a_jobs_start_settings_never_make_a_zygote_but_thread_counts_and_the_like(
    warm_client: gpulayer.Client, tmp_path: Path, setting: dict[str, str]
) -> None:
    # A zygote runs as the worker's user (root under --run-as) and serves
    # later jobs of the same key: made with a job's PYTHONHOME or LD_PRELOAD
    # it would run that job's code there. Such a job starts cold, as itself.
    workers = warm_client._embedded.workers  # type: ignore[union-attr]
    before = {id(z) for w in workers for z in w._warm.zygotes}
    script = _project(tmp_path, "print('ran')\n", "main.py")
    for _ in range(2):
        job = _run(warm_client, script, warm=True, env=setting)
        (name,) = setting
        assert job.info.start is not None and f"its {name} differs" in job.info.start, (
            job.info.start
        )
    _all_ready(warm_client)
    assert {id(z) for w in workers for z in w._warm.zygotes} == before


def test_a_warm_mode_that_is_none_of_them_is_refused_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpulayer.errors import WorkerError

    monkeypatch.setenv("GPULAYER_WARM", "yes; rm -rf /")
    with pytest.raises(WorkerError, match=r"GPULAYER_WARM='yes; rm -rf /' is not one of 0, 1"):
        warm.from_environment({}, warm=None, preload=None, eager=True)


@pytest.mark.parametrize("preload", ["os;import shutil", "../evil", "torch,--", "a b"])
def test_a_preload_that_is_no_module_name_is_refused_before_anything_starts(
    tmp_path: Path, preload: str
) -> None:
    home = tmp_path / "worker-home"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulayer.cli",
            "--home",
            str(home),
            "--server",
            "http://127.0.0.1:9",
            "worker",
            "start",
            "--gpus",
            "none",
            "--preload",
            preload,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "is not a module name" in done.stderr and "--preload" in done.stderr
    assert not home.exists()  # no home made, no GPU claimed, no zygote started
