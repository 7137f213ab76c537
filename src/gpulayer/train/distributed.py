"""The process group and DDP: what changes when a job has several ranks."""

from __future__ import annotations

import atexit
import logging
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpulayer.train.accelerator import Accelerator
from gpulayer.train.environment import ClusterEnvironment
from gpulayer.train.errors import TrainerError

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_log = logging.getLogger("gpulayer.train")

#: How long a rank waits at exit for the others before tearing down alone;
#: only a peer that is alive but never gets there costs this long.
EXIT_BARRIER_TIMEOUT = timedelta(minutes=5)

# Whether the Trainer's last fit()/validate() here returned normally. Only
# then do the ranks meet at exit: a rank leaving on an error (an exception,
# sys.exit(1) in a callback) must go at once, so that peers blocked in a
# collective it will never join fail fast rather than wait for it.
_finished_cleanly = False


def finished_cleanly(done: bool) -> None:
    """The Trainer says whether its current call returned normally."""
    global _finished_cleanly
    _finished_cleanly = done


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
    """At exit: wait (bounded) for the other ranks, then destroy the group.

    On gloo, ``destroy_process_group`` leaves the group's worker threads
    running while anything (a DDP wrapper) holds the group: into interpreter
    finalization. A worker lets go of a finished collective's tensors just
    after it wakes the caller; if the caller has dropped one (``any_rank``
    does), freeing its Python object takes the GIL, and once finalization has
    begun Python ends that thread with pthread_exit, which aborts in a C++
    destructor: "terminate called without an active exception". A rank that
    exits right after its last collective (not rank 0, which still writes
    files) loses that race on a busy machine. Waiting in a barrier releases
    the GIL until every rank is done, so the workers finish first, and no rank
    closes its sockets while a peer still talks to it.
    """
    if not dist.is_initialized():
        return
    if _finished_cleanly and dist.get_backend() == dist.Backend.GLOO and not _exiting_on_error():
        try:
            _meet(EXIT_BARRIER_TIMEOUT)  # gloo only: NCCL ranks keep the plain teardown
        except Exception as exc:
            _log.warning("ranks did not meet at exit, tearing down alone: %s", exc)
    dist.destroy_process_group()


def _meet(timeout: timedelta) -> None:
    """Wait for every rank. ``monitored_barrier`` fails at once when a peer is
    gone (its sockets closed) and bounds rank 0's wait by ``timeout``; the
    other ranks wait for rank 0 as long as the group's own timeout allows,
    which is what they should do while it finishes its last writes."""
    dist.monitored_barrier(timeout=timeout)


def _exiting_on_error() -> bool:
    """An uncaught exception ends the interpreter (Python sets this before atexit).

    The peers may then be blocked in a collective this rank will never join:
    leaving at once, without a barrier, closes its sockets and fails them fast.
    """
    return (
        getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
    )


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
