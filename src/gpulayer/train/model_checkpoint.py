"""ModelCheckpoint: when to write checkpoints, and which ones to keep."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

    ``dirpath`` defaults to ``<run dir>/checkpoints``. ``filename`` is a format
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
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename or "{epoch}-{step}"
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps
        self.every_n_epochs = every_n_epochs if (every_n_epochs or every_n_train_steps) else 1
        self.verbose = verbose
        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint[monitor={self.monitor}]"

    # ---- triggers --------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        if self.dirpath is None:
            self.dirpath = trainer.log_dir / "checkpoints"

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
        return {
            "dirpath": str(self.dirpath) if self.dirpath is not None else None,
            "monitor": self.monitor,
            "best_k_models": dict(self.best_k_models),
            "best_model_path": self.best_model_path,
            "best_model_score": self.best_model_score,
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Only continue ranking the files when they are in the same directory.
        if self.dirpath is not None and state.get("dirpath") == str(self.dirpath):
            self.best_k_models = dict(state["best_k_models"])
            self.best_model_path = state["best_model_path"]
            self.best_model_score = state["best_model_score"]
            self.last_model_path = state["last_model_path"]
