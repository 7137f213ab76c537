"""A fake NVML: the part of ``pynvml`` (nvidia-ml-py) that GPUlayer calls.

Two ways in:

- in one process, a :class:`FakeNvml` given to the code under test
  (``open_sampler(gpus, nvml=FakeNvml(...))``);
- in a worker process, this module as NVML's bindings:
  ``GPULAYER_NVML_MODULE=fake_nvml`` with ``tests/`` on ``PYTHONPATH``. Its
  GPUs are then those of the JSON file ``FAKE_NVML_GPUS`` names (a list of
  :class:`FakeGpu` fields), else :data:`DEFAULT_GPUS`.

A figure set to None raises NVML's "Not Supported", as a real GPU's
missing sensor does; any other value is returned as given (a hostile or
broken driver's NaN, negative or huge numbers included).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_TEMPERATURE_GPU = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
FILE_ENV = "FAKE_NVML_GPUS"


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    name: Any = "NVIDIA Fake GPU 80GB"
    uuid: Any = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total: Any = 80 * 1024**3
    memory_used: Any = 20 * 1024**3
    utilization: Any = 42
    temperature: Any = 55
    power_mw: Any = 250_000  # NVML gives milliwatts


DEFAULT_GPUS = [
    FakeGpu(uuid="GPU-fa4e0000-0000-0000-0000-000000000000", utilization=42),
    FakeGpu(uuid="GPU-fa4e0001-0000-0000-0000-000000000001", utilization=87, temperature=71),
]


@dataclass
class FakeNvml:
    gpus: list[FakeGpu] = field(default_factory=lambda: list(DEFAULT_GPUS))
    init_error: bool = False  # nvmlInit fails, as on a machine without the driver
    inits: int = 0  # NVML counts its inits: each shutdown undoes one
    calls: int = 0  # figure reads, to tell that sampling happens
    NVML_TEMPERATURE_GPU: int = NVML_TEMPERATURE_GPU
    NVMLError: type[NVMLError] = NVMLError

    @classmethod
    def from_env(cls) -> FakeNvml:
        path = os.environ.get(FILE_ENV)
        if not path:
            return cls()
        with open(path) as f:
            return cls([FakeGpu(**fields) for fields in json.load(f)])

    @staticmethod
    def write(path: str | os.PathLike[str], gpus: list[FakeGpu]) -> None:
        """Write ``gpus`` where a worker process's FAKE_NVML_GPUS will read them."""
        with open(path, "w") as f:
            json.dump([asdict(g) for g in gpus], f)

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._check()
        self.inits -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetName(self, handle: FakeGpu) -> Any:
        return self._figure(handle.name)

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> Any:
        return self._figure(handle.uuid)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> SimpleNamespace:
        self._figure(handle.memory_total)
        return SimpleNamespace(total=handle.memory_total, used=handle.memory_used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._figure(handle.utilization), memory=0)

    def nvmlDeviceGetTemperature(self, handle: FakeGpu, sensor: int) -> Any:
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self._figure(handle.temperature)

    def nvmlDeviceGetPowerUsage(self, handle: FakeGpu) -> Any:
        return self._figure(handle.power_mw)

    def _check(self) -> None:
        if self.inits <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _figure(self, value: Any) -> Any:
        self._check()
        self.calls += 1
        if value is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return value


# As a module in place of pynvml: the GPUs FAKE_NVML_GPUS names, read on import.
_nvml = FakeNvml.from_env()
nvmlInit = _nvml.nvmlInit
nvmlShutdown = _nvml.nvmlShutdown
nvmlDeviceGetCount = _nvml.nvmlDeviceGetCount
nvmlDeviceGetHandleByIndex = _nvml.nvmlDeviceGetHandleByIndex
nvmlDeviceGetName = _nvml.nvmlDeviceGetName
nvmlDeviceGetUUID = _nvml.nvmlDeviceGetUUID
nvmlDeviceGetMemoryInfo = _nvml.nvmlDeviceGetMemoryInfo
nvmlDeviceGetUtilizationRates = _nvml.nvmlDeviceGetUtilizationRates
nvmlDeviceGetTemperature = _nvml.nvmlDeviceGetTemperature
nvmlDeviceGetPowerUsage = _nvml.nvmlDeviceGetPowerUsage
