"""Sync-free metric accumulation, loggers and the progress display."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_testkit import Regression, make_batches, quiet

from gpulayer.train import CSVLogger, TensorBoardLogger, Trainer, TrainerError
from gpulayer.train.logging import MetricStore, infer_batch_size, to_host
from gpulayer.train.progress import ProgressBar

pytestmark = pytest.mark.torch


def test_epoch_mean_is_weighted_by_batch_size() -> None:
    store = MetricStore(on_step=False, on_epoch=True)
    for value, size in ((1.0, 2), (4.0, 6)):
        store.batch = (torch.zeros(size, 3), torch.zeros(size))
        store.log("loss", torch.tensor(value))
    values = store.epoch_values()
    assert isinstance(values["loss"], torch.Tensor)  # still a tensor: nothing was read
    assert to_host(values) == {"loss": pytest.approx((1 * 2 + 4 * 6) / 8)}


@pytest.mark.parametrize(
    ("reduce_fx", "expected"), [("sum", 9.0), ("max", 5.0), ("min", 1.0), ("mean", 3.0)]
)
def test_reductions(reduce_fx: str, expected: float) -> None:
    for as_tensor in (True, False):
        store = MetricStore(on_step=False, on_epoch=True)
        for value in (1.0, 5.0, 3.0):
            store.log(
                "m", torch.tensor(value) if as_tensor else value, reduce_fx=reduce_fx, batch_size=1
            )
        assert to_host(store.epoch_values()) == {"m": pytest.approx(expected)}


def test_the_accumulator_does_not_alias_the_logged_tensor() -> None:
    store = MetricStore(on_step=False, on_epoch=True)
    first = torch.tensor(2.0)
    store.log("m", first, reduce_fx="sum")
    store.log("m", torch.tensor(3.0), reduce_fx="sum")
    assert first.item() == 2.0
    assert to_host(store.epoch_values()) == {"m": 5.0}


def test_step_and_epoch_keys_follow_lightning() -> None:
    store = MetricStore(on_step=True, on_epoch=False)
    store.log("a", torch.tensor(1.0))
    store.log("b", torch.tensor(2.0), on_epoch=True, prog_bar=True)
    store.log("c", torch.tensor(3.0), on_step=False, on_epoch=True, logger=False)
    store.log("b", torch.tensor(4.0))
    # The plain "b" too, as Lightning's callback_metrics; never for the loggers.
    assert to_host(store.step_values()) == {"a": 1.0, "b_step": 4.0, "b": 4.0}
    assert to_host(store.epoch_values()) == {"b_epoch": 3.0, "b": 3.0, "c": 3.0}
    assert store.keys_where("prog_bar") == {"b_step", "b_epoch"}
    assert store.keys_where("logger") == {"a", "b_step", "b_epoch"}


def test_step_values_are_references_not_copies() -> None:
    store = MetricStore(on_step=True, on_epoch=False)
    loss = torch.tensor(1.5, requires_grad=True) * 2
    store.log("loss", loss)
    held = store.step_values()["loss"]
    assert isinstance(held, torch.Tensor) and not held.requires_grad
    assert held.data_ptr() == loss.data_ptr()  # detached, not copied


def test_to_host_reads_each_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(t.shape) or original(t))
    host = to_host(
        {
            "a": torch.tensor(1.0),
            "b": torch.tensor([2.0]),
            "c": 3.0,
            "d": torch.tensor(4, dtype=torch.int64),
        }
    )
    assert host == {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    assert calls == [torch.Size([3])]


def test_infer_batch_size() -> None:
    assert infer_batch_size((torch.zeros(5, 2), torch.zeros(5))) == 5
    assert infer_batch_size({"x": torch.zeros(7, 1)}) == 7
    assert infer_batch_size([["text"], torch.zeros(3)]) == 3
    assert infer_batch_size("no tensors") == 1


def test_csv_logger_writes_steps_and_epochs(tmp_path: Path) -> None:
    trainer = Trainer(
        **quiet(max_epochs=2, log_every_n_steps=2, logger=True, default_root_dir=tmp_path)
    )
    trainer.fit(Regression(), make_batches(4), make_batches(2, seed=1))
    rows = list(csv.DictReader(io.StringIO((trainer.log_dir / "metrics.csv").read_text())))
    step_rows = [r for r in rows if r["loss"]]
    val_rows = [r for r in rows if r["val_loss"]]
    epoch_rows = [r for r in rows if r["train_loss"]]
    # As Lightning: at the batches that stepped before the current one, and a
    # row for the validation, then one for the epoch's training values.
    assert [int(r["step"]) for r in step_rows] == [1, 3, 5, 7]
    assert [(int(r["step"]), int(r["epoch"])) for r in val_rows] == [(3, 0), (7, 1)]
    assert [(int(r["step"]), int(r["epoch"])) for r in epoch_rows] == [(3, 0), (7, 1)]
    assert rows.index(val_rows[0]) + 1 == rows.index(epoch_rows[0])
    assert float(step_rows[-1]["loss"]) == pytest.approx(trainer.callback_metrics["loss"])
    assert json.loads((trainer.log_dir / "hparams.json").read_text())["hidden"] == 8
    assert trainer.log_dir == tmp_path / "version_0"


def test_csv_logger_widens_its_header(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    logger.log_metrics({"a": 1.0}, step=1)
    logger.log_metrics({"a": 2.0}, step=2)
    logger.log_metrics({"b": 3.0}, step=3)
    metrics = tmp_path / "lightning_logs" / "version_0" / "metrics.csv"  # Lightning's layout
    assert metrics.read_text().splitlines() == [
        "step,a,b",
        "1,1.0,",
        "2,2.0,",
        "3,,3.0",
    ]


def test_tensorboard_logger(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path)
    trainer = Trainer(**quiet(max_epochs=1, log_every_n_steps=1, logger=[logger]))
    trainer.fit(Regression(), make_batches(2))
    assert list((tmp_path / "lightning_logs" / "version_0").glob("events.out.tfevents.*"))


def test_tensorboard_logger_explains_a_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(TrainerError, match="pip install tensorboard"):
        TensorBoardLogger()


def test_progress_lines_show_logged_values_at_log_steps() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream)
    assert not bar.interactive
    bar.start("epoch 0", 10)
    for _ in range(4):
        bar.advance()
    assert stream.getvalue() == ""  # counting alone prints nothing off a terminal
    bar.show({"loss": 0.25})
    bar.finish({"val_loss": 0.5})
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("epoch 0 4/10 [") and lines[0].endswith("loss=0.25")
    assert lines[1].endswith("loss=0.25 val_loss=0.5")


def test_progress_redraws_in_place_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    bar = ProgressBar(stream, refresh_s=0.0)
    bar.start("epoch 1", None)
    bar.advance()
    bar.advance()
    assert stream.getvalue().count("\r") == 2
    assert "\n" not in stream.getvalue()
    assert "epoch 1 2 [" in stream.getvalue()


def test_trainer_progress_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    Trainer(**quiet(max_epochs=1, log_every_n_steps=2, enable_progress_bar=True)).fit(
        Regression(), make_batches(4)
    )
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("epoch 0 2/4") and "loss=" in err[0]
    assert err[-1].startswith("epoch 0 4/4")


def test_module_logs_in_epoch_end_hooks_count_per_epoch() -> None:
    class EpochEnd(Regression):
        def on_train_epoch_end(self) -> None:
            self.log("epoch_marker", float(self.current_epoch) + 0.5)

    trainer = Trainer(**quiet(max_epochs=2))
    trainer.fit(EpochEnd(), make_batches(2))
    assert trainer.callback_metrics["epoch_marker"] == 1.5


def test_validate_returns_metrics(tmp_path: Path) -> None:
    module = Regression()
    trainer = Trainer(**quiet())
    [metrics] = trainer.validate(module, make_batches(3), verbose=False)
    with torch.no_grad():
        expected = torch.stack(
            [torch.nn.functional.mse_loss(module(x), y) for x, y in make_batches(3)]
        ).mean()
    assert metrics == {"val_loss": pytest.approx(expected.item())}


def test_logging_outside_a_loop_is_a_no_op() -> None:
    module = Regression()
    module.log("anything", 1.0)
    loss: Any = module.training_step(make_batches(1)[0], 0)
    assert loss.shape == ()
