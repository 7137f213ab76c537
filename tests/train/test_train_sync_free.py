"""No host sync per step: the loop reads device values only when it must.

On a GPU a read (``.item()``, ``.cpu()``, ``bool(t)``...) makes the host wait
for the device. There is no GPU here, so every such tensor method is
instrumented to count its calls, and the counts are checked between the
loop's per-batch hooks. Calls made by ``torch.utils.data`` itself are not
counted: the DataLoader's sampler reads its own CPU index tensors (a seed
and a permutation per epoch), which never live on the device.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer_testkit import Regression, make_batches

from gpulayer.train import Callback, Module, Trainer

pytestmark = pytest.mark.torch

SYNCING_METHODS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__format__",
    "__repr__",
    "__array__",
)
SYNCING_FUNCTIONS = ("equal", "allclose", "is_nonzero")


class SyncCounter:
    def __init__(self) -> None:
        self.count = 0
        self.where: list[str] = []

    def hit(self, name: str) -> None:
        self.count += 1
        self.where.append(f"{name} at {''.join(traceback.format_stack(limit=4)[:-2])}")


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    counter = SyncCounter()

    def wrap(name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith("torch.utils.data"):
                counter.hit(name)
            return original(*args, **kwargs)

        return counted

    for name in SYNCING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    for name in SYNCING_FUNCTIONS:
        monkeypatch.setattr(torch, name, wrap(name, getattr(torch, name)))
    yield counter


class Recorder(Callback):
    """Notes the sync count at every per-batch hook."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter
        self.events: list[tuple[int, int, str, int, int]] = []  # epoch, batch, hook, step, count

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.events.append(
            (trainer.current_epoch, batch_idx, "start", trainer.global_step, self.counter.count)
        )

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.events.append(
            (trainer.current_epoch, batch_idx, "end", trainer.global_step, self.counter.count)
        )


class Busy(Regression):
    """Logs every kind of value, every step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("max_loss", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("seen", float(len(batch[0])), on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("scale", 0.5)  # a Python number
        return {"loss": loss, "detached": loss.detach()}


def loader(batches: int, seed: int = 0) -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * 4, 4, generator=gen)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=True)


def fit(counter: SyncCounter, batches: int, log_every: int, **kwargs: Any) -> Recorder:
    recorder = Recorder(counter)
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=3,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        log_every_n_steps=log_every,
        callbacks=[recorder],
        enable_progress_bar=True,  # the progress bar and CSV logger are part of the loop
        **kwargs,
    )
    torch.manual_seed(0)
    trainer.fit(Busy(), loader(batches), [(torch.randn(4, 4), torch.randn(4, 1))])
    return recorder


def syncs_inside_epochs(recorder: Recorder) -> list[tuple[int, int, str, int]]:
    """(epoch, batch, hook, step) of each hook reached after a sync within the epoch."""
    found = []
    for before, after in zip(recorder.events, recorder.events[1:], strict=False):
        if before[0] == after[0] and after[4] != before[4]:
            found.append(after[:4])
    return found


def test_no_host_sync_between_log_steps(syncs: SyncCounter) -> None:
    recorder = fit(syncs, batches=16, log_every=1000)  # longer than the run: no reads
    assert len(recorder.events) == 3 * 16 * 2
    assert syncs_inside_epochs(recorder) == [], "\n".join(syncs.where)
    # ...while the same instrumentation does see the reads made at epoch ends.
    assert syncs.count > 0


def test_sync_count_does_not_grow_with_steps(syncs: SyncCounter) -> None:
    fit(syncs, batches=8, log_every=1000)
    short = syncs.count
    syncs.count = 0
    fit(syncs, batches=32, log_every=1000)
    assert syncs.count == short


def test_reads_happen_only_on_logging_steps(syncs: SyncCounter) -> None:
    recorder = fit(syncs, batches=16, log_every=3)
    synced = syncs_inside_epochs(recorder)
    assert synced, "logging every 3 steps must read values"
    for epoch, batch, hook, step in synced:
        # A read happens inside the batch whose optimizer step is a multiple of 3.
        assert hook == "end" and step % 3 == 0, (epoch, batch, hook, step)
        assert (batch + 1) % 2 == 0  # a stepping batch (accumulate_grad_batches=2)
    # 3 epochs x 8 optimizer steps: one read at each of steps 3, 6, ..., 24.
    assert [step for *_, step in synced] == list(range(3, 25, 3))


def test_the_instrumentation_catches_a_per_step_read(syncs: SyncCounter) -> None:
    class Reads(Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.layer(batch[0]).pow(2).mean()
            self.losses = [*getattr(self, "losses", []), loss.item()]  # the habit we avoid
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    recorder = Recorder(syncs)
    Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    ).fit(Reads(), make_batches(5))
    assert len(syncs_inside_epochs(recorder)) == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
def test_no_cuda_sync_during_steps() -> None:  # pragma: no cover - GPU only
    """On a GPU, CUDA's own sync detector raises if the loop synchronises."""
    device = torch.device("cuda", 0)
    batches = [(x.to(device), y.to(device)) for x, y in make_batches(12)]

    class Guard(Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if batch_idx == len(batches) - 1:
                torch.cuda.set_sync_debug_mode("default")  # epoch-end reads are allowed

    try:
        trainer = Trainer(
            accelerator="cuda",
            max_epochs=2,
            accumulate_grad_batches=2,
            gradient_clip_val=1.0,
            log_every_n_steps=1000,
            callbacks=[Guard()],
        )
        trainer.fit(Busy(), batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.global_step == 12
