"""The training and validation loops.

Per batch the host only launches work: it moves the batch, runs the step,
and every ``accumulate_grad_batches`` batches steps the optimizer. Nothing
here reads a device value except :func:`publish_step_metrics` (every
``log_every_n_steps`` optimizer steps, and after ``should_stop`` is set) and
the epoch-end reads. The loggers get the values at Lightning's steps (see
:mod:`gpulayer.train.logging`): the count of batches that stepped before the
current one, ``LoopPosition.stepped_batches``.
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
from gpulayer.train.logging import MetricStore, Reducer, log_to_loggers, to_host
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module
from gpulayer.train.optim import SchedulerConfig
from gpulayer.train.precision import MixedPrecision, Precision
from gpulayer.train.profilers import Profiler, timed, timed_hook, timed_iter, timed_step
from gpulayer.train.progress import ProgressBar

if TYPE_CHECKING:
    from gpulayer.train.preemption import Preemption
    from gpulayer.train.trainer import Trainer

_END = object()
#: The loader failed after SIGTERM (it ends DataLoader workers): no next batch.
_CUT = object()


@dataclass
class ResumePoint:
    """Where a checkpoint left the loop: ``batches`` done in the current epoch.

    ``rng`` is None for a checkpoint that Lightning wrote (it saves no RNG
    states); ``epoch_rng`` is None unless the checkpoint was written mid-epoch.
    """

    batches: int
    epoch_rng: dict[str, Any] | None
    rng: dict[str, Any] | None
    #: ``global_step`` when the epoch began (for the per-epoch counters).
    epoch_start_step: int = 0


#: LoopPosition.phase values, in the order an epoch goes through them.
PHASES = ("idle", "epoch_start", "batches", "epoch_end")


@dataclass
class LoopPosition:
    """Where the fit loop is: host integers, a few assignments per batch.

    A checkpoint records it as Lightning's progress counters (see
    :mod:`gpulayer.train.state`), so that either trainer resumes the other's
    files. ``phase`` says which of those counters have moved for ``epoch``:
    "idle" between epochs, "epoch_start" during ``on_train_epoch_start``,
    "batches" while the batches run, "epoch_end" from the epoch-end hooks
    until the epoch is counted. An epoch that ``max_steps`` or
    ``should_stop`` cut short stays at "epoch_end" after its hooks (as in
    Lightning, whose counters then say "processed, not completed"), so that a
    checkpoint written after ``fit`` still resumes inside it.
    """

    epoch: int = 0
    phase: str = "idle"
    #: Batches of ``epoch`` trained (Lightning: processed) ...
    batches: int = 0
    #: ... and those whose ``on_train_batch_end`` hooks have run (completed).
    completed: int = 0
    #: Batches trained in all epochs.
    total: int = 0
    #: The epoch's last batch has been trained (Lightning: is_last_batch).
    last_batch: bool = False
    #: No gradients wait to be accumulated into an optimizer step.
    stepped: bool = True
    #: Batches that ended with an optimizer step (Lightning: _batches_that_stepped).
    stepped_batches: int = 0
    #: ``global_step`` when ``epoch`` began.
    epoch_start_step: int = 0
    #: The RNG states from the epoch's start, before its loader was iterated.
    epoch_rng: dict[str, Any] | None = None


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
    #: Evaluation batches run per dataloader, the step of their per-step values.
    #: As Lightning: counted across the validations of one fit, anew per call.
    eval_batches: dict[int, int] = field(default_factory=dict)
    resume: ResumePoint | None = None
    #: The Trainer's profiler; None when it records nothing (the default).
    profiler: Profiler | None = None
    #: Checkpoint-on-SIGTERM, when GPULAYER_PREEMPT_NOTICE is set (fit only).
    preempt: Preemption | None = None
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
        timed_hook(run, "on_before_optimizer_step")(optimizer)
        if closure is not None and not scaled:
            step = timed(run.profiler, "optimizer_step", optimizer.step)
            result = step(closure=closure, **kwargs)
        else:
            timed(run.profiler, "optimizer_step", run.precision.step)(optimizer)
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
        partial(h, trainer, module)
        for h in callback_hooks(run.callbacks, "on_before_backward", run.profiler)
    ]
    after: list[Hook] = [
        partial(h, trainer, module)
        for h in callback_hooks(run.callbacks, "on_after_backward", run.profiler)
    ]
    if overridden(module, "on_before_backward"):
        before.append(timed_hook(run, "on_before_backward"))
    if overridden(module, "on_after_backward"):
        after.append(timed_hook(run, "on_after_backward"))
    return before, after


def backward(trainer: Trainer, run: Run, loss: torch.Tensor) -> None:
    """``manual_backward``: the backward hooks around the precision's backward."""
    before, after = backward_hooks(trainer, run)
    for hook in before:
        hook(loss)
    timed_step(run, "backward", run.precision.backward)(loss)
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


def publish_step_metrics(trainer: Trainer, run: Run, *, show: bool = True) -> dict[str, float]:
    """Read the latest per-step values to the host (one transfer) for the
    callbacks and (``show``) the progress bar; return them for the loggers."""
    host = to_host(run.train_store.step_values())
    trainer.callback_metrics.update(host)
    if show and trainer.is_global_zero:
        prog = run.train_store.keys_where("prog_bar")
        shown = {k: v for k, v in host.items() if k in prog}
        trainer.progress_bar_metrics.update(shown)
        if run.progress is not None:
            run.progress.show(shown)
    return host


def log_step_metrics(trainer: Trainer, run: Run, host: dict[str, float]) -> None:
    """Hand the per-step values read to the loggers at Lightning's step: the
    batches that stepped before this one (the first batch's at 0)."""
    if not trainer.is_global_zero:
        return  # logged_metrics and the loggers live on rank 0
    logged = run.train_store.keys_where("logger")
    to_log = {k: v for k, v in host.items() if k in logged}
    trainer.logged_metrics.update(to_log)
    log_to_loggers(trainer.loggers, to_log, trainer._loop.stepped_batches, trainer.current_epoch)


def log_validation_metrics(trainer: Trainer, run: Run, host: dict[str, float], step: int) -> None:
    """Hand a validation's values to the loggers, as soon as it has run (Lightning's
    order): its per-epoch values, at ``step`` (the batches that stepped before the
    batch it followed). Its per-step values went out batch by batch."""
    if not trainer.is_global_zero:
        return
    store = run.val_store
    every = store.keys_where("logger")
    trainer.logged_metrics.update({k: v for k, v in host.items() if k in every})
    keys = store.logged_epoch_keys()
    logged = {k: v for k, v in host.items() if k in keys}
    log_to_loggers(trainer.loggers, logged, step, trainer.current_epoch)


def fit_loop(trainer: Trainer, run: Run) -> None:
    prepare_train_data(trainer, run)
    if trainer.limit_train_batches == 0:
        return  # as Lightning: no training at all, not even on_train_start
    call_callbacks(trainer, run, "on_train_start")
    timed_hook(run, "on_train_start")()
    epoch = timed(run.profiler, "run_training_epoch", train_epoch)
    preempt = run.preempt
    while not trainer.should_stop and not trainer.max_steps_reached:
        if trainer.max_epochs >= 0 and trainer.current_epoch >= trainer.max_epochs:
            break
        epoch(trainer, run)
        if preempt is not None and preempt.requested:
            preempt.stop(trainer, run)  # a safe point: between epochs
    call_callbacks(trainer, run, "on_train_end")
    timed_hook(run, "on_train_end")()


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
        timed_hook(run, "on_validation_model_zero_grad")()
    host = evaluation_loop(trainer, run, "validation", run.val_data, run.val_limit)
    run.module._attach(trainer, run.train_store)
    return host


def _validation_due(trainer: Trainer) -> bool:
    every = trainer.check_val_every_n_epoch
    return trainer.validating_in_fit and (every is None or (trainer.current_epoch + 1) % every == 0)


def _start_epoch(
    run: Run, data: Any, count: int | None, resume: ResumePoint | None
) -> tuple[Any, Any, dict[str, Any]]:
    """The epoch's iterator, its first batch and the RNG states from its start.

    Resuming mid-epoch, the epoch's starting RNG states are put back, the
    batches already trained on are replayed through the loader (not the
    model) so that the sampler is where it was, then the checkpoint's RNG
    states are put back. With a known ``count`` exactly that many batches are
    read, as Lightning does: reading past the end would run the sampler once
    more, which moves a generator the DataLoader was given.
    """
    skip = resume.batches if resume is not None else 0
    if skip and resume is not None and resume.epoch_rng is not None:
        epoch_rng = resume.epoch_rng
        restore_rng_states(epoch_rng)
    else:
        epoch_rng = capture_rng_states()
    iterator = iter(timed_iter(run.profiler, "[_TrainingEpochLoop].train_dataloader_next", data))
    for done in range(skip):
        if next(iterator, _END) is _END:
            raise CheckpointError(
                f"the checkpoint resumes after batch {skip} of the epoch, but the "
                f"training data has only {done} batches"
            )
    first = next(iterator, _END) if count is None or skip < count else _END
    if skip and resume is not None and resume.rng is not None:
        restore_rng_states(resume.rng)
    return iterator, first, epoch_rng


def train_epoch(trainer: Trainer, run: Run) -> None:
    module, store, device, precision = run.module, run.train_store, run.device, run.precision
    optimizer = run.optimizer
    assert optimizer is not None
    data, limit = run.train_data, run.train_limit
    # None: no len(); the loader is then read one batch ahead to see its end.
    count = batch_count(data, limit)
    set_epoch(data, trainer.current_epoch)
    store.reset()
    resume, run.resume = run.resume, None
    skip = resume.batches if resume is not None else 0
    if resume is not None and not skip and resume.rng is not None:
        restore_rng_states(resume.rng)
    position = trainer._loop
    position.epoch, position.phase = trainer.current_epoch, "epoch_start"
    module._attach(trainer, store)
    module.train()
    if not skip:
        # As Lightning: not called again when resuming mid-epoch.
        call_callbacks(trainer, run, "on_train_epoch_start")
        timed_hook(run, "on_train_epoch_start")()
    # How the epoch ends: "all" its batches, "skipped" (on_train_batch_start
    # returned -1) or "stopped" early (max_steps, should_stop).
    ended = "all"
    if trainer.should_stop and not run.env.distributed:
        # As Lightning: set in on_train_epoch_start, it stops before any batch.
        iterator, pending, epoch_rng, ended = iter(()), _END, None, "stopped"
    else:
        # After on_train_epoch_start, as Lightning: the loader's iterator (which
        # draws its seed from the RNG) is made once the hooks have run.
        iterator, pending, epoch_rng = _start_epoch(run, data, count, resume)
    batch_idx = skip
    # As Lightning, the epoch's batch counters start after on_train_epoch_start.
    position.phase, position.batches, position.completed = "batches", skip, skip
    position.last_batch, position.stepped, position.epoch_rng = False, True, epoch_rng
    position.epoch_start_step = trainer.global_step if resume is None else resume.epoch_start_step
    progress = run.progress
    if progress is not None:
        progress.start(f"epoch {trainer.current_epoch}", count)

    # Per-batch hooks: looked up once per epoch, called only where defined.
    prof = run.profiler
    starts = callback_hooks(run.callbacks, "on_train_batch_start", prof)
    ends = callback_hooks(run.callbacks, "on_train_batch_end", prof)
    before_step = callback_hooks(run.callbacks, "on_before_optimizer_step", prof)
    before_zero = callback_hooks(run.callbacks, "on_before_zero_grad", prof)
    if overridden(module, "on_before_zero_grad"):
        on_zero = timed_hook(run, "on_before_zero_grad")
        before_zero.append(lambda _t, _m, opt: on_zero(opt))
    before_backward, after_backward = backward_hooks(trainer, run)
    batch_start, batch_end = (timed_hook(run, f"on_train_batch_{w}") for w in ("start", "end"))
    before_optimizer = timed_hook(run, "on_before_optimizer_step")
    run_backward = timed_step(run, "backward", precision.backward)
    optimizer_step = timed(prof, "optimizer_step", precision.step)
    step_schedulers = [s for s in run.schedulers if s.interval == "step"]
    epoch_schedulers = automatic_epoch_schedulers(run, plateau=False)
    ddp, transfer, automatic = run.ddp, run.transfer, module.automatic_optimization
    forward = timed_step(run, "training_step", ddp if ddp is not None else module.training_step)
    accumulate = trainer.accumulate_grad_batches
    clip_val, clip_norm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm == "norm"
    log_every, max_steps = trainer.log_every_n_steps, trainer.max_steps
    params = [p for p in module.parameters() if p.requires_grad] if clip_val else []
    val_every, validate = run.val_every, _validation_due(trainer)
    by_total = trainer.check_val_every_n_epoch is None
    alone = not run.env.distributed
    preempt = run.preempt

    while pending is not _END:
        batch = pending
        nxt = batch_idx + 1
        if count is None or nxt < count:
            try:
                pending = next(iterator, _END)
            except Exception:
                # SIGTERM went to the DataLoader's workers too, and torch's own
                # handler ends them: train the batch in hand, then save.
                if preempt is None or not preempt.received:
                    raise
                pending = _CUT
        else:
            pending = _END
        last = pending is _END
        stepping = last or nxt % accumulate == 0
        batch = transfer(batch, device)
        store.batch = batch
        for hook in starts:
            hook(trainer, module, batch, batch_idx)
        if batch_start(batch, batch_idx) == -1:
            # As Lightning: the rest of the epoch is skipped, and the epoch
            # counts as finished (its schedulers step).
            position.last_batch, ended = True, "skipped"
            _step_schedulers(trainer, epoch_schedulers)
            break

        if prof is not None:
            prof.start("run_training_batch")
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
                    run_backward(loss / accumulate if accumulate > 1 else loss)
                    for hook in after_backward:
                        hook()

        if progress is not None:
            progress.advance()
        if automatic and stepping:
            for hook in before_step:
                hook(trainer, module, optimizer)
            before_optimizer(optimizer)
            if clip_val:
                precision.unscale(optimizer)
                if clip_norm:
                    torch.nn.utils.clip_grad_norm_(params, clip_val)
                else:
                    torch.nn.utils.clip_grad_value_(params, clip_val)
            optimizer_step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            trainer.global_step += 1
            for config in step_schedulers:
                if trainer.global_step % config.frequency == 0:
                    config.scheduler.step()
        if prof is not None:
            prof.stop("run_training_batch")
        if last and epoch_schedulers:
            # As Lightning: with the epoch's last batch, before on_train_batch_end
            # (ReduceLROnPlateau waits for the epoch-end metrics).
            _step_schedulers(trainer, epoch_schedulers)
        # As Lightning, every manual-optimization batch counts as one that stepped.
        stepping = stepping or not automatic
        # As Lightning: the values are published every log_every_n_steps batches
        # that stepped, counted over all epochs. They are read before the
        # on_train_batch_end hooks, which may look at callback_metrics.
        due = stepping and (position.stepped_batches + 1) % log_every == 0
        step_host = publish_step_metrics(trainer, run) if due else None
        calls = store.calls
        position.batches, position.stepped, position.last_batch = nxt, stepping, last
        position.total += 1
        for hook in ends:
            hook(trainer, module, output, batch, batch_idx)
        batch_end(output, batch, batch_idx)
        position.completed = nxt
        # The loggers get them after those hooks, as in Lightning, and once
        # should_stop is set on every batch that steps (as Lightning's
        # should_update_logs). A second read only if the hooks logged more.
        if stepping and (due or trainer.should_stop):
            if step_host is None or store.calls != calls:
                step_host = publish_step_metrics(trainer, run, show=step_host is None)
            log_step_metrics(trainer, run, step_host)
        host: dict[str, float] | None = None
        if validate and val_every is not None:
            counter = position.total if by_total else nxt
            if counter % val_every == 0:
                host = _validate_in_fit(trainer, run, stepping)
        # Stopping mid-epoch, only right after an optimizer step (so that no
        # accumulated gradient is lost) and, under DDP, for max_steps only: a
        # rank stopping alone would hang the others, so there should_stop is
        # agreed on at the epoch end instead.
        stop = (
            stepping
            and not last
            and (0 <= max_steps <= trainer.global_step or (trainer.should_stop and alone))
        )
        if stop and trainer.should_stop and validate and host is None:
            host = _validate_in_fit(trainer, run, stepping)  # as Lightning, before stopping
        if host is not None:
            # As Lightning: at the count of batches that stepped before this one.
            log_validation_metrics(trainer, run, host, position.stepped_batches)
            if not (last or stop) and trainer.is_global_zero:
                _show_epoch_metrics(trainer, run)  # at the epoch's end otherwise
        position.stepped_batches += stepping
        # Preempted (SIGTERM, GPULAYER_PREEMPT_NOTICE set): the safe point is
        # here, the batch's hooks done, right after an optimizer step (no
        # accumulated gradient is lost). The epoch's last batch waits for
        # the epoch's end, so that its hooks run first. Without a next batch
        # (_CUT) it is here whatever the accumulation.
        if (
            preempt is not None
            and not last
            and ((preempt.requested and stepping) or pending is _CUT)
        ):
            preempt.stop(trainer, run)
        batch_idx = nxt
        if stop:
            ended = "stopped"
            break
    end_train_epoch(trainer, run, ended)


def end_train_epoch(trainer: Trainer, run: Run, ended: str = "all") -> None:
    """The epoch-end hooks, as Lightning runs them, however the epoch ended.

    An epoch cut short (``ended="stopped"``) still runs its hooks and counts
    in ``current_epoch``, as in Lightning, but its epoch-interval schedulers
    do not step, and a checkpoint resumes inside it.
    """
    module, store, position = run.module, run.train_store, trainer._loop
    # Lightning logs the epoch's values with its counter of batches that
    # stepped taken back by one: that of the epoch's last stepping batch.
    epoch_step = position.stepped_batches - 1
    if ended == "all" and run.val_every is None and _validation_due(trainer):
        # Lightning validates with the last batch, before counting it as stepped.
        val_host = _validate_in_fit(trainer, run, position.stepped)
        log_validation_metrics(trainer, run, val_host, epoch_step)
    position.phase = "epoch_end"
    # What the module logs in on_train_epoch_end is per-epoch by default.
    store.default_on_step, store.default_on_epoch = False, True
    monitors = (EarlyStopping, ModelCheckpoint)
    # As Lightning: other callbacks, then the module, then the monitoring callbacks.
    firsts = [cb for cb in run.callbacks if not isinstance(cb, monitors)]
    train_values = store.epoch_values(run.reducer)
    host = to_host({**store.step_values(), **train_values})
    trainer.callback_metrics.update(host)
    for hook in callback_hooks(firsts, "on_train_epoch_end", run.profiler):
        hook(trainer, module)
    timed_hook(run, "on_train_epoch_end")()
    store.default_on_step, store.default_on_epoch = True, False
    if overridden(module, "on_train_epoch_end") or firsts:
        # What was logged there joins the epoch's values: one more read.
        train_values = store.epoch_values(run.reducer)
        host = to_host({**store.step_values(), **train_values})
        trainer.callback_metrics.update(host)
    if ended != "stopped":
        # Before the monitoring callbacks (Lightning: after them), so that the
        # checkpoints they write hold the stepped scheduler.
        _step_schedulers(trainer, automatic_epoch_schedulers(run, plateau=True))
    lasts: list[Callback] = [cb for cb in run.callbacks if isinstance(cb, monitors)]
    for hook in callback_hooks(lasts, "on_train_epoch_end", run.profiler):
        hook(trainer, module)
    if run.env.distributed:
        # Early stopping decided on one rank stops all of them together.
        trainer.should_stop = distributed.any_rank(trainer.should_stop, run.device)
    if trainer.is_global_zero:
        logged_keys = store.keys_where("logger")
        logged = {k: host[k] for k in train_values if k in logged_keys}
        trainer.logged_metrics.update(logged)
        log_to_loggers(trainer.loggers, logged, epoch_step, trainer.current_epoch)
        _show_epoch_metrics(trainer, run)
    trainer.current_epoch += 1
    if ended != "stopped":
        position.epoch, position.phase = trainer.current_epoch, "idle"


def _show_epoch_metrics(trainer: Trainer, run: Run) -> None:
    """The progress bar's values after a validation or at the epoch's end."""
    stores = (run.train_store, run.val_store)
    prog_keys = set().union(*(s.keys_where("prog_bar") for s in stores))
    if run.progress is not None:
        shown = {k: v for k, v in trainer.callback_metrics.items() if k in prog_keys}
        trainer.progress_bar_metrics.update(shown)
        run.progress.finish(shown)


def automatic_epoch_schedulers(run: Run, *, plateau: bool) -> list[SchedulerConfig]:
    """The epoch-interval schedulers the loop steps: the ReduceLROnPlateau ones
    (``plateau``) or the others; none under manual optimization, as Lightning."""
    if not run.module.automatic_optimization:
        return []
    return [
        config
        for config in run.schedulers
        if config.interval == "epoch"
        and isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) == plateau
    ]


def _step_schedulers(trainer: Trainer, configs: list[SchedulerConfig]) -> None:
    for config in configs:
        if (trainer.current_epoch + 1) % config.frequency:
            continue
        if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            assert config.monitor is not None
            from gpulayer.train.callbacks import monitored_value

            config.scheduler.step(monitored_value(trainer, config.monitor, "ReduceLROnPlateau"))
        else:
            config.scheduler.step()
