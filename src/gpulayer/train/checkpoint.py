"""Checkpoint files: written atomically, read back with plain-data unpickling.

A checkpoint is a dict (``torch.save``) with Lightning 2.6's keys where the
two formats meet (:mod:`gpulayer.train.state` writes and reads it)::

    epoch, global_step          where training was
    pytorch-lightning_version   the Lightning layout followed (Lightning needs it)
    format                      "gpulayer.train/2": GPUlayer wrote it
    state_dict                  the module's weights (never the DDP wrapper's)
    loops                       Lightning's loop progress counters: the next batch
                                to train; mid-epoch, also the RNG states from that
                                epoch's start (fit_loop.state_dict.gpulayer)
    callbacks                   each stateful callback's state, by its state_key
    optimizer_states            [optimizer.state_dict()]
    lr_schedulers               [scheduler.state_dict(), ...]
    MixedPrecision              the gradient scaler's state, if one runs
    rng                         Python, NumPy, torch CPU and accelerator RNG states
    hyper_parameters            Module.hparams

Writes go to a temporary file in the same directory, are fsynced, and renamed
over the target, so a crash mid-write never leaves a torn ``last.ckpt``.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch

from gpulayer.train.errors import CheckpointError

#: GPUlayer's checkpoint format; "gpulayer.train/1" files (``loop``, ``precision``) still load.
FORMAT = "gpulayer.train/2"
#: The Lightning version whose checkpoint layout GPUlayer's follows. Lightning
#: reads it as the file's version: an older one would make it migrate the keys.
LIGHTNING_LAYOUT = "2.6.6"

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the torch extra
    np = None  # type: ignore[assignment]


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` so that readers see the old file or the new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def load_checkpoint(
    path: str | Path,
    map_location: str | torch.device | None = None,
    *,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Read a checkpoint. ``weights_only`` refuses arbitrary pickled objects."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        hint = (
            " (it holds objects that are not plain data, e.g. custom hyperparameters; "
            "pass weights_only=False only if you trust the file)"
            if weights_only and "weights_only" in str(exc)
            else ""
        )
        raise CheckpointError(f"cannot read checkpoint {str(path)!r}: {exc}{hint}") from exc
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(
            f"{str(path)!r} is not a training checkpoint: expected a dict with a "
            f"'state_dict' key, found {type(checkpoint).__name__}"
        )
    return checkpoint


def capture_rng_states() -> dict[str, Any]:
    """Every RNG a training step may draw from, as plain data."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        # As a tensor, so that the checkpoint loads with weights_only=True.
        keys_tensor = torch.from_numpy(np.asarray(keys).astype("int64"))
        states["numpy"] = (kind, keys_tensor, pos, has_gauss, gauss)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    if torch.backends.mps.is_available():
        states["mps"] = torch.mps.get_rng_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_states` returned."""
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    torch.set_rng_state(states["torch"])
    if np is not None and "numpy" in states:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    if "mps" in states and torch.backends.mps.is_available():
        torch.mps.set_rng_state(states["mps"])
