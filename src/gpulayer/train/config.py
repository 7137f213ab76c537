"""Trainer settings: checking them and filling in defaults."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gpulayer.train.callbacks import Callback
from gpulayer.train.errors import TrainerError
from gpulayer.train.loggers import CSVLogger, Logger
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module

_log = logging.getLogger("gpulayer.train")


def count_setting(name: str, value: Any, minimum: int, *, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if optional else ""
        raise TrainerError(f"{name}={value!r} must be an int >= {minimum}{extra}")
    return value


def next_version(root: Path) -> int:
    """One more than the highest ``version_N`` under ``root`` (0 if none)."""
    taken = [
        int(m.group(1))
        for p in root.glob("version_*")
        if (m := re.fullmatch(r"version_(\d+)", p.name))
    ]
    return max(taken, default=-1) + 1


def default_callbacks(
    callbacks: Iterable[Callback] | Callback | None, checkpointing: bool
) -> list[Callback]:
    if callbacks is None:
        found: list[Callback] = []
    elif isinstance(callbacks, Callback):
        found = [callbacks]
    else:
        found = list(callbacks)
    for cb in found:
        if not isinstance(cb, Callback):
            raise TrainerError(
                f"callbacks must be gpulayer.train.Callback instances; got {type(cb).__name__}"
            )
    if checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in found):
        found.append(ModelCheckpoint(save_top_k=0, save_last=True))
    if not checkpointing and any(isinstance(cb, ModelCheckpoint) for cb in found):
        raise TrainerError("enable_checkpointing=False but callbacks include a ModelCheckpoint")
    return found


def default_loggers(logger: bool | Logger | Iterable[Logger]) -> list[Logger]:
    if logger is True:
        return [CSVLogger()]
    if logger is False or logger is None:
        return []
    found = [logger] if isinstance(logger, Logger) else list(logger)
    for item in found:
        if not isinstance(item, Logger):
            raise TrainerError(
                f"logger must be True, False, a Logger or a list of them; got {type(item).__name__}"
            )
    return found


def check_validation_step(model: Module) -> None:
    """Refuse validation data for a module without validation_step, before training."""
    if type(model).validation_step is Module.validation_step:
        raise TrainerError(
            f"{type(model).__name__} was given validation data but defines no "
            f"validation_step(batch, batch_idx)"
        )


def resolve_ckpt_path(
    ckpt_path: str | Path | None, root: Path, checkpoints: list[ModelCheckpoint]
) -> Path | None:
    """The file ``ckpt_path`` means. ``"last"``: the newest ``last.ckpt`` in the
    ModelCheckpoint directories or under ``root/*/checkpoints``, or None."""
    if ckpt_path is None:
        return None
    if ckpt_path != "last":
        return Path(ckpt_path)
    places = [cb.dirpath / "last.ckpt" for cb in checkpoints if cb.dirpath]
    places += root.glob("*/checkpoints/last.ckpt")
    found = [p for p in places if p.is_file()]
    if not found:
        _log.info("ckpt_path='last': no last.ckpt under %s; starting fresh", root)
        return None
    return max(found, key=lambda p: p.stat().st_mtime_ns)
