"""One call that seeds every RNG a training run draws from."""

from __future__ import annotations

import random

import torch

from gpulayer.train.errors import TrainerError

_MAX_SEED = 2**32 - 1


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, NumPy (when installed) and torch on every device.

    Returns ``seed``. All ranks of a job seeded alike draw alike (DDP also
    broadcasts rank 0's weights when it wraps the model).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise TrainerError(f"seed={seed!r} must be an int in 0..{_MAX_SEED}")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with the torch extra
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA and MPS generators
    return seed
