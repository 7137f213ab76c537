"""The public surface of gpulayer.train, and that gpulayer alone needs no torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from trainer_testkit import SRC

import gpulayer.train

pytestmark = pytest.mark.torch

PUBLIC = {
    "CSVLogger",
    "Callback",
    "CheckpointError",
    "EarlyStopping",
    "LearningRateMonitor",
    "LightningDataModule",
    "LightningModule",
    "Logger",
    "ModelCheckpoint",
    "ModelSummary",
    "Module",
    "TensorBoardLogger",
    "Trainer",
    "TrainerError",
    "callbacks",
    "loggers",
    "profilers",
    "seed_everything",
}
# lightning.pytorch.callbacks, .loggers and .profilers
SUBMODULES = {"callbacks", "loggers", "profilers"}


def test_exported_members() -> None:
    assert set(gpulayer.train.__all__) == PUBLIC
    for name in PUBLIC - SUBMODULES:
        assert getattr(gpulayer.train, name).__module__.startswith("gpulayer.train.")
    for name in SUBMODULES:
        assert getattr(gpulayer.train, name).__name__ == f"gpulayer.train.{name}"


def test_import_gpulayer_does_not_import_torch() -> None:
    code = "import sys, gpulayer; assert 'torch' not in sys.modules, 'torch imported'"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_seed_everything_repeats_draws() -> None:
    import random

    import numpy as np
    import torch

    draws = []
    for _ in range(2):
        assert gpulayer.train.seed_everything(123) == 123
        draws.append((random.random(), float(np.random.rand()), torch.rand(1)))
    assert draws[0][:2] == draws[1][:2] and torch.equal(draws[0][2], draws[1][2])
    with pytest.raises(
        gpulayer.train.TrainerError, match=r"seed=-1 must be an int in 0\.\.4294967295"
    ):
        gpulayer.train.seed_everything(-1)
