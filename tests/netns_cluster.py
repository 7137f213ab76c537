"""A GPUlayer server and workers, each on its own "host": a Linux network namespace.

Used by ``tests/server/test_multihost_netns.py`` and by
``benchmarks/distributed_startup.py --netns``. Needs root (``ip netns add``);
:func:`netns_unavailable` says why not when it cannot be done.

The layout, for a cluster numbered ``n`` in process ``pid``, on a free subnet
``10.A.B.0/24``::

    root namespace (this process, the client)
      glPIDcN  10.A.B.254 ----+
                              |  veth pairs into a bridge of their own
    gpulayer-PID-N-hub        |  (a namespace of its own too, so the host's
      br0 ----+---------------+   firewall and bridge-netfilter settings
              |                   never see the traffic)
              +-- gpulayer-PID-N-server  gl0  10.A.B.1  `gpulayer server start`
              +-- gpulayer-PID-N-w0      gl0  10.A.B.2  `gpulayer worker start`
              +-- gpulayer-PID-N-w1      gl0  10.A.B.3  `gpulayer worker start`

Every namespace has its loopback up. The interface inside each namespace is
named ``gl0`` (:data:`IFNAME`). Jobs need not name it: each worker sets
``GLOO_SOCKET_IFNAME`` to the interface of the address it advertises.

Everything is removed by :meth:`NetnsCluster.close`, whatever happened before:
processes (those left inside the namespaces too), the root-side veth, the
namespaces. Names carry the pid and a counter, so parallel runs (pytest-xdist)
do not clash.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import Announced, stop, tail

import gpulayer

IFNAME = "gl0"
SERVER_PORT = 8585  # the server's namespace is its own: no port can clash

_counter = itertools.count()


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}"
        )
    return done


def netns_unavailable() -> str | None:
    """``None`` if this process may create network namespaces, else why not."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed, so `ip netns add` cannot run"
    probe = f"gpulayer-probe-{os.getpid()}-{next(_counter)}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        who = "as root" if os.geteuid() == 0 else f"as uid {os.geteuid()}, not root"
        return (
            f"`ip netns add` is not permitted here ({who}): {made.stderr.strip()}; "
            "creating network namespaces needs root (CAP_SYS_ADMIN)"
        )
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _free_subnet() -> str:
    """A ``10.A.B`` prefix no interface or route of this namespace uses yet."""
    used = _run(["ip", "-4", "-o", "addr"]).stdout + _run(["ip", "-4", "route"]).stdout
    pid = os.getpid()
    for i in range(256):
        key = (pid + i * 7919) % 12800  # spread parallel runs over 50 x 256 subnets
        prefix = f"10.{200 + key // 256}.{key % 256}"
        if not re.search(rf"(?<![\d.]){re.escape(prefix)}\.", used):
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test network")


class Network:
    """A hub namespace with a bridge, named namespaces on it, and this process's veth."""

    def __init__(self, hosts: list[str]) -> None:
        n = next(_counter)
        pid = os.getpid()
        self.prefix = _free_subnet()
        self.hub = f"gpulayer-{pid}-{n}-hub"
        self.root_if = f"gl{pid}c{n}"[:15]
        self.root_addr = f"{self.prefix}.254"
        self.namespaces = {host: f"gpulayer-{pid}-{n}-{host}" for host in hosts}
        self.addresses = {host: f"{self.prefix}.{i + 1}" for i, host in enumerate(hosts)}
        self._made: list[str] = []  # namespaces that exist, for close()
        self._root_if_made = False

    def create(self) -> None:
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        hub = self.hub
        _run(["ip", "netns", "add", hub])
        self._made.append(hub)
        self.ns_run(hub, "ip", "link", "set", "lo", "up")
        self.ns_run(hub, "ip", "link", "add", "br0", "type", "bridge")
        self.ns_run(hub, "ip", "link", "set", "br0", "up")
        for i, (host, ns) in enumerate(self.namespaces.items()):
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            port = f"p{i}"
            self.ns_run(ns, "ip", "link", "set", "lo", "up")
            _run(["ip", "link", "add", IFNAME, "netns", ns, "type", "veth",
                  "peer", "name", port, "netns", hub])  # fmt: skip
            self.ns_run(ns, "ip", "addr", "add", f"{self.addresses[host]}/24", "dev", IFNAME)
            self.ns_run(ns, "ip", "link", "set", IFNAME, "up")
            self.ns_run(hub, "ip", "link", "set", port, "master", "br0")
            self.ns_run(hub, "ip", "link", "set", port, "up")
        _run(["ip", "link", "add", self.root_if, "type", "veth", "peer", "name", "up0",
              "netns", hub])  # fmt: skip
        self._root_if_made = True
        _run(["ip", "addr", "add", f"{self.root_addr}/24", "dev", self.root_if])
        _run(["ip", "link", "set", self.root_if, "up"])
        self.ns_run(hub, "ip", "link", "set", "up0", "master", "br0")
        self.ns_run(hub, "ip", "link", "set", "up0", "up")

    def ns_run(self, ns: str, *argv: str) -> subprocess.CompletedProcess[str]:
        return _run(["ip", "netns", "exec", ns, *argv])

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def kill_leftovers(self) -> None:
        """SIGKILL whatever still runs inside the namespaces (only what we started)."""
        for ns in self._made:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    def close(self) -> None:
        self.kill_leftovers()
        if self._root_if_made:
            # Deleting the peer's namespace would remove it too, but only later,
            # in the kernel's own time; delete it now so its route goes at once.
            _run(["ip", "link", "del", self.root_if], check=False)
            self._root_if_made = False
        for ns in reversed(self._made):
            _run(["ip", "netns", "del", ns], check=False)
        self._made.clear()


class NetnsCluster:
    """``gpulayer server start`` in one namespace, ``workers`` one-slot workers
    each in its own; this process reaches them through its veth.

    ``with NetnsCluster(workers=2) as cluster: client = cluster.client()``.
    Raises ``RuntimeError`` (with the processes' last output) if something
    does not come up; cleans up before raising.
    """

    def __init__(
        self,
        *,
        workers: int = 2,
        slots: int = 1,
        kill_grace: float = 0.5,
        root: Path | None = None,
        python: str = sys.executable,
    ) -> None:
        self.worker_hosts = [f"w{i}" for i in range(workers)]
        self.net = Network(["server", *self.worker_hosts])
        self.slots = slots
        self.kill_grace = kill_grace
        self.python = python
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="gpulayer-netns-")
        self.root = root or Path(self._tmp.name)  # type: ignore[union-attr]
        self.server_addr = self.net.addresses["server"]
        self.url = f"http://{self.server_addr}:{SERVER_PORT}"
        self.admin = ""
        self.server: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self._outputs: list[Announced] = []
        self.worker_names = {host: f"netns-{os.getpid()}-{host}" for host in self.worker_hosts}

    @property
    def worker_addresses(self) -> dict[str, str]:
        """Each worker's name and its namespace's address."""
        return {self.worker_names[h]: self.net.addresses[h] for h in self.worker_hosts}

    def __enter__(self) -> NetnsCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cli(self, *argv: str) -> list[str]:
        return [self.python, "-m", "gpulayer.cli", *argv]

    def _spawn(
        self, host: str, argv: list[str], log: Path, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], Announced]:
        # Own session: a Ctrl-C reaches only the caller, which stops them in order.
        proc = subprocess.Popen(
            self.net.exec_argv(host, argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        assert proc.stdout is not None
        announced = Announced(proc.stdout, log)
        self._outputs.append(announced)
        return proc, announced

    def start(self) -> None:
        self.net.create()
        home, log = self.root / "server", self.root / "server.log"
        argv = self._cli(
            "--home", str(home), "server", "start", "--host", self.server_addr,
            "--port", str(SERVER_PORT), "--heartbeat-timeout", "30",
        )  # fmt: skip
        self.server, announced = self._spawn("server", argv, log)
        announced.wait("the server did not start in its namespace")
        self.admin = (home / "admin-token").read_text().strip()
        env = {**os.environ, "GPULAYER_TOKEN": self.admin}
        starting = []
        for host in self.worker_hosts:
            log = self.root / f"worker-{host}.log"
            argv = self._cli(
                "--home", str(self.root / f"worker-{host}"), "--server", self.url,
                "worker", "start", "--gpus", "none", "--slots", str(self.slots),
                "--name", self.worker_names[host], "--kill-grace", str(self.kill_grace),
            )  # fmt: skip
            proc, announced = self._spawn(host, argv, log, env)
            self.workers.append(proc)
            starting.append(announced)
        for announced in starting:  # "gpulayer: worker <id> (...) serving URL" once registered
            announced.wait("a worker did not register")

    def client(self) -> gpulayer.Client:
        """A client of the server, with the admin token."""
        return gpulayer.Client(self.url, token=self.admin)

    def logs(self) -> str:
        """The last lines of every process's output, for a failure message."""
        parts = [f"--- server ---\n{tail(self.root / 'server.log')}"]
        parts += [
            f"--- worker {h} ---\n{tail(self.root / f'worker-{h}.log')}" for h in self.worker_hosts
        ]
        return "\n".join(parts)

    def close(self) -> None:
        try:
            for proc in self.workers:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in self.workers:
                stop(proc)
            if self.server is not None:
                stop(self.server)
            for output in self._outputs:  # the copies end with the processes
                output.thread.join(timeout=10)
        finally:
            try:
                self.net.close()
            finally:
                if self._tmp is not None:
                    self._tmp.cleanup()
                    self._tmp = None
