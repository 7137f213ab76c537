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

import torch

from gpulayer.train.errors import TrainerError
from gpulayer.train.module import (
    LIGHTNING_DATA_HOOKS,
    AttributeDict,
    init_arguments,
    move_to_device,
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


class LightningDataModule:
    """Subclass this and define the ``*_dataloader()`` methods you need."""

    #: As Lightning: False runs prepare_data on global rank 0 only.
    prepare_data_per_node: bool = True

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

    # ---- the hooks -------------------------------------------------------
    def prepare_data(self) -> None:
        """Download or write data (once per node); state set here is not shared."""

    def setup(self, stage: str) -> None:
        """Build datasets; runs on every rank."""

    def teardown(self, stage: str) -> None:
        """Release what setup built."""

    def train_dataloader(self) -> Any:
        return None

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

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
