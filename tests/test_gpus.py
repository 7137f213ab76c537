"""GPU detection against fake nvidia-smi / amd-smi / rocm-smi executables.

Each fake is a small script on a PATH that holds nothing else, so the real
tools of a GPU machine never leak in; NVML is blocked (or faked) through
``sys.modules``. Sample outputs follow the real tools' formats.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from gpulayer.errors import GPUlayerError, WorkerError
from gpulayer.worker.gpulocks import claim_gpus, unclaimed
from gpulayer.worker.gpus import (
    GPUS_HELP,
    Gpu,
    detect_gpus,
    gpus_option,
    select_gpus,
    share_gpus,
    visible_devices_env,
)

NVIDIA_SMI_ARGS = [
    "--query-gpu=index,name,memory.total,uuid",
    "--format=csv,noheader,nounits",
]
AMD_SMI_ARGS = ["static", "--asic", "--vram", "--json"]
ROCM_SMI_ARGS = ["--showproductname", "--showmeminfo", "vram", "--json"]

NVIDIA_SMI_OUT = (
    "0, NVIDIA A100-SXM4-80GB, 81920, GPU-2b5a3c1e-8f1d-4f6e-9a7b-3c2d1e0f9a8b\n"
    "1, NVIDIA GeForce RTX 4090, 24564, GPU-7c9e6f5d-4b3a-2c1d-0e9f-8a7b6c5d4e3f\n"
    "2, NVIDIA GH200 480GB, [N/A], GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9\n"
)
NVIDIA_SMI_GPUS = [
    Gpu(0, "nvidia", "NVIDIA A100-SXM4-80GB", 81920, "GPU-2b5a3c1e-8f1d-4f6e-9a7b-3c2d1e0f9a8b"),
    Gpu(1, "nvidia", "NVIDIA GeForce RTX 4090", 24564, "GPU-7c9e6f5d-4b3a-2c1d-0e9f-8a7b6c5d4e3f"),
    Gpu(2, "nvidia", "NVIDIA GH200 480GB", None, "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"),
]


def _amd_smi_gpu(index: int, size: Any) -> dict[str, Any]:
    return {
        "gpu": index,
        "asic": {
            "market_name": "AMD Instinct MI300X",
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": "0x74a1",
            "subsystem_id": "0x74a1",
            "rev_id": "0x00",
            "asic_serial": "0x5D5D0F7A2B3C4E1F",
            "oam_id": index,
            "num_compute_units": 304,
            "target_graphics_version": "gfx942",
        },
        "vram": {"type": "HBM", "vendor": "N/A", "size": size, "bit_width": 8192},
    }


AMD_SMI_GPUS = [Gpu(i, "amd", "AMD Instinct MI300X", 196592) for i in (0, 1)]

ROCM_SMI_OUT = json.dumps(
    {
        f"card{i}": {
            "Card Series": "AMD Instinct MI210",
            "Card Model": "0x740f",
            "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
            "Card SKU": "D67301",
            "Subsystem ID": "0x0c34",
            "Device Rev": "0x02",
            "Node ID": str(i + 2),
            "GUID": "11063",
            "GFX Version": "gfx90a",
            "VRAM Total Memory (B)": "68702699520",
            "VRAM Total Used Memory (B)": "10993664",
        }
        for i in (1, 0)
    }
)
ROCM_SMI_GPUS = [Gpu(i, "amd", "AMD Instinct MI210", 65520) for i in (0, 1)]


class Tools:
    """Writes fake GPU tools into a directory that is the whole PATH."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir

    def add(
        self,
        name: str,
        stdout: str = "",
        *,
        code: int = 0,
        args: list[str] | None = None,
        hang: bool = False,
    ) -> None:
        lines = ["import sys, time"]
        if args is not None:  # answer only the command line the real tool gets
            lines.append(f"if sys.argv[1:] != {args!r}: sys.exit('bad args %r' % sys.argv[1:])")
        if hang:
            lines.append("time.sleep(120)")
        lines += [f"sys.stdout.write({stdout!r})", f"sys.exit({code})"]
        path = self.bin_dir / name
        path.write_text(f"#!{sys.executable}\n" + "\n".join(lines) + "\n")
        path.chmod(0o755)


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tools:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: NVML absent
    return Tools(bin_dir)


def fake_nvml(*, init_error: bool = False) -> SimpleNamespace:
    def init() -> None:
        if init_error:
            raise RuntimeError("NVML Shared Library Not Found")

    names = [b"NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]  # old pynvml gave bytes
    return SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: names[h],
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=85520809984),
        nvmlDeviceGetUUID=lambda h: f"GPU-0000000{h}-1111-2222-3333-444444444444",
    )


def test_no_tools_means_no_gpus(tools: Tools) -> None:
    assert detect_gpus() == []


def test_nvidia_smi_csv(tools: Tools) -> None:
    tools.add("nvidia-smi", NVIDIA_SMI_OUT, args=NVIDIA_SMI_ARGS)
    assert detect_gpus() == NVIDIA_SMI_GPUS


def test_nvml_is_preferred_to_nvidia_smi(tools: Tools, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    tools.add("nvidia-smi", NVIDIA_SMI_OUT, args=NVIDIA_SMI_ARGS)
    assert detect_gpus() == [
        Gpu(
            i,
            "nvidia",
            "NVIDIA H100 80GB HBM3",
            81559,
            f"GPU-0000000{i}-1111-2222-3333-444444444444",
        )
        for i in (0, 1)
    ]


def test_nvml_that_cannot_start_falls_back_to_nvidia_smi(
    tools: Tools, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error=True))
    tools.add("nvidia-smi", NVIDIA_SMI_OUT, args=NVIDIA_SMI_ARGS)
    assert detect_gpus() == NVIDIA_SMI_GPUS


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param([_amd_smi_gpu(i, {"value": 196592, "unit": "MB"}) for i in (1, 0)], id="list"),
        pytest.param(
            {"gpu_data": [_amd_smi_gpu(i, {"value": 196592, "unit": "MB"}) for i in (0, 1)]},
            id="gpu_data",
        ),
        pytest.param([_amd_smi_gpu(i, "196592 MB") for i in (0, 1)], id="size-string"),
    ],
)
def test_amd_smi_json_shapes(tools: Tools, payload: Any) -> None:
    tools.add("amd-smi", json.dumps(payload, indent=4), args=AMD_SMI_ARGS)
    tools.add("rocm-smi", ROCM_SMI_OUT, args=ROCM_SMI_ARGS)  # must not be asked
    assert detect_gpus() == AMD_SMI_GPUS


def test_amd_smi_without_name_or_size(tools: Tools) -> None:
    entry = {"gpu": 0, "asic": {"market_name": "N/A"}, "vram": {"size": "N/A"}}
    tools.add("amd-smi", json.dumps({"gpu_data": [entry], "cpu_data": []}))
    assert detect_gpus() == [Gpu(0, "amd", "AMD GPU", None)]


def test_rocm_smi_json(tools: Tools) -> None:
    tools.add("rocm-smi", ROCM_SMI_OUT, args=ROCM_SMI_ARGS)
    assert detect_gpus() == ROCM_SMI_GPUS


def test_rocm_smi_old_key_case_and_leading_warning(tools: Tools) -> None:
    # ROCm 5 spelled "Card series"; some builds print a warning before the JSON.
    card = {"Card series": "Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]", "Card model": "0x73bf"}
    card["VRAM Total Memory (B)"] = "17163091968"
    out = "WARNING: AMD GPU device(s) is/are in a low-power state.\n" + json.dumps({"card0": card})
    tools.add("rocm-smi", out)
    assert detect_gpus() == [Gpu(0, "amd", "Navi 21 [Radeon RX 6800/6800 XT / 6900 XT]", 16368)]


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param({"code": 1, "stdout": "Failed to initialize amdsmi\n"}, id="exit-1"),
        pytest.param({"stdout": "garbage, not JSON\n"}, id="garbage"),
        pytest.param({"stdout": '{"gpu_data": "nope"}'}, id="wrong-shape"),
    ],
)
def test_failing_amd_smi_falls_back_to_rocm_smi(tools: Tools, failure: dict[str, Any]) -> None:
    tools.add("amd-smi", **failure)
    tools.add("rocm-smi", ROCM_SMI_OUT)
    assert detect_gpus() == ROCM_SMI_GPUS


@pytest.mark.parametrize(
    "failure",
    [
        pytest.param({"code": 6, "stdout": "No devices were found\n"}, id="exit-6"),
        pytest.param(
            {"stdout": "NVIDIA-SMI has failed because it couldn't communicate\n"}, id="garbage"
        ),
        pytest.param({"stdout": "x, NVIDIA A100, 81920, GPU-1\n"}, id="bad-index"),
    ],
)
def test_failing_nvidia_smi_means_no_nvidia_gpus(
    tools: Tools, failure: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    tools.add("nvidia-smi", **failure)
    with caplog.at_level(logging.DEBUG, logger="gpulayer.worker.gpus"):
        assert detect_gpus() == []
    assert "no nvidia GPUs from nvidia-smi" in caplog.text


def test_hanging_tool_is_killed_after_the_timeout(tools: Tools) -> None:
    tools.add("nvidia-smi", NVIDIA_SMI_OUT, hang=True)
    tools.add("rocm-smi", ROCM_SMI_OUT)
    started = time.monotonic()
    assert detect_gpus(timeout=0.5) == ROCM_SMI_GPUS  # the other vendor still answers
    assert time.monotonic() - started < 10  # far from the fake's 120 s
    assert psutil.Process().children(recursive=True) == []  # killed and reaped


def test_both_vendors_nvidia_first(tools: Tools) -> None:
    tools.add("rocm-smi", ROCM_SMI_OUT)
    tools.add("nvidia-smi", NVIDIA_SMI_OUT)
    assert detect_gpus() == NVIDIA_SMI_GPUS + ROCM_SMI_GPUS


HIDE_ALL = {"CUDA_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "-1"}


@pytest.mark.parametrize(
    ("vendor", "indexes", "expected"),
    [
        pytest.param(
            "nvidia",
            [0, 2],
            {
                "CUDA_VISIBLE_DEVICES": "0,2",
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "ROCR_VISIBLE_DEVICES": "",
                "HIP_VISIBLE_DEVICES": "-1",
            },
            id="nvidia",
        ),
        pytest.param(
            "amd", [3, 1], {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "3,1"}, id="amd"
        ),
        pytest.param("nvidia", [], HIDE_ALL, id="nvidia-no-gpus"),
        pytest.param("amd", (), HIDE_ALL, id="amd-no-gpus"),
        pytest.param(None, [], HIDE_ALL, id="cpu-worker"),
    ],
)
def test_visible_devices_env(vendor: Any, indexes: list[int], expected: dict[str, str]) -> None:
    assert visible_devices_env(vendor, indexes) == expected


@pytest.mark.parametrize(("vendor", "indexes"), [(None, [0]), ("nvidia", [-1])])
def test_visible_devices_env_rejects_nonsense(vendor: Any, indexes: list[int]) -> None:
    with pytest.raises(ValueError, match="GPU indexes"):
        visible_devices_env(vendor, indexes)


MIXED = [*NVIDIA_SMI_GPUS[:2], *AMD_SMI_GPUS]  # nvidia 0, 1 and amd 0, 1


@pytest.mark.parametrize(
    ("found", "wanted", "chosen"),
    [
        (NVIDIA_SMI_GPUS, "all", ["nvidia:0", "nvidia:1", "nvidia:2"]),
        (NVIDIA_SMI_GPUS, "ALL", ["nvidia:0", "nvidia:1", "nvidia:2"]),
        (NVIDIA_SMI_GPUS, "none", []),
        (NVIDIA_SMI_GPUS, "2,0", ["nvidia:2", "nvidia:0"]),
        (NVIDIA_SMI_GPUS, " 1 ", ["nvidia:1"]),
        (NVIDIA_SMI_GPUS, "nvidia:1", ["nvidia:1"]),
        (NVIDIA_SMI_GPUS, "nvidia", ["nvidia:0", "nvidia:1", "nvidia:2"]),
        (MIXED, "amd:1,0", ["amd:1", "amd:0"]),
        (MIXED, "nvidia", ["nvidia:0", "nvidia:1"]),
        (MIXED, "amd", ["amd:0", "amd:1"]),
    ],
)
def test_select_gpus(found: list[Gpu], wanted: str, chosen: list[str]) -> None:
    assert gpus_option_parts(select_gpus(found, wanted)) == chosen


def gpus_option_parts(gpus: list[Gpu]) -> list[str]:
    return [f"{g.vendor}:{g.index}" for g in gpus]


@pytest.mark.parametrize(
    ("found", "wanted", "message"),
    [
        (
            NVIDIA_SMI_GPUS,
            "3",
            "--gpus 3: this machine has no GPU 3 (its GPUs: nvidia:0, nvidia:1, nvidia:2)",
        ),
        (NVIDIA_SMI_GPUS, "0,5,7", "this machine has no GPU 5, 7"),
        (NVIDIA_SMI_GPUS, "amd:0", "--gpus amd:0: this machine has no amd GPU 0"),
        (NVIDIA_SMI_GPUS, "amd", "--gpus amd: this machine has no amd GPU (its GPUs: nvidia:0"),
        (NVIDIA_SMI_GPUS, "", f"--gpus takes {GPUS_HELP}; got ''"),
        (NVIDIA_SMI_GPUS, "first", "got 'first'"),
        (NVIDIA_SMI_GPUS, "0,,1", "got '0,,1'"),
        (NVIDIA_SMI_GPUS, "intel:0", "got 'intel:0'"),
        (NVIDIA_SMI_GPUS, "nvidia:", "got 'nvidia:'"),
        (NVIDIA_SMI_GPUS, ":1", "got ':1'"),
        (NVIDIA_SMI_GPUS, "1,1", "--gpus lists a GPU twice: '1,1'"),
        (
            MIXED,
            "0",
            "--gpus 0: this machine has NVIDIA and AMD GPUs, numbered apart; say which, such as nvidia:0",
        ),
        ([], "0", "no GPU 0 (it has none)"),
    ],
)
def test_select_gpus_names_what_is_wrong(found: list[Gpu], wanted: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        select_gpus(found, wanted)


def test_select_gpus_on_a_machine_without_gpus() -> None:
    assert select_gpus([], "all") == [] == select_gpus([], "none")


def test_share_gpus_offers_each_once() -> None:
    four = [Gpu(i, "nvidia", "G") for i in range(4)]
    assert [[g.index for g in s] for s in share_gpus(four, 2)] == [[0, 2], [1, 3]]
    assert [[g.index for g in s] for s in share_gpus(four[:1], 3)] == [[0], [], []]
    assert [gpus_option(s) for s in share_gpus(four[:3], 2)] == ["nvidia:0,2", "nvidia:1"]
    assert gpus_option([]) == "none"


def test_share_gpus_refuses_two_vendors() -> None:
    # Each worker drives one vendor; numbered apart, nvidia 0 and amd 0 are two GPUs.
    with pytest.raises(WorkerError, match=re.escape("--gpus nvidia, and --gpus amd")):
        share_gpus(MIXED, 2)


def _fake(count: int) -> list[Gpu]:
    return [Gpu(index=i, vendor="nvidia", name="T", uuid=f"GPU-{i}") for i in range(count)]


def test_a_gpu_is_claimed_by_one_worker_at_a_time_and_freed_when_its_holder_dies() -> None:
    gpus = _fake(3)
    held = claim_gpus(gpus[1:2])
    assert unclaimed(gpus) == [gpus[0], gpus[2]]
    with pytest.raises(WorkerError) as refused:  # all or nothing
        claim_gpus(gpus)
    assert str(refused.value) == (
        f"another GPUlayer worker on this machine offers nvidia GPU 1 (pid {os.getpid()}); "
        "a GPU is offered by one worker at a time"
    )
    assert unclaimed(gpus) == [gpus[0], gpus[2]], "the refused claim kept nothing"
    rest = claim_gpus(gpus, all_of_them=False)  # those left, in one pass
    assert (rest.gpus, rest.taken) == (
        [gpus[0], gpus[2]],
        [f"nvidia GPU 1 (pid {os.getpid()}): another worker offers it"],
    )
    with pytest.raises(WorkerError, match="offers every GPU this one would: nvidia GPU 0 "):
        claim_gpus(gpus[:1], all_of_them=False)
    held.release()
    rest.release()
    assert unclaimed(gpus) == gpus
    # Held by another process, which is then killed: the kernel frees it.
    code = (
        "import sys; from gpulayer.worker.gpulocks import claim_gpus; "
        "from gpulayer.worker.gpus import Gpu; "
        "c = claim_gpus([Gpu(index=2, vendor='nvidia', name='T')]); "
        "print('held', flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            assert unclaimed(gpus) == gpus[:2]
            with pytest.raises(WorkerError, match=f"offers nvidia GPU 2 \\(pid {holder.pid}\\)"):
                claim_gpus(gpus)
        finally:
            holder.kill()
    assert unclaimed(gpus) == gpus
    locks = Path(os.environ["GPULAYER_GPU_LOCKS"])
    assert sorted(p.name for p in locks.iterdir()) == [f"nvidia-{i}.lock" for i in range(3)]
    assert {p.read_bytes() for p in locks.iterdir()} == {b""}, "nothing is written to them"
    assert {oct(p.stat().st_mode & 0o7777) for p in locks.iterdir()} == {"0o644"}
    assert oct(locks.stat().st_mode & 0o7777) == "0o1777"


def test_what_another_user_plants_in_the_claims_directory_harms_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (gpu,) = _fake(1)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    locks = Path(os.environ["GPULAYER_GPU_LOCKS"])
    locks.mkdir()
    (locks / "nvidia-0.lock").symlink_to(victim)
    with pytest.raises(WorkerError, match=r"nvidia-0\.lock: it is a symbolic link"):
        claim_gpus([gpu])
    assert victim.read_text() == "precious"
    (locks / "nvidia-0.lock").unlink()
    # A hard link to a private file of the worker's user: locked, left as it is.
    victim.chmod(0o600)
    os.link(victim, locks / "nvidia-0.lock")
    claim_gpus([gpu]).release()
    assert (victim.read_text(), oct(victim.stat().st_mode & 0o777)) == ("precious", "0o600")
    (locks / "nvidia-0.lock").unlink()
    os.mkfifo(locks / "nvidia-0.lock")  # would block an open for reading
    with pytest.raises(WorkerError, match=r"nvidia-0\.lock is not a regular file"):
        claim_gpus([gpu])
    # The directory itself a link, to a private directory: not followed, not opened up.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("GPULAYER_GPU_LOCKS", str(tmp_path / "linked"))
    (tmp_path / "linked").symlink_to(private)
    with pytest.raises(WorkerError, match=r"cannot keep GPU claims in .*linked"):
        claim_gpus([gpu])
    assert oct(private.stat().st_mode & 0o7777) == "0o700"


def test_a_lock_file_is_made_for_every_user_whatever_the_umask() -> None:
    """Else another user's worker could not open it, even to look."""
    before = os.umask(0o077)
    try:
        claim_gpus(_fake(1)).release()
    finally:
        os.umask(before)
    (made,) = Path(os.environ["GPULAYER_GPU_LOCKS"]).iterdir()
    assert oct(made.stat().st_mode & 0o777) == "0o644"


def test_a_look_at_the_claims_makes_nothing_and_never_makes_a_claim_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A look locks each file shared for an instant; a claim that meets only
    such locks tries again, however long the look is held up, and gets it."""
    from gpulayer.worker import gpulocks

    gpus = _fake(2)
    locks = Path(os.environ["GPULAYER_GPU_LOCKS"])
    assert unclaimed(gpus) == gpus and not locks.exists()  # no directory, no file made
    claim_gpus(gpus[:1]).release()
    assert unclaimed(gpus) == gpus and [p.name for p in locks.iterdir()] == ["nvidia-0.lock"]
    directory = gpulocks._Directory()
    look = directory.open(gpus[0])
    assert look is not None
    fcntl.flock(look, fcntl.LOCK_SH)  # a look held up, in another process say
    waits: list[float] = []

    def look_held_up(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 20:  # 40 ms: it ends at last
            fcntl.flock(look, fcntl.LOCK_UN)

    monkeypatch.setattr(gpulocks.time, "sleep", look_held_up)
    claim = claim_gpus(gpus)
    assert claim.gpus == gpus and len(waits) == 20
    with pytest.raises(WorkerError, match=f"offers nvidia GPU 0 \\(pid {os.getpid()}\\)"):
        claim_gpus(gpus[:1])  # a claim, unlike a look, is not waited for
    assert len(waits) == 20
    claim.release()
    os.close(look)
    directory.close()


def test_a_claim_that_looks_outlast_names_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a worker, nor a file replaced, though its second ran out between
    two readings of the clock."""
    from gpulayer.worker import gpulocks

    gpus = _fake(1)
    claim_gpus(gpus).release()  # its file is there
    directory = gpulocks._Directory()
    look = directory.open(gpus[0])
    assert look is not None
    fcntl.flock(look, fcntl.LOCK_SH)  # a look that never ends
    clock = iter(float(t) * 0.6 for t in range(1000))
    monkeypatch.setattr(gpulocks.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(gpulocks.time, "sleep", lambda seconds: None)
    with pytest.raises(WorkerError) as stuck:
        claim_gpus(gpus)
    assert str(stuck.value) == (
        f"processes looking at the claims held the lock file of nvidia GPU 0 (pid {os.getpid()}) "
        "for over 1 s; try again"
    )
    # `worker start --gpus all` offers the others, and says why not that one.
    claim_gpus(_fake(2)[1:]).release()  # GPU 1's file is there too
    clock = iter(float(t) * 0.6 for t in range(1000))
    rest = claim_gpus(_fake(2), all_of_them=False)
    assert (rest.gpus, rest.taken) == (
        _fake(2)[1:],
        [f"nvidia GPU 0 (pid {os.getpid()}): looks held its lock file for over 1 s"],
    )
    rest.release()
    os.close(look)
    directory.close()


def test_the_claims_directory_must_be_roots_or_the_workers_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = _fake(1)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o750)  # an admin's choice: kept as it is
    monkeypatch.setenv("GPULAYER_GPU_LOCKS", str(mine))
    claim_gpus(gpus).release()
    assert oct(mine.stat().st_mode & 0o7777) == "0o750"
    mine.chmod(0o777)  # others could delete a lock file, and claim the GPU twice
    with pytest.raises(WorkerError, match="others may write to it and it is not sticky"):
        claim_gpus(gpus)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root makes a directory another user owns")
def test_another_users_claims_directory_serves_only_if_sticky(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sticky, as the default one another user's worker made: no user
    deletes another's files there. Else its owner could."""
    gpus = _fake(1)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    theirs.chmod(0o1777)
    os.chown(theirs, 65534, 65534)  # nobody's
    monkeypatch.setenv("GPULAYER_GPU_LOCKS", str(theirs))
    claim_gpus(gpus).release()
    theirs.chmod(0o755)
    with pytest.raises(WorkerError, match=r"belongs to another user \(65534\) and is not sticky"):
        unclaimed(gpus)


def test_a_child_forked_without_exec_does_not_keep_its_parents_claims() -> None:
    import warnings

    gpus = _fake(1)
    claim = claim_gpus(gpus)
    read, write = os.pipe()
    ready_read, ready = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: forking with threads
        child = os.fork()
    if child == 0:  # a multiprocessing pool's worker, say, running on
        os.close(write)
        mine = os.open(os.devnull, os.O_RDONLY)  # may get a number the claim had
        claim.release()  # as its __del__ would: leaves the child's own files alone
        os.write(ready, b"x")
        os.read(read, 1)
        try:
            os.fstat(mine)
        except OSError:
            os._exit(1)
        os._exit(0)
    os.close(read)
    os.close(ready)
    try:
        assert os.read(ready_read, 1) == b"x"
        os.close(ready_read)
        claim.release()
        again = claim_gpus(gpus)  # the child still lives, with a copy of the descriptor
        again.release()
    finally:
        os.close(write)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0


def test_a_worker_offering_gpus_claims_them_until_it_stops(tmp_path: Path) -> None:
    from gpulayer.artifacts import ArtifactStore
    from gpulayer.service import ControlPlane
    from gpulayer.store.sqlite import SqliteStore
    from gpulayer.transport.inprocess import InProcessTransport
    from gpulayer.worker.worker import Worker

    gpus = _fake(2)
    store = SqliteStore(tmp_path / "db.sqlite")
    cache = ArtifactStore(tmp_path / "c")
    transport = InProcessTransport(ControlPlane(store, instance_id="t"), cache)

    def worker(offer: list[Gpu]) -> Worker:
        return Worker(transport, cache=cache, work_dir=tmp_path, gpus=offer)

    first = worker(gpus[:1])
    first.start()
    with pytest.raises(WorkerError, match="offers nvidia GPU 0 "):
        worker(gpus)
    first.stop()
    second = worker(gpus)
    assert unclaimed(gpus) == []
    second.start()
    second.stop()
    assert unclaimed(gpus) == gpus
    never_started = worker(gpus)
    with contextlib.suppress(Exception):
        never_started.stop()
    assert unclaimed(gpus) == gpus
    store.close()
    refused = worker(gpus)  # its start fails: the store is closed
    with pytest.raises((GPUlayerError, sqlite3.ProgrammingError)):
        refused.start()
    assert unclaimed(gpus) == gpus, "a worker that failed to start keeps no GPU"
