"""Warm start: a task's script forked from a Python that is ready.

Where a short job's time goes is the interpreter and PyTorch: 15 ms for
``python -c pass`` and a second or two for ``import torch`` on a small
machine, per rank. A worker keeps a *zygote* (``zygote.py``): its own
Python, started once, that has imported the preload set (``torch`` and
``numpy`` when importable) and waits. A script task, or a rank under the
direct launcher, then starts as a fork of it that becomes what a cold
``python script.py`` would be (see ``zygote.py`` for what is put right in
the child: session, descriptors, user, directory, environment, argv, path,
``__main__``, signals, exit). A script that evidently imports only the
standard library forks from a *light* zygote instead, which imported
nothing: a small process, faster to fork and to end (see WarmStarts).

What cannot be put right after the fork is what the preloaded modules read
as they were imported: thread counts (``OMP_NUM_THREADS``, read by libgomp
as it loads), allocators, the locale, every ``PYTHON*`` setting. A zygote is
made for one set of those values (its *key*); a task whose values differ
starts from the zygote made for them, or cold while that one starts (a few
are kept: the worker's own settings, and its ranks' ``OMP_NUM_THREADS=1``).

A task also starts cold, and its record says why, when its script's folder
or its ``PYTHONPATH`` holds a module of a name the zygote has imported (a
cold start would import that one instead), when the zygote is not ready
yet, or could not be made single-threaded (a fork copies one thread), or has
died (it is made again). See docs/adr/0023-warm-start.md.
"""

from __future__ import annotations

# The package's modules, by concept: keys (what a zygote is made for),
# light (which scripts fork from the light zygote), process (a task's
# forked process, and the primed ones), handle (one zygote process),
# starts (a worker's zygotes, and the choice for each task). A constant is
# read in the module that defines it or imports it by name: a test that
# patches one patches it there (see tests/warm/test_warm_start.py).
from .. import zygote as protocol
from .handle import ZYGOTE, Zygote
from .keys import Key, key_of, read_at_start
from .light import LIGHT_SCRIPT_MAX_BYTES, LIGHT_SCRIPT_MAX_IMPORTS, imports_only
from .process import FORK_TIMEOUT_S, REPORT_WAIT_S, Primed, WarmProcess, WarmUnavailable
from .starts import (
    DEFAULT_PRELOAD,
    MAX_LIGHT,
    MAX_REMAKES,
    MAX_ZYGOTES,
    PRELOAD_ENV,
    RANK_SETTINGS,
    READY_TIMEOUT_S,
    STARTED_TIMEOUT_S,
    WARM_ENV,
    WARM_MODES,
    Slot,
    WarmStarts,
    from_environment,
    supported,
)

__all__ = [
    "DEFAULT_PRELOAD",
    "FORK_TIMEOUT_S",
    "LIGHT_SCRIPT_MAX_BYTES",
    "LIGHT_SCRIPT_MAX_IMPORTS",
    "MAX_LIGHT",
    "MAX_REMAKES",
    "MAX_ZYGOTES",
    "PRELOAD_ENV",
    "RANK_SETTINGS",
    "READY_TIMEOUT_S",
    "REPORT_WAIT_S",
    "STARTED_TIMEOUT_S",
    "WARM_ENV",
    "WARM_MODES",
    "ZYGOTE",
    "Key",
    "Primed",
    "Slot",
    "WarmProcess",
    "WarmStarts",
    "WarmUnavailable",
    "Zygote",
    "from_environment",
    "imports_only",
    "key_of",
    "protocol",
    "read_at_start",
    "supported",
]
