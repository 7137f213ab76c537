"""test/predict, the datamodule's life (prepare_data, setup, teardown, also under
DDP), refusals of what would silently not run, and the new settings' errors."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from trainer_testkit import Regression, make_batches, quiet, run_ranks

from gpulayer.train import Trainer, TrainerError
from gpulayer.train.datamodule import LightningDataModule

pytestmark = pytest.mark.torch
HERE = Path(__file__).resolve().parent


class Data(LightningDataModule):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.calls: list[str] = []

    def prepare_data(self) -> None:
        # Once per node: a marker file per call shows how many ranks ran it.
        rank = os.environ.get("RANK", "0")
        (self.root / f"prepared-by-{rank}").write_text("")
        self.calls.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}:{(self.root / 'prepared-by-0').exists()}")
        self.batches = make_batches(4)

    def teardown(self, stage: str) -> None:
        self.calls.append(f"teardown:{stage}")

    def train_dataloader(self) -> Any:
        return self.batches

    def test_dataloader(self) -> Any:
        return self.batches


class WithTest(Regression):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y))


def test_datamodule_life_and_test_results(tmp_path: Path) -> None:
    data = Data(tmp_path)
    trainer = Trainer(**quiet(max_epochs=1))
    trainer.fit(WithTest(), datamodule=data)
    results = trainer.test(datamodule=data, verbose=False)
    assert data.calls == [
        "prepare_data",
        "setup:fit:True",
        "teardown:fit",
        "prepare_data",
        "setup:test:True",
        "teardown:test",
    ]
    assert list(results[0]) == ["test_loss"] and results[0]["test_loss"] > 0
    assert trainer.datamodule is data


def test_predict_returns_per_batch_outputs_and_refuses_logging() -> None:
    module = Regression()
    batches = [x for x, _ in make_batches(3)]
    out = Trainer(**quiet()).predict(module, batches)
    assert out is not None and len(out) == 3
    assert all(o.shape == (8, 1) for o in out)
    assert Trainer(**quiet()).predict(module, batches, return_predictions=False) is None

    class Logs(Regression):
        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("p", 1.0)

    with pytest.raises(TrainerError, match=r"self.log\('p', ...\) was called during predict"):
        Trainer(**quiet()).predict(Logs(), batches)


@pytest.mark.parametrize(
    ("hook", "source"),
    [
        ("optimizer_step", "def optimizer_step(self, *a, **k): pass"),
        ("configure_gradient_clipping", "def configure_gradient_clipping(self, *a): pass"),
        ("on_exception", None),  # a Callback hook, not a module one: allowed
    ],
)
def test_hooks_that_would_not_run_are_refused(hook: str, source: str | None) -> None:
    namespace: dict[str, Any] = {}
    exec(source or f"def {hook}(self, *a): pass", namespace)
    Odd = type("Odd", (Regression,), {hook: namespace[hook]})
    weights = Odd().state_dict()
    if source is None:
        Trainer(**quiet(max_epochs=1)).fit(Odd(), make_batches(1))
        return
    module = Odd()
    module.load_state_dict(weights)
    with pytest.raises(
        TrainerError, match=rf"Odd defines {hook}, which the GPUlayer Trainer never"
    ):
        Trainer(**quiet(max_epochs=1)).fit(module, make_batches(1))
    # Refused before anything ran: the weights did not move.
    for key, value in module.state_dict().items():
        assert torch.equal(value, weights[key])


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"limit_val_batches": -1}, "limit_val_batches=-1 must be an int >= 0 (batches)"),
        ({"limit_test_batches": "all"}, "limit_test_batches='all' must be an int >= 0"),
        ({"val_check_interval": 0.0}, "val_check_interval=0.0 must be an int >= 1"),
        ({"num_sanity_val_steps": -2}, "num_sanity_val_steps=-2 must be an int >= -1"),
        ({"fast_dev_run": -1}, "fast_dev_run=-1 must be a bool or an int >= 0"),
        ({"num_nodes": 0}, "num_nodes=0 must be an int >= 1 or None"),
        (
            {"check_val_every_n_epoch": None, "val_check_interval": 0.5},
            "check_val_every_n_epoch=None counts training batches across epochs",
        ),
        ({"enable_model_summary": "yes"}, "enable_model_summary='yes' must be True"),
    ],
)
def test_new_settings_are_checked_at_construction(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(TrainerError) as info:
        Trainer(**kwargs)
    assert expected in str(info.value)


def test_call_time_refusals_name_what_is_wrong() -> None:
    with pytest.raises(TrainerError, match="num_nodes=2 but this job has 1 node"):
        Trainer(**quiet(num_nodes=2)).fit(Regression(), make_batches(1))
    with pytest.raises(TrainerError, match="defines no test_step"):
        Trainer(**quiet()).test(Regression(), make_batches(1))
    loaders = [DataLoader(make_batches(2), batch_size=None)] * 2
    # Several test dataloaders are supported (tests/train/test_lightning_eval_parity.py),
    # several training ones are not.
    with pytest.raises(TrainerError, match="is a list of 2 DataLoaders; several training"):
        Trainer(**quiet()).fit(WithTest(), loaders)
    with pytest.raises(TrainerError, match=r"WithTest.test_step\(\) takes no dataloader_idx"):
        Trainer(**quiet()).test(WithTest(), loaders)
    with pytest.raises(TrainerError, match="ckpt_path='best' but no ModelCheckpoint"):
        Trainer(**quiet()).test(WithTest(), make_batches(1), ckpt_path="best")
    with pytest.raises(TrainerError, match="val_check_interval=5 is more than the 2 training"):
        Trainer(**quiet(val_check_interval=5)).fit(Regression(), make_batches(2), make_batches(1))

    class Manual(Regression):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(TrainerError, match="accumulate_grad_batches=2 does nothing under manual"):
        Trainer(**quiet(accumulate_grad_batches=2)).fit(Manual(), make_batches(1))
    with pytest.raises(
        TrainerError, match=r"returned 2 optimizers; .*automatic_optimization = False"
    ):

        class Two(Regression):
            def configure_optimizers(self) -> Any:
                return [torch.optim.SGD(self.parameters()), torch.optim.SGD(self.parameters())]

        Trainer(**quiet()).fit(Two(), make_batches(1))


def test_hostile_stage_data_paths_stay_inside(tmp_path: Path) -> None:
    # A datamodule state saved in a checkpoint is keyed by its class name only:
    # a hostile state value is data, and loading it runs nothing.
    class Stateful(Data):
        def state_dict(self) -> dict[str, Any]:
            return {"note": "'; DROP TABLE runs; --", "path": "../../etc/passwd"}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loaded = state_dict

    data = Stateful(tmp_path)
    trainer = Trainer(**quiet(max_epochs=1))
    trainer.fit(Regression(), datamodule=data)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    again = Stateful(tmp_path)
    Trainer(**quiet(max_epochs=2)).fit(
        Regression(), datamodule=again, ckpt_path=tmp_path / "c.ckpt"
    )
    assert again.loaded == data.state_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt", "prepared-by-0"]


# ---- two ranks: prepare_data once per node, setup on every rank ---------------
def test_prepare_data_runs_on_local_rank_zero_before_setup_on_all(tmp_path: Path) -> None:
    run_ranks([__file__, str(tmp_path)], world=2, cwd=tmp_path)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(p.name for p in tmp_path.glob("prepared-by-*")) == ["prepared-by-0"]
    assert reports[0]["calls"] == ["prepare_data", "setup:fit:True", "teardown:fit"]
    # Rank 1 saw rank 0's file in setup: it waited for prepare_data.
    assert reports[1]["calls"] == ["setup:fit:True", "teardown:fit"]
    assert reports[0]["step"] == reports[1]["step"] == 2


def _rank_main(out: Path) -> None:
    data = Data(out)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Regression(), datamodule=data)
    report = {"calls": data.calls, "step": trainer.global_step}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))


def test_a_callbacks_on_exception_is_called_as_lightnings_is() -> None:
    """Every hook Lightning's Callback has is called here too: on_exception
    with the error a fit raised, before it propagates."""
    import lightning.pytorch as pl

    from gpulayer.train import Callback

    called = {n for n, v in vars(pl.Callback).items() if callable(v) and n.startswith("on_")}
    assert "on_exception" in called
    seen: list[BaseException] = []

    class Watch(Callback):
        def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
            seen.append(exception)

    class Fails(Regression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise RuntimeError("boom")

    trainer = Trainer(**quiet(max_epochs=1, callbacks=[Watch()]))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Fails(), make_batches(2))
    assert [str(e) for e in seen] == ["boom"]
