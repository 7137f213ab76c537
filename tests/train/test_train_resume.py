"""Resuming from a checkpoint reproduces the uninterrupted run exactly (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer_testkit import Regression, assert_same_weights

from gpulayer.train import CheckpointError, ModelCheckpoint, Module, Trainer
from gpulayer.train.state import resume_position

pytestmark = pytest.mark.torch

EPOCHS = 3  # 10 batches per epoch, accumulate 2: 5 optimizer steps per epoch


def shuffled_loader() -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 4, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)


def fresh() -> Regression:
    # Dropout, Adam and a step LR schedule: RNG, optimizer and scheduler state all matter.
    torch.manual_seed(0)
    return Regression(dropout=0.2, optimizer="adam", lr=0.01, step_lr=3)


def trainer(root: Path, callbacks: list[Any] | None = None, **kwargs: Any) -> Trainer:
    kwargs.setdefault("accelerator", "cpu")
    return Trainer(
        max_epochs=EPOCHS,
        accumulate_grad_batches=2,
        seed=7,
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        callbacks=callbacks,
        **kwargs,
    )


@pytest.fixture
def uninterrupted(tmp_path: Path) -> Regression:
    module = fresh()
    trainer(tmp_path / "whole").fit(module, shuffled_loader(), ckpt_path="last")
    return module


@pytest.mark.parametrize("stop_at", [7, 5, 1])  # mid-epoch, at an epoch's end, first step
def test_resume_after_max_steps_matches_uninterrupted(
    tmp_path: Path, uninterrupted: Regression, stop_at: int
) -> None:
    first = trainer(tmp_path / "split", max_steps=stop_at)
    first.fit(fresh(), shuffled_loader())
    assert first.global_step == stop_at
    assert (first.log_dir / "checkpoints" / "last.ckpt").is_file()

    resumed_module = fresh()
    resumed = trainer(tmp_path / "split")
    resumed.fit(resumed_module, shuffled_loader(), ckpt_path="last")

    assert resumed.global_step == EPOCHS * 5
    assert resumed.current_epoch == EPOCHS
    assert_same_weights(resumed_module, uninterrupted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resume_on_cuda_matches_uninterrupted(tmp_path: Path) -> None:  # pragma: no cover - GPU
    # Dropout draws from the CUDA generator here: its state must be restored too.
    whole = fresh()
    trainer(tmp_path / "whole", accelerator="cuda").fit(whole, shuffled_loader())
    trainer(tmp_path / "split", accelerator="cuda", max_steps=7).fit(fresh(), shuffled_loader())
    resumed = fresh()
    again = trainer(tmp_path / "split", accelerator="cuda")
    again.fit(resumed, shuffled_loader(), ckpt_path="last")
    assert again.global_step == EPOCHS * 5
    assert resumed.net[0].weight.device.type == "cuda"
    assert_same_weights(resumed, whole)


def test_resume_from_an_epoch_checkpoint(tmp_path: Path, uninterrupted: Regression) -> None:
    keep_all = ModelCheckpoint(save_top_k=-1)
    trainer(tmp_path / "all", callbacks=[keep_all]).fit(fresh(), shuffled_loader())
    saved = sorted(p.name for p in keep_all.dirpath.iterdir())  # type: ignore[union-attr]
    assert saved == ["epoch=0-step=5.ckpt", "epoch=1-step=10.ckpt", "epoch=2-step=15.ckpt"]

    module = fresh()
    again = trainer(tmp_path / "again")
    again.fit(module, shuffled_loader(), ckpt_path=keep_all.dirpath / "epoch=0-step=5.ckpt")  # type: ignore[operator]
    assert again.global_step == 15
    assert_same_weights(module, uninterrupted)


def test_resume_mid_epoch_from_every_n_train_steps(
    tmp_path: Path, uninterrupted: Regression
) -> None:
    every = ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)
    trainer(tmp_path / "steps", callbacks=[every]).fit(fresh(), shuffled_loader())
    checkpoint = every.dirpath / "epoch=1-step=8.ckpt"  # type: ignore[operator]
    saved = torch.load(checkpoint, weights_only=True)
    assert resume_position(saved["loops"]["fit_loop"]) == (1, 6)  # epoch 1, after batch 6

    module = fresh()
    trainer(tmp_path / "from8").fit(module, shuffled_loader(), ckpt_path=checkpoint)
    assert_same_weights(module, uninterrupted)


def test_stopping_without_resume_differs(tmp_path: Path, uninterrupted: Regression) -> None:
    # The resume test is not vacuous: restarting from scratch lands elsewhere.
    module = fresh()
    trainer(tmp_path / "short", max_steps=7).fit(module, shuffled_loader())
    restarted = trainer(tmp_path / "restart")
    restarted.fit(module, shuffled_loader())
    assert not torch.equal(module.net[0].weight, uninterrupted.net[0].weight)


def test_last_with_nothing_saved_starts_fresh(tmp_path: Path) -> None:
    t = trainer(tmp_path / "empty", max_steps=2)
    t.fit(fresh(), shuffled_loader(), ckpt_path="last")
    assert t.global_step == 2


def test_resume_rejects_a_weights_only_checkpoint(tmp_path: Path) -> None:
    t = trainer(tmp_path / "w", max_steps=1)
    t.fit(fresh(), shuffled_loader())
    t.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    with pytest.raises(CheckpointError, match="lacks optimizer_states, lr_schedulers"):
        trainer(tmp_path / "w2").fit(
            fresh(), shuffled_loader(), ckpt_path=tmp_path / "weights.ckpt"
        )


def test_missing_checkpoint_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope\.ckpt' does not exist"):
        trainer(tmp_path / "x").fit(fresh(), shuffled_loader(), ckpt_path=tmp_path / "nope.ckpt")


def test_load_from_checkpoint_rebuilds_the_module(tmp_path: Path) -> None:
    t = trainer(tmp_path / "h", max_steps=3)
    module = fresh()
    t.fit(module, shuffled_loader())
    loaded = Regression.load_from_checkpoint(t.log_dir / "checkpoints" / "last.ckpt")
    assert loaded.hparams == {
        "in_dim": 4,
        "hidden": 8,
        "dropout": 0.2,
        "lr": 0.01,
        "optimizer": "adam",
        "step_lr": 3,
    }
    assert loaded.hparams.lr == 0.01  # attribute access, as in Lightning
    assert_same_weights(loaded, module)


def test_checkpoint_hooks_see_and_restore_extra_state(tmp_path: Path) -> None:
    class Counting(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.counter = 0

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["counter"] = 41

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.counter = checkpoint["counter"] + 1

    t = trainer(tmp_path / "c", max_steps=2)
    t.fit(Counting(), shuffled_loader())
    module: Module = Counting()
    trainer(tmp_path / "c").fit(module, shuffled_loader(), ckpt_path="last")
    assert module.counter == 42  # type: ignore[attr-defined]
