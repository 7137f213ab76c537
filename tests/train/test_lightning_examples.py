"""Lightning's own example scripts, run as shipped and with only their imports changed.

The scripts are kept verbatim in ``lightning_examples/`` (each names its
source, commit and licence; ``KEPT`` holds a digest of each text). A run
under ``lightning.pytorch`` and a run of the same text with its import lines
rewritten to ``gpulayer.train`` are compared: both reach the end, ``test()``
returns the same metrics, the final weights are the same (same seed before
the script's entry point), and the same metric names (and, where the script
logs every step, the same values) are logged. Each runnable port also runs
as a script on its own and as a GPUlayer job of 2 nodes x 2 ranks (DDP on
gloo, CPU).

* ``bug_report_model.py``: the BoringModel, as shipped.
* ``transformer.py``: a transformer language model on WikiText2, with the
  demo module it imports kept as ``demos_transformer.py``. The script takes
  no options and trains 20 epochs on all of WikiText2: the test writes a
  small WikiText2 file where the dataset reads it (``./data``) and makes the
  runs short with ``PL_TRAINER_*`` variables, which both trainers read as
  their arguments' defaults.
* ``autoencoder.py``, ``backbone_image_classifier.py``: built on
  LightningCLI, which GPUlayer does not have; their ports are refused at
  once, by name, saying what to write instead.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import random
import re
import subprocess
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from trainer_testkit import SRC

from gpulayer.train import TrainerError

pytestmark = pytest.mark.torch

EXAMPLES = Path(__file__).parent / "lightning_examples"
BUG_REPORT = EXAMPLES / "bug_report_model.py"
TRANSFORMER = EXAMPLES / "transformer.py"
DEMO = EXAMPLES / "demos_transformer.py"
CLI_EXAMPLES = [EXAMPLES / "autoencoder.py", EXAMPLES / "backbone_image_classifier.py"]

#: What lies below each kept file's line: the SHA-256 of the upstream text at
#: the commit its header names, so that an edit of the test data is caught.
KEPT = {
    "bug_report_model.py": "5b40c80c42efd713000d6c4a4b3aaeafea0cb3ccea792edebf583fc1a64863b0",
    "transformer.py": "417e7ceb2e0611d7656ea6ea72927c18a04dcf4fda824e3baca2645a9e464367",
    "demos_transformer.py": "6655cf1b00acc96209b878598c2b5e63d1246bc32342e1991d42c5fc57aa4e4d",
    "autoencoder.py": "fbd691666054c1ac7472df714d5e8b4cdfb912d5973d010cd6a6172cf6bf3255",
    "backbone_image_classifier.py": "a34c1eda8065de16185466d8abba545e770567a639c0f4e49b9f630523b2db1b",
}
LINE = "# " + "-" * 76 + "\n"

#: Lightning's demo modules that a kept example imports, and the kept copy
#: (a module beside the ported script) that its port imports instead.
KEPT_DEMOS = {
    "lightning.pytorch.demos": DEMO.stem,
    "lightning.pytorch.demos.transformer": DEMO.stem,
}

# `from lightning.pytorch.callbacks import X`, `from lightning import X`,
# `import lightning.pytorch as pl`, `import lightning as L` (and the older
# `pytorch_lightning` package): the only lines a port changes.
_FROM = re.compile(
    r"^(\s*)from (?:lightning\.pytorch|lightning|pytorch_lightning)(\.[\w.]+)? import "
)
_IMPORT_AS = re.compile(
    r"^(\s*)import (?:lightning\.pytorch|lightning|pytorch_lightning) as (\w+)\s*$"
)
_FROM_DEMOS = re.compile(r"^(\s*)from (lightning\.pytorch\.demos(?:\.\w+)?) import ")


def port_imports(source: str) -> str:
    """``source`` with each Lightning import line pointed at gpulayer.train
    (a kept demo module's at its kept copy)."""
    out = []
    for line in source.splitlines(keepends=True):
        demo = _FROM_DEMOS.match(line)
        if demo and demo[2] in KEPT_DEMOS:
            line = f"{demo[1]}from {KEPT_DEMOS[demo[2]]} import " + line[demo.end() :]
        else:
            line = _FROM.sub(lambda m: f"{m[1]}from gpulayer.train{m[2] or ''} import ", line)
            line = _IMPORT_AS.sub(lambda m: f"{m[1]}import gpulayer.train as {m[2]}\n", line)
        out.append(line)
    return "".join(out)


def changed_lines(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
    ]


@dataclass
class Outcome:
    """What one run of a script left behind, read by wrapping Trainer.fit/test."""

    fit_metrics: list[set[str]] = field(default_factory=list)  # callback_metrics keys per fit
    test_results: list[list[dict[str, float]]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    global_steps: list[int] = field(default_factory=list)  # after each fit


def record(monkeypatch: pytest.MonkeyPatch, trainer_cls: type) -> Outcome:
    outcome = Outcome()
    fit, test = trainer_cls.fit, trainer_cls.test  # type: ignore[attr-defined]

    def recording_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = fit(self, *args, **kwargs)
        outcome.fit_metrics.append(set(self.callback_metrics))
        outcome.global_steps.append(self.global_step)
        return result

    def recording_test(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = test(self, *args, **kwargs)
        outcome.test_results.append([{k: float(v) for k, v in d.items()} for d in result])
        module = self.lightning_module
        outcome.weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return result

    monkeypatch.setattr(trainer_cls, "fit", recording_fit)
    monkeypatch.setattr(trainer_cls, "test", recording_test)
    return outcome


def run_script(source: str, path: Path, seed: int, entry: str = "run") -> None:
    """Execute the script as a module (not as __main__), then call its entry point."""
    namespace: dict[str, Any] = {"__name__": path.stem, "__file__": str(path)}
    exec(compile(source, str(path), "exec"), namespace)
    torch.manual_seed(seed)  # the script draws its data and weights in run()
    runner: Callable[[], None] = namespace[entry]
    runner()


def install_kept_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port of the kept demo module, importable by its name for this test only."""
    module = types.ModuleType(DEMO.stem)
    module.__file__ = str(DEMO)
    exec(compile(port_imports(DEMO.read_text()), str(DEMO), "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, DEMO.stem, module)


def run_both(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    script: Path,
    seed: int = 0,
    entry: str = "run",
    prepare: Callable[[Path], None] = lambda folder: None,
) -> tuple[Outcome, Outcome]:
    """Run ``script`` under Lightning in ``tmp_path/lightning``, then its port
    under GPUlayer in ``tmp_path/gpulayer``; ``prepare`` fills each folder first."""
    import lightning.pytorch

    import gpulayer.train

    source = script.read_text()
    theirs = record(monkeypatch, lightning.pytorch.Trainer)
    (tmp_path / "lightning").mkdir()
    prepare(tmp_path / "lightning")
    monkeypatch.chdir(tmp_path / "lightning")
    with warnings.catch_warnings():
        # Lightning's advice (few workers, a short epoch...) is not under test.
        warnings.simplefilter("ignore")
        run_script(source, script, seed, entry)

    ours = record(monkeypatch, gpulayer.train.Trainer)
    (tmp_path / "gpulayer").mkdir()
    prepare(tmp_path / "gpulayer")
    monkeypatch.chdir(tmp_path / "gpulayer")
    run_script(port_imports(source), script, seed, entry)  # our own warnings stay errors
    return theirs, ours


def script_env() -> dict[str, str]:
    """The environment of a ported script run as a process: gpulayer
    importable, and no rank variables of the test's own."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


# ---- the kept files ---------------------------------------------------------
def test_port_imports_changes_only_import_lines() -> None:
    source = BUG_REPORT.read_text()
    assert changed_lines(source, port_imports(source)) == [
        "-from lightning.pytorch import LightningModule, Trainer",
        "+from gpulayer.train import LightningModule, Trainer",
    ]
    other = (
        "import lightning as L\n"
        "import lightning.pytorch as pl\n"
        "from lightning.pytorch.callbacks import ModelCheckpoint\n"
        "    from lightning.pytorch.loggers import CSVLogger\n"
        "from lightning.pytorch.demos import Transformer, WikiText2\n"
        "from lightning.pytorch.demos.transformer import WikiText2\n"
        "from lightning.pytorch.demos.boring_classes import BoringModel\n"
        "from lightning_utilities.core.imports import RequirementCache\n"
        "x = 'from lightning import nothing'\n"
    )
    assert port_imports(other) == (
        "import gpulayer.train as L\n"
        "import gpulayer.train as pl\n"
        "from gpulayer.train.callbacks import ModelCheckpoint\n"
        "    from gpulayer.train.loggers import CSVLogger\n"
        "from demos_transformer import Transformer, WikiText2\n"
        "from demos_transformer import WikiText2\n"
        # Not kept: a port of it fails to import, naming the module.
        "from gpulayer.train.demos.boring_classes import BoringModel\n"
        "from lightning_utilities.core.imports import RequirementCache\n"
        "x = 'from lightning import nothing'\n"
    )
    for script in (TRANSFORMER, DEMO, *CLI_EXAMPLES):
        source = script.read_text()
        changed = changed_lines(source, port_imports(source))
        assert changed, script.name
        assert all(re.match(r"[-+](import|from) ", line) for line in changed), changed


@pytest.mark.parametrize("name", sorted(KEPT))
def test_kept_example_names_its_source_and_is_unedited(name: str) -> None:
    header, sep, body = (EXAMPLES / name).read_text().partition(LINE)
    assert sep, f"{name} has no line between its header and the kept text"
    assert re.search(
        r"Source: https://github\.com/Lightning-AI/pytorch-lightning/blob/([0-9a-f]{40})/\S+",
        header,
    )
    commit = re.search(r"Commit: ([0-9a-f]{40})", header)
    assert commit and f"/blob/{commit[1]}/" in header  # the URL is at that commit
    assert "Apache License 2.0" in header
    assert hashlib.sha256(body.encode()).hexdigest() == KEPT[name]


def test_kept_demo_is_the_installed_lightning_demo() -> None:
    """Under Lightning the script imports lightning.pytorch.demos.transformer;
    its port imports the kept copy: the two runs use the same model and data code."""
    import lightning.pytorch.demos.transformer as theirs

    body = DEMO.read_text().partition(LINE)[2]
    assert body == Path(theirs.__file__).read_text()


# ---- bug_report_model.py ----------------------------------------------------
def test_bug_report_model_matches_lightning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    theirs, ours = run_both(monkeypatch, tmp_path, BUG_REPORT)
    # Both ran to the end: one fit, then one test() returning [metrics].
    assert len(theirs.fit_metrics) == len(ours.fit_metrics) == 1
    assert len(theirs.test_results) == len(ours.test_results) == 1
    assert [set(d) for d in ours.test_results[0]] == [{"test_loss"}]
    assert ours.test_results[0][0]["test_loss"] == pytest.approx(
        theirs.test_results[0][0]["test_loss"], rel=1e-6
    )
    assert set(ours.weights) == set(theirs.weights) == {"layer.weight", "layer.bias"}
    for name, value in theirs.weights.items():
        torch.testing.assert_close(ours.weights[name], value, msg=name)
    assert ours.fit_metrics == theirs.fit_metrics == [{"train_loss", "valid_loss"}]
    # The same names reach the default loggers' files: Lightning's TensorBoard
    # events, GPUlayer's metrics.csv.
    names = set(lightning_scalars(tmp_path / "lightning"))
    assert set(our_scalars(tmp_path / "gpulayer")) == names == {"valid_loss", "test_loss"}


def lightning_scalars(root: Path) -> dict[str, list[tuple[int, float]]]:
    """What Lightning's default logger (TensorBoard) wrote: name -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run))
    events.Reload()
    names = set(events.Tags()["scalars"]) - {"epoch", "hp_metric"}
    return {name: [(e.step, e.value) for e in events.Scalars(name)] for name in names}


def our_scalars(root: Path) -> dict[str, list[tuple[int, float]]]:
    """What GPUlayer's default logger (metrics.csv) wrote: name -> [(step, value)]."""
    import csv

    (path,) = root.rglob("metrics.csv")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    names = set(rows[0]) - {"step", "epoch"} if rows else set()
    return {
        name: [(int(row["step"]), float(row[name])) for row in rows if row[name] != ""]
        for name in names
    }


def test_logged_steps_match_lightning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The step each value is logged at, which is the x axis of its plot: the
    BoringModel's first batch's train_loss and its validation, logging every step."""
    monkeypatch.setenv("PL_TRAINER_LOG_EVERY_N_STEPS", "1")
    run_both(monkeypatch, tmp_path, BUG_REPORT)
    theirs = lightning_scalars(tmp_path / "lightning")
    ours = our_scalars(tmp_path / "gpulayer")
    assert set(theirs) == {"train_loss", "valid_loss", "test_loss"}
    assert theirs["test_loss"][0][0] == ours["test_loss"][0][0] == 1  # after fit, the same
    assert {name: [step for step, _ in points] for name, points in ours.items()} == {
        name: [step for step, _ in points] for name, points in theirs.items()
    }


def test_ported_bug_report_runs_as_a_script(tmp_path: Path) -> None:
    script = tmp_path / "bug_report_model.py"
    script.write_text(port_imports(BUG_REPORT.read_text()))
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test_loss" in result.stdout  # test(verbose=True) prints its metrics
    assert list(tmp_path.rglob("metrics.csv")), "the default CSVLogger wrote no metrics"


def test_ported_bug_report_runs_as_a_2x2_job(home: Path, tmp_path: Path) -> None:
    """Lightning's own BoringModel, only its imports changed, as a GPUlayer
    job of two nodes of two ranks (DDP on gloo, CPU): every rank trains and
    tests, and rank 0 reports the test loss."""
    import gpulayer

    folder = tmp_path / "boring"
    folder.mkdir()
    script = folder / "bug_report_model.py"
    script.write_text(port_imports(BUG_REPORT.read_text()))
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(2)
        job = client.submit(script, nodes=2, procs_per_node=2)
        assert job.wait(timeout=300) == "succeeded", job.logs()[-3000:]
        lines = list(job.stream_logs(follow=False))
    assert {line.rank for line in lines} <= {0, 1, 2, 3}
    assert any("test_loss" in line.text for line in lines if line.rank == 0), [
        line.text for line in lines
    ][-20:]


# ---- transformer.py ---------------------------------------------------------
#: The script splits WikiText2 into all-but-4000 samples to train on, then
#: 2000 to validate and 2000 to test: 40 more make two training batches of 20.
WIKITEXT_SAMPLES = 4040
BLOCK = 35  # WikiText2's default block_size, which the script keeps
#: Short runs of the unedited script, set from outside as Lightning allows:
#: its Trainer(gradient_clip_val=0.25, max_epochs=20) keeps its own two.
SHORT_RUN = {
    "PL_TRAINER_ACCELERATOR": "cpu",
    "PL_TRAINER_MAX_STEPS": "5",  # 3 epochs, the last cut short
    "PL_TRAINER_LIMIT_VAL_BATCHES": "2",
    "PL_TRAINER_LIMIT_TEST_BATCHES": "2",
    "PL_TRAINER_LOG_EVERY_N_STEPS": "1",
    "PL_TRAINER_ENABLE_PROGRESS_BAR": "False",
}


def write_wikitext(folder: Path, samples: int = WIKITEXT_SAMPLES) -> None:
    """A WikiText2 file where ``WikiText2()`` reads it (``./data/wikitext-2.txt``,
    one line a sentence, words split by spaces), long enough for ``samples``
    blocks: the dataset's length is ``tokens // block_size - 1``, and each
    line counts one more token, ``<eos>``. Words follow a repeating pattern
    with noise, so the model has something to learn."""
    rng = random.Random(0)
    vocabulary = [f"w{i}" for i in range(24)]
    needed = (samples + 1) * BLOCK
    lines, tokens = [], 0
    while tokens < needed:
        count = min(69, needed - tokens - 1)
        start = rng.randrange(len(vocabulary))
        words = [
            vocabulary[(start + i) % len(vocabulary)] if rng.random() < 0.8 else "the"
            for i in range(count)
        ]
        lines.append(" ".join(words))
        tokens += count + 1
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "wikitext-2.txt").write_text("\n".join(lines) + "\n", encoding="utf8")


def test_fake_wikitext_has_the_samples_the_script_splits() -> None:
    from lightning.pytorch.demos import WikiText2

    for samples in (WIKITEXT_SAMPLES, 4001):
        folder = Path(f"wikitext_{samples}")
        write_wikitext(folder, samples)
        dataset = WikiText2(folder / "data", download=False)
        assert len(dataset) == samples
        assert dataset.vocab_size == 26  # 24 words, "the" and "<eos>"


@pytest.fixture
def short_run(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SHORT_RUN.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("short_run")
def test_transformer_matches_lightning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install_kept_demo(monkeypatch)
    theirs, ours = run_both(
        monkeypatch, tmp_path, TRANSFORMER, seed=0, entry="main", prepare=write_wikitext
    )
    assert theirs.global_steps == ours.global_steps == [5]
    assert len(theirs.test_results) == len(ours.test_results) == 1
    assert [set(d) for d in ours.test_results[0]] == [{"test_loss"}]
    assert ours.test_results[0][0]["test_loss"] == pytest.approx(
        theirs.test_results[0][0]["test_loss"], rel=1e-5
    )
    # Same seed (the script's seed_everything(42)), same split, same shuffled
    # order, dropout and clipping: the same weights after five SGD steps.
    assert set(ours.weights) == set(theirs.weights)
    assert len(ours.weights) > 50  # the whole transformer, not a stray layer
    for name, value in theirs.weights.items():
        torch.testing.assert_close(ours.weights[name], value, msg=name)
    assert ours.fit_metrics == theirs.fit_metrics == [{"train_loss", "val_loss"}]
    # Every step's train_loss, each epoch's val_loss, the test_loss: the same
    # names and values, in order, in Lightning's TensorBoard events and our CSV
    # (the steps they are logged at: test_logged_steps_match_lightning).
    logged_theirs = lightning_scalars(tmp_path / "lightning")
    logged_ours = our_scalars(tmp_path / "gpulayer")
    assert set(logged_ours) == set(logged_theirs) == {"train_loss", "val_loss", "test_loss"}
    assert [len(logged_theirs[name]) for name in ("train_loss", "val_loss")] == [5, 2]
    for name, points in logged_theirs.items():
        assert [value for _, value in logged_ours[name]] == pytest.approx(
            [value for _, value in points], rel=1e-5
        ), name
    assert logged_ours["test_loss"][0][0] == logged_theirs["test_loss"][0][0] == 5


def ported_transformer(folder: Path) -> Path:
    """The port of transformer.py, its kept demo beside it, and WikiText2's file."""
    folder.mkdir()
    (folder / DEMO.name).write_text(port_imports(DEMO.read_text()))
    script = folder / TRANSFORMER.name
    script.write_text(port_imports(TRANSFORMER.read_text()))
    write_wikitext(folder)
    return script


def test_ported_transformer_runs_as_a_script_without_lightning(tmp_path: Path) -> None:
    """Run as ``__main__`` (runpy, as ``python transformer.py`` does), then
    check that no module of lightning was imported: the port stands alone."""
    script = ported_transformer(tmp_path / "port")
    code = (
        "import runpy, sys\n"
        f"runpy.run_path({script.name!r}, run_name='__main__')\n"
        "print('lightning modules:', sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('lightning', 'pytorch_lightning')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=script.parent,
        env={**script_env(), **SHORT_RUN, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test_loss" in result.stdout  # test(verbose=True) prints its metrics
    assert "lightning modules: []" in result.stdout, result.stdout[-2000:]
    (metrics,) = script.parent.rglob("metrics.csv")
    assert "train_loss" in metrics.read_text().splitlines()[0]


def test_ported_transformer_runs_as_a_2x2_job(home: Path, tmp_path: Path) -> None:
    """Lightning's transformer example, only its imports changed, as a job of
    two nodes of two ranks; strategy="ddp" comes from the job's environment
    (PL_TRAINER_STRATEGY), as the script has no option for it. Each rank
    trains on its shard of the 40 training samples (one batch of 10 an
    epoch, so the 5 steps take 5 epochs, where one process takes 3) and rank
    0 reports the test loss."""
    import csv

    import gpulayer

    script = ported_transformer(tmp_path / "transformer")
    env = {**SHORT_RUN, "PL_TRAINER_STRATEGY": "ddp", "OMP_NUM_THREADS": "1"}
    metrics = "gpulayer_runs/version_0/metrics.csv"
    with gpulayer.Client(home=home) as client:
        client.ensure_local_workers(2)
        job = client.submit(script, nodes=2, procs_per_node=2, env=env, outputs=[metrics])
        assert job.wait(timeout=300) == "succeeded", job.logs()[-3000:]
        lines = list(job.stream_logs(follow=False))
        out = job.download_outputs(tmp_path / "out")
    assert any("test_loss" in line.text for line in lines if line.rank == 0), [
        line.text for line in lines
    ][-20:]
    with (out / metrics).open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["train_loss"]]
    assert [row["epoch"] for row in rows] == ["0", "1", "2", "3", "4"]  # a step an epoch


# ---- PL_TRAINER_* variables, which the transformer runs rely on ------------
def test_pl_trainer_variables_are_read_as_lightning_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning.pytorch as pl

    import gpulayer.train as L

    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "7")
    monkeypatch.setenv("PL_TRAINER_LIMIT_VAL_BATCHES", "0.25")
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")  # not a literal: the text
    monkeypatch.setenv("PL_TRAINER_LOGGER", "False")
    monkeypatch.setenv("PL_TRAINER_MAX_EPOCHS", "")  # empty: not set
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pl.Trainer(enable_progress_bar=False)
        theirs_given = pl.Trainer(max_steps=3, enable_progress_bar=False)
    ours = L.Trainer(enable_progress_bar=False)
    assert ours.max_steps == theirs.max_steps == 7
    assert ours.limit_val_batches == theirs.limit_val_batches == 0.25
    assert ours.loggers == theirs.loggers == []
    assert theirs.max_epochs is None and ours.max_epochs == -1  # max_steps alone bounds it
    # An argument in the code wins over the variable, in both.
    assert L.Trainer(max_steps=3).max_steps == theirs_given.max_steps == 3


def test_a_refused_pl_trainer_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    import gpulayer.train as L

    monkeypatch.setenv("PL_TRAINER_MAX_EPOCHS", "ten")
    with pytest.raises(TrainerError, match=r"max_epochs='ten' must be an int") as caught:
        L.Trainer()
    assert "PL_TRAINER_MAX_EPOCHS='ten'" in str(caught.value)
    assert L.Trainer(max_epochs=2).max_epochs == 2  # not read when the code gives it
    monkeypatch.delenv("PL_TRAINER_MAX_EPOCHS")
    # One of Lightning's arguments that GPUlayer refuses is refused from outside too.
    monkeypatch.setenv("PL_TRAINER_MIN_EPOCHS", "2")
    with pytest.raises(TrainerError, match=r"Trainer\(min_epochs=2\) is Lightning's") as caught:
        L.Trainer()
    assert "PL_TRAINER_MIN_EPOCHS='2'" in str(caught.value)


def test_a_pl_trainer_value_is_never_run_as_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import gpulayer.train as L

    target = tmp_path / "pwned"
    hostile = f"__import__('pathlib').Path({str(target)!r}).touch()"
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", hostile)
    with pytest.raises(TrainerError, match="accelerator") as caught:
        L.Trainer()
    assert hostile in str(caught.value)  # echoed as the text it is
    assert not target.exists()
    # Too deep for literal_eval: the text, refused as any bad value is.
    monkeypatch.setenv("PL_TRAINER_ACCELERATOR", "cpu")
    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "[" * 5000 + "]" * 5000)
    with pytest.raises(TrainerError, match=r"max_steps='\[\[\[.* must be an int"):
        L.Trainer()
    monkeypatch.delenv("PL_TRAINER_MAX_STEPS")
    monkeypatch.setenv("PL_TRAINER_DEFAULT_ROOT_DIR", "runs'; DROP TABLE jobs; --")
    trainer = L.Trainer()  # a path is text, as an argument's would be
    assert trainer.default_root_dir == Path("runs'; DROP TABLE jobs; --")
    assert not target.exists() and sorted(tmp_path.iterdir()) == []


# ---- autoencoder.py, backbone_image_classifier.py: LightningCLI -------------
@pytest.mark.parametrize("script", CLI_EXAMPLES, ids=[p.stem for p in CLI_EXAMPLES])
def test_ported_cli_example_is_refused_naming_lightning_cli(script: Path, tmp_path: Path) -> None:
    """The script builds everything through LightningCLI; its port fails at
    the import of it, before any data or model is made, naming it and what
    to write instead."""
    source = port_imports(script.read_text())
    assert "from gpulayer.train.cli import LightningCLI\n" in source
    with pytest.raises(TrainerError) as caught:
        exec(compile(source, str(script), "exec"), {"__name__": script.stem})
    message = str(caught.value)
    assert message.startswith("LightningCLI is part of Lightning's command line")
    assert "argparse" in message and "PL_TRAINER_" in message
    assert sorted(tmp_path.iterdir()) == []  # nothing downloaded or written


def test_every_name_of_lightning_cli_is_refused_by_name() -> None:
    import lightning.pytorch.cli as theirs

    import gpulayer.train.cli as ours

    names = [
        name
        for name, value in vars(theirs).items()
        if not name.startswith("_")
        and getattr(value, "__module__", None) == theirs.__name__
        and not isinstance(value, TypeVar)  # ModuleType, a name for annotations
    ]
    assert "LightningCLI" in names
    for name in names:
        with pytest.raises(TrainerError, match=f"^{name} is part of Lightning's command line"):
            getattr(ours, name)
    with pytest.raises(AttributeError):
        ours.nothing_of_lightning  # noqa: B018 - the lookup is the test


def test_cli_lightning_logo_prints_a_banner(capsys: pytest.CaptureFixture[str]) -> None:
    import gpulayer.train as L

    L.cli_lightning_logo()
    assert "gpulayer.train" in capsys.readouterr().out
