"""GPU telemetry: each GPU's figures, read every few seconds on a thread.

A worker offering GPUs opens a :class:`Sampler` as it starts serving; its
heartbeats carry the latest figures (:class:`~gpulayer.jobs.GpuStats`) to the
control plane, which keeps an hour of them (``service/state.py``), exports
them on ``/metrics`` and shows them in ``gpulayer workers`` and the dashboard.

Mechanisms, one :class:`Reader` per vendor (a library initialised once, its
handles taken once), all read by the one sampler thread:

1. NVIDIA: NVML through ``pynvml`` (nvidia-ml-py); a sample is five library
   calls per GPU (:class:`NvmlReader`).
2. AMD: AMD SMI through ``amdsmi``, the Python bindings ROCm ships (the
   library the ``amd-smi`` command is built on), not a process per sample;
   four or five library calls per GPU (``telemetry_amd.py``).

Telemetry never stands in a job's way: sampling runs on its own thread (a
driver that hangs stalls it, not the heartbeats, which send the latest
sample they have), and any failure means no figures (for that vendor's
GPUs), said once in the worker's log, never an error. A figure outside what
a GPU can report (NaN, negative, absurd) is dropped, so that no heartbeat is
refused for it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..jobs import GpuStats
from .gpus import Gpu, load_nvml

log = logging.getLogger(__name__)

# How often a GPU's figures are read; heartbeats send the latest one.
SAMPLE_INTERVAL_S = 5.0
# The bounds GpuStats puts on each figure: one outside them is dropped here.
_MAX_BYTES = 2**60
_NAME_MAX, _UUID_MAX = 256, 128


class Reader(Protocol):
    """One vendor's library, initialised, with a handle for each GPU it reads."""

    def describe(self) -> str:
        """What it reads with, for the log: ``NVML (pynvml), 2 GPU(s)``."""
        ...

    def sample(self) -> list[GpuStats]:
        """Each GPU's figures now (a figure the library would not give is None)."""
        ...

    def close(self) -> None:
        """Shut the library down; never raises."""
        ...


class NvmlReader:
    """NVML's figures for ``gpus``.

    ``nvml``: the bindings, initialised; raises where NVML has no handle for
    one of ``gpus``."""

    def __init__(self, nvml: Any, gpus: Sequence[Gpu]):
        self._nvml = nvml
        self._sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        # (index, handle, uuid, name); NVML's uuid and name, else detection's.
        self._gpus: list[tuple[int, Any, str | None, str | None]] = []
        for gpu in gpus:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)  # raises if it has none
            uuid = _text(_read(nvml.nvmlDeviceGetUUID, handle) or gpu.uuid, _UUID_MAX)
            name = _text(_read(nvml.nvmlDeviceGetName, handle) or gpu.name, _NAME_MAX)
            self._gpus.append((gpu.index, handle, uuid, name))

    def describe(self) -> str:
        return f"NVML ({getattr(self._nvml, '__name__', 'pynvml')}), {len(self._gpus)} GPU(s)"

    def sample(self) -> list[GpuStats]:
        nvml = self._nvml
        found = []
        for index, handle, uuid, name in self._gpus:
            rates = _read(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = _read(nvml.nvmlDeviceGetMemoryInfo, handle)
            milliwatts = _read(nvml.nvmlDeviceGetPowerUsage, handle)
            found.append(
                GpuStats(
                    index=index,
                    uuid=uuid,
                    name=name,
                    utilization=_within(getattr(rates, "gpu", None), 0, 100),
                    memory_used=_count(getattr(memory, "used", None)),
                    memory_total=_count(getattr(memory, "total", None)),
                    temperature=_within(
                        _read(nvml.nvmlDeviceGetTemperature, handle, self._sensor), -100, 300
                    ),
                    power=_within(_milli(milliwatts), 0, 100_000),
                )
            )
        return found

    def close(self) -> None:
        _read(self._nvml.nvmlShutdown)


class Sampler:
    """Reads each of ``readers`` every ``interval`` seconds, on a thread of
    its own; stopping closes them (see :func:`open_sampler`)."""

    def __init__(self, readers: Sequence[Reader], interval: float = SAMPLE_INTERVAL_S):
        self.readers = list(readers)
        self.interval = interval
        self._latest: list[GpuStats] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.ready = threading.Event()  # set once the first sample is in
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpulayer-telemetry", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():  # else a library is in use still
            for reader in self.readers:
                reader.close()

    def latest(self) -> list[GpuStats]:
        """The last sample's figures, one per GPU; ``[]`` before the first."""
        with self._lock:
            return self._latest

    def sample(self) -> list[GpuStats]:
        """Each GPU's figures now, every reader's in turn."""
        return [stats for reader in self.readers for stats in reader.sample()]

    def _run(self) -> None:
        while True:
            try:
                figures = self.sample()
            except Exception:  # a bug, not a GPU's answer (each read is guarded)
                log.exception("GPU telemetry: sampling failed; no figures from now on")
                figures = []
                self._stopping.set()
            with self._lock:
                self._latest = figures
            self.ready.set()
            if self._stopping.wait(self.interval):
                return


def open_sampler(
    gpus: Sequence[Gpu],
    *,
    interval: float = SAMPLE_INTERVAL_S,
    nvml: Any = None,
    amdsmi: Any = None,
) -> Sampler | None:
    """A started sampler of ``gpus``, or None where none can read them (no
    GPUs; the vendor's bindings absent or failing). Says which, once, in the
    log. Where a worker has GPUs of both vendors and one vendor's library
    fails, the other's GPUs are sampled still.

    ``nvml``, ``amdsmi``: the bindings to use (not yet initialised), instead
    of :func:`~gpulayer.worker.gpus.load_nvml`'s (``pynvml``, or the module
    ``GPULAYER_NVML_MODULE`` names) and
    :func:`~gpulayer.worker.gpus.load_amdsmi`'s (``amdsmi``, or
    ``GPULAYER_AMDSMI_MODULE``'s)."""
    if not gpus:
        return None
    readers: list[Reader] = []
    nvidia = [g for g in gpus if g.vendor == "nvidia"]
    amd = [g for g in gpus if g.vendor == "amd"]
    if nvidia and (reader := _open_nvml(nvidia, nvml)) is not None:
        readers.append(reader)
    if amd:
        # Imported here: telemetry_amd uses this module's helpers.
        from .telemetry_amd import open_amdsmi

        if (amd_reader := open_amdsmi(amd, amdsmi)) is not None:
            readers.append(amd_reader)
    if not readers:
        return None
    sampler = Sampler(readers, interval)
    sampler.start()
    said = " and ".join(reader.describe() for reader in readers)
    log.info("GPU telemetry: %s every %g s", said, interval)
    return sampler


def _open_nvml(gpus: Sequence[Gpu], nvml: Any) -> NvmlReader | None:
    try:
        bindings = load_nvml() if nvml is None else nvml
    except ImportError as exc:
        log.info("GPU telemetry: off: NVML's bindings cannot be imported (%s)", exc)
        return None
    try:
        bindings.nvmlInit()
    except Exception as exc:  # NVMLError: no driver, no library
        log.info("GPU telemetry: off: NVML did not start (%s)", exc)
        return None
    try:
        return NvmlReader(bindings, gpus)
    except Exception as exc:  # a GPU detection found that NVML does not know
        _read(bindings.nvmlShutdown)
        log.info("GPU telemetry: off: NVML has no handle for every GPU offered (%s)", exc)
        return None


def _read(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None where it fails (NVMLError_NotSupported,
    AmdSmiLibraryException, a GPU fallen off the bus): that figure is
    missing from this sample."""
    try:
        return call(*args)
    except Exception:
        return None


def _within(value: Any, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and low <= number <= high else None


def _milli(value: Any) -> Any:
    return value / 1000 if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= _MAX_BYTES else None


def _text(value: Any, limit: int) -> str | None:
    if isinstance(value, bytes):  # pynvml before nvidia-ml-py 11.515
        value = value.decode(errors="replace")
    return value[:limit] if isinstance(value, str) else None
