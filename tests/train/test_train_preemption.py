"""Checkpoint on preemption (SIGTERM with GPULAYER_PREEMPT_NOTICE), resume on
the next attempt (ADR-0024): in-process, as two DDP ranks, and as a real
preemptible GPUlayer job.

Run as a script, this file is one rank of the DDP tests (see ``rank_main``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import test_train_sync_free as sync_free
import torch
from trainer_testkit import Regression, assert_same_weights, make_batches, quiet, run_ranks

from gpulayer.train import Callback, CheckpointError, Trainer, TrainerError
from gpulayer.train.checkpoint import load_checkpoint
from gpulayer.train.preemption import EXIT_CODE, FILENAME, Preempted

pytestmark = pytest.mark.torch

NOTICE, SCRATCH, ATTEMPT = "GPULAYER_PREEMPT_NOTICE", "GPULAYER_SCRATCH", "GPULAYER_ATTEMPT"
#: The fixture that counts reads of device values (test_train_sync_free's).
syncs = sync_free.syncs


class SigtermAt(Callback):
    """Sends SIGTERM to this process at the end of batch ``batch`` (counted
    over the fit, from 0), or in ``on_train_end``."""

    def __init__(self, batch: int | None = None, *, at_train_end: bool = False) -> None:
        self.batch, self.at_train_end, self.seen = batch, at_train_end, 0
        self.handler_during_fit: Any = None

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.handler_during_fit = signal.getsignal(signal.SIGTERM)
        if self.seen == self.batch:
            os.kill(os.getpid(), signal.SIGTERM)
        self.seen += 1

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if self.at_train_end:
            os.kill(os.getpid(), signal.SIGTERM)


class FirstStep(Callback):
    """Records the global step the fit's first batch starts at."""

    def __init__(self) -> None:
        self.first: int | None = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
        if self.first is None:
            self.first = trainer.global_step


class Stopped(Exception):
    pass


def _previous_handler(signum: int, frame: FrameType | None) -> None:
    raise Stopped(f"the previous handler got signal {signum}")


@pytest.fixture
def previous_handler() -> Iterator[Any]:
    """A SIGTERM handler of the test's own, as a script's would be; put back after."""
    before = signal.signal(signal.SIGTERM, _previous_handler)
    yield _previous_handler
    signal.signal(signal.SIGTERM, before)


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A preemptible job's environment: a notice and a scratch folder, attempt 1."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setenv(NOTICE, "10")
    monkeypatch.setenv(SCRATCH, str(folder))
    monkeypatch.setenv(ATTEMPT, "1")
    return folder


def _module() -> Regression:
    torch.manual_seed(0)
    # Dropout and Adam: the resumed run must put back the RNG and the moments.
    return Regression(dropout=0.2, optimizer="adam", lr=0.02, step_lr=3)


def _loader() -> torch.utils.data.DataLoader[Any]:
    data = make_batches(6)
    xs = torch.cat([x for x, _ in data])
    ys = torch.cat([y for _, y in data])
    dataset = torch.utils.data.TensorDataset(xs, ys)
    return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)


def _trainer(root: Path, *callbacks: Callback, **overrides: Any) -> Trainer:
    kwargs = quiet(max_epochs=3, seed=7, default_root_dir=root, callbacks=list(callbacks))
    kwargs.update(overrides)
    return Trainer(**kwargs)


def _uninterrupted(root: Path, **overrides: Any) -> Regression:
    module = _module()
    _trainer(root, **overrides).fit(module, _loader())
    return module


def _saved_line(err: str) -> re.Match[str]:
    found = re.search(
        r"gpulayer: preempted: checkpoint saved at step (\d+) to (\S+) in ([\d.]+) s; "
        r"resuming on the next attempt",
        err,
    )
    assert found, err
    return found


# ---- one process ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("batch", "overrides", "saved_at"),
    [
        (3, {}, 4),  # mid-epoch: right after the step of the signal's batch
        (5, {}, 6),  # an epoch's last batch: at the epoch's end
        (2, {"accumulate_grad_batches": 2}, 2),  # accumulating: at the next step
        (6, {"accumulate_grad_batches": 2}, 4),  # the same, in the 2nd epoch
    ],
    ids=["mid-epoch", "last-batch", "accumulating", "accumulating-2nd-epoch"],
)
def test_sigterm_saves_at_the_next_safe_point_and_a_resume_equals_the_uninterrupted_run(
    scratch: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    previous_handler: Any,
    batch: int,
    overrides: dict[str, Any],
    saved_at: int,
) -> None:
    expected = _uninterrupted(tmp_path / "plain", **overrides)
    capsys.readouterr()

    signaller = SigtermAt(batch)
    module = _module()
    with pytest.raises(Preempted) as stopped:
        _trainer(tmp_path / "runs", signaller, **overrides).fit(module, _loader())
    assert stopped.value.code == EXIT_CODE == 143
    assert isinstance(stopped.value, SystemExit)
    path = scratch / FILENAME
    assert stopped.value.path == path and stopped.value.step == saved_at
    line = _saved_line(capsys.readouterr().err)
    assert (int(line[1]), line[2]) == (saved_at, str(path))
    # The save is quick next to the notice (measured: about 0.01 s on CPU).
    assert float(line[3]) < 1.0
    checkpoint = load_checkpoint(path)
    assert checkpoint["global_step"] == saved_at
    assert {"optimizer_states", "lr_schedulers", "loops", "rng"} <= checkpoint.keys()
    # Our handler during fit, the script's own after it.
    assert signaller.handler_during_fit not in (previous_handler, signal.SIG_DFL)
    assert signal.getsignal(signal.SIGTERM) is previous_handler
    assert not list(scratch.glob(".*.tmp")), "the write left no temporary file"

    # The next attempt: the same script, ckpt_path=None.
    monkeypatch.setenv(ATTEMPT, "2")
    first = FirstStep()
    module = _module()
    trainer = _trainer(tmp_path / "runs", first, **overrides)
    trainer.fit(module, _loader())
    assert f"gpulayer: resumed from step {saved_at}: preemption checkpoint {path}" in (
        capsys.readouterr().err
    )
    assert first.first == saved_at
    assert_same_weights(module, expected)
    assert trainer.global_step == 3 * 6 // overrides.get("accumulate_grad_batches", 1)
    assert not path.exists(), "a fit that ends normally removes the preemption checkpoint"
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_sigterm_after_the_last_batch_saves_the_finished_run(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handler: Any
) -> None:
    """The end of training is the last safe point: the next attempt has nothing
    left to train, and ends with the same weights."""
    expected = _uninterrupted(tmp_path / "plain")
    module = _module()
    with pytest.raises(Preempted) as stopped:
        _trainer(tmp_path / "runs", SigtermAt(at_train_end=True)).fit(module, _loader())
    assert stopped.value.step == 18
    monkeypatch.setenv(ATTEMPT, "2")
    first, module = FirstStep(), _module()
    _trainer(tmp_path / "runs", first).fit(module, _loader())
    assert first.first is None, "no batch trained again"
    assert_same_weights(module, expected)


def test_an_explicit_ckpt_path_wins_over_the_preemption_checkpoint(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handler: Any
) -> None:
    other = tmp_path / "mine.ckpt"
    trainer = _trainer(tmp_path / "runs", max_steps=2)
    trainer.fit(_module(), _loader())
    trainer.save_checkpoint(other)
    with pytest.raises(Preempted):
        _trainer(tmp_path / "runs", SigtermAt(3)).fit(_module(), _loader())
    assert (scratch / FILENAME).exists()
    monkeypatch.setenv(ATTEMPT, "2")
    first = FirstStep()
    _trainer(tmp_path / "runs", first).fit(_module(), _loader(), ckpt_path=other)
    assert first.first == 2


def test_a_first_attempt_does_not_resume_from_a_file_it_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handler: Any
) -> None:
    """Without a scratch folder the file is under default_root_dir, which
    another job may have used: only a later attempt of a job resumes."""
    monkeypatch.setenv(NOTICE, "10")
    monkeypatch.delenv(SCRATCH, raising=False)
    monkeypatch.setenv(ATTEMPT, "2")
    root = tmp_path / "runs"
    with pytest.raises(Preempted) as stopped:
        _trainer(root, SigtermAt(3)).fit(_module(), _loader())
    assert stopped.value.path == root / FILENAME
    monkeypatch.setenv(ATTEMPT, "1")
    first = FirstStep()
    _trainer(root, first).fit(_module(), _loader())
    assert first.first == 0


def test_without_the_notice_sigterm_reaches_the_script_s_handler_and_no_file_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handler: Any
) -> None:
    monkeypatch.setenv(NOTICE, "10")
    monkeypatch.delenv(SCRATCH, raising=False)
    monkeypatch.setenv(ATTEMPT, "2")
    root = tmp_path / "runs"
    with pytest.raises(Preempted):
        _trainer(root, SigtermAt(3)).fit(_module(), _loader())
    assert (root / FILENAME).exists()
    monkeypatch.delenv(NOTICE)

    signaller, first = SigtermAt(2), FirstStep()
    with pytest.raises(Stopped, match="previous handler got signal 15"):
        _trainer(root, signaller, first).fit(_module(), _loader())
    assert signaller.handler_during_fit is previous_handler, "no handler of the Trainer's"
    assert first.first == 0, "the preemption checkpoint was not looked at"
    assert (root / FILENAME).exists(), "nor removed"


def test_a_signal_the_fit_could_not_act_on_is_delivered_to_the_previous_handler(
    scratch: Path, tmp_path: Path, previous_handler: Any
) -> None:
    class LateSignal(Callback):
        def on_fit_end(self, trainer: Any, module: Any) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # after the last safe point

    with pytest.raises(Stopped):
        _trainer(tmp_path / "runs", LateSignal()).fit(_module(), _loader())
    assert signal.getsignal(signal.SIGTERM) is previous_handler
    assert not (scratch / FILENAME).exists()


def test_an_unreadable_preemption_checkpoint_is_refused_naming_it(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handler: Any
) -> None:
    path = scratch / FILENAME
    path.write_bytes(b"PK\x03\x04 half a checkpoint")
    monkeypatch.setenv(ATTEMPT, "2")
    first = FirstStep()
    with pytest.raises(CheckpointError) as refused:
        _trainer(tmp_path / "runs", first).fit(_module(), _loader())
    message = str(refused.value)
    assert str(path) in message and "delete it" in message and "ckpt_path" in message
    assert path.read_bytes() == b"PK\x03\x04 half a checkpoint", "left as it was"
    assert first.first is None, "nothing trained"
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_a_weights_only_file_in_its_place_is_refused_too(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, previous_handler: Any
) -> None:
    trainer = _trainer(tmp_path / "runs", max_steps=2)
    trainer.fit(_module(), _loader())
    trainer.save_checkpoint(scratch / FILENAME, weights_only=True)
    monkeypatch.setenv(ATTEMPT, "2")
    with pytest.raises(CheckpointError, match="cannot resume from the preemption checkpoint"):
        _trainer(tmp_path / "runs").fit(_module(), _loader())


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_notice_that_is_not_seconds_is_refused_before_anything_runs(
    scratch: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(NOTICE, value)
    before = signal.getsignal(signal.SIGTERM)
    first = FirstStep()
    with pytest.raises(TrainerError, match=f"GPULAYER_PREEMPT_NOTICE='{value}'"):
        _trainer(tmp_path / "runs", first).fit(_module(), _loader())
    assert first.first is None and signal.getsignal(signal.SIGTERM) is before


def test_a_link_in_the_checkpoint_s_place_is_replaced_not_followed(
    scratch: Path, tmp_path: Path, previous_handler: Any
) -> None:
    """Hostile: whatever the job's folder holds at that name, the save and
    the removal touch that name only, never what a link points to."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (scratch / FILENAME).symlink_to(target)
    with pytest.raises(Preempted):
        _trainer(tmp_path / "runs", SigtermAt(1)).fit(_module(), _loader())
    assert target.read_text() == "keep me"
    assert not (scratch / FILENAME).is_symlink()
    (scratch / FILENAME).unlink()
    (scratch / FILENAME).symlink_to(target)
    _trainer(tmp_path / "runs").fit(_module(), _loader())  # ends normally: removes the name
    assert target.read_text() == "keep me" and not (scratch / FILENAME).is_symlink()


def test_fit_outside_the_main_thread_sets_no_handler(
    scratch: Path, tmp_path: Path, previous_handler: Any, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            _trainer(tmp_path / "runs").fit(_module(), _loader())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=fit)
    thread.start()
    thread.join()
    assert not errors
    assert "outside the main thread" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is previous_handler


def test_with_the_notice_set_the_steps_still_read_nothing_from_the_device(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, syncs: sync_free.SyncCounter
) -> None:
    """test_train_sync_free's instrumented run, notice set: no read between
    two batches of an epoch, and no more reads in all than without it."""
    recorder = sync_free.fit(syncs, batches=16, log_every=1000)
    assert sync_free.syncs_inside_epochs(recorder) == [], "\n".join(syncs.where)
    with_notice, syncs.count = syncs.count, 0
    monkeypatch.delenv(NOTICE)
    sync_free.fit(syncs, batches=16, log_every=1000)
    assert with_notice == syncs.count > 0


# ---- as a GPUlayer job -----------------------------------------------------------

JOB_SCRIPT = """\
import os, time
import torch
from gpulayer.train import Callback, Module, Trainer

class Net(Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Wait(Callback):
    first = None
    def on_train_batch_start(self, trainer, module, batch, i):
        if self.first is None:
            self.first = trainer.global_step
    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        if os.environ["GPULAYER_ATTEMPT"] == "1" and trainer.global_step == 3:
            print("ready at step 3", flush=True)
            deadline = time.monotonic() + 120
            # The first attempt waits here to be preempted (the flag is the
            # Trainer's own handler's), so it cannot end first.
            while not trainer._run.preempt.requested and time.monotonic() < deadline:
                time.sleep(0.01)

if __name__ == "__main__":
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(80, 4, generator=gen), torch.randn(80, 1, generator=gen)
    )
    # Loader workers: the preemption's SIGTERM reaches them too.
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2)
    wait = Wait()
    trainer = Trainer(accelerator="cpu", max_epochs=2, seed=0, callbacks=[wait],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Net(), loader)
    print("attempt", os.environ["GPULAYER_ATTEMPT"], "first step", wait.first,
          "done at step", trainer.global_step, flush=True)
"""


def test_a_preempted_trainer_job_resumes_on_its_next_attempt(home: Path, tmp_path: Path) -> None:
    import gpulayer

    root = tmp_path / "project"
    root.mkdir()
    (root / "train.py").write_text(JOB_SCRIPT)
    (root / "urgent.py").write_text("print('urgent ran')\n")
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(1, kill_grace=10)
        job = client.submit(root / "train.py", source=root, preemptible=True)
        lines = iter(job.stream_logs(follow=True))
        assert any(line.text == "ready at step 3" for line in lines)
        getattr(lines, "close", lambda: None)()
        urgent = client.submit(root / "urgent.py", source=root, priority=5)
        assert urgent.wait(timeout=120) == "succeeded"
        assert job.wait(timeout=180) == "succeeded", job.logs()
        info = job.info
        text = [line.text for line in job.stream_logs(follow=False)]
    assert info.given_back == 1 and info.attempt == 2
    saved = [t for t in text if t.startswith("gpulayer: preempted: checkpoint saved at step 3 to ")]
    assert len(saved) == 1 and f"/{FILENAME} in " in saved[0], text
    assert any(t.startswith("gpulayer: resumed from step 3: preemption checkpoint ") for t in text)
    assert "attempt 2 first step 3 done at step 20" in text, text


# ---- two DDP ranks -------------------------------------------------------------


def rank_main(out: Path, mode: str) -> None:
    """One rank: ``plain`` trains 3 epochs; ``preempt`` gets SIGTERM (rank 1
    a batch before rank 0); ``resume`` is the next attempt. Each rank has a
    scratch folder of its own, as each node of a job has: rank 1 finds no
    file there and gets rank 0's."""
    rank = int(os.environ["RANK"])
    os.environ[SCRATCH] = str(out / mode.replace("resume", "preempt") / f"scratch{rank}")
    Path(os.environ[SCRATCH]).mkdir(parents=True, exist_ok=True)
    os.environ[ATTEMPT] = "2" if mode == "resume" else "1"
    callbacks: list[Callback] = [FirstStep()]
    if mode == "preempt":
        callbacks.append(SigtermAt(3 if rank == 0 else 2))
    module = _module()
    trainer = Trainer(
        **quiet(
            max_epochs=3,
            seed=7,
            strategy="ddp",
            default_root_dir=out / mode / "runs",
            callbacks=callbacks,
        )
    )
    trainer.fit(module, make_batches(12))
    torch.save(module.state_dict(), out / f"{mode}-rank{rank}.pt")
    print(f"first step {callbacks[0].first}", flush=True)  # type: ignore[attr-defined]


def test_two_ddp_ranks_preempted_resume_to_the_weights_of_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NOTICE, "10")
    script = [__file__, str(tmp_path)]
    run_ranks([*script, "plain"], 2, tmp_path)

    ranks = run_ranks([*script, "preempt"], 2, tmp_path, check=False)
    assert [r.returncode for r in ranks] == [EXIT_CODE, EXIT_CODE], [
        r.stderr[-2000:] for r in ranks
    ]
    assert _saved_line(ranks[0].stderr)[1] == "4"
    assert "gpulayer: preempted: rank 1 stops; rank 0 saved the checkpoint at step 4" in (
        ranks[1].stderr
    )
    assert (tmp_path / "preempt" / "scratch0" / FILENAME).exists()
    assert not (tmp_path / "preempt" / "scratch1" / FILENAME).exists(), "only rank 0 writes"

    ranks = run_ranks([*script, "resume"], 2, tmp_path)
    assert "gpulayer: resumed from step 4" in ranks[0].stderr
    assert [r.stdout.split()[-1] for r in ranks] == ["4", "4"]
    plain = torch.load(tmp_path / "plain-rank0.pt")
    for rank in (0, 1):
        resumed = torch.load(tmp_path / f"resume-rank{rank}.pt")
        for key, value in plain.items():
            assert torch.equal(resumed[key], value), f"rank {rank}: {key} differs"
    assert not (tmp_path / "preempt" / "scratch0" / FILENAME).exists()


if __name__ == "__main__":
    rank_main(Path(sys.argv[1]), sys.argv[2])
