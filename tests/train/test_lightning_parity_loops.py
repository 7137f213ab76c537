"""The loops against real Lightning: the same module/datamodule code under
``lightning.pytorch`` and ``gpulayer.train``, same seeds, compared.

Each class below is built twice by a factory, once on Lightning's base
classes and once on GPUlayer's, so the code under test is literally the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.train as G
from gpulayer.train.datamodule import LightningDataModule as GDataModule
from gpulayer.train.module import (
    LIGHTNING_CHECKPOINT_HOOKS,
    LIGHTNING_DATA_HOOKS,
    LIGHTNING_LOOP_METHODS,
    LIGHTNING_MODEL_HOOKS,
)

pl = pytest.importorskip("lightning.pytorch")

pytestmark = [
    pytest.mark.torch,
    # Lightning's own advice (workers, log intervals, deprecations) is not under test.
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]

# Hooks GPUlayer calls that the recorder below logs on both sides.
MODULE_HOOKS = [
    "prepare_data",
    "setup",
    "teardown",
    "configure_model",
    "configure_optimizers",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    *(h for h in LIGHTNING_MODEL_HOOKS if h != "configure_sharded_model"),
]
DATA_HOOKS = ["prepare_data", "setup", "teardown", "train_dataloader", "val_dataloader",
              "test_dataloader", "predict_dataloader"]  # fmt: skip
CALLBACK_HOOKS = [
    "setup",
    "teardown",
    "on_fit_start",
    "on_fit_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_end",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_start",
    "on_test_end",
    "on_test_epoch_start",
    "on_test_epoch_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
]


def tensors(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=gen))


def classes(lib: str, calls: list[str] | None = None) -> tuple[type, type, type]:
    """(Module, DataModule, Callback) on ``lib``'s base classes ("pl" or "gpulayer")."""
    module_base = pl.LightningModule if lib == "pl" else G.Module
    data_base = pl.LightningDataModule if lib == "pl" else GDataModule
    callback_base = pl.Callback if lib == "pl" else G.Callback

    class Net(module_base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # type: ignore[no-any-return]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.mse_loss(self(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]))
            self.log("test_max", self(batch[0]).max(), reduce_fx="max")

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Data(data_base):  # type: ignore[misc, valid-type]
        def __init__(self, n_train: int = 40) -> None:
            super().__init__()
            self.n_train = n_train

        def prepare_data(self) -> None: ...

        def setup(self, stage: str) -> None:
            # Datasets exist only after setup: a Trainer that skips it fails.
            self.train, self.val = tensors(self.n_train, 0), tensors(16, 1)
            self.test, self.pred = tensors(12, 2), tensors(10, 3)

        def train_dataloader(self) -> Any:
            # Shuffled from the global RNG, which both sides seed the same.
            return DataLoader(self.train, batch_size=4, shuffle=True)

        def val_dataloader(self) -> Any:
            return DataLoader(self.val, batch_size=4)

        def test_dataloader(self) -> Any:
            return DataLoader(self.test, batch_size=4)

        def predict_dataloader(self) -> Any:
            return DataLoader(self.pred, batch_size=4)

    class Record(callback_base):  # type: ignore[misc, valid-type]
        pass

    if calls is None:
        return Net, Data, Record

    built = []
    for owner, base, names in (
        ("module", Net, MODULE_HOOKS),
        ("data", Data, DATA_HOOKS),
        ("callback", Record, CALLBACK_HOOKS),
    ):
        sub = type(base.__name__, (base,), {})
        for name in names:
            setattr(sub, name, _bind(owner, name, sub, calls))
        built.append(sub)
    return built[0], built[1], built[2]


def _bind(owner: str, name: str, sub: type, calls: list[str]) -> Any:
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        if name in ("setup", "teardown"):
            stage = kwargs.get("stage", args[-1] if args else None)
            calls.append(f"{owner}.{name}({stage})")
        else:
            calls.append(f"{owner}.{name}")
        parent = getattr(super(sub, self), name, None)
        return parent(*args, **kwargs) if parent is not None else None

    return hook


def trainer(lib: str, **kwargs: Any) -> Any:
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": kwargs.pop("enable_checkpointing", False),
    }
    common.update(kwargs)
    if lib == "pl":
        return pl.Trainer(**common)
    return G.Trainer(**common)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- the hook list kept as data ------------------------------------------
def test_the_hook_lists_are_lightnings() -> None:
    from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

    def public(cls: type) -> set[str]:
        return {k for k in vars(cls) if not k.startswith("_")}

    assert set(LIGHTNING_MODEL_HOOKS) == public(ModelHooks)
    assert set(LIGHTNING_DATA_HOOKS) == public(DataHooks)
    assert set(LIGHTNING_CHECKPOINT_HOOKS) == public(CheckpointHooks)
    assert set(LIGHTNING_LOOP_METHODS) <= public(pl.LightningModule)


# ---- hook order --------------------------------------------------------------
def run_all_stages(lib: str, calls: list[str], **kwargs: Any) -> Any:
    Net, Data, Record = classes(lib, calls)
    model, data = Net(), Data(n_train=12)
    t = trainer(lib, max_epochs=2, callbacks=[Record()], **kwargs)
    t.fit(model, datamodule=data)
    calls.append("---")
    t.validate(model, datamodule=data, verbose=False)
    calls.append("---")
    t.test(model, datamodule=data, verbose=False)
    calls.append("---")
    t.predict(model, datamodule=data)
    return t


@pytest.mark.parametrize("sanity", [2, 0])
def test_hook_order_matches_lightning(sanity: int) -> None:
    theirs: list[str] = []
    ours: list[str] = []
    torch.manual_seed(0)
    run_all_stages("pl", theirs, num_sanity_val_steps=sanity, limit_val_batches=2)
    torch.manual_seed(0)
    run_all_stages("gpulayer", ours, num_sanity_val_steps=sanity, limit_val_batches=2)
    # Lightning's stage names are str enums: "TrainerFn.FITTING" == "fit".
    theirs = [c.replace("TrainerFn.FITTING", "fit") for c in theirs]
    for enum, name in (("VALIDATING", "validate"), ("TESTING", "test"), ("PREDICTING", "predict")):
        theirs = [c.replace(f"TrainerFn.{enum}", name) for c in theirs]
    assert "data.setup(fit)" in ours and "module.teardown(predict)" in ours
    assert ours == theirs


# ---- weights, limits, val_check_interval -------------------------------------
def fit_counting(lib: str, **kwargs: Any) -> tuple[dict[str, torch.Tensor], int, int, Any]:
    Net, Data, _ = classes(lib)
    runs: list[int] = []

    class Counting(Net):  # type: ignore[misc, valid-type]
        def on_validation_start(self) -> None:
            if not self.trainer.sanity_checking:
                runs.append(self.global_step)

    torch.manual_seed(0)
    model = Counting()
    t = trainer(lib, **kwargs)
    t.fit(model, datamodule=Data())
    return weights(model), t.global_step, len(runs), t


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_epochs": 2},
        {"max_epochs": 2, "limit_train_batches": 0.5, "limit_val_batches": 0.5},
        {"max_epochs": 2, "limit_train_batches": 3, "limit_val_batches": 1},
        {"max_epochs": 1, "val_check_interval": 0.25},
        {"max_epochs": 2, "val_check_interval": 3},
        {"max_epochs": 3, "check_val_every_n_epoch": 2},
        {"max_steps": 14, "val_check_interval": 4, "check_val_every_n_epoch": None},
        {"max_epochs": 1, "limit_train_batches": 0},
        {"max_epochs": 2, "accumulate_grad_batches": 3, "val_check_interval": 0.5},
    ],
)
def test_weights_steps_and_validation_runs_match_lightning(kwargs: dict[str, Any]) -> None:
    theirs = fit_counting("pl", **kwargs)
    ours = fit_counting("gpulayer", **kwargs)
    assert ours[1:3] == theirs[1:3]
    for name, value in theirs[0].items():
        torch.testing.assert_close(ours[0][name], value, msg=name)


def test_limits_refuse_fractions_smaller_than_a_batch() -> None:
    Net, Data, _ = classes("gpulayer")
    with pytest.raises(G.TrainerError, match=r"limit_train_batches=0.01 of 10 batches"):
        trainer("gpulayer", max_epochs=1, limit_train_batches=0.01).fit(Net(), datamodule=Data())


# ---- test and predict ----------------------------------------------------------
def evaluate_both(lib: str, **kwargs: Any) -> tuple[Any, Any]:
    Net, Data, _ = classes(lib)
    torch.manual_seed(0)
    model, data = Net(), Data()
    t = trainer(lib, max_epochs=1, **kwargs)
    t.fit(model, datamodule=data)
    return t.test(model, datamodule=data, verbose=False), t.predict(model, datamodule=data)


@pytest.mark.parametrize("kwargs", [{}, {"limit_test_batches": 2, "limit_predict_batches": 0.5}])
def test_test_and_predict_results_match_lightning(kwargs: dict[str, Any]) -> None:
    (their_test, their_pred), (our_test, our_pred) = (
        evaluate_both("pl", **kwargs),
        evaluate_both("gpulayer", **kwargs),
    )
    assert len(our_test) == len(their_test) == 1
    assert set(our_test[0]) == set(their_test[0]) == {"test_loss", "test_max"}
    for key, value in their_test[0].items():
        assert our_test[0][key] == pytest.approx(value, rel=1e-6), key
    assert len(our_pred) == len(their_pred) > 0
    for a, b in zip(our_pred, their_pred, strict=True):
        assert a.device.type == "cpu"
        torch.testing.assert_close(a, b)


# ---- fast_dev_run ------------------------------------------------------------
@pytest.mark.parametrize("fast_dev_run", [True, 3])
def test_fast_dev_run_matches_lightning(fast_dev_run: Any, tmp_path: Path) -> None:
    results = []
    for lib in ("pl", "gpulayer"):
        root = tmp_path / lib
        w, steps, runs, t = fit_counting(
            lib,
            fast_dev_run=fast_dev_run,
            max_epochs=5,
            enable_checkpointing=True,
            default_root_dir=root,
        )
        results.append((w, steps, runs, t.current_epoch, list(root.rglob("*.ckpt"))))
    (tw, *theirs), (ow, *ours) = results
    assert ours == theirs
    assert ours[0] == (1 if fast_dev_run is True else 3) and ours[3] == []
    for name, value in tw.items():
        torch.testing.assert_close(ow[name], value, msg=name)


# ---- manual optimization -------------------------------------------------------
def manual_fit(lib: str) -> dict[str, torch.Tensor]:
    Net, Data, _ = classes(lib)

    class TwoOptimizers(Net):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            first, second = self.optimizers()
            scheduler = self.lr_schedulers()
            loss = F.mse_loss(self(batch[0]), batch[1])
            first.zero_grad()
            self.manual_backward(loss)
            first.step()
            if batch_idx % 2 == 0:
                second.zero_grad()
                self.manual_backward(self(batch[0]).abs().mean())
                second.step()
            scheduler.step()
            self.log("loss", loss)

        def configure_optimizers(self) -> Any:
            a = torch.optim.SGD(self.net[0].parameters(), lr=0.05)
            b = torch.optim.Adam(self.net[3].parameters(), lr=0.01)
            return [a, b], [torch.optim.lr_scheduler.StepLR(a, 3, gamma=0.5)]

    torch.manual_seed(0)
    model = TwoOptimizers()
    t = trainer(lib, max_epochs=2, limit_val_batches=0)
    t.fit(model, datamodule=Data(n_train=20))
    out = weights(model)
    out["global_step"] = torch.tensor(t.global_step)
    return out


def test_manual_optimization_matches_lightning() -> None:
    theirs, ours = manual_fit("pl"), manual_fit("gpulayer")
    assert int(ours["global_step"]) == int(theirs["global_step"]) == 2 * (5 + 3)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, msg=name)
