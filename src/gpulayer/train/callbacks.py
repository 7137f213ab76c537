"""Callbacks: code that runs at fixed points of the loop, and the stock ones.

Hooks take ``(trainer, module, ...)`` like Lightning's. The loop calls a
per-batch hook only on callbacks that override it, so an unused hook costs
nothing per step. This module is also ``lightning.pytorch.callbacks`` for a
port: ``ModelCheckpoint``, ``EarlyStopping``, ``LearningRateMonitor`` and
``ModelSummary`` import from here; Lightning's callbacks GPUlayer does not
provide fail on import, naming themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from gpulayer.train.errors import TrainerError, invalid_choice

if TYPE_CHECKING:
    from gpulayer.train.module import Module
    from gpulayer.train.trainer import Trainer

__all__ = [
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
]

MODES = ("min", "max")
LR_INTERVALS = ("step", "epoch", None)
#: Lightning's callbacks GPUlayer does not provide, and what to do instead.
NOT_PROVIDED = {
    "RichProgressBar": "the Trainer shows plain-text progress (enable_progress_bar)",
    "TQDMProgressBar": "the Trainer shows plain-text progress (enable_progress_bar)",
    "ProgressBar": "the Trainer shows plain-text progress (enable_progress_bar)",
    "RichModelSummary": "use ModelSummary",
    "StochasticWeightAveraging": "use torch.optim.swa_utils in your own Callback",
    "WeightAveraging": "use torch.optim.swa_utils in your own Callback",
    "EMAWeightAveraging": "use torch.optim.swa_utils in your own Callback",
    "GradientAccumulationScheduler": "use Trainer(accumulate_grad_batches=N)",
    "BatchSizeFinder": "choose the batch size yourself",
    "LearningRateFinder": "choose the learning rate yourself",
    "DeviceStatsMonitor": "log device statistics in your own Callback",
    "BasePredictionWriter": "write predict()'s returned outputs yourself",
    "BackboneFinetuning": "freeze parameters (requires_grad_) in your own Callback",
    "BaseFinetuning": "freeze parameters (requires_grad_) in your own Callback",
    "ModelPruning": "use torch.nn.utils.prune in your own Callback",
    "OnExceptionCheckpoint": "resume from last.ckpt (ckpt_path='last')",
    "Timer": "use Trainer(max_steps=...) or set trainer.should_stop in a Callback",
    "ThroughputMonitor": "time steps in your own Callback",
    "SpikeDetection": "watch the loss in your own Callback",
    "LambdaCallback": "subclass Callback",
    "Checkpoint": "subclass ModelCheckpoint or Callback",
}


#: Every hook of Lightning 2.6.6's ``Callback`` (the public methods of
#: lightning/pytorch/callbacks/callback.py), kept as data:
#: tests/train/test_lightning_fit_parity.py compares it with the installed
#: Lightning. The Trainer calls each one that :class:`Callback` defines; a
#: callback overriding one it does not define is refused (it would not run).
LIGHTNING_CALLBACK_HOOKS = (
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "on_train_start",
    "on_train_end",
    "on_validation_start",
    "on_validation_end",
    "on_test_start",
    "on_test_end",
    "on_predict_start",
    "on_predict_end",
    "on_exception",
    "state_dict",
    "load_state_dict",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
)


class Callback:
    """Base class: override the hooks you need.

    Every hook of Lightning's ``Callback`` is here as a no-op, with the same
    signature, so ``super().on_fit_start(trainer, pl_module)`` works in a
    ported callback. The loop skips the no-ops: a hook costs something only
    where a subclass overrides it.
    """

    @property
    def state_key(self) -> str:
        """Identifies this callback's state in a checkpoint (``checkpoint["callbacks"]``)."""
        return type(self).__qualname__

    @property
    def _legacy_state_key(self) -> str | None:
        """The key GPUlayer's first checkpoint format used, if different."""
        return None

    def _generate_state_key(self, **kwargs: Any) -> str:
        """``ClassName{'key': value, ...}``: a state key as Lightning builds one."""
        return f"{type(self).__qualname__}{kwargs!r}"

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Called when fit, validate, test or predict begins (``stage``)."""

    def teardown(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        """Called when fit, validate, test or predict returns."""

    def on_fit_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_fit_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_sanity_check_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_sanity_check_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int
    ) -> None: ...
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_test_epoch_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_test_epoch_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: Module,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_test_batch_start(
        self,
        trainer: Trainer,
        pl_module: Module,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_predict_batch_start(
        self,
        trainer: Trainer,
        pl_module: Module,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_test_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_test_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_predict_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_predict_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_exception(
        self, trainer: Trainer, pl_module: Module, exception: BaseException
    ) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What to save in checkpoints (nothing is saved for an empty dict)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned."""

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]
    ) -> None: ...
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]
    ) -> None: ...
    def on_before_backward(
        self, trainer: Trainer, pl_module: Module, loss: torch.Tensor
    ) -> None: ...
    def on_after_backward(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: Module, optimizer: torch.optim.Optimizer
    ) -> None: ...
    def on_before_zero_grad(
        self, trainer: Trainer, pl_module: Module, optimizer: torch.optim.Optimizer
    ) -> None: ...


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
        return self._generate_state_key(monitor=self.monitor, mode=self.mode)  # Lightning's

    @property
    def _legacy_state_key(self) -> str:
        return f"EarlyStopping[monitor={self.monitor}]"

    def _on_train_epoch_end_applies(self, trainer: Trainer) -> bool:
        if self.check_on_train_epoch_end is not None:
            return self.check_on_train_epoch_end
        # As Lightning: validating once at each epoch's end, check at the train
        # epoch end, which sees the validation values and the training epoch's too.
        once_per_epoch = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
        return not trainer.validating_in_fit or once_per_epoch

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        # As Lightning: the sanity check's values are not a check.
        if trainer.sanity_checking:
            return
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
            # A tensor, as Lightning keeps it (its EarlyStopping calls .to() on it).
            "best_score": torch.tensor(self.best_score, dtype=torch.float64),
            "patience": self.patience,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = int(state_dict["wait_count"])
        self.stopped_epoch = int(state_dict["stopped_epoch"])
        self.best_score = float(state_dict["best_score"])  # a float or Lightning's tensor


class LearningRateMonitor(Callback):
    """Log each optimizer's learning rate as ``lr-<Optimizer>``, as Lightning does.

    ``logging_interval="step"`` logs at every logging step (``log_every_n_steps``),
    ``"epoch"`` at each epoch start, ``None`` at the interval of each optimizer's
    scheduler (an optimizer without one: both). Several parameter groups are
    ``lr-SGD/pg1``, ``lr-SGD/pg2`` (or ``lr-SGD/<group name>``);
    ``log_momentum`` adds ``lr-SGD-momentum`` (Adam's ``betas[0]``),
    ``log_weight_decay`` adds ``lr-SGD-weight_decay``.

    The values come from ``optimizer.param_groups``: Python floats, so logging
    them never waits on the device.
    """

    def __init__(
        self,
        logging_interval: str | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ) -> None:
        if logging_interval not in LR_INTERVALS:
            raise invalid_choice(
                "LearningRateMonitor(logging_interval)", logging_interval, LR_INTERVALS
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[float]] = {}

    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        if not trainer.loggers:
            raise TrainerError(
                "LearningRateMonitor needs a logger, but the Trainer has logger=False; "
                "pass logger=True (or a Logger), or remove LearningRateMonitor"
            )
        for optimizer, _ in self._optimizers(trainer):
            for key in ("lr", "momentum", "betas", "weight_decay"):
                for group in optimizer.param_groups:
                    _check_host_value(group.get(key), key, optimizer)
            names = [g.get("name", f"pg{i}") for i, g in enumerate(optimizer.param_groups, 1)]
            if len(set(names)) != len(names):
                raise TrainerError(
                    f"LearningRateMonitor: {type(optimizer).__name__} has parameter groups "
                    f"with the same name ({', '.join(map(str, names))}); give each group a "
                    f"different 'name'"
                )

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        if self.logging_interval != "step":
            self._log(trainer, "epoch" if self.logging_interval is None else "any")

    def on_train_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int
    ) -> None:
        # Before the batch's step, on the batches whose step will be logged.
        if self.logging_interval == "epoch":
            return
        if (trainer.global_step + 1) % trainer.log_every_n_steps and not trainer.should_stop:
            return
        self._log(trainer, "step" if self.logging_interval is None else "any")

    def _optimizers(self, trainer: Trainer) -> list[tuple[torch.optim.Optimizer, str | None]]:
        """Each optimizer with its scheduler's interval (None: it has no scheduler)."""
        run = getattr(trainer, "_run", None)
        intervals = {
            id(c.scheduler.optimizer): c.interval
            for c in (getattr(run, "schedulers", None) or [])
            if hasattr(c.scheduler, "optimizer")
        }
        return [(opt, intervals.get(id(opt))) for opt in trainer.optimizers]

    def _log(self, trainer: Trainer, interval: str) -> None:
        stats: dict[str, float] = {}
        seen: dict[type, int] = {}
        for optimizer, scheduled in self._optimizers(trainer):
            kind = type(optimizer)
            seen[kind] = seen.get(kind, 0) + 1
            if scheduled is not None and interval not in (scheduled, "any"):
                continue
            base = f"lr-{kind.__name__}" + (f"-{seen[kind] - 1}" if seen[kind] > 1 else "")
            stats.update(self._stats(optimizer, base))
        if not stats:
            return
        trainer.callback_metrics.update(stats)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(stats, trainer.global_step)

    def _stats(self, optimizer: torch.optim.Optimizer, base: str) -> dict[str, float]:
        groups = optimizer.param_groups
        uses_betas = "betas" in optimizer.defaults
        stats: dict[str, float] = {}
        for index, group in enumerate(groups, 1):
            if len(groups) > 1:
                name = f"{base}/{group.get('name', f'pg{index}')}"
            else:
                name = f"{base}/{group['name']}" if group.get("name") else base
            stats[name] = _host_float(group["lr"])
            self.lrs.setdefault(name, []).append(stats[name])
            if self.log_momentum:
                momentum = group["betas"][0] if uses_betas else group.get("momentum", 0.0)
                stats[f"{name}-momentum"] = _host_float(momentum)
            if self.log_weight_decay:
                stats[f"{name}-weight_decay"] = _host_float(group.get("weight_decay", 0.0))
        return stats


def _check_host_value(value: Any, key: str, optimizer: torch.optim.Optimizer) -> None:
    values = value if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    for item in values:
        if isinstance(item, torch.Tensor) and item.device.type != "cpu":
            raise TrainerError(
                f"LearningRateMonitor: {type(optimizer).__name__}'s {key} is a tensor on "
                f"{item.device}; reading it every logging step would wait on the device. "
                f"Keep {key} a float or a CPU tensor, or remove LearningRateMonitor"
            )


def _host_float(value: Any) -> float:
    # A float, or a CPU tensor (checked at train start): no device wait.
    return float(value)


class ModelSummary(Callback):
    """Print the module's layers and parameter counts when ``fit`` starts (rank 0),
    down to ``max_depth`` levels (-1: all), as Lightning's ModelSummary."""

    def __init__(self, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise TrainerError(f"ModelSummary(max_depth={max_depth!r}) must be an int >= -1")
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        if self.max_depth != 0 and trainer.is_global_zero:
            from gpulayer.train.summary import model_summary

            print(model_summary(module, max_depth=self.max_depth))


def __getattr__(name: str) -> Any:
    # `from gpulayer.train.callbacks import RichProgressBar` in a ported script
    # fails here, naming the callback, rather than with a bare ImportError.
    if name in NOT_PROVIDED:
        raise TrainerError(
            f"{name} is a Lightning callback GPUlayer does not provide; {NOT_PROVIDED[name]}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Last, because model_checkpoint imports Callback from this module (which
# gpulayer/train/__init__.py always loads first).
from gpulayer.train.model_checkpoint import ModelCheckpoint  # noqa: E402
