"""Review of the Trainer's checkpoint on preemption (issue 20, ADR-0024)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_testkit import Regression, make_batches, quiet

from gpulayer.train import Callback, CheckpointError, Trainer
from gpulayer.train.preemption import FILENAME, Preempted

NOTICE, SCRATCH, ATTEMPT = "GPULAYER_PREEMPT_NOTICE", "GPULAYER_SCRATCH", "GPULAYER_ATTEMPT"


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPULAYER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GPULAYER_PRELOAD", "")


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setenv(NOTICE, "10")
    monkeypatch.setenv(SCRATCH, str(folder))
    monkeypatch.setenv(ATTEMPT, "1")
    return folder


@pytest.fixture(autouse=True)
def _restore_sigterm() -> Any:
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _dataset() -> torch.utils.data.TensorDataset:
    data = make_batches(6)
    return torch.utils.data.TensorDataset(
        torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    )


def _loader(workers: int = 0) -> torch.utils.data.DataLoader[Any]:
    return torch.utils.data.DataLoader(_dataset(), batch_size=8, num_workers=workers)


class PreemptDuringValidation(Callback):
    """What the worker does to a preempted task, while it validates: SIGTERM
    to every process of the task (this one and its DataLoader workers)."""

    def __init__(self) -> None:
        self.sent = False

    def on_validation_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if self.sent or trainer.sanity_checking:
            return
        self.sent = True
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGTERM)  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_during_validation_with_loader_workers_still_saves(
    scratch: Path, tmp_path: Path
) -> None:
    """The notice promises a checkpoint at the next safe point. A SIGTERM
    that lands while validation reads from its DataLoader's workers (which
    torch's own handler ends) must still end in Preempted and a file, as
    the same signal during training does (fit.py's _CUT), not in the
    loader's RuntimeError with nothing saved."""
    torch.manual_seed(0)
    trainer = Trainer(
        **quiet(
            max_epochs=3,
            seed=7,
            default_root_dir=tmp_path / "runs",
            callbacks=[PreemptDuringValidation()],
            num_sanity_val_steps=0,
        )
    )
    with pytest.raises(Preempted):
        trainer.fit(Regression(), _loader(), _loader(workers=1))
    assert (scratch / FILENAME).exists()


def test_a_stale_preempt_checkpoint_of_another_model_is_refused_naming_it(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A preemption checkpoint the fit did not ask for, of another model
    (the script changed, or default_root_dir is shared): the error must
    name the preemption checkpoint and what to do, as for an unreadable one,
    not torch's bare load_state_dict RuntimeError."""
    path = scratch / FILENAME
    trainer = Trainer(**quiet(max_steps=2, default_root_dir=tmp_path / "a"))
    torch.manual_seed(0)
    trainer.fit(Regression(hidden=8), _loader())
    trainer.save_checkpoint(path)
    monkeypatch.setenv(ATTEMPT, "2")
    other = Trainer(**quiet(max_epochs=1, default_root_dir=tmp_path / "b"))
    with pytest.raises(CheckpointError) as refused:
        other.fit(Regression(hidden=16), _loader())
    assert str(path) in str(refused.value)


def test_an_exception_inside_fit_puts_the_handler_back_and_keeps_no_flag(
    scratch: Path, tmp_path: Path
) -> None:
    class Boom(Callback):
        def on_train_batch_end(self, *a: Any) -> None:
            raise ValueError("boom")

    mine = lambda s, f: None  # noqa: E731
    signal.signal(signal.SIGTERM, mine)
    with pytest.raises(ValueError):
        Trainer(**quiet(max_epochs=1, default_root_dir=tmp_path, callbacks=[Boom()])).fit(
            Regression(), _loader()
        )
    assert signal.getsignal(signal.SIGTERM) is mine
    assert [t.name for t in threading.enumerate() if "preempt" in t.name] == []


def test_sigterm_during_the_sanity_check_saves_too(scratch: Path, tmp_path: Path) -> None:
    class AtSanity(Callback):
        def on_validation_batch_end(self, trainer: Any, *a: Any) -> None:
            if trainer.sanity_checking:
                for child in multiprocessing.active_children():
                    os.kill(child.pid, signal.SIGTERM)  # type: ignore[arg-type]
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = Trainer(
        **quiet(
            max_epochs=3,
            default_root_dir=tmp_path / "runs",
            callbacks=[AtSanity()],
            num_sanity_val_steps=2,
        )
    )
    with pytest.raises(Preempted):
        trainer.fit(Regression(), _loader(), _loader(workers=1))
    assert (scratch / FILENAME).exists()
