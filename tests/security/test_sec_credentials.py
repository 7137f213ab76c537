"""A job, or another local user, goes after a worker's token (issue 16, items
2 and 12): through /proc (environ, cmdline, mem), ptrace, or `ps`. The
worker and its job run as one ordinary Unix user, as on a shared machine
without --run-as (see sec_credentials_kit.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sec_credentials_kit import (
    PROBE,
    Cluster,
    all_command_lines,
    cluster,
    descendants,
    job_python,
    loot_of,
    need_other_user,
    own,
    worker_uid,
)

import gpulayer
from gpulayer.credentials import find_token, read_token_file

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and prctl are Linux's")


@pytest.fixture(scope="module")
def servers() -> Iterator[Cluster]:
    need_other_user()
    with cluster() as found:
        yield found


def _token_file(servers: Cluster, token: str, mode: int = 0o600) -> Path:
    path = servers.root / f"token-{mode:o}-{os.urandom(4).hex()}"
    path.write_text(token + "\n")
    return own(path, mode)


@pytest.mark.parametrize("given", ["environment", "token-file"])
def test_a_job_reads_no_token_from_its_worker(servers: Cluster, given: str) -> None:
    """The hostile job reads /proc/<pid>/environ and cmdline of its worker
    and of the worker's warden, scans their memory (maps, mem) for anything
    shaped like a token, and ptrace-attaches to both; it also looks at its
    own environment. It gets not a byte of the token and no attach (without
    the worker's non-dumpable flag it gets the token both ways); nor is the
    token on any command line on the machine."""
    token = servers.token("worker")
    name = f"probed-{given}"
    if given == "environment":
        worker, _ = servers.start_worker(name, env=servers.worker_env(GPULAYER_TOKEN=token))
    else:
        worker, _ = servers.start_worker(name, "--token-file", str(_token_file(servers, token)))
    assert token.encode() not in all_command_lines()  # what `ps` shows every user
    targets = [worker.pid, *descendants(worker.pid)]  # the worker and its warden
    assert len(targets) >= 2, targets
    loot = servers.root / f"loot-{given}"
    loot.mkdir()
    own(loot, 0o700)  # the job's user writes what it got there
    with servers.client() as client:
        job = client.submit(
            command=[job_python(), "-c", PROBE, str(loot), *map(str, targets)], timeout=60
        )
        assert job.wait(timeout=90) == "succeeded", job.logs()
    tried, got = loot_of(loot)
    assert tried["uid"] == worker_uid() != 0  # as the worker's own, ordinary, user
    assert token.encode() not in got
    own_env = tried["own_env"]
    assert isinstance(own_env, dict)
    assert not {"GPULAYER_TOKEN", "GPULAYER_TOKEN_FILE"} & set(own_env), sorted(own_env)
    for pid in targets:
        seen = tried[str(pid)]
        assert isinstance(seen, dict)
        assert seen["environ"] == seen["mem"] == seen["maps"] == "Permission denied", seen
        assert seen["ptrace"] == "Operation not permitted", seen
        assert seen["cmdline"] == "read"  # readable by everyone, and holds no token
    worker.terminate()
    assert worker.wait(timeout=30) == 0


def test_a_token_file_others_may_read_is_refused(servers: Cluster) -> None:
    """A token in a file with mode 0644 (or 0640) is every local user's
    already: the worker refuses it, says how to fix it, and never registers."""
    token = servers.token("worker")
    for mode in (0o644, 0o640, 0o606):
        path = _token_file(servers, token, mode)
        refused = subprocess.run(
            servers.worker_argv(f"refused-{mode:o}", "--token-file", str(path)),
            env=servers.worker_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode != 0
        assert f"the token file {path} has permissions {mode:04o}" in refused.stderr
        assert f"chmod 600 {path}" in refused.stderr
        assert token not in refused.stderr + refused.stdout
    with servers.client() as client:
        assert not [w for w in client.workers() if w.name.startswith("refused-")]


def test_a_token_on_the_command_line_warns_and_names_the_alternatives(
    servers: Cluster,
) -> None:
    cli = [sys.executable, "-m", "gpulayer.cli", "--server", servers.url]
    done = subprocess.run(
        [*cli, "--token", servers.admin, "jobs", "--limit", "1"],
        env={k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_TOKEN")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "visible to every user of this machine (in `ps`)" in done.stderr
    assert "$GPULAYER_TOKEN" in done.stderr and "--token-file" in done.stderr
    given_twice = subprocess.run(
        [*cli, "--token", servers.admin, "worker", "start", "--token-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert given_twice.returncode != 0
    assert "the worker's token is given twice" in given_twice.stderr


def test_the_token_comes_by_the_documented_precedence(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("from-file\n")
    path.chmod(0o600)
    env = {"GPULAYER_TOKEN": "from-env", "GPULAYER_TOKEN_FILE": str(path), "OTHER": "x"}
    assert find_token(token=None, token_file=None, env=dict(env)) == "from-env"
    assert find_token(token=None, token_file=path, env=dict(env)) == "from-file"
    assert find_token(token="given", token_file=None, env=dict(env)) == "given"
    only_file = {"GPULAYER_TOKEN_FILE": str(path)}
    assert find_token(token=None, token_file=None, env=only_file) == "from-file"
    assert find_token(token=None, token_file=None, env={}) is None
    forgotten = dict(env)
    assert find_token(token=None, token_file=None, env=forgotten, forget=True) == "from-env"
    assert forgotten == {"OTHER": "x"}  # a worker's jobs inherit neither
    with pytest.raises(gpulayer.GPUlayerError, match="not both"):
        find_token(token="a", token_file=path, env={})


def test_a_token_file_must_hold_one_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    for text, why in (("", "it is empty"), ("a b\n", "one token on one line")):
        path.write_text(text)
        path.chmod(0o600)
        with pytest.raises(gpulayer.GPUlayerError, match=why):
            read_token_file(path)
    with pytest.raises(gpulayer.GPUlayerError, match="cannot read the token file"):
        read_token_file(tmp_path / "missing")
    with pytest.raises(gpulayer.GPUlayerError, match="not a regular file"):
        read_token_file(tmp_path)


# The job climbs to its worker and to the `gpulayer run` that started that
# worker, then probes both as PROBE does.
_CLIMB = r"""
import os, sys
def parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
worker = os.getppid()
sys.argv = ["probe", sys.argv[1], str(worker), str(parent(worker))]
exec(PROBE)
"""


def test_a_job_of_a_local_worker_reads_no_token_from_the_run_that_started_it(
    servers: Cluster,
) -> None:
    """`gpulayer run --workers 1` against a server hands its token to the
    worker it starts; the job it runs climbs to that `run` process, whose
    environment held the token (a reviewer read an admin token there and
    made a new admin token with it). The CLI is non-dumpable as a worker is."""
    token = servers.token("admin")
    loot = servers.root / "loot-run"
    loot.mkdir()
    own(loot, 0o700)
    home = servers.root / "run-home"
    home.mkdir()
    own(home, 0o700)
    script = servers.root / "climb.py"
    script.write_text(f"PROBE = {PROBE!r}\n{_CLIMB}")
    own(script, 0o644)
    argv = [job_python(), "-m", "gpulayer.cli", "--home", str(home), "--server", servers.url]
    argv += ["run", "--workers", "1", "--", job_python(), str(script), str(loot)]
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    done = subprocess.run(
        argv,
        env=servers.worker_env(GPULAYER_TOKEN=token),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "probed 2" in done.stdout + done.stderr
    tried, got = loot_of(loot)
    assert token.encode() not in got
    probed = [v for k, v in tried.items() if k.isdigit()]
    assert len(probed) == 2
    for seen in probed:
        assert isinstance(seen, dict)
        assert seen["environ"] == seen["mem"] == "Permission denied", seen


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_token_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    """Mode 0600 but nobody's: a job running as nobody (--run-as) could
    rewrite it and choose the token a root worker acts with."""
    path = tmp_path / "token"
    path.write_text("glt_w_notmine\n")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    with pytest.raises(gpulayer.GPUlayerError, match="belongs to user id 65534"):
        read_token_file(path)
