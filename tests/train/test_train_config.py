"""Settings are checked up front, and errors say what was given and what works."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from trainer_testkit import Regression, make_batches, quiet

from gpulayer.errors import GPUlayerError
from gpulayer.train import EarlyStopping, ModelCheckpoint, Module, Trainer, TrainerError
from gpulayer.train.accelerator import CPUAccelerator, resolve_device, select_accelerator
from gpulayer.train.environment import EnvVarEnvironment, SingleProcess, detect_environment

pytestmark = pytest.mark.torch


def test_trainer_error_is_a_gpulayer_error() -> None:
    assert issubclass(TrainerError, GPUlayerError)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"accelerator": "tpu"},
            "accelerator='tpu' is not supported; valid values: 'auto', 'cpu', 'cuda', 'gpu', 'rocm', 'mps'",
        ),
        (
            {"strategy": "fsdp"},
            "strategy='fsdp' is not supported; valid values: 'auto', 'ddp', 'ddp_find_unused_parameters_true'",
        ),
        ({"accumulate_grad_batches": 0}, "accumulate_grad_batches=0 must be an int >= 1"),
        ({"max_steps": -2}, "max_steps=-2 must be an int >= -1"),
        ({"max_epochs": 1.5}, "max_epochs=1.5 must be an int >= -1"),
        ({"log_every_n_steps": 0}, "log_every_n_steps=0 must be an int >= 1"),
        (
            {"limit_train_batches": 1.5},
            "limit_train_batches=1.5 must be an int >= 0 (batches) or a float in [0.0, 1.0]",
        ),
        ({"gradient_clip_val": -1}, "gradient_clip_val=-1 must be a number >= 0 or None"),
        (
            {"gradient_clip_algorithm": "l1"},
            "gradient_clip_algorithm='l1' is not supported; valid values: 'norm', 'value'",
        ),
        (
            {"callbacks": [object()]},
            "callbacks must be gpulayer.train.Callback instances; got object",
        ),
        ({"logger": "csv"}, "logger must be True, False, a Logger or a list of them; got str"),
        ({"run_name": "a/b"}, "run_name='a/b' must be a plain directory name"),
        (
            {"enable_checkpointing": False, "callbacks": [ModelCheckpoint()]},
            "enable_checkpointing=False but",
        ),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(TrainerError) as info:
        Trainer(**kwargs)
    assert expected in str(info.value)


def test_an_absent_accelerator_names_what_is_present() -> None:
    if torch.backends.mps.is_available():
        pytest.skip("MPS is present")
    with pytest.raises(
        TrainerError,
        match=r"accelerator='mps' was asked for but no such device.*available here: cpu",
    ):
        select_accelerator("mps")


def test_auto_picks_cpu_without_a_gpu() -> None:
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("an accelerator is present")
    assert isinstance(select_accelerator("auto"), CPUAccelerator)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (2, "devices=2 but this node runs 1 process(es)"),
        (0, "devices=0 must be at least 1"),
        ([0, 1], "devices=[0, 1] must list one device index per process"),
        ("many", "devices='many' is not supported"),
    ],
)
def test_devices_must_match_the_processes_launched(devices: Any, expected: str) -> None:
    with pytest.raises(TrainerError) as info:
        resolve_device(CPUAccelerator(), devices, SingleProcess())
    assert expected in str(info.value)


def test_devices_resolve_to_this_ranks_device() -> None:
    env = EnvVarEnvironment(rank=3, size=4, local=1, local_size=2, address="h", port=1)
    assert resolve_device(CPUAccelerator(), 2, env) == torch.device("cpu")
    assert resolve_device(CPUAccelerator(), "auto", SingleProcess()) == torch.device("cpu")


def test_environment_from_launcher_variables() -> None:
    env = detect_environment(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (env.global_rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.main_address, env.main_port, env.distributed) == ("10.0.0.1", 29500, True)
    assert not detect_environment({}).distributed
    assert not detect_environment({"WORLD_SIZE": "1", "RANK": "0"}).distributed


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR, MASTER_PORT are not set"),
        (
            {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "RANK=2 is outside 0..1",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "0"},
            "MASTER_PORT=0 is not a TCP port",
        ),
        (
            {
                "WORLD_SIZE": "2",
                "RANK": "1",
                "LOCAL_RANK": "5",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "1",
            },
            "LOCAL_RANK=5 is outside",
        ),
    ],
)
def test_bad_launcher_variables_are_named(env: dict[str, str], expected: str) -> None:
    with pytest.raises(TrainerError) as info:
        detect_environment(env)
    assert expected in str(info.value)


class NoOptimizer(Module):
    def __init__(self, returns: Any) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.returns = returns

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.layer(batch[0]).mean()

    def configure_optimizers(self) -> Any:
        return self.returns(self) if callable(self.returns) else self.returns


@pytest.mark.parametrize(
    ("returns", "expected"),
    [
        ("adam", "configure_optimizers() returned str"),
        (
            lambda m: [torch.optim.SGD(m.parameters(), 0.1), torch.optim.SGD(m.parameters(), 0.1)],
            "returned 2 optimizers",
        ),
        (lambda m: {"lr_scheduler": None}, "returned a dict without 'optimizer'"),
        (
            lambda m: {
                "optimizer": (o := torch.optim.SGD(m.parameters(), 0.1)),
                "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o),
            },
            "ReduceLROnPlateau needs a metric",
        ),
        (
            lambda m: {
                "optimizer": (o := torch.optim.SGD(m.parameters(), 0.1)),
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.StepLR(o, 1),
                    "interval": "batch",
                },
            },
            "lr_scheduler interval='batch' is not supported; valid values: 'epoch', 'step'",
        ),
    ],
)
def test_bad_configure_optimizers_results(returns: Any, expected: str) -> None:
    with pytest.raises(TrainerError) as info:
        Trainer(**quiet(max_epochs=1)).fit(NoOptimizer(returns), make_batches(2))
    assert expected in str(info.value)


def test_training_step_must_return_a_loss() -> None:
    class Bad(Regression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return "loss"

    with pytest.raises(TrainerError, match="training_step returned str; return the loss tensor"):
        Trainer(**quiet(max_epochs=1)).fit(Bad(), make_batches(2))


def test_a_dict_output_and_a_skipped_batch_are_accepted() -> None:
    class Skips(Regression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 1:
                return None
            return {"loss": super().training_step(batch, batch_idx), "extra": 1}

    torch.manual_seed(0)
    module = Skips()
    before = module.net[0].weight.detach().clone()
    trainer = Trainer(**quiet(max_epochs=1))
    trainer.fit(module, make_batches(3))
    assert trainer.global_step == 3
    assert not torch.equal(before, module.net[0].weight)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (torch.ones(3), "got a tensor of shape (3,); log one value"),
        (
            "high",
            "got str; valid values: a 1-element tensor, an int, a float or a torchmetrics Metric",
        ),
        (True, "got bool"),
    ],
)
def test_log_refuses_values_it_cannot_reduce(value: Any, expected: str) -> None:
    class Logs(Regression):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("bad", value)
            return super().training_step(batch, batch_idx)

    with pytest.raises(TrainerError) as info:
        Trainer(**quiet(max_epochs=1)).fit(Logs(), make_batches(1))
    assert expected in str(info.value)


def test_log_option_errors() -> None:
    class Logs(Regression):
        def __init__(self, **options: Any) -> None:
            super().__init__()
            self.options = options

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.log("x", 1.0, **self.options)
            return super().training_step(batch, batch_idx)

    with pytest.raises(
        TrainerError,
        match="reduce_fx\\)='median' is not supported; valid values: 'mean', 'sum', 'max', 'min'",
    ):
        Trainer(**quiet(max_epochs=1)).fit(Logs(reduce_fx="median"), make_batches(1))
    with pytest.raises(TrainerError, match="on_step=False, on_epoch=False\\) would record nothing"):
        Trainer(**quiet(max_epochs=1)).fit(Logs(on_step=False, on_epoch=False), make_batches(1))


def test_data_must_be_reiterable() -> None:
    with pytest.raises(TrainerError, match=r"one-shot iterator .*pass a DataLoader or a list"):
        Trainer(**quiet(max_epochs=2)).fit(Regression(), iter(make_batches(2)))
    with pytest.raises(TrainerError, match="fit\\(\\) needs training data"):
        Trainer(**quiet(max_epochs=1)).fit(Regression())
    with pytest.raises(TrainerError, match=r"must be a gpulayer\.train\.Module; got Linear"):
        Trainer(**quiet(max_epochs=1)).fit(torch.nn.Linear(1, 1), make_batches(1))  # type: ignore[arg-type]


def test_callback_settings_are_checked() -> None:
    with pytest.raises(
        TrainerError, match="mode\\)='best' is not supported; valid values: 'min', 'max'"
    ):
        EarlyStopping("val_loss", mode="best")
    with pytest.raises(TrainerError, match="save_top_k=3, monitor=None\\) has no quantity"):
        ModelCheckpoint(save_top_k=3)
    with pytest.raises(TrainerError, match="every_n_train_steps=0\\) must be >= 1"):
        ModelCheckpoint(every_n_train_steps=0)


def test_module_without_steps_explains_itself() -> None:
    class Empty(Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

    with pytest.raises(TrainerError, match="Empty must define configure_optimizers"):
        Trainer(**quiet(max_epochs=1)).fit(Empty(), make_batches(1))
    with pytest.raises(TrainerError, match="Empty is not attached to a Trainer"):
        _ = Empty().trainer
    assert Empty().global_step == 0 and Empty().current_epoch == 0


def test_validation_data_without_validation_step_fails_before_training() -> None:
    class TrainOnly(NoOptimizer):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise AssertionError("training must not start")

    module = TrainOnly(lambda m: torch.optim.SGD(m.parameters(), 0.1))
    with pytest.raises(
        TrainerError, match="was given validation data but defines no validation_step"
    ):
        Trainer(**quiet(max_epochs=1)).fit(module, make_batches(2), make_batches(1))
    with pytest.raises(TrainerError, match="defines no validation_step"):
        Trainer(**quiet()).validate(module, make_batches(1))


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"detect_anomaly": True}, "Trainer(detect_anomaly=True) is Lightning's"),
        ({"sync_batchnorm": True}, "convert_sync_batchnorm"),
        ({"min_epochs": 2}, "stop with max_epochs"),
        ({"max_epoch": 3}, "unknown argument 'max_epoch'; did you mean 'max_epochs'?"),
    ],
)
def test_lightning_arguments_it_does_not_take_are_refused_naming_them(
    given: dict[str, Any], words: str
) -> None:
    with pytest.raises(TrainerError, match=re.escape(words)):
        Trainer(**quiet(max_epochs=1), **given)


def test_lightning_arguments_at_their_default_change_nothing_and_are_accepted() -> None:
    Trainer(
        **quiet(max_epochs=1),
        profiler=None,
        sync_batchnorm=False,
        inference_mode=True,
        use_distributed_sampler=True,
        detect_anomaly=False,
    )


@pytest.mark.parametrize("mode", [True, "warn"])
def test_deterministic_makes_torch_deterministic_as_lightning_does(mode: bool | str) -> None:
    import os

    Trainer(**quiet(max_epochs=1), deterministic=mode)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled() == (mode == "warn")
    assert torch.backends.cudnn.benchmark is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    with pytest.raises(TrainerError, match="deterministic='yes' is not supported"):
        Trainer(**quiet(max_epochs=1), deterministic="yes")
