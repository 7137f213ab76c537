"""Usage by project over HTTP: ``GET /api/v1/usage`` and the project gauges
of ``/metrics``, in-process (who sees which row, hostile requests), then a
real server (``gpulayer usage`` and ``Client.usage()``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpulayer.access import Viewer
from gpulayer.artifacts import ArtifactStore
from gpulayer.http import auth
from gpulayer.http.app import create_app
from gpulayer.http.metrics import _ProjectCollector
from gpulayer.projects import ProjectUsage
from gpulayer.service import ControlPlane
from gpulayer.spec import parse_spec
from gpulayer.store.sqlite import SqliteStore
from gpulayer.transport.http import HttpTransport
from server.conftest import ServerProc
from server.rawhttp import asgi_request

USAGE = "/api/v1/usage"
KEYS = set(ProjectUsage.__struct_fields__)


class Api:
    """A plane with projects vision (ada) and nlp (eve) and a job waiting in
    each and in default (carol's), behind its app: a request is a call."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = SqliteStore(tmp_path / "db.sqlite")
        self.plane = ControlPlane(self.store, instance_id="s1")
        self.app = create_app(self.plane, ArtifactStore(tmp_path / "blobs"))
        self.plane.create_project("vision", gpus=8)
        self.plane.create_project("nlp", slots=4)
        self.plane.add_project_member("vision", "ada")
        self.plane.add_project_member("nlp", "eve")
        self.tokens = {
            "admin": auth.create_token(self.store, "admin"),
            "ada": auth.create_token(self.store, "user", user="ada"),
            "eve": auth.create_token(self.store, "user", user="eve"),
            "carol": auth.create_token(self.store, "user", user="carol"),
            "worker": auth.create_token(self.store, "worker"),
        }
        spec = parse_spec({"command": ["x"], "gpus": 1})
        for user in ("ada", "eve", "carol", "dave"):  # no worker: each waits
            self.plane.submit(spec, viewer=Viewer(user))

    def __call__(
        self, method: str, path: str, query: str = "", *, token: str | None = "admin"
    ) -> tuple[int, Any]:
        sent = self.tokens[token] if token is not None else None
        status, _, answer = asyncio.run(asgi_request(self.app, method, path, query, token=sent))
        return status, answer


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    made = Api(tmp_path)
    try:
        yield made
    finally:
        made.store.close()


def _rows(api: Api, token: str) -> dict[str, dict[str, Any]]:
    status, answer = api("GET", USAGE, token=token)
    assert status == 200, answer
    assert all(set(row) == KEYS for row in answer)
    return {row["project"]: row for row in answer}


def test_each_caller_gets_the_rows_it_may_see(api: Api) -> None:
    everything = _rows(api, "admin")
    assert list(everything) == ["vision", "nlp", "default"]
    assert [everything[p]["waiting"] for p in everything] == [1, 1, 2]
    assert everything["vision"]["gpu_quota"] == 8
    assert everything["nlp"]["slot_quota"] == 4
    ada = _rows(api, "ada")
    assert list(ada) == ["vision", "default"]
    # Default: only ada's own jobs there (none), and no fair-share figure.
    assert ada["default"]["waiting"] == 0
    assert (ada["default"]["only_yours"], ada["default"]["fair_share_usage"]) == (True, None)
    assert list(_rows(api, "eve")) == ["nlp", "default"]
    carol = _rows(api, "carol")
    assert list(carol) == ["default"]
    assert carol["default"]["waiting"] == 1  # hers, not dave's


@pytest.mark.parametrize(
    "query", ["project=nlp", "user=eve", "admin=1", "viewer=root", "project=nlp&project=vision"]
)
def test_no_parameter_gets_a_user_another_project_s_usage(api: Api, query: str) -> None:
    status, answer = api("GET", USAGE, query, token="ada")
    assert status == 422, answer
    assert "unknown query parameter" in answer["error"]
    assert "nlp" not in json.dumps(answer).replace(query, "")  # nothing of nlp's came back
    assert list(_rows(api, "ada")) == ["vision", "default"]  # and nothing changed


def test_other_ways_in_are_refused(api: Api) -> None:
    assert api("GET", f"{USAGE}/nlp", token="ada")[0] == 404
    assert api("POST", USAGE, token="ada")[0] == 405
    assert api("GET", USAGE, token=None)[0] == 401
    status, answer = api("GET", USAGE, token="worker")
    assert status == 403, answer


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the project gauges, parsed by prometheus_client's own parser."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("gpulayer_project_"):
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_metrics_have_each_project_s_gauges_for_those_the_caller_may_see(api: Api) -> None:
    status, _, body = asyncio.run(
        asgi_request(api.app, "GET", "/metrics", token=api.tokens["admin"])
    )
    assert status == 200
    text = body.decode() if isinstance(body, bytes) else str(body)
    samples = _samples(text)
    for project, waiting in (("vision", 1), ("nlp", 1), ("default", 2)):
        labels = (("project", project), ("state", "queued"))
        assert samples[("gpulayer_project_jobs", labels)] == waiting
        assert samples[("gpulayer_project_jobs", (("project", project), ("state", "running")))] == 0
        assert samples[("gpulayer_project_gpus_held", (("project", project),))] == 0
        key = ("gpulayer_project_fair_share_usage_gpu_seconds", (("project", project),))
        assert samples[key] == 0
        hours = ("gpulayer_project_gpu_hours", (("project", project), ("window", "24h")))
        assert samples[hours] == 0
    quotas = {k[1]: v for k, v in samples.items() if k[0] == "gpulayer_project_gpu_quota"}
    assert quotas == {(("project", "vision"),): 8}  # only where one is set
    assert "gpulayer_jobs{" in text  # the fleet's figures are still there
    # A user's scrape: its own projects only.
    status, _, body = asyncio.run(asgi_request(api.app, "GET", "/metrics", token=api.tokens["ada"]))
    assert status == 200
    seen = {dict(labels)["project"] for _, labels in _samples(body.decode())}
    assert seen == {"vision", "default"}


def test_label_values_are_escaped_as_the_text_format_asks() -> None:
    class Plane:
        def usage(self, viewer: Viewer) -> list[ProjectUsage]:
            return [ProjectUsage(project='a"b\\c\nd', running=3)]

    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(_ProjectCollector(Plane(), Viewer("x", admin=True)))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    assert 'project="a\\"b\\\\c\\nd"' in text
    labels = (("project", 'a"b\\c\nd'), ("state", "running"))
    assert _samples(text)[("gpulayer_project_jobs", labels)] == 3


# ---- a real server ----


def _gl(server: ServerProc, *args: str, token: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPULAYER_SERVER", "GPULAYER_TOKEN")}
    env["GPULAYER_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", "--server", server.url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_usage_from_the_command_line_and_the_client(server: ServerProc) -> None:
    long_name = "v" + "x" * 39  # the longest a project's name may be
    admin = server.client()
    transport = admin.transport
    assert isinstance(transport, HttpTransport)
    transport.create_project(long_name, gpus=2)
    transport.create_project("nlp")
    transport.add_project_member(long_name, "ada")
    ada = server.token("user", "ada")
    with server.client(ada) as client:
        client.submit(command=["true"], gpus=1)  # no worker: it waits
        assert [(r.project, r.waiting) for r in client.usage()] == [(long_name, 1), ("default", 0)]

    shown = _gl(server, "usage", token=ada)  # piped: tab-separated, nothing cut
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == [
        "PROJECT\tGPU-H 24H\tGPU-H 7D\tRUNNING\tWAITING\tGPUS HELD\tQUOTA",
        f"{long_name}\t0.0\t0.0\t0\t1\t0\t2 GPUs",
        "default\t0.0\t0.0\t0\t0\t0\tnone",
    ]
    as_json = json.loads(_gl(server, "usage", "--json", token=ada).stdout)
    assert [(r["schema"], r["project"], r["only_yours"]) for r in as_json] == [
        (1, long_name, False),
        (1, "default", True),
    ]
    everything = json.loads(_gl(server, "usage", "--json", token=server.admin).stdout)
    assert [r["project"] for r in everything] == [long_name, "nlp", "default"]
    admin.close()
