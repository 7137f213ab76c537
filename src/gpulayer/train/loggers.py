"""Where metrics go once they reach the host: CSV and TensorBoard.

Loggers see plain floats only, every ``log_every_n_steps`` optimizer steps and
at the end of each epoch, and only on global rank 0.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpulayer.train.checkpoint import _fsync_dir
from gpulayer.train.errors import TrainerError


class Logger(ABC):
    """Receives host-side metric values."""

    def __init__(self, save_dir: str | Path | None = None) -> None:
        self._save_dir = Path(save_dir) if save_dir is not None else None

    def setup(self, run_dir: Path) -> None:
        """Called once by the Trainer, on rank 0, with the run's directory."""
        if self._save_dir is None:
            self._save_dir = run_dir

    @property
    def log_dir(self) -> Path:
        if self._save_dir is None:
            raise TrainerError(f"{type(self).__name__} has no directory until fit() starts")
        return self._save_dir

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:  # noqa: B027 - optional
        """Record the run's hyperparameters (default: ignore them)."""

    def finalize(self) -> None:  # noqa: B027 - optional
        """Flush and close; called when fit/validate ends."""


class CSVLogger(Logger):
    """Rows of ``step, epoch, <metrics...>`` in ``<run dir>/metrics.csv``.

    A metric that first appears late widens the header; the file is then
    rewritten whole (rarely: once per new metric name).
    """

    def __init__(self, save_dir: str | Path | None = None, filename: str = "metrics.csv") -> None:
        super().__init__(save_dir)
        self.filename = filename
        self._rows: list[dict[str, float]] = []
        self._header: list[str] = []
        self._written = 0

    @property
    def path(self) -> Path:
        return self.log_dir / self.filename

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": float(step), **metrics}
        self._rows.append(row)
        new = [k for k in row if k not in self._header]
        if new:
            self._header.extend(new)
            self._rewrite()
        else:
            self._append(self._rows[self._written :])

    def _format(self, rows: list[dict[str, float]]) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self._header, lineterminator="\n")
        for row in rows:
            writer.writerow({k: _cell(k, v) for k, v in row.items()})
        return buf.getvalue()

    def _rewrite(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.filename}.tmp")
        tmp.write_text(",".join(self._header) + "\n" + self._format(self._rows))
        tmp.replace(self.path)
        self._written = len(self._rows)

    def _append(self, rows: list[dict[str, float]]) -> None:
        with self.path.open("a") as f:
            f.write(self._format(rows))
        self._written = len(self._rows)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        if params:
            path = self.log_dir / "hparams.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(params), indent=2, default=repr) + "\n")

    def finalize(self) -> None:
        if self._save_dir is not None and self.path.exists():
            _fsync_dir(self.path.parent)


def _cell(key: str, value: float) -> float | int:
    return int(value) if key in ("step", "epoch") else value


class TensorBoardLogger(Logger):
    """Scalars for TensorBoard in ``<run dir>/tensorboard`` (needs ``tensorboard``)."""

    def __init__(self, save_dir: str | Path | None = None) -> None:
        if importlib.util.find_spec("tensorboard") is None:
            raise TrainerError(
                "TensorBoardLogger needs the tensorboard package, which is not "
                "installed; run `pip install tensorboard`, or use CSVLogger"
            )
        super().__init__(save_dir)
        self._writer: Any = None

    def setup(self, run_dir: Path) -> None:
        if self._save_dir is None:
            self._save_dir = run_dir / "tensorboard"

    @property
    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            if key != "epoch":
                self.writer.add_scalar(key, value, global_step=step)

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        if params:
            text = json.dumps(dict(params), indent=2, default=repr)
            self.writer.add_text("hparams", f"```\n{text}\n```")

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
