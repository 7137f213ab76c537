"""The light zygote: a script that evidently needs only the standard library
forks from a zygote that preloaded nothing (warm.WarmStarts, imports_only).

The preload here is ``colorsys``: a small module of the standard library
that no zygote imports otherwise, standing in for torch. Which zygote a job
came from is told by its parent's pid (a warm job's parent is its zygote),
and by whether the preload is in ``sys.modules`` before the script imports
it. A wrong guess may only cost time: every job here succeeds or fails
exactly as cold.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer
from gpulayer.worker import warm

pytestmark = pytest.mark.skipif(not warm.supported(), reason="warm start needs Linux pidfds")

PRELOAD = "colorsys"
# Which zygote, and whether the preload was there before the script's first line.
WHERE = "import os, sys\nprint(os.getppid(), 'colorsys' in sys.modules, flush=True)\n"
STDLIB = frozenset(sys.stdlib_module_names) - {PRELOAD}


@pytest.fixture
def client(home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[gpulayer.Client]:
    monkeypatch.setenv("GPULAYER_WARM", "ready")
    monkeypatch.setenv("GPULAYER_PRELOAD", PRELOAD)
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(1, kill_grace=0.5)
        yield c


def _starts(client: gpulayer.Client) -> warm.WarmStarts:
    starts = client._embedded.workers[0]._warm  # type: ignore[union-attr]
    assert starts is not None
    return starts


def _kind_of(client: gpulayer.Client, pid: int) -> str:
    """ "light" or "full": the zygote whose pid that is."""
    for zygote in _starts(client).zygotes:
        if zygote.proc is not None and zygote.proc.pid == pid:
            return "light" if zygote.light else "full"
    raise AssertionError(f"{pid} is no zygote of the worker's")


def _project(tmp_path: Path, files: dict[str, str | bytes]) -> Path:
    root = tmp_path / "project"
    root.mkdir(exist_ok=True)
    for name, source in files.items():
        path = root / name
        if isinstance(source, bytes):
            path.write_bytes(source)
        else:
            path.write_text(textwrap.dedent(source))
    return root


def _run(client: gpulayer.Client, root: Path, script: str, *, warm: bool) -> gpulayer.Job:
    job = client.submit(root / script, source=root, warm=warm)
    job.wait(timeout=120)
    return job


def _where(client: gpulayer.Client, job: gpulayer.Job) -> tuple[str, bool]:
    assert job.info.start == "warm", job.info.start
    ppid, preloaded = job.logs().split()[:2]
    return _kind_of(client, int(ppid)), preloaded == "True"


def _paths_out(text: str) -> str:
    return re.sub(r"/task-\d+/", "/task-N/", text)


# -- which zygote ----------------------------------------------------------------


def test_a_trivial_script_forks_from_the_light_zygote(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    root = _project(tmp_path, {"main.py": WHERE + "import json, os.path\nprint()\n"})
    job = _run(client, root, "main.py", warm=True)
    assert job.info.state == "succeeded", job.logs()
    assert _where(client, job) == ("light", False)
    light = [z for z in _starts(client).zygotes if z.light]
    assert len(light) == 1 and light[0].info["preloaded"] == []


@pytest.mark.parametrize(
    "imports",
    [
        "import colorsys",  # the preload
        "import json, colorsys as c",
        "from colorsys import rgb_to_hsv",
        "def f():\n    import colorsys",  # at any level
        "if True: import colorsys",
        "import json; import colorsys",
        "import helper",  # not the standard library: the job's own
        "import json, \\\n    colorsys",  # a statement not understood: the full one
    ],
)
def test_a_script_that_may_import_more_than_the_standard_library_forks_from_the_full_one(
    client: gpulayer.Client, tmp_path: Path, imports: str
) -> None:
    root = _project(tmp_path, {"main.py": WHERE + imports + "\n", "helper.py": ""})
    job = _run(client, root, "main.py", warm=True)
    assert job.info.state == "succeeded", job.logs()
    assert _where(client, job) == ("full", True)


def test_a_module_imported_otherwise_in_the_light_zygote_is_imported_as_cold(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    # The guess misses importlib: the job imports the preload itself.
    source = WHERE + (
        "import importlib\n"
        "m = importlib.import_module('colorsys')\n"
        "print(m.rgb_to_hsv(1.0, 0.0, 0.0), 'colorsys' in sys.modules)\n"
    )
    root = _project(tmp_path, {"main.py": source})
    hot = _run(client, root, "main.py", warm=True)
    cold = _run(client, root, "main.py", warm=False)
    assert hot.info.state == cold.info.state == "succeeded", hot.logs()
    assert _where(client, hot) == ("light", False)
    assert hot.logs().splitlines()[1:] == cold.logs().splitlines()[1:] == ["(0.0, 1.0, 1.0) True"]


def test_a_relative_import_in_the_light_zygote_fails_as_cold(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    root = _project(tmp_path, {"main.py": WHERE + "from . import helper\n", "helper.py": ""})
    hot = _run(client, root, "main.py", warm=True)
    cold = _run(client, root, "main.py", warm=False)
    assert _where(client, hot)[0] == "light"
    assert (hot.info.exit_code, hot.info.state) == (cold.info.exit_code, cold.info.state)
    assert cold.info.exit_code == 1 and "no known parent package" in cold.logs()
    tail = lambda job: _paths_out(job.logs()).splitlines()[1:]  # noqa: E731
    assert tail(hot) == tail(cold)


# -- what the worker reads: a job's text, hostile -------------------------------


@pytest.mark.parametrize(
    "source",
    [
        b"import json\ndef f(:\n",  # a syntax error
        b"import json\nprint('\xff\xfe')\n",  # not UTF-8
        b"import json\x00\n",  # a NUL
        b"(" * 300 + b"\n",  # nested past the parser's limit
        b"import " + b"a" * 100_000 + b"\n",  # a name as long as the file
    ],
    ids=["syntax-error", "not-utf8", "nul", "nested", "long-name"],
)
def test_a_script_the_parser_refuses_fails_warm_exactly_as_cold(
    client: gpulayer.Client, tmp_path: Path, source: bytes
) -> None:
    root = _project(tmp_path, {"main.py": source})
    hot = _run(client, root, "main.py", warm=True)
    cold = _run(client, root, "main.py", warm=False)
    assert hot.info.start == "warm", hot.info.start
    assert cold.info.state == "failed" and cold.info.exit_code == 1, cold.logs()
    assert (hot.info.exit_code, hot.info.state) == (cold.info.exit_code, cold.info.state)
    assert _paths_out(hot.logs()) == _paths_out(cold.logs())
    again = _run(client, _project(tmp_path, {"ok.py": WHERE}), "ok.py", warm=True)
    assert _where(client, again) == ("light", False)  # the worker is none the worse


def test_a_script_of_50_mb_runs_from_the_full_zygote_unread(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    # Over LIGHT_SCRIPT_MAX_BYTES: its size is all the worker looks at.
    root = tmp_path / "project"
    root.mkdir()
    with (root / "main.py").open("w") as f:
        f.write(WHERE)
        line = "# " + "x" * 1021 + "\n"
        for _ in range(50 << 10):
            f.write(line)
        f.write("print('end')\n")
    job = _run(client, root, "main.py", warm=True)
    assert job.info.state == "succeeded", job.info.reason
    assert _where(client, job) == ("full", True)
    assert job.logs().splitlines()[-1] == "end"


def test_imports_only_reads_what_it_should_and_nothing_else(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()

    def check(text: str | bytes) -> bool:
        (ws / "s.py").write_bytes(text.encode() if isinstance(text, str) else text)
        return warm.imports_only(ws / "s.py", ws, STDLIB)

    assert check("print()\n")
    assert check("import os.path as p, sys\nfrom json import dumps\nfrom . import x\n")
    assert check("from __future__ import annotations\r\nimport os\r\n")
    assert not check("import torch\n")
    assert not check("x = 1; import numpy\n")
    assert not check("try:\n    import numpy as np\nexcept ImportError:\n    np = None\n")
    assert not check("import colorsys\n")  # the preload: the full one has it
    assert not check("import " + "os, " * 10 + "\\\n  numpy\n")
    assert not check("import os\n" * (warm.LIGHT_SCRIPT_MAX_IMPORTS + 1))
    assert not check(b"import \xc3\xa9t\xc3\xa9\n")  # a name outside ASCII: not the stdlib's
    assert not check("#" * (warm.LIGHT_SCRIPT_MAX_BYTES + 1))
    # A link out of the workspace: never read as the worker (root under --run-as).
    outside = tmp_path / "outside.py"
    outside.write_text("print()\n")
    (ws / "link.py").symlink_to(outside)
    assert not warm.imports_only(ws / "link.py", ws, STDLIB)
    (ws / "dev.py").symlink_to("/dev/zero")
    assert not warm.imports_only(ws / "dev.py", ws, STDLIB)
    # A FIFO: opening it to read would block until a writer comes; it is
    # not waited for (the open does not block, and it is no regular file).
    os.mkfifo(ws / "fifo.py")
    assert stat.S_ISFIFO(os.stat(ws / "fifo.py").st_mode)
    assert not warm.imports_only(ws / "fifo.py", ws, STDLIB)
    assert not warm.imports_only(ws / "missing.py", ws, STDLIB)
    assert not warm.imports_only(ws, ws, STDLIB)  # a folder


# -- the same child as cold ---------------------------------------------------------


def test_a_light_fork_sees_what_a_cold_start_sees(client: gpulayer.Client, tmp_path: Path) -> None:
    # The probe of test_warm_start.py: every fact a script can see of its start.
    from test_warm_start import PROBE

    root = _project(tmp_path, {"probe.py": PROBE.replace("import atexit", WHERE + "import atexit")})
    env = {"PROBE_X": "from the job"}
    jobs = {}
    for start in (False, True):
        job = client.submit(root / "probe.py", ["3"], source=root, warm=start, env=env)
        job.wait(timeout=60)
        jobs[start] = job
    cold, hot = jobs[False], jobs[True]
    assert _where(client, hot) == ("light", False)
    for job in (cold, hot):
        assert job.info.exit_code == 3 and job.logs().splitlines()[-1] == "atexit ran"
    assert hot.logs().splitlines()[1:] == cold.logs().splitlines()[1:]


def test_a_killed_primed_child_costs_the_next_job_nothing(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    # A job of the worker's user can kill its zygote's other children: the
    # child primed for the next task among them. That task still starts
    # warm, from a child forked for it.
    killer = WHERE + textwrap.dedent(
        """\
        me, zygote = os.getpid(), os.getppid()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if parent == zygote and int(pid) != me:
                os.kill(int(pid), signal.SIGKILL)
                print("killed", pid)
        """
    )
    root = _project(tmp_path, {"killer.py": "import signal\n" + killer, "ok.py": WHERE})
    first = _run(client, root, "killer.py", warm=True)
    assert first.info.state == "succeeded", first.logs()
    for _ in range(3):
        job = _run(client, root, "ok.py", warm=True)
        assert job.info.state == "succeeded", job.logs()
        assert _where(client, job) == ("light", False)


# -- which zygotes there are ----------------------------------------------------------


def test_with_no_preload_there_is_one_kind(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    starts = warm.WarmStarts(dict(os.environb), preload=(), eager=True)
    try:
        assert starts.wait_ready(60)
        assert [z.light for z in starts.zygotes] == [False]
    finally:
        starts.close()


def test_a_worker_of_its_own_makes_both_kinds_at_once() -> None:
    starts = warm.WarmStarts(dict(os.environb), preload=(PRELOAD,), eager=True)
    try:
        assert starts.wait_ready(60)
        kinds = {z.light: z for z in starts.zygotes}
        assert set(kinds) == {False, True}
        assert kinds[False].info["preloaded"] == [PRELOAD] and kinds[True].info["preloaded"] == []
        assert PRELOAD in kinds[False].modules and PRELOAD not in kinds[True].modules
    finally:
        starts.close()


def test_no_warm_makes_no_zygote_of_either_kind(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPULAYER_WARM", "0")
    monkeypatch.setenv("GPULAYER_PRELOAD", PRELOAD)
    root = _project(tmp_path, {"main.py": "print('ran')\n"})
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(1)
        job = _run(c, root, "main.py", warm=True)
        assert job.info.state == "succeeded" and job.logs() == "ran\n"
        assert job.info.start is not None and "--no-warm" in job.info.start
        assert c._embedded.workers[0]._warm is None  # type: ignore[union-attr]


def test_embedded_both_kinds_are_made_once_a_first_job_has_run(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPULAYER_WARM", "1")
    monkeypatch.setenv("GPULAYER_PRELOAD", PRELOAD)
    root = _project(tmp_path, {"main.py": WHERE})
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(1)
        first = _run(c, root, "main.py", warm=True)
        assert first.info.start == "cold: the ready interpreter starts once a first job has run"
        assert _starts(c).wait_ready(60)
        assert sorted(z.light for z in _starts(c).zygotes) == [False, True]
        second = _run(c, root, "main.py", warm=True)
        assert _where(c, second) == ("light", False)
        # The ranks' settings (OMP_NUM_THREADS=1) have no light one made for
        # a job that needs the full one.
        heavy = _project(tmp_path, {"heavy.py": WHERE + "import colorsys\n"})
        third = c.submit(heavy / "heavy.py", source=heavy, env={"OMP_NUM_THREADS": "2"})
        third.wait(timeout=60)
        assert _starts(c).wait_ready(60)
        assert sorted(z.light for z in _starts(c).zygotes) == [False, False, True]


def test_a_job_killing_the_light_zygote_leaves_the_full_one_serving(
    client: gpulayer.Client, tmp_path: Path
) -> None:
    root = _project(
        tmp_path,
        {
            "killer.py": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nraise SystemExit(4)\n",
            "ok.py": WHERE,
        },
    )
    killed = _run(client, root, "killer.py", warm=True)
    assert (killed.info.start, killed.info.exit_code) == ("warm", 4)
    after = _run(client, root, "ok.py", warm=True)
    assert after.info.state == "succeeded"
    assert _where(client, after) == ("full", True)  # while the light one is made again
    assert _starts(client).wait_ready(60)
    again = _run(client, root, "ok.py", warm=True)
    assert _where(client, again) == ("light", False)
