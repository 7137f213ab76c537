"""``Module``: a ``torch.nn.Module`` that knows how to train itself.

Shaped like Lightning's ``LightningModule`` so that porting a script is mostly
a change of imports; ``docs/trainer.md`` lists what differs.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from gpulayer.train.errors import TrainerError

if TYPE_CHECKING:
    from gpulayer.train.logging import MetricStore
    from gpulayer.train.trainer import Trainer


def move_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (through lists, tuples, dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        # non_blocking: a pinned host batch is copied while the GPU still works.
        return batch.to(device, non_blocking=True)
    if isinstance(batch, list):
        return [move_to_device(b, device) for b in batch]
    if isinstance(batch, tuple):
        moved = [move_to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if isinstance(batch, Mapping):
        return type(batch)({k: move_to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    return batch


class AttributeDict(dict[str, Any]):
    """A dict whose keys read as attributes too: ``self.hparams.lr``, as in Lightning."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no hyperparameter {name!r}; saved: {', '.join(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


class Module(torch.nn.Module):
    """Subclass this; define ``training_step`` and ``configure_optimizers``.

    ``training_step(batch, batch_idx)`` returns the loss (a tensor, or a dict
    with a ``"loss"`` key, or None to skip the backward of that batch).
    ``validation_step`` is optional. The ``on_*`` hooks do nothing unless
    overridden.
    """

    # Declared so that type checkers do not read them through nn.Module.__getattr__.
    _trainer_ref: weakref.ref[Trainer] | None
    _metric_store: MetricStore | None
    hparams: AttributeDict

    def __init__(self) -> None:
        super().__init__()
        self.hparams = AttributeDict()
        # Plain attributes, set past nn.Module.__setattr__'s checks.
        object.__setattr__(self, "_trainer_ref", None)
        object.__setattr__(self, "_metric_store", None)

    # ---- the steps -------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise TrainerError(f"{type(self).__name__} must define training_step(batch, batch_idx)")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise TrainerError(
            f"{type(self).__name__} was given validation data but defines no "
            f"validation_step(batch, batch_idx)"
        )

    def configure_optimizers(self) -> Any:
        raise TrainerError(
            f"{type(self).__name__} must define configure_optimizers() returning an "
            f"optimizer, (optimizers, schedulers), or a dict with 'optimizer' and "
            f"optionally 'lr_scheduler'"
        )

    def train_dataloader(self) -> Any:
        """Training data when ``fit`` is given none (optional)."""
        return None

    def val_dataloader(self) -> Any:
        """Validation data when ``fit``/``validate`` are given none (optional)."""
        return None

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        return move_to_device(batch, device)

    # ---- hooks -----------------------------------------------------------
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...

    # ---- logging ---------------------------------------------------------
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        batch_size: int | None = None,
        sync_dist: bool = False,
    ) -> None:
        """Record ``value`` without reading it: it stays on its device.

        Defaults follow Lightning: in training ``on_step=True, on_epoch=False``,
        in validation ``on_step=False, on_epoch=True``. Outside a running loop
        this does nothing.
        """
        store = self._metric_store
        if store is not None:
            store.log(
                name,
                value,
                prog_bar=prog_bar,
                logger=logger,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                batch_size=batch_size,
                sync_dist=sync_dist,
            )

    def log_dict(self, metrics: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None or trainer.is_global_zero:
            print(*args, **kwargs)

    # ---- state the Trainer provides ---------------------------------------
    @property
    def trainer(self) -> Trainer:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None:
            raise TrainerError(f"{type(self).__name__} is not attached to a Trainer")
        return trainer

    def _attach(self, trainer: Trainer | None, store: MetricStore | None = None) -> None:
        ref = weakref.ref(trainer) if trainer is not None else None
        object.__setattr__(self, "_trainer_ref", ref)
        object.__setattr__(self, "_metric_store", store)

    @property
    def device(self) -> torch.device:
        for param in self.parameters():
            return param.device
        for buffer in self.buffers():
            return buffer.device
        return torch.device("cpu")

    @property
    def global_step(self) -> int:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        return trainer.global_step if trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        return trainer.current_epoch if trainer is not None else 0

    @property
    def global_rank(self) -> int:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        return trainer.global_rank if trainer is not None else 0

    # ---- hyperparameters and loading -------------------------------------
    def save_hyperparameters(self, *names: str, ignore: Iterable[str] = ()) -> None:
        """Store the caller's ``__init__`` arguments in ``self.hparams``.

        They are saved in checkpoints, and :meth:`load_from_checkpoint` passes
        them back to ``__init__``.
        """
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:  # pragma: no cover - CPython always has frames
            return
        args = inspect.getargvalues(caller)
        values = {n: args.locals[n] for n in args.args if n != "self"}
        if args.keywords:
            values.update(args.locals[args.keywords])
        skip = set(ignore)
        chosen = names or tuple(values)
        unknown = [n for n in chosen if n not in values]
        if unknown:
            raise TrainerError(
                f"save_hyperparameters{tuple(names)!r}: {', '.join(unknown)} not among "
                f"the __init__ arguments ({', '.join(values) or 'none'})"
            )
        self.hparams.update({n: values[n] for n in chosen if n not in skip})

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: str | Path,
        map_location: str | torch.device | None = None,
        weights_only: bool = True,
        **kwargs: Any,
    ) -> Self:
        """Build the module from its saved hyperparameters and load its weights."""
        from gpulayer.train.checkpoint import load_checkpoint

        checkpoint = load_checkpoint(checkpoint_path, map_location, weights_only=weights_only)
        module = cls(**{**checkpoint.get("hyper_parameters", {}), **kwargs})
        module.on_load_checkpoint(checkpoint)
        module.load_state_dict(checkpoint["state_dict"])
        return module
