"""Lightning's own defaults, given explicitly, mean here what they mean there.

A port often spells out Lightning's defaults (``logger=None``,
``precision=None``...). In Lightning, ``None`` in these is "the default",
never "off": each is made here and in lightning.pytorch 2.6.6 and compared.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import gpulayer.train as G

pl = pytest.importorskip("lightning.pytorch")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def test_every_lightning_trainer_argument_at_its_default_is_accepted(tmp_path: Path) -> None:
    """All of inspect.signature(lightning.pytorch.Trainer) at once, each at
    Lightning's default: a port that spells them out runs unchanged."""
    defaults = {
        name: p.default
        for name, p in inspect.signature(pl.Trainer.__init__).parameters.items()
        if name != "self" and p.default is not inspect.Parameter.empty
    }
    defaults["default_root_dir"] = str(tmp_path)
    trainer = G.Trainer(**defaults)
    assert trainer.precision == "32"
    assert trainer.log_every_n_steps == 50 and trainer.gradient_clip_algorithm == "norm"


def test_none_means_lightnings_default_not_off(tmp_path: Path) -> None:
    theirs = pl.Trainer(
        logger=None, enable_checkpointing=None, enable_progress_bar=None, default_root_dir=tmp_path
    )
    ours = G.Trainer(
        logger=None, enable_checkpointing=None, enable_progress_bar=None, default_root_dir=tmp_path
    )
    assert len(ours.loggers) == len(theirs.loggers) == 1
    assert theirs.checkpoint_callback is not None and ours.checkpoint_callback is not None
    assert theirs.progress_bar_callback is not None and ours.enable_progress_bar is True
    # And a ModelCheckpoint of one's own beside enable_checkpointing=None.
    pl.Trainer(enable_checkpointing=None, callbacks=[pl.callbacks.ModelCheckpoint()])
    G.Trainer(enable_checkpointing=None, callbacks=[G.ModelCheckpoint()])


def test_default_root_dir_none_is_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert Path(pl.Trainer(default_root_dir=None).default_root_dir) == tmp_path
    assert Path(G.Trainer(default_root_dir=None).default_root_dir) == tmp_path


@pytest.mark.parametrize("value", [1, 0, "true"])
def test_deterministic_takes_what_lightning_types_say(value: object) -> None:
    with pytest.raises(G.TrainerError, match="deterministic="):
        G.Trainer(deterministic=value, logger=False)
