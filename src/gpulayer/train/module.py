"""``Module``: a ``torch.nn.Module`` that knows how to train itself.

Shaped like Lightning's ``LightningModule`` so that porting a script is mostly
a change of imports; ``docs/trainer.md`` lists what differs.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch

from gpulayer.train.errors import TrainerError

if TYPE_CHECKING:
    from gpulayer.train.logging import MetricStore
    from gpulayer.train.trainer import Trainer

# Every hook Lightning 2.6.6 defines, kept here as data: the public methods of
# ModelHooks, DataHooks and CheckpointHooks in lightning/pytorch/core/hooks.py,
# and the loop methods a LightningModule may override
# (lightning/pytorch/core/module.py). tests/train/test_lightning_parity_loops.py
# checks the lists against the installed Lightning.
LIGHTNING_MODEL_HOOKS = (
    "configure_model",
    "configure_sharded_model",
    "on_after_backward",
    "on_before_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_fit_end",
    "on_fit_start",
    "on_predict_batch_end",
    "on_predict_batch_start",
    "on_predict_end",
    "on_predict_epoch_end",
    "on_predict_epoch_start",
    "on_predict_model_eval",
    "on_predict_start",
    "on_test_batch_end",
    "on_test_batch_start",
    "on_test_end",
    "on_test_epoch_end",
    "on_test_epoch_start",
    "on_test_model_eval",
    "on_test_model_train",
    "on_test_start",
    "on_train_batch_end",
    "on_train_batch_start",
    "on_train_end",
    "on_train_epoch_end",
    "on_train_epoch_start",
    "on_train_start",
    "on_validation_batch_end",
    "on_validation_batch_start",
    "on_validation_end",
    "on_validation_epoch_end",
    "on_validation_epoch_start",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_validation_model_zero_grad",
    "on_validation_start",
)
LIGHTNING_DATA_HOOKS = (
    "on_after_batch_transfer",
    "on_before_batch_transfer",
    "predict_dataloader",
    "prepare_data",
    "setup",
    "teardown",
    "test_dataloader",
    "train_dataloader",
    "transfer_batch_to_device",
    "val_dataloader",
)
LIGHTNING_CHECKPOINT_HOOKS = ("on_load_checkpoint", "on_save_checkpoint")
LIGHTNING_LOOP_METHODS = (
    "backward",
    "configure_callbacks",
    "configure_gradient_clipping",
    "lr_scheduler_step",
    "optimizer_step",
    "optimizer_zero_grad",
)
#: The Lightning hooks GPUlayer does not call: defining one is refused.
UNCALLED_HOOKS = {
    "configure_sharded_model": "it is deprecated in Lightning; use configure_model",
    "backward": "override on_before_backward/on_after_backward, or use manual optimization",
    "configure_callbacks": "pass the callbacks to Trainer(callbacks=...)",
    "configure_gradient_clipping": "use Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)",
    "lr_scheduler_step": "return a torch scheduler (stepped by the Trainer) or use manual optimization",
    "optimizer_step": "use on_before_optimizer_step, or manual optimization",
    "optimizer_zero_grad": "use on_before_zero_grad, or manual optimization",
}


def refuse_uncalled_hooks(obj: object, base: type, hooks: Iterable[str]) -> None:
    """Refuse ``obj`` if its class defines a Lightning hook that GPUlayer never calls.

    Such a hook would silently not run; among ``hooks``, the ones ``base``
    does not define are the ones GPUlayer does not call.
    """
    cls = type(obj)
    found = [
        name
        for name in hooks
        if name in UNCALLED_HOOKS or not hasattr(base, name)
        if getattr(cls, name, None) is not getattr(base, name, None)
    ]
    if found:
        advice = "; ".join(f"{n}: {UNCALLED_HOOKS.get(n, 'not supported')}" for n in found)
        raise TrainerError(
            f"{cls.__name__} defines {', '.join(found)}, which the GPUlayer Trainer never "
            f"calls (it would silently not run); remove it. Instead: {advice}"
        )


def init_arguments(frame: Any, names: tuple[str, ...], ignore: Iterable[str]) -> dict[str, Any]:
    """The ``__init__`` arguments seen in ``frame`` (for save_hyperparameters)."""
    args = inspect.getargvalues(frame)
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
    return {n: values[n] for n in chosen if n not in skip}


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``batch`` with every tensor in it (through lists, tuples, dicts) on ``device``.

    ``non_blocking``: a pinned host batch is copied while the GPU still works
    (never for copies to the host, which could be read before they land).
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, list):
        return [move_to_device(b, device, non_blocking) for b in batch]
    if isinstance(batch, tuple):
        moved = [move_to_device(b, device, non_blocking) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if isinstance(batch, Mapping):
        return type(batch)(  # type: ignore[call-arg]
            {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
        )
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


class DataHooks:
    """The data hooks a module and a datamodule share, as Lightning's
    ``DataHooks``: ``prepare_data`` once per node (local rank 0) before
    ``setup``; ``setup(stage)`` and ``teardown(stage)`` on every rank, with
    "fit", "validate", "test" or "predict"; the ``*_dataloader()`` a call
    reads; and the three steps of moving a batch to the device."""

    #: As Lightning: False runs prepare_data on global rank 0 only.
    prepare_data_per_node: bool = True

    def prepare_data(self) -> None:
        """Download or write data, once per node; state set here is not shared."""

    def setup(self, stage: str) -> None:
        """Build datasets; runs on every rank."""

    def teardown(self, stage: str) -> None:
        """Release what setup built; runs on every rank when the call returns."""

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


class Module(DataHooks, torch.nn.Module):
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
        # toggle_optimizer's record of each parameter's requires_grad.
        self._param_requires_grad_state: dict[torch.nn.Parameter, bool] = {}

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

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise TrainerError(
            f"{type(self).__name__} defines no test_step(batch, batch_idx), which test() needs"
        )

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        """As Lightning's default: the module called on the batch."""
        return self(batch)

    # ---- data: DataHooks (used when a call gets no dataloaders and no datamodule)
    def configure_model(self) -> None:
        """Build layers here to create them after setup (called once per call)."""

    # ---- hooks (no-ops unless overridden) ----------------------------------
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Return -1 to skip the rest of the epoch, as in Lightning."""
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(
        self, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_validation_model_zero_grad(self) -> None:
        self.zero_grad()

    def on_validation_model_eval(self) -> None:
        self.eval()

    def on_validation_model_train(self) -> None:
        """By default the loop puts back each submodule's mode from before."""

    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_model_eval(self) -> None:
        self.eval()

    def on_test_model_train(self) -> None:
        """By default the loop puts back each submodule's mode from before."""

    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(
        self, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_model_eval(self) -> None:
        self.eval()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...

    # ---- manual optimization -----------------------------------------------
    #: Set to False (in __init__) to step the optimizers yourself in training_step.
    automatic_optimization: bool = True

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer (or the list of them) from configure_optimizers.

        Their ``step()`` goes through the precision's gradient scaler and
        counts in ``global_step``, as Lightning's wrappers do.
        """
        wrapped = self.trainer._manual_optimizers()
        found: list[Any] = wrapped if use_pl_optimizer else [w.optimizer for w in wrapped]
        return found[0] if len(found) == 1 else found

    def lr_schedulers(self) -> Any:
        """The scheduler (or list of them), or None; step them yourself."""
        found = self.trainer.lr_schedulers
        if not found:
            return None
        return found[0] if len(found) == 1 else found

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` through the precision's scaler, with the backward hooks."""
        self.trainer._backward(loss, *args, **kwargs)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters compute gradients until
        :meth:`untoggle_optimizer`, as Lightning's (the GAN pattern): every other
        optimizer's parameters get ``requires_grad=False``; the settings from
        before are kept, and ``optimizer``'s own parameters keep theirs."""
        chosen = self._configured_optimizer(optimizer, "toggle_optimizer")
        saved: dict[torch.nn.Parameter, bool] = {}
        for opt in self.trainer.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param not in saved:  # a parameter two optimizers share
                        saved[param] = param.requires_grad
                        param.requires_grad = False
        for group in chosen.param_groups:
            for param in group["params"]:
                param.requires_grad = saved[param]
        self._param_requires_grad_state = saved

    def untoggle_optimizer(self, optimizer: Any) -> None:
        """Put back the ``requires_grad`` that :meth:`toggle_optimizer` turned off."""
        chosen = self._configured_optimizer(optimizer, "untoggle_optimizer")
        saved = self._param_requires_grad_state
        for opt in self.trainer.optimizers:
            if opt is chosen:
                continue
            for group in opt.param_groups:
                for param in group["params"]:
                    if param in saved:
                        param.requires_grad = saved[param]
        self._param_requires_grad_state = {}

    @contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``toggle_optimizer`` for the ``with`` block, then ``untoggle_optimizer``."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def _configured_optimizer(self, optimizer: Any, what: str) -> torch.optim.Optimizer:
        """The torch optimizer behind ``optimizer`` (or what ``self.optimizers()`` gave)."""
        chosen = getattr(optimizer, "optimizer", optimizer)  # self.optimizers() wraps them
        configured = self.trainer.optimizers
        if not any(chosen is opt for opt in configured):
            raise TrainerError(
                f"{what}() got {type(optimizer).__name__}, which is not one of the "
                f"{len(configured)} optimizer(s) configure_optimizers() returned; pass one "
                f"of self.optimizers()"
            )
        return chosen  # type: ignore[no-any-return]

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
        add_dataloader_idx: bool = True,
    ) -> None:
        """Record ``value`` without reading it: it stays on its device.

        Defaults follow Lightning: in training ``on_step=True, on_epoch=False``,
        in validation ``on_step=False, on_epoch=True``. With several evaluation
        dataloaders the name gets ``/dataloader_idx_N`` unless
        ``add_dataloader_idx=False``. Outside a running loop this does nothing.
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
                add_dataloader_idx=add_dataloader_idx,
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
    def logger(self) -> Any:
        """The Trainer's first logger (None without loggers), as Lightning."""
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        return trainer.logger if trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        return list(trainer.loggers) if trainer is not None else []

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
        self.hparams.update(init_arguments(caller, names, ignore))

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
