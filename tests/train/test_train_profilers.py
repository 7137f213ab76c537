"""``Trainer(profiler=...)``: the actions recorded, against real Lightning, the
reports, and what the profilers refuse.

The parity test builds one module and one callback class twice, on
Lightning's base classes and on GPUlayer's, fits both with a SimpleProfiler
and compares the recorded action names and call counts.
"""

from __future__ import annotations

import pstats
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_sync_free import SyncCounter, fit, syncs, syncs_inside_epochs
from torch.utils.data import DataLoader, TensorDataset

import gpulayer.train as G
from gpulayer.train import TrainerError, profilers
from gpulayer.train.profilers import (
    AdvancedProfiler,
    PassThroughProfiler,
    Profiler,
    SimpleProfiler,
    timed,
    timed_iter,
)

__all__ = ["syncs"]  # the fixture, imported for its name
pytestmark = [
    pytest.mark.torch,
    # Lightning's own advice (workers, log intervals) is not under test.
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]

EPOCHS, TRAIN_BATCHES, VAL_BATCHES = 2, 4, 2
STRATEGY = "[Strategy]SingleDeviceStrategy"


def _distinctive_helper(x: torch.Tensor) -> torch.Tensor:
    """Called from training_step, so that the AdvancedProfiler's report must name it."""
    return x * 2.0


def make_classes(module_base: type, callback_base: type) -> tuple[type, type]:
    """The same module and callback code on either framework's base classes."""

    class Boring(module_base):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)
            self.steps_seen: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.steps_seen.append(batch_idx)
            with self.trainer.profiler.profile("my_action"):
                out = self.layer(batch[0])
            return _distinctive_helper(out).pow(2).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.layer(batch[0]).pow(2).mean())

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", self.layer(batch[0]).pow(2).mean())

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0])

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class EpochCounter(callback_base):  # type: ignore[misc]
        def __init__(self) -> None:
            self.epochs = 0

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.epochs += 1

    return Boring, EpochCounter


def loaders() -> tuple[DataLoader[Any], DataLoader[Any]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TRAIN_BATCHES * 2, 4, generator=gen)
    v = torch.randn(VAL_BATCHES * 2, 4, generator=gen)
    return DataLoader(TensorDataset(x), batch_size=2), DataLoader(TensorDataset(v), batch_size=2)


def quiet(root: Path, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "max_epochs": EPOCHS,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 1,
        "default_root_dir": str(root),
    }
    kwargs.update(overrides)
    return kwargs


def counts(profiler: SimpleProfiler | Any) -> dict[str, int]:
    return {name: len(d) for name, d in profiler.recorded_durations.items()}


def gpulayer_fit(root: Path, profiler: Any, **overrides: Any) -> tuple[Any, Any, G.Trainer]:
    Boring, EpochCounter = make_classes(G.LightningModule, G.Callback)
    torch.manual_seed(0)
    module, callback = Boring(), EpochCounter()
    trainer = G.Trainer(**quiet(root, callbacks=[callback], profiler=profiler, **overrides))
    trainer.fit(module, *loaders())
    return module, callback, trainer


# ---- parity with Lightning ---------------------------------------------------
def test_actions_and_counts_match_lightnings_simple_profiler(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.profilers import SimpleProfiler as LightningSimple

    Boring, EpochCounter = make_classes(pl.LightningModule, pl.Callback)
    torch.manual_seed(0)
    their_module, their_cb, their_profiler = Boring(), EpochCounter(), LightningSimple()
    pl.Trainer(**quiet(tmp_path / "pl", callbacks=[their_cb], profiler=their_profiler)).fit(
        their_module, *loaders()
    )
    our_profiler = SimpleProfiler()
    our_module, our_cb, _ = gpulayer_fit(tmp_path / "g", our_profiler)
    theirs, ours = counts(their_profiler), counts(our_profiler)

    callback = f"[Callback]{type(our_cb).__qualname__}"
    both = {
        "run_training_epoch",
        "run_training_batch",
        "my_action",
        f"{STRATEGY}.training_step",
        f"{STRATEGY}.validation_step",
        f"{STRATEGY}.backward",
        f"{STRATEGY}.batch_to_device",
        "[_TrainingEpochLoop].train_dataloader_next",
        "[_EvaluationLoop].val_next",
        "[LightningModule]Boring.setup",
        "[LightningModule]Boring.configure_optimizers",
        "[LightningModule]Boring.on_fit_start",
        "[LightningModule]Boring.on_train_batch_start",
        "[LightningModule]Boring.on_train_batch_end",
        "[LightningModule]Boring.on_validation_epoch_end",
        "[LightningModule]Boring.teardown",
        f"{callback}.on_train_epoch_end",
    }
    assert both <= theirs.keys() and both <= ours.keys(), (both - theirs.keys(), both - ours.keys())
    # Everything GPUlayer records, Lightning records too, except its name for
    # the step alone (Lightning's optimizer_step action wraps the whole closure)
    # and configure_model, which Lightning calls only when overridden.
    extra = ours.keys() - theirs.keys()
    assert extra == {"optimizer_step", "[LightningModule]Boring.configure_model"}, extra

    steps = EPOCHS * TRAIN_BATCHES
    assert ours[f"{STRATEGY}.training_step"] == theirs[f"{STRATEGY}.training_step"] == steps
    validations = 1 + EPOCHS * VAL_BATCHES  # one sanity batch, then each epoch's
    assert ours[f"{STRATEGY}.validation_step"] == theirs[f"{STRATEGY}.validation_step"]
    assert ours[f"{STRATEGY}.validation_step"] == validations
    # Fetches: a GPUlayer loop may ask for one batch more, finding the data's
    # end, which is counted too (Lightning stops by the loader's length).
    loops = {"[_TrainingEpochLoop].train_dataloader_next": EPOCHS, "[_EvaluationLoop].val_next": 3}
    fetches = set(loops)
    for name, n in loops.items():
        assert theirs[name] <= ours[name] <= theirs[name] + n, (name, ours[name], theirs[name])
    for name in (ours.keys() & theirs.keys()) - fetches:
        assert ours[name] == theirs[name], (name, ours[name], theirs[name])
    assert our_cb.epochs == their_cb.epochs == EPOCHS
    # Profiling changes nothing about the training itself.
    torch.testing.assert_close(our_module.state_dict(), their_module.state_dict())


def test_test_and_predict_record_lightnings_actions(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.profilers import SimpleProfiler as LightningSimple

    data = loaders()[1]
    recorded = []
    for framework, profiler in ((pl, LightningSimple()), (G, SimpleProfiler())):
        Boring, _ = make_classes(framework.LightningModule, framework.Callback)
        trainer = framework.Trainer(**quiet(tmp_path / framework.__name__, profiler=profiler))
        trainer.test(Boring(), data, verbose=False)
        trainer.predict(Boring(), data)
        recorded.append(counts(profiler))
    theirs, ours = recorded
    expected = {
        f"{STRATEGY}.test_step": VAL_BATCHES,
        f"{STRATEGY}.predict_step": VAL_BATCHES,
        "[LightningModule]Boring.on_test_batch_end": VAL_BATCHES,
        "[LightningModule]Boring.on_predict_batch_start": VAL_BATCHES,
        "[LightningModule]Boring.on_test_end": 1,
        "[LightningModule]Boring.on_predict_end": 1,
    }
    for name, count in expected.items():
        assert ours[name] == theirs[name] == count, (name, ours[name], theirs[name])
    for name in ("[_EvaluationLoop].test_next", "[_PredictionLoop].predict_next"):
        assert theirs[name] <= ours[name] <= theirs[name] + 1, (name, ours[name], theirs[name])


def test_the_report_has_lightnings_columns_and_is_printed_on_rank_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpulayer_fit(tmp_path, "simple")
    out = capsys.readouterr().out
    assert "FIT Profiler Report" in out
    header = next(line for line in out.splitlines() if "Mean duration (s)" in line)
    cells = [c.strip() for c in header.strip().strip("|").split("|")]
    assert cells == ["Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %"]
    total = next(line for line in out.splitlines() if line.startswith("|  Total"))
    assert "100 %" in total
    batch_row = next(line for line in out.splitlines() if "|  run_training_batch" in line)
    assert batch_row.split("|")[3].strip() == str(EPOCHS * TRAIN_BATCHES)  # Num calls


def test_extended_false_reports_three_columns() -> None:
    profiler = SimpleProfiler(extended=False)
    with profiler.profile("load"):
        pass
    header = next(line for line in profiler.summary().splitlines() if "Action" in line)
    assert [c.strip() for c in header.strip().strip("|").split("|")] == [
        "Action",
        "Mean duration (s)",
        "Total time (s)",
    ]


def test_the_report_file_goes_to_dirpath_per_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "prof"
    profiler = SimpleProfiler(dirpath=folder, filename="perf")
    _, _, trainer = gpulayer_fit(tmp_path, profiler)
    trainer.validate(dataloaders=loaders()[1], verbose=False)
    assert sorted(p.name for p in folder.iterdir()) == ["fit-perf.txt", "validate-perf.txt"]
    fit_report = (folder / "fit-perf.txt").read_text()
    assert fit_report.startswith("FIT Profiler Report")
    assert "run_training_epoch" in fit_report and "my_action" in fit_report
    assert "VALIDATE Profiler Report" in (folder / "validate-perf.txt").read_text()
    assert "Profiler Report" not in capsys.readouterr().out  # written, not printed


def test_filename_alone_writes_into_the_trainers_log_dir(tmp_path: Path) -> None:
    _, _, trainer = gpulayer_fit(tmp_path, SimpleProfiler(filename="perf"), run_name="run1")
    assert trainer.log_dir == tmp_path / "run1"
    assert (tmp_path / "run1" / "fit-perf.txt").read_text().startswith("FIT Profiler Report")


def test_user_actions_are_recorded_and_the_default_profiler_records_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiler = SimpleProfiler()
    gpulayer_fit(tmp_path, profiler)
    assert counts(profiler)["my_action"] == EPOCHS * TRAIN_BATCHES
    assert all(d > 0 for d in profiler.recorded_durations["my_action"])

    capsys.readouterr()
    module, _, trainer = gpulayer_fit(tmp_path / "plain", None)
    assert type(trainer.profiler) is PassThroughProfiler
    assert module.steps_seen == list(range(TRAIN_BATCHES)) * EPOCHS  # profile() still runs
    assert "Profiler Report" not in capsys.readouterr().out
    assert G.Trainer().profiler.profile("x").__enter__() == "x"  # usable outside a call


def test_string_names_are_lightnings_case_insensitive() -> None:
    assert type(G.Trainer(profiler="SIMPLE").profiler) is SimpleProfiler
    assert type(G.Trainer(profiler="advanced").profiler) is AdvancedProfiler
    mine = AdvancedProfiler(line_count_restriction=5)
    assert G.Trainer(profiler=mine).profiler is mine


# ---- the AdvancedProfiler -------------------------------------------------------
def test_advanced_profiler_reports_the_functions_each_action_ran(tmp_path: Path) -> None:
    folder = tmp_path / "prof"
    gpulayer_fit(tmp_path, AdvancedProfiler(dirpath=folder, filename="adv", dump_stats=True))
    report = (folder / "fit-adv.txt").read_text()
    assert report.startswith("FIT Profiler Report")
    section = report.split(f"Profile stats for: {STRATEGY}.training_step", 1)[1]
    section = section.split("Profile stats for:", 1)[0]
    assert "_distinctive_helper" in section
    assert "Ordered by: cumulative time" in section
    # dump_stats: each action's raw profile, readable by pstats, inside dirpath.
    dumped = folder / f"fit-adv-{STRATEGY}.training_step.prof"
    stats = pstats.Stats(str(dumped))
    assert any(func[2] == "_distinctive_helper" for func in stats.stats)  # type: ignore[attr-defined]


def test_advanced_profiler_resumes_the_outer_action_after_a_nested_one() -> None:
    def before() -> None: ...
    def after() -> None: ...
    def inner_work() -> None: ...

    profiler = AdvancedProfiler()
    with profiler.profile("outer"):
        before()
        with profiler.profile("inner"):
            inner_work()
        after()  # Lightning would have stopped profiling "outer" for good here

    def functions(action: str) -> set[str]:
        stats = pstats.Stats(profiler.profiled_actions[action])
        return {func[2] for func in stats.stats}  # type: ignore[attr-defined]

    assert {"before", "after"} <= functions("outer")
    assert "inner_work" not in functions("outer")
    assert "inner_work" in functions("inner")


@pytest.mark.parametrize("value", [-1, 1.5, "all", True])
def test_advanced_line_count_restriction_is_checked(value: object) -> None:
    with pytest.raises(TrainerError, match="line_count_restriction="):
        AdvancedProfiler(line_count_restriction=value)  # type: ignore[arg-type]


# ---- failures, refusals and hostile input ---------------------------------------
def test_a_failed_call_writes_no_report_and_leaves_the_profiler_usable(tmp_path: Path) -> None:
    folder = tmp_path / "prof"
    profiler = SimpleProfiler(dirpath=folder, filename="perf")
    Boring, _ = make_classes(G.LightningModule, G.Callback)

    class Fails(Boring):  # type: ignore[misc, valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("boom")

    trainer = G.Trainer(**quiet(tmp_path, profiler=profiler))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Fails(), *loaders())
    assert not (folder / "fit-perf.txt").exists()  # as Lightning: a report on success only
    assert profiler.current_actions == {}  # run_training_batch was left open, then cleared
    gpulayer_fit(tmp_path, profiler)
    assert (folder / "fit-perf.txt").exists()


def test_start_twice_and_stop_unstarted_are_refused() -> None:
    profiler = SimpleProfiler()
    profiler.start("a")
    with pytest.raises(TrainerError, match="'a' was started again"):
        profiler.start("a")
    with pytest.raises(TrainerError, match="'b' was stopped but never started"):
        profiler.stop("b")


@pytest.mark.parametrize(
    "filename", ["../../escape", "sub/perf", "..\\evil", "..", "a\x00b", "x\ny", 'p"; DROP --']
)
@pytest.mark.parametrize("kind", [SimpleProfiler, AdvancedProfiler])
def test_a_filename_that_is_a_path_is_refused_and_nothing_is_written(
    tmp_path: Path, filename: str, kind: type[Profiler]
) -> None:
    folder = tmp_path / "prof"
    with pytest.raises(TrainerError, match="filename=") as caught:
        kind(dirpath=folder, filename=filename)
    assert repr(filename) in str(caught.value)
    assert list(tmp_path.iterdir()) == []
    # And through the Trainer argument as Lightning users write it.
    with pytest.raises(TrainerError, match="filename="):
        G.Trainer(profiler=kind(filename=filename))
    assert list(tmp_path.iterdir()) == []


def test_shell_characters_in_a_filename_stay_a_file_name(tmp_path: Path) -> None:
    folder = tmp_path / "prof"
    gpulayer_fit(tmp_path, SimpleProfiler(dirpath=folder, filename="perf;rm -rf ~ $(id)"))
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["fit-perf;rm -rf ~ $(id).txt"]


def test_a_planted_symlink_at_the_report_path_is_refused_before_training(tmp_path: Path) -> None:
    folder, outside = tmp_path / "prof", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    target = outside / "precious.txt"
    target.write_text("keep me")
    (folder / "fit-perf.txt").symlink_to(target)
    Boring, _ = make_classes(G.LightningModule, G.Callback)
    module = Boring()
    trainer = G.Trainer(**quiet(tmp_path, profiler=SimpleProfiler(dirpath=folder, filename="perf")))
    with pytest.raises(TrainerError, match="symbolic link"):
        trainer.fit(module, *loaders())
    assert module.steps_seen == []  # refused before any work
    assert target.read_text() == "keep me"


def test_action_names_in_dumped_files_cannot_leave_dirpath(tmp_path: Path) -> None:
    folder = tmp_path / "prof"
    profiler = AdvancedProfiler(dirpath=folder, filename="adv", dump_stats=True)
    with profiler.profile("../../escape/x"):
        pass
    profiler.describe()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(p.parent == folder for p in files), files
    assert sorted(p.name for p in files) == ["adv-.._.._escape_x.prof", "adv.txt"]


def test_remote_and_odd_dirpaths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TrainerError, match="remote URL"):
        SimpleProfiler(dirpath="s3://bucket/prof", filename="perf")
    with pytest.raises(TrainerError, match="dirpath="):
        SimpleProfiler(dirpath=3, filename="perf")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["bogus", "", 3, True])
def test_an_unknown_profiler_is_refused_naming_the_choices(value: object) -> None:
    with pytest.raises(TrainerError) as caught:
        G.Trainer(profiler=value)  # type: ignore[arg-type]
    message = str(caught.value)
    assert f"profiler={value!r}" in message and "'simple', 'advanced'" in message


@pytest.mark.parametrize(
    ("value", "name"), [("pytorch", "PyTorchProfiler"), ("xla", "XLAProfiler")]
)
def test_lightnings_other_profilers_are_refused_saying_what_to_use(value: str, name: str) -> None:
    with pytest.raises(TrainerError, match=f"profiler='{value}'.*{name}.*torch.profiler"):
        G.Trainer(profiler=value)
    # Where a port imports them: at once, naming them, not a bare ImportError.
    with pytest.raises(TrainerError, match=f"{name} is a Lightning profiler.*torch.profiler"):
        exec(f"from gpulayer.train.profilers import {name}", {})
    with pytest.raises(TrainerError, match=name):
        getattr(G.profilers, name)
    with pytest.raises(AttributeError, match="NoSuchProfiler"):
        _ = profilers.NoSuchProfiler


def test_a_lightning_profiler_object_is_refused_saying_where_ours_is() -> None:
    pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.profilers import SimpleProfiler as LightningSimple

    with pytest.raises(TrainerError, match=re.escape("import it from gpulayer.train.profilers")):
        G.Trainer(profiler=LightningSimple())  # type: ignore[arg-type]


def test_profiling_changes_nothing_with_dropout_and_a_shuffling_loader(tmp_path: Path) -> None:
    from test_train_sync_free import loader
    from trainer_testkit import Regression, assert_same_weights

    modules = []
    for profiler in (None, "simple", "advanced"):
        torch.manual_seed(0)
        module = Regression(dropout=0.5)
        trainer = G.Trainer(**quiet(tmp_path, profiler=profiler, num_sanity_val_steps=0))
        trainer.fit(module, loader(6))
        modules.append(module)
    assert_same_weights(modules[0], modules[1])
    assert_same_weights(modules[0], modules[2])


# ---- the speed stays ----------------------------------------------------------------
def test_without_a_profiler_the_loop_gets_the_very_callables() -> None:
    def fn() -> None: ...

    data = [1, 2]
    assert timed(None, "x", fn) is fn
    assert timed_iter(None, "x", data) is data
    assert timed(SimpleProfiler(), "x", fn) is not fn


@pytest.mark.parametrize("profiler", ["simple", "advanced"])
def test_profiling_adds_no_host_sync_per_step(syncs: SyncCounter, profiler: str) -> None:
    recorder = fit(syncs, batches=8, log_every=1000, profiler=profiler)
    assert len(recorder.events) == 3 * 8 * 2
    assert syncs_inside_epochs(recorder) == [], "\n".join(syncs.where)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature")
@pytest.mark.parametrize("profiler", ["simple", "advanced"])
def test_profiling_adds_no_cuda_sync(
    profiler: str, tmp_path: Path
) -> None:  # pragma: no cover - GPU only
    """On a GPU, CUDA's own sync detector raises if timing an action synchronises."""
    from test_train_sync_free import Busy
    from trainer_testkit import make_batches

    device = torch.device("cuda", 0)
    batches = [(x.to(device), y.to(device)) for x, y in make_batches(6)]

    class Guard(G.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if batch_idx == len(batches) - 1:
                torch.cuda.set_sync_debug_mode("default")  # epoch-end reads are allowed

    kind = SimpleProfiler if profiler == "simple" else AdvancedProfiler
    chosen = kind(dirpath=tmp_path, filename="p")
    try:
        trainer = G.Trainer(
            accelerator="cuda",
            max_epochs=2,
            log_every_n_steps=1000,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            callbacks=[Guard()],
            profiler=chosen,
        )
        trainer.fit(Busy(), batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.global_step == 12
    assert "[Strategy]SingleDeviceStrategy.training_step" in (tmp_path / "fit-p.txt").read_text()


# ---- two ranks: a file per rank, the printed report on rank 0 only ------------------
def test_under_ddp_each_rank_writes_its_own_report(tmp_path: Path) -> None:
    from trainer_testkit import run_ranks

    results = run_ranks([__file__, str(tmp_path)], world=2, cwd=tmp_path)
    for rank in range(2):
        report = (tmp_path / "prof" / f"fit-perf-{rank}.txt").read_text()
        assert report.startswith("FIT Profiler Report")
        assert "[Strategy]DDPStrategy.training_step" in report
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == [
        "fit-perf-0.txt",
        "fit-perf-1.txt",
    ]
    printed = ["FIT Profiler Report" in r.stdout for r in results]
    assert printed == [True, False]  # without a filename: global rank 0 prints


def _rank_main(out: Path) -> None:
    from trainer_testkit import Regression, make_batches

    for profiler in (SimpleProfiler(dirpath=out / "prof", filename="perf"), "simple"):
        trainer = G.Trainer(**quiet(out, max_epochs=1, profiler=profiler))
        trainer.fit(Regression(), make_batches(4))


if __name__ == "__main__":
    import sys

    _rank_main(Path(sys.argv[1]))
