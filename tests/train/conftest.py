"""Fixtures for the Trainer tests: single-process, in a scratch directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tests run as one process even inside a distributed job, and write to tmp_path."""
    for name in DIST_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Iterator[None]:
    # Tiny models: threads only add contention next to the other xdist worker.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
