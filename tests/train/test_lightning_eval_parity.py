"""Evaluation and logging against real Lightning: several dataloaders,
``inference_mode``, the plain name of a value logged on step and epoch, and the
monitoring callbacks in the sanity check.

Each module below is built twice by a factory, once on Lightning's base
classes and once on GPUlayer's, so the code under test is literally the same;
both run with the same seeds and are compared.
"""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from trainer_testkit import run_ranks

import gpulayer.train as G
from gpulayer.train.data import SequentialLoaders, combine_loaders, shard
from gpulayer.train.environment import EnvVarEnvironment
from gpulayer.train.logging import MetricStore, to_host

pl = pytest.importorskip("lightning.pytorch")
MisconfigurationException = pytest.importorskip(
    "lightning.fabric.utilities.exceptions"
).MisconfigurationException

pytestmark = [
    pytest.mark.torch,
    # Lightning's own advice (workers, log intervals, deprecations) is not under test.
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]

LIBS = ("pl", "gpulayer")


def tensors(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=gen))


def loader(n: int, seed: int) -> DataLoader[Any]:
    return DataLoader(tensors(n, seed), batch_size=4)


def base(lib: str) -> type:
    return pl.LightningModule if lib == "pl" else G.Module  # type: ignore[no-any-return]


def make_trainer(lib: str, **kwargs: Any) -> Any:
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    common.update(kwargs)
    return pl.Trainer(**common) if lib == "pl" else G.Trainer(**common)


def floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def assert_same_metrics(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    ours, theirs = floats(ours), floats(theirs)
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def several_loaders_module(lib: str, calls: list[Any]) -> Any:
    """A module whose evaluation steps take ``dataloader_idx`` and record what they get."""

    class Net(base(lib)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.log("tl", loss, on_step=True, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            calls.append(
                ("validation_step", batch_idx, dataloader_idx, self.trainer.sanity_checking)
            )
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.log("vl", loss, on_step=True, on_epoch=True)
            self.log("vs", loss, on_step=True, on_epoch=False)
            self.log(f"own{dataloader_idx}", loss * 2, add_dataloader_idx=False)
            self.log("hidden", loss, logger=False)

        def on_validation_batch_start(
            self, batch: Any, batch_idx: int, dataloader_idx: int = 0
        ) -> None:
            calls.append(("on_validation_batch_start", batch_idx, dataloader_idx))

        def on_validation_batch_end(
            self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
        ) -> None:
            calls.append(("on_validation_batch_end", batch_idx, dataloader_idx))

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            calls.append(("on_before_batch_transfer", dataloader_idx))
            return batch

        def on_validation_epoch_end(self) -> None:
            # Logged outside any dataloader: no suffix, in every dataloader's results.
            self.log("epoch_end", 3.0)

        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            calls.append(("test_step", batch_idx, dataloader_idx))
            self.log("t", F.mse_loss(self.layer(batch[0]), batch[1]))
            self.log("tmax", self.layer(batch[0]).max(), reduce_fx="max")

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            calls.append(("predict_step", batch_idx, dataloader_idx))
            return self.layer(batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Net()


def batch_recorder(lib: str, calls: list[Any]) -> Any:
    callback_base = pl.Callback if lib == "pl" else G.Callback

    class Record(callback_base):  # type: ignore[misc, valid-type]
        def on_validation_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
            calls.append(("callback.on_validation_batch_start", *args[1:]))

        def on_validation_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            calls.append(("callback.on_validation_batch_end", *args[2:]))

        def on_predict_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            calls.append(("callback.on_predict_batch_end", *args[2:]))

    return Record()


# ---- several dataloaders ---------------------------------------------------------
def fit_with_two_val_loaders(lib: str) -> tuple[Any, Any, list[Any]]:
    calls: list[Any] = []
    torch.manual_seed(0)
    model = several_loaders_module(lib, calls)
    trainer = make_trainer(
        lib,
        max_epochs=2,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        log_every_n_steps=1,
        callbacks=[batch_recorder(lib, calls)],
    )
    trainer.fit(model, loader(12, 0), [loader(8, 1), loader(16, 2)])
    return trainer, model, calls


def test_fit_with_several_val_dataloaders_matches_lightning() -> None:
    (theirs, their_model, their_calls) = fit_with_two_val_loaders("pl")
    (ours, our_model, our_calls) = fit_with_two_val_loaders("gpulayer")
    # The index reaches the step and every batch hook; batch_idx restarts per
    # dataloader; limit_val_batches=2 and the sanity check's 1 apply to each.
    assert our_calls == their_calls
    assert ("validation_step", 1, 1, False) in our_calls
    assert ("validation_step", 0, 1, True) in our_calls
    assert_same_metrics(ours.callback_metrics, theirs.callback_metrics)
    assert_same_metrics(ours.logged_metrics, theirs.logged_metrics)
    assert "vl/dataloader_idx_1" in ours.callback_metrics
    assert "own1" in ours.logged_metrics and "own1/dataloader_idx_1" not in ours.logged_metrics
    assert "hidden/dataloader_idx_0" not in ours.logged_metrics
    for name, value in their_model.state_dict().items():
        torch.testing.assert_close(our_model.state_dict()[name], value, msg=name)


def evaluate_two_loaders(lib: str) -> dict[str, Any]:
    calls: list[Any] = []
    torch.manual_seed(0)
    model = several_loaders_module(lib, calls)
    trainer = make_trainer(
        lib,
        limit_test_batches=3,
        limit_predict_batches=0.5,
        callbacks=[batch_recorder(lib, calls)],
    )
    out: dict[str, Any] = {}
    out["validate"] = trainer.validate(model, [loader(8, 1), loader(12, 2)], verbose=False)
    out["validate_callback"] = floats(trainer.callback_metrics)
    out["validate_logged"] = floats(trainer.logged_metrics)
    # A dict of dataloaders: its order gives the index (Lightning's "sequential" mode).
    out["test"] = trainer.test(model, {"b": loader(16, 3), "a": loader(8, 4)}, verbose=False)
    out["test_callback"] = floats(trainer.callback_metrics)
    out["predict"] = trainer.predict(model, (loader(8, 5), loader(16, 6)))
    out["predict_one"] = trainer.predict(model, [loader(8, 5)])
    out["calls"] = calls
    return out


def test_validate_test_and_predict_with_several_dataloaders_match_lightning() -> None:
    theirs, ours = evaluate_two_loaders("pl"), evaluate_two_loaders("gpulayer")
    # Also the batch-transfer hooks and the callbacks get the index.
    assert ours["calls"] == theirs["calls"]
    assert ("on_before_batch_transfer", 1) in ours["calls"]
    assert ("callback.on_predict_batch_end", 1, 1) in ours["calls"]
    for key in ("validate", "test"):
        assert len(ours[key]) == len(theirs[key]) == 2, key
        for our_dict, their_dict in zip(ours[key], theirs[key], strict=True):
            assert_same_metrics(our_dict, their_dict)
    assert set(ours["validate"][1]) == {
        "vl_epoch/dataloader_idx_1",
        "own1",
        "epoch_end",
    }
    assert set(ours["test"][0]) == {"t/dataloader_idx_0", "tmax/dataloader_idx_0"}
    for key in ("validate_callback", "validate_logged", "test_callback"):
        assert_same_metrics(ours[key], theirs[key])
    # A list of outputs per dataloader; limit_predict_batches=0.5 of each.
    assert [len(p) for p in ours["predict"]] == [len(p) for p in theirs["predict"]] == [1, 2]
    for our_list, their_list in zip(ours["predict"], theirs["predict"], strict=True):
        for a, b in zip(our_list, their_list, strict=True):
            torch.testing.assert_close(a, b)
    # One dataloader in a list is that dataloader: a flat list of outputs.
    assert len(ours["predict_one"]) == len(theirs["predict_one"]) == 1
    assert isinstance(ours["predict_one"][0], torch.Tensor)


def test_limit_fractions_apply_to_each_dataloader_as_lightning() -> None:
    runs = []
    for lib in LIBS:
        calls: list[Any] = []
        model = several_loaders_module(lib, calls)
        # 0.5 of 2 and of 5 batches: 1 and 2 (int(len * f) each, as Lightning).
        results = make_trainer(lib, limit_test_batches=0.5).test(
            model, [loader(8, 1), loader(20, 2)], verbose=False
        )
        runs.append((calls, [sorted(r) for r in results]))
    assert runs[0] == runs[1]
    assert [c[2] for c in runs[1][0] if c[0] == "test_step"] == [0, 1, 1]


def test_limit_zero_skips_the_loop_as_lightning() -> None:
    for lib in LIBS:
        calls: list[Any] = []
        model = several_loaders_module(lib, calls)
        trainer = make_trainer(lib, limit_test_batches=0, limit_predict_batches=0)
        assert trainer.test(model, [loader(8, 1), loader(8, 2)], verbose=False) == [], lib
        assert trainer.predict(model, [loader(8, 1), loader(8, 2)]) is None, lib
        assert calls == [], lib


def signature_modules(lib: str) -> tuple[Any, Any]:
    class Plain(base(lib)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            raise AssertionError("must be refused before any batch")

    class Required(Plain):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
            raise AssertionError("must be refused before any batch")

    return Plain(), Required()


def test_dataloader_idx_in_the_signature_is_checked_as_lightning() -> None:
    two = [loader(8, 1), loader(8, 2)]
    plain, required = signature_modules("gpulayer")
    with pytest.raises(
        G.TrainerError,
        match=r"Plain.validation_step\(\) takes no dataloader_idx, but the validation data is "
        r"2 dataloaders; add dataloader_idx=0",
    ):
        make_trainer("gpulayer").validate(plain, two)
    with pytest.raises(
        G.TrainerError, match=r"Required.validation_step\(\) requires dataloader_idx, but the "
    ):
        make_trainer("gpulayer").validate(required, loader(8, 1))
    # Lightning refuses both too.
    plain, required = signature_modules("pl")
    for model, data in ((plain, two), (required, loader(8, 1))):
        with pytest.raises(RuntimeError, match="dataloader_idx"):
            make_trainer("pl").validate(model, data)


def test_steps_without_batch_idx_are_called_without_it_as_lightning() -> None:
    outputs = []
    for lib in LIBS:

        class NoIndex(base(lib)):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(3, 1)

            def test_step(self, batch: Any) -> None:
                self.log("t", self.layer(batch[0]).mean())

            def predict_step(self, batch: Any) -> Any:
                return self.layer(batch[0])

        torch.manual_seed(0)
        model, trainer = NoIndex(), make_trainer(lib)
        outputs.append(
            (trainer.test(model, loader(8, 1), verbose=False), trainer.predict(model, loader(8, 1)))
        )
    (their_test, their_pred), (our_test, our_pred) = outputs
    assert_same_metrics(our_test[0], their_test[0])
    torch.testing.assert_close(our_pred, their_pred)


def test_one_name_from_two_dataloaders_without_the_index_is_refused_as_lightning() -> None:
    for lib in LIBS:

        class Same(base(lib)):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.layer = torch.nn.Linear(3, 1)

            def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
                self.log("same", self.layer(batch[0]).mean(), add_dataloader_idx=False)

        error = G.TrainerError if lib == "gpulayer" else MisconfigurationException
        with pytest.raises(error, match="same") as caught:
            make_trainer(lib).validate(Same(), [loader(8, 1), loader(8, 2)], verbose=False)
        if lib == "gpulayer":
            assert str(caught.value) == (
                "self.log('same', ..., add_dataloader_idx=False) was called from dataloader 0 "
                "and from dataloader 1; give each dataloader its own name, or leave "
                "add_dataloader_idx=True to add /dataloader_idx_N"
            )


def test_a_dict_of_dataloaders_must_hold_dataloaders_and_nothing_runs_otherwise() -> None:
    calls: list[Any] = []
    model = several_loaders_module("gpulayer", calls)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(G.TrainerError, match="a dict of dataloaders must hold DataLoaders only"):
        make_trainer("gpulayer").test(model, {"a": loader(8, 1), "b": [1, 2]})
    assert calls == []
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


def test_hostile_metric_names_and_dataloader_keys_are_only_names(tmp_path: Path) -> None:
    # Metacharacters of SQL, JSON, CSV and paths in a metric name; the dict keys
    # of the dataloaders are never used as names at all.
    hostile = 'x"},{"evil": 1}; DROP TABLE runs; --,\n../../escape'
    keys = {"../../outside": loader(8, 1), "'; DROP TABLE t; --": loader(8, 2)}

    class Hostile(G.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log(hostile, self.layer(batch[0]).mean())

    root = tmp_path / "runs"
    trainer = G.Trainer(
        accelerator="cpu",
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=root,
        logger=G.loggers.CSVLogger(root),
    )
    results = trainer.test(Hostile(), keys, verbose=False)
    assert [list(r) for r in results] == [
        [f"{hostile}/dataloader_idx_0"],
        [f"{hostile}/dataloader_idx_1"],
    ]
    # Nothing was written but the run's own files, under the run directory.
    written = list(tmp_path.rglob("*"))
    assert all(p == root or root in p.parents for p in written)
    assert not any("outside" in p.name or "escape" in p.name or "DROP" in p.name for p in written)
    for far in ("../outside", "../../outside", "../escape", "../../escape"):
        assert not (tmp_path / far).exists()
    # The CSV header quotes the name (commas, quotes and a newline in it) as the rows are.
    [csv_file] = root.rglob("metrics.csv")
    with csv_file.open(newline="") as f:
        header, *rows = list(csv.reader(f))
    names = [f"{hostile}/dataloader_idx_0", f"{hostile}/dataloader_idx_1"]
    assert header == ["step", *names, "epoch"]  # test() logs the epoch, as Lightning's
    assert rows and all(len(row) == len(header) for row in rows)


def test_several_dataloaders_are_sharded_one_by_one_under_ddp() -> None:
    env = EnvVarEnvironment(rank=1, size=2, local=1, local_size=2, address="127.0.0.1", port=1)
    combined = combine_loaders([loader(8, 1), loader(16, 2)])
    assert isinstance(combined, SequentialLoaders)
    sharded = shard(combined, env, shuffle=False, seed=0)
    assert isinstance(sharded, SequentialLoaders)
    samplers = [dl.sampler for dl in sharded.loaders]
    assert all(isinstance(s, DistributedSampler) and s.rank == 1 for s in samplers)
    assert [len(dl) for dl in sharded.loaders] == [1, 2]  # half of each, not half of the list
    # A list of batches stays a list of batches; training data is never combined.
    batches = [(torch.zeros(2, 3), torch.zeros(2, 1))]
    assert combine_loaders(batches) is batches


DDP_VALIDATE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import gpulayer.train as G

    seen = []

    class Net(G.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(3, 1)

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            out = self.layer(batch[0])
            seen.append([dataloader_idx, batch_idx, out.is_inference()])
            self.log("v", (out - batch[1]).pow(2).mean(), sync_dist=True)

    def data(n, seed):
        x = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)

    trainer = G.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    results = trainer.validate(Net(), [data(8, 1), data(4, 2)], verbose=False)
    if len(sys.argv) > 2:
        print(json.dumps(results))
    else:
        with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump({"results": results, "seen": seen}, f)
    """
)


def test_several_dataloaders_under_ddp_are_sharded_and_reduced(tmp_path: Path) -> None:
    script = tmp_path / "validate.py"
    script.write_text(DDP_VALIDATE)
    alone = run_ranks([str(script), str(tmp_path), "print"], world=1, cwd=tmp_path)
    expected = json.loads(alone[0].stdout.strip().splitlines()[-1])
    run_ranks([str(script), str(tmp_path)], world=2, cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Each rank gets half of each dataloader (2 batches of 8 samples, 1 of 4);
    # with gloo, as Lightning, validate runs under no_grad, not inference_mode.
    for rank in ranks:
        assert rank["seen"] == [[0, 0, False], [0, 1, False], [1, 0, False]]
    # sync_dist reduces each dataloader's value across ranks: the whole data's.
    assert ranks[0]["results"] == ranks[1]["results"]
    assert [list(r) for r in expected] == [["v/dataloader_idx_0"], ["v/dataloader_idx_1"]]
    for got, want in zip(ranks[0]["results"], expected, strict=True):
        assert got == pytest.approx(want, rel=1e-6)


# ---- inference_mode ----------------------------------------------------------------
def inference_flags(lib: str, inference_mode: bool) -> list[tuple[str, bool]]:
    seen: list[tuple[str, bool]] = []
    call = ["fit"]

    class Probe(base(lib)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.layer(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            seen.append((call[0], self.layer(batch[0]).is_inference()))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            seen.append((call[0], self.layer(batch[0]).is_inference()))

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            out = self.layer(batch[0])
            seen.append((call[0], out.is_inference()))
            return out

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Probe()
    trainer = make_trainer(
        lib,
        max_epochs=1,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        inference_mode=inference_mode,
    )
    trainer.fit(model, loader(8, 0), loader(4, 1))
    call[0] = "validate"
    trainer.validate(model, loader(4, 1), verbose=False)
    call[0] = "test"
    trainer.test(model, loader(4, 1), verbose=False)
    call[0] = "predict"
    trainer.predict(model, loader(4, 1))
    return seen


@pytest.mark.parametrize("inference_mode", [True, False])
def test_inference_mode_is_where_lightning_uses_it(inference_mode: bool) -> None:
    ours = inference_flags("gpulayer", inference_mode)
    assert ours == inference_flags("pl", inference_mode)
    # Validation inside fit always runs under no_grad, as in Lightning.
    assert ours == [
        ("fit", False),
        ("validate", inference_mode),
        ("test", inference_mode),
        ("predict", inference_mode),
    ]


def test_inference_mode_must_be_a_bool() -> None:
    with pytest.raises(G.TrainerError, match=r"inference_mode='yes' must be True"):
        G.Trainer(inference_mode="yes")  # type: ignore[arg-type]


# ---- a value logged on step and on epoch: its plain name ------------------------
def monitored_fit(lib: str, tmp_path: Path) -> tuple[Any, Any, Any, Any]:
    class Net(base(lib)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.log("tl", loss, on_step=True, on_epoch=True, prog_bar=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.log("vl", loss, on_step=True, on_epoch=True)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    callbacks = pl.callbacks if lib == "pl" else G.callbacks
    # mode="max" on a falling loss: no improvement, so it stops after patience checks.
    stopper = callbacks.EarlyStopping(monitor="tl", mode="max", patience=2)
    keeper = callbacks.ModelCheckpoint(
        dirpath=tmp_path / lib, monitor="tl", save_top_k=1, filename="{epoch}-{step}"
    )
    torch.manual_seed(0)
    model = Net()
    trainer = make_trainer(
        lib,
        max_epochs=6,
        log_every_n_steps=1,
        callbacks=[stopper, keeper],
        enable_checkpointing=True,
    )
    trainer.fit(model, loader(12, 0), loader(8, 1))
    return trainer, model, stopper, keeper


def test_the_plain_name_of_a_forked_metric_and_its_monitors_match_lightning(
    tmp_path: Path,
) -> None:
    theirs, their_model, their_stop, their_keep = monitored_fit("pl", tmp_path)
    ours, our_model, our_stop, our_keep = monitored_fit("gpulayer", tmp_path)
    assert_same_metrics(ours.callback_metrics, theirs.callback_metrics)
    # After the epoch, the plain name holds the epoch value.
    assert ours.callback_metrics["tl"] == ours.callback_metrics["tl_epoch"]
    assert ours.callback_metrics["vl"] == ours.callback_metrics["vl_epoch"]
    # logged_metrics: the last step's value (not the plain name), as Lightning's.
    assert_same_metrics(ours.logged_metrics, theirs.logged_metrics)
    assert "tl" not in ours.logged_metrics and "tl_step" in ours.logged_metrics
    assert (our_stop.stopped_epoch, ours.current_epoch) == (
        their_stop.stopped_epoch,
        theirs.current_epoch,
    )
    assert our_stop.stopped_epoch == 2
    assert Path(our_keep.best_model_path).name == Path(their_keep.best_model_path).name
    assert float(our_keep.best_model_score) == pytest.approx(float(their_keep.best_model_score))
    for name, value in their_model.state_dict().items():
        torch.testing.assert_close(our_model.state_dict()[name], value, msg=name)


def test_the_plain_name_is_never_sent_to_the_loggers() -> None:
    store = MetricStore(on_step=True, on_epoch=False)
    store.log("tl", torch.tensor(2.0), on_epoch=True)
    store.log("tl", torch.tensor(4.0), on_epoch=True)
    assert to_host(store.step_values()) == {"tl_step": 4.0, "tl": 4.0}
    assert to_host(store.epoch_values()) == {"tl_epoch": 3.0, "tl": 3.0}
    assert store.keys_where("logger") == {"tl_step", "tl_epoch"}
    assert store.epoch_keys(None, logged=True) == {"tl_epoch"}
    assert store.epoch_keys(None, logged=False) == {"tl_epoch", "tl"}


def test_a_forked_metric_adds_no_host_read_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    original = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        reads.append(1)
        return original(self)

    class Forked(G.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.log("tl", loss, on_step=True, on_epoch=True)
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            per_batch.append(len(reads))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    per_batch: list[int] = []
    stopper = G.callbacks.EarlyStopping(monitor="tl", check_on_train_epoch_end=True)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    make_trainer("gpulayer", max_epochs=1, log_every_n_steps=4, callbacks=[stopper]).fit(
        Forked(), loader(32, 0)
    )
    # 8 batches: one read at steps 4 and 8 (the logging interval), none between.
    reads_per_batch = [b - a for a, b in zip([0, *per_batch], per_batch, strict=False)]
    assert reads_per_batch == [0, 0, 0, 1, 0, 0, 0, 1]


# ---- the sanity check --------------------------------------------------------------
def sanity_run(lib: str, tmp_path: Path) -> tuple[list[Any], Any, Any, Any]:
    seen: list[Any] = []
    callbacks = pl.callbacks if lib == "pl" else G.callbacks

    class Stopper(callbacks.EarlyStopping):  # type: ignore[misc, name-defined]
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            seen.append(("stop", trainer.sanity_checking, sorted(trainer.callback_metrics)))
            super().on_validation_end(trainer, module)

    class Keeper(callbacks.ModelCheckpoint):  # type: ignore[misc, name-defined]
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            seen.append(("keep", trainer.sanity_checking, sorted(trainer.callback_metrics)))
            super().on_validation_end(trainer, module)

        def on_train_start(self, trainer: Any, module: Any) -> None:
            # What the sanity check showed is gone by now.
            seen.append(("train_start", sorted(trainer.callback_metrics)))
            super().on_train_start(trainer, module)

    class Net(base(lib)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            # Logged only in training: a check in the sanity check would find nothing.
            self.log("tl", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("vl", F.mse_loss(self.layer(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    # Strict: checked in the sanity check, it would find no "tl" and raise.
    stopper = Stopper(monitor="tl", patience=5)
    # Checked after each validation. mode="max" on a falling loss: counted in the
    # sanity check, its high value would stop training after epoch 0, not 1.
    after_val = callbacks.EarlyStopping(
        monitor="vl", mode="max", patience=1, check_on_train_epoch_end=False
    )
    keeper = Keeper(dirpath=tmp_path / lib, monitor="tl", save_top_k=1)
    torch.manual_seed(0)
    trainer = make_trainer(
        lib,
        max_epochs=4,
        num_sanity_val_steps=2,
        callbacks=[stopper, after_val, keeper],
        enable_checkpointing=True,
    )
    trainer.fit(Net(), loader(8, 0), loader(12, 1))
    return seen, stopper, after_val, keeper


def test_monitoring_callbacks_skip_the_sanity_check_as_lightning(tmp_path: Path) -> None:
    theirs, their_stop, their_after_val, _ = sanity_run("pl", tmp_path)
    ours, our_stop, our_after_val, _ = sanity_run("gpulayer", tmp_path)
    assert ours == theirs
    assert our_after_val.stopped_epoch == their_after_val.stopped_epoch == 1
    # Called in the sanity check (seeing its values), but nothing was checked then.
    assert ours[0] == ("stop", True, ["vl"]) and ours[2] == ("train_start", [])
    assert (our_stop.wait_count, our_stop.best_score) == pytest.approx(
        (their_stop.wait_count, float(their_stop.best_score))
    )
    assert sorted(p.name for p in (tmp_path / "gpulayer").iterdir()) == sorted(
        p.name for p in (tmp_path / "pl").iterdir()
    )
