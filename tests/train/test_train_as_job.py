"""The example training script run as a GPUlayer job (embedded), outputs kept.

Each test runs twice (the ``torch_start`` fixture): cold, and forked from
its workers' zygotes, which have imported torch, as the job's record says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gpulayer

from helpers import Start

pytestmark = pytest.mark.torch

EXAMPLE = Path(__file__).parents[2] / "examples" / "train_mlp" / "train.py"


def test_the_training_example_runs_as_a_job(torch_start: Start, home: Path, tmp_path: Path) -> None:
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1)
        job = client.submit(
            EXAMPLE, args=["--epochs", "2", "--samples", "512"], outputs=["gpulayer_runs"]
        )
        assert job.wait(timeout=300) == "succeeded", job.info.reason
        torch_start.check(job)
        out = job.download_outputs(tmp_path / "out")
    summaries = list(out.rglob("summary.json"))
    assert len(summaries) == 1, sorted(p.relative_to(out) for p in out.rglob("*"))
    summary = json.loads(summaries[0].read_text())
    assert summary, "the run wrote a summary"
    assert list(out.rglob("*.ckpt")), "checkpoints came back as outputs"
    assert "gpulayer_runs" in job.info.outputs


def test_the_training_example_runs_as_a_2x2_job(
    torch_start: Start, home: Path, tmp_path: Path
) -> None:
    """DDP on gloo across two workers: rank 0's run (on node 0) comes back."""
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(2)
        job = client.submit(
            EXAMPLE,
            args=["--epochs", "1", "--samples", "512"],
            nodes=2,
            procs_per_node=2,
            outputs=["gpulayer_runs"],
        )
        assert job.wait(timeout=300) == "succeeded", job.logs()
        torch_start.check(job)
        out = job.download_outputs(tmp_path / "out")
        ranks = {line.rank for line in job.stream_logs(follow=False)}
    (summary_file,) = out.rglob("summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["world_size"] == 4
    assert summary["global_step"] == 512 // 64 // 4
    assert list(out.rglob("*.ckpt"))
    assert 0 in ranks and ranks <= {0, 1, 2, 3}
