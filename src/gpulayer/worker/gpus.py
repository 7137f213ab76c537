"""Find the machine's GPUs and build the env that shows a task exactly its own.

Detection asks, in order:

1. NVIDIA through NVML (``pynvml``, from nvidia-ml-py), else ``nvidia-smi``
   (CSV);
2. AMD through ``amd-smi`` (JSON), else ``rocm-smi`` (JSON).

Any failure (tool missing, non-zero exit, timeout, output it cannot parse)
means "no GPUs of that vendor", logged at debug level, never an exception: a
machine without drivers is a CPU worker, not an error. Detection reports the
physical GPUs; an inherited ``CUDA_VISIBLE_DEVICES`` is the caller's business.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import msgspec

from ..errors import WorkerError

logger = logging.getLogger(__name__)

Vendor = Literal["nvidia", "amd"]

# How long one query tool may run. nvidia-smi answers in well under a second
# on a healthy machine; one stuck on a wedged driver must not stall start-up.
TOOL_TIMEOUT_S = 5.0

_NVIDIA_SMI_ARGS = (
    "--query-gpu=index,name,memory.total,uuid",
    "--format=csv,noheader,nounits",
)
_AMD_SMI_ARGS = ("static", "--asic", "--vram", "--json")
_ROCM_SMI_ARGS = ("--showproductname", "--showmeminfo", "vram", "--json")
_MIB = 1024 * 1024


class Gpu(msgspec.Struct, frozen=True):
    """One physical GPU as the worker offers it."""

    index: int  # what goes in CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES
    vendor: Vendor
    name: str
    memory_mb: int | None = None  # MiB
    uuid: str | None = None


class _Unusable(Exception):
    """A tool's answer cannot be used; the message says why."""


def detect_gpus(*, timeout: float = TOOL_TIMEOUT_S) -> list[Gpu]:
    """The machine's NVIDIA GPUs, then its AMD GPUs; ``[]`` on a CPU-only machine."""
    nvidia = _first_answer(
        "nvidia", [("NVML", _from_nvml), ("nvidia-smi", _from_nvidia_smi)], timeout
    )
    amd = _first_answer("amd", [("amd-smi", _from_amd_smi), ("rocm-smi", _from_rocm_smi)], timeout)
    return nvidia + amd


_VENDORS: tuple[Vendor, ...] = ("nvidia", "amd")
GPUS_HELP = "'all', 'none', a vendor ('nvidia', 'amd'), or GPU indexes such as 0,2 or nvidia:0,2"


def select_gpus(found: Sequence[Gpu], wanted: str) -> list[Gpu]:
    """The GPUs a worker offers, as ``--gpus`` says.

    ``all``; ``none``; a vendor (``nvidia``, ``amd``: all of its GPUs); or
    indexes, as ``nvidia-smi`` or ``amd-smi`` number them (``0,2``), with the
    vendor first (``nvidia:0,2``) where the machine has both. Raises
    ``ValueError`` naming what is wrong: a malformed list, an index given
    twice, one this machine does not have, or one that two vendors share.
    """
    text = wanted.strip().lower()
    if text in ("all", "none"):
        return list(found) if text == "all" else []
    vendor, colon, listed = text.rpartition(":")
    if not colon and text in _VENDORS:
        vendor, listed = text, ""
    if (vendor and vendor not in _VENDORS) or (colon and not (vendor and listed)):
        raise ValueError(f"--gpus takes {GPUS_HELP}; got {wanted!r}")
    mine = [g for g in found if not vendor or g.vendor == vendor]
    if vendor and not listed:
        if not mine:
            raise ValueError(f"--gpus {wanted}: this machine has no {vendor} GPU ({_have(found)})")
        return mine
    try:
        indexes = [int(part) for part in listed.split(",")]
    except ValueError:
        raise ValueError(f"--gpus takes {GPUS_HELP}; got {wanted!r}") from None
    if len(set(indexes)) != len(indexes):
        raise ValueError(f"--gpus lists a GPU twice: {wanted!r}")
    if len({g.vendor for g in mine}) > 1:
        raise ValueError(
            f"--gpus {wanted}: this machine has NVIDIA and AMD GPUs, numbered apart; "
            f"say which, such as nvidia:{listed}"
        )
    by_index = {g.index: g for g in mine}
    missing = [i for i in indexes if i not in by_index]
    if missing:
        raise ValueError(
            f"--gpus {wanted}: this machine has no {vendor + ' ' if vendor else ''}GPU "
            f"{', '.join(map(str, missing))} ({_have(found)})"
        )
    return [by_index[i] for i in indexes]


def gpus_option(gpus: Sequence[Gpu]) -> str:
    """What ``--gpus`` says to offer exactly ``gpus`` (of one vendor)."""
    if not gpus:
        return "none"
    return f"{gpus[0].vendor}:{','.join(str(g.index) for g in gpus)}"


def _have(found: Sequence[Gpu]) -> str:
    if not found:
        return "it has none"
    return "its GPUs: " + ", ".join(f"{g.vendor}:{g.index}" for g in found)


def share_gpus(free: Sequence[Gpu], count: int) -> list[list[Gpu]]:
    """Split ``free`` among ``count`` workers started together, none offered twice.

    Round-robin (with 4 GPUs and 2 workers: 0 and 2, 1 and 3); a worker left
    without a GPU is a CPU worker. A worker drives one vendor, so GPUs of two
    vendors are refused (``WorkerError``): start those workers one vendor each.
    """
    if len({g.vendor for g in free}) > 1:
        raise WorkerError(MIXED_VENDORS)
    return [list(free[i::count]) for i in range(count)]


MIXED_VENDORS = (
    "this machine has NVIDIA and AMD GPUs, and a worker drives one vendor: start one "
    "worker per vendor (gpulayer worker start --gpus nvidia, and --gpus amd; in Python, "
    "Worker(gpus=...))"
)


def visible_devices_env(vendor: Vendor | None, indexes: Sequence[int]) -> dict[str, str]:
    """Env vars that let a task see exactly the GPUs ``indexes`` of ``vendor``.

    Every vendor the task was not given is hidden, including on a CPU worker
    (``vendor=None``): a driver the worker did not detect, or a GPU it did not
    offer, must not be grabbed by a job. Merge the result over the task's env.
    """
    if vendor is None and indexes:
        raise ValueError(f"GPU indexes {list(indexes)} given without a vendor")
    if any(i < 0 for i in indexes):
        raise ValueError(f"GPU indexes must be >= 0, got {list(indexes)}")
    # CUDA_VISIBLE_DEVICES="" hides every NVIDIA GPU (documented by CUDA).
    env = {"CUDA_VISIBLE_DEVICES": ""}
    # HIP treats an empty HIP_VISIBLE_DEVICES as unset (ROCm/hip#3001), so AMD
    # GPUs are hidden one layer down: ROCr exposes none when
    # ROCR_VISIBLE_DEVICES is set but empty. HIP_VISIBLE_DEVICES=-1 (an
    # invalid first index ends the list) hides them from HIP as well, and
    # keeps tools that only read the HIP variable from counting GPUs.
    env |= {"ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "-1"}
    if not indexes:
        return env
    listed = ",".join(str(i) for i in indexes)
    if vendor == "nvidia":
        # CUDA numbers GPUs fastest first unless told otherwise; NVML and
        # nvidia-smi number them by PCI bus. Make the indexes mean the same.
        env |= {"CUDA_VISIBLE_DEVICES": listed, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    else:
        # Only HIP_VISIBLE_DEVICES carries the list. ROCr applies its own
        # variable first and HIP then indexes what is left, so the same
        # physical list in both would point HIP at the wrong GPUs (or none);
        # ROCR_VISIBLE_DEVICES is dropped here rather than set.
        del env["ROCR_VISIBLE_DEVICES"]
        env["HIP_VISIBLE_DEVICES"] = listed
    return env


_Source = Callable[[float], list[Gpu]]


def _first_answer(vendor: Vendor, sources: list[tuple[str, _Source]], timeout: float) -> list[Gpu]:
    """The GPUs from the first source that answers; ``[]`` when none does."""
    for label, source in sources:
        try:
            gpus = source(timeout)
        except _Unusable as e:
            logger.debug("no %s GPUs from %s: %s", vendor, label, e)
            continue
        logger.debug("%d %s GPU(s) from %s", len(gpus), vendor, label)
        return gpus
    return []


# The module used as NVML's bindings instead of ``pynvml`` (nvidia-ml-py): for
# tests (tests/fake_nvml.py), which give a worker process GPUs and figures
# that way. Unset: ``pynvml``.
NVML_MODULE_ENV = "GPULAYER_NVML_MODULE"


def load_nvml() -> Any:
    """NVML's Python bindings, not yet initialised; ImportError if absent."""
    name = os.environ.get(NVML_MODULE_ENV) or "pynvml"
    with warnings.catch_warnings():
        # The old "pynvml" wheel warns on import that it is deprecated.
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


# The module used as AMD SMI's bindings instead of ``amdsmi`` (ROCm's): for
# tests (tests/fake_amdsmi.py), as NVML_MODULE_ENV. Unset: ``amdsmi``.
AMDSMI_MODULE_ENV = "GPULAYER_AMDSMI_MODULE"


def load_amdsmi() -> Any:
    """AMD SMI's Python bindings, not yet initialised. Raises ImportError if
    absent, or another error where ROCm's library is broken (amdsmi raises
    OSError or KeyError on import when libamd_smi.so is missing or mismatched)."""
    name = os.environ.get(AMDSMI_MODULE_ENV) or "amdsmi"
    # It prints on import where libamd_smi.so cannot be loaded: not for our stdout.
    with contextlib.redirect_stdout(io.StringIO()):
        return importlib.import_module(name)


def _from_nvml(timeout: float) -> list[Gpu]:
    del timeout  # NVML is a library call, not a process
    try:
        nvml = load_nvml()
    except ImportError as e:
        raise _Unusable(f"cannot import NVML's bindings: {e}") from e
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError and friends: no driver, no library
        raise _Unusable(f"nvmlInit failed: {e}") from e
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                Gpu(
                    index=i,
                    vendor="nvidia",
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_mb=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // _MIB,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                )
            )
        return gpus
    except Exception as e:
        raise _Unusable(f"NVML query failed: {e}") from e
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _from_nvidia_smi(timeout: float) -> list[Gpu]:
    gpus = []
    for line in _run("nvidia-smi", _NVIDIA_SMI_ARGS, timeout).splitlines():
        if not line.strip():
            continue
        # index, name, memory.total, uuid; split the ends off so that a comma
        # in a product name cannot shift the columns.
        first, _, rest = line.partition(",")
        middle, memory, uuid = _rsplit3(rest, line)
        gpus.append(
            Gpu(
                index=_int(first, line),
                vendor="nvidia",
                name=middle.strip(),
                memory_mb=_int_or_none(memory),  # "[N/A]" on some boards
                uuid=uuid.strip() or None,
            )
        )
    return gpus


def _from_amd_smi(timeout: float) -> list[Gpu]:
    data = _json(_run("amd-smi", _AMD_SMI_ARGS, timeout))
    # A bare list up to ROCm 6.3, {"gpu_data": [...]} since.
    entries = data.get("gpu_data") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise _Unusable("no list of GPUs in the JSON")
    gpus = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise _Unusable(f"unexpected entry {str(entry)[:80]!r}")
        if "gpu" not in entry:  # a CPU on an APU machine
            continue
        asic = entry.get("asic")
        name = asic.get("market_name") if isinstance(asic, dict) else None
        gpus.append(
            Gpu(
                index=_int(entry["gpu"], "gpu"),
                vendor="amd",
                name=name if isinstance(name, str) and name != "N/A" else "AMD GPU",
                memory_mb=_amd_vram_mb(entry.get("vram")),
                uuid=entry.get("uuid") if isinstance(entry.get("uuid"), str) else None,
            )
        )
    return sorted(gpus, key=lambda g: g.index)


def _from_rocm_smi(timeout: float) -> list[Gpu]:
    data = _json(_run("rocm-smi", _ROCM_SMI_ARGS, timeout))
    if not isinstance(data, dict):
        raise _Unusable("JSON is not an object")
    gpus = []
    for key, fields in data.items():
        if not key.startswith("card"):  # e.g. a "system" section
            continue
        if not isinstance(fields, dict):
            raise _Unusable(f"{key} is not an object")
        # Key case changed across releases ("Card series" / "Card Series").
        lower = {str(k).lower(): v for k, v in fields.items()}
        name = lower.get("card series") or lower.get("card model") or "AMD GPU"
        total = _int_or_none(lower.get("vram total memory (b)"))
        gpus.append(
            Gpu(
                index=_int(key.removeprefix("card"), key),
                vendor="amd",
                name=str(name),
                memory_mb=None if total is None else total // _MIB,
            )
        )
    return sorted(gpus, key=lambda g: g.index)


def _run(tool: str, args: Sequence[str], timeout: float) -> str:
    """The tool's stdout; ``_Unusable`` if it is missing, fails or hangs."""
    path = shutil.which(tool)
    if path is None:
        raise _Unusable(f"{tool} is not on PATH")
    try:
        proc = subprocess.Popen(
            [path, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so a timeout can kill whatever it started
        )
    except OSError as e:
        raise _Unusable(f"cannot run {path}: {e}") from e
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        # A tool stuck in the kernel may not even die; do not wait on it forever.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        raise _Unusable(f"{tool} did not answer within {timeout:g} s") from e
    finally:
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-200:]
        raise _Unusable(f"{tool} exited with {proc.returncode}: {tail}")
    return out.decode(errors="replace")


def _json(text: str) -> Any:
    """Parse JSON, skipping any warning lines a tool prints before it."""
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        raise _Unusable(f"no JSON in output {text[:80]!r}")
    try:
        return json.JSONDecoder().raw_decode(text, start)[0]
    except ValueError as e:
        raise _Unusable(f"unparsable JSON: {e}") from e


def _amd_vram_mb(vram: Any) -> int | None:
    """VRAM size from amd-smi, whose shape varies by release."""
    if not isinstance(vram, dict):
        return None
    if "vram_size_mb" in vram:  # early releases
        return _int_or_none(vram["vram_size_mb"])
    size = vram.get("size")
    if isinstance(size, dict):  # {"value": 65536, "unit": "MB"}
        value, unit = size.get("value"), size.get("unit", "MB")
    elif isinstance(size, str) and " " in size:  # "65536 MB"
        value, unit = size.split(maxsplit=1)
    else:
        value, unit = size, "MB"
    mb = _int_or_none(value)
    scale = {"B": 1 / _MIB, "KB": 1 / 1024, "MB": 1, "GB": 1024}.get(str(unit).upper())
    return None if mb is None or scale is None else int(mb * scale)


def _rsplit3(rest: str, line: str) -> list[str]:
    parts = rest.rsplit(",", 2)
    if len(parts) != 3:
        raise _Unusable(f"expected 4 columns in {line!r}")
    return parts


def _int(value: Any, what: str) -> int:
    number = _int_or_none(value)
    if number is None:
        raise _Unusable(f"no integer index in {what!r}")
    return number


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def _text(value: str | bytes) -> str:
    # pynvml returned bytes before nvidia-ml-py 11.515.
    return value.decode() if isinstance(value, bytes) else value
