"""AMD GPUs' figures through AMD SMI's Python bindings (``amdsmi``, shipped
with ROCm; the library the ``amd-smi`` command is built on).

Per GPU and sample: ``amdsmi_get_gpu_activity`` (``gfx_activity``, %),
``amdsmi_get_gpu_vram_usage`` (``vram_used``, ``vram_total``, MiB),
``amdsmi_get_temp_metric`` (edge sensor, else hotspot: MI300 has no edge
sensor; °C) and ``amdsmi_get_power_info`` (W). The answers vary across
ROCm releases, and each is read for what it can give:

- a figure the GPU does not report is the string ``"N/A"`` (activity since
  6.1, power since 6.2), or the raw "not supported" value (0xFFFF,
  UINT32_MAX) where the bindings leave it unconverted (earlier), or an
  ``AmdSmiLibraryException``;
- power is ``average_socket_power`` (5.7), ``current_socket_power`` as well
  (6.0, MI300 and later) and ``socket_power`` as well (6.4 and later);
- a figure may come as ``{"value": ..., "unit": ...}``, as ``amd-smi``'s
  JSON writes them.

Which handle is which GPU: ``amdsmi_get_processor_handles()`` lists them in
``amd-smi``'s order, the order of the indexes detection found (``amd-smi
static``) and that go in ``HIP_VISIBLE_DEVICES``. A GPU whose uuid is
known is matched by uuid instead, where AMD SMI gives one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..jobs import GpuStats
from .gpus import Gpu, load_amdsmi
from .telemetry import _NAME_MAX, _UUID_MAX, _count, _read, _text, _within

log = logging.getLogger("gpulayer.worker.telemetry")  # one log for telemetry

_MIB = 1024 * 1024
# What AMD SMI's C library writes where a GPU does not report a figure;
# the bindings turn these into "N/A", but not in every release. 0xFFFF MiB
# can be VRAM in use, so memory is not read for it.
_NOT_SUPPORTED = frozenset({0xFFFF, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})
_NOT_SUPPORTED_MIB = frozenset({0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})
# Its power, by release: the first one a GPU reports is its power.
_POWER_KEYS = ("socket_power", "current_socket_power", "average_socket_power")


class AmdSmiReader:
    """AMD SMI's figures for ``gpus``.

    ``amdsmi``: the bindings, initialised; ``handles``: its
    ``amdsmi_get_processor_handles()``. Raises LookupError, saying which,
    where a GPU has no handle."""

    def __init__(self, amdsmi: Any, gpus: Sequence[Gpu], handles: Sequence[Any]):
        self._amdsmi = amdsmi
        uuids = [_uuid(_read(amdsmi.amdsmi_get_gpu_device_uuid, h)) for h in handles]
        # (index, handle, uuid, name); AMD SMI's uuid and name, else detection's.
        self._gpus: list[tuple[int, Any, str | None, str | None]] = []
        for gpu, at in zip(gpus, match_handles(gpus, uuids), strict=True):
            handle = handles[at]
            asic = _read(amdsmi.amdsmi_get_gpu_asic_info, handle)
            name = _text(_known(_field(asic, "market_name")) or gpu.name, _NAME_MAX)
            self._gpus.append((gpu.index, handle, uuids[at] or _uuid(gpu.uuid), name))
        types = getattr(amdsmi, "AmdSmiTemperatureType", None)
        self._sensors = [getattr(types, n) for n in ("EDGE", "HOTSPOT") if hasattr(types, n)]
        self._current = getattr(getattr(amdsmi, "AmdSmiTemperatureMetric", None), "CURRENT", None)

    def describe(self) -> str:
        return f"AMD SMI ({getattr(self._amdsmi, '__name__', 'amdsmi')}), {len(self._gpus)} GPU(s)"

    def sample(self) -> list[GpuStats]:
        amdsmi = self._amdsmi
        found = []
        for index, handle, uuid, name in self._gpus:
            activity = _read(amdsmi.amdsmi_get_gpu_activity, handle)
            vram = _read(amdsmi.amdsmi_get_gpu_vram_usage, handle)
            found.append(
                GpuStats(
                    index=index,
                    uuid=uuid,
                    name=name,
                    utilization=_within(_field(activity, "gfx_activity", "%"), 0, 100),
                    memory_used=_bytes(_field(vram, "vram_used", "MB", _NOT_SUPPORTED_MIB)),
                    memory_total=_bytes(_field(vram, "vram_total", "MB", _NOT_SUPPORTED_MIB)),
                    temperature=self._temperature(handle),
                    power=_power(_read(amdsmi.amdsmi_get_power_info, handle)),
                )
            )
        return found

    def close(self) -> None:
        _read(self._amdsmi.amdsmi_shut_down)

    def _temperature(self, handle: Any) -> float | None:
        if self._current is None:
            return None
        for sensor in self._sensors:
            value = _read(self._amdsmi.amdsmi_get_temp_metric, handle, sensor, self._current)
            celsius = _within(_unwrap(value), -100, 300)
            if celsius is not None:
                return celsius
        return None


def match_handles(gpus: Sequence[Gpu], uuids: Sequence[str | None]) -> list[int]:
    """Where each of ``gpus`` is in AMD SMI's list of handles, whose uuids
    (None where it gave none) are ``uuids``: by uuid where both have one,
    else at the GPU's index. LookupError, saying which, where one is not
    there, or two GPUs would share a handle."""
    keys = [_key(u) for u in uuids]
    by_uuid = {key: at for at, key in enumerate(keys) if key}
    found: list[int] = []
    for gpu in gpus:
        key = _key(gpu.uuid)
        if key and key in by_uuid:
            at = by_uuid[key]
        elif not 0 <= gpu.index < len(uuids):
            raise LookupError(
                f"AMD GPU {gpu.index}: AMD SMI lists {len(uuids)} GPU(s), none at index {gpu.index}"
            )
        elif key and keys[gpu.index]:
            raise LookupError(
                f"AMD GPU {gpu.index}: no GPU of AMD SMI's has its uuid {gpu.uuid} "
                f"(at index {gpu.index}: {uuids[gpu.index]})"
            )
        else:
            at = gpu.index
        if at in found:
            raise LookupError(f"AMD GPU {gpu.index}: AMD SMI's GPU {at} is another GPU offered")
        found.append(at)
    return found


def open_amdsmi(gpus: Sequence[Gpu], amdsmi: Any = None) -> AmdSmiReader | None:
    """A reader of ``gpus`` (AMD's), or None, said once in the log, where
    AMD SMI cannot read them. ``amdsmi``: the bindings, not yet initialised,
    instead of :func:`~gpulayer.worker.gpus.load_amdsmi`'s."""
    try:
        bindings = load_amdsmi() if amdsmi is None else amdsmi
    except Exception as exc:  # ImportError; KeyError, OSError where libamd_smi.so is broken
        log.info("GPU telemetry: off: AMD SMI's bindings (amdsmi) cannot be imported (%s)", exc)
        return None
    try:
        bindings.amdsmi_init()  # AMD GPUs only, its default
    except Exception as exc:  # AmdSmiLibraryException: no driver, no library
        log.info("GPU telemetry: off: AMD SMI did not start (%s)", exc)
        return None
    try:
        handles = list(bindings.amdsmi_get_processor_handles())
        return AmdSmiReader(bindings, gpus, handles)
    except Exception as exc:  # LookupError: a GPU detection found that AMD SMI does not know
        _read(bindings.amdsmi_shut_down)
        log.info("GPU telemetry: off: AMD SMI has no handle for every GPU offered (%s)", exc)
        return None


def _field(
    found: Any, key: str, unit: str | None = None, missing: frozenset[int] = _NOT_SUPPORTED
) -> Any:
    """``found[key]`` (a dict, as the bindings give), else its attribute;
    None where it has none, a unit other than ``unit``, or says it has none."""
    value = found.get(key) if isinstance(found, dict) else getattr(found, key, None)
    return _unwrap(value, unit, missing)


def _unwrap(value: Any, unit: str | None = None, missing: frozenset[int] = _NOT_SUPPORTED) -> Any:
    if isinstance(value, dict):  # {"value": 42, "unit": "W"}
        if unit is not None and value.get("unit", unit) != unit:
            return None
        value = value.get("value")
    return None if isinstance(value, int) and value in missing else value


def _known(value: Any) -> Any:
    """None for "N/A" (or nothing), the bindings' word for a figure not reported."""
    return None if isinstance(value, str) and value.strip().upper() in ("", "N/A") else value


def _uuid(value: Any) -> str | None:
    return _text(_known(value), _UUID_MAX)


def _key(uuid: str | None) -> str | None:
    return uuid.strip().lower() or None if uuid else None


def _bytes(mib: Any) -> int | None:
    if isinstance(mib, bool) or not isinstance(mib, int):
        return None
    return _count(mib * _MIB)


def _power(info: Any) -> float | None:
    """The first power ``info`` has, in W, passing over a 0 where another
    is more: a board reads 0 for the one it does not measure, we take it."""
    watts = [
        w for key in _POWER_KEYS if (w := _within(_field(info, key, "W"), 0, 100_000)) is not None
    ]
    return next((w for w in watts if w > 0), watts[0] if watts else None)
