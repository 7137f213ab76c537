"""What the warm-start tests share: a worker with a ready zygote, and the
server fixture of tests/server (a real server process), re-exported."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import gpulayer
from server.conftest import ServerProc, server

__all__ = ["PRELOADS", "ServerProc", "server", "warm_client"]


# What the zygotes preload, for each test that takes ``warm_client``:
# nothing (one kind of zygote), or a small module of the standard library
# no zygote imports otherwise, so that each key has a full and a light
# zygote and the scripts that do not import it fork from the light one.
PRELOADS = {"one-kind": "", "light": "colorsys"}


@pytest.fixture(params=list(PRELOADS))
def warm_client(
    request: pytest.FixtureRequest, home: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[gpulayer.Client]:
    """One local worker whose zygotes (ready in milliseconds) are made and
    waited for before it serves; each test runs with both preloads above."""
    monkeypatch.setenv("GPULAYER_WARM", "ready")
    monkeypatch.setenv("GPULAYER_PRELOAD", PRELOADS[request.param])
    with gpulayer.Client(home=home) as c:
        c.ensure_local_workers(1, kill_grace=0.5)
        yield c
