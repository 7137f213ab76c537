"""Fixtures that start real things and always clean up after them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer
from gpulayer.service import ControlPlane
from gpulayer.store.sqlite import SqliteStore

from helpers import STARTS, Start


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No test touches ~/.gpulayer: each gets its own home, and its own
    machine-wide GPU claims (tests run side by side, some with fake GPUs)."""
    home = tmp_path / "gpulayer-home"
    monkeypatch.setenv("GPULAYER_HOME", str(home))
    monkeypatch.setenv("GPULAYER_GPU_LOCKS", str(tmp_path / "gpu-locks"))
    monkeypatch.delenv("GPULAYER_SERVER", raising=False)
    # Warm starts stay on (the default), but the zygotes preload nothing
    # unless a test says otherwise: each worker a test starts would else
    # import torch in its zygote, seconds of CPU on a 2-core machine, for
    # jobs that mostly print. Tests of warm starts with torch set it.
    monkeypatch.setenv("GPULAYER_PRELOAD", "")
    monkeypatch.delenv("GPULAYER_WARM", raising=False)
    return home


@pytest.fixture(autouse=True)
def _no_box_left_open() -> Iterator[None]:
    """A test leaves no task's box open in this process's shared subreaper
    containment: one left open would make the next test's worker reap
    children of its host program born since (its ``since``)."""
    yield
    from gpulayer.worker import containment

    shared = containment._SHARED.get(containment.SUBREAPER)
    if shared is not None:
        with shared._lock:  # type: ignore[attr-defined]
            left = list(shared._open)  # type: ignore[attr-defined]
        assert not left, f"{len(left)} task box(es) left open in the subreaper containment"


@pytest.fixture
def home(_isolated_home: Path) -> Path:
    return _isolated_home


def _start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, preload: str) -> Start:
    # Read as each worker starts: a test names this fixture before its
    # client (pytest sets up arguments in order, after ``home``); a client
    # made first would start jobs otherwise, which Start.check catches.
    monkeypatch.setenv("GPULAYER_WARM", STARTS[request.param])
    monkeypatch.setenv("GPULAYER_PRELOAD", preload)
    return Start(warm=request.param == "warm")


@pytest.fixture(params=list(STARTS))
def start(request: pytest.FixtureRequest, home: Path, monkeypatch: pytest.MonkeyPatch) -> Start:
    """The test runs twice: every job cold, and from zygotes ready before the
    workers serve, which preload nothing (helpers.STARTS)."""
    return _start(request, monkeypatch, "")


@pytest.fixture(params=list(STARTS))
def torch_start(
    request: pytest.FixtureRequest, home: Path, monkeypatch: pytest.MonkeyPatch
) -> Start:
    """As ``start``, for jobs that import torch: the zygotes preload it."""
    return _start(request, monkeypatch, "torch,numpy")


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """A control plane over its own store, with no workers (tests register them)."""
    store = SqliteStore(tmp_path / "db.sqlite")
    try:
        yield ControlPlane(store, instance_id="test")
    finally:
        store.close()


@pytest.fixture
def client(home: Path) -> Iterator[gpulayer.Client]:
    """An embedded client with two one-slot local workers and a short kill grace."""
    before = threading.active_count()
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(2, kill_grace=0.5)
        yield c
    # Worker and task threads end with the client (log sender included).
    assert threading.active_count() <= before + 1, threading.enumerate()


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A small script directory, like a user's project."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "train.py").write_text(
        "import json, os, sys\n"
        "from helper import greet\n"
        "print(greet(sys.argv[1:]))\n"
        "data = open(os.path.join(os.environ['GPULAYER_INPUTS'], 'data')).read() if 'GPULAYER_INPUTS' in os.environ else ''\n"
        "os.makedirs('out', exist_ok=True)\n"
        "json.dump({'args': sys.argv[1:], 'data': data}, open('out/result.json', 'w'))\n"
    )
    (root / "helper.py").write_text("def greet(args):\n    return 'hello ' + ' '.join(args)\n")
    return root
