"""Seeding every RNG a training run draws from, DataLoader workers included.

``seed_everything(seed, workers=True)`` behaves as Lightning's: it records the
seed in ``PL_GLOBAL_SEED`` and the choice in ``PL_SEED_WORKERS`` (environment
variables, so that processes started later see them too), and the Trainer
then gives each DataLoader without a ``worker_init_fn`` one that seeds every
worker differently per worker and per rank, with the same values Lightning
gives, so that random augmentations in workers match a Lightning run.
"""

from __future__ import annotations

import logging
import numbers
import os
import random
from functools import partial
from typing import Any

import torch

from gpulayer.train.errors import TrainerError

_MAX_SEED = 2**32 - 1
_MASK64 = (1 << 64) - 1
#: Environment variables Lightning uses; the same names, so scripts reading them still work.
SEED_VAR = "PL_GLOBAL_SEED"
WORKERS_VAR = "PL_SEED_WORKERS"

_log = logging.getLogger("gpulayer.train")


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's ``random``, NumPy (when installed) and torch on every device.

    ``seed=None`` takes ``PL_GLOBAL_SEED`` from the environment, else 0.
    ``workers=True`` makes the Trainer seed DataLoader worker processes (see
    :func:`worker_init_function`). Returns the seed. All ranks of a job seeded
    alike draw alike (DDP also broadcasts rank 0's weights when it wraps the
    model).
    """
    if seed is None:
        from_env = os.environ.get(SEED_VAR)
        if from_env is None:
            seed = 0
        elif from_env.strip().isdigit():
            seed = int(from_env)
        else:
            raise TrainerError(
                f"{SEED_VAR}={from_env!r} in the environment is not a seed; set it to an "
                f"int in 0..{_MAX_SEED} or pass seed_everything(seed)"
            )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TrainerError(f"seed={seed!r} must be an int in 0..{_MAX_SEED}")
    seed = int(seed)
    if not 0 <= seed <= _MAX_SEED:
        raise TrainerError(f"seed={seed!r} must be an int in 0..{_MAX_SEED}")
    if not isinstance(workers, bool):
        raise TrainerError(f"seed_everything(workers={workers!r}) must be True or False")
    if verbose:
        _log.info("Seed set to %d", seed)
    os.environ[SEED_VAR] = str(seed)
    os.environ[WORKERS_VAR] = str(int(workers))
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with the torch extra
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds CUDA and MPS generators
    return seed


def _seed_sequence(base_seed: int, worker_id: int, rank: int, count: int) -> list[int]:
    # Lightning's scheme, reproduced for identical worker draws: mix (seed,
    # worker, rank) into 64 bits with MurmurHash3's finalizer, then step a
    # 64-bit linear congruential generator (Knuth's multiplier) once per seed.
    mixed = ((base_seed << 32) | (worker_id << 16) | rank) & _MASK64
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        mixed ^= mixed >> 33
        mixed = (mixed * multiplier) & _MASK64
    mixed ^= mixed >> 33
    out = []
    for _ in range(count):
        mixed = (mixed * 6364136223846793005 + 1) & _MASK64
        out.append(mixed)
    return out


def worker_init_function(worker_id: int, rank: int = 0) -> None:
    """Seed torch, ``random`` and NumPy in a DataLoader worker (Lightning's values).

    torch has already seeded the worker with ``base_seed + worker_id``, where
    ``base_seed`` comes from the main process's seeded generator.
    """
    base_seed = torch.initial_seed() - worker_id
    seeds = _seed_sequence(base_seed, worker_id, rank, count=4)
    torch.manual_seed(seeds[0])
    random.seed((seeds[1] << 32) | seeds[2])
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with the torch extra
        return
    np.random.seed(np.random.SeedSequence([base_seed, worker_id, rank]).generate_state(4))


def add_worker_init_fn(loader: Any, rank: int) -> None:
    """After ``seed_everything(..., workers=True)``: give ``loader`` a seeding
    ``worker_init_fn`` unless it has one (a user's own always wins)."""
    if os.environ.get(WORKERS_VAR) != "1" or not hasattr(loader, "worker_init_fn"):
        return
    if loader.worker_init_fn is None:
        loader.worker_init_fn = partial(worker_init_function, rank=rank)
