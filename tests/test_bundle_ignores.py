"""What a bundle leaves out by default: what training leaves beside a script."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpulayer
from gpulayer import bundle


def _tree(root: Path) -> Path:
    for rel in (
        "train.py",
        "pkg/model.py",
        "lightning_logs/version_0/metrics.csv",
        "wandb/run-1/files/output.log",
        "mlruns/0/meta.yaml",
        "runs/Dec01/events.out.tfevents",
        "checkpoints/last.pt",
        "pkg/lightning_logs/x.txt",
        "epoch=3-step=40.ckpt",
        "notes/.ipynb_checkpoints/a.ipynb",
    ):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rel)
    return root


def _files(manifest: bundle.Manifest) -> set[str]:
    return {e.path for e in manifest.entries if e.kind == "file"}


def test_what_training_leaves_is_left_out_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = _tree(tmp_path / "proj")
    with caplog.at_level(logging.INFO, logger="gpulayer.bundle"):
        manifest = bundle.scan(root)
    assert _files(manifest) == {"train.py", "pkg/model.py"}
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "left out of the bundle" in said and "lightning_logs/" in said
    assert "epoch=3-step=40.ckpt" in said and bundle.IGNORE_FILE in said


def test_an_ignore_file_takes_a_default_back_and_adds_its_own(tmp_path: Path) -> None:
    root = _tree(tmp_path / "proj")
    (root / bundle.IGNORE_FILE).write_text("!checkpoints/\n!*.ckpt\npkg/\n")
    files = _files(bundle.scan(root))
    assert "checkpoints/last.pt" in files and "epoch=3-step=40.ckpt" in files
    assert not any(f.startswith("pkg/") for f in files)
    assert not any(f.startswith(("lightning_logs/", "wandb/")) for f in files)


def test_an_input_inside_the_scripts_folder_is_sent_once_and_found_at_both_paths(
    home: Path, tmp_path: Path
) -> None:
    """A file both in the script's folder and given as an input is one blob
    (blobs are named by their content: its bytes are stored and sent once),
    and the job finds it at both paths: where the script reads it, and as
    its input."""
    root = tmp_path / "proj"
    (root / "data").mkdir(parents=True)
    (root / "data" / "part.txt").write_text("in the folder")
    (root / "train.py").write_text(
        "import os, pathlib\n"
        "print(pathlib.Path(os.environ['GPULAYER_INPUTS'], 'data', 'part.txt').read_text())\n"
        "print(pathlib.Path('data', 'part.txt').read_text())\n"
    )
    with gpulayer.Client(home=home) as client:
        job = client.submit(script=root / "train.py", inputs={"data": root / "data"})
        assert job.wait(timeout=60) == "succeeded", job.logs()
        assert job.logs().splitlines() == ["in the folder", "in the folder"]
        store = gpulayer.artifacts.ArtifactStore(home / "artifacts")
        assert job.info.spec.bundle is not None
        source = bundle.load(store, job.info.spec.bundle)
        given = bundle.load(store, job.info.spec.inputs["data"].digest)
    in_bundle = {e.path: e.digest for e in source.entries if e.kind == "file"}
    as_input = {e.path: e.digest for e in given.entries if e.kind == "file"}
    assert in_bundle["data/part.txt"] == as_input["part.txt"]  # one blob


def test_the_cli_says_what_it_left_out(home: Path, tmp_path: Path) -> None:
    root = _tree(tmp_path / "proj")
    (root / "train.py").write_text("print('ran')\n")
    done = subprocess.run(
        [sys.executable, "-m", "gpulayer.cli", "run", str(root / "train.py")],
        capture_output=True,
        text=True,
        env={**os.environ, "GPULAYER_HOME": str(home)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "left out of the bundle" in done.stderr and "lightning_logs/" in done.stderr
    assert "source bundle" in done.stderr and "2 files" in done.stderr


def test_a_file_removed_while_the_folder_is_scanned_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file listed, then removed before it is read (a log rotated, a temp
    file of another program): left out, not a traceback."""
    root = tmp_path / "proj"
    root.mkdir()
    (root / "train.py").write_text("print(1)")
    (root / "fleeting.tmp").write_text("gone soon")
    listed = bundle._listdir

    def listdir(path: str) -> list[os.DirEntry[str]]:
        entries = listed(path)
        (root / "fleeting.tmp").unlink(missing_ok=True)  # after the listing, before the read
        return entries

    monkeypatch.setattr(bundle, "_listdir", listdir)
    assert _files(bundle.scan(root)) == {"train.py"}
