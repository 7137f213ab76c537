"""What ``configure_optimizers`` may return, read into one optimizer and its schedulers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpulayer.train.errors import TrainerError, invalid_choice

INTERVALS = ("epoch", "step")


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None


def _scheduler(item: Any, default_monitor: str | None) -> SchedulerConfig:
    if isinstance(item, Mapping):
        if "scheduler" not in item:
            raise TrainerError(
                f"an lr_scheduler dict needs a 'scheduler' key; got keys {sorted(item)}"
            )
        config = SchedulerConfig(
            item["scheduler"],
            item.get("interval", "epoch"),
            int(item.get("frequency", 1)),
            item.get("monitor", default_monitor),
        )
    else:
        config = SchedulerConfig(item, monitor=default_monitor)
    if config.interval not in INTERVALS:
        raise invalid_choice("lr_scheduler interval", config.interval, INTERVALS)
    if config.frequency < 1:
        raise TrainerError(f"lr_scheduler frequency={config.frequency} must be >= 1")
    plateau = isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if plateau and config.monitor is None:
        raise TrainerError(
            "ReduceLROnPlateau needs a metric: return {'optimizer': ..., "
            "'lr_scheduler': {'scheduler': ..., 'monitor': 'val_loss'}}"
        )
    return config


def parse_optimizers(
    value: Any, several: bool = False
) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """The optimizers (exactly one unless ``several``) and schedulers from
    ``configure_optimizers()``'s result."""
    if isinstance(value, str | bytes) or not isinstance(
        value, torch.optim.Optimizer | Mapping | Sequence
    ):
        raise TrainerError(
            f"configure_optimizers() returned {type(value).__name__}; return an "
            f"optimizer, ([optimizer], [schedulers]), or {{'optimizer': ..., "
            f"'lr_scheduler': ...}}"
        )
    optimizers: list[Any]
    schedulers: list[Any] = []
    monitor = None
    if isinstance(value, torch.optim.Optimizer):
        optimizers = [value]
    elif isinstance(value, Mapping):
        if "optimizer" not in value:
            raise TrainerError(
                f"configure_optimizers() returned a dict without 'optimizer' (keys: "
                f"{sorted(value)})"
            )
        optimizers = [value["optimizer"]]
        monitor = value.get("monitor")
        if value.get("lr_scheduler") is not None:
            schedulers = [value["lr_scheduler"]]
    elif len(value) == 2 and all(isinstance(v, Sequence) for v in value):
        optimizers, schedulers = list(value[0]), list(value[1])
    else:
        optimizers = list(value)
    if len(optimizers) != 1 and not (several and optimizers):
        raise TrainerError(
            f"configure_optimizers() returned {len(optimizers)} optimizers; the Trainer "
            f"drives exactly one (automatic optimization); for several, set "
            f"self.automatic_optimization = False and step them in training_step"
        )
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TrainerError(
                f"configure_optimizers() returned {type(optimizer).__name__} where a "
                f"torch.optim.Optimizer was expected"
            )
    return optimizers, [_scheduler(s, monitor) for s in schedulers]
