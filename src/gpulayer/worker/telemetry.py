"""GPU telemetry: each GPU's figures, read every few seconds on a thread.

A worker offering GPUs opens a :class:`Sampler` as it starts serving; its
heartbeats carry the latest figures (:class:`~gpulayer.jobs.GpuStats`) to the
control plane, which keeps an hour of them (``service/state.py``), exports
them on ``/metrics`` and shows them in ``gpulayer workers`` and the dashboard.

Mechanisms:

1. NVIDIA: NVML through ``pynvml`` (nvidia-ml-py), initialised once, its
   handles taken once; a sample is five library calls per GPU.
2. AMD: none yet. ``amd-smi metric --json`` has the figures, but as a
   process started for each sample (about a second of CPU) in a JSON shape
   that changed across ROCm releases; a worker offering AMD GPUs says so
   once and sends none.

Telemetry never stands in a job's way: sampling runs on its own thread (a
driver that hangs stalls it, not the heartbeats, which send the latest
sample they have), and any failure means no figures, said once in the
worker's log, never an error. A figure outside what a GPU can report (NaN,
negative, absurd) is dropped, so that no heartbeat is refused for it.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..jobs import GpuStats
from .gpus import Gpu, load_nvml

log = logging.getLogger(__name__)

# How often a GPU's figures are read; heartbeats send the latest one.
SAMPLE_INTERVAL_S = 5.0
# The bounds GpuStats puts on each figure: one outside them is dropped here.
_MAX_BYTES = 2**60
_NAME_MAX, _UUID_MAX = 256, 128


class Sampler:
    """Reads NVML's figures for ``gpus`` every ``interval`` seconds.

    ``nvml``: the bindings, initialised (see :func:`open_sampler`); the
    sampler shuts them down as it stops."""

    def __init__(self, nvml: Any, gpus: Sequence[Gpu], interval: float = SAMPLE_INTERVAL_S):
        self._nvml = nvml
        self.interval = interval
        self._sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        # (index, handle, uuid, name); NVML's uuid and name, else detection's.
        self._gpus: list[tuple[int, Any, str | None, str | None]] = []
        for gpu in gpus:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)  # raises if it has none
            uuid = _text(_read(nvml.nvmlDeviceGetUUID, handle) or gpu.uuid, _UUID_MAX)
            name = _text(_read(nvml.nvmlDeviceGetName, handle) or gpu.name, _NAME_MAX)
            self._gpus.append((gpu.index, handle, uuid, name))
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
        if self._thread is None or not self._thread.is_alive():  # else NVML is in use still
            _read(self._nvml.nvmlShutdown)

    def latest(self) -> list[GpuStats]:
        """The last sample's figures, one per GPU; ``[]`` before the first."""
        with self._lock:
            return self._latest

    def sample(self) -> list[GpuStats]:
        """Each GPU's figures now (a figure NVML would not give is None)."""
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
                    power=_within(None if milliwatts is None else milliwatts / 1000, 0, 100_000),
                )
            )
        return found

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
    gpus: Sequence[Gpu], *, interval: float = SAMPLE_INTERVAL_S, nvml: Any = None
) -> Sampler | None:
    """A started sampler of ``gpus``, or None where none can read them (no
    GPUs, AMD's, NVML absent or failing). Says which, once, in the log.

    ``nvml``: the bindings to use (not yet initialised), instead of
    :func:`~gpulayer.worker.gpus.load_nvml`'s (``pynvml``, or the module
    ``GPULAYER_NVML_MODULE`` names)."""
    if not gpus:
        return None
    if any(g.vendor != "nvidia" for g in gpus):
        log.info("GPU telemetry: off: figures from AMD GPUs (amd-smi) are not collected yet")
        return None
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
        sampler = Sampler(bindings, gpus, interval)
    except Exception as exc:  # a GPU detection found that NVML does not know
        _read(bindings.nvmlShutdown)
        log.info("GPU telemetry: off: NVML has no handle for every GPU offered (%s)", exc)
        return None
    sampler.start()
    log.info(
        "GPU telemetry: NVML (%s), %d GPU(s) every %g s",
        getattr(bindings, "__name__", "pynvml"),
        len(gpus),
        interval,
    )
    return sampler


def _read(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None where it fails (NVMLError_NotSupported, a
    GPU fallen off the bus): that figure is missing from this sample."""
    try:
        return call(*args)
    except Exception:
        return None


def _within(value: Any, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and low <= number <= high else None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= _MAX_BYTES else None


def _text(value: Any, limit: int) -> str | None:
    if isinstance(value, bytes):  # pynvml before nvidia-ml-py 11.515
        value = value.decode(errors="replace")
    return value[:limit] if isinstance(value, str) else None
