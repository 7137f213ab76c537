"""ModelCheckpoint and EarlyStopping, driven by scripted metric values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_testkit import Regression, make_batches, quiet

from gpulayer.train import Callback, EarlyStopping, ModelCheckpoint, Trainer, TrainerError

pytestmark = pytest.mark.torch


class Scripted(Regression):
    """Reports ``scores[epoch]`` as its validation "score"."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", torch.tensor(self.scores[self.current_epoch]))


def fit(scores: list[float], callbacks: list[Callback], tmp_path: Path, **kwargs: Any) -> Trainer:
    trainer = Trainer(
        **quiet(
            max_epochs=len(scores),
            callbacks=callbacks,
            enable_checkpointing=True,
            default_root_dir=tmp_path,
            **kwargs,
        )
    )
    trainer.fit(Scripted(scores), make_batches(2), make_batches(1, seed=1))
    return trainer


def names(directory: Path | None) -> list[str]:
    assert directory is not None
    return sorted(p.name for p in directory.iterdir())


def test_top_k_keeps_the_best_by_mode(tmp_path: Path) -> None:
    best = ModelCheckpoint(
        monitor="score", mode="min", save_top_k=2, filename="{epoch}-{score:.1f}"
    )
    fit([5.0, 3.0, 4.0, 1.0, 2.0], [best], tmp_path)
    assert names(best.dirpath) == ["epoch=3-score=1.0.ckpt", "epoch=4-score=2.0.ckpt"]
    assert best.best_model_path.endswith("epoch=3-score=1.0.ckpt")
    assert best.best_model_score == 1.0
    saved = torch.load(best.best_model_path, weights_only=True)
    assert (saved["epoch"], saved["global_step"]) == (3, 8)


def test_top_k_max_mode_and_save_last(tmp_path: Path) -> None:
    best = ModelCheckpoint(monitor="score", mode="max", save_top_k=1, save_last=True)
    fit([5.0, 3.0, 7.0, 1.0], [best], tmp_path)
    assert names(best.dirpath) == ["epoch=2-step=6.ckpt", "last.ckpt"]
    last = torch.load(best.dirpath / "last.ckpt", weights_only=True)  # type: ignore[operator]
    assert last["global_step"] == 8


def test_every_n_train_steps(tmp_path: Path) -> None:
    every = ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)
    fit([1.0] * 5, [every], tmp_path)  # 10 steps
    assert names(every.dirpath) == [
        "epoch=1-step=3.ckpt",
        "epoch=2-step=6.ckpt",
        "epoch=4-step=9.ckpt",
    ]


def test_default_checkpointing_keeps_only_last(tmp_path: Path) -> None:
    trainer = fit([1.0, 2.0], [], tmp_path)
    assert names(trainer.log_dir / "checkpoints") == ["last.ckpt"]
    assert trainer.checkpoint_callback is not None
    assert trainer.checkpoint_callback.last_model_path == str(
        trainer.log_dir / "checkpoints" / "last.ckpt"
    )


def test_a_missing_monitor_lists_what_was_logged(tmp_path: Path) -> None:
    with pytest.raises(
        TrainerError, match="no metric 'val_acc'; logged metrics: loss, score, train_loss"
    ):
        fit([1.0], [ModelCheckpoint(monitor="val_acc")], tmp_path)


def test_a_bad_filename_field_is_named(tmp_path: Path) -> None:
    with pytest.raises(TrainerError, match="names 'acc', which is not among epoch, step"):
        fit([1.0], [ModelCheckpoint(filename="{acc}")], tmp_path)


def test_early_stopping_after_patience(tmp_path: Path) -> None:
    stop = EarlyStopping(monitor="score", patience=2, mode="min")
    trainer = fit([5.0, 4.0, 4.5, 4.2, 1.0, 0.5], [stop], tmp_path)
    assert stop.stopped_epoch == 3
    assert trainer.current_epoch == 4  # epochs 0..3 ran
    assert stop.best_score == 4.0


def test_early_stopping_min_delta_and_max_mode(tmp_path: Path) -> None:
    stop = EarlyStopping(monitor="score", patience=1, mode="max", min_delta=0.5)
    trainer = fit([1.0, 1.4, 3.0, 3.2], [stop], tmp_path)
    assert stop.stopped_epoch == 1 and trainer.current_epoch == 2


def test_early_stopping_on_non_finite(tmp_path: Path) -> None:
    stop = EarlyStopping(monitor="score", patience=10)
    trainer = fit([1.0, float("nan"), 0.5], [stop], tmp_path)
    assert stop.stopped_epoch == 1 and trainer.current_epoch == 2


def test_early_stopping_without_validation_checks_training_metrics(tmp_path: Path) -> None:
    class Flat(Regression):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("flat", 1.0, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

    stop = EarlyStopping(monitor="flat", patience=2)
    trainer = Trainer(**quiet(max_epochs=10, callbacks=[stop]))
    trainer.fit(Flat(), make_batches(2))
    assert trainer.current_epoch == 3  # first check sets the best, two more without gain


def test_hooks_run_in_order(tmp_path: Path) -> None:
    hooks = [
        "on_fit_start",
        "on_fit_end",
        "on_train_start",
        "on_train_end",
        "on_train_epoch_start",
        "on_train_epoch_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_validation_end",
        "on_train_batch_end",
    ]
    calls: list[str] = []

    def recorder(name: str) -> Any:
        return lambda self, *args: calls.append(name)

    Order = type("Order", (Callback,), {name: recorder(name) for name in hooks})
    fit([1.0], [Order()], tmp_path)
    assert calls == [
        "on_fit_start",
        # Lightning's sanity check: num_sanity_val_steps=2 validation batches first.
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_validation_end",
        "on_train_start",
        "on_train_epoch_start",
        "on_train_batch_end",
        "on_train_batch_end",
        "on_validation_epoch_start",
        "on_validation_epoch_end",
        "on_validation_end",
        "on_train_epoch_end",
        "on_train_end",
        "on_fit_end",
    ]


def test_plateau_scheduler_reads_the_monitored_metric(tmp_path: Path) -> None:
    class Plateau(Scripted):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
                optimizer, patience=0, factor=0.5
            )
            return {"optimizer": optimizer, "lr_scheduler": scheduler, "monitor": "score"}

    trainer = Trainer(**quiet(max_epochs=3))
    trainer.fit(Plateau([1.0, 2.0, 3.0]), make_batches(1), make_batches(1))
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.25


def test_should_stop_set_mid_epoch_stops_after_that_step() -> None:
    class StopAtThree(Callback):
        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if trainer.global_step == 3:
                trainer.should_stop = True

    trainer = Trainer(**quiet(max_epochs=5, callbacks=[StopAtThree()]))
    trainer.fit(Regression(), make_batches(10))
    # As Lightning: the epoch cut short still ends (its hooks run) and counts.
    assert (trainer.global_step, trainer.current_epoch) == (3, 1)
