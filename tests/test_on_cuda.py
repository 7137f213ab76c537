"""On a machine with NVIDIA GPUs: what the worker finds, what each job sees, NCCL.

Skipped where CUDA is absent (no package makes a GPU appear); run on a GPU
machine with the rest of the suite. Every job here is a real process started
by a real worker, as a user's would be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gpulayer
from gpulayer.worker.gpus import Gpu, _from_nvidia_smi, detect_gpus

from helpers import PY

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

# What a job's process says about the GPUs it can see, as one JSON line.
REPORT = (
    "import json, os, torch\n"
    "n = torch.cuda.device_count()\n"
    "print(json.dumps({'visible': os.environ.get('CUDA_VISIBLE_DEVICES'), 'count': n,\n"
    "    'uuids': [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]}))\n"
)

# Every rank all-reduces rank+1 on its own GPU over NCCL; rank 0 writes the sum.
NCCL_ALLREDUCE = """\
import json, os, sys
import torch
import torch.distributed as dist

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)], device="cuda")
dist.all_reduce(value)
if rank == 0:
    with open("sum.json", "w") as out:
        json.dump({"sum": value.item(), "world": world, "backend": dist.get_backend(),
                   "device": str(value.device)}, out)
dist.barrier()
dist.destroy_process_group()
"""


def bare_uuid(uuid: str | None) -> str:
    """nvidia-smi and NVML write ``GPU-<uuid>``; PyTorch writes the uuid alone."""
    assert uuid, "the GPU's UUID was not detected"
    return uuid.removeprefix("GPU-")


@pytest.fixture(scope="module")
def gpus() -> list[Gpu]:
    found = detect_gpus()
    assert found, "CUDA sees a GPU but the worker's detection found none"
    return found


def test_detection_finds_the_gpus_cuda_sees(gpus: list[Gpu]) -> None:
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    assert {bare_uuid(g.uuid) for g in gpus} == {str(p.uuid) for p in props}
    assert sorted(g.name for g in gpus) == sorted(p.name for p in props)
    assert all(g.vendor == "nvidia" and (g.memory_mb or 0) > 1024 for g in gpus)
    assert [g.index for g in gpus] == list(range(len(gpus)))
    # Both NVIDIA sources give the same answer (NVML is used when installed).
    assert _from_nvidia_smi(5.0) == gpus


def test_each_job_sees_exactly_its_own_gpus(home: Path, gpus: list[Gpu]) -> None:
    by_index = {g.index: bare_uuid(g.uuid) for g in gpus}
    with gpulayer.Client(home=home) as client:
        one_each = [client.submit(command=[PY, "-c", REPORT], gpus=1) for _ in gpus]
        # The default worker, started by the first submit: one slot per GPU.
        assert [w.slot_gpus for w in client.workers()] == [[g.index for g in gpus]]
        every = client.submit(command=[PY, "-c", REPORT], gpus=len(gpus))
        none = client.submit(command=[PY, "-c", REPORT], gpus=0)
        for job in [*one_each, every, none]:
            assert job.wait(timeout=120) == "succeeded", job.logs()
            seen = json.loads(job.logs().splitlines()[-1])
            assert seen["count"] == len(job.info.gpus), seen
            assert seen["uuids"] == [by_index[i] for i in job.info.gpus], seen
        assert json.loads(none.logs().splitlines()[-1])["visible"] == ""
        assert sorted(i for job in one_each for i in job.info.gpus) == sorted(by_index)


@pytest.mark.parametrize("launcher", ["torchrun", "direct"])
def test_an_nccl_all_reduce_across_the_machines_gpus(
    home: Path, tmp_path: Path, gpus: list[Gpu], launcher: str
) -> None:
    ranks = len(gpus)
    if launcher == "direct" and ranks == 1:
        pytest.skip("the direct launcher wires up ranks only for two or more")
    source = tmp_path / "src"
    source.mkdir()
    (source / "nccl_allreduce.py").write_text(NCCL_ALLREDUCE)
    with gpulayer.Client(home=home) as client:
        job = client.submit(
            str(source / "nccl_allreduce.py"),
            procs_per_node=ranks,
            gpus=ranks,
            launcher=launcher,
            outputs=["sum.json"],
            timeout=180,
        )
        assert job.wait(timeout=240) == "succeeded", job.logs()
        out = job.download_outputs(tmp_path / "out")
    assert json.loads((out / "sum.json").read_text()) == {
        "sum": ranks * (ranks + 1) / 2,
        "world": ranks,
        "backend": "nccl",
        "device": "cuda:0",
    }
