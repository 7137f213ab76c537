"""A fake AMD SMI: the part of ROCm's ``amdsmi`` Python bindings that
GPUlayer calls (``src/gpulayer/worker/telemetry_amd.py``).

Two ways in, as ``fake_nvml``:

- in one process, a :class:`FakeAmdSmi` given to the code under test
  (``open_sampler(gpus, amdsmi=FakeAmdSmi(...))``);
- in a worker, this module as AMD SMI's bindings:
  ``GPULAYER_AMDSMI_MODULE=fake_amdsmi`` with ``tests/`` on the path. Its
  GPUs are then those of the JSON file ``FAKE_AMDSMI_GPUS`` names (a list of
  :class:`FakeGpu` fields), else :data:`DEFAULT_GPUS`, read as the library
  is initialised (so a test may write the file after this module is imported).

Shapes imitate ROCm 6.2's bindings (``py-interface/amdsmi_interface.py`` and
``amdsmi_exception.py`` at tag ``rocm-6.2.0`` of github.com/ROCm/amdsmi):
dicts from ``amdsmi_get_gpu_activity`` (``gfx_activity``, ``umc_activity``,
``mm_activity``), ``amdsmi_get_gpu_vram_usage`` (``vram_total``,
``vram_used``, in MiB), ``amdsmi_get_power_info`` (``current_socket_power``,
``average_socket_power``, voltages, ``power_limit``, in W) and
``amdsmi_get_gpu_asic_info`` (``market_name`` and more), with ``"N/A"`` for
what the GPU does not report; a bare int from ``amdsmi_get_temp_metric``
(°C) and a str from ``amdsmi_get_gpu_device_uuid``; handles that the calls
check the type of; ``AmdSmiLibraryException(err_code)`` for a library error.
Other releases' shapes (``socket_power`` since 6.4, ``{"value", "unit"}``
dicts, raw 0xFFFF) are given through :attr:`FakeGpu.power_info` and raw
figures.

A figure set to None is what a GPU without it gives: "N/A" in a dict, an
``AMDSMI_STATUS_NOT_SUPPORTED`` exception for a bare value. Any other value
is returned as given (a hostile or broken library's NaN, negative or huge
numbers, wrong types included). A call named in :attr:`FakeGpu.fail`
raises ``AMDSMI_STATUS_API_FAILED`` for that GPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any

FILE_ENV = "FAKE_AMDSMI_GPUS"

# amdsmi_wrapper's status codes (rocm-6.2.0).
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_API_FAILED = 7
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34
_STATUS = {
    AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    AMDSMI_STATUS_API_FAILED: "AMDSMI_STATUS_API_FAILED - API call failed",
    AMDSMI_STATUS_NOT_INIT: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    AMDSMI_STATUS_DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded",
}


class AmdSmiException(Exception):
    """Base smi exception class"""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _STATUS.get(err_code, "unknown error")

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"


class AmdSmiParameterException(AmdSmiException):
    pass


class AmdSmiInitFlags(IntEnum):
    INIT_AMD_GPUS = 2


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0


@dataclass
class FakeGpu:
    market_name: Any = "AMD Instinct MI300X"
    uuid: Any = "28ff74a1-0000-1000-80e9-b6a6d4a93e0c"
    gfx_activity: Any = 42  # %
    vram_total: Any = 196592  # MiB
    vram_used: Any = 24576
    edge: Any = None  # °C; MI300X has no edge sensor
    hotspot: Any = 48
    power: Any = 350  # W, as current_socket_power (MI300); average_socket_power "N/A"
    power_info: Any = None  # amdsmi_get_power_info's answer as given, instead of power's
    fail: list[str] = field(default_factory=list)  # calls that raise for this GPU


DEFAULT_GPUS = [
    FakeGpu(uuid="28ff74a1-0000-1000-80e9-b6a6d4a90000", gfx_activity=42),
    FakeGpu(uuid="28ff74a1-0000-1000-80e9-b6a6d4a90001", gfx_activity=87, hotspot=71),
]


class FakeHandle:
    """Stands for amdsmi_wrapper.amdsmi_processor_handle (a ctypes pointer)."""

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu


@dataclass
class FakeAmdSmi:
    gpus: list[FakeGpu] = field(default_factory=lambda: list(DEFAULT_GPUS))
    init_error: bool = False  # amdsmi_init fails, as on a machine without the amdgpu driver
    inits: int = 0
    calls: int = 0  # figure reads, to tell that sampling happens
    from_env: bool = False  # (re)read FAKE_AMDSMI_GPUS as it is initialised
    AmdSmiException: type[AmdSmiException] = AmdSmiException
    AmdSmiLibraryException: type[AmdSmiLibraryException] = AmdSmiLibraryException
    AmdSmiInitFlags: type[AmdSmiInitFlags] = AmdSmiInitFlags
    AmdSmiTemperatureType: type[AmdSmiTemperatureType] = AmdSmiTemperatureType
    AmdSmiTemperatureMetric: type[AmdSmiTemperatureMetric] = AmdSmiTemperatureMetric
    _handles: list[FakeHandle] = field(default_factory=list, init=False, repr=False)

    @staticmethod
    def write(path: str | os.PathLike[str], gpus: list[FakeGpu]) -> None:
        """Write ``gpus`` where a worker's FAKE_AMDSMI_GPUS will read them."""
        with open(path, "w") as f:
            json.dump([asdict(g) for g in gpus], f)

    def amdsmi_init(self, flag: Any = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        if not isinstance(flag, AmdSmiInitFlags):
            raise AmdSmiParameterException(flag)
        if self.init_error:
            raise AmdSmiLibraryException(AMDSMI_STATUS_DRIVER_NOT_LOADED)
        if self.from_env and self.inits == 0:
            path = os.environ.get(FILE_ENV)
            if path:
                with open(path) as f:
                    self.gpus = [FakeGpu(**fields) for fields in json.load(f)]
            else:
                self.gpus = list(DEFAULT_GPUS)
        if self.inits == 0:
            self._handles = [FakeHandle(g) for g in self.gpus]
        self.inits += 1

    def amdsmi_shut_down(self) -> None:
        self._check()
        self.inits -= 1

    def amdsmi_get_processor_handles(self) -> list[FakeHandle]:
        self._check()
        return list(self._handles)

    def amdsmi_get_gpu_device_uuid(self, handle: FakeHandle) -> Any:
        return _bare(self._gpu(handle, "amdsmi_get_gpu_device_uuid").uuid)

    def amdsmi_get_gpu_asic_info(self, handle: FakeHandle) -> dict[str, Any]:
        gpu = self._gpu(handle, "amdsmi_get_gpu_asic_info")
        return {
            "market_name": _na(gpu.market_name),
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": "0x74a1",
            "rev_id": "0x00",
            "asic_serial": "0x5D5D0F7A2B3C4E1F",
            "oam_id": 0,
            "num_compute_units": 304,
            "target_graphics_version": "gfx942",
        }

    def amdsmi_get_gpu_activity(self, handle: FakeHandle) -> dict[str, Any]:
        gpu = self._gpu(handle, "amdsmi_get_gpu_activity")
        return {"gfx_activity": _na(gpu.gfx_activity), "umc_activity": 3, "mm_activity": "N/A"}

    def amdsmi_get_gpu_vram_usage(self, handle: FakeHandle) -> dict[str, Any]:
        gpu = self._gpu(handle, "amdsmi_get_gpu_vram_usage")
        return {"vram_total": gpu.vram_total, "vram_used": gpu.vram_used}

    def amdsmi_get_temp_metric(
        self,
        handle: FakeHandle,
        sensor_type: Any,
        metric: Any,
    ) -> Any:
        if not isinstance(sensor_type, AmdSmiTemperatureType):
            raise AmdSmiParameterException(sensor_type)
        if not isinstance(metric, AmdSmiTemperatureMetric):
            raise AmdSmiParameterException(metric)
        if metric != AmdSmiTemperatureMetric.CURRENT:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        gpu = self._gpu(handle, "amdsmi_get_temp_metric")
        return _bare(gpu.edge if sensor_type == AmdSmiTemperatureType.EDGE else gpu.hotspot)

    def amdsmi_get_power_info(self, handle: FakeHandle) -> Any:
        gpu = self._gpu(handle, "amdsmi_get_power_info")
        if gpu.power_info is not None:
            return gpu.power_info
        return {
            "current_socket_power": _na(gpu.power),
            "average_socket_power": "N/A",
            "gfx_voltage": "N/A",
            "soc_voltage": "N/A",
            "mem_voltage": "N/A",
            "power_limit": 750,
        }

    def _check(self) -> None:
        if self.inits <= 0:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)

    def _gpu(self, handle: Any, call: str) -> FakeGpu:
        self._check()
        if not isinstance(handle, FakeHandle) or handle not in self._handles:
            raise AmdSmiParameterException(handle)
        self.calls += 1
        if call in handle.gpu.fail:
            raise AmdSmiLibraryException(AMDSMI_STATUS_API_FAILED)
        return handle.gpu


def _bare(value: Any) -> Any:
    if value is None:
        raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
    return value


def _na(value: Any) -> Any:
    return "N/A" if value is None else value


# As a module in place of amdsmi: the GPUs FAKE_AMDSMI_GPUS names, read on init.
_amdsmi = FakeAmdSmi(from_env=True)
amdsmi_init = _amdsmi.amdsmi_init
amdsmi_shut_down = _amdsmi.amdsmi_shut_down
amdsmi_get_processor_handles = _amdsmi.amdsmi_get_processor_handles
amdsmi_get_gpu_device_uuid = _amdsmi.amdsmi_get_gpu_device_uuid
amdsmi_get_gpu_asic_info = _amdsmi.amdsmi_get_gpu_asic_info
amdsmi_get_gpu_activity = _amdsmi.amdsmi_get_gpu_activity
amdsmi_get_gpu_vram_usage = _amdsmi.amdsmi_get_gpu_vram_usage
amdsmi_get_temp_metric = _amdsmi.amdsmi_get_temp_metric
amdsmi_get_power_info = _amdsmi.amdsmi_get_power_info
