"""The errors the Trainer raises.

Both derive from :class:`gpulayer.errors.GPUlayerError`::

    GPUlayerError
    └── TrainerError        a Trainer/Module setting or call it cannot honour
        └── CheckpointError  a checkpoint is missing, unreadable or does not fit

Messages echo the value that was given and list the ones that would work.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpulayer.errors import GPUlayerError


class TrainerError(GPUlayerError):
    """The Trainer or a Module was configured or used in a way it cannot honour."""


class CheckpointError(TrainerError):
    """A checkpoint cannot be found, read, or restored into this run."""


def invalid_choice(what: str, value: object, valid: Iterable[object]) -> TrainerError:
    """An error for a setting outside a fixed set: echoes it and lists the set."""
    choices = ", ".join(repr(v) for v in valid)
    return TrainerError(f"{what}={value!r} is not supported; valid values: {choices}")
