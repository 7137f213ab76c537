"""``gpulayer.train``: a PyTorch training loop that never waits on the host.

Importing this package imports torch (``pip install gpulayer[torch]``);
``import gpulayer`` alone does not. See ``docs/trainer.md``.
"""

from __future__ import annotations

from gpulayer.train.callbacks import Callback, EarlyStopping
from gpulayer.train.errors import CheckpointError, TrainerError
from gpulayer.train.loggers import CSVLogger, Logger, TensorBoardLogger
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module
from gpulayer.train.seed import seed_everything
from gpulayer.train.trainer import Trainer

__all__ = [
    "CSVLogger",
    "Callback",
    "CheckpointError",
    "EarlyStopping",
    "Logger",
    "ModelCheckpoint",
    "Module",
    "TensorBoardLogger",
    "Trainer",
    "TrainerError",
    "seed_everything",
]
