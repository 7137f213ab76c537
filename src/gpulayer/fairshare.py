"""Each project's recent usage, for fair share (scheduler rule 8), and what
its running jobs hold now, for quotas (rule 7). Pure bookkeeping, no I/O.

Usage is weighted GPU-seconds (:func:`~gpulayer.scheduler.weight`) halved
every ``half_life`` seconds. It is kept exactly, without sampling: between
two events (a job of the project starting or ending) the project holds a
constant weight ``r``, and its usage ``u`` moves from time ``t0`` to ``t``
as::

    u(t) = u(t0) * d + r * tau * (1 - d),   d = 2 ** (-(t - t0) / half_life)

where ``tau = half_life / ln 2``: the integral of the decayed weight. Each
event folds the usage up to its time and changes ``r``, so reading a
project's usage costs the same however many jobs it runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .scheduler import weight


class Accounts:
    """Usage and holdings of every project (the control plane's; not
    thread-safe, it calls it under its lock)."""

    def __init__(
        self, half_life: float, saved: Mapping[str, tuple[float, float]] | None = None
    ) -> None:
        """``saved``: project -> (usage, when), as last stored."""
        if not half_life > 0:
            raise ValueError(f"the fair-share half-life must be positive, not {half_life!r}")
        self.half_life = half_life
        self._tau = half_life / math.log(2)
        self._usage: dict[str, tuple[float, float]] = dict(saved or {})
        self._rate: dict[str, float] = {}
        self.held: dict[str, tuple[int, int]] = {}  # project -> (GPUs, CPU slots)

    def _at(self, project: str, now: float) -> float:
        usage, when = self._usage.get(project, (0.0, now))
        rate = self._rate.get(project, 0.0)
        if now <= when:
            return usage
        d = math.exp(-(now - when) / self._tau)
        return usage * d + rate * self._tau * (1.0 - d)

    def _fold(self, project: str, now: float) -> None:
        _, when = self._usage.get(project, (0.0, now))
        self._usage[project] = (self._at(project, now), max(now, when))

    def start(self, project: str, demand: tuple[int, int], now: float) -> None:
        """A job of ``project`` holding ``demand`` (GPUs, CPU slots) started."""
        self._fold(project, now)
        self._rate[project] = self._rate.get(project, 0.0) + weight(*demand)
        gpus, slots = self.held.get(project, (0, 0))
        self.held[project] = (gpus + demand[0], slots + demand[1])

    def stop(self, project: str, demand: tuple[int, int], now: float) -> None:
        """A job of ``project`` holding ``demand`` let go of it."""
        self._fold(project, now)
        rate = self._rate.get(project, 0.0) - weight(*demand)
        gpus, slots = self.held.get(project, (0, 0))
        gpus, slots = max(0, gpus - demand[0]), max(0, slots - demand[1])
        if gpus or slots:
            self._rate[project] = max(0.0, rate)
            self.held[project] = (gpus, slots)
        else:  # nothing held: no rounding left over to accrue
            self._rate.pop(project, None)
            self.held.pop(project, None)

    def usage(self, now: float) -> dict[str, float]:
        """Every project's usage now."""
        return {project: self._at(project, now) for project in self._usage}

    def saved(self, now: float) -> dict[str, tuple[float, float]]:
        """What to store: project -> (usage, when), folded up to ``now``."""
        for project in list(self._usage):
            self._fold(project, now)
        return dict(self._usage)


__all__ = ["Accounts"]
