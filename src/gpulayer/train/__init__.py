"""``gpulayer.train``: a PyTorch training loop that never waits on the host.

Importing this package imports torch (``pip install gpulayer[torch]``);
``import gpulayer`` alone does not. See ``docs/trainer.md``.

It also stands in for ``lightning.pytorch`` in a port: ``import
gpulayer.train as L`` gives ``L.LightningModule``, ``L.Trainer``,
``L.LightningDataModule``, ``L.Callback``, ``L.seed_everything``, and the
submodules ``L.callbacks``, ``L.loggers`` and ``L.profilers``
(``lightning.pytorch.callbacks``, ``.loggers`` and ``.profilers``). Nothing here imports lightning, torchmetrics or tensorboard.
"""

from __future__ import annotations

from gpulayer.train import callbacks, loggers, profilers
from gpulayer.train.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelSummary
from gpulayer.train.datamodule import LightningDataModule
from gpulayer.train.errors import CheckpointError, TrainerError
from gpulayer.train.loggers import CSVLogger, Logger, TensorBoardLogger
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module
from gpulayer.train.seed import seed_everything
from gpulayer.train.trainer import Trainer

#: Lightning's name for :class:`Module`.
LightningModule = Module

__all__ = [
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
]
