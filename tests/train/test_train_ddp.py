"""Two real ranks over gloo: DDP wrapping, data sharding, accumulation without
all-reduce, rank-0-only files, the example script as a distributed job, and
the process group's teardown at exit."""

from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from trainer_testkit import Regression, make_batches, make_optimizer, raw_fit, run_ranks

from gpulayer.train import distributed

pytestmark = pytest.mark.torch

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "train_mlp" / "train.py"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("ddp")
    run_ranks([str(HERE / "ddp_worker.py"), str(out)], world=2, cwd=out)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, reports


def load(out: Path, rank: int, accumulate: int) -> dict[str, Any]:
    return torch.load(out / f"rank{rank}-acc{accumulate}.pt", weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("accumulate", "steps"), [(1, 6), (2, 3), (3, 2)])
def test_gradients_are_exchanged_only_on_stepping_batches(
    two_ranks: tuple[Path, list[dict[str, Any]]], accumulate: int, steps: int
) -> None:
    _, reports = two_ranks
    for rank, report in enumerate(reports):
        run = report[str(accumulate)]
        assert run["rank"] == rank and run["world_size"] == 2
        assert run["ddp"] == "DistributedDataParallel"
        assert run["global_step"] == steps  # 12 batches, 6 per rank
        # One all-reduce per optimizer step (the tiny model fits one bucket),
        # none for the accumulating batches that ran under no_sync.
        assert run["allreduces"] == steps


def test_ranks_see_disjoint_halves_and_end_with_equal_weights(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, _ = two_ranks
    for accumulate in (1, 2, 3):
        a, b = load(out, 0, accumulate), load(out, 1, accumulate)
        assert len(a["seen"]) == len(b["seen"]) == 6
        data = [x for x, _ in make_batches(12)]
        assert all(torch.equal(x, data[2 * i]) for i, x in enumerate(a["seen"]))
        assert all(torch.equal(x, data[2 * i + 1]) for i, x in enumerate(b["seen"]))
        for key in a["weights"]:
            assert torch.equal(a["weights"][key], b["weights"][key]), key


@pytest.mark.parametrize("accumulate", [1, 3])
def test_two_ranks_match_one_process_accumulating_twice_as_much(
    two_ranks: tuple[Path, list[dict[str, Any]]], accumulate: int
) -> None:
    # DDP averages the ranks' gradients; one process averaging the same batches
    # by accumulation takes the same steps (up to float summation order).
    out, _ = two_ranks
    torch.manual_seed(0)
    net = copy.deepcopy(Regression().net)
    raw_fit(net, make_optimizer(net.parameters(), "sgd", 0.05), [make_batches(12)], accumulate * 2)
    ddp = load(out, 0, accumulate)["weights"]
    for key, value in net.state_dict().items():
        assert torch.allclose(ddp[f"net.{key}"], value, atol=1e-6), key


def test_sync_dist_reduces_epoch_values_across_ranks(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, reports = two_ranks
    run0, run1 = reports[0]["1"], reports[1]["1"]
    assert run0["val_local"] != run1["val_local"]
    assert run0["val_synced"] == pytest.approx(run1["val_synced"])
    assert run0["val_synced"] == pytest.approx((run0["val_local"] + run1["val_local"]) / 2)


def test_only_rank_zero_writes(two_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    out, reports = two_ranks
    assert reports[1]["0"]["saves"] == []
    assert len(reports[0]["0"]["saves"]) == 3  # last.ckpt once per fit
    # Rank 0 chose each run's directory and told rank 1.
    dirs = [[reports[r][str(a)]["log_dir"] for a in (1, 2, 3)] for r in range(2)]
    assert dirs[0] == dirs[1] == [str(out / "runs" / f"version_{i}") for i in range(3)]
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "version_0",
        "version_1",
        "version_2",
    ]
    header = (out / "runs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "val_synced" in header


def test_example_runs_alone_and_as_a_two_rank_job(tmp_path: Path) -> None:
    alone, job = tmp_path / "alone", tmp_path / "job"
    alone.mkdir()
    job.mkdir()
    run_ranks([str(EXAMPLE), "--epochs", "2", "--samples", "1024"], world=1, cwd=alone)
    run_ranks([str(EXAMPLE), "--epochs", "2", "--samples", "1024"], world=2, cwd=job)
    for where, world in ((alone, 1), (job, 2)):
        run = where / "gpulayer_runs" / "version_0"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_size"] == world
        assert summary["epochs"] == 2
        assert summary["global_step"] == 2 * 1024 // 64 // world
        assert (run / "checkpoints" / "last.ckpt").is_file()
        assert (run / "metrics.csv").read_text().startswith("step,")
        assert summary["metrics"]["val_acc"] > 0.5  # four classes: it learned something


@pytest.mark.parametrize("dead", [0, 1])
def test_a_rank_whose_peer_died_still_exits_cleanly(tmp_path: Path, dead: int) -> None:
    # The exit barrier must not wait for a rank that is gone (rank 0 also
    # hosts the store): the dead rank's closed sockets fail it at once.
    results = run_ranks(
        [str(HERE / "ddp_exit_worker.py"), str(dead), "die"], world=2, cwd=tmp_path, check=False
    )
    assert results[dead].returncode == 3
    alive = results[1 - dead]
    assert alive.returncode == 0, alive.stderr[-3000:]
    assert "ranks did not meet at exit" in alive.stderr


@pytest.mark.parametrize("quitter", [0, 1])
def test_a_rank_that_quits_mid_work_does_not_hold_its_peers(tmp_path: Path, quitter: int) -> None:
    # No fit() returned: no exit barrier, so the rank that quit is gone at
    # once and its peer's collective fails instead of waiting for it (with a
    # barrier at exit both would wait out the process group's 30 minutes).
    results = run_ranks(
        [str(HERE / "ddp_exit_worker.py"), str(quitter), "quit"],
        world=2,
        cwd=tmp_path,
        check=False,
        timeout=60,
    )
    assert results[quitter].returncode == 1, results[quitter].stderr[-3000:]
    assert results[1 - quitter].returncode != 0


@pytest.fixture
def teardown_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The exit teardown's calls into torch.distributed, recorded, none made."""
    calls: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(distributed, "_meet", lambda timeout: calls.append(f"barrier {timeout}"))
    monkeypatch.setattr(distributed, "_finished_cleanly", True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.delattr(sys, "last_value", raising=False)
    monkeypatch.delattr(sys, "last_exc", raising=False)
    return calls


def test_exit_teardown_meets_the_other_ranks_then_destroys(teardown_calls: list[str]) -> None:
    distributed._destroy()
    assert teardown_calls == [f"barrier {distributed.EXIT_BARRIER_TIMEOUT}", "destroy"]


def test_exit_teardown_skips_the_barrier_unless_the_trainer_finished(
    teardown_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(distributed, "_finished_cleanly", False)
    distributed._destroy()
    assert teardown_calls == ["destroy"]


def test_exit_teardown_skips_the_barrier_when_an_exception_ends_the_process(
    teardown_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The peers may be blocked in a collective this rank never joins.
    monkeypatch.setattr(sys, "last_value", RuntimeError("boom"), raising=False)
    distributed._destroy()
    assert teardown_calls == ["destroy"]


def test_exit_teardown_destroys_even_when_the_barrier_fails(
    teardown_calls: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def timed_out(timeout: object) -> None:
        raise RuntimeError("wait timeout after 300000ms, keys: /gpulayer/exit/all")

    monkeypatch.setattr(distributed, "_meet", timed_out)
    with caplog.at_level(logging.WARNING, logger="gpulayer.train"):
        distributed._destroy()
    assert teardown_calls == ["destroy"]
    assert "did not meet at exit" in caplog.text
