"""Distributed tasks: how one node's ranks are wired up and started.

A job of ``nodes=N, procs_per_node=M`` has N tasks; each starts M ranks. Two
launchers (ADR-0016):

- ``direct`` (the default): the worker spawns the M rank processes itself,
  each with the variables ``torch.distributed``'s ``env://`` initialisation
  reads. Nothing here imports torch, and no agent process sits between the
  worker and the ranks: the start-up and shutdown torchrun spends are gone.
- ``torchrun``: one ``torch.distributed.run`` agent per node, for scripts that
  rely on torchelastic (restarts, its own rendezvous). Its output lines carry
  a rank prefix (set through its environment) that the worker strips into the
  line's ``rank``. Its ranks get what torchrun sets, and ``NODE_RANK`` too.

The master port: node 0's worker reserves it before anything starts. The
socket is bound with ``SO_REUSEADDR`` and never listens, so the kernel gives
that port to no one else (``bind`` to port 0 skips it, a plain ``bind`` to
it fails), while rank 0's TCP store (which sets ``SO_REUSEADDR`` too) can
still bind and listen on it. The usual alternative, bind to port 0, close,
hand the number over, leaves a window in which another job starting at the
same moment can take the port.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import sys
import time
from collections.abc import Iterable

from ..spec import JobSpec

TORCHRUN_PREFIX = "[gpulayer-rank${rank}]:"
_PREFIX_RE = re.compile(r"^\[gpulayer-rank(\d+)\]:")
# torchrun's summary of a failed rank ("Root Cause (first observed failure)").
_ROOT_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)")
_ROOT_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


RANK_ZERO_WAIT_S = 0.25  # the most node 0's forked ranks wait for rank 0's store


def listening(port: int, timeout: float) -> bool:
    """Whether a socket of this machine listens on TCP ``port``, looked for
    in /proc/net/tcp{,6} (no connection made: a store would see one) until
    ``timeout`` s have passed."""
    want = f":{port:04X} "
    deadline = time.monotonic() + timeout
    while True:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    next(f, None)  # its header
                    for line in f:
                        fields = line.split()
                        # local_address is field 1; st (0A: LISTEN) field 3
                        if (
                            len(fields) > 3
                            and fields[3] == "0A"
                            and (fields[1] + " ").endswith(want)
                        ):
                            return True
            except OSError:
                return False  # no /proc to look in: do not wait
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)  # polled: nothing tells another process of a listen


def reserve_port() -> socket.socket:
    """A socket holding a free TCP port for rank 0 (see the module's notes).

    Keep it open until the task ends: closing it gives the port back.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    return sock


def rank_env(
    spec: JobSpec, *, node: int, local_rank: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """What one rank of the direct launcher sees, as torchrun would set it.

    No ``TORCHELASTIC_*`` variables: they would make ``torch.distributed``
    look for an agent's store that does not exist.
    """
    per_node = spec.procs_per_node
    rank = node * per_node + local_rank
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_WORLD_SIZE": str(per_node),
        "NODE_RANK": str(node),
        "GROUP_RANK": str(node),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    env.update(cpu_threads(spec))
    return env


def cpu_threads(spec: JobSpec) -> dict[str, str]:
    """One thread per rank unless the job says otherwise (as torchrun does)."""
    return {} if "OMP_NUM_THREADS" in spec.env else {"OMP_NUM_THREADS": "1"}


def torchrun_argv(
    spec: JobSpec,
    program: list[str],
    *,
    node: int,
    master_addr: str,
    master_port: int,
    log_dir: str,
) -> list[str]:
    """The agent's command line for one node. ``program`` is the script and
    its arguments, or a command (run with ``--no-python``)."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={spec.nodes}",
        f"--nproc-per-node={spec.procs_per_node}",
        f"--node-rank={node}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        # Tee: output goes through the agent, which prefixes each line with
        # its rank; the log directory lives in the task's directory.
        "--tee=3",
        f"--log-dir={log_dir}",
    ]
    if spec.script is None:
        argv.append("--no-python")
    return [*argv, *program]


def interface_of(address: str | None) -> str | None:
    """The name of this machine's network interface holding ``address``.

    None for a loopback or unknown address. Gloo (and NCCL) pick the
    interface their ranks listen on from what the hostname resolves to,
    often 127.0.0.1 or 127.0.1.1: ranks on other machines then cannot reach
    them. The interface of the address the worker advertises is the one
    that reaches the other workers.
    """
    if not address:
        return None
    try:
        if ipaddress.ip_address(address).is_loopback:
            return None
    except ValueError:
        return None  # a host name, not an address
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def network_env(spec: JobSpec, interface: str | None) -> dict[str, str]:
    """Which interface a job of several nodes talks on, unless its env says."""
    if spec.nodes < 2 or interface is None:
        return {}
    return {
        key: interface
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        if key not in spec.env
    }


def torchrun_env(spec: JobSpec, *, node: int) -> dict[str, str]:
    """What one node's torchrun agent gets, and passes on to its ranks.

    torchrun sets ``GROUP_RANK`` for each rank but not ``NODE_RANK``, which
    every rank gets under the direct launcher and which Lightning's own
    environment detection reads: the agent's environment carries it.
    """
    return {
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": TORCHRUN_PREFIX,
        "NODE_RANK": str(node),
        **cpu_threads(spec),
    }


def split_rank(text: str) -> tuple[int | None, str]:
    """A torchrun output line's rank and the line as the rank printed it."""
    match = _PREFIX_RE.match(text)
    if match is None:
        return None, text
    return int(match.group(1)), text[match.end() :]


def torchrun_failure(lines: Iterable[str]) -> tuple[int, int] | None:
    """(rank, exit code) of the root cause torchrun names when a rank fails."""
    rank = None
    cause = False
    for line in lines:
        if not cause:
            cause = "Root Cause" in line
        elif rank is None:
            found = _ROOT_RANK_RE.match(line)
            if found:
                rank = int(found.group(1))
        else:
            found = _ROOT_EXIT_RE.match(line)
            if found:
                return rank, int(found.group(1))
    return None
