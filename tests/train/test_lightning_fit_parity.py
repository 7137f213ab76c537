"""The fit loop and checkpoints against real Lightning: how an epoch ends
(``max_steps``, ``should_stop``), the Callback base class, toggling
optimizers, where checkpoints go, what they hold (each trainer resumes the
other's files) and the shuffle of a DataLoader with its own generator.

Each model and callback is built twice by a factory, once on Lightning's base
classes and once on GPUlayer's, so that the code under test is the same.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.train as G
from gpulayer.train.callbacks import LIGHTNING_CALLBACK_HOOKS
from gpulayer.train.state import resume_position

pl = pytest.importorskip("lightning.pytorch")

pytestmark = [
    pytest.mark.torch,
    # Lightning's advice (workers, deprecations, non-empty dirs) is not under test.
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]

LIBS = ("pl", "gpulayer")


def lib_of(name: str) -> Any:
    """The module whose names a script uses: ``lightning.pytorch`` or ``gpulayer.train``."""
    return pl if name == "pl" else G


def dataset(n: int = 16, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=gen)
    return TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=gen))


def loader(n: int = 16, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(dataset(n), batch_size=4, **kwargs)  # 4 batches for n=16


def trainer(lib: str, **kwargs: Any) -> Any:
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
    }
    common.update(kwargs)
    return lib_of(lib).Trainer(**common)


def net_class(lib: str, calls: list[str] | None = None) -> type:
    """A tiny regression module with an epoch-interval scheduler."""

    class Net(lib_of(lib).LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)  # type: ignore[no-any-return]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = F.mse_loss(self(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
            scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": scheduler}

        def on_train_epoch_end(self) -> None:
            if calls is not None:
                calls.append(f"module.epoch_end e={self.current_epoch} s={self.global_step}")

    return Net


def recorder_class(lib: str) -> type:
    """Records where the loop is at the hooks that say how epochs end."""

    class Recorder(lib_of(lib).Callback):  # type: ignore[misc, name-defined]
        def __init__(self, calls: list[str]) -> None:
            self.calls = calls

        def where(self, what: str, trainer: Any) -> None:
            self.calls.append(f"{what} e={trainer.current_epoch} s={trainer.global_step}")

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self.where("epoch_start", trainer)

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            self.where(f"epoch_end lr={lr}", trainer)

        def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
            self.where("validation", trainer)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.where("train_end", trainer)

    return Recorder


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, msg=name)


def ckpt_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.ckpt"))


# ---- 1. how an epoch ends ------------------------------------------------------
def fit_recorded(lib: str, root: Path, **kwargs: Any) -> tuple[Any, list[str], dict[str, Any]]:
    calls: list[str] = []
    torch.manual_seed(0)
    model = net_class(lib, calls)()
    mc = lib_of(lib).callbacks.ModelCheckpoint(dirpath=root / lib, save_top_k=-1, save_last=True)
    t = trainer(
        lib, callbacks=[recorder_class(lib)(calls), mc], enable_checkpointing=True, **kwargs
    )
    t.fit(model, loader(), loader(8))
    return t, calls, weights(model)


@pytest.mark.parametrize("max_steps", [3, 8])  # mid-epoch; two whole epochs of 4 batches
def test_max_steps_ends_the_epoch_as_lightning(tmp_path: Path, max_steps: int) -> None:
    (theirs, their_calls, their_w), (ours, our_calls, our_w) = (
        fit_recorded(lib, tmp_path, max_steps=max_steps) for lib in LIBS
    )
    assert our_calls == their_calls
    assert (ours.current_epoch, ours.global_step) == (theirs.current_epoch, theirs.global_step)
    assert ours.current_epoch == (1 if max_steps == 3 else 2)  # the cut-short epoch counts
    assert ckpt_names(tmp_path / "gpulayer") == ckpt_names(tmp_path / "pl")
    if max_steps == 3:
        # The epoch's hooks ran, its scheduler did not step, it did not validate.
        assert "epoch_end lr=0.1 e=0 s=3" in our_calls
        assert not any(c.startswith("validation") for c in our_calls)
        assert ckpt_names(tmp_path / "gpulayer") == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert_same_weights(our_w, their_w)


def test_should_stop_mid_epoch_validates_and_ends_the_epoch_as_lightning(
    tmp_path: Path,
) -> None:
    results = []
    for lib in LIBS:
        calls: list[str] = []
        base = recorder_class(lib)

        class StopAtTwo(base):  # type: ignore[misc, valid-type]
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                if trainer.global_step == 2:
                    trainer.should_stop = True

        torch.manual_seed(0)
        model = net_class(lib, calls)()
        t = trainer(lib, max_epochs=5, callbacks=[StopAtTwo(calls)])
        t.fit(model, loader(), loader(8))
        results.append((calls, t.current_epoch, t.global_step, weights(model)))
    (their_calls, *theirs, their_w), (our_calls, *ours, our_w) = results
    assert our_calls == their_calls
    assert "validation e=0 s=2" in our_calls  # as Lightning: validates before stopping
    assert ours == theirs == [1, 2]
    assert_same_weights(our_w, their_w)


def test_should_stop_in_on_train_epoch_start_trains_no_batch_as_lightning() -> None:
    results = []
    for lib in LIBS:
        calls: list[str] = []
        base = recorder_class(lib)

        class StopSecondEpoch(base):  # type: ignore[misc, valid-type]
            def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
                super().on_train_epoch_start(trainer, pl_module)
                if trainer.current_epoch == 1:
                    trainer.should_stop = True

        torch.manual_seed(0)
        t = trainer(lib, max_epochs=5, callbacks=[StopSecondEpoch(calls)])
        t.fit(net_class(lib, calls)(), loader(), loader(8))
        results.append((calls, t.current_epoch, t.global_step))
    assert results[1] == results[0]
    assert results[1][1:] == (2, 4)  # epoch 1 ran its hooks, and no batch


# ---- 2. the Callback base class ----------------------------------------------
def lightning_callback_hooks() -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(pl.Callback).items()
        if not name.startswith("_") and callable(value)
    }


def test_every_lightning_callback_hook_is_on_ours_with_its_signature() -> None:
    theirs = lightning_callback_hooks()
    assert set(LIGHTNING_CALLBACK_HOOKS) == set(theirs)
    for name, hook in theirs.items():
        ours = getattr(G.Callback, name)
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(hook).parameters
        ), name
        defaults = [p.default for p in inspect.signature(ours).parameters.values()]
        assert defaults == [p.default for p in inspect.signature(hook).parameters.values()]
    assert G.Callback().state_key == "Callback"


def test_a_callback_hook_the_trainer_does_not_call_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every hook Lightning has is called today; one it adds later (listed, not
    # on the base class) must be refused rather than silently never run.
    import gpulayer.train.config as config

    monkeypatch.setattr(
        config, "LIGHTNING_CALLBACK_HOOKS", (*LIGHTNING_CALLBACK_HOOKS, "on_future_hook")
    )

    class Future(G.Callback):
        def on_future_hook(self, trainer: Any, pl_module: Any) -> None: ...

    with pytest.raises(G.TrainerError, match=r"Future defines on_future_hook, which"):
        G.Trainer(callbacks=[Future()], logger=False)


HOOK_ARGS = {name: list(inspect.signature(h).parameters)[1:] for name, h in
             lightning_callback_hooks().items()}  # fmt: skip


def every_hook_class(lib: str, calls: list[str]) -> type:
    """A callback overriding every Lightning hook: records it, then calls super()."""
    base = lib_of(lib).Callback

    def make(name: str) -> Any:
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            if name in ("setup", "teardown"):
                # Lightning's stage is a str enum (TrainerFn.FITTING, value "fit").
                stage = kwargs.get("stage", args[-1])
                calls.append(f"{name}({getattr(stage, 'value', stage)})")
            else:
                calls.append(name)
            # By keyword, with Lightning's parameter names: the base must take them.
            named = dict(zip(HOOK_ARGS[name], args, strict=False))
            result = getattr(super(cls, self), name)(**named, **kwargs)
            # Some state, so that it is saved and loaded back.
            return {"seen": 1} if name == "state_dict" else result

        return hook

    cls = type("EveryHook", (base,), {name: make(name) for name in HOOK_ARGS})
    return cls


def every_hook_run(lib: str, root: Path, manual: bool) -> list[str]:
    """fit (sanity check, 2 epochs of 2 batches, validating), validate, test,
    predict, a resume, then a fit whose training_step fails."""
    calls: list[str] = []

    class Module(net_class(lib)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.automatic_optimization:
                return super().training_step(batch, batch_idx)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
            opt.step()
            return None

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]))

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            return self(batch[0])

    torch.manual_seed(0)
    model = Module()
    mc = lib_of(lib).callbacks.ModelCheckpoint(dirpath=root / lib, save_last=True)
    t = trainer(lib, max_epochs=2, callbacks=[every_hook_class(lib, calls)(), mc],
                enable_checkpointing=True, num_sanity_val_steps=1)  # fmt: skip
    t.fit(model, loader(8), loader(8))
    for call, kwargs in (("validate", {"verbose": False}), ("test", {"verbose": False}),
                         ("predict", {})):  # fmt: skip
        calls.append("---")
        getattr(t, call)(model, loader(8), **kwargs)
    calls.append("--- resume")
    again = trainer(lib, max_epochs=3, callbacks=[every_hook_class(lib, calls)()])
    again.fit(Module(), loader(8), ckpt_path=root / lib / "last.ckpt")
    calls.append("--- failing")

    class Failing(Module):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        trainer(lib, max_epochs=1, callbacks=[every_hook_class(lib, calls)()]).fit(
            Failing(), loader(8)
        )
    return calls


@pytest.mark.parametrize("manual", [False, True])
def test_every_callback_hook_runs_as_in_lightning_and_super_works(
    tmp_path: Path, manual: bool
) -> None:
    theirs, ours = (every_hook_run(lib, tmp_path, manual) for lib in LIBS)
    assert ours == theirs
    # The run reaches every hook but the one only automatic optimization calls.
    missing = set(HOOK_ARGS) - {c.split("(")[0] for c in ours}
    assert missing == (set() if not manual else {"on_before_zero_grad"}), missing


# ---- 3. toggle_optimizer: the two-optimizer (GAN) pattern --------------------------
def gan_class(lib: str, seen: list[tuple[str, tuple[bool, ...]]]) -> type:
    class Gan(lib_of(lib).LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = torch.nn.Linear(3, 3)
            self.frozen = torch.nn.Linear(3, 3)  # in the generator's optimizer, but frozen
            self.frozen.weight.requires_grad_(False)
            self.discriminator = torch.nn.Linear(3, 1)

        def flags(self, when: str) -> None:
            seen.append((when, tuple(p.requires_grad for p in self.parameters())))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            g_opt, d_opt = self.optimizers()
            x = batch[0]
            self.toggle_optimizer(g_opt)
            self.flags("generator")
            fake = self.frozen(self.generator(x))
            g_opt.zero_grad()
            self.manual_backward(-self.discriminator(fake).mean())
            g_opt.step()
            self.untoggle_optimizer(g_opt)
            self.flags("after generator")
            with self.toggled_optimizer(d_opt):
                self.flags("discriminator")
                d_loss = self.discriminator(fake.detach()).mean() - self.discriminator(x).mean()
                d_opt.zero_grad()
                self.manual_backward(d_loss)
                d_opt.step()
            self.flags("after discriminator")

        def configure_optimizers(self) -> Any:
            g = [*self.generator.parameters(), *self.frozen.parameters()]
            return [
                torch.optim.SGD(g, lr=0.01),
                torch.optim.SGD(self.discriminator.parameters(), lr=0.01),
            ]

    return Gan


def test_toggle_optimizer_matches_lightning() -> None:
    results = []
    for lib in LIBS:
        seen: list[tuple[str, tuple[bool, ...]]] = []
        torch.manual_seed(0)
        model = gan_class(lib, seen)()
        trainer(lib, max_epochs=1).fit(model, loader(8))
        results.append((seen, weights(model)))
    (their_flags, their_w), (our_flags, our_w) = results
    assert our_flags == their_flags
    # generator, frozen (weight off, bias on), discriminator: as toggled.
    assert our_flags[:4] == [
        ("generator", (True, True, False, True, False, False)),
        ("after generator", (True, True, False, True, True, True)),
        ("discriminator", (False, False, False, False, True, True)),
        ("after discriminator", (True, True, False, True, True, True)),
    ]
    assert_same_weights(our_w, their_w)


def test_toggling_an_optimizer_the_module_does_not_have_is_refused() -> None:
    seen: list[tuple[str, tuple[bool, ...]]] = []
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    class Wrong(gan_class("gpulayer", seen)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.flags("before")
            try:
                self.toggle_optimizer(stranger)
            finally:
                self.flags("after")

    with pytest.raises(G.TrainerError, match=r"toggle_optimizer\(\) got SGD, which is not one"):
        trainer("gpulayer", max_epochs=1).fit(Wrong(), loader(8))
    assert seen[0][1] == seen[1][1]  # nothing was toggled


# ---- 4. where checkpoints go -----------------------------------------------------
def checkpoints_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.ckpt"))


def test_checkpoints_go_to_the_loggers_directory_as_in_lightning(tmp_path: Path) -> None:
    found = []
    for lib in LIBS:
        root = tmp_path / lib
        logger = lib_of(lib).loggers.CSVLogger(root / "logs", name="exp")
        torch.manual_seed(0)
        mc = lib_of(lib).callbacks.ModelCheckpoint()  # without dirpath
        t = trainer(lib, max_epochs=2, logger=logger, enable_checkpointing=True,
                    default_root_dir=root, callbacks=[mc])  # fmt: skip
        t.fit(net_class(lib)(), loader())
        found.append(checkpoints_under(root))
    assert found[1] == found[0] == ["logs/exp/version_0/checkpoints/epoch=1-step=8.ckpt"]


def test_without_a_logger_each_run_keeps_its_own_checkpoints(tmp_path: Path) -> None:
    # Deliberately unlike Lightning's <default_root_dir>/checkpoints, shared by
    # every run: docs/trainer.md ("What differs") says so.
    for lib in LIBS:
        for _ in range(2):
            torch.manual_seed(0)
            mc = lib_of(lib).callbacks.ModelCheckpoint()
            t = trainer(lib, max_epochs=1, enable_checkpointing=True,
                        default_root_dir=tmp_path / lib, callbacks=[mc])  # fmt: skip
            t.fit(net_class(lib)(), loader())
    assert checkpoints_under(tmp_path / "pl") == [
        "checkpoints/epoch=0-step=4-v1.ckpt",  # the second run's, next to the first's
        "checkpoints/epoch=0-step=4.ckpt",
    ]
    assert checkpoints_under(tmp_path / "gpulayer") == [
        "version_0/checkpoints/epoch=0-step=4.ckpt",
        "version_1/checkpoints/epoch=0-step=4.ckpt",
    ]


def test_last_finds_the_checkpoint_in_the_loggers_directory(tmp_path: Path) -> None:
    def run(**kwargs: Any) -> Any:
        torch.manual_seed(0)
        t = G.Trainer(**{**RUN, "logger": G.CSVLogger(tmp_path, name="exp"), **kwargs})
        t.fit(net_class("gpulayer")(), loader(), ckpt_path="last")
        return t

    first = run(max_steps=3)
    assert (tmp_path / "exp" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    second = run(max_steps=6)  # a new version directory, resumed from version_0's file
    assert second.global_step == 6 and first.global_step == 3
    assert (tmp_path / "exp" / "version_1" / "checkpoints" / "last.ckpt").is_file()


def test_a_given_dirpath_is_resolved_as_lightning_resolves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("HOME", str(tmp_path))
    for given in ("relative/ckpts", "~/home-ckpts", str(tmp_path / "link" / "ckpts")):
        theirs = pl.callbacks.ModelCheckpoint(dirpath=given).dirpath
        assert G.ModelCheckpoint(dirpath=given).dirpath == Path(theirs), given
    assert not (tmp_path / "relative").exists()  # nothing is created until a save


@pytest.mark.parametrize("value", ["yes", 1, "False; rm -rf ~"])
def test_save_on_train_epoch_end_must_be_a_bool_or_none(value: Any) -> None:
    with pytest.raises(G.TrainerError, match=r"save_on_train_epoch_end=.* must be True, False"):
        G.ModelCheckpoint(save_on_train_epoch_end=value)


RUN: dict[str, Any] = {
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}


# ---- 5. a DataLoader with its own generator -------------------------------------
def test_a_loader_with_its_own_generator_shuffles_as_in_lightning() -> None:
    def order(lib: str) -> list[list[int]]:
        seen: list[list[int]] = []

        class Spy(net_class(lib)):  # type: ignore[misc]
            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                seen.append(batch[1].flatten().long().tolist())
                return super().training_step(batch, batch_idx)

        data = TensorDataset(torch.randn(8, 3), torch.arange(8.0).unsqueeze(1))
        gen = torch.Generator().manual_seed(42)
        torch.manual_seed(0)
        trainer(lib, max_epochs=3).fit(
            Spy(), DataLoader(data, batch_size=4, shuffle=True, generator=gen)
        )
        return seen

    orders = [order(lib) for lib in LIBS]
    assert orders[1] == orders[0]
    assert len(orders[1]) == 6 and orders[1][0:2] != orders[1][2:4]  # it does shuffle


# ---- 6. checkpoint contents: each trainer reads the other's ---------------------
#: The counters in loops["fit_loop"] GPUlayer writes (Lightning keeps defaults for the rest).
LOOP_KEYS = (
    "epoch_progress",
    "epoch_loop.batch_progress",
    "epoch_loop.state_dict",
    "epoch_loop.automatic_optimization.optim_progress",
    "epoch_loop.manual_optimization.optim_step_progress",
)


def manual_net_class(lib: str) -> type:
    class Manual(net_class(lib)):  # type: ignore[misc]
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__(lr)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
            opt.step()

    return Manual


SCENARIOS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (Trainer arguments, ModelCheckpoint arguments)
    "epoch ends": ({"max_epochs": 2}, {}),
    "every 3 steps": ({"max_epochs": 2}, {"every_n_train_steps": 3}),
    "accumulating": ({"max_epochs": 1, "accumulate_grad_batches": 3}, {"every_n_train_steps": 1}),
    "max_steps mid-epoch": ({"max_steps": 3}, {}),
    "validating twice an epoch": ({"max_epochs": 2, "val_check_interval": 0.5}, {}),
    "validating every 2 epochs": ({"max_epochs": 4, "check_val_every_n_epoch": 2}, {}),
    "manual": ({"max_epochs": 1, "manual": True}, {"every_n_train_steps": 2}),
}


def first_part(lib: str, root: Path, scenario: str) -> dict[str, torch.Tensor]:
    """Train the scenario, keeping every checkpoint in ``root/lib``."""
    kwargs, mc_kwargs = SCENARIOS[scenario]
    kwargs = dict(kwargs)
    cls = manual_net_class(lib) if kwargs.pop("manual", False) else net_class(lib)
    mc = lib_of(lib).callbacks.ModelCheckpoint(
        dirpath=root / lib, save_top_k=-1, save_last=True, **mc_kwargs
    )
    torch.manual_seed(0)
    model = cls()
    t = trainer(lib, callbacks=[mc], enable_checkpointing=True, **kwargs)
    t.fit(model, loader(), loader(8))
    return weights(model)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_checkpoints_hold_what_lightnings_hold(tmp_path: Path, scenario: str) -> None:
    for lib in LIBS:
        first_part(lib, tmp_path, scenario)
    names = ckpt_names(tmp_path / "pl")
    assert ckpt_names(tmp_path / "gpulayer") == names and len(names) >= 2
    for name in names:
        theirs, ours = load(tmp_path / "pl" / name), load(tmp_path / "gpulayer" / name)
        if name == "last.ckpt" and scenario == "every 3 steps":
            # Deliberately unlike Lightning, which keeps the step-6 file: ours is
            # rewritten when training ends (step 8), so "last" resumes from the end.
            assert (ours["global_step"], theirs["global_step"]) == (8, 6)
            continue
        assert (ours["epoch"], ours["global_step"]) == (theirs["epoch"], theirs["global_step"])
        for key in LOOP_KEYS:
            assert ours["loops"]["fit_loop"][key] == theirs["loops"]["fit_loop"][key], (name, key)
        assert ours["callbacks"].keys() == theirs["callbacks"].keys()
        for key, state in theirs["callbacks"].items():
            assert ours["callbacks"][key].keys() == state.keys()
        assert_same_weights(ours["state_dict"], theirs["state_dict"])
        assert ours["lr_schedulers"] == theirs["lr_schedulers"]
        torch.testing.assert_close(ours["optimizer_states"], theirs["optimizer_states"])
        assert ours["hyper_parameters"] == theirs["hyper_parameters"] == {"lr": 0.1}
        assert ours["pytorch-lightning_version"] == theirs["pytorch-lightning_version"]


def resume(lib: str, path: Path, cls: type | None = None) -> tuple[list[Any], Any, Any]:
    """Train to 3 epochs from ``path``; which batches were trained, and the result."""
    trained: list[tuple[int, int]] = []

    class Tracing(cls or net_class(lib)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            trained.append((self.current_epoch, batch_idx))
            return super().training_step(batch, batch_idx)

    torch.manual_seed(1)
    model = Tracing()
    t = trainer(lib, max_epochs=3)
    t.fit(model, loader(), loader(8), ckpt_path=path)
    return trained, (t.current_epoch, t.global_step), weights(model)


# The files both trainers name the same, each a different kind of resume.
RESUMED = {
    "epoch ends": "epoch=0-step=4.ckpt",  # at an epoch's end
    "every 3 steps": "epoch=0-step=3.ckpt",  # inside an epoch
    "max_steps mid-epoch": "last.ckpt",  # an epoch that stopped early
}


@pytest.mark.parametrize("scenario", list(RESUMED))
def test_lightning_resumes_our_checkpoints_as_its_own(tmp_path: Path, scenario: str) -> None:
    for lib in LIBS:
        first_part(lib, tmp_path, scenario)
    name = RESUMED[scenario]
    from_theirs = resume("pl", tmp_path / "pl" / name)
    from_ours = resume("pl", tmp_path / "gpulayer" / name)
    assert from_ours[:2] == from_theirs[:2]
    # Lightning, told max_epochs=3, counts the stopped epoch as done (11 steps).
    assert from_ours[1] == (3, 11 if scenario == "max_steps mid-epoch" else 12)
    assert_same_weights(from_ours[2], from_theirs[2])


@pytest.mark.parametrize("scenario", list(RESUMED))
def test_we_resume_lightnings_checkpoints_as_our_own(tmp_path: Path, scenario: str) -> None:
    for lib in LIBS:
        first_part(lib, tmp_path, scenario)
    name = RESUMED[scenario]
    from_theirs = resume("gpulayer", tmp_path / "pl" / name)
    from_ours = resume("gpulayer", tmp_path / "gpulayer" / name)
    assert from_theirs[:2] == from_ours[:2]
    # Where Lightning itself resumes: inside the epoch after the batches done.
    first = {"epoch ends": (1, 0), "every 3 steps": (0, 3), "max_steps mid-epoch": (0, 3)}
    assert from_theirs[0][0] == first[scenario] and from_theirs[1] == (3, 12)
    assert_same_weights(from_theirs[2], from_ours[2])
    # No shuffle and no dropout here: the split run equals the whole one.
    torch.manual_seed(0)
    whole = net_class("gpulayer")()
    trainer("gpulayer", max_epochs=3).fit(whole, loader(), loader(8))
    assert_same_weights(from_theirs[2], weights(whole))


def callback_states(lib: str, root: Path, resume_from: Path | None) -> dict[str, Any]:
    """Fit with EarlyStopping and a monitoring ModelCheckpoint; their state
    when fit starts (after a resume: as loaded) and at the end."""
    found: dict[str, Any] = {}
    L = lib_of(lib)
    stop = L.callbacks.EarlyStopping(monitor="val_loss", patience=5)
    best = L.callbacks.ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=2,
                                       save_last=True)  # fmt: skip

    class Look(L.Callback):  # type: ignore[misc, name-defined]
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            found["start"] = (float(stop.best_score), stop.wait_count, best.best_model_path,
                              sorted(best.best_k_models), best.last_model_path)  # fmt: skip

    torch.manual_seed(0)
    t = trainer(lib, max_epochs=3 if resume_from else 2, callbacks=[Look(), stop, best],
                enable_checkpointing=True)  # fmt: skip
    t.fit(net_class(lib)(), loader(), loader(8), ckpt_path=resume_from)
    found["end"] = (float(stop.best_score), sorted(best.best_k_models), t.global_step)
    return found


@pytest.mark.parametrize("writer", LIBS)
def test_callback_states_cross_over(tmp_path: Path, writer: str) -> None:
    reader = "gpulayer" if writer == "pl" else "pl"
    wrote = callback_states(writer, tmp_path, None)
    read = callback_states(reader, tmp_path, tmp_path / "last.ckpt")
    # What the writer ended with is what the reader starts with.
    score, kept, _ = wrote["end"]
    assert read["start"][0] == pytest.approx(score) and read["start"][1] == 0
    assert read["start"][3] == kept and len(kept) == 2
    assert read["start"][2] in kept and read["start"][4] == str(tmp_path / "last.ckpt")
    assert read["end"][2] == 12  # and training went on from there


def test_load_from_checkpoint_reads_the_other_trainers_files(tmp_path: Path) -> None:
    for lib in LIBS:
        first_part(lib, tmp_path, "epoch ends")
    for reader in LIBS:
        for writer in LIBS:
            path = tmp_path / writer / "last.ckpt"
            loaded = net_class(reader).load_from_checkpoint(path)
            assert loaded.hparams["lr"] == 0.1
            assert_same_weights(weights(loaded), load(path)["state_dict"])


def test_checkpoints_of_the_first_format_still_resume(tmp_path: Path) -> None:
    # A mid-epoch checkpoint rewritten as GPUlayer's first format wrote it
    # ("loop", "precision", the old callback keys): it resumes exactly as before.
    from gpulayer.train.checkpoint import atomic_save

    first_part("gpulayer", tmp_path, "every 3 steps")
    new = load(tmp_path / "gpulayer" / "epoch=0-step=3.ckpt")
    fit_loop = new.pop("loops")["fit_loop"]
    epoch, batch = resume_position(fit_loop)
    old = {
        **{k: v for k, v in new.items() if k != "pytorch-lightning_version"},
        "format": "gpulayer.train/1",
        "loop": {"epoch": epoch, "batch": batch, "total_batches": 3,
                 "epoch_rng": fit_loop["state_dict"]["gpulayer"]["epoch_rng"]},
        "precision": {},
        "callbacks": {"ModelCheckpoint[monitor=None]": next(iter(new["callbacks"].values()))},
    }  # fmt: skip
    atomic_save(old, tmp_path / "old.ckpt")
    from_old = resume("gpulayer", tmp_path / "old.ckpt")
    from_new = resume("gpulayer", tmp_path / "gpulayer" / "epoch=0-step=3.ckpt")
    assert from_old[:2] == from_new[:2] and from_old[0][0] == (0, 3)
    assert_same_weights(from_old[2], from_new[2])


def test_callback_states_under_the_first_formats_keys_still_load(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from gpulayer.train.state import restore_callbacks

    stop = G.EarlyStopping(monitor="val_loss", patience=5)
    best = G.ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2)
    old = {
        "EarlyStopping[monitor=val_loss]": {
            "wait_count": 2, "stopped_epoch": -1, "best_score": 0.5, "patience": 5},
        "ModelCheckpoint[monitor=val_loss]": {
            "dirpath": str(tmp_path), "monitor": "val_loss", "best_k_models": {"a.ckpt": 0.5},
            "best_model_path": "a.ckpt", "best_model_score": 0.5, "last_model_path": ""},
    }  # fmt: skip
    run = SimpleNamespace(callbacks=[stop, best], module=None)
    restore_callbacks(G.Trainer(logger=False), run, {"callbacks": old})  # type: ignore[arg-type]
    assert (stop.wait_count, stop.best_score) == (2, 0.5)
    assert (best.best_k_models, best.best_model_path, best.best_model_score) == (
        {"a.ckpt": 0.5}, "a.ckpt", 0.5)  # fmt: skip
    # The new keys are Lightning's.
    assert stop.state_key == "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"
    assert best.state_key == (
        "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, "
        "'every_n_epochs': 1, 'train_time_interval': None}"
    )


@pytest.mark.parametrize(
    "damage",
    [
        lambda c: c["loops"]["fit_loop"].pop("epoch_progress"),
        lambda c: c["loops"]["fit_loop"]["epoch_progress"]["current"].update(processed="1; rm"),
        lambda c: c["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"].update(
            processed=-4
        ),
        lambda c: c.pop("loops"),
    ],
    ids=["missing counters", "a string", "negative", "no loops"],
)
def test_a_checkpoint_with_a_damaged_loop_position_is_refused_untouched(
    tmp_path: Path, damage: Any
) -> None:
    from gpulayer.train.checkpoint import atomic_save

    first_part("gpulayer", tmp_path, "every 3 steps")
    checkpoint = load(tmp_path / "gpulayer" / "epoch=0-step=3.ckpt")
    damage(checkpoint)
    atomic_save(checkpoint, tmp_path / "bad.ckpt")
    torch.manual_seed(5)
    model = net_class("gpulayer")()
    before = weights(model)
    with pytest.raises(G.CheckpointError, match=r"cannot resume training from this checkpoint"):
        trainer("gpulayer", max_epochs=3).fit(model, loader(), ckpt_path=tmp_path / "bad.ckpt")
    assert_same_weights(weights(model), before)  # refused before anything was loaded
