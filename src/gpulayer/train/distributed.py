"""The process group and DDP: what changes when a job has several ranks."""

from __future__ import annotations

import atexit
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpulayer.train.accelerator import Accelerator
from gpulayer.train.environment import ClusterEnvironment
from gpulayer.train.errors import TrainerError

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def init_process_group(env: ClusterEnvironment, accelerator: Accelerator) -> None:
    """Join the job's process group (NCCL on GPUs, gloo otherwise) once per process."""
    if not dist.is_available():  # pragma: no cover - every supported build has it
        raise TrainerError("WORLD_SIZE > 1 but this PyTorch build has no torch.distributed")
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size:
            raise TrainerError(
                f"a process group of {dist.get_world_size()} ranks already exists, but "
                f"WORLD_SIZE={env.world_size}"
            )
        return
    dist.init_process_group(
        backend=accelerator.dist_backend,
        init_method=f"tcp://{env.main_address}:{env.main_port}",
        rank=env.global_rank,
        world_size=env.world_size,
    )
    # The group lives as long as the process, so fit() then validate() reuse it.
    atexit.register(_destroy)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class TrainingStep(torch.nn.Module):
    """Routes DDP's forward to ``training_step``: DDP prepares its gradient
    hooks in forward, so the step must run through the wrapper."""

    def __init__(self, module: Any) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.module.training_step(batch, batch_idx)


def wrap_ddp(
    module: torch.nn.Module, device: torch.device, find_unused: bool
) -> DistributedDataParallel:
    return DistributedDataParallel(
        TrainingStep(module),
        device_ids=[device] if device.type == "cuda" else None,
        find_unused_parameters=find_unused,
    )


def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    dist.all_reduce(tensor, op=_OPS[op])
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is true on any (one small collective)."""
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item() > 0)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
