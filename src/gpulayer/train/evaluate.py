"""The evaluation loops: validation (also the sanity check), test and predict.

Hooks run in Lightning's order: the module's ``on_<stage>_model_eval``,
then for the start, epoch start, each batch, epoch end and end, the
callbacks' hook before the module's; the submodules' train/eval modes from
before the loop are put back at its end. Nothing here runs per training
step; values logged are read to the host once, at the end of the loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpulayer.train.callbacks import Callback, EarlyStopping
from gpulayer.train.checkpoint import capture_rng_states, load_checkpoint, restore_rng_states
from gpulayer.train.config import check_validation_step, resolve_ckpt_path, resolve_limit
from gpulayer.train.data import check_reiterable, shard
from gpulayer.train.datamodule import LOADERS, LightningDataModule
from gpulayer.train.errors import TrainerError
from gpulayer.train.logging import MetricStore, to_host
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module, move_to_device

if TYPE_CHECKING:
    from gpulayer.train.fit import Run
    from gpulayer.train.trainer import Trainer

Hook = Callable[..., Any]


def callback_hooks(callbacks: list[Callback], name: str) -> list[Hook]:
    """The bound ``name`` hooks of the callbacks that define it (not as a no-op base)."""
    base = getattr(Callback, name, None)
    return [
        getattr(cb, name)
        for cb in callbacks
        if getattr(type(cb), name, None) is not None and getattr(type(cb), name) is not base
    ]


def call_callbacks(trainer: Trainer, run: Run, name: str, *args: Any) -> None:
    module = run.module
    for hook in callback_hooks(run.callbacks, name):
        hook(trainer, module, *args)


def overridden(module: Module, name: str) -> bool:
    return getattr(type(module), name) is not getattr(Module, name)


class _NoLogging(MetricStore):
    """Lightning refuses ``self.log`` in predict; so does GPUlayer, rather than drop it."""

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        raise TrainerError(
            f"self.log({name!r}, ...) was called during predict, which logs nothing (as "
            f"in Lightning); return the value from predict_step instead"
        )


@contextmanager
def _isolated_rng() -> Iterator[None]:
    states = capture_rng_states()
    try:
        yield
    finally:
        restore_rng_states(states)


def _capture_modes(module: torch.nn.Module) -> dict[torch.nn.Module, bool]:
    return {m: m.training for m in module.modules()}


def _restore_modes(modes: dict[torch.nn.Module, bool]) -> None:
    for m, training in modes.items():
        m.training = training


def evaluation_loop(
    trainer: Trainer,
    run: Run,
    stage: str,
    data: Any,
    limit: int | None,
    *,
    sanity: bool = False,
) -> dict[str, float]:
    """Run ``stage`` ("validation" or "test") over ``data`` once; return its metrics."""
    module, device, precision = run.module, run.device, run.precision
    store = run.val_store if stage == "validation" else run.test_store
    callbacks = run.callbacks
    if sanity:
        # Lightning's own callbacks skip the sanity check; these would act on it.
        callbacks = [cb for cb in callbacks if not isinstance(cb, EarlyStopping | ModelCheckpoint)]

    def hooks(name: str) -> list[Hook]:
        return callback_hooks(callbacks, name)

    store.reset()
    module._attach(trainer, store)
    modes = _capture_modes(module)
    getattr(module, f"on_{stage}_model_eval")()
    for name in (f"on_{stage}_start", f"on_{stage}_epoch_start"):
        for hook in hooks(name):
            hook(trainer, module)
        getattr(module, name)()
    starts, ends = hooks(f"on_{stage}_batch_start"), hooks(f"on_{stage}_batch_end")
    module_start = getattr(module, f"on_{stage}_batch_start")
    module_end = getattr(module, f"on_{stage}_batch_end")
    step = getattr(module, f"{stage}_step")
    with torch.no_grad():
        for batch_idx, batch in enumerate(itertools.islice(data, limit)):
            batch = run.transfer(batch, device)
            store.batch = batch
            for hook in starts:
                hook(trainer, module, batch, batch_idx)
            module_start(batch, batch_idx)
            with precision.autocast():
                output = step(batch, batch_idx)
            for hook in ends:
                hook(trainer, module, output, batch, batch_idx)
            module_end(output, batch, batch_idx)
    for hook in hooks(f"on_{stage}_epoch_end"):
        hook(trainer, module)
    getattr(module, f"on_{stage}_epoch_end")()
    host = to_host({**store.step_values(), **store.epoch_values(run.reducer)})
    if not sanity:
        trainer.callback_metrics.update(host)
    for hook in hooks(f"on_{stage}_end"):
        hook(trainer, module)
    getattr(module, f"on_{stage}_end")()
    if overridden(module, f"on_{stage}_model_train"):
        getattr(module, f"on_{stage}_model_train")()
    else:
        _restore_modes(modes)
    return host


def sanity_check(trainer: Trainer, run: Run, steps: int, has_data: Callable[[], bool]) -> None:
    """Lightning's ``num_sanity_val_steps``: a few validation batches before training.

    Metrics are discarded and the RNG states put back, so training is the same
    as without it. ``has_data`` asks for the validation data (after
    ``on_sanity_check_start``, as Lightning).
    """
    trainer.sanity_checking = True
    try:
        with _isolated_rng():
            call_callbacks(trainer, run, "on_sanity_check_start")
            if has_data():
                limit = run.val_limit
                limit = limit if steps < 0 else min(steps, steps if limit is None else limit)
                evaluation_loop(trainer, run, "validation", run.val_data, limit, sanity=True)
            call_callbacks(trainer, run, "on_sanity_check_end")
    finally:
        trainer.sanity_checking = False


def predict_loop(
    trainer: Trainer, run: Run, data: Any, limit: int | None, keep: bool
) -> list[Any] | None:
    """``predict_step`` over ``data``; the outputs (moved to the CPU) if ``keep``."""
    module, device, precision = run.module, run.device, run.precision
    module._attach(trainer, _NoLogging(on_step=False, on_epoch=True))
    modes = _capture_modes(module)
    module.on_predict_model_eval()
    for name in ("on_predict_start", "on_predict_epoch_start"):
        call_callbacks(trainer, run, name)
        getattr(module, name)()
    starts = callback_hooks(run.callbacks, "on_predict_batch_start")
    ends = callback_hooks(run.callbacks, "on_predict_batch_end")
    predictions: list[Any] = []
    with torch.no_grad():
        for batch_idx, batch in enumerate(itertools.islice(data, limit)):
            batch = run.transfer(batch, device)
            for hook in starts:
                hook(trainer, module, batch, batch_idx)
            module.on_predict_batch_start(batch, batch_idx)
            with precision.autocast():
                output = module.predict_step(batch, batch_idx)
            if keep:
                # As Lightning: kept on the CPU, so that device memory does not grow.
                predictions.append(move_to_device(output, torch.device("cpu"), non_blocking=False))
            for hook in ends:
                hook(trainer, module, output, batch, batch_idx)
            module.on_predict_batch_end(output, batch, batch_idx)
    for name in ("on_predict_epoch_end", "on_predict_end"):
        call_callbacks(trainer, run, name)
        getattr(module, name)()
    _restore_modes(modes)
    module._attach(trainer)
    return predictions if keep else None


# -- the calls: validate(), test(), predict() -----------------------------------


def run_evaluation(
    trainer: Trainer,
    fn: str,
    model: Module | None,
    dataloaders: Any,
    ckpt_path: str | Path | None,
    verbose: bool,
    datamodule: LightningDataModule | None,
) -> list[dict[str, float]]:
    """``trainer.validate()`` or ``trainer.test()`` (``fn``): ``[metrics]``."""
    if isinstance(dataloaders, LightningDataModule):
        datamodule, dataloaders = dataloaders, None
    model, path = _evaluated_model(trainer, fn, model, dataloaders, datamodule, ckpt_path)
    source = trainer._source(fn, model, datamodule, dataloaders, "dataloaders")
    if source is None:
        raise TrainerError(
            f"{fn}() needs data: pass dataloaders=..., a datamodule, or define "
            f"{type(model).__name__}.{LOADERS[fn]}()"
        )
    stage = "validation" if fn == "validate" else "test"
    check_validation_step(model, f"{stage}_step")
    limit_name = f"limit_{'val' if fn == 'validate' else 'test'}_batches"

    def body(run: Run) -> list[dict[str, float]]:
        _load_weights(run, path)
        data = _eval_data(trainer, run, source, "dataloaders")
        limit = resolve_limit(limit_name, getattr(trainer, limit_name), data)
        metrics = evaluation_loop(trainer, run, stage, data, limit)
        if trainer.is_global_zero:
            store = run.val_store if stage == "validation" else run.test_store
            logged = {k: v for k, v in metrics.items() if k in store.keys_where("logger")}
            trainer.logged_metrics.update(logged)
            for logger in trainer.loggers:
                logger.log_metrics(logged, trainer.global_step)
            if verbose:
                for key, value in metrics.items():
                    print(f"{key}: {value:.6g}")
        return [metrics]

    return trainer._call(fn, model, datamodule, body)


def run_prediction(
    trainer: Trainer,
    model: Module | None,
    dataloaders: Any,
    datamodule: LightningDataModule | None,
    return_predictions: bool | None,
    ckpt_path: str | Path | None,
) -> list[Any] | None:
    """``trainer.predict()``: the per-batch results of ``predict_step``, on the CPU."""
    if isinstance(dataloaders, LightningDataModule):
        datamodule, dataloaders = dataloaders, None
    model, path = _evaluated_model(trainer, "predict", model, dataloaders, datamodule, ckpt_path)
    source = trainer._source("predict", model, datamodule, dataloaders, "dataloaders")
    if source is None:
        raise TrainerError(
            "predict() needs data: pass dataloaders=..., a datamodule, or define "
            f"{type(model).__name__}.predict_dataloader()"
        )
    keep = True if return_predictions is None else return_predictions

    def body(run: Run) -> list[Any] | None:
        _load_weights(run, path)
        data = _eval_data(trainer, run, source, "dataloaders")
        limit = resolve_limit("limit_predict_batches", trainer.limit_predict_batches, data)
        return predict_loop(trainer, run, data, limit, keep)

    return trainer._call("predict", model, datamodule, body, loggers=False)


def _evaluated_model(
    trainer: Trainer,
    fn: str,
    model: Module | None,
    dataloaders: Any,
    datamodule: LightningDataModule | None,
    ckpt_path: str | Path | None,
) -> tuple[Module, Path | None]:
    given = model is not None
    model = model if model is not None else trainer.lightning_module
    if model is None:
        raise TrainerError(f"{fn}() needs a model: {fn}(model, dataloaders)")
    if datamodule is not None and dataloaders is not None:
        raise TrainerError(f"{fn}() got both dataloaders and datamodule=...; pass one")
    trainer._check_call(model, datamodule)
    if ckpt_path is None and not given:
        # As Lightning: after fit, the best checkpoint if one was kept.
        best = next(
            (cb.best_model_path for cb in trainer.checkpoint_callbacks if cb.best_model_path), ""
        )
        return model, Path(best) if best else None
    return model, resolve_ckpt_path(
        ckpt_path, trainer.default_root_dir, trainer.checkpoint_callbacks
    )


def _load_weights(run: Run, path: Path | None) -> None:
    from gpulayer.train.state import restore_datamodule  # state imports fit, which imports this

    if path is None:
        return
    checkpoint = load_checkpoint(path, map_location="cpu")
    run.module.on_load_checkpoint(checkpoint)
    run.module.load_state_dict(checkpoint["state_dict"])
    restore_datamodule(run, checkpoint)


def _eval_data(trainer: Trainer, run: Run, source: Callable[[], Any], argument: str) -> Any:
    data = source()
    if data is None:
        raise TrainerError(f"the dataloader method returned None; {argument} needs data")
    check_reiterable(data, argument)
    return shard(data, run.env, shuffle=False, seed=trainer.seed or 0)
