"""Review of issue 19: what a warm script can observe that a cold
``python script.py`` does not (each test asserts the cold behaviour).

The zygote preloads nothing here (``GPULAYER_PRELOAD=""``): none of these
depend on torch.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

import gpulayer
from gpulayer.worker import warm

pytestmark = pytest.mark.skipif(not warm.supported(), reason="warm start needs Linux pidfds")


def _project(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "project"
    root.mkdir(exist_ok=True)
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def _run(
    client: gpulayer.Client, root: Path, script: str, *, warm: bool, **kw: object
) -> gpulayer.Job:
    job = client.submit(root / script, source=root, warm=warm, **kw)  # type: ignore[arg-type]
    job.wait(timeout=60)
    return job


def _both(
    client: gpulayer.Client, root: Path, script: str = "main.py", **kw: object
) -> tuple[gpulayer.Job, gpulayer.Job]:
    cold = _run(client, root, script, warm=False, **kw)
    hot = _run(client, root, script, warm=True, **kw)
    assert hot.info.start == "warm", hot.info.start
    return cold, hot


def _paths_out(text: str) -> str:
    return re.sub(r"/task-\d+/", "/task-N/", text)


def _ready(client: gpulayer.Client) -> None:
    workers = client._embedded.workers  # type: ignore[union-attr]
    assert all(w._warm is not None and w._warm.wait_ready(60) for w in workers)


# -- exit codes ----------------------------------------------------------------


@pytest.mark.parametrize("code", ["2**64", "2**63"])
def test_sys_exit_with_an_int_too_big_for_a_c_long_fails_as_cold(
    warm_client: gpulayer.Client, tmp_path: Path, code: str
) -> None:
    # CPython: PyLong_AsLong overflows, the status is -1 (255). The zygote
    # masks the int with 0xFF instead: 2**64 & 0xFF == 0, a failure
    # reported as success.
    root = _project(tmp_path, {"main.py": f"import sys\nsys.exit({code})\n"})
    cold, hot = _both(warm_client, root)
    assert cold.info.exit_code == 255 and cold.info.state == "failed"
    assert (hot.info.exit_code, hot.info.state) == (cold.info.exit_code, cold.info.state)


def test_a_forked_child_that_returns_does_not_decide_the_jobs_exit_code(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    # A script forks (plain os.fork); the child finishes with sys.exit(0),
    # which in a warm job runs _run's tail in the child too, and so sends
    # ("exit", 0) down the channel shared with its parent. When the zygote
    # is gone (OOM, killed) the worker reads that first message as the
    # job's code: 0 for a script that exits 7.
    source = """\
        import os, signal, sys, time
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        os.kill(os.getppid(), signal.SIGKILL)  # warm only: the zygote
        sys.exit(7)
    """
    root = _project(tmp_path, {"main.py": source})
    hot = _run(warm_client, root, "main.py", warm=True)  # never cold: it kills its parent
    assert hot.info.start == "warm"
    assert hot.info.exit_code == 7, (hot.info.state, hot.info.exit_code)


# -- the import system ---------------------------------------------------------


@pytest.mark.parametrize("module", ["types", "signal", "socket", "typing", "enum", "threading"])
def test_a_stdlib_module_the_zygote_itself_imported_is_still_shadowed_as_cold(
    warm_client: gpulayer.Client, tmp_path: Path, module: str
) -> None:
    # A cold start imports the project's own <module>.py (the script's
    # folder comes first: none of these is imported by a cold interpreter
    # before the script). The zygote imported them itself (zygote.py's
    # imports, before _STARTUP_MODULES is taken; _run's, in the child), so
    # they are never in the modules that _shadowed checks: the job gets
    # the stdlib one, silently, and its record says "warm".
    root = _project(
        tmp_path,
        {
            "main.py": f"import {module}\nprint(getattr({module}, 'OWN', 'the stdlib one'))\n",
            f"{module}.py": "OWN = 'the project s own'\n",
        },
    )
    cold = _run(warm_client, root, "main.py", warm=False)
    hot = _run(warm_client, root, "main.py", warm=True)
    assert cold.logs().startswith("the project s own")
    task_dirs = re.compile(r"/task-\d+/")  # each task its own workspace
    assert task_dirs.sub("/", hot.logs()) == task_dirs.sub("/", cold.logs()), hot.info.start


def test_pythonsafepath_keeps_the_scripts_folder_off_sys_path_as_cold(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    # PYTHONSAFEPATH (3.11): sys.path[0] is not the script's folder. The
    # zygote made for that setting has sys.flags.safe_path set, but _enter
    # puts the folder first regardless.
    root = _project(
        tmp_path,
        {
            "main.py": "import sys\nprint(sys.flags.safe_path, any(p.endswith('/workspace') "
            "for p in sys.path))\ntry:\n    import helper\n    print('imported helper')\n"
            "except ImportError:\n    print('no helper')\n",
            "helper.py": "",
        },
    )
    env = {"PYTHONSAFEPATH": "1"}
    cold = _run(warm_client, root, "main.py", warm=True, env=env)  # cold: wants its zygote
    assert cold.info.start is not None and cold.info.start.startswith("cold"), cold.info.start
    _ready(warm_client)
    hot = _run(warm_client, root, "main.py", warm=True, env=env)
    assert hot.info.start == "warm", hot.info.start
    assert cold.logs() == "True False\nno helper\n"
    assert hot.logs() == cold.logs()


# -- what the process shows of itself -----------------------------------------


def test_a_command_naming_a_missing_script_fails_as_python_does(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    # `python missing.py`: "python: can't open file '...': [Errno 2] ...",
    # exit 2. Warm (the command is the worker's Python on a .py), _run's
    # open() raises: a FileNotFoundError line and exit 1.
    import sys

    command = [sys.executable, "missing.py"]
    cold = warm_client.submit(command=command, warm=False)
    hot = warm_client.submit(command=command)
    cold.wait(timeout=60)
    hot.wait(timeout=60)
    assert hot.info.start == "warm", hot.info.start
    assert cold.info.exit_code == 2 and "can't open file" in cold.logs()
    assert hot.info.exit_code == cold.info.exit_code, hot.logs()
    assert _paths_out(hot.logs()) == _paths_out(cold.logs())


def test_files_alive_at_exit_are_closed_as_cold(
    warm_client: gpulayer.Client, tmp_path: Path
) -> None:
    # A cold interpreter's teardown frees __main__'s globals: a GzipFile is
    # closed (its trailer written), a ZipFile's __del__ writes its central
    # directory. The warm end (_flush_files, then os._exit) only flushes:
    # the .gz has no end-of-stream, the .zip is no zip (an output lost, as
    # issue 19 point 4 says must not happen).
    source = """\
        import gzip, zipfile
        log = gzip.open("out.gz", "wt")
        log.write("hello")
        archive = zipfile.ZipFile("out.zip", "w")
        archive.writestr("a.txt", "A")
    """
    import gzip
    import zipfile

    root = _project(tmp_path, {"main.py": source})
    for warm_start in (False, True):
        job = _run(warm_client, root, "main.py", warm=warm_start, outputs=["out.gz", "out.zip"])
        assert job.info.state == "succeeded", job.logs()
        assert job.info.start == ("warm" if warm_start else "cold: the job asked for a cold start")
        out = job.download_outputs(tmp_path / f"out-{warm_start}")
        kind = job.info.start
        with gzip.open(out / "out.gz", "rt") as gz:
            assert gz.read() == "hello", kind
        with zipfile.ZipFile(out / "out.zip") as zf:
            assert zf.namelist() == ["a.txt"], kind
