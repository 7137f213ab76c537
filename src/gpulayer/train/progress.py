"""A progress display that never reads a device value.

Per batch it only counts (host integers). Metric values shown are the ones
the loop already read every ``log_every_n_steps`` steps, so they can lag by
up to that many steps. On a terminal it redraws one line at most every
``refresh_s`` seconds; otherwise (a GPUlayer job's log, a file) it writes a
line each time new values arrive and at the end of each epoch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO


class ProgressBar:
    def __init__(self, stream: TextIO | None = None, refresh_s: float = 0.1) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.refresh_s = refresh_s
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.metrics: dict[str, float] = {}
        self._label = ""
        self._total: int | None = None
        self._done = 0
        self._started = 0.0
        self._drawn = 0.0

    def start(self, label: str, total: int | None) -> None:
        self._label = label
        self._total = total
        self._done = 0
        self._started = self._drawn = time.monotonic()

    def advance(self) -> None:
        self._done += 1
        if self.interactive:
            now = time.monotonic()
            if now - self._drawn >= self.refresh_s:
                self._drawn = now
                self._write("\r" + self._line(now), end="")

    def show(self, metrics: Mapping[str, float]) -> None:
        """New values were read to the host: display them."""
        self.metrics.update(metrics)
        if not self.interactive:
            self._write(self._line(time.monotonic()))

    def finish(self, metrics: Mapping[str, float] | None = None) -> None:
        if metrics:
            self.metrics.update(metrics)
        line = self._line(time.monotonic())
        self._write("\r" + line if self.interactive else line)

    def _line(self, now: float) -> str:
        total = f"/{self._total}" if self._total is not None else ""
        elapsed = now - self._started
        rate = f"{self._done / elapsed:.1f} it/s" if elapsed > 0 else "-"
        values = " ".join(f"{k}={v:.4g}" for k, v in self.metrics.items())
        return f"{self._label} {self._done}{total} [{elapsed:.1f}s, {rate}] {values}".rstrip()

    def _write(self, text: str, end: str = "\n") -> None:
        self.stream.write(text + end)
        self.stream.flush()
