"""Precision: autocast per device, the 16-mixed caveat off CUDA, and validation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from trainer_testkit import Regression, make_batches, quiet

from gpulayer.errors import GPUlayerError
from gpulayer.train import Module, Trainer, TrainerError
from gpulayer.train.precision import FullPrecision, MixedPrecision, make_precision

pytestmark = pytest.mark.torch


class Learnable(Module):
    """Records the dtype its matmuls ran in and its loss at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        self.dtypes: set[torch.dtype] = set()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.dtypes.add(out.dtype)
        loss = F.mse_loss(out.float(), y)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def learnable_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=gen)
    batches = []
    for _ in range(20):
        x = torch.randn(32, 8, generator=gen)
        batches.append((x, x @ w))
    return batches


def first_and_last_epoch_loss(module: Learnable, per_epoch: int) -> tuple[float, float]:
    losses = torch.stack(module.losses)
    return losses[:per_epoch].mean().item(), losses[-per_epoch:].mean().item()


def test_bf16_mixed_on_cpu_runs_in_bf16_and_learns() -> None:
    torch.manual_seed(0)
    module = Learnable()
    Trainer(**quiet(max_epochs=8, precision="bf16-mixed")).fit(module, learnable_data())
    assert module.dtypes == {torch.bfloat16}
    first, last = first_and_last_epoch_loss(module, 20)
    assert last < first / 10
    assert module.net[0].weight.dtype == torch.float32  # weights stay fp32


def test_32_runs_in_float32() -> None:
    module = Learnable()
    Trainer(**quiet(max_epochs=1, precision="32")).fit(module, learnable_data())
    assert module.dtypes == {torch.float32}


def test_16_mixed_off_cuda_warns_and_runs_without_a_scaler() -> None:
    module = Learnable()
    trainer = Trainer(**quiet(max_epochs=3, precision="16-mixed"))
    with pytest.warns(UserWarning, match="without a gradient scaler.*bf16-mixed"):
        trainer.fit(module, learnable_data())
    assert module.dtypes == {torch.float16}
    first, last = first_and_last_epoch_loss(module, 20)
    assert last < first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_16_mixed_on_cuda_uses_a_grad_scaler() -> None:  # pragma: no cover - GPU only
    precision = make_precision("16-mixed", torch.device("cuda", 0))
    assert isinstance(precision, MixedPrecision) and precision.scaler is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)]
)
def test_mixed_precision_on_cuda_learns_with_fp32_weights(
    precision: str, dtype: torch.dtype
) -> None:  # pragma: no cover - GPU only
    torch.manual_seed(0)
    module = Learnable()
    trainer = Trainer(**quiet(accelerator="cuda", max_epochs=8, precision=precision))
    trainer.fit(module, learnable_data())
    assert module.dtypes == {dtype}
    first, last = first_and_last_epoch_loss(module, 20)
    assert last < first / 10
    weight = module.net[0].weight
    assert (weight.device.type, weight.dtype) == ("cuda", torch.float32)


def test_precision_objects_per_device() -> None:
    assert isinstance(make_precision("32", torch.device("cpu")), FullPrecision)
    assert isinstance(make_precision(32, torch.device("cpu")), FullPrecision)
    assert isinstance(make_precision("32-true", torch.device("cpu")), FullPrecision)
    bf16 = make_precision("bf16-mixed", torch.device("cpu"))
    assert isinstance(bf16, MixedPrecision)
    assert (bf16.dtype, bf16.device_type, bf16.scaler) == (torch.bfloat16, "cpu", None)


@pytest.mark.parametrize("bad", ["fp8", "16", "bf16", 64])  # None is Lightning's "32"
def test_unknown_precision_lists_the_valid_ones(bad: object) -> None:
    with pytest.raises(TrainerError) as info:
        Trainer(precision=bad)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"precision={bad!r}" in message
    for valid in ("'32'", "'bf16-mixed'", "'16-mixed'"):
        assert valid in message
    assert isinstance(info.value, GPUlayerError)


def test_validation_runs_under_autocast_too() -> None:
    class Checks(Regression):
        dtypes: set[torch.dtype] = set()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.dtypes.add(self.net(batch[0]).dtype)

    module = Checks()
    Trainer(**quiet(max_epochs=1, precision="bf16-mixed")).fit(
        module, make_batches(2), make_batches(2)
    )
    assert module.dtypes == {torch.bfloat16}
