"""What a checkpoint holds (see :mod:`gpulayer.train.checkpoint`), and putting it back.

The loop position is recorded as the next batch to train: ``(epoch, batch)``.
A checkpoint written at the end of an epoch points at batch 0 of the next
one. One written mid-epoch (``every_n_train_steps``, or the ``last.ckpt`` of
a run stopped by ``max_steps``) also keeps the RNG states from that epoch's
start, so that a resumed run rebuilds the same shuffled order and skips the
batches already trained on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gpulayer.train.checkpoint import FORMAT, capture_rng_states
from gpulayer.train.errors import CheckpointError
from gpulayer.train.fit import ResumePoint, Run

if TYPE_CHECKING:
    from gpulayer.train.trainer import Trainer


def weights_only_checkpoint(trainer: Trainer, run: Run) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "pytorch_version": str(torch.__version__),
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "state_dict": run.module.state_dict(),
        "hyper_parameters": dict(run.module.hparams),
    }


def dump_checkpoint(trainer: Trainer, run: Run) -> dict[str, Any]:
    checkpoint = weights_only_checkpoint(trainer, run)
    if trainer._epoch_finished:
        loop: dict[str, Any] = {"epoch": trainer.current_epoch + 1, "batch": 0, "epoch_rng": None}
    else:
        batch = trainer._batches_done
        epoch_rng = trainer._epoch_rng if batch else None
        loop = {"epoch": trainer.current_epoch, "batch": batch, "epoch_rng": epoch_rng}
    loop["total_batches"] = trainer._total_batches
    checkpoint.update(
        optimizer_states=[o.state_dict() for o in run.optimizers],
        lr_schedulers=[c.scheduler.state_dict() for c in run.schedulers],
        precision=run.precision.state_dict(),
        loop=loop,
        rng=capture_rng_states(),
        callbacks={cb.state_key: cb.state_dict() for cb in run.callbacks},
    )
    if run.datamodule is not None:
        # As Lightning: under the datamodule's class name, when it has state.
        state = run.datamodule.state_dict()
        if state:
            checkpoint[type(run.datamodule).__qualname__] = state
    run.module.on_save_checkpoint(checkpoint)
    for cb in run.callbacks:
        cb.on_save_checkpoint(trainer, run.module, checkpoint)
    return checkpoint


def restore_checkpoint(trainer: Trainer, run: Run, checkpoint: dict[str, Any]) -> None:
    """Weights, optimizer, schedulers, scaler, counters and loop position.

    Callback states are restored later, once callbacks know their directories.
    """
    missing = [k for k in ("optimizer_states", "loop", "rng") if k not in checkpoint]
    if missing:
        raise CheckpointError(
            f"cannot resume training from this checkpoint: it lacks {', '.join(missing)} "
            f"(a weights-only checkpoint? load it with Module.load_from_checkpoint)"
        )
    run.module.on_load_checkpoint(checkpoint)
    run.module.load_state_dict(checkpoint["state_dict"])
    states = checkpoint["optimizer_states"]
    if len(states) != len(run.optimizers):
        raise CheckpointError(
            f"the checkpoint holds {len(states)} optimizer states but "
            f"configure_optimizers() returned {len(run.optimizers)} optimizers"
        )
    for optimizer, state in zip(run.optimizers, states, strict=True):
        optimizer.load_state_dict(state)
    saved = checkpoint["lr_schedulers"]
    if len(saved) != len(run.schedulers):
        raise CheckpointError(
            f"the checkpoint holds {len(saved)} lr scheduler states but "
            f"configure_optimizers() returned {len(run.schedulers)} schedulers"
        )
    for config, state in zip(run.schedulers, saved, strict=True):
        config.scheduler.load_state_dict(state)
    run.precision.load_state_dict(checkpoint.get("precision", {}))
    loop = checkpoint["loop"]
    trainer.global_step = int(checkpoint["global_step"])
    trainer.current_epoch = int(loop["epoch"])
    trainer._total_batches = int(loop.get("total_batches", 0))
    run.resume = ResumePoint(int(loop["batch"]), loop["epoch_rng"], checkpoint["rng"])
    restore_datamodule(run, checkpoint)


def restore_datamodule(run: Run, checkpoint: dict[str, Any]) -> None:
    """The datamodule's state, if the checkpoint holds one for its class."""
    if run.datamodule is not None:
        key = type(run.datamodule).__qualname__
        if key in checkpoint:
            run.datamodule.load_state_dict(checkpoint[key])


def restore_callbacks(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Callback states, by state_key (after callbacks know their directories)."""
    states = checkpoint.get("callbacks", {})
    assert trainer.lightning_module is not None
    for cb in trainer.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
        cb.on_load_checkpoint(trainer, trainer.lightning_module, checkpoint)
