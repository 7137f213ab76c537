"""GPU telemetry for AMD GPUs: the sampler over a fake AMD SMI
(tests/fake_amdsmi.py, ROCm 6.2's shapes), and an embedded client's worker
that finds fake AMD GPUs (a fake ``amd-smi`` on PATH) and sends their figures."""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

import fake_amdsmi
import gpulayer
from fake_amdsmi import FakeAmdSmi, FakeGpu
from fake_nvml import FakeGpu as FakeNvidiaGpu
from fake_nvml import FakeNvml
from gpulayer.cli import workers as workers_cli
from gpulayer.http.schemas import HeartbeatRequest
from gpulayer.jobs import GpuStats
from gpulayer.worker.gpus import AMDSMI_MODULE_ENV, NVML_MODULE_ENV, Gpu, detect_gpus
from gpulayer.worker.telemetry import Sampler, open_sampler
from gpulayer.worker.telemetry_amd import match_handles
from test_telemetry import wait_for_gpu_figures

MIB, GIB = 1024**2, 1024**3
LOGGER = "gpulayer.worker.telemetry"
UUID_A = "28ff74a1-0000-1000-80e9-b6a6d4a9000a"
UUID_B = "28ff74a1-0000-1000-80e9-b6a6d4a9000b"


def amd(count: int, **fields: Any) -> list[Gpu]:
    return [Gpu(i, "amd", "AMD Instinct MI300X", **fields) for i in range(count)]


def first_sample(sampler: Sampler | None) -> list[GpuStats]:
    assert sampler is not None
    try:
        assert sampler.ready.wait(10), "no first sample"
        return sampler.latest()
    finally:
        sampler.stop()


def one(gpu: FakeGpu) -> GpuStats:
    amdsmi = FakeAmdSmi([gpu])
    (found,) = first_sample(open_sampler(amd(1), amdsmi=amdsmi))
    assert amdsmi.inits == 0  # shut down as it stopped
    return found


# ---- hostile and broken answers first ------------------------------------


@pytest.mark.parametrize(
    ("fake_field", "value", "figure"),
    [
        ("gfx_activity", None, "utilization"),  # the bindings' "N/A"
        ("gfx_activity", "N/A", "utilization"),
        ("gfx_activity", math.nan, "utilization"),
        ("gfx_activity", -1, "utilization"),
        ("gfx_activity", 101, "utilization"),
        ("gfx_activity", 0xFFFF, "utilization"),  # raw "not supported" (ROCm 6.0)
        ("gfx_activity", True, "utilization"),
        ("gfx_activity", "42", "utilization"),
        ("gfx_activity", [42], "utilization"),
        ("vram_used", -5, "memory_used"),
        ("vram_used", 2**80, "memory_used"),
        ("vram_used", 0xFFFFFFFF, "memory_used"),
        ("vram_used", "N/A", "memory_used"),
        ("vram_used", 1.5, "memory_used"),
        ("vram_total", None, "memory_total"),
        ("vram_total", {"bad": 1}, "memory_total"),
        ("hotspot", None, "temperature"),  # and no edge sensor: none at all
        ("hotspot", math.inf, "temperature"),
        ("hotspot", -300, "temperature"),
        ("hotspot", 1e308, "temperature"),
        ("hotspot", "hot", "temperature"),
        ("hotspot", 0xFFFF, "temperature"),
        ("power", None, "power"),
        ("power", -5, "power"),
        ("power", math.nan, "power"),
        ("power", 0xFFFF, "power"),  # 65535 W: "not supported", not a reading
        ("power", 10**9, "power"),
        ("power", "350 W", "power"),
        ("power_info", "N/A", "power"),
        ("power_info", ["current_socket_power", 350], "power"),
    ],
)
def test_a_bad_figure_is_dropped_alone(fake_field: str, value: Any, figure: str) -> None:
    found = one(FakeGpu(**{fake_field: value}))
    assert getattr(found, figure) is None
    good = msgspec.structs.asdict(one(FakeGpu()))
    assert good[figure] is not None
    others = {k: v for k, v in good.items() if k not in (figure, "time")}
    assert {k: getattr(found, k) for k in others} == others  # the rest arrive as ever
    body = msgspec.json.encode({"gpus": [found]})  # and the server takes it
    assert msgspec.json.decode(body, type=HeartbeatRequest).gpus == [found]


def test_hostile_names_and_uuids_are_bounded_or_replaced() -> None:
    long = one(FakeGpu(market_name="<script>" * 100, uuid="u" * 500))
    assert long.name == ("<script>" * 100)[:256] and long.uuid == "u" * 128
    odd = one(FakeGpu(market_name=None, uuid=7))  # "N/A", and not text
    assert odd.name == "AMD Instinct MI300X"  # detection's
    assert odd.uuid is None
    raw = one(FakeGpu(uuid=b"28ff74a1-bytes"))
    assert raw.uuid == "28ff74a1-bytes"


@pytest.mark.parametrize(
    ("call", "figures"),
    [
        ("amdsmi_get_gpu_activity", ["utilization"]),
        ("amdsmi_get_gpu_vram_usage", ["memory_used", "memory_total"]),
        ("amdsmi_get_temp_metric", ["temperature"]),
        ("amdsmi_get_power_info", ["power"]),
        ("amdsmi_get_gpu_asic_info", ["name"]),  # its name is then detection's
    ],
)
def test_a_failing_call_drops_only_its_figures(call: str, figures: list[str]) -> None:
    named = "AMD Instinct MI300X OAM"  # AMD SMI's name, not detection's
    amdsmi = FakeAmdSmi([FakeGpu(market_name=named, fail=[call]), FakeGpu(uuid=UUID_B)])
    failing, fine = first_sample(open_sampler(amd(2), amdsmi=amdsmi))
    for name in ("utilization", "memory_used", "memory_total", "temperature", "power"):
        assert (getattr(failing, name) is None) == (name in figures), name
        assert getattr(fine, name) is not None, name  # the other GPU's are all there
    assert failing.name == ("AMD Instinct MI300X" if "name" in figures else named)
    assert amdsmi.inits == 0


def test_a_failing_uuid_read_leaves_detections(caplog: pytest.LogCaptureFixture) -> None:
    amdsmi = FakeAmdSmi([FakeGpu(fail=["amdsmi_get_gpu_device_uuid"])])
    (found,) = first_sample(open_sampler(amd(1, uuid=UUID_A), amdsmi=amdsmi))
    assert found.uuid == UUID_A and found.utilization == 42.0


def test_broken_bindings_that_raise_on_import_mean_no_sampler(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ROCm's amdsmi prints, then raises KeyError, where libamd_smi.so is missing."""
    (tmp_path / "broken_amdsmi.py").write_text(
        "print('Unable to find amdsmi library')\nraise KeyError('libamd_smi.so')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(AMDSMI_MODULE_ENV, "broken_amdsmi")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert open_sampler(amd(1)) is None
    assert "AMD SMI's bindings (amdsmi) cannot be imported" in caplog.text
    assert "Unable to find" not in capsys.readouterr().out  # not on the worker's stdout


def test_absent_bindings_mean_no_sampler(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(AMDSMI_MODULE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import fails: ROCm's not installed
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert open_sampler(amd(1)) is None
    assert "AMD SMI's bindings (amdsmi) cannot be imported" in caplog.text


@pytest.mark.parametrize(
    ("gpus", "amdsmi", "said"),
    [
        (amd(1), FakeAmdSmi(init_error=True), "AMD SMI did not start"),
        (amd(3), FakeAmdSmi(), "AMD SMI lists 2 GPU(s), none at index 2"),
        (
            [Gpu(1, "amd", "MI300X", uuid="not-this-one")],
            FakeAmdSmi(),
            "no GPU of AMD SMI's has its uuid not-this-one",
        ),
        (
            [
                Gpu(0, "amd", "MI300X"),
                Gpu(1, "amd", "MI300X", uuid=fake_amdsmi.DEFAULT_GPUS[0].uuid),
            ],
            FakeAmdSmi(),
            "AMD SMI's GPU 0 is another GPU offered",
        ),
    ],
    ids=["no-driver", "gpu-amdsmi-lacks", "uuid-unknown", "one-handle-twice"],
)
def test_no_mechanism_means_no_sampler_said_once(
    gpus: list[Gpu], amdsmi: FakeAmdSmi, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert open_sampler(gpus, amdsmi=amdsmi) is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and said in messages[0], messages
    assert messages[0].startswith("GPU telemetry: off: ")
    assert amdsmi.inits == 0  # nothing left initialised


def test_a_library_that_cannot_list_its_gpus_is_shut_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    amdsmi = FakeAmdSmi()
    amdsmi.amdsmi_get_processor_handles = lambda: 7  # type: ignore[assignment,method-assign,return-value]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert open_sampler(amd(1), amdsmi=amdsmi) is None
    assert "GPU telemetry: off: AMD SMI" in caplog.text
    assert amdsmi.inits == 0


# ---- what it reads -------------------------------------------------------


def test_the_fakes_figures_arrive_as_gpu_stats() -> None:
    amdsmi = FakeAmdSmi([FakeGpu(uuid=UUID_A), FakeGpu(uuid=UUID_B, edge=60, hotspot=80)])
    assert first_sample(open_sampler(amd(2), amdsmi=amdsmi)) == [
        GpuStats(
            index=0,
            uuid=UUID_A,  # AMD SMI's: detection (amd-smi static) gave none
            name="AMD Instinct MI300X",
            utilization=42.0,
            memory_used=24576 * MIB,  # AMD SMI's MiB, in bytes
            memory_total=196592 * MIB,
            temperature=48.0,  # no edge sensor (MI300): the hotspot's
            power=350.0,
        ),
        GpuStats(
            index=1,
            uuid=UUID_B,
            name="AMD Instinct MI300X",
            utilization=42.0,
            memory_used=24576 * MIB,
            memory_total=196592 * MIB,
            temperature=60.0,  # the edge sensor's where there is one
            power=350.0,
        ),
    ]
    assert amdsmi.inits == 0


@pytest.mark.parametrize(
    ("power_info", "watts"),
    [
        ({"average_socket_power": 120, "gfx_voltage": 800, "power_limit": 300}, 120.0),  # 5.7
        ({"current_socket_power": 0xFFFF, "average_socket_power": 300}, 300.0),  # 6.0 raw
        ({"current_socket_power": "N/A", "average_socket_power": 95}, 95.0),  # 6.2, MI200
        ({"current_socket_power": 0, "average_socket_power": 95}, 95.0),
        ({"socket_power": 510, "current_socket_power": 510, "average_socket_power": "N/A"}, 510.0),
        ({"socket_power": 0xFFFFFFFF, "current_socket_power": 505}, 505.0),  # 7.x "unsupported"
        ({"socket_power": {"value": 200, "unit": "W"}}, 200.0),  # amd-smi JSON's shape
        ({"socket_power": {"value": 2 * 10**8, "unit": "uW"}}, None),
        ({"current_socket_power": 0, "average_socket_power": "N/A"}, 0.0),
        (SimpleNamespace(average_socket_power=77), 77.0),
        ({}, None),
    ],
    ids=[
        "5.7",
        "6.0-raw-not-supported",
        "6.2-mi200",
        "current-reads-0",
        "6.4-socket-power",
        "7.x-uint32-max",
        "value-unit",
        "other-unit",
        "all-0",
        "attributes",
        "none",
    ],
)
def test_power_in_each_releases_shape(power_info: Any, watts: float | None) -> None:
    assert one(FakeGpu(power_info=power_info)).power == watts


def test_gpus_are_matched_by_uuid_where_both_have_one() -> None:
    """Detection's uuids in another order than AMD SMI's handles: each
    GPU's figures are its own, not those of the GPU at its position."""
    amdsmi = FakeAmdSmi([FakeGpu(uuid=UUID_A, gfx_activity=10), FakeGpu(uuid=UUID_B)])
    gpus = [
        Gpu(0, "amd", "MI300X", uuid=UUID_B.upper()),  # case as another tool writes it
        Gpu(1, "amd", "MI300X", uuid=UUID_A),
    ]
    found = first_sample(open_sampler(gpus, amdsmi=amdsmi))
    assert [(s.index, s.uuid, s.utilization) for s in found] == [
        (0, UUID_B, 42.0),
        (1, UUID_A, 10.0),
    ]


@pytest.mark.parametrize(
    ("offered", "uuids", "where"),
    [
        ([(0, None), (1, None)], ["a", "b"], [0, 1]),  # by position
        ([(1, None)], [None, None], [1]),
        ([(0, "b"), (1, "a")], ["a", "b"], [1, 0]),  # by uuid
        ([(0, "A")], ["a", "b"], [0]),
        ([(0, "x")], [None, "b"], [0]),  # AMD SMI gave none at 0: by position
        ([(1, "b")], ["a", None, "b"], [2]),  # by uuid, wherever it is
        ([(0, "x")], ["a"], LookupError),  # both have one, and they differ
        ([(2, None)], ["a", "b"], LookupError),
        ([(0, None), (1, "a")], ["a", "b"], LookupError),  # two GPUs on one handle
        ([(0, None)], [], LookupError),
    ],
)
def test_matching_gpus_to_handles(
    offered: list[tuple[int, str | None]], uuids: list[str | None], where: Any
) -> None:
    gpus = [Gpu(i, "amd", "MI300X", uuid=u) for i, u in offered]
    if where is LookupError:
        with pytest.raises(LookupError, match=f"AMD GPU {offered[-1][0]}"):
            match_handles(gpus, uuids)
    else:
        assert match_handles(gpus, uuids) == where


def test_sampling_goes_on_and_stop_shuts_the_library_down() -> None:
    amdsmi = FakeAmdSmi([FakeGpu()])
    sampler = open_sampler(amd(1), amdsmi=amdsmi, interval=0.01)
    assert sampler is not None
    try:
        assert sampler.ready.wait(10)
        assert amdsmi.inits == 1
        first = amdsmi.calls
        amdsmi.gpus[0].gfx_activity = 99
        deadline = time.monotonic() + 10
        while sampler.latest()[0].utilization != 99 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.latest()[0].utilization == 99
        assert amdsmi.calls > first
    finally:
        sampler.stop()
    assert amdsmi.inits == 0
    assert not any(t.name == "gpulayer-telemetry" for t in threading.enumerate())


def test_the_in_use_mechanism_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        first_sample(open_sampler(amd(2), amdsmi=FakeAmdSmi()))
    said = [r.getMessage() for r in caplog.records]
    assert said == ["GPU telemetry: AMD SMI (amdsmi), 2 GPU(s) every 5 s"], said


def test_both_vendors_are_read_by_one_sampler(caplog: pytest.LogCaptureFixture) -> None:
    nvml, amdsmi = FakeNvml([FakeNvidiaGpu(uuid="GPU-n")]), FakeAmdSmi([FakeGpu(uuid=UUID_A)])
    gpus = [Gpu(0, "nvidia", "NVIDIA Fake GPU 80GB"), Gpu(0, "amd", "AMD Instinct MI300X")]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        found = first_sample(open_sampler(gpus, nvml=nvml, amdsmi=amdsmi))
    assert [(s.uuid, s.utilization, s.power) for s in found] == [
        ("GPU-n", 42.0, 250.0),
        (UUID_A, 42.0, 350.0),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        "GPU telemetry: NVML (pynvml), 1 GPU(s) and AMD SMI (amdsmi), 1 GPU(s) every 5 s"
    ]
    assert (nvml.inits, amdsmi.inits) == (0, 0)


def test_one_vendor_off_leaves_the_others_figures(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([FakeNvidiaGpu(uuid="GPU-n")])
    gpus = [Gpu(0, "nvidia", "NVIDIA Fake GPU 80GB"), Gpu(0, "amd", "AMD Instinct MI300X")]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        found = first_sample(open_sampler(gpus, nvml=nvml, amdsmi=FakeAmdSmi(init_error=True)))
    assert [s.uuid for s in found] == ["GPU-n"]
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("GPU telemetry: off: AMD SMI did not start"), said
    assert said[1].startswith("GPU telemetry: NVML"), said


# ---- an embedded client's worker -----------------------------------------


def _amd_smi_static(uuids: list[str | None]) -> str:
    """``amd-smi static --asic --vram --json`` as ROCm 6.3 and later write it."""
    gpus = [
        {
            "gpu": i,
            "asic": {"market_name": "AMD Instinct MI300X", "target_graphics_version": "gfx942"},
            "vram": {"type": "HBM", "size": {"value": 196592, "unit": "MB"}},
        }
        for i in range(len(uuids))
    ]
    return json.dumps({"gpu_data": gpus})


def test_embedded_local_workers_send_their_amd_gpus_figures(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker finds two AMD GPUs (a fake ``amd-smi`` on PATH, no NVIDIA
    ones), reads them through the fake AMD SMI (GPULAYER_AMDSMI_MODULE,
    figures from FAKE_AMDSMI_GPUS) and sends them, as ``client.workers()``
    shows; closing the client shuts the library down."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {
        "amd-smi": f"import sys\nsys.stdout.write({_amd_smi_static([None, None])!r})\n",
        "nvidia-smi": "import sys\nsys.exit(9)\n",  # a GPU machine's real one never answers
    }
    for name, script in tools.items():
        (bin_dir / name).write_text(f"#!{sys.executable}\n{script}")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}")
    monkeypatch.setenv(NVML_MODULE_ENV, "gpulayer_test_no_such_nvml")  # no NVIDIA through NVML
    monkeypatch.setenv(AMDSMI_MODULE_ENV, "fake_amdsmi")
    figures = tmp_path / "amdsmi-gpus.json"
    FakeAmdSmi.write(
        figures,
        [FakeGpu(uuid=UUID_A, gfx_activity=13), FakeGpu(uuid=UUID_B, gfx_activity=99, hotspot=71)],
    )
    monkeypatch.setenv(fake_amdsmi.FILE_ENV, str(figures))
    assert [(g.vendor, g.index) for g in detect_gpus()] == [("amd", 0), ("amd", 1)]
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1)
        worker = wait_for_gpu_figures(client, 2)
        assert worker.gpu_vendor == "amd"
        stats = worker.gpu_stats
        assert [(s.index, s.uuid, s.utilization) for s in stats] == [
            (0, UUID_A, 13.0),
            (1, UUID_B, 99.0),
        ]
        assert (stats[1].temperature, stats[1].power) == (71.0, 350.0)
        assert workers_cli.gpu_use(stats[0]) == "0: 13% 24.0/192.0 GiB 48°C"
    assert fake_amdsmi._amdsmi.inits == 0  # the worker's sampler shut it down
