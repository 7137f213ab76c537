"""``gpulayer.train``: a PyTorch training loop that never waits on the host.

Importing this package imports torch (``pip install gpulayer[torch]``);
``import gpulayer`` alone does not. See ``docs/trainer.md``.

It also stands in for ``lightning.pytorch`` in a port: ``import
gpulayer.train as L`` gives ``L.LightningModule``, ``L.Trainer``,
``L.LightningDataModule``, ``L.Callback``, ``L.seed_everything``, and the
submodules ``L.callbacks``, ``L.loggers`` and ``L.profilers``
(``lightning.pytorch.callbacks``, ``.loggers`` and ``.profilers``);
``gpulayer.train.cli`` refuses ``LightningCLI`` by name. Nothing here
imports lightning, torchmetrics or tensorboard.
"""

from __future__ import annotations

from gpulayer.train import callbacks, loggers, profilers
from gpulayer.train.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelSummary
from gpulayer.train.cli import cli_lightning_logo as cli_lightning_logo
from gpulayer.train.datamodule import LightningDataModule
from gpulayer.train.errors import CheckpointError, TrainerError
from gpulayer.train.loggers import CSVLogger, Logger, TensorBoardLogger
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module
from gpulayer.train.seed import seed_everything
from gpulayer.train.trainer import Trainer

# cli_lightning_logo, like Lightning's, is not in __all__; importing it also
# loads gpulayer.train.cli, where LightningCLI is refused by name.

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
