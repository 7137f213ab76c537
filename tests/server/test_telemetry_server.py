"""GPU telemetry over HTTP: hostile heartbeats first (in-process, into the
app), then a real server with a worker process over the fake NVML, its
figures in ``gpulayer workers`` and on ``/metrics``, and a worker facing a
server from before GPU figures."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fake_nvml import FILE_ENV, FakeGpu, FakeNvml
from gpulayer.artifacts import ArtifactStore
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.jobs import MAX_TELEMETRY_GPUS, GpuStats, WorkerInfo
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore
from gpulayer.transport.http import HttpTransport
from gpulayer.worker.gpus import NVML_MODULE_ENV
from server.conftest import ServerProc
from server.rawhttp import asgi_request
from server.test_dashboard import Browser

TESTS = Path(__file__).resolve().parent.parent
GAUGES = {
    "gpulayer_gpu_utilization_percent",
    "gpulayer_gpu_memory_used_bytes",
    "gpulayer_gpu_memory_total_bytes",
    "gpulayer_gpu_temperature_celsius",
    "gpulayer_gpu_power_watts",
}


class Api:
    """A plane behind its app, with a worker registered with a worker token."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = SqliteStore(tmp_path / "db.sqlite")
        self.plane = ControlPlane(self.store, instance_id="s1")
        self.app = create_app(self.plane, ArtifactStore(tmp_path / "blobs"))
        self.admin = auth.create_token(self.store, "admin")
        self.token = auth.create_token(self.store, "worker")
        worker = {"id": "", "name": "w", "host": "h", "slot_gpus": [0, 1]}
        status, _, body = self.call("POST", "/api/v1/workers", {"worker": worker})
        assert status == 201, body
        self.worker_id = body["id"]

    def call(self, method: str, path: str, body: object = None, **kw: Any) -> tuple[int, Any, Any]:
        kw.setdefault("token", self.token)
        return asyncio.run(asgi_request(self.app, method, path, body=body, **kw))

    def beat(self, gpus: object = None, **kw: Any) -> tuple[int, Any]:
        body = {} if gpus is None else {"gpus": gpus}
        status, _, answer = self.call(
            "POST", f"/api/v1/workers/{self.worker_id}/heartbeat", body, **kw
        )
        return status, answer

    def metrics(self) -> dict[str, list[Any]]:
        status, _, text = self.call("GET", "/metrics", token=self.admin)
        assert status == 200
        families = text_string_to_metric_families(text.decode())
        return {f.name: f.samples for f in families if f.name in GAUGES}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    made = Api(tmp_path)
    try:
        yield made
    finally:
        made.store.close()


GOOD = {"index": 0, "uuid": "GPU-0", "utilization": 50, "memory_used": 1, "memory_total": 2}


@pytest.mark.parametrize(
    ("gpus", "status", "said"),
    [
        ([GOOD] * (MAX_TELEMETRY_GPUS + 1), 422, "length <= 64"),
        ([{**GOOD, "utilization": -1}], 422, "utilization"),
        ([{**GOOD, "utilization": 101}], 422, "utilization"),
        ([{**GOOD, "memory_used": -5}], 422, "memory_used"),
        ([{**GOOD, "memory_total": 2**63}], 422, "memory_total"),
        ([{**GOOD, "temperature": 400}], 422, "temperature"),
        ([{**GOOD, "power": "300W"}], 422, "power"),
        ([{**GOOD, "index": -1}], 422, "index"),
        ([{**GOOD, "index": 10**6}], 422, "index"),
        ([{**GOOD, "name": "<b>x</b>" * 100}], 422, "name"),
        ([{**GOOD, "uuid": "u" * 129}], 422, "uuid"),
        ([{**GOOD, "time": 1e300}], 422, "time"),
        ([{**GOOD, "extra": 1}], 204, None),  # figures of a later worker: ignored, not refused
        ({"0": GOOD}, 422, "Expected `array`"),
        ("gpus", 422, "Expected `array`"),
    ],
)
def test_hostile_gpu_figures_are_refused_and_the_server_stays_up(
    api: Api, gpus: object, status: int, said: str | None
) -> None:
    got, answer = api.beat(gpus)
    assert got == status, answer
    if said is not None:
        assert said in answer["error"], answer
        assert api.plane.gpu_history(api.worker_id) == {}  # nothing of it kept
    assert api.beat()[0] == 204  # it still heartbeats
    api.metrics()  # and /metrics still answers


def test_nan_infinity_and_overflow_are_refused(api: Api) -> None:
    for word, status, said in [
        (b"NaN", 400, "not valid JSON"),
        (b"Infinity", 400, "not valid JSON"),
        (b"-Infinity", 400, "not valid JSON"),
        (b"1e999", 422, "out of range"),
    ]:
        raw = b'{"gpus": [{"index": 0, "utilization": ' + word + b"}]}"
        got, _, answer = api.call("POST", f"/api/v1/workers/{api.worker_id}/heartbeat", raw=raw)
        assert (got, said in answer["error"]) == (status, True), answer
    assert api.plane.gpu_history(api.worker_id) == {}


def test_only_the_workers_own_token_sends_its_figures(api: Api) -> None:
    other = auth.create_token(api.store, "worker")
    assert api.beat([GOOD], token=other)[0] == 403
    assert api.beat([GOOD], token=None)[0] == 401
    assert api.plane.gpu_history(api.worker_id) == {}


def test_figures_become_gauges_labelled_by_worker_gpu_and_uuid(api: Api) -> None:
    hostile_uuid = (
        'GPU-"}\n# HELP x\\' + "<script>" * 10
    )  # label text, escaped by prometheus_client
    status, _ = api.beat(
        [
            {**GOOD, "temperature": 61.5, "power": 300.25},
            {"index": 1, "uuid": hostile_uuid, "utilization": 0},  # a GPU not reporting the rest
            {"index": 5, "uuid": "GPU-5", "utilization": 100},  # not a GPU it offers
        ]
    )
    assert status == 204
    gauges = api.metrics()
    assert set(gauges) == GAUGES

    def values(name: str) -> dict[tuple[str, str, str], float]:
        return {
            (s.labels["worker"], s.labels["gpu"], s.labels["uuid"]): s.value for s in gauges[name]
        }

    w = api.worker_id
    assert values("gpulayer_gpu_utilization_percent") == {
        (w, "0", "GPU-0"): 50.0,
        (w, "1", hostile_uuid): 0.0,
    }
    assert values("gpulayer_gpu_memory_used_bytes") == {(w, "0", "GPU-0"): 1.0}
    assert values("gpulayer_gpu_memory_total_bytes") == {(w, "0", "GPU-0"): 2.0}
    assert values("gpulayer_gpu_temperature_celsius") == {(w, "0", "GPU-0"): 61.5}
    assert values("gpulayer_gpu_power_watts") == {(w, "0", "GPU-0"): 300.25}


# ---- a real server and worker process ------------------------------------


def test_a_worker_process_sends_its_gpus_figures_to_a_server(
    server: ServerProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gpulayer worker start --gpus all`` over the fake NVML (its GPUs,
    one named with HTML): the figures reach ``gpulayer workers`` (table
    and JSON) and ``/metrics``."""
    figures = tmp_path / "gpus.json"
    FakeNvml.write(
        figures,
        [
            FakeGpu(uuid="GPU-aa", name="<img src=x onerror=alert(1)>", utilization=12),
            FakeGpu(uuid="GPU-bb", utilization=97, temperature=80, power_mw=None),
        ],
    )
    monkeypatch.setenv(NVML_MODULE_ENV, "fake_nvml")
    monkeypatch.setenv(FILE_ENV, str(figures))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    proc = server.start_worker(tmp_path / "worker-home", gpus="all")
    assert proc.poll() is None
    cli = [sys.executable, "-m", "gpulayer.cli", "--server", server.url, "--token", server.admin]
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(
            [*cli, "workers", "--json"], capture_output=True, text=True, check=True
        ).stdout
        (worker,) = json.loads(out)
        if len(worker["gpu_stats"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    first, second = worker["gpu_stats"]
    assert set(first) == set(GpuStats.__struct_fields__)  # every key, null where unknown
    assert first["name"] == "<img src=x onerror=alert(1)>"  # JSON gives text exactly
    assert (first["index"], first["uuid"], first["utilization"]) == (0, "GPU-aa", 12.0)
    assert (second["utilization"], second["temperature"], second["power"]) == (97.0, 80.0, None)
    assert second["memory_total"] == 80 * 1024**3 and second["time"] > 0
    table = subprocess.run([*cli, "workers"], capture_output=True, text=True, check=True).stdout
    header, row = table.splitlines()
    assert "GPU USE" in header.split("\t")
    assert "0: 12% 20.0/80.0 GiB 55°C, 1: 97% 20.0/80.0 GiB 80°C" in row.split("\t")
    with server.client() as client:
        req = urllib.request.Request(
            f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.admin}"}
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        assert client.workers()[0].gpu_stats[1].uuid == "GPU-bb"
    util = {
        s.labels["uuid"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "gpulayer_gpu_utilization_percent"
        for s in f.samples
    }
    assert util == {"GPU-aa": 12.0, "GPU-bb": 97.0}


# ---- a worker and a server from before GPU figures -----------------------


class _OldServer(http.server.BaseHTTPRequestHandler):
    """Answers heartbeats as a server from before ``gpus`` did."""

    bodies: list[dict[str, Any]]
    refusal = "invalid request body: Object contains unknown field `gpus`"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        if "gpus" in body:
            self._answer(422, {"error": self.refusal})
        else:
            self._answer(204, None)

    def _answer(self, status: int, body: object) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("refusal", "sent"),
    [
        # A server from before them: from then on, none are sent.
        ("invalid request body: Object contains unknown field `gpus`", [True, False, False]),
        # Figures a server's bounds refuse: that beat goes without them.
        (
            "invalid request body: Expected `float` <= 100.0 - at `$.gpus[0].utilization`",
            [True, False, True, False],
        ),
    ],
    ids=["old-server", "refused-figures"],
)
def test_a_heartbeat_goes_through_when_its_gpu_figures_are_refused(
    refusal: str, sent: list[bool]
) -> None:
    bodies: list[dict[str, Any]] = []
    handler = type("Handler", (_OldServer,), {"bodies": bodies, "refusal": refusal})
    old = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=old.serve_forever, daemon=True)
    thread.start()
    transport = HttpTransport(f"http://127.0.0.1:{old.server_address[1]}", retries=1)
    try:
        figures = [GpuStats(index=0, utilization=5.0)]
        transport.heartbeat("w1", gpus=figures)  # refused with them: sent again without
        transport.heartbeat("w1", gpus=figures)
        assert ["gpus" in b for b in bodies] == sent
    finally:
        transport.close()
        old.shutdown()
        old.server_close()
        thread.join()


# ---- the dashboard's workers page ----------------------------------------


def test_the_workers_page_shows_each_gpus_figures_as_text(tmp_path: Path) -> None:
    now = [1000.0]
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        plane = ControlPlane(store, instance_id="s1", clock=lambda: now[0])
        app = create_app(plane, ArtifactStore(tmp_path / "blobs"))
        info = plane.register_worker(WorkerInfo(id="", name="w", host="h", slot_gpus=[0]))
        hostile = "<script>alert(1)</script>"
        for utilization in (10.0, 90.0):  # two samples a step apart: a chart
            plane.heartbeat(
                info.id,
                gpus=[
                    GpuStats(
                        index=0,
                        name=hostile,
                        uuid=hostile,
                        utilization=utilization,
                        memory_used=2 * 1024**3,
                        memory_total=8 * 1024**3,
                        temperature=64.0,
                        power=301.0,
                    )
                ],
            )
            now[0] += 5
        b = Browser(app)
        b.sign_in(auth.create_token(store, "user", user="ada"))
        page = b.get("/workers")
        assert page.status == 200, page.text
        assert "<script>alert" not in page.text  # the worker's words are text
        assert "90%" in page.text and "2.0/8.0 GiB" in page.text and "64 °C" in page.text
        assert "301 W" in page.text
        assert 'points="0.0,21.6 120.0,2.4"' in page.text  # 10% then 90% over its hour
    finally:
        store.close()
