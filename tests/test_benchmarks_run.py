"""The benchmarks still run, end to end, at a tiny size.

They are measured by hand, not here (speed is not asserted in tests); this
catches a benchmark left behind by a change of the API it drives, as when
the finished report's reply went from 204 to 200 and the long-poll benchmark
counted every placement as dropped.
"""

from __future__ import annotations

import json
import os
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
    # The trivial script job, warm (the benchmark checked each started so) and cold.
    for kind in ("warm", "cold_script"):
        assert single[f"{kind}_ms"] > 0 and single[f"{kind}_ratio"] > 0, single
        low, high = single[f"{kind}_pair_ratio_quartiles"]
        assert 0 < low <= high
        assert single[f"{kind}_stages_ms"]["run"] > 0
    assert single["warm_target"] == (0.7 if mode else 0.5)
    if mode:  # CPU per process is reported (too coarse to be non-zero in so short a burst)
        assert {f"cpu_ms_per_job_{p}" for p in ("server", "workers", "client")} <= set(burst)


def test_distributed_startup_benchmark_runs(tmp_path: Path) -> None:
    """One run of each kind; the zygotes preload nothing here (conftest), so
    they are ready at once and the warm ranks import torch themselves."""
    pytest.importorskip("torch")
    figures = _run(
        tmp_path, "distributed_startup.py", "--repeat", "1", "--warmup", "0", "--backend", "gloo"
    )
    median, checks = figures["median"], figures["checks"]
    assert isinstance(median, dict) and isinstance(checks, dict)
    assert set(median) == {"bare", "direct", "warm", "torchrun"}
    for kind, stages in median.items():
        assert stages["total"] > 0 and stages["script"] > 0, kind
        low, high = stages["uss_mib"]  # each rank's memory, as it ends
        assert 0 < low <= high <= stages["rss_mib"][1], kind
    runs = figures["runs"]
    assert isinstance(runs, dict)
    # Each job ran as labelled (the benchmark stops otherwise; here it is seen).
    assert [r["start"] for r in runs["warm"]] == ["warm"]
    assert all(r["start"].startswith("cold: ") for r in runs["direct"] + runs["torchrun"])
    assert checks["warm_ratio"] > 0 and isinstance(checks["warm_ratio_ok"], bool)
    assert isinstance(checks["warm_startup_ok"], bool)
    # Both workers' ready interpreters (theirs, and their ranks' with one
    # OpenMP thread) are found, with their memory.
    zygotes = figures["zygotes"]
    own = os.environ.get("OMP_NUM_THREADS", "")
    per_worker = [own] if own == "1" else [own, "1"]
    assert isinstance(zygotes, list)
    assert sorted(z["omp_num_threads"] or "" for z in zygotes) == sorted(per_worker * 2), zygotes
    assert all(z["rss_mib"] > 0 for z in zygotes)
    assert checks["zygote_rss_mib"] == [z["rss_mib"] for z in zygotes]


def test_longpoll_benchmark_holds_a_few_workers(tmp_path: Path) -> None:
    figures = _run(tmp_path, "longpoll_scale.py", "--workers", "20", "--samples", "3")
    (step,) = figures["steps"]  # type: ignore[misc]
    assert step["held"] and not step["errors"] and step["dropped"] == 0, step
    assert figures["largest_held"] == 20


def test_placement_benchmark_runs(tmp_path: Path) -> None:
    figures = _run(
        tmp_path,
        "placement.py",
        "--jobs",
        "2000",
        "--projects",
        "5",
        "--workers",
        "50",
        "--repeat",
        "1",
        "--passes",
        "3",
    )
    for scenario in ("one-frees", "all-idle"):
        found = figures[scenario]
        assert isinstance(found, dict)
        assert found["fair_share_ms"] > 0 and found["baseline_ms"] > 0
        placed = found["assignments_last_pass"]
        assert placed["fair-share"] > 0 and placed["baseline"] > 0
    queue = figures["queue"]
    assert isinstance(queue, dict) and queue["add_remove_us"] > 0
