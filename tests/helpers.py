"""Small helpers shared by tests (importable thanks to pytest's pythonpath)."""

from __future__ import annotations

import os
import sys

PY = sys.executable


def pids_alive(*pids: int) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A zombie is dead for our purposes.
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    continue
        except FileNotFoundError:
            continue
        alive.append(pid)
    return alive
