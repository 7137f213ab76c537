"""What a port touches: ``import gpulayer.train as L``, seeding, LR monitor,
loggers, torchmetrics objects in ``self.log`` and the model summary, each
checked against real Lightning where the two can be compared."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_train_sync_free import Recorder, SyncCounter, syncs, syncs_inside_epochs
from trainer_testkit import SRC, make_batches, quiet

import gpulayer.train as L
from gpulayer.train import TrainerError
from gpulayer.train.seed import add_worker_init_fn, worker_init_function
from gpulayer.train.summary import human_count, model_summary

pytestmark = pytest.mark.torch
__all__ = ["syncs"]  # the fixture, imported for its name

SEED_VARS = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _seed_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    # seed_everything sets these (as Lightning does); each test starts without them.
    for name in SEED_VARS:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def loader_of(batches: list[Any]) -> torch.utils.data.DataLoader[Any]:
    """Ready-made batches as a DataLoader: to Lightning a plain list is several loaders."""
    return torch.utils.data.DataLoader(batches, batch_size=None)


def lightning_quiet(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    kwargs.update(overrides)
    return kwargs


def quiet_lightning_run(trainer: Any, *args: Any, **kwargs: Any) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice is not under test
        trainer.fit(*args, **kwargs)


# ---- import gpulayer.train as L ---------------------------------------------
def test_names_of_lightning_pytorch_are_there() -> None:
    import lightning.pytorch

    for name in lightning.pytorch.__all__:
        assert hasattr(L, name), name
    assert L.LightningModule is L.Module
    assert L.callbacks.ModelCheckpoint is L.ModelCheckpoint
    assert L.loggers.CSVLogger is L.CSVLogger
    from gpulayer.train.callbacks import (  # noqa: F401 - the import is the test
        Callback,
        EarlyStopping,
        LearningRateMonitor,
        ModelCheckpoint,
        ModelSummary,
    )
    from gpulayer.train.loggers import CSVLogger, Logger, TensorBoardLogger  # noqa: F401


@pytest.mark.parametrize("package", ["callbacks", "loggers"])
def test_each_lightning_callback_and_logger_exists_or_names_itself(package: str) -> None:
    import importlib

    theirs = importlib.import_module(f"lightning.pytorch.{package}")
    ours = importlib.import_module(f"gpulayer.train.{package}")
    provided = []
    for name in theirs.__all__:
        try:
            getattr(ours, name)
        except TrainerError as exc:
            assert name in str(exc) and "GPUlayer does not provide" in str(exc)
        else:
            provided.append(name)
    expected = {
        "callbacks": [
            "Callback",
            "EarlyStopping",
            "LearningRateMonitor",
            "ModelCheckpoint",
            "ModelSummary",
        ],
        "loggers": ["CSVLogger", "Logger", "TensorBoardLogger"],
    }
    assert sorted(provided) == expected[package]
    with pytest.raises(TrainerError, match="RichProgressBar is a Lightning callback"):
        exec("from gpulayer.train.callbacks import RichProgressBar", {})
    with pytest.raises(AttributeError):
        ours.NoSuchThing  # noqa: B018 - unknown names stay plain AttributeErrors


def test_import_stays_cheap() -> None:
    code = (
        "import sys, gpulayer.train as L; L.callbacks; L.loggers; "
        "heavy = [m for m in ('lightning', 'pytorch_lightning', 'torchmetrics', "
        "'tensorboard', 'torch.utils.tensorboard') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# ---- seed_everything ----------------------------------------------------------
def draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_seed_everything_matches_lightning() -> None:
    from lightning.fabric.utilities.seed import seed_everything as theirs

    assert theirs(11, workers=True, verbose=False) == 11
    their_env = {k: os.environ[k] for k in SEED_VARS}
    their_draws = draws()
    for name in SEED_VARS:
        del os.environ[name]
    assert L.seed_everything(11, workers=True) == 11
    assert their_env == {"PL_GLOBAL_SEED": "11", "PL_SEED_WORKERS": "1"}
    assert {k: os.environ[k] for k in SEED_VARS} == their_env
    ours = draws()
    assert ours[:2] == their_draws[:2] and torch.equal(ours[2], their_draws[2])
    L.seed_everything(11)
    assert os.environ["PL_SEED_WORKERS"] == "0"
    # seed=None reads PL_GLOBAL_SEED, as Lightning does.
    os.environ["PL_GLOBAL_SEED"] = "5"
    assert L.seed_everything() == 5


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", True])
def test_seed_everything_refuses_what_is_not_a_seed(bad: Any) -> None:
    with pytest.raises(TrainerError, match=r"seed=.* must be an int in 0\.\.4294967295"):
        L.seed_everything(bad)
    assert "PL_GLOBAL_SEED" not in os.environ  # nothing was changed


def test_seed_everything_refuses_a_hostile_env_seed() -> None:
    os.environ["PL_GLOBAL_SEED"] = "1; rm -rf /"
    with pytest.raises(TrainerError, match="PL_GLOBAL_SEED='1; rm -rf /'"):
        L.seed_everything()
    assert os.environ["PL_GLOBAL_SEED"] == "1; rm -rf /"


@pytest.mark.parametrize(("worker_id", "rank"), [(0, 0), (1, 0), (3, 2)])
def test_worker_seeds_are_lightnings(worker_id: int, rank: int) -> None:
    from lightning.fabric.utilities.seed import pl_worker_init_function

    results = []
    for init in (pl_worker_init_function, worker_init_function):
        torch.manual_seed(1234 + worker_id)  # what torch does in a worker before init_fn
        init(worker_id, rank=rank)
        results.append(draws())
    (a, b) = results
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


class RandomItems(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(np.random.rand()), random.random()])


def test_workers_seeded_only_when_asked() -> None:
    def fresh() -> torch.utils.data.DataLoader[torch.Tensor]:
        return torch.utils.data.DataLoader(RandomItems(), batch_size=2, num_workers=2)

    L.seed_everything(3)
    loader = fresh()
    add_worker_init_fn(loader, rank=0)
    assert loader.worker_init_fn is None  # workers=False: left alone
    L.seed_everything(3, workers=True)
    mine = fresh()
    mine.worker_init_fn = print  # the user's own wins
    add_worker_init_fn(mine, rank=0)
    assert mine.worker_init_fn is print
    runs = []
    for _ in range(2):
        L.seed_everything(3, workers=True)
        loader = fresh()
        add_worker_init_fn(loader, rank=0)
        runs.append(torch.cat(list(loader)))
    torch.testing.assert_close(runs[0], runs[1])
    # Without the seeding init fn, numpy repeats its state in every worker.
    assert not torch.equal(runs[0][0], runs[0][2])


def test_trainer_seeds_dataloader_workers() -> None:
    # As in Lightning, the Trainer gives the loaders it uses the seeding worker_init_fn.
    L.seed_everything(3, workers=True)
    loader = torch.utils.data.DataLoader(make_batches(2), batch_size=None)
    val = torch.utils.data.DataLoader(make_batches(1), batch_size=None)

    class WithVal(Net):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

    L.Trainer(**quiet(max_epochs=1)).fit(WithVal(), loader, val)
    for used in (loader, val):
        assert isinstance(used.worker_init_fn, functools.partial)
        assert used.worker_init_fn.func is worker_init_function


# ---- LearningRateMonitor ---------------------------------------------------------
def net_module(base: type, scheduler: str = "step", momentum: bool = True) -> Any:
    """The same small regression module for Lightning's base class or ours."""

    class LrNet(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            if momentum:
                optimizer: torch.optim.Optimizer = torch.optim.SGD(
                    self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01
                )
            else:
                optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
            if scheduler == "none":
                return optimizer
            sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": sched, "interval": scheduler},
            }

    return LrNet()


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def recording_logger(base: type, calls: list[tuple[int, dict[str, float]]]) -> Any:
    class Recording(base):  # type: ignore[misc, valid-type]
        @property
        def name(self) -> str:
            return "recording"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            lrs = {k: float(v) for k, v in metrics.items() if k.startswith("lr-")}
            if lrs:
                calls.append((int(step or 0), lrs))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    return Recording()


@pytest.mark.parametrize(
    ("interval", "scheduler", "momentum"),
    [("step", "step", True), ("epoch", "epoch", False), (None, "step", True), (None, "none", True)],
)
def test_learning_rate_monitor_logs_what_lightning_logs(
    interval: str | None, scheduler: str, momentum: bool
) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor as TheirMonitor
    from lightning.pytorch.loggers import Logger as TheirLogger

    batches = loader_of(make_batches(4))
    monitor_args = {"logging_interval": interval, "log_momentum": True, "log_weight_decay": True}
    theirs: list[tuple[int, dict[str, float]]] = []
    torch.manual_seed(0)
    trainer = pl.Trainer(
        **lightning_quiet(
            max_epochs=2,
            log_every_n_steps=2,
            logger=recording_logger(TheirLogger, theirs),
            callbacks=[TheirMonitor(**monitor_args)],
        )
    )
    quiet_lightning_run(trainer, net_module(pl.LightningModule, scheduler, momentum), batches)

    ours: list[tuple[int, dict[str, float]]] = []
    torch.manual_seed(0)
    monitor = L.LearningRateMonitor(**monitor_args)
    L.Trainer(
        **quiet(
            max_epochs=2,
            log_every_n_steps=2,
            logger=recording_logger(L.Logger, ours),
            callbacks=[monitor],
        )
    ).fit(net_module(L.LightningModule, scheduler, momentum), batches)
    assert ours, "nothing was logged"
    assert ours == theirs
    assert monitor.lrs == trainer.callbacks[0].lrs


def test_learning_rate_monitor_names_groups_like_lightning() -> None:
    monitor = L.LearningRateMonitor(log_momentum=True)
    w, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    two = torch.optim.Adam([{"params": [w]}, {"params": [b], "lr": 0.5}], lr=0.1)
    named = torch.optim.SGD([{"params": [w], "name": "encoder"}], lr=0.2)
    assert monitor._stats(two, "lr-Adam") == {
        "lr-Adam/pg1": 0.1,
        "lr-Adam/pg1-momentum": 0.9,
        "lr-Adam/pg2": 0.5,
        "lr-Adam/pg2-momentum": 0.9,
    }
    assert monitor._stats(named, "lr-SGD") == {
        "lr-SGD/encoder": 0.2,
        "lr-SGD/encoder-momentum": 0.0,
    }


def test_learning_rate_monitor_refuses_what_lightning_refuses() -> None:
    with pytest.raises(TrainerError, match=r"logging_interval.*'minute'.*valid values"):
        L.LearningRateMonitor(logging_interval="minute")
    trainer = L.Trainer(**quiet(max_epochs=1, callbacks=[L.LearningRateMonitor()]))
    with pytest.raises(TrainerError, match="LearningRateMonitor needs a logger"):
        trainer.fit(Net(), make_batches(2))


def test_learning_rate_monitor_does_not_sync(syncs: SyncCounter) -> None:
    # The module logs nothing, so any read inside an epoch would be the monitor's.
    calls: list[tuple[int, dict[str, float]]] = []
    recorder = Recorder(syncs)
    L.Trainer(
        **quiet(
            max_epochs=2,
            log_every_n_steps=1,
            logger=recording_logger(L.Logger, calls),
            callbacks=[recorder, L.LearningRateMonitor(logging_interval="step")],
        )
    ).fit(net_module(L.LightningModule, "step"), make_batches(4))
    assert len(calls) == 8  # it did log, every step
    assert syncs_inside_epochs(recorder) == [], "\n".join(syncs.where)


# ---- loggers --------------------------------------------------------------------
LAYOUTS: list[dict[str, Any]] = [
    {},
    {"name": "exp"},
    {"name": "exp", "version": 3},
    {"name": "exp", "version": "run_a"},
    {"name": ""},
    {"name": None, "version": 1},
]


@pytest.mark.parametrize("kwargs", LAYOUTS)
def test_logger_folders_are_lightnings(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    from lightning.pytorch.loggers import CSVLogger as TheirCSV
    from lightning.pytorch.loggers import TensorBoardLogger as TheirTB

    (tmp_path / "exp" / "version_0").mkdir(parents=True)  # taken: the next is version_1
    (tmp_path / "lightning_logs" / "version_4").mkdir(parents=True)
    for ours, theirs in ((L.CSVLogger, TheirCSV), (L.TensorBoardLogger, TheirTB)):
        mine, lightning = ours(tmp_path, **kwargs), theirs(tmp_path, **kwargs)
        assert mine.log_dir == Path(lightning.log_dir)
        assert mine.version == lightning.version
        assert (mine.name or "") == (lightning.name or "")
    tb = L.TensorBoardLogger(tmp_path, name="exp", version=2, sub_dir="train")
    assert tb.log_dir == Path(TheirTB(tmp_path, name="exp", version=2, sub_dir="train").log_dir)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "../escape"},
        {"name": "a/b"},
        {"name": ".."},
        {"version": "../../x"},
        {"version": "a\\b"},
        {"version": -1},
        {"name": " padded"},
        {"name": "x\x00y"},
    ],
)
def test_hostile_logger_names_are_refused(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    save_dir = tmp_path / "logs"
    for cls in (L.CSVLogger, L.TensorBoardLogger):
        with pytest.raises(TrainerError, match=r"(name|version)="):
            cls(save_dir, **kwargs)
    with pytest.raises(TrainerError, match="sub_dir="):
        L.TensorBoardLogger(save_dir, sub_dir="../../x")
    with pytest.raises(TrainerError, match="filename="):
        L.CSVLogger(save_dir, filename="../metrics.csv")
    assert list(tmp_path.iterdir()) == []  # nothing was created anywhere


def test_csv_logger_in_a_fit(tmp_path: Path) -> None:
    logger = L.CSVLogger(tmp_path, name="exp", flush_logs_every_n_steps=1)
    seen: list[Any] = []

    class Logs(Net):
        def __init__(self, hidden: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss)
            if batch_idx == 0:
                seen.append((self.logger, self.logger.experiment))
            return loss

    trainer = L.Trainer(**quiet(max_epochs=1, log_every_n_steps=1, logger=logger))
    trainer.fit(Logs(), make_batches(3))
    log_dir = tmp_path / "exp" / "version_0"
    assert logger.log_dir == log_dir
    lines = (log_dir / "metrics.csv").read_text().splitlines()
    assert lines[0].split(",")[:3] == ["step", "loss", "epoch"] and len(lines) == 4
    assert '"hidden": 3' in (log_dir / "hparams.json").read_text()
    assert seen[0][0] is logger and isinstance(seen[0][1], L.loggers.ExperimentWriter)


def test_csv_logger_buffers_rows_like_lightning(tmp_path: Path) -> None:
    logger = L.CSVLogger(tmp_path, flush_logs_every_n_steps=3, prefix="train")
    writer = logger.experiment
    assert writer.metrics_file_path == tmp_path / "lightning_logs" / "version_0" / "metrics.csv"
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_metrics({"a": 2.0}, step=1)
    assert not writer.metrics_file_path.exists()  # buffered until step 2 ((2 + 1) % 3 == 0)
    logger.log_metrics({"b": 3.0}, step=2)
    assert writer.metrics_file_path.read_text().splitlines() == [
        "step,train-a,train-b",
        "0,1.0,",
        "1,2.0,",
        "2,,3.0",
    ]
    writer.log_metrics({"c": 4.0})  # Lightning's ExperimentWriter: step defaults to the row count
    logger.finalize("success")
    assert writer.metrics_file_path.read_text().splitlines()[-1] == "3,,,4.0"
    logger.log_hyperparams({"lr": 0.1, "path": Path("/x")})
    assert '"lr": 0.1' in (writer.log_dir / "hparams.json").read_text()


def test_tensorboard_logger_experiment_and_hparams(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    logger = L.TensorBoardLogger(tmp_path, name="tb", version=0, flush_secs=5)
    assert isinstance(logger.experiment, SummaryWriter)
    logger.log_hyperparams({"lr": 0.1, "layers": [1, 2]})
    logger.log_metrics({"loss": 0.5, "epoch": 0.0}, step=3)
    logger.finalize()
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "hp_metric"}  # "epoch" is not a curve
    assert events.Scalars("loss")[0].step == 3
    assert "_hparams_/experiment" in events.summary_metadata


def test_tensorboard_logger_refuses_what_it_does_not_do(tmp_path: Path) -> None:
    with pytest.raises(TrainerError, match="log_graph=True"):
        L.TensorBoardLogger(tmp_path, log_graph=True)
    with pytest.raises(TrainerError, match=r"write_to_disk=\.\.\."):
        L.TensorBoardLogger(tmp_path, write_to_disk=False)
    with pytest.raises(TrainerError, match=r"WandbLogger .*does not provide"):
        exec("from gpulayer.train.loggers import WandbLogger", {})
    assert list(tmp_path.iterdir()) == []


# ---- torchmetrics objects in self.log --------------------------------------------
def metric_module(base: type) -> Any:
    import torchmetrics

    class Classifier(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.train_acc = torchmetrics.classification.BinaryAccuracy()
            self.val_acc = torchmetrics.classification.BinaryAccuracy()
            self.val_mean = torchmetrics.MeanMetric()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            self.train_acc(logits.sigmoid(), (y > 0).int())
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            return F.binary_cross_entropy_with_logits(logits, (y > 0).float())

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            logits = self.net(x)
            self.val_acc.update(logits.sigmoid(), (y > 0).int())
            self.val_mean.update(logits)
            self.log("val_acc", self.val_acc)
            self.log("val_mean", self.val_mean)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Classifier()


def test_metric_objects_are_computed_like_lightning() -> None:
    import lightning.pytorch as pl

    train, val = loader_of(make_batches(4, seed=1)), loader_of(make_batches(3, seed=2))
    torch.manual_seed(0)
    theirs = metric_module(pl.LightningModule)
    their_trainer = pl.Trainer(**lightning_quiet(max_epochs=2, log_every_n_steps=1))
    quiet_lightning_run(their_trainer, theirs, train, val)
    torch.manual_seed(0)
    ours = metric_module(L.LightningModule)
    trainer = L.Trainer(**quiet(max_epochs=2, log_every_n_steps=1))
    trainer.fit(ours, train, val)
    expected = {k: float(v) for k, v in their_trainer.callback_metrics.items()}
    assert set(expected) == {
        "train_acc",
        "train_acc_step",
        "train_acc_epoch",
        "val_acc",
        "val_mean",
    }
    for key in ("train_acc_step", "train_acc_epoch", "val_acc", "val_mean"):
        assert trainer.callback_metrics[key] == pytest.approx(expected[key], rel=1e-6), key
    # Reset at each epoch end, as Lightning leaves them.
    for module in (theirs, ours):
        assert module.val_acc._update_count == 0 and module.train_acc._update_count == 0


def test_metric_objects_do_not_sync_per_step(syncs: SyncCounter) -> None:
    import torchmetrics

    class Total(torchmetrics.Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("total", torch.zeros(()), dist_reduce_fx="sum")

        def update(self, value: torch.Tensor) -> None:
            self.total += value.sum()

        def compute(self) -> torch.Tensor:
            return self.total

    class Counts(Net):
        def __init__(self) -> None:
            super().__init__()
            self.seen = Total()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen(torch.ones(len(batch[0])))
            self.log("seen", self.seen, on_step=True, on_epoch=True)
            return super().training_step(batch, batch_idx)

    recorder = Recorder(syncs)
    trainer = L.Trainer(**quiet(max_epochs=2, log_every_n_steps=1000, callbacks=[recorder]))
    trainer.fit(Counts(), make_batches(5))
    assert syncs_inside_epochs(recorder) == [], "\n".join(syncs.where)
    assert trainer.callback_metrics["seen_epoch"] == 5 * 8  # five batches of eight
    assert trainer.callback_metrics["seen_step"] == 8


def test_a_metric_that_computes_several_values_is_refused() -> None:
    import torchmetrics

    class PerClass(Net):
        def __init__(self) -> None:
            super().__init__()
            self.acc = torchmetrics.classification.MulticlassAccuracy(3, average=None)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.acc.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
            self.log("acc", self.acc, on_epoch=True, on_step=False)
            return super().training_step(batch, batch_idx)

    with pytest.raises(TrainerError, match=r"self.log\('acc', MulticlassAccuracy\).*shape \(3,\)"):
        L.Trainer(**quiet(max_epochs=1)).fit(PerClass(), make_batches(1))


# ---- model summary --------------------------------------------------------------
def add_layers(module: torch.nn.Module) -> torch.nn.Module:
    """Nested, frozen, eval-mode and large layers: every column and total varies."""
    module.net = torch.nn.Sequential(
        torch.nn.Linear(4, 300), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(300, 8))
    )
    module.norm = torch.nn.BatchNorm1d(8).eval()
    module.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
    module.big = torch.nn.Embedding(40_000, 32)
    return module


def their_table(module: torch.nn.Module, max_depth: int) -> list[list[str]]:
    from lightning.pytorch.utilities.model_summary import ModelSummary

    lines = str(ModelSummary(module, max_depth=max_depth)).splitlines()  # type: ignore[arg-type]
    rows = [[c.strip() for c in line.split("|")][:5] for line in lines if "|" in line]
    totals = [line.rstrip() for line in lines if "|" not in line and not line.startswith("-")]
    return [*rows, *[[t] for t in totals if "Flops" not in t]]


def our_table(module: torch.nn.Module, max_depth: int) -> list[list[str]]:
    lines = model_summary(module, max_depth=max_depth).splitlines()
    rows = [[c.strip() for c in line.split("|")] for line in lines if "|" in line]
    return [*rows, *[[t.rstrip()] for t in lines if "|" not in t and not t.startswith("-")]]


@pytest.mark.parametrize("max_depth", [1, 2, -1])
def test_model_summary_is_lightnings_table(max_depth: int) -> None:
    import lightning.pytorch as pl

    ours, theirs = add_layers(L.LightningModule()), add_layers(pl.LightningModule())
    table = our_table(ours, max_depth)
    assert table == their_table(theirs, max_depth)
    assert len(table) > 8


def test_human_counts() -> None:
    assert [human_count(n) for n in (0, 999, 1000, 1234, 99_949, 123_456, 4_500_000, None)] == [
        "0",
        "999",
        "1.0 K",
        "1.2 K",
        "99.9 K",
        "123 K",
        "4.5 M",
        "?",
    ]
    assert model_summary(torch.nn.Linear(2, 2), max_depth=0).splitlines()[0].startswith("6 ")
    with pytest.raises(TrainerError, match="max_depth=-2"):
        model_summary(torch.nn.Linear(2, 2), max_depth=-2)


def test_model_summary_callback_prints_on_fit_start(capsys: pytest.CaptureFixture[str]) -> None:
    L.Trainer(**quiet(max_epochs=1, callbacks=[L.ModelSummary(max_depth=1)])).fit(
        Net(), make_batches(1)
    )
    out = capsys.readouterr().out
    assert "0 | net  | Linear | 5      | train" in out and "5         Trainable params" in out
    # As in Lightning, a ModelSummary callback replaces the Trainer's own summary.
    assert out.count("Trainable params") == 1
