"""The training and validation loops.

Per batch the host only launches work: it moves the batch, runs the step,
and every ``accumulate_grad_batches`` batches steps the optimizer. Nothing
here reads a device value except :func:`publish_step_metrics` (every
``log_every_n_steps`` optimizer steps) and the epoch-end reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from gpulayer.train import distributed
from gpulayer.train.callbacks import Callback, overrides
from gpulayer.train.checkpoint import capture_rng_states, restore_rng_states
from gpulayer.train.data import batch_count, set_epoch
from gpulayer.train.environment import ClusterEnvironment
from gpulayer.train.errors import CheckpointError, TrainerError
from gpulayer.train.logging import MetricStore, Reducer, to_host
from gpulayer.train.module import Module
from gpulayer.train.optim import SchedulerConfig
from gpulayer.train.precision import Precision
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
    """What one ``fit``/``validate`` call set up."""

    module: Module
    device: torch.device
    precision: Precision
    env: ClusterEnvironment
    callbacks: list[Callback]
    progress: ProgressBar | None
    ddp: DistributedDataParallel | None = None
    optimizer: torch.optim.Optimizer | None = None
    schedulers: list[SchedulerConfig] = field(default_factory=list)
    train_data: Any = None
    val_data: Any = None
    resume: ResumePoint | None = None
    train_store: MetricStore = field(
        default_factory=lambda: MetricStore(on_step=True, on_epoch=False)
    )
    val_store: MetricStore = field(
        default_factory=lambda: MetricStore(on_step=False, on_epoch=True)
    )

    @property
    def reducer(self) -> Reducer | None:
        return distributed.all_reduce if self.env.distributed else None


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
    module.on_train_start()
    for cb in run.callbacks:
        cb.on_train_start(trainer, module)
    while not trainer.should_stop and not trainer.max_steps_reached:
        if trainer.max_epochs >= 0 and trainer.current_epoch >= trainer.max_epochs:
            break
        train_epoch(trainer, run)
    module.on_train_end()
    for cb in run.callbacks:
        cb.on_train_end(trainer, module)


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
    data, limit = run.train_data, trainer.limit_train_batches
    set_epoch(data, trainer.current_epoch)
    store.reset()
    iterator, pending, batch_idx, trainer._epoch_rng = _start_epoch(run, data, limit)
    trainer._batches_done = batch_idx
    trainer._stepped = True
    module._attach(trainer, store)
    module.train()
    module.on_train_epoch_start()
    for cb in run.callbacks:
        cb.on_train_epoch_start(trainer, module)
    progress = run.progress
    if progress is not None:
        progress.start(f"epoch {trainer.current_epoch}", batch_count(data, limit))

    starts = [cb for cb in run.callbacks if overrides(cb, "on_train_batch_start")]
    ends = [cb for cb in run.callbacks if overrides(cb, "on_train_batch_end")]
    step_schedulers = [s for s in run.schedulers if s.interval == "step"]
    ddp = run.ddp
    forward = ddp if ddp is not None else module.training_step
    accumulate = trainer.accumulate_grad_batches
    clip_val, clip_norm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm == "norm"
    log_every, max_steps = trainer.log_every_n_steps, trainer.max_steps
    params = [p for p in module.parameters() if p.requires_grad] if clip_val else []

    while pending is not _END:
        batch = pending
        nxt = batch_idx + 1
        pending = next(iterator, _END) if limit is None or nxt < limit else _END
        stepping = pending is _END or nxt % accumulate == 0
        batch = module.transfer_batch_to_device(batch, device, 0)
        store.batch = batch
        module.on_train_batch_start(batch, batch_idx)
        for cb in starts:
            cb.on_train_batch_start(trainer, module, batch, batch_idx)

        # Accumulating batches skip DDP's gradient all-reduce.
        with nullcontext() if ddp is None or stepping else ddp.no_sync():
            with precision.autocast():
                output = forward(batch, batch_idx)
            loss = _loss_of(output)
            if loss is not None:
                precision.backward(loss / accumulate if accumulate > 1 else loss)

        if progress is not None:
            progress.advance()
        if stepping:
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
            if trainer.global_step % log_every == 0:
                publish_step_metrics(trainer, run)
        trainer._batches_done = nxt
        trainer._stepped = stepping
        module.on_train_batch_end(output, batch, batch_idx)
        for cb in ends:
            cb.on_train_batch_end(trainer, module, output, batch, batch_idx)
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
    val_host: dict[str, float] = {}
    if (
        trainer.validating_in_fit
        and (trainer.current_epoch + 1) % trainer.check_val_every_n_epoch == 0
    ):
        val_host = validation_loop(trainer, run)
        module._attach(trainer, store)
    # What the module logs in on_train_epoch_end is per-epoch by default.
    store.default_on_step, store.default_on_epoch = False, True
    module.on_train_epoch_end()
    store.default_on_step, store.default_on_epoch = True, False
    train_values = store.epoch_values(run.reducer)
    host = to_host({**store.step_values(), **train_values})
    trainer.callback_metrics.update(host)
    _step_epoch_schedulers(trainer, run)
    trainer._epoch_finished = True
    for cb in run.callbacks:
        cb.on_train_epoch_end(trainer, module)
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
    for config in run.schedulers:
        if config.interval != "epoch" or (trainer.current_epoch + 1) % config.frequency:
            continue
        if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            assert config.monitor is not None
            from gpulayer.train.callbacks import monitored_value

            config.scheduler.step(monitored_value(trainer, config.monitor, "ReduceLROnPlateau"))
        else:
            config.scheduler.step()


def validation_loop(trainer: Trainer, run: Run) -> dict[str, float]:
    """Run the validation data once; return its metrics, read to the host."""
    module, store, device, precision = run.module, run.val_store, run.device, run.precision
    store.reset()
    was_training = module.training
    module.eval()
    module._attach(trainer, store)
    module.on_validation_epoch_start()
    for cb in run.callbacks:
        cb.on_validation_epoch_start(trainer, module)
    limit = trainer.limit_val_batches
    with torch.no_grad():
        for batch_idx, batch in enumerate(run.val_data):
            if limit is not None and batch_idx >= limit:
                break
            batch = module.transfer_batch_to_device(batch, device, 0)
            store.batch = batch
            with precision.autocast():
                module.validation_step(batch, batch_idx)
    module.on_validation_epoch_end()
    for cb in run.callbacks:
        cb.on_validation_epoch_end(trainer, module)
    host = to_host({**store.step_values(), **store.epoch_values(run.reducer)})
    trainer.callback_metrics.update(host)
    module.train(was_training)
    for cb in run.callbacks:
        cb.on_validation_end(trainer, module)
    return host
