"""Checkpoint files are replaced atomically: a crash mid-write keeps the old one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from trainer_testkit import SRC

from gpulayer.errors import GPUlayerError
from gpulayer.train import CheckpointError
from gpulayer.train.checkpoint import atomic_save, load_checkpoint

pytestmark = pytest.mark.torch

CRASH = textwrap.dedent(
    """
    import os, sys, torch
    from gpulayer.train.checkpoint import atomic_save

    path, how = sys.argv[1], sys.argv[2]
    if how == "torn":
        # Die with half the bytes written: what a kill or power cut does mid-write.
        real_save = torch.save
        def torn(obj, f):
            real_save(obj, f)
            f.flush()
            f.truncate(f.tell() // 2)
            os._exit(9)
        torch.save = torn
    else:
        # Die after the data is on disk, just before the rename.
        os.replace = lambda *a: os._exit(9)
    atomic_save({"state_dict": {"w": torch.full((1000,), 2.0)}, "version": 2}, path)
    """
)


@pytest.mark.parametrize("how", ["torn", "before_rename"])
def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path: Path, how: str) -> None:
    path = tmp_path / "checkpoints" / "last.ckpt"
    atomic_save({"state_dict": {"w": torch.ones(1000)}, "version": 1}, path)

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", CRASH, str(path), how], env=env, capture_output=True, timeout=60
    )
    assert result.returncode == 9, result.stderr.decode()[-2000:]

    survived = load_checkpoint(path)
    assert survived["version"] == 1
    assert torch.equal(survived["state_dict"]["w"], torch.ones(1000))
    # The crash left at most a hidden temporary file, never a torn last.ckpt.
    leftovers = [p.name for p in path.parent.iterdir() if p.name != "last.ckpt"]
    assert all(name.startswith(".last.ckpt.") and name.endswith(".tmp") for name in leftovers)


def test_an_error_mid_write_removes_the_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.ckpt"
    atomic_save({"state_dict": {}, "version": 1}, path)

    def failing(obj: object, f: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError, match="disk full"):
        atomic_save({"state_dict": {}, "version": 2}, path)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert load_checkpoint(path)["version"] == 1


def test_unreadable_and_foreign_files_raise_checkpoint_errors(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read checkpoint") as info:
        load_checkpoint(garbage)
    assert isinstance(info.value, GPUlayerError)

    foreign = tmp_path / "tensor.pt"
    torch.save(torch.ones(2), foreign)
    with pytest.raises(
        CheckpointError, match="expected a dict with a 'state_dict' key, found Tensor"
    ):
        load_checkpoint(foreign)


def test_arbitrary_objects_are_refused_unless_trusted(tmp_path: Path) -> None:
    path = tmp_path / "odd.ckpt"
    atomic_save({"state_dict": {}, "hyper_parameters": {"data": Path("/data")}}, path)
    with pytest.raises(CheckpointError, match="weights_only=False only if you trust"):
        load_checkpoint(path)
    assert load_checkpoint(path, weights_only=False)["hyper_parameters"]["data"] == Path("/data")
