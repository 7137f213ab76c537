"""Lightning's own example scripts, run as shipped and with only their imports changed.

The scripts are kept verbatim in ``lightning_examples/`` (each names its
source, commit and licence). A run under ``lightning.pytorch`` and a run of the
same text with its import lines rewritten to ``gpulayer.train`` are compared:
both reach the end, ``test()`` returns the same metrics, the final weights are
the same (same seed before the script's ``run()``), and the same metric names
are logged. The 2 x 2 DDP run of the same script lives with the job tests.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_testkit import SRC

pytestmark = pytest.mark.torch

EXAMPLES = Path(__file__).parent / "lightning_examples"
BUG_REPORT = EXAMPLES / "bug_report_model.py"

# `from lightning.pytorch.callbacks import X`, `from lightning import X`,
# `import lightning.pytorch as pl`, `import lightning as L` (and the older
# `pytorch_lightning` package): the only lines a port changes.
_FROM = re.compile(
    r"^(\s*)from (?:lightning\.pytorch|lightning|pytorch_lightning)(\.[\w.]+)? import "
)
_IMPORT_AS = re.compile(
    r"^(\s*)import (?:lightning\.pytorch|lightning|pytorch_lightning) as (\w+)\s*$"
)


def port_imports(source: str) -> str:
    """``source`` with each Lightning import line pointed at gpulayer.train."""
    out = []
    for line in source.splitlines(keepends=True):
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


def record(monkeypatch: pytest.MonkeyPatch, trainer_cls: type) -> Outcome:
    outcome = Outcome()
    fit, test = trainer_cls.fit, trainer_cls.test  # type: ignore[attr-defined]

    def recording_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = fit(self, *args, **kwargs)
        outcome.fit_metrics.append(set(self.callback_metrics))
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


def run_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: Path, seed: int = 0
) -> tuple[Outcome, Outcome]:
    import lightning.pytorch

    import gpulayer.train

    source = script.read_text()
    theirs = record(monkeypatch, lightning.pytorch.Trainer)
    (tmp_path / "lightning").mkdir()
    monkeypatch.chdir(tmp_path / "lightning")
    with warnings.catch_warnings():
        # Lightning's advice (few workers, a short epoch...) is not under test.
        warnings.simplefilter("ignore")
        run_script(source, script, seed)

    ours = record(monkeypatch, gpulayer.train.Trainer)
    (tmp_path / "gpulayer").mkdir()
    monkeypatch.chdir(tmp_path / "gpulayer")
    run_script(port_imports(source), script, seed)  # our own warnings stay errors
    return theirs, ours


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
        "x = 'from lightning import nothing'\n"
    )
    assert port_imports(other) == (
        "import gpulayer.train as L\n"
        "import gpulayer.train as pl\n"
        "from gpulayer.train.callbacks import ModelCheckpoint\n"
        "    from gpulayer.train.loggers import CSVLogger\n"
        "x = 'from lightning import nothing'\n"
    )


def test_kept_example_names_its_source() -> None:
    header = BUG_REPORT.read_text().split("# ---", 1)[0]
    assert "github.com/Lightning-AI/pytorch-lightning/blob/" in header
    assert re.search(r"Commit: [0-9a-f]{40}", header)
    assert "Apache License 2.0" in header


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
    names = logged_names_lightning(tmp_path / "lightning")
    assert logged_names_ours(tmp_path / "gpulayer") == names == {"valid_loss", "test_loss"}


def logged_names_lightning(root: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = {p.parent for p in root.rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run))
    events.Reload()
    return set(events.Tags()["scalars"]) - {"epoch", "hp_metric"}


def logged_names_ours(root: Path) -> set[str]:
    (path,) = root.rglob("metrics.csv")
    return set(path.read_text().splitlines()[0].split(",")) - {"step", "epoch"}


def test_ported_bug_report_runs_as_a_script(tmp_path: Path) -> None:
    script = tmp_path / "bug_report_model.py"
    script.write_text(port_imports(BUG_REPORT.read_text()))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
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
