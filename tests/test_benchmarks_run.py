"""The benchmarks still run, end to end, at a tiny size.

They are measured by hand, not here (speed is not asserted in tests); this
catches a benchmark left behind by a change of the API it drives, as when
the finished report's reply went from 204 to 200 and the long-poll benchmark
counted every placement as dropped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _run(tmp_path: Path, script: str, *args: str) -> dict[str, object]:
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures: dict[str, object] = json.loads(out.read_text())
    return figures


@pytest.mark.parametrize("mode", [[], ["--server"]], ids=["embedded", "server"])
def test_dispatch_benchmark_runs(tmp_path: Path, mode: list[str]) -> None:
    small = ["--jobs", "4", "--workers", "2", "--repeat", "2", "--rounds", "1", "--submits", "20"]
    figures = _run(tmp_path, "dispatch.py", *mode, *small)
    burst, single = figures["burst"], figures["single"]
    assert isinstance(burst, dict) and isinstance(single, dict)
    assert burst["gpulayer_jobs_per_s"] > 0 and single["gpulayer_ms"] > 0
    assert set(single["stages_ms"]) >= {"dispatch", "prepare", "launch", "run", "finish"}
    # Each run shows its own noise: one ratio per burst pair, the quartiles of the job pairs.
    assert len(burst["round_ratios"]) == 1 and burst["round_ratios"][0] > 0
    low, high = single["pair_ratio_quartiles"]
    assert 0 < low <= high
    if mode:  # CPU per process is reported (too coarse to be non-zero in so short a burst)
        assert {f"cpu_ms_per_job_{p}" for p in ("server", "workers", "client")} <= set(burst)


def test_longpoll_benchmark_holds_a_few_workers(tmp_path: Path) -> None:
    figures = _run(tmp_path, "longpoll_scale.py", "--workers", "20", "--samples", "3")
    (step,) = figures["steps"]  # type: ignore[misc]
    assert step["held"] and not step["errors"] and step["dropped"] == 0, step
    assert figures["largest_held"] == 20
