"""``LightningDataModule``: the data of a run, with the set-up that makes it.

Shaped like Lightning's: ``prepare_data`` runs once per node (local rank 0;
every other rank waits for it), then ``setup(stage)`` on every rank, then the
Trainer asks for the ``*_dataloader()`` the call needs; ``teardown(stage)``
runs when the call returns. ``stage`` is ``"fit"``, ``"validate"``,
``"test"`` or ``"predict"``. Given a datamodule, a call takes its data from
the datamodule only, never from the module's own ``*_dataloader()``.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gpulayer.train.errors import TrainerError
from gpulayer.train.module import (
    LIGHTNING_DATA_HOOKS,
    AttributeDict,
    DataHooks,
    init_arguments,
    refuse_uncalled_hooks,
)

if TYPE_CHECKING:
    from gpulayer.train.trainer import Trainer

#: The dataloader method each call reads, by stage.
LOADERS = {
    "train": "train_dataloader",
    "validate": "val_dataloader",
    "test": "test_dataloader",
    "predict": "predict_dataloader",
}


class LightningDataModule(DataHooks):
    """Subclass this and define the ``*_dataloader()`` methods you need."""

    def __init__(self) -> None:
        self.hparams = AttributeDict()
        self._trainer_ref: weakref.ref[Trainer] | None = None

    @property
    def trainer(self) -> Trainer | None:
        return self._trainer_ref() if self._trainer_ref is not None else None

    @trainer.setter
    def trainer(self, trainer: Trainer | None) -> None:
        self._trainer_ref = weakref.ref(trainer) if trainer is not None else None

    def save_hyperparameters(self, *names: str, ignore: Iterable[str] = ()) -> None:
        """Store the caller's ``__init__`` arguments in ``self.hparams``."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is not None:
            self.hparams.update(init_arguments(caller, names, ignore))

    # ---- the hooks (and DataHooks') -------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        """Called when fit/validate/test/predict raises."""

    def state_dict(self) -> dict[str, Any]:
        """Saved in checkpoints under the class's name when not empty."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


#: The alias GPUlayer's own names use.
DataModule = LightningDataModule


def defines(obj: object, base: type, name: str) -> bool:
    """Whether ``obj``'s class overrides ``base``'s ``name``."""
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def check_datamodule(datamodule: Any) -> LightningDataModule:
    if not isinstance(datamodule, LightningDataModule):
        raise TrainerError(
            f"datamodule must be a gpulayer.train.LightningDataModule; got "
            f"{type(datamodule).__name__}"
        )
    refuse_uncalled_hooks(datamodule, LightningDataModule, LIGHTNING_DATA_HOOKS)
    return datamodule
