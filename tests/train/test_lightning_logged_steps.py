"""What the loggers receive, call by call, against real Lightning.

The x axis of every plot is the step a value is logged at. The same module
and callbacks run under ``lightning.pytorch`` and under ``gpulayer.train``
with a logger that records each ``log_metrics(metrics, step)`` call; the two
lists must be equal: the same calls, in the same order, at the same steps,
with the same names and (to float precision) values. Lightning's step is its
count of training batches that stepped before the current one, so the first
batch's values are at step 0.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.train as G

pl = pytest.importorskip("lightning.pytorch")

pytestmark = [
    pytest.mark.torch,
    # Lightning's advice (workers, logging intervals) is not under test.
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

Call = tuple[int, dict[str, float]]


def lib_of(name: str) -> Any:
    return pl if name == "pl" else G


def loader(batches: int = 4, seed: int = 0) -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * 4, 3, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def recorder(lib: str, calls: list[Call]) -> Any:
    """A logger on ``lib``'s base class that keeps every log_metrics call."""
    base = pl.loggers.Logger if lib == "pl" else G.Logger

    class Recording(base):  # type: ignore[misc, valid-type]
        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            assert step is not None, "the trainer always gives the step"
            calls.append((int(step), {k: float(v) for k, v in metrics.items()}))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return Recording()


def module_class(
    lib: str, *, manual: bool = False, val_on_step: bool = False, batch_end: bool = False
) -> type:
    """A regression logging per step, per epoch (also from on_train_epoch_end)
    and in validation; with ``batch_end``, also from on_train_batch_end."""

    class Net(lib_of(lib).LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.log("loss", loss)
            self.log("both", loss * 2, on_step=True, on_epoch=True)
            self.log("mean_loss", loss, on_step=False, on_epoch=True)
            self.log("hidden", loss, logger=False)
            if manual:
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
                return None
            return loss

        def on_train_epoch_end(self) -> None:
            self.log("epoch_marker", float(self.current_epoch) + 0.5)

        if batch_end:

            def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
                self.log("after_batch", float(batch_idx) + 0.25)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.log("val_loss", loss)
            if val_on_step:
                self.log("val_step_loss", loss, on_step=True, on_epoch=True)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Net


def run(
    lib: str,
    *,
    batches: int = 4,
    after_fit: bool = False,
    module: Mapping[str, Any] | None = None,
    callbacks: Any = None,
    **trainer_args: Any,
) -> list[Call]:
    """Fit ``lib``'s module (built with the ``module`` options) for 2 epochs
    (then validate and test, if ``after_fit``); every log_metrics call made."""
    calls: list[Call] = []
    args: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": 2,
        "logger": recorder(lib, calls),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "callbacks": callbacks(lib) if callbacks is not None else [],
        **trainer_args,
    }
    torch.manual_seed(0)
    model = module_class(lib, **(module or {}))()
    trainer = lib_of(lib).Trainer(**args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice is not under test
        trainer.fit(model, loader(batches), loader(2, seed=1))
        if after_fit:
            trainer.validate(model, loader(2, seed=1), verbose=False)
            trainer.test(model, loader(2, seed=2), verbose=False)
    return calls


def both(**kwargs: Any) -> tuple[list[Call], list[Call]]:
    """(GPUlayer's calls, Lightning's calls) for the same run."""
    theirs = run("pl", **kwargs)
    ours = run("gpulayer", **kwargs)
    return ours, theirs


def assert_same_calls(ours: list[Call], theirs: list[Call]) -> None:
    assert theirs, "Lightning logged nothing: the case tests nothing"
    # Steps and names first, for a readable failure, then the values.
    assert [(s, sorted(m)) for s, m in ours] == [(s, sorted(m)) for s, m in theirs]
    for (step, mine), (_, lightning) in zip(ours, theirs, strict=True):
        assert mine == pytest.approx(lightning, rel=1e-5), step


def steps_with(calls: list[Call], name: str) -> list[int]:
    return [step for step, metrics in calls if name in metrics]


def test_plain_fit_then_validate_and_test() -> None:
    """Validation at each epoch's end, every step logged; then validate() and
    test() after fit, at the count of batches that stepped during fit."""
    ours, theirs = both(log_every_n_steps=1, after_fit=True)
    assert_same_calls(ours, theirs)
    # The first batch's values at step 0 (before its step is counted); the
    # epoch's validation, then its training values, at its last batch's step.
    assert [s for s, _ in ours[:6]] == [0, 1, 2, 3, 3, 3]
    assert "val_loss" in ours[4][1] and "mean_loss" in ours[5][1]
    assert ours[5][1]["epoch_marker"] == 0.5  # logged in on_train_epoch_end
    assert steps_with(ours, "test_loss") == [8]
    assert "hidden" not in {name for _, metrics in ours for name in metrics}


@pytest.mark.parametrize("log_every", [1, 2, 3])
def test_log_every_n_steps_counts_over_epochs(log_every: int) -> None:
    """log_every_n_steps counts batches that stepped over all epochs (3 with 4
    batches an epoch: the 3rd of epoch 0 and the 2nd of epoch 1)."""
    ours, theirs = both(log_every_n_steps=log_every)
    assert_same_calls(ours, theirs)
    assert steps_with(ours, "loss") == [s for s in range(8) if (s + 1) % log_every == 0]


def test_val_check_interval_half_an_epoch() -> None:
    """Validation mid-epoch and at the epoch's end, each at the step of the
    batch it follows."""
    ours, theirs = both(log_every_n_steps=1, val_check_interval=0.5)
    assert_same_calls(ours, theirs)
    assert steps_with(ours, "val_loss") == [1, 3, 5, 7]


@pytest.mark.parametrize("batches", [4, 5])
def test_accumulate_grad_batches(batches: int) -> None:
    """Steps count the batches that stepped: with 2 accumulated, every second
    batch, and the epoch's last one (5 batches: after batches 2, 4 and 5)."""
    ours, theirs = both(log_every_n_steps=1, accumulate_grad_batches=2, batches=batches)
    assert_same_calls(ours, theirs)
    per_epoch = 2 if batches == 4 else 3
    assert steps_with(ours, "loss") == list(range(2 * per_epoch))


@pytest.mark.parametrize("log_every", [1, 3])
def test_manual_optimization_one_optimizer(log_every: int) -> None:
    """Under manual optimization every batch counts as one that stepped."""
    ours, theirs = both(log_every_n_steps=log_every, after_fit=True, module={"manual": True})
    assert_same_calls(ours, theirs)
    assert steps_with(ours, "loss") == [s for s in range(8) if (s + 1) % log_every == 0]


def test_validation_step_values_at_their_own_steps() -> None:
    """Values logged with on_step=True in validation_step go out batch by batch,
    at the number of validation batches before (counted across the validations
    of one fit, anew for validate())."""
    ours, theirs = both(log_every_n_steps=50, after_fit=True, module={"val_on_step": True})
    assert_same_calls(ours, theirs)
    assert steps_with(ours, "val_step_loss_step") == [0, 1, 2, 3, 0, 1]
    assert steps_with(ours, "val_step_loss_epoch") == [3, 7, 8]


def stop_after_second_batch(lib: str) -> list[Any]:
    class Stop(lib_of(lib).Callback):  # type: ignore[misc, name-defined]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 2:
                trainer.should_stop = True

    return [Stop()]


def test_should_stop_logs_the_batch_it_is_set_in() -> None:
    """As Lightning's should_update_logs: once should_stop is set, the batch's
    values are logged even off the log_every_n_steps grid, and the validation
    run before stopping is logged at the same step."""
    ours, theirs = both(log_every_n_steps=50, callbacks=stop_after_second_batch)
    assert_same_calls(ours, theirs)
    assert steps_with(ours, "loss") == [1]
    assert steps_with(ours, "val_loss") == [1]


def test_a_logged_step_value_is_the_step() -> None:
    """As Lightning: a value logged as "step" is used as the step (and no
    "epoch" is added)."""

    def with_step(lib: str) -> list[Any]:
        class LogsStep(lib_of(lib).Callback):  # type: ignore[misc, name-defined]
            def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
                module.log("step", float(100 + trainer.global_step))

        return [LogsStep()]

    ours, theirs = both(log_every_n_steps=2, callbacks=with_step)
    assert_same_calls(ours, theirs)
    assert steps_with(ours, "loss")[:2] == [101, 103]


def test_values_logged_in_on_train_batch_end_are_in_that_step() -> None:
    """The loggers get a step's values after its on_train_batch_end hooks, as
    in Lightning: what those hooks log is in the same call."""
    ours, theirs = both(log_every_n_steps=2, module={"batch_end": True})
    assert_same_calls(ours, theirs)
    assert [m["after_batch"] for _, m in ours if "loss" in m] == [1.25, 3.25, 1.25, 3.25]
