"""Callbacks: code that runs at fixed points of the loop, and EarlyStopping.

Hooks take ``(trainer, module, ...)`` like Lightning's. The loop calls a
per-batch hook only on callbacks that override it, so an unused hook costs
nothing per step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from gpulayer.train.errors import TrainerError, invalid_choice

if TYPE_CHECKING:
    from gpulayer.train.module import Module
    from gpulayer.train.trainer import Trainer

MODES = ("min", "max")


class Callback:
    """Base class: override the hooks you need."""

    @property
    def state_key(self) -> str:
        """Identifies this callback's state in a checkpoint."""
        return type(self).__qualname__

    def on_fit_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_fit_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_end(self, trainer: Trainer, module: Module) -> None: ...

    def on_train_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int
    ) -> None: ...

    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_save_checkpoint(
        self, trainer: Trainer, module: Module, checkpoint: dict[str, Any]
    ) -> None: ...

    def on_load_checkpoint(
        self, trainer: Trainer, module: Module, checkpoint: dict[str, Any]
    ) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def overrides(callback: Callback, hook: str) -> bool:
    """Whether ``callback`` replaces the base class's no-op ``hook``."""
    return getattr(type(callback), hook) is not getattr(Callback, hook)


def monitored_value(trainer: Trainer, monitor: str, who: str) -> float:
    """``trainer.callback_metrics[monitor]``, or an error naming what exists."""
    value = trainer.callback_metrics.get(monitor)
    if value is None:
        available = ", ".join(sorted(trainer.callback_metrics)) or "none yet"
        raise TrainerError(
            f"{who}(monitor={monitor!r}) found no metric {monitor!r}; logged metrics: "
            f"{available}. Log it with self.log({monitor!r}, value)"
        )
    return value


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` checks.

    It checks after each validation when the run has validation data, else at
    the end of each training epoch. ``check_on_train_epoch_end`` forces one.
    """

    def __init__(
        self,
        monitor: str,
        patience: int = 3,
        mode: str = "min",
        min_delta: float = 0.0,
        strict: bool = True,
        check_finite: bool = True,
        check_on_train_epoch_end: bool | None = None,
        verbose: bool = False,
    ) -> None:
        if mode not in MODES:
            raise invalid_choice("EarlyStopping(mode)", mode, MODES)
        if patience < 0:
            raise TrainerError(f"EarlyStopping(patience={patience!r}) must be >= 0")
        self.monitor = monitor
        self.patience = patience
        self.mode = mode
        self.min_delta = abs(min_delta)
        self.strict = strict
        self.check_finite = check_finite
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.verbose = verbose
        self.wait_count = 0
        self.stopped_epoch = -1
        self.best_score = math.inf if mode == "min" else -math.inf

    @property
    def state_key(self) -> str:
        return f"EarlyStopping[monitor={self.monitor}]"

    def _on_train_epoch_end_applies(self, trainer: Trainer) -> bool:
        if self.check_on_train_epoch_end is not None:
            return self.check_on_train_epoch_end
        return not trainer.validating_in_fit

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        if trainer.fitting and not self._on_train_epoch_end_applies(trainer):
            self._check(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self._on_train_epoch_end_applies(trainer):
            self._check(trainer)

    def _improved(self, current: float) -> bool:
        if self.mode == "min":
            return current < self.best_score - self.min_delta
        return current > self.best_score + self.min_delta

    def _check(self, trainer: Trainer) -> None:
        if not self.strict and self.monitor not in trainer.callback_metrics:
            return
        current = monitored_value(trainer, self.monitor, "EarlyStopping")
        reason = None
        if self.check_finite and not math.isfinite(current):
            reason = f"{self.monitor}={current} is not finite"
        elif self._improved(current):
            self.best_score = current
            self.wait_count = 0
        else:
            self.wait_count += 1
            if self.wait_count >= self.patience:
                reason = (
                    f"{self.monitor} did not improve on {self.best_score:.6g} for "
                    f"{self.wait_count} checks"
                )
        if reason is not None:
            self.stopped_epoch = trainer.current_epoch
            trainer.should_stop = True
            if self.verbose and trainer.is_global_zero:
                print(f"EarlyStopping at epoch {trainer.current_epoch}: {reason}")

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            "best_score": self.best_score,
            "patience": self.patience,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_count = state["wait_count"]
        self.stopped_epoch = state["stopped_epoch"]
        self.best_score = state["best_score"]
