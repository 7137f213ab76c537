"""What a checkpoint holds (see :mod:`gpulayer.train.checkpoint`), and putting it back.

Where the two formats meet, a checkpoint has Lightning 2.6's keys, so that
Lightning resumes GPUlayer's files and GPUlayer resumes Lightning's:
``epoch``, ``global_step``, ``pytorch-lightning_version``, ``state_dict``,
``loops``, ``callbacks`` (by Lightning's state keys), ``optimizer_states``,
``lr_schedulers``, ``MixedPrecision`` (the gradient scaler),
``hyper_parameters`` and the datamodule's state under its class name.

The loop position is read from Lightning's progress counters in ``loops``:
the next batch to train is ``(epoch, batch)``. A checkpoint written at the
end of an epoch points at batch 0 of the next one; one written mid-epoch
(``every_n_train_steps``, or the ``last.ckpt`` of a run stopped by
``max_steps``) at the batch after the last one trained. GPUlayer adds what
Lightning does not keep: ``rng`` (every RNG state) and, mid-epoch, the RNG
states from that epoch's start (``loops.fit_loop.state_dict.gpulayer``), so
that a resumed run rebuilds the same shuffled order and skips the batches
already trained on. A Lightning checkpoint, without them, resumes at the same
batch with the RNG as it is.

GPUlayer's first format (``"gpulayer.train/1"``: ``loop``, ``precision``,
callback states under ``ModelCheckpoint[monitor=...]``) still loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpulayer.train.checkpoint import FORMAT, LIGHTNING_LAYOUT, capture_rng_states
from gpulayer.train.errors import CheckpointError
from gpulayer.train.fit import LoopPosition, ResumePoint, Run

if TYPE_CHECKING:
    from gpulayer.train.trainer import Trainer

#: What resuming needs besides the weights (a weights-only file lacks them).
RESUME_KEYS = ("optimizer_states", "lr_schedulers")
#: Lightning's class name for the mixed-precision plugin, the key of the scaler's state.
SCALER_KEY = "MixedPrecision"

# ---- Lightning's progress counters ---------------------------------------------


def _counts(ready: int, started: int, processed: int, completed: int) -> dict[str, int]:
    return {"ready": ready, "started": started, "processed": processed, "completed": completed}


def _steps(total: int, current: int, *, started: bool = False) -> dict[str, Any]:
    def one(n: int) -> dict[str, int]:
        return (
            {"ready": n, "started": n, "completed": n} if started else {"ready": n, "completed": n}
        )

    return {"total": one(total), "current": one(current)}


def fit_loop_state(trainer: Trainer, manual: bool) -> dict[str, Any]:
    """``loops["fit_loop"]``: Lightning's counters, as Lightning would have them now.

    Only the counters that say where training is are written (not those of
    the validation inside fit, nor the schedulers'): Lightning loads a
    partial state, keeping its defaults for the rest.
    """
    p = trainer._loop
    e = p.epoch
    # Which of ready, started, processed have moved past `completed` (= e).
    ready, started, processed = {
        "idle": (e, e, e),
        "epoch_start": (e + 1, e, e),
        "batches": (e + 1, e + 1, e),
        "epoch_end": (e + 1, e + 1, e + 1),
    }[p.phase]
    epochs = _counts(ready, started, processed, e)
    n, done = p.batches, p.completed
    batches = {
        "total": _counts(p.total, p.total, p.total, p.total - (n - done)),
        "current": _counts(n, n, n, done),
        "is_last_batch": p.last_batch,
    }
    steps, this_epoch = trainer.global_step, trainer.global_step - p.epoch_start_step
    # Lightning counts a zero_grad when an accumulation window begins.
    waiting = 0 if p.stepped else 1
    automatic = {
        "optimizer": {
            "step": _steps(0 if manual else steps, 0 if manual else this_epoch),
            "zero_grad": _steps(
                0 if manual else steps + waiting,
                0 if manual else this_epoch + waiting,
                started=True,
            ),
        }
    }
    state: dict[str, Any] = {
        "state_dict": {},
        "epoch_progress": {"total": dict(epochs), "current": dict(epochs)},
        "epoch_loop.state_dict": {"_batches_that_stepped": p.stepped_batches},
        "epoch_loop.batch_progress": batches,
        "epoch_loop.automatic_optimization.optim_progress": automatic,
        "epoch_loop.manual_optimization.optim_step_progress": _steps(
            steps if manual else 0, this_epoch if manual else 0
        ),
    }
    if resume_position(state)[1] and p.epoch_rng is not None:
        state["state_dict"]["gpulayer"] = {"epoch_rng": p.epoch_rng}
    return state


def resume_position(fit_loop: Mapping[str, Any]) -> tuple[int, int]:
    """The next batch to train, ``(epoch, batch)``, read from Lightning's counters.

    As Lightning resumes: inside an epoch, after the batches it trained; after
    an epoch that stopped early (max_steps), inside that epoch; after an
    epoch's last batch, at the next epoch.
    """
    epochs = fit_loop["epoch_progress"]["current"]
    batches = fit_loop["epoch_loop.batch_progress"]
    if epochs["started"] > epochs["processed"]:
        return int(epochs["processed"]), int(batches["current"]["processed"])
    if epochs["processed"] > epochs["completed"] and not batches["is_last_batch"]:
        return int(epochs["completed"]), int(batches["current"]["completed"])
    return int(epochs["processed"]), 0


def loops_state(trainer: Trainer, run: Run) -> dict[str, Any]:
    # The evaluation loops keep nothing across calls; Lightning still reads
    # the entry of the loop it resumes.
    return {
        "fit_loop": fit_loop_state(trainer, manual=not run.module.automatic_optimization),
        "validate_loop": {"state_dict": {}},
        "test_loop": {"state_dict": {}},
        "predict_loop": {"state_dict": {}},
    }


@dataclass
class _Position:
    epoch: int
    batch: int
    epoch_rng: dict[str, Any] | None
    total: int
    stepped_batches: int
    epoch_start_step: int


def read_position(checkpoint: Mapping[str, Any]) -> _Position:
    """Where the checkpoint left the loop, from ``loops`` (or the old ``loop``)."""
    step = int(checkpoint["global_step"])
    if "loops" not in checkpoint:
        # GPUlayer's first format. It did not keep the per-epoch counters,
        # which only Lightning's own counters (written later) depend on.
        loop = checkpoint["loop"]
        batch = int(loop["batch"])
        epoch_rng = loop["epoch_rng"] if batch else None
        total = int(loop.get("total_batches", 0))
        if min(batch, total, int(loop["epoch"]), step) < 0:
            raise ValueError(f"negative counters in {dict(loop, epoch_rng=...)}")
        return _Position(int(loop["epoch"]), batch, epoch_rng, total, step, step)
    fit = checkpoint["loops"]["fit_loop"]
    epoch, batch = resume_position(fit)
    batches = fit["epoch_loop.batch_progress"]
    extra = (fit.get("state_dict") or {}).get("gpulayer") or {}
    stepped = int((fit.get("epoch_loop.state_dict") or {}).get("_batches_that_stepped", step))
    if batches["current"]["completed"] < batches["current"]["processed"]:
        stepped += 1  # written in on_train_batch_end, before Lightning counts the batch
    manual = fit.get("epoch_loop.manual_optimization.optim_step_progress")
    automatic = fit.get("epoch_loop.automatic_optimization.optim_progress")
    this_epoch = 0
    if batch and manual and manual["total"]["completed"]:
        this_epoch = int(manual["current"]["completed"])
    elif batch and automatic:
        this_epoch = int(automatic["optimizer"]["step"]["current"]["completed"])
    position = _Position(
        epoch,
        batch,
        extra.get("epoch_rng") if batch else None,
        int(batches["total"]["processed"]),
        stepped,
        step - this_epoch,
    )
    counts = (position.epoch, position.batch, position.total, position.epoch_start_step, step)
    if min(counts) < 0:
        raise ValueError(f"negative counters {counts}")
    return position


# ---- writing -----------------------------------------------------------------


def weights_only_checkpoint(trainer: Trainer, run: Run) -> dict[str, Any]:
    checkpoint = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        # Lightning refuses a file without it, and migrates one with an older
        # version: this is the layout the file follows, not who wrote it.
        "pytorch-lightning_version": LIGHTNING_LAYOUT,
        "format": FORMAT,
        "pytorch_version": str(torch.__version__),
        "state_dict": run.module.state_dict(),
        "loops": loops_state(trainer, run),
        "hyper_parameters": dict(run.module.hparams),
    }
    return checkpoint


def dump_checkpoint(trainer: Trainer, run: Run, *, weights_only: bool = False) -> dict[str, Any]:
    """The checkpoint dict, with Lightning's hooks in Lightning's order."""
    checkpoint = weights_only_checkpoint(trainer, run)
    if not weights_only:
        # As Lightning: only callbacks with state, under their state keys.
        checkpoint["callbacks"] = {
            cb.state_key: state for cb in run.callbacks if (state := cb.state_dict())
        }
        checkpoint["optimizer_states"] = [o.state_dict() for o in run.optimizers]
        checkpoint["lr_schedulers"] = [c.scheduler.state_dict() for c in run.schedulers]
        scaler = run.precision.state_dict().get("scaler")
        if scaler:
            checkpoint[SCALER_KEY] = scaler
        checkpoint["rng"] = capture_rng_states()
    if run.datamodule is not None:
        # As Lightning: under the datamodule's class name, when it has state.
        state = run.datamodule.state_dict()
        if state:
            checkpoint[type(run.datamodule).__qualname__] = state
    if not weights_only:
        for cb in run.callbacks:
            cb.on_save_checkpoint(trainer, run.module, checkpoint)
    run.module.on_save_checkpoint(checkpoint)
    return checkpoint


# ---- reading back --------------------------------------------------------------


def check_resumable(checkpoint: Mapping[str, Any]) -> None:
    """Refuse, before anything is loaded, a checkpoint that cannot resume training."""
    missing = [k for k in RESUME_KEYS if k not in checkpoint]
    if "loops" not in checkpoint and "loop" not in checkpoint:
        missing.append("loops")
    if missing:
        raise CheckpointError(
            f"cannot resume training from this checkpoint: it lacks {', '.join(missing)} "
            f"(a weights-only checkpoint? load it with Module.load_from_checkpoint)"
        )
    try:
        read_position(checkpoint)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"cannot resume training from this checkpoint: its loop position "
            f"({'loops' if 'loops' in checkpoint else 'loop'}) is malformed ({exc!r}); "
            f"resume from another file, or load the weights with Module.load_from_checkpoint"
        ) from exc


def restore_modules(trainer: Trainer, run: Run, checkpoint: dict[str, Any]) -> None:
    """As Lightning, before the optimizers exist: the module (its
    ``on_load_checkpoint``, then the weights), the datamodule, the callbacks."""
    run.module.on_load_checkpoint(checkpoint)
    run.module.load_state_dict(checkpoint["state_dict"])
    restore_datamodule(run, checkpoint)
    restore_callbacks(trainer, run, checkpoint)


def restore_training_state(trainer: Trainer, run: Run, checkpoint: dict[str, Any]) -> None:
    """The scaler, the loop position, the optimizers and the schedulers."""
    states, saved = checkpoint["optimizer_states"], checkpoint["lr_schedulers"]
    if len(states) != len(run.optimizers):
        raise CheckpointError(
            f"the checkpoint holds {len(states)} optimizer states but "
            f"configure_optimizers() returned {len(run.optimizers)} optimizers"
        )
    if len(saved) != len(run.schedulers):
        raise CheckpointError(
            f"the checkpoint holds {len(saved)} lr scheduler states but "
            f"configure_optimizers() returned {len(run.schedulers)} schedulers"
        )
    scaler = checkpoint.get(SCALER_KEY)
    run.precision.load_state_dict({"scaler": scaler} if scaler else checkpoint.get("precision", {}))
    position = read_position(checkpoint)
    for optimizer, state in zip(run.optimizers, states, strict=True):
        optimizer.load_state_dict(state)
    for config, state in zip(run.schedulers, saved, strict=True):
        config.scheduler.load_state_dict(state)
    trainer.global_step = int(checkpoint["global_step"])
    trainer.current_epoch = position.epoch
    trainer._loop = LoopPosition(
        epoch=position.epoch,
        total=position.total,
        stepped_batches=position.stepped_batches,
        epoch_start_step=position.epoch_start_step,
    )
    run.resume = ResumePoint(
        position.batch, position.epoch_rng, checkpoint.get("rng"), position.epoch_start_step
    )


def restore_datamodule(run: Run, checkpoint: dict[str, Any]) -> None:
    """The datamodule's state, if the checkpoint holds one for its class."""
    if run.datamodule is not None:
        key = type(run.datamodule).__qualname__
        if key in checkpoint:
            run.datamodule.load_state_dict(checkpoint[key])


def restore_callbacks(trainer: Trainer, run: Run, checkpoint: dict[str, Any]) -> None:
    """As Lightning: every callback's ``on_load_checkpoint``, then each state,
    found by ``state_key`` (or the key GPUlayer's first format used)."""
    module = run.module
    for cb in run.callbacks:
        cb.on_load_checkpoint(trainer, module, checkpoint)
    states = checkpoint.get("callbacks") or {}
    for cb in run.callbacks:
        legacy = cb._legacy_state_key
        state = states.get(cb.state_key, states.get(legacy) if legacy is not None else None)
        if state:
            cb.load_state_dict(state)
