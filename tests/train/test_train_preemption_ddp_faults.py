"""Review: what a DDP fit with the notice set leaves behind when it raises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_testkit import run_ranks

pytestmark = pytest.mark.torch


def test_a_ddp_fit_that_raises_releases_its_side_gloo_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fit makes a gloo group (preemption.Preemption.attach); close()
    destroys it only when the fit ended normally, so every fit that raises
    (caught by the script, as a sweep or a retry loop does) leaks one: its
    TCP connections, its gloo threads."""
    monkeypatch.setenv("GPULAYER_PREEMPT_NOTICE", "10")
    ranks = run_ranks(
        [str(Path(__file__).with_name("preempt_ddp_rank.py")), str(tmp_path)],
        2,
        tmp_path,
        timeout=120,
    )
    for rank in (0, 1):
        said = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert said["threads"] == [], said
        # The default group alone, after each fit, as without the notice.
        assert said["groups"] == [1, 1, 1], (rank, said, ranks[rank].stderr[-1500:])
