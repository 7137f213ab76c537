"""What the warm-start tests share: a worker with a ready zygote, and the
server fixture of tests/server (a real server process), re-exported."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer
from server.conftest import ServerProc, server

__all__ = ["ServerProc", "server", "warm_client"]


@pytest.fixture
def warm_client(home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[gpulayer.Client]:
    """One local worker whose zygotes (preloading nothing: ready in
    milliseconds) are made and waited for before it serves."""
    monkeypatch.setenv("GPULAYER_WARM", "ready")
    monkeypatch.setenv("GPULAYER_PRELOAD", "")
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(1, kill_grace=0.5)
        yield c
