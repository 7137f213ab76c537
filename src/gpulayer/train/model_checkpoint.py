"""ModelCheckpoint: when to write checkpoints, and which ones to keep."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpulayer.train import distributed
from gpulayer.train.callbacks import MODES, Callback, monitored_value
from gpulayer.train.errors import TrainerError, invalid_choice

if TYPE_CHECKING:
    from gpulayer.train.module import Module
    from gpulayer.train.trainer import Trainer

LAST_NAME = "last"
SUFFIX = ".ckpt"
_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


class ModelCheckpoint(Callback):
    """Write checkpoints at the end of epochs or every N optimizer steps.

    * no ``monitor``: keep the latest ``save_top_k`` (0, 1 or -1 for all);
    * with ``monitor``: keep the ``save_top_k`` best by ``mode``;
    * ``save_last``: also keep ``last.ckpt`` (what ``ckpt_path="last"`` finds),
      refreshed at every save and when training ends.

    As Lightning, the epoch's save happens at the end of the training epoch,
    or after each validation when validation does not run exactly once per
    epoch (``val_check_interval`` below 1, ``check_val_every_n_epoch`` above
    1); ``save_on_train_epoch_end`` chooses.

    ``dirpath`` defaults, as in Lightning, to ``checkpoints/`` in the first
    logger's directory when that logger was given a ``save_dir``
    (``<save_dir>/<name>/<version>/checkpoints``); otherwise, unlike
    Lightning's ``<default_root_dir>/checkpoints``, to the run directory's
    ``checkpoints/``, so that each run keeps its own. ``filename`` is a format
    string over ``epoch``, ``step`` and logged metrics; as in Lightning,
    ``"{epoch}-{val_loss:.2f}"`` becomes ``epoch=3-val_loss=0.12.ckpt``.
    Only global rank 0 writes or deletes files.
    """

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        verbose: bool = False,
    ) -> None:
        if mode not in MODES:
            raise invalid_choice("ModelCheckpoint(mode)", mode, MODES)
        if save_top_k < -1:
            raise TrainerError(f"ModelCheckpoint(save_top_k={save_top_k!r}) must be >= -1")
        if monitor is None and save_top_k > 1:
            raise TrainerError(
                f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) has no quantity "
                f"to rank checkpoints by; set monitor=..., or save_top_k to -1, 0 or 1"
            )
        for name, n in (
            ("every_n_train_steps", every_n_train_steps),
            ("every_n_epochs", every_n_epochs),
        ):
            if n is not None and n < 1:
                raise TrainerError(f"ModelCheckpoint({name}={n!r}) must be >= 1 or None")
        if save_on_train_epoch_end is not None and not isinstance(save_on_train_epoch_end, bool):
            raise TrainerError(
                f"ModelCheckpoint(save_on_train_epoch_end={save_on_train_epoch_end!r}) must be "
                f"True, False or None (decide from the validation schedule)"
            )
        # As Lightning: a given directory is made absolute (and ~ expanded) at once.
        self.dirpath = (
            Path(os.path.realpath(os.path.expanduser(dirpath))) if dirpath is not None else None
        )
        self.filename = filename or "{epoch}-{step}"
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs if (every_n_epochs or every_n_train_steps) else 1
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.verbose = verbose
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.current_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1

    @property
    def state_key(self) -> str:
        # Lightning's key, so that each trainer finds the other's state.
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self.every_n_train_steps or 0,
            every_n_epochs=self.every_n_epochs or 0,
            train_time_interval=None,
        )

    @property
    def _legacy_state_key(self) -> str:
        return f"ModelCheckpoint[monitor={self.monitor}]"

    # ---- triggers --------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        # As Lightning: the directory is chosen when the call starts, on rank 0.
        if self.dirpath is None:
            dirpath = default_dirpath(trainer) if trainer.is_global_zero else None
            if trainer.world_size > 1:
                dirpath = distributed.broadcast_object(dirpath)
            self.dirpath = dirpath

    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_train_steps
        step = trainer.global_step
        if n and step % n == 0 and step != self._last_saved_step and trainer.at_step_boundary:
            if self.monitor is not None:
                trainer.refresh_metrics()  # one host read every n steps, not per step
            self._save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self._saves_on_train_epoch_end(trainer):
            self._save_epoch(trainer)

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        fitting = trainer.fitting and not trainer.sanity_checking
        if fitting and not self._saves_on_train_epoch_end(trainer):
            self._save_epoch(trainer)

    def _saves_on_train_epoch_end(self, trainer: Trainer) -> bool:
        """Lightning's rule: at the training epoch's end unless validation runs
        other than once at each epoch's end (then after each validation)."""
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        run = getattr(trainer, "_run", None)
        validates = (
            trainer.validating_in_fit
            and run is not None
            and run.val_data is not None
            and run.val_limit != 0
        )
        return not validates or trainer.val_check_interval == 1.0

    def _save_epoch(self, trainer: Trainer) -> None:
        n = self.every_n_epochs
        if (
            n
            and (trainer.current_epoch + 1) % n == 0
            and trainer.global_step != self._last_saved_step
        ):
            self._save(trainer)

    def on_train_end(self, trainer: Trainer, module: Module) -> None:
        if self.save_last and trainer.global_step != self._last_saved_step:
            self._save_last(trainer)
            self._last_saved_step = trainer.global_step

    # ---- saving ----------------------------------------------------------
    def format_name(self, trainer: Trainer) -> str:
        fields: dict[str, Any] = {
            **trainer.callback_metrics,
            "epoch": trainer.current_epoch,
            "step": trainer.global_step,
        }

        def fill(match: re.Match[str]) -> str:
            key, spec = match.group(1), (match.group(2) or ":")[1:]
            if key not in fields:
                raise TrainerError(
                    f"ModelCheckpoint(filename={self.filename!r}) names {key!r}, which "
                    f"is not among epoch, step, or the logged metrics "
                    f"({', '.join(sorted(trainer.callback_metrics)) or 'none'})"
                )
            return f"{key}={format(fields[key], spec)}"

        return _FIELD.sub(fill, self.filename)

    def _better(self, score: float, than: float) -> bool:
        return score < than if self.mode == "min" else score > than

    def _save(self, trainer: Trainer) -> None:
        self._last_saved_step = trainer.global_step
        assert self.dirpath is not None
        if self.save_top_k != 0:
            path = str(self.dirpath / (self.format_name(trainer) + SUFFIX))
            if self.monitor is None:
                self._keep(trainer, path, math.nan, drop_others=self.save_top_k == 1)
            else:
                value = monitored_value(trainer, self.monitor, "ModelCheckpoint")
                self._consider(trainer, path, value)
        if self.save_last:
            self._save_last(trainer)

    def _consider(self, trainer: Trainer, path: str, score: float) -> None:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            self._keep(trainer, path, score, drop_others=False)
        else:
            worst = self._worst()
            if self._better(score, self.best_k_models[worst]):
                self._keep(trainer, path, score, drop_others=False)
                self._drop(trainer, worst)
            else:
                return  # as Lightning: not among the best, nothing changes
        self.current_score = score
        best = min if self.mode == "min" else max
        self.best_model_path = best(self.best_k_models, key=self.best_k_models.__getitem__)
        self.best_model_score = self.best_k_models[self.best_model_path]

    def _worst(self) -> str:
        pick = max if self.mode == "min" else min
        return pick(self.best_k_models, key=self.best_k_models.__getitem__)

    def _keep(self, trainer: Trainer, path: str, score: float, *, drop_others: bool) -> None:
        trainer.save_checkpoint(path)
        if drop_others:
            for old in list(self.best_k_models):
                if old != path:
                    self._drop(trainer, old)
            self.best_model_path = path
        self.best_k_models[path] = score
        if self.verbose and trainer.is_global_zero:
            print(f"ModelCheckpoint: saved {path}")

    def _drop(self, trainer: Trainer, path: str) -> None:
        self.best_k_models.pop(path, None)
        if trainer.is_global_zero and path != self.last_model_path:
            Path(path).unlink(missing_ok=True)

    def _save_last(self, trainer: Trainer) -> None:
        assert self.dirpath is not None
        path = self.dirpath / (LAST_NAME + SUFFIX)
        trainer.save_checkpoint(path)
        self.last_model_path = str(path)

    def state_dict(self) -> dict[str, Any]:
        """Lightning's keys, with the scores as tensors as Lightning keeps them."""
        kth_path, kth_value = "", math.inf if self.mode == "min" else -math.inf
        if self.monitor is not None and 0 < self.save_top_k == len(self.best_k_models):
            kth_path = self._worst()
            kth_value = self.best_k_models[kth_path]
        return {
            "monitor": self.monitor,
            "best_model_score": _tensor(self.best_model_score),
            "best_model_path": self.best_model_path,
            "current_score": _tensor(self.current_score),
            "dirpath": str(self.dirpath) if self.dirpath is not None else None,
            "best_k_models": {p: _tensor(v) for p, v in self.best_k_models.items()},
            "kth_best_model_path": kth_path,
            "kth_value": _tensor(kth_value),
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # As Lightning: the ranking continues only over files in the same
        # directory; the best model's path is taken from anywhere.
        if state_dict.get("dirpath") == (str(self.dirpath) if self.dirpath else None):
            self.best_model_score = _float(state_dict.get("best_model_score"))
            self.current_score = _float(state_dict.get("current_score"))
            self.best_k_models = {
                str(p): float(v) for p, v in (state_dict.get("best_k_models") or {}).items()
            }
            self.last_model_path = state_dict.get("last_model_path", self.last_model_path)
        self.best_model_path = state_dict.get("best_model_path", self.best_model_path)


def default_dirpath(trainer: Trainer) -> Path:
    """Where checkpoints go without ``dirpath``: ``checkpoints/`` in the first
    logger's own directory (it was given a ``save_dir``), as in Lightning, or
    else in the run directory."""
    own = trainer.loggers[0].own_dir if trainer.loggers else None
    return (own if own is not None else trainer.log_dir) / "checkpoints"


def _tensor(value: float | None) -> torch.Tensor | None:
    # float64: the host float survives the trip exactly.
    return None if value is None else torch.tensor(value, dtype=torch.float64)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)  # a float, or Lightning's tensor
