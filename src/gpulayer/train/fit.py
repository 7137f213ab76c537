"""The training and validation loops.

Per batch the host only launches work: it moves the batch, runs the step,
and every ``accumulate_grad_batches`` batches steps the optimizer. Nothing
here reads a device value except :func:`publish_step_metrics` (every
``log_every_n_steps`` optimizer steps) and the epoch-end reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gpulayer.train import distributed
from gpulayer.train.callbacks import Callback, EarlyStopping
from gpulayer.train.checkpoint import capture_rng_states, restore_rng_states
from gpulayer.train.data import batch_count, set_epoch
from gpulayer.train.datamodule import LightningDataModule, defines
from gpulayer.train.environment import ClusterEnvironment
from gpulayer.train.errors import CheckpointError, TrainerError
from gpulayer.train.evaluate import (
    Hook,
    call_callbacks,
    callback_hooks,
    evaluation_loop,
    overridden,
)
from gpulayer.train.logging import MetricStore, Reducer, to_host
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module
from gpulayer.train.optim import SchedulerConfig
from gpulayer.train.precision import MixedPrecision, Precision
from gpulayer.train.progress import ProgressBar

if TYPE_CHECKING:
    from gpulayer.train.trainer import Trainer

_END = object()


@dataclass
class ResumePoint:
    """Where a checkpoint left the loop: ``batches`` done in the current epoch."""

    batches: int
    epoch_rng: dict[str, Any] | None
    rng: dict[str, Any]


@dataclass
class Run:
    """What one ``fit``/``validate``/``test``/``predict`` call set up."""

    module: Module
    device: torch.device
    precision: Precision
    env: ClusterEnvironment
    callbacks: list[Callback]
    progress: ProgressBar | None
    transfer: Callable[[Any, torch.device], Any]
    datamodule: LightningDataModule | None = None
    ddp: DistributedDataParallel | None = None
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    manual: list[ManualOptimizer] = field(default_factory=list)
    schedulers: list[SchedulerConfig] = field(default_factory=list)
    train_source: Callable[[], Any] | None = None
    val_source: Callable[[], Any] | None = None
    train_data: Any = None
    train_limit: int | None = None
    val_data: Any = None
    val_limit: int | None = None
    #: Validate every this many training batches (None: at each epoch's end).
    val_every: int | None = None
    #: Metrics of the validation that ran with the epoch's last batch.
    pending_val: dict[str, float] = field(default_factory=dict)
    resume: ResumePoint | None = None
    train_store: MetricStore = field(
        default_factory=lambda: MetricStore(on_step=True, on_epoch=False)
    )
    val_store: MetricStore = field(
        default_factory=lambda: MetricStore(on_step=False, on_epoch=True)
    )
    test_store: MetricStore = field(
        default_factory=lambda: MetricStore(on_step=False, on_epoch=True)
    )

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.optimizers[0] if self.optimizers else None

    @property
    def reducer(self) -> Reducer | None:
        return distributed.all_reduce if self.env.distributed else None


def make_transfer(module: Module, datamodule: LightningDataModule | None) -> Callable[..., Any]:
    """The batch-transfer hooks composed once, from the ones overridden.

    As Lightning, a hook the datamodule overrides is taken from it, else the
    module's. The default path is one call per batch.
    """

    def pick(name: str) -> Any:
        if datamodule is not None and defines(datamodule, LightningDataModule, name):
            return getattr(datamodule, name)
        return getattr(module, name) if defines(module, Module, name) else None

    before, move, after = (
        pick(n)
        for n in ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
    )
    move = move if move is not None else module.transfer_batch_to_device
    if before is None and after is None:
        return lambda batch, device: move(batch, device, 0)

    def transfer(batch: Any, device: torch.device) -> Any:
        if before is not None:
            batch = before(batch, 0)
        batch = move(batch, device, 0)
        return after(batch, 0) if after is not None else batch

    return transfer


class ManualOptimizer:
    """What ``self.optimizers()`` returns: Lightning's ``LightningOptimizer``.

    ``step()`` runs the ``on_before_optimizer_step`` hooks, goes through the
    precision's gradient scaler and adds one to ``global_step``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: Trainer, run: Run) -> None:
        self.optimizer = optimizer
        self._trainer, self._run = trainer, run

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        run, optimizer = self._run, self.optimizer
        scaled = isinstance(run.precision, MixedPrecision) and run.precision.scaler is not None
        result = None
        if closure is not None and scaled:
            result = closure()  # a scaler cannot run a closure inside step()
        call_callbacks(self._trainer, run, "on_before_optimizer_step", optimizer)
        run.module.on_before_optimizer_step(optimizer)
        if closure is not None and not scaled:
            result = optimizer.step(closure=closure, **kwargs)
        else:
            run.precision.step(optimizer)
        self._trainer.global_step += 1
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()


def backward_hooks(trainer: Trainer, run: Run) -> tuple[list[Hook], list[Hook]]:
    """Hooks to call around each backward: callbacks' then the module's, if defined."""
    module = run.module
    before: list[Hook] = [
        partial(h, trainer, module) for h in callback_hooks(run.callbacks, "on_before_backward")
    ]
    after: list[Hook] = [
        partial(h, trainer, module) for h in callback_hooks(run.callbacks, "on_after_backward")
    ]
    if overridden(module, "on_before_backward"):
        before.append(module.on_before_backward)
    if overridden(module, "on_after_backward"):
        after.append(module.on_after_backward)
    return before, after


def backward(trainer: Trainer, run: Run, loss: torch.Tensor) -> None:
    """``manual_backward``: the backward hooks around the precision's backward."""
    before, after = backward_hooks(trainer, run)
    for hook in before:
        hook(loss)
    run.precision.backward(loss)
    for hook in after:
        hook()


def _loss_of(output: Any) -> torch.Tensor | None:
    if output is None or isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
        if isinstance(loss, torch.Tensor):
            return loss
    raise TrainerError(
        f"training_step returned {type(output).__name__}; return the loss tensor, a dict "
        f"with a 'loss' tensor, or None to skip the batch"
    )


def publish_step_metrics(trainer: Trainer, run: Run) -> None:
    """Read the latest per-step values to the host (one transfer) and hand them out."""
    host = to_host(run.train_store.step_values())
    trainer.callback_metrics.update(host)
    if not trainer.is_global_zero:
        return
    prog = run.train_store.keys_where("prog_bar")
    logged = run.train_store.keys_where("logger")
    trainer.progress_bar_metrics.update({k: v for k, v in host.items() if k in prog})
    to_log = {k: v for k, v in host.items() if k in logged}
    trainer.logged_metrics.update(to_log)
    if to_log:
        for logger in trainer.loggers:
            logger.log_metrics(
                {**to_log, "epoch": float(trainer.current_epoch)}, trainer.global_step
            )
    if run.progress is not None:
        run.progress.show({k: v for k, v in host.items() if k in prog})


def fit_loop(trainer: Trainer, run: Run) -> None:
    module = run.module
    prepare_train_data(trainer, run)
    if trainer.limit_train_batches == 0:
        return  # as Lightning: no training at all, not even on_train_start
    call_callbacks(trainer, run, "on_train_start")
    module.on_train_start()
    while not trainer.should_stop and not trainer.max_steps_reached:
        if trainer.max_epochs >= 0 and trainer.current_epoch >= trainer.max_epochs:
            break
        train_epoch(trainer, run)
    call_callbacks(trainer, run, "on_train_end")
    module.on_train_end()


def prepare_train_data(trainer: Trainer, run: Run) -> None:
    """Ask for the training data (after the sanity check, as Lightning) and size it."""
    from gpulayer.train.config import resolve_limit
    from gpulayer.train.data import check_reiterable, shard

    assert run.train_source is not None
    data = run.train_source()
    if data is None:
        raise TrainerError(
            f"{type(run.module).__name__}.train_dataloader() returned None; fit() needs "
            f"training data"
        )
    check_reiterable(data, "train_dataloaders")
    run.train_data = shard(data, run.env, shuffle=True, seed=trainer.seed or 0)
    if trainer.validating_in_fit:
        ensure_val_data(trainer, run)  # as Lightning: asked for right after the training data
    run.train_limit = resolve_limit(
        "limit_train_batches", trainer.limit_train_batches, run.train_data
    )
    batches = batch_count(run.train_data, run.train_limit)
    interval = trainer.val_check_interval
    if isinstance(interval, int):
        if (
            batches is not None
            and interval > batches
            and trainer.check_val_every_n_epoch is not None
            and trainer.validating_in_fit
        ):
            raise TrainerError(
                f"val_check_interval={interval} is more than the {batches} training batches "
                f"of an epoch; give at most {batches}, or check_val_every_n_epoch=None to "
                f"count batches across epochs"
            )
        run.val_every = interval
    elif batches is None:
        if interval != 1.0:
            raise TrainerError(
                f"val_check_interval={interval!r} is a fraction of an epoch, but the training "
                f"data has no len(); give an int (training batches) or 1.0"
            )
        run.val_every = None
    else:
        run.val_every = max(1, int(batches * interval))


def ensure_val_data(trainer: Trainer, run: Run) -> bool:
    """Ask for the validation data the first time it is needed; False if there is none."""
    from gpulayer.train.config import resolve_limit
    from gpulayer.train.data import check_reiterable, shard

    if run.val_data is None and run.val_source is not None:
        data = run.val_source()
        run.val_source = None
        if data is not None:
            check_reiterable(data, "val_dataloaders")
            run.val_data = shard(data, run.env, shuffle=False, seed=trainer.seed or 0)
            run.val_limit = resolve_limit(
                "limit_val_batches", trainer.limit_val_batches, run.val_data
            )
    return run.val_data is not None and run.val_limit != 0


def _validate_in_fit(trainer: Trainer, run: Run, stepped: bool) -> dict[str, float]:
    if not ensure_val_data(trainer, run):
        return {}
    if stepped:
        # As Lightning: gradients are let go before validating (not mid-accumulation).
        run.module.on_validation_model_zero_grad()
    host = evaluation_loop(trainer, run, "validation", run.val_data, run.val_limit)
    run.module._attach(trainer, run.train_store)
    return host


def _validation_due(trainer: Trainer) -> bool:
    every = trainer.check_val_every_n_epoch
    return trainer.validating_in_fit and (every is None or (trainer.current_epoch + 1) % every == 0)


def _start_epoch(run: Run, data: Any, limit: int | None) -> tuple[Any, Any, int, dict[str, Any]]:
    """The epoch's iterator, its first batch and where to start, RNG-exactly on resume."""
    resume, run.resume = run.resume, None
    skip = resume.batches if resume is not None else 0
    if resume is not None and resume.epoch_rng is not None:
        epoch_rng = resume.epoch_rng
        restore_rng_states(epoch_rng)
    else:
        if resume is not None:
            restore_rng_states(resume.rng)
        epoch_rng = capture_rng_states()
    iterator = iter(data)
    for done in range(skip):
        # Replaying the loader (not the model) puts the sampler where it was.
        if next(iterator, _END) is _END:
            raise CheckpointError(
                f"the checkpoint resumes after batch {skip} of the epoch, but the "
                f"training data has only {done} batches"
            )
    first = next(iterator, _END) if limit is None or skip < limit else _END
    if resume is not None and skip:
        restore_rng_states(resume.rng)
    return iterator, first, skip, epoch_rng


def train_epoch(trainer: Trainer, run: Run) -> None:
    module, store, device, precision = run.module, run.train_store, run.device, run.precision
    optimizer = run.optimizer
    assert optimizer is not None
    data, limit = run.train_data, run.train_limit
    set_epoch(data, trainer.current_epoch)
    store.reset()
    iterator, pending, batch_idx, trainer._epoch_rng = _start_epoch(run, data, limit)
    trainer._batches_done = batch_idx
    trainer._stepped = True
    module._attach(trainer, store)
    module.train()
    call_callbacks(trainer, run, "on_train_epoch_start")
    module.on_train_epoch_start()
    progress = run.progress
    if progress is not None:
        progress.start(f"epoch {trainer.current_epoch}", batch_count(data, limit))

    # Per-batch hooks: looked up once per epoch, called only where defined.
    starts = callback_hooks(run.callbacks, "on_train_batch_start")
    ends = callback_hooks(run.callbacks, "on_train_batch_end")
    before_step = callback_hooks(run.callbacks, "on_before_optimizer_step")
    before_zero = callback_hooks(run.callbacks, "on_before_zero_grad")
    if overridden(module, "on_before_zero_grad"):
        before_zero.append(lambda _t, _m, opt: module.on_before_zero_grad(opt))
    before_backward, after_backward = backward_hooks(trainer, run)
    step_schedulers = [s for s in run.schedulers if s.interval == "step"]
    ddp, transfer, automatic = run.ddp, run.transfer, module.automatic_optimization
    forward = ddp if ddp is not None else module.training_step
    accumulate = trainer.accumulate_grad_batches
    clip_val, clip_norm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm == "norm"
    log_every, max_steps = trainer.log_every_n_steps, trainer.max_steps
    params = [p for p in module.parameters() if p.requires_grad] if clip_val else []
    val_every, validate = run.val_every, _validation_due(trainer)
    by_total = trainer.check_val_every_n_epoch is None

    while pending is not _END:
        batch = pending
        nxt = batch_idx + 1
        pending = next(iterator, _END) if limit is None or nxt < limit else _END
        stepping = pending is _END or nxt % accumulate == 0
        batch = transfer(batch, device)
        store.batch = batch
        for hook in starts:
            hook(trainer, module, batch, batch_idx)
        if module.on_train_batch_start(batch, batch_idx) == -1:
            break  # as Lightning: the rest of the epoch is skipped

        if not automatic:
            # Manual optimization: the step does backward and step itself.
            with precision.autocast():
                output = forward(batch, batch_idx)
        else:
            # Accumulating batches skip DDP's gradient all-reduce.
            with nullcontext() if ddp is None or stepping else ddp.no_sync():
                with precision.autocast():
                    output = forward(batch, batch_idx)
                loss = _loss_of(output)
                if loss is not None:
                    if before_zero and batch_idx % accumulate == 0:
                        for hook in before_zero:
                            hook(trainer, module, optimizer)
                    for hook in before_backward:
                        hook(loss)
                    precision.backward(loss / accumulate if accumulate > 1 else loss)
                    for hook in after_backward:
                        hook()

        if progress is not None:
            progress.advance()
        if automatic and stepping:
            for hook in before_step:
                hook(trainer, module, optimizer)
            module.on_before_optimizer_step(optimizer)
            if clip_val:
                precision.unscale(optimizer)
                if clip_norm:
                    torch.nn.utils.clip_grad_norm_(params, clip_val)
                else:
                    torch.nn.utils.clip_grad_value_(params, clip_val)
            precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            trainer.global_step += 1
            for config in step_schedulers:
                if trainer.global_step % config.frequency == 0:
                    config.scheduler.step()
        # Manual optimization publishes every log_every_n_steps batches.
        count = trainer.global_step if automatic else nxt
        if (stepping or not automatic) and count % log_every == 0:
            publish_step_metrics(trainer, run)
        trainer._batches_done = nxt
        trainer._stepped = stepping = stepping or not automatic
        trainer._total_batches += 1
        for hook in ends:
            hook(trainer, module, output, batch, batch_idx)
        module.on_train_batch_end(output, batch, batch_idx)
        if validate and val_every is not None:
            counter = trainer._total_batches if by_total else nxt
            if counter % val_every == 0:
                host = _validate_in_fit(trainer, run, stepping)
                if pending is _END:
                    run.pending_val = host
                elif trainer.is_global_zero:
                    _publish_epoch_metrics(trainer, run, {}, host)
        batch_idx = nxt
        if stepping and pending is not _END:
            # Stopped mid-epoch: no epoch end; the position goes into last.ckpt.
            if 0 <= max_steps <= trainer.global_step:
                return
            # A rank stopping alone would hang the others: under DDP,
            # should_stop is agreed on at the epoch end instead.
            if trainer.should_stop and not run.env.distributed:
                return
    end_train_epoch(trainer, run)


def end_train_epoch(trainer: Trainer, run: Run) -> None:
    module, store = run.module, run.train_store
    val_host, run.pending_val = run.pending_val, {}
    if run.val_every is None and _validation_due(trainer):
        val_host = _validate_in_fit(trainer, run, trainer._stepped)
    # What the module logs in on_train_epoch_end is per-epoch by default.
    store.default_on_step, store.default_on_epoch = False, True
    monitors = (EarlyStopping, ModelCheckpoint)
    # As Lightning: other callbacks, then the module, then the monitoring callbacks.
    firsts = [cb for cb in run.callbacks if not isinstance(cb, monitors)]
    train_values = store.epoch_values(run.reducer)
    host = to_host({**store.step_values(), **train_values})
    trainer.callback_metrics.update(host)
    for hook in callback_hooks(firsts, "on_train_epoch_end"):
        hook(trainer, module)
    module.on_train_epoch_end()
    store.default_on_step, store.default_on_epoch = True, False
    if overridden(module, "on_train_epoch_end") or firsts:
        # What was logged there joins the epoch's values: one more read.
        train_values = store.epoch_values(run.reducer)
        host = to_host({**store.step_values(), **train_values})
        trainer.callback_metrics.update(host)
    _step_epoch_schedulers(trainer, run)
    trainer._epoch_finished = True
    lasts: list[Callback] = [cb for cb in run.callbacks if isinstance(cb, monitors)]
    for hook in callback_hooks(lasts, "on_train_epoch_end"):
        hook(trainer, module)
    if run.env.distributed:
        # Early stopping decided on one rank stops all of them together.
        trainer.should_stop = distributed.any_rank(trainer.should_stop, run.device)
    if trainer.is_global_zero:
        _publish_epoch_metrics(trainer, run, {k: host[k] for k in train_values}, val_host)
    trainer._epoch_finished = False
    trainer.current_epoch += 1
    trainer._batches_done = 0
    trainer._epoch_rng = None


def _publish_epoch_metrics(
    trainer: Trainer, run: Run, train: dict[str, float], val: dict[str, float]
) -> None:
    stores = (run.train_store, run.val_store)
    logged_keys = set().union(*(s.keys_where("logger") for s in stores))
    prog_keys = set().union(*(s.keys_where("prog_bar") for s in stores))
    values = {**train, **val}
    logged = {k: v for k, v in values.items() if k in logged_keys}
    trainer.logged_metrics.update(logged)
    if logged:
        epoch = float(trainer.current_epoch)
        for logger in trainer.loggers:
            logger.log_metrics({**logged, "epoch": epoch}, trainer.global_step)
    if run.progress is not None:
        shown = {k: v for k, v in trainer.callback_metrics.items() if k in prog_keys}
        trainer.progress_bar_metrics.update(shown)
        run.progress.finish(shown)


def _step_epoch_schedulers(trainer: Trainer, run: Run) -> None:
    if not run.module.automatic_optimization:
        return  # as Lightning: under manual optimization the step steps them
    for config in run.schedulers:
        if config.interval != "epoch" or (trainer.current_epoch + 1) % config.frequency:
            continue
        if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            assert config.monitor is not None
            from gpulayer.train.callbacks import monitored_value

            config.scheduler.step(monitored_value(trainer, config.monitor, "ReduceLROnPlateau"))
        else:
            config.scheduler.step()
