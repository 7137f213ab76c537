"""A job's secrets (issue 16, item 12): they reach the job's environment, and
nothing else shows them: not the API, the CLI, the job store's bytes,
GPUlayer's own logs, an error message or a repr."""

from __future__ import annotations

import base64
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from sec_credentials_kit import Cluster, cluster, job_python, need_other_user

import gpulayer
from gpulayer.ids import new_id
from gpulayer.jobs import RunTask
from gpulayer.service import ControlPlane
from gpulayer.spec import REDACTED, JobSpec, parse_spec
from server.conftest import ServerProc

# The job prints a digest of each secret it was given, never the secret.
PRINT_DIGESTS = (
    "import hashlib, os, sys\n"
    "for name in sys.argv[1:]:\n"
    "    print(name, hashlib.sha256(os.environ[name].encode()).hexdigest())\n"
)


def _value() -> str:
    return "sk-" + os.urandom(12).hex()


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _forms(value: str) -> list[bytes]:
    """The value, and the encodings a store that only encoded it would hold."""
    raw = value.encode()
    return [raw, base64.b64encode(raw), base64.urlsafe_b64encode(raw), raw.hex().encode()]


def _shows_none(data: bytes | str, *values: str) -> None:
    data = data.encode() if isinstance(data, str) else data
    for value in values:
        for form in _forms(value):
            assert form not in data, f"{form!r} is shown"


def _store_bytes(home: Path) -> bytes:
    """Every byte of the job store: the database, its WAL and shared memory."""
    files = sorted(home.glob("gpulayer.db*"))
    assert files, f"no job store in {home}"
    return b"".join(f.read_bytes() for f in files)


def _gl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", "-v", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def servers() -> Iterator[Cluster]:
    need_other_user()
    with cluster() as found:
        yield found


def test_a_secret_reaches_its_job_and_no_reader_of_the_server(servers: Cluster) -> None:
    worker, worker_said = servers.start_worker("secrets")
    secret = _value()
    with servers.client() as client:
        job = client.submit(
            command=[job_python(), "-c", PRINT_DIGESTS, "API_KEY"],
            env={"PLAIN": "shown"},
            secrets={"API_KEY": secret},
            timeout=60,
        )
        _shows_none(msgspec.json.encode(job.info), secret)  # the submit's own answer
        assert job.wait(timeout=90) == "succeeded", job.logs()
        assert job.logs() == f"API_KEY {_digest(secret)}\n"  # the job had it
        assert job.info.spec.secrets == {"API_KEY": REDACTED}
        assert job.info.spec.env == {"PLAIN": "shown"}  # an env is no secret
        assert all(j.info.spec.secrets == {"API_KEY": REDACTED} for j in client.jobs())
    for path in (f"/api/v1/jobs/{job.id}", "/api/v1/jobs", f"/api/v1/jobs/{job.id}/logs"):
        answer = servers.get(path)
        _shows_none(answer, secret)
    assert b'"API_KEY":"<redacted>"' in servers.get(f"/api/v1/jobs/{job.id}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    env.update(GPULAYER_TOKEN=servers.admin, COLUMNS="200")
    shown = _gl("--server", servers.url, "show", job.id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "API_KEY" in shown.stdout  # its name, and only its name
    _shows_none(shown.stdout + shown.stderr, secret)
    if "--json" in _gl("show", "--help", env=env).stdout:
        as_json = _gl("--server", servers.url, "show", "--json", job.id, env=env)
        assert as_json.returncode == 0, as_json.stderr
        _shows_none(as_json.stdout, secret)
    _shows_none(_store_bytes(servers.home), secret)
    worker.terminate()
    assert worker.wait(timeout=30) == 0
    _shows_none("".join(worker_said) + "".join(servers.server_said), secret)  # both with -v


def test_secrets_from_the_command_line_reach_the_job_only(tmp_path: Path) -> None:
    """`gpulayer run --secret NAME --env-file FILE`, embedded: the job gets
    both; the CLI's own output, `show` and the store's bytes show neither."""
    home = tmp_path / "home"
    from_shell, from_file, quoted = _value(), _value(), _value()
    env_file = tmp_path / "job.env"
    env_file.write_text(f"# a comment\n\nexport DB_PASSWORD={from_file}\nQUOTED = '{quoted}'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    env.update(GPULAYER_HOME=str(home), API_KEY=from_shell, COLUMNS="200")
    done = _gl(
        "run", "--secret", "API_KEY", "--env-file", str(env_file), "--",
        sys.executable, "-c", PRINT_DIGESTS, "API_KEY", "DB_PASSWORD", "QUOTED",
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"API_KEY {_digest(from_shell)}",
        f"DB_PASSWORD {_digest(from_file)}",
        f"QUOTED {_digest(quoted)}",
    ]
    _shows_none(done.stderr, from_shell, from_file, quoted)  # GPUlayer's own words, with -v
    job_id = done.stderr.split("gpulayer: job ")[1].split()[0]
    shown = _gl("show", job_id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "API_KEY, DB_PASSWORD, QUOTED" in shown.stdout
    _shows_none(shown.stdout + shown.stderr, from_shell, from_file, quoted)
    _shows_none(_store_bytes(home), from_shell, from_file, quoted)
    key = home / "secrets.key"
    assert key.stat().st_mode & 0o777 == 0o600


def test_a_value_on_the_command_line_or_in_env_is_warned_about(tmp_path: Path) -> None:
    """`--secret NAME=VALUE` is in `ps` while `run` runs, and `--env HF_TOKEN=...`
    is stored and shown as it is: both say so, and the job still gets them."""
    secret = _value()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    env["GPULAYER_HOME"] = str(tmp_path / "home")
    done = _gl(
        "run", "--secret", f"API_KEY={secret}", "--env", "HF_TOKEN=plain", "--",
        sys.executable, "-c", PRINT_DIGESTS, "API_KEY", "HF_TOKEN",
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"API_KEY {_digest(secret)}",
        f"HF_TOKEN {_digest('plain')}",
    ]
    assert "a --secret NAME=VALUE is visible to every user of this machine" in done.stderr
    assert "--env HF_TOKEN is stored and shown in plain text" in done.stderr
    _shows_none(done.stderr, secret)


def test_bad_secrets_are_refused_without_saying_them(tmp_path: Path) -> None:
    home = tmp_path / "home"
    secret = _value()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULAYER_")}
    env["GPULAYER_HOME"] = str(home)
    bad_line = tmp_path / "bad.env"
    bad_line.write_text(f"OK=1\nAPI_KEY {secret}\n")  # no '='
    refused = _gl("run", "--env-file", str(bad_line), "--", "true", env=env)
    assert refused.returncode != 0
    assert f"{bad_line} line 2: expected NAME=VALUE" in refused.stderr
    _shows_none(refused.stderr + refused.stdout, secret)
    unset = _gl("run", "--secret", "NOT_SET_HERE_X", "--", "true", env=env)
    assert unset.returncode != 0 and "$NOT_SET_HERE_X is not set here" in unset.stderr
    with gpulayer.Client(home=home, auto_worker=False) as client:
        cases = {
            "secrets.API_KEY": {"env": {"API_KEY": "x"}, "secrets": {"API_KEY": secret}},
            "secrets.1BAD": {"secrets": {"1BAD": secret}},
            "secrets.AGAIN": {"secrets": {"AGAIN": REDACTED}},  # a record's, submitted again
        }
        for field, fields in cases.items():
            with pytest.raises(gpulayer.SpecError) as caught:
                client.submit(command=["true"], **fields)  # type: ignore[arg-type]
            assert caught.value.field == field
            _shows_none(str(caught.value), secret)
        assert client.jobs() == []  # nothing stored
    spec = parse_spec({"command": ["true"], "secrets": {"API_KEY": secret}})
    task = RunTask(job_id="j", attempt=1, spec=spec, slots=[0], gpus=[])
    _shows_none(repr(spec) + repr(task) + str(spec), secret)


def test_a_store_without_its_key_reveals_and_runs_nothing(server: ServerProc) -> None:
    """A job queued with a secret on a server; then the server's home loses
    its key (a copy of the database elsewhere, say) and the server starts
    again. Its bytes hold no secret, and the job ends failed saying why: it
    never runs without its secret."""
    secret = _value()
    with server.client() as client:
        job = client.submit(command=[sys.executable, "-c", "print('ran')"], secrets={"K": secret})
        assert job.status == "queued"  # no worker yet
    server.kill(signal.SIGTERM)
    _shows_none(_store_bytes(server.home), secret)
    (server.home / "secrets.key").unlink()
    server.start()
    server.start_worker(server.home.parent / "worker-home")
    with server.client() as client:
        again = client.job(job.id)
        assert again.wait(timeout=60) == "failed"
        assert "the secret K cannot be decrypted" in (again.info.reason or "")
        assert again.logs() == ""
        _shows_none(msgspec.json.encode(again.info), secret)


def test_a_retried_submit_with_secrets_is_the_same_job(plane: ControlPlane) -> None:
    """Each seal of a value differs; a retry of a submit (same id, same spec)
    still finds its job, and a different secret is a different spec."""
    spec = JobSpec(command=["true"], secrets={"K": "v1"})
    job_id = new_id()
    first = plane.submit(spec, job_id=job_id)
    assert plane.submit(spec, job_id=job_id).id == first.id == job_id
    with pytest.raises(gpulayer.GPUlayerError, match="different spec"):
        plane.submit(JobSpec(command=["true"], secrets={"K": "v2"}), job_id=job_id)
    stored = plane.store.get_job(job_id)
    assert stored is not None
    assert stored.spec.secrets["K"] not in ("v1", REDACTED)  # sealed
    assert plane.get(job_id).spec.secrets == {"K": REDACTED}
