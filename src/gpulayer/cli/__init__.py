"""The ``gpulayer`` command: a thin layer over :class:`gpulayer.Client`.

One module per verb (or group of verbs on one thing); each adds its
commands to the ``main`` group of ``root.py`` when imported here.
"""

from __future__ import annotations

from . import (
    actions,
    dashboard,
    jobs,
    maintenance,
    projects,
    run,
    server,
    tokens,
    usage,
    worker,
    workers,
)
from .root import _main, main
from .run import EXIT_CODES

__all__ = [
    "EXIT_CODES",
    "_main",
    "actions",
    "dashboard",
    "jobs",
    "main",
    "maintenance",
    "projects",
    "run",
    "server",
    "tokens",
    "usage",
    "worker",
    "workers",
]
