"""GPU telemetry: the worker's sampler (over a fake NVML), the control
plane's hour of figures, and an embedded client's workers sending them."""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import msgspec
import pytest

import gpulayer
from fake_nvml import FakeGpu, FakeNvml
from gpulayer.cli import workers as workers_cli
from gpulayer.http.schemas import HeartbeatRequest
from gpulayer.jobs import MAX_TELEMETRY_GPUS, GpuStats, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.service.state import _HISTORY_LEN, GPU_HISTORY_STEP_S, GpuHistory
from gpulayer.worker.gpus import NVML_MODULE_ENV, Gpu, detect_gpus
from gpulayer.worker.telemetry import Sampler, open_sampler

GIB = 1024**3


def nvidia(count: int) -> list[Gpu]:
    return [Gpu(i, "nvidia", "NVIDIA Fake GPU 80GB") for i in range(count)]


def first_sample(sampler: Sampler | None) -> list[GpuStats]:
    assert sampler is not None
    try:
        assert sampler.ready.wait(10), "no first sample"
        return sampler.latest()
    finally:
        sampler.stop()


def test_the_sampler_reads_each_gpus_figures() -> None:
    nvml = FakeNvml([FakeGpu(uuid="GPU-a", utilization=42), FakeGpu(uuid="GPU-b", power_mw=None)])
    found = first_sample(open_sampler(nvidia(2), nvml=nvml))
    assert found == [
        GpuStats(
            index=0,
            uuid="GPU-a",
            name="NVIDIA Fake GPU 80GB",
            utilization=42.0,
            memory_used=20 * GIB,
            memory_total=80 * GIB,
            temperature=55.0,
            power=250.0,  # NVML's milliwatts, in watts
        ),
        GpuStats(
            index=1,
            uuid="GPU-b",
            name="NVIDIA Fake GPU 80GB",
            utilization=42.0,
            memory_used=20 * GIB,
            memory_total=80 * GIB,
            temperature=55.0,
            power=None,  # "Not Supported", as on boards without a power sensor
        ),
    ]
    assert nvml.inits == 0  # shut down as it stopped


def test_a_broken_or_hostile_drivers_figures_are_dropped_not_sent() -> None:
    """What NVML (or a fake one in its place) returns is bounded before it
    goes: a heartbeat with it must be one the server takes."""
    nvml = FakeNvml(
        [
            FakeGpu(
                name="<script>alert(1)</script>" * 100,
                uuid=b"GPU-" + b"x" * 500,
                utilization=math.nan,
                memory_used=-1,
                memory_total=2**80,
                temperature=math.inf,
                power_mw=-5,
            ),
            FakeGpu(name=None, uuid=7, utilization=True, memory_used="lots", temperature=1e308),
        ]
    )
    found = first_sample(open_sampler(nvidia(2), nvml=nvml))
    hostile, odd = found
    assert hostile.name is not None and len(hostile.name) == 256
    assert hostile.uuid == "GPU-" + "x" * 124
    assert (hostile.utilization, hostile.memory_used, hostile.memory_total) == (None, None, None)
    assert (hostile.temperature, hostile.power) == (None, None)
    assert odd.name == "NVIDIA Fake GPU 80GB"  # NVML had none: detection's
    assert (odd.uuid, odd.utilization, odd.memory_used, odd.temperature) == (None, None, None, None)
    # The server's bounds take them (a refused heartbeat could cost the worker its place).
    body = msgspec.json.encode({"gpus": found})
    assert msgspec.json.decode(body, type=HeartbeatRequest).gpus == found


def test_sampling_goes_on_every_interval() -> None:
    nvml = FakeNvml([FakeGpu()])
    sampler = open_sampler(nvidia(1), nvml=nvml, interval=0.01)
    assert sampler is not None
    try:
        assert sampler.ready.wait(10)
        first = nvml.calls
        nvml.gpus[0].utilization = 99
        deadline = time.monotonic() + 10
        while sampler.latest()[0].utilization != 99 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.latest()[0].utilization == 99
        assert nvml.calls > first
    finally:
        sampler.stop()


@pytest.mark.parametrize(
    ("gpus", "nvml", "said"),
    [
        (nvidia(1), FakeNvml(init_error=True), "NVML did not start"),
        (nvidia(3), FakeNvml([FakeGpu()]), "no handle for every GPU"),
    ],
    ids=["no-driver", "gpu-nvml-lacks"],  # AMD: tests/test_telemetry_amd.py
)
def test_no_mechanism_means_no_sampler_said_once(
    gpus: list[Gpu], nvml: FakeNvml, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="gpulayer.worker.telemetry"):
        assert open_sampler(gpus, nvml=nvml) is None
    assert [r.getMessage() for r in caplog.records if said in r.getMessage()], caplog.text
    assert nvml.inits == 0  # nothing left initialised


def test_nvml_bindings_absent_mean_no_sampler(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with caplog.at_level(logging.INFO, logger="gpulayer.worker.telemetry"):
        assert open_sampler(nvidia(1)) is None
    assert "NVML's bindings cannot be imported" in caplog.text
    assert open_sampler([]) is None  # a CPU worker: nothing to say


def test_the_in_use_mechanism_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gpulayer.worker.telemetry"):
        first_sample(open_sampler(nvidia(2), nvml=FakeNvml([FakeGpu(), FakeGpu()])))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("GPU telemetry: NVML"), said


# ---- the control plane's side --------------------------------------------


def stats(index: int, **figures: float) -> GpuStats:
    return GpuStats(index=index, uuid=f"GPU-{index}", **figures)  # type: ignore[arg-type]


def test_a_gpus_history_is_an_hour_in_a_bounded_ring() -> None:
    history = GpuHistory()
    for second in range(0, 4 * 3600, 1):  # a heartbeat a second for four hours
        history.add(msgspec.structs.replace(stats(0, utilization=second % 100), time=second))
    kept = history.samples(since=0)
    assert len(kept) == _HISTORY_LEN  # never more, however often it is sent
    assert kept[-1].time == 4 * 3600 - 1 and history.latest == kept[-1]
    hour = history.samples(since=kept[-1].time - 3600)
    assert hour[-1].time - hour[0].time >= 3600 - 2 * GPU_HISTORY_STEP_S  # the whole last hour
    assert [s.time for s in hour] == sorted(s.time for s in hour)
    assert {s.uuid for s in kept} == {"GPU-0"}


def test_heartbeats_every_few_seconds_fill_an_hour() -> None:
    history = GpuHistory()
    at = 0.0
    for beat in range(2000):  # every 5 s, a little early or late
        at += 5.0 + (0.05 if beat % 2 else -0.05)
        history.add(stats(0, utilization=1.0, time=at))
    hour = history.samples(since=at - 3600)
    assert len(hour) >= 3600 / 5.1  # every beat of the hour kept
    assert hour[-1].time - hour[0].time >= 3590


def test_a_history_keeps_what_was_not_reported_as_missing() -> None:
    history = GpuHistory()
    history.add(stats(0, utilization=10.0, memory_used=5, time=100.0))
    history.add(stats(0, temperature=70.0, time=110.0))
    first, second = history.samples(0)
    assert (first.utilization, first.memory_used, first.temperature) == (10.0, 5, None)
    assert (second.utilization, second.memory_used, second.temperature) == (None, None, 70.0)


def register(plane: ControlPlane, gpus: list[int | None]) -> str:
    info = WorkerInfo(id="", name="w", host="h", slot_gpus=gpus)
    return plane.register_worker(info).id


def test_the_plane_keeps_figures_of_offered_gpus_only(plane: ControlPlane) -> None:
    """A worker's token holder can send any GPU index: only the GPUs it
    registered are kept, so it cannot grow the server's memory."""
    wid = register(plane, [0, 1])
    plane.heartbeat(wid, gpus=[stats(0, utilization=5.0), stats(1), stats(7), stats(1023)])
    history = plane.gpu_history(wid)
    assert sorted(history) == [0, 1]
    assert history[0][0].utilization == 5.0 and history[0][0].time > 0  # stamped by the server
    assert sorted(plane.gpu_stats()[wid], key=lambda s: s.index) == plane.gpu_stats()[wid]
    assert plane.gpu_history("no-such-worker") == {}
    cpu = register(plane, [None, None])
    plane.heartbeat(cpu, gpus=[stats(0, utilization=1.0)])
    assert plane.gpu_history(cpu) == {} and cpu not in plane.gpu_stats()


def test_a_worker_offering_many_gpus_keeps_a_bounded_number(plane: ControlPlane) -> None:
    wid = register(plane, list(range(1000)))
    for start in range(0, 1000, MAX_TELEMETRY_GPUS):
        plane.heartbeat(wid, gpus=[stats(i) for i in range(start, start + MAX_TELEMETRY_GPUS)])
    assert len(plane.gpu_history(wid)) == MAX_TELEMETRY_GPUS


def test_a_server_stamps_the_time_not_the_worker(tmp_path: Path) -> None:
    from gpulayer.store.sqlite import SqliteStore

    now = [1000.0]
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="test", clock=lambda: now[0])
        wid = register(plane, [0])
        plane.heartbeat(wid, gpus=[stats(0, utilization=1.0, time=9e10)])
        assert [s.time for s in plane.gpu_stats()[wid]] == [1000.0]
        now[0] += 61  # no word for a minute: not its GPUs' figures now
        assert plane.gpu_stats()[wid] == []
        assert [s.time for s in plane.gpu_history(wid)[0]] == [1000.0]  # still in the hour
        now[0] += 3600
        assert plane.gpu_history(wid) == {0: []}
    finally:
        store.close()


# ---- an embedded client's workers ----------------------------------------


def wait_for_gpu_figures(client: gpulayer.Client, gpus: int) -> WorkerInfo:
    """The client's one worker, once its heartbeats carry ``gpus`` GPUs' figures."""
    deadline = time.monotonic() + 30
    while True:
        (worker,) = client.workers()
        if len(worker.gpu_stats) == gpus:
            return worker
        assert time.monotonic() < deadline, f"no GPU figures arrived: {worker}"
        time.sleep(0.05)  # the figures come with a heartbeat: nothing to wait on here


def test_embedded_local_workers_send_their_gpus_figures(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local workers find the fake NVML's two GPUs (GPULAYER_NVML_MODULE),
    sample them and send the figures, which ``client.workers()`` shows."""
    monkeypatch.setenv(NVML_MODULE_ENV, "fake_nvml")
    assert [g.uuid for g in detect_gpus()] == [
        "GPU-fa4e0000-0000-0000-0000-000000000000",
        "GPU-fa4e0001-0000-0000-0000-000000000001",
    ]
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1)
        worker = wait_for_gpu_figures(client, 2)
        assert [(s.index, s.utilization) for s in worker.gpu_stats] == [(0, 42.0), (1, 87.0)]
        assert worker.gpu_stats[1].temperature == 71.0
        row = workers_cli.gpu_use(worker.gpu_stats[0])
        assert row == "0: 42% 20.0/80.0 GiB 55°C"
