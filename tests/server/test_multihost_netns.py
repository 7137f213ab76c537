"""A distributed job across "hosts": the server and two workers each in a
network namespace of its own, joined by veth pairs on a bridge, and the
client in this process reaching the server over its own veth.

What loopback cannot show: node 0's worker advertises the address it reaches
the server from (its namespace's, not 127.0.0.1), ranks on the other worker
reach rank 0 there, and the gloo ranks connect to each other across namespaces.

Needs root for ``ip netns add``; skipped, saying so, where it is not permitted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer
from netns_cluster import IFNAME, NetnsCluster, netns_unavailable

from helpers import PY, run_2x2_allreduce

PRINT_ADDR = (
    "import json, os; print(json.dumps({k: os.environ[k] for k in "
    "('RANK', 'NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'GLOO_SOCKET_IFNAME')}))"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    """One server and two one-slot workers, each in its own namespace, for the module."""
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    # NetnsCluster cleans up (processes, veth, namespaces) if start-up fails,
    # and on leaving the block whatever the tests did.
    with NetnsCluster(workers=2, slots=1, root=tmp_path_factory.mktemp("netns")) as c:
        yield c


@pytest.fixture
def client(cluster: NetnsCluster) -> Iterator[gpulayer.Client]:
    with cluster.client() as c:
        yield c


def node0_address(cluster: NetnsCluster, client: gpulayer.Client, job: gpulayer.Job) -> str:
    """Node 0's worker's namespace address; asserts the tasks used both workers."""
    info = job.refresh()
    names = {w.id: w.name for w in client.workers()}
    on = [names[t.worker] for t in sorted(info.tasks, key=lambda t: t.node)]
    assert sorted(on) == sorted(cluster.worker_names.values()), on  # one task on each
    return cluster.worker_addresses[on[0]]


@pytest.mark.parametrize("launcher", ["direct", "torchrun"])
def test_a_2x2_gloo_all_reduce_across_namespaces(
    cluster: NetnsCluster, client: gpulayer.Client, launcher: str, tmp_path: Path
) -> None:
    # No GLOO_SOCKET_IFNAME in the job: each worker names the interface of
    # its advertised address. Without that, gloo listens on the address the
    # hostname resolves to (127.0.0.1 here) and the ranks on the other worker
    # fail with "Gloo connectFullMesh failed ... Connection refused,
    # remote=[127.0.0.1]:PORT".
    job = run_2x2_allreduce(client, tmp_path / "out", launcher, context=cluster.logs)
    addr = node0_address(cluster, client, job)
    assert addr != "127.0.0.1"
    assert addr.startswith(cluster.net.prefix + ".")


def test_ranks_get_node_0s_namespace_address_as_master(
    cluster: NetnsCluster, client: gpulayer.Client
) -> None:
    job = client.submit(command=[PY, "-c", PRINT_ADDR], nodes=2, procs_per_node=2, timeout=60)
    assert job.wait(timeout=90) == "succeeded", f"{job.logs()}\n{cluster.logs()}"
    seen = {line.rank: json.loads(line.text) for line in job.stream_logs(follow=False)}
    assert set(seen) == {0, 1, 2, 3}
    addr = node0_address(cluster, client, job)
    assert {env["MASTER_ADDR"] for env in seen.values()} == {addr}
    assert {env["NODE_RANK"] for env in seen.values()} == {"0", "1"}
    assert len({env["MASTER_PORT"] for env in seen.values()}) == 1
    assert {env["GLOO_SOCKET_IFNAME"] for env in seen.values()} == {IFNAME}
    # The workers advertise their namespaces' addresses, as the server sees them.
    advertised = {w.name: w.address for w in client.workers()}
    assert {n: advertised[n] for n in cluster.worker_names.values()} == cluster.worker_addresses
