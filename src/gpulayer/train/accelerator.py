"""The device a rank computes on: one small class per kind of accelerator.

``accelerator="auto"`` picks CUDA (which is also how PyTorch exposes ROCm
GPUs), then Apple MPS, then the CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from gpulayer.train.environment import ClusterEnvironment
from gpulayer.train.errors import TrainerError, invalid_choice

ACCELERATOR_NAMES = ("auto", "cpu", "cuda", "gpu", "rocm", "mps")


class Accelerator(ABC):
    """One kind of device: how to find it, name it and talk across ranks on it."""

    #: The ``torch.device`` type and the ``torch.autocast`` device type.
    device_type: ClassVar[str]
    #: The ``torch.distributed`` backend for ranks on this kind of device.
    dist_backend: ClassVar[str]

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool: ...

    @classmethod
    def device_count(cls) -> int:
        return 1

    def device(self, index: int) -> torch.device:
        return torch.device(self.device_type, index)

    def setup_device(self, device: torch.device) -> None:  # noqa: B027 - optional
        """Make ``device`` this process's current device, where that means anything."""

    @property
    def name(self) -> str:
        return self.device_type


class CPUAccelerator(Accelerator):
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, index: int) -> torch.device:
        return torch.device("cpu")


class CUDAAccelerator(Accelerator):
    """NVIDIA GPUs, and AMD GPUs through ROCm builds of PyTorch."""

    device_type = "cuda"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count()

    def setup_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    @property
    def name(self) -> str:
        return "rocm" if torch.version.hip else "cuda"


class MPSAccelerator(Accelerator):
    """Apple GPUs. One device; ranks on MPS talk through gloo."""

    device_type = "mps"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return torch.backends.mps.is_available()


_BY_NAME: dict[str, type[Accelerator]] = {
    "cpu": CPUAccelerator,
    "cuda": CUDAAccelerator,
    "gpu": CUDAAccelerator,
    "rocm": CUDAAccelerator,
    "mps": MPSAccelerator,
}


def select_accelerator(choice: str | Accelerator) -> Accelerator:
    """The accelerator ``choice`` names; ``"auto"`` takes the best one present."""
    if isinstance(choice, Accelerator):
        return choice
    if choice == "auto":
        for auto in (CUDAAccelerator, MPSAccelerator, CPUAccelerator):
            if auto.is_available():
                return auto()
    if choice not in _BY_NAME:
        raise invalid_choice("accelerator", choice, ACCELERATOR_NAMES)
    kind: type[Accelerator] = _BY_NAME[choice]
    if not kind.is_available():
        present = [n for n, k in _BY_NAME.items() if k.is_available()]
        raise TrainerError(
            f"accelerator={choice!r} was asked for but no such device is available "
            f"to this process; available here: {', '.join(present)}"
        )
    return kind()


def resolve_device(
    accelerator: Accelerator,
    devices: int | str | Sequence[int],
    env: ClusterEnvironment,
) -> torch.device:
    """The one device this process computes on.

    The Trainer never starts processes: a job with several devices per node
    runs one process per device (``gpulayer run --procs-per-node N`` or
    torchrun), and each takes the device its ``LOCAL_RANK`` points at.
    """
    procs = env.local_world_size
    if devices == "auto":
        index = env.local_rank
    elif isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise TrainerError(f"devices={devices!r} must be at least 1, or 'auto'")
        if devices != procs:
            raise TrainerError(
                f"devices={devices} but this node runs {procs} process(es) "
                f"(LOCAL_WORLD_SIZE); the Trainer uses one device per process, so "
                f"launch {devices} processes per node (gpulayer run --procs-per-node "
                f"{devices}, or torchrun --nproc-per-node {devices}) or pass "
                f"devices='auto'"
            )
        index = env.local_rank
    elif isinstance(devices, Sequence) and not isinstance(devices, str):
        indices = list(devices)
        if len(indices) != procs or not all(isinstance(i, int) for i in indices):
            raise TrainerError(
                f"devices={indices!r} must list one device index per process on this "
                f"node ({procs} process(es), LOCAL_WORLD_SIZE)"
            )
        index = indices[env.local_rank]
    else:
        raise TrainerError(
            f"devices={devices!r} is not supported; valid values: 'auto', a positive "
            f"int, or a list of device indices"
        )
    count = accelerator.device_count()
    if accelerator.device_type != "cpu" and not 0 <= index < count:
        raise TrainerError(
            f"device index {index} (devices={devices!r}, LOCAL_RANK={env.local_rank}) "
            f"is out of range: this process sees {count} {accelerator.name} device(s)"
        )
    return accelerator.device(index)
