"""The evaluation loops: validation (also the sanity check), test and predict.

Hooks run in Lightning's order: the module's ``on_<stage>_model_eval``,
then for the start, epoch start, each batch, epoch end and end, the
callbacks' hook before the module's; the submodules' train/eval modes from
before the loop are put back at its end. Nothing here runs per training
step; values logged are read to the host at the end of the loop (and once
before the epoch-end hooks, when there are any, so that they see them).

Several dataloaders (a list, tuple or dict of them: ``SequentialLoaders``)
run one after the other, as Lightning's "sequential" mode: ``batch_idx``
starts again at 0 for each, ``limit_*_batches`` applies to each, and the step
and batch hooks get ``dataloader_idx`` (only when there are several).
Validation inside ``fit`` runs under ``torch.no_grad()``; ``validate``,
``test`` and ``predict`` under ``torch.inference_mode()`` unless
``Trainer(inference_mode=False)``, as in Lightning.

What reaches the loggers follows Lightning: values logged with
``on_step=True`` after each batch (read then, on rank 0, only if there are
any), at the number of batches of that dataloader run before it (counted
across the validations of one ``fit``); the per-epoch values at the end, at
the fit loop's count of batches that stepped, with ``epoch``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gpulayer.train.callbacks import Callback
from gpulayer.train.checkpoint import capture_rng_states, load_checkpoint, restore_rng_states
from gpulayer.train.config import check_validation_step, resolve_ckpt_path, resolve_limit
from gpulayer.train.data import SequentialLoaders, check_reiterable, shard
from gpulayer.train.datamodule import LOADERS, LightningDataModule, defines
from gpulayer.train.errors import TrainerError
from gpulayer.train.logging import MetricStore, log_to_loggers, to_host
from gpulayer.train.module import Module, move_to_device
from gpulayer.train.profilers import (
    Profiler,
    action_name,
    timed,
    timed_hook,
    timed_iter,
    timed_step,
)

if TYPE_CHECKING:
    from gpulayer.train.fit import Run
    from gpulayer.train.trainer import Trainer

Hook = Callable[..., Any]
#: A dataloader and the number of batches to take from it (None: all).
Plan = tuple[Any, int | None]
LIMIT_SETTINGS = {
    "validation": "limit_val_batches",
    "test": "limit_test_batches",
    "predict": "limit_predict_batches",
}
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def callback_hooks(
    callbacks: list[Callback], name: str, profiler: Profiler | None = None
) -> list[Hook]:
    """The bound ``name`` hooks of the callbacks that define it (not as a no-op base),
    each timed by ``profiler`` when there is one."""
    base = getattr(Callback, name, None)
    return [
        timed(profiler, action_name(cb, name), getattr(cb, name))
        if profiler is not None
        else getattr(cb, name)
        for cb in callbacks
        if getattr(type(cb), name, None) is not None and getattr(type(cb), name) is not base
    ]


def call_callbacks(trainer: Trainer, run: Run, name: str, *args: Any) -> None:
    module = run.module
    for hook in callback_hooks(run.callbacks, name, run.profiler):
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


def _grad_context(trainer: Trainer) -> AbstractContextManager[Any]:
    """Lightning's choice: validation inside ``fit`` runs under ``no_grad``;
    ``validate``, ``test`` and ``predict`` under ``inference_mode`` unless
    ``Trainer(inference_mode=False)``, and under ``no_grad`` with gloo, which
    Lightning finds unreliable with inference tensors."""
    if trainer.fitting or not trainer.inference_mode:
        return torch.no_grad()
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.no_grad()
    return torch.inference_mode()


def _plan(trainer: Trainer, stage: str, data: Any, limit: int | None) -> list[Plan]:
    """Each dataloader with the number of batches to take from it (None: all).
    ``limit`` caps each one; with several, ``limit_<stage>_batches`` applies to
    each of them, as in Lightning."""
    if not isinstance(data, SequentialLoaders):
        return [(data, limit)]
    setting = LIMIT_SETTINGS[stage]
    plan: list[Plan] = []
    for loader in data.loaders:
        own = resolve_limit(setting, getattr(trainer, setting), loader)
        plan.append((loader, own if limit is None else limit if own is None else min(own, limit)))
    return plan


def _skipped(plan: list[Plan]) -> bool:
    """As Lightning: a loop whose every dataloader is limited to 0 batches does not run."""
    return all(limit == 0 for _, limit in plan)


def _positional(fn: Callable[..., Any]) -> tuple[list[inspect.Parameter], bool]:
    params = list(inspect.signature(fn).parameters.values())
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named, any(p.kind is p.VAR_POSITIONAL for p in params)


def _takes(fn: Callable[..., Any], param: str, min_args: int | None = None) -> bool:
    """Lightning's ``is_param_in_hook_signature``: ``param`` by name, ``*args``,
    or at least ``min_args`` positional parameters."""
    named, varargs = _positional(fn)
    return (
        varargs
        or any(p.name == param for p in named)
        or (min_args is not None and len(named) >= min_args)
    )


def _check_dataloader_idx(module: Module, stage: str, hooks: tuple[str, ...], count: int) -> None:
    """As Lightning, before the loop: with several dataloaders the step and the
    module's batch hooks must take ``dataloader_idx``; with one, not require it."""
    for hook in hooks:
        fn = getattr(module, hook)
        name = f"{type(module).__name__}.{hook}()"
        if count > 1 and not _takes(fn, "dataloader_idx"):
            raise TrainerError(
                f"{name} takes no dataloader_idx, but the {stage} data is {count} "
                f"dataloaders; add dataloader_idx=0 to its signature"
            )
        param = inspect.signature(fn).parameters.get("dataloader_idx")
        if count == 1 and param is not None and param.default is param.empty:
            raise TrainerError(
                f"{name} requires dataloader_idx, but the {stage} data is one dataloader; "
                f"give it a default (dataloader_idx=0) or remove it"
            )


def _indexed_transfer(run: Run, dataloader_idx: int) -> Callable[[Any, torch.device], Any]:
    """The batch-transfer hooks (the datamodule's override first, as ``run.transfer``)
    told which of several dataloaders the batch comes from."""
    module, datamodule = run.module, run.datamodule

    def pick(name: str) -> Any:
        if datamodule is not None and defines(datamodule, LightningDataModule, name):
            return getattr(datamodule, name)
        return getattr(module, name)

    before, move, after = (pick(name) for name in TRANSFER_HOOKS)
    return lambda batch, device: after(
        move(before(batch, dataloader_idx), device, dataloader_idx), dataloader_idx
    )


def _read(store: MetricStore, run: Run, reset: bool = True) -> tuple[dict[str, float], set[str]]:
    """Everything logged, read to the host at once, and which of it is per-epoch."""
    epoch = store.epoch_values(run.reducer, reset_metric_objects=reset)
    return to_host({**store.step_values(), **epoch}), set(epoch)


def _hand_out(
    trainer: Trainer, store: MetricStore, host: dict[str, float], epoch: set[str], sanity: bool
) -> None:
    """Lightning's evaluation callback metrics: the per-epoch values (a forked
    one also under its plain name), never step values. In the sanity check
    only those logged outside any of several dataloaders, and cleared after."""
    keys = store.epoch_keys(None, logged=False) if sanity else epoch
    trainer.callback_metrics.update({k: v for k, v in host.items() if k in keys})
    if not sanity:
        shown = store.keys_where("prog_bar")
        trainer.progress_bar_metrics.update({k: v for k, v in host.items() if k in shown})


def _log_batch(trainer: Trainer, run: Run, store: MetricStore, index: int) -> None:
    """As Lightning after each evaluation batch (not in the sanity check): the
    per-step values logged from this dataloader go to the loggers, at the number
    of its batches that came before. One read, only when there is such a value."""
    step = run.eval_batches.get(index, 0)
    run.eval_batches[index] = step + 1
    if not trainer.is_global_zero or not trainer.loggers:
        return
    values = store.logged_step_values(store.dataloader_idx)
    if values:
        log_to_loggers(trainer.loggers, to_host(values), step)


def _until_preempted(batches: Iterable[Any], trainer: Trainer, run: Run) -> Iterator[Any]:
    """``batches``; but when SIGTERM has come (a preemption, see
    preemption.py) and the loader fails, as it does once torch's own handler
    has ended its workers, the fit's checkpoint is saved now (the state after
    its last optimizer step; this validation's partial results are dropped)
    and the fit ends Preempted, as in training."""
    iterator = iter(batches)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception:
            preempt = run.preempt
            if preempt is None or not preempt.received:
                raise
            preempt.stop(trainer, run)  # raises Preempted
            raise
        yield batch


def evaluation_loop(
    trainer: Trainer,
    run: Run,
    stage: str,
    data: Any,
    limit: int | None,
    *,
    sanity: bool = False,
) -> dict[str, float]:
    """Run ``stage`` ("validation" or "test") once over ``data`` (several
    dataloaders one after the other); return everything logged, by the names
    reported (``name/dataloader_idx_N`` with several)."""
    module, device, precision = run.module, run.device, run.precision
    store = run.val_store if stage == "validation" else run.test_store
    plan = _plan(trainer, stage, data, limit)
    several = len(plan) > 1
    step_name = f"{stage}_step"
    batch_hooks = (f"on_{stage}_batch_start", f"on_{stage}_batch_end")
    _check_dataloader_idx(module, stage, (step_name, *batch_hooks), len(plan))
    with_batch_idx = _takes(getattr(module, step_name), "batch_idx", min_args=2)

    def hooks(name: str) -> list[Hook]:
        # Lightning's EarlyStopping and ModelCheckpoint are called in the sanity
        # check too, and skip it themselves (trainer.sanity_checking).
        return callback_hooks(run.callbacks, name, run.profiler)

    with _grad_context(trainer):
        store.reset()
        module._attach(trainer, store)
        modes = _capture_modes(module)
        timed_hook(run, f"on_{stage}_model_eval")()
        for name in (f"on_{stage}_start", f"on_{stage}_epoch_start"):
            for hook in hooks(name):
                hook(trainer, module)
            timed_hook(run, name)()
        starts, ends = hooks(batch_hooks[0]), hooks(batch_hooks[1])
        module_start, module_end = (timed_hook(run, name) for name in batch_hooks)
        step = timed_step(run, step_name, getattr(module, step_name))
        fetch = f"[_EvaluationLoop].{'val' if stage == 'validation' else 'test'}_next"
        for index, (loader, loader_limit) in enumerate(plan):
            # The index goes to the step and hooks only with several, as in Lightning.
            extra = (index,) if several else ()
            transfer = _indexed_transfer(run, index) if several else run.transfer
            store.dataloader_idx = index if several else None
            # Timed beneath the limit: stopping at the limit fetches nothing.
            batches = itertools.islice(timed_iter(run.profiler, fetch, loader), loader_limit)
            for batch_idx, batch in enumerate(_until_preempted(batches, trainer, run)):
                batch = transfer(batch, device)
                store.batch = batch
                for hook in starts:
                    hook(trainer, module, batch, batch_idx, *extra)
                module_start(batch, batch_idx, *extra)
                with precision.autocast():
                    if with_batch_idx:
                        output = step(batch, batch_idx, *extra)
                    else:
                        output = step(batch, *extra)
                for hook in ends:
                    hook(trainer, module, output, batch, batch_idx, *extra)
                module_end(output, batch, batch_idx, *extra)
                if not sanity:
                    _log_batch(trainer, run, store, index)
        store.batch, store.dataloader_idx = None, None
        epoch_end = f"on_{stage}_epoch_end"
        if not sanity and (hooks(epoch_end) or overridden(module, epoch_end)):
            # As Lightning: the epoch-end hooks already see this loop's values.
            _hand_out(trainer, store, *_read(store, run, reset=False), sanity)
        for hook in hooks(epoch_end):
            hook(trainer, module)
        timed_hook(run, epoch_end)()
        host, epoch = _read(store, run)
        _hand_out(trainer, store, host, epoch, sanity)
        for hook in hooks(f"on_{stage}_end"):
            hook(trainer, module)
        timed_hook(run, f"on_{stage}_end")()
        if overridden(module, f"on_{stage}_model_train"):
            timed_hook(run, f"on_{stage}_model_train")()
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
        # As Lightning: what the sanity check showed the callbacks is dropped.
        trainer.callback_metrics.clear()
        trainer.logged_metrics.clear()
        trainer.progress_bar_metrics.clear()


def predict_loop(
    trainer: Trainer, run: Run, data: Any, limit: int | None, keep: bool
) -> list[Any] | None:
    """``predict_step`` over ``data``; the outputs (moved to the CPU) if ``keep``:
    one per batch, or with several dataloaders a list of them per dataloader."""
    module, device, precision = run.module, run.device, run.precision
    plan = _plan(trainer, "predict", data, limit)
    if _skipped(plan):
        return None  # as Lightning: limit_predict_batches=0 runs nothing
    several = len(plan) > 1
    batch_hooks = ("on_predict_batch_start", "on_predict_batch_end")
    _check_dataloader_idx(module, "predict", ("predict_step", *batch_hooks), len(plan))
    with_batch_idx = _takes(module.predict_step, "batch_idx", min_args=2)
    predictions: list[list[Any]] = [[] for _ in plan]
    with _grad_context(trainer):
        module._attach(trainer, _NoLogging(on_step=False, on_epoch=True))
        modes = _capture_modes(module)
        timed_hook(run, "on_predict_model_eval")()
        for name in ("on_predict_start", "on_predict_epoch_start"):
            call_callbacks(trainer, run, name)
            timed_hook(run, name)()
        starts = callback_hooks(run.callbacks, batch_hooks[0], run.profiler)
        ends = callback_hooks(run.callbacks, batch_hooks[1], run.profiler)
        batch_start, batch_end = (timed_hook(run, name) for name in batch_hooks)
        step = timed_step(run, "predict_step", module.predict_step)
        for index, (loader, loader_limit) in enumerate(plan):
            extra = (index,) if several else ()
            transfer = _indexed_transfer(run, index) if several else run.transfer
            fetched = timed_iter(run.profiler, "[_PredictionLoop].predict_next", loader)
            for batch_idx, batch in enumerate(itertools.islice(fetched, loader_limit)):
                batch = transfer(batch, device)
                for hook in starts:
                    hook(trainer, module, batch, batch_idx, *extra)
                batch_start(batch, batch_idx, *extra)
                with precision.autocast():
                    if with_batch_idx:
                        output = step(batch, batch_idx, *extra)
                    else:
                        output = step(batch, *extra)
                if keep:
                    # As Lightning: kept on the CPU, so that device memory does not grow.
                    cpu = move_to_device(output, torch.device("cpu"), non_blocking=False)
                    predictions[index].append(cpu)
                for hook in ends:
                    hook(trainer, module, output, batch, batch_idx, *extra)
                batch_end(output, batch, batch_idx, *extra)
        for name in ("on_predict_epoch_end", "on_predict_end"):
            call_callbacks(trainer, run, name)
            timed_hook(run, name)()
        _restore_modes(modes)
    module._attach(trainer)
    if not keep:
        return None
    return predictions if several else predictions[0]


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
    """``trainer.validate()`` or ``trainer.test()`` (``fn``): the per-epoch values
    logged (``logger=True``), one dict per dataloader, as Lightning returns them."""
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
    limit_name = LIMIT_SETTINGS[stage]

    def body(run: Run) -> list[dict[str, float]]:
        _load_weights(run, path)
        data = _eval_data(trainer, run, source, "dataloaders")
        limit = resolve_limit(limit_name, getattr(trainer, limit_name), data)
        if _skipped(_plan(trainer, stage, data, limit)):
            return []  # as Lightning: limited to 0 batches, the loop does not run
        host = evaluation_loop(trainer, run, stage, data, limit)
        store = run.val_store if stage == "validation" else run.test_store
        count = len(data.loaders) if isinstance(data, SequentialLoaders) else 1
        results = _results(store, host, count)
        if trainer.is_global_zero:
            logged = {k: v for k, v in host.items() if k in store.keys_where("logger")}
            trainer.logged_metrics.update(logged)
            # As Lightning: the per-epoch values, at the fit loop's count of
            # batches that stepped (0 without a fit), with the epoch.
            keys = store.logged_epoch_keys()
            log_to_loggers(
                trainer.loggers,
                {k: v for k, v in logged.items() if k in keys},
                trainer._loop.stepped_batches,
                trainer.current_epoch,
            )
            if verbose:
                for index, metrics in enumerate(results):
                    if count > 1:
                        print(f"DataLoader {index}:")
                    for key, value in metrics.items():
                        print(f"{key}: {value:.6g}")
        return results

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


def _results(store: MetricStore, host: dict[str, float], count: int) -> list[dict[str, float]]:
    """Lightning's ``validate()``/``test()`` results: per dataloader, the epoch
    values logged from it with ``logger=True``, and those logged in the
    epoch-end hooks (in every dataloader's dict)."""
    shared = store.epoch_keys(None, logged=True)
    if count == 1:
        return [{k: v for k, v in host.items() if k in shared}]
    out = []
    for index in range(count):
        keys = shared | store.epoch_keys(index, logged=True)
        out.append({k: v for k, v in host.items() if k in keys})
    return out


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
        ckpt_path, trainer.default_root_dir, trainer.checkpoint_callbacks, trainer.loggers
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
