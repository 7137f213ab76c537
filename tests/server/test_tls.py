"""Optional TLS: ``server start --tls-cert/--tls-key`` serves HTTPS, and clients and
workers reach it with a CA they are told to trust.

The certificates are made at test time with the ``openssl`` command: a CA,
and a server certificate it signs for 127.0.0.1 and localhost.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpulayer.errors import ServerUnreachable, UntrustedServer
from gpulayer.spec import JobSpec
from gpulayer.transport.http import HttpTransport
from server.conftest import ServerProc, free_port, worker_start_refused

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@dataclass
class Certs:
    ca: Path  # what clients trust
    cert: Path  # the server's certificate and key
    key: Path


def make_certs(where: Path) -> Certs:
    where.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=where, check=True, capture_output=True, stdin=subprocess.DEVNULL
        )

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=gpulayer test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    openssl("req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=localhost")  # fmt: skip
    (where / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\n"
        "subjectKeyIdentifier=hash\n"
    )
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-set_serial", "1", "-days", "2", "-extfile", "server.ext", "-out", "server.pem")  # fmt: skip
    return Certs(where / "ca.pem", where / "server.pem", where / "server.key")


@dataclass
class TlsServer(ServerProc):
    """The conftest's server process, started with a certificate: it speaks HTTPS."""

    certs: Certs | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def plain_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def context(self) -> ssl.SSLContext:
        assert self.certs is not None
        return ssl.create_default_context(cafile=str(self.certs.ca))

    def start(self) -> None:
        assert self.certs is not None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpulayer.cli", "--home", str(self.home),
             "server", "start", "--port", str(self.port),
             "--tls-cert", str(self.certs.cert), "--tls-key", str(self.certs.key)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()  # "gpulayer: serving https://... (home ...)"
        assert f"serving {self.url}" in line, line + self.proc.stderr.read()
        deadline = time.monotonic() + 30
        while True:  # readiness: the health endpoint answers over HTTPS
            try:
                with urllib.request.urlopen(
                    f"{self.url}/healthz", timeout=1, context=self.context()
                ) as r:
                    if r.status == 200:
                        break
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {self.proc.stderr.read()}") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)  # waiting for another process to bind: nothing to block on
        self.admin = (self.home / "admin-token").read_text().strip()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsServer]:
    srv = TlsServer(tmp_path / "server-home", free_port(), certs=make_certs(tmp_path / "certs"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_health_over_https_with_the_ca(tls_server: TlsServer) -> None:
    url = f"{tls_server.url}/healthz"
    with urllib.request.urlopen(url, timeout=10, context=tls_server.context()) as r:
        assert (r.status, json.loads(r.read())) == (200, {"ok": True})
    # The name in the certificate is checked too: localhost is in it.
    with urllib.request.urlopen(
        f"https://localhost:{tls_server.port}/healthz", timeout=10, context=tls_server.context()
    ) as r:
        assert r.status == 200
    # Without the CA the certificate is not trusted.
    with pytest.raises(urllib.error.URLError) as refused:
        urllib.request.urlopen(url, timeout=10, context=ssl.create_default_context())
    assert isinstance(refused.value.reason, ssl.SSLCertVerificationError), refused.value


def test_plain_http_gets_no_answer(tls_server: TlsServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", tls_server.port, timeout=10)
    try:
        with pytest.raises((OSError, http.client.HTTPException)):
            conn.request("GET", "/healthz")
            conn.getresponse().read()
    finally:
        conn.close()
    assert tls_server.proc is not None and tls_server.proc.poll() is None  # still serving
    with pytest.raises(ServerUnreachable):
        HttpTransport(tls_server.plain_url, token=tls_server.admin, retries=1).list_jobs()


def test_transport_without_the_ca_is_refused(tls_server: TlsServer) -> None:
    transport = HttpTransport(tls_server.url, token=tls_server.admin)
    try:
        with pytest.raises(UntrustedServer, match="CERTIFICATE_VERIFY_FAILED") as refused:
            transport.list_jobs()
        assert "--ca-file" in str(refused.value)  # it says what to do
    finally:
        transport.close()


def test_a_worker_that_does_not_trust_the_server_says_so_and_exits(
    tls_server: TlsServer, tmp_path: Path
) -> None:
    env = {**os.environ, "GPULAYER_TOKEN": tls_server.admin}
    env.pop("SSL_CERT_FILE", None)
    env.pop("GPULAYER_CA_FILE", None)
    started = worker_start_refused(tmp_path / "w", tls_server.url, env)
    assert "does not trust" in started.stderr and "--ca-file" in started.stderr


def test_submit_list_and_run_over_tls(
    tls_server: TlsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tls_server.certs is not None
    ca = str(tls_server.certs.ca)
    transport = HttpTransport(tls_server.url, token=tls_server.admin, ca_file=ca)
    try:
        job = transport.submit(JobSpec(command=[sys.executable, "-c", "print('over tls')"]))
        assert [j.id for j in transport.list_jobs()] == [job.id]
        assert job.state == "queued"
        # The worker process trusts the CA that GPULAYER_CA_FILE names.
        monkeypatch.setenv("GPULAYER_CA_FILE", ca)
        tls_server.start_worker(tmp_path / "w1")
        done = transport.wait(job.id, timeout=60)
        assert (done.state, done.exit_code) == ("succeeded", 0), done.reason
        chunk = transport.read_logs(job.id, (0, 0), timeout=0)
        assert "over tls" in [line.text for line in chunk.lines]
        assert [w.name for w in transport.list_workers()] == ["w"]
    finally:
        transport.close()


def test_the_cli_trusts_the_ca_it_is_given(tls_server: TlsServer) -> None:
    assert tls_server.certs is not None
    base = [sys.executable, "-m", "gpulayer.cli", "--server", tls_server.url]
    env = {**os.environ, "GPULAYER_TOKEN": tls_server.admin}
    env.pop("SSL_CERT_FILE", None)
    trusted = subprocess.run(
        [*base, "--ca-file", str(tls_server.certs.ca), "workers"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert trusted.returncode == 0, trusted.stderr
    untrusted = subprocess.run([*base, "workers"], env=env, capture_output=True, text=True)
    assert untrusted.returncode != 0
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.stderr
