"""Where metrics go once they reach the host: CSV and TensorBoard.

Loggers see plain floats only, every ``log_every_n_steps`` optimizer steps and
at the end of each epoch, and only on global rank 0.

Directories follow Lightning: a logger given a ``save_dir`` writes in
``save_dir/name/version_N`` (``name`` defaults to ``"lightning_logs"``;
``version`` to the next free N). A logger without one (the Trainer's default
``logger=True``) writes in the Trainer's run directory instead.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpulayer.train.checkpoint import _fsync_dir
from gpulayer.train.errors import TrainerError

__all__ = ["CSVLogger", "ExperimentWriter", "Logger", "TensorBoardLogger"]

DEFAULT_NAME = "lightning_logs"
#: What TensorBoardLogger passes on to torch's SummaryWriter (the rest is refused).
SUMMARY_WRITER_ARGS = ("comment", "purge_step", "max_queue", "flush_secs", "filename_suffix")
#: Lightning's loggers that GPUlayer does not provide, and what to do instead.
NOT_PROVIDED = {
    "WandbLogger": "Weights & Biases",
    "MLFlowLogger": "MLflow",
    "CometLogger": "Comet",
    "NeptuneLogger": "Neptune",
    "LitLogger": "Lightning's cloud",
}


def _plain_name(what: str, value: str) -> str:
    # A name becomes one directory under save_dir: nothing that climbs out of it
    # or nests (a user-supplied "../x" must not write elsewhere).
    if (
        not value
        or value in (".", "..")
        or re.search(r"[/\\\x00]", value)
        or value != value.strip()
    ):
        raise TrainerError(
            f"{what}={value!r} must be a plain directory name (no '/', '\\\\', '..' or "
            f"surrounding spaces)"
        )
    return value


def _version_dir(version: int | str) -> str:
    return f"version_{version}" if isinstance(version, int) else version


def _next_version(root: Path) -> int:
    taken = [
        int(m.group(1))
        for p in (root.iterdir() if root.is_dir() else ())
        if p.is_dir() and (m := re.fullmatch(r"version_(\d+)", p.name))
    ]
    return max(taken, default=-1) + 1


def _params_dict(params: Mapping[str, Any] | argparse.Namespace) -> dict[str, Any]:
    if isinstance(params, argparse.Namespace):
        return vars(params)
    if isinstance(params, Mapping):
        return dict(params)
    raise TrainerError(
        f"log_hyperparams() got {type(params).__name__}; pass a dict or an argparse.Namespace"
    )


class Logger(ABC):
    """Receives host-side metric values. Subclass it for a tracker of your own:
    define ``log_metrics``; ``log_hyperparams``, ``save`` and ``finalize`` are
    optional."""

    def __init__(
        self,
        save_dir: str | Path | None = None,
        name: str | None = DEFAULT_NAME,
        version: int | str | None = None,
        prefix: str = "",
    ) -> None:
        if name is not None and name != "":
            _plain_name("name", name)
        if isinstance(version, bool) or not (version is None or isinstance(version, int | str)):
            raise TrainerError(f"version={version!r} must be an int >= 0, a string or None")
        if isinstance(version, int) and version < 0:
            raise TrainerError(f"version={version!r} must be an int >= 0, a string or None")
        if isinstance(version, str):
            _plain_name("version", version)
        if not isinstance(prefix, str):
            raise TrainerError(f"prefix={prefix!r} must be a string")
        self._save_dir = Path(save_dir) if save_dir is not None else None
        self._name = name or ""
        self._version = version
        self._prefix = prefix
        self._run_dir: Path | None = None

    def setup(self, run_dir: Path) -> None:
        """Called once by the Trainer, on rank 0, with the run's directory."""
        self._run_dir = run_dir

    # ---- where it writes (Lightning's names) -------------------------------
    @property
    def name(self) -> str | None:
        return self._name

    @property
    def save_dir(self) -> Path | None:
        return self._save_dir

    @property
    def root_dir(self) -> Path | None:
        """``save_dir/name`` (``save_dir`` when the name is empty)."""
        if self._save_dir is None:
            return None
        return self._save_dir / self._name if self._name else self._save_dir

    @property
    def version(self) -> int | str | None:
        """The version given, else the next free ``version_N`` under ``root_dir``
        (decided on first use, then kept)."""
        root = self.root_dir
        if self._version is None and root is not None:
            self._version = _next_version(root)
        return self._version

    @property
    def own_dir(self) -> Path | None:
        """The directory this logger chose itself, or None when it writes in the
        Trainer's run directory (no ``save_dir`` was given)."""
        root = self.root_dir
        version = self.version
        return root / _version_dir(version) if root is not None and version is not None else None

    @property
    def log_dir(self) -> Path:
        own = self.own_dir
        if own is not None:
            return own
        if self._run_dir is None:
            raise TrainerError(
                f"{type(self).__name__} without save_dir has no directory until fit() "
                f"starts; pass save_dir= to choose one"
            )
        return self._run_dir

    # ---- what it receives --------------------------------------------------
    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:  # noqa: B027 - optional
        """Record the run's hyperparameters (default: ignore them)."""

    def save(self) -> None:  # noqa: B027 - optional
        """Write out what is buffered (default: nothing is)."""

    def finalize(self, status: str = "success") -> None:
        """Flush and close; called when fit/validate/test ends."""
        self.save()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:  # noqa: B027 - optional
        """Called after a ModelCheckpoint wrote a file (default: nothing)."""

    def _prefixed(self, metrics: Mapping[str, float]) -> dict[str, float]:
        if not self._prefix:
            return dict(metrics)
        return {f"{self._prefix}-{k}": v for k, v in metrics.items()}


class ExperimentWriter:
    """What ``CSVLogger.experiment`` is, as in Lightning: rows of ``step`` and
    metrics, written to ``metrics.csv`` by :meth:`save`.

    A metric that first appears late widens the header; the file is then
    rewritten whole (atomically, and rarely: once per new metric name).
    """

    def __init__(self, log_dir: Path, filename: str = "metrics.csv") -> None:
        self.log_dir = log_dir
        self.metrics_file_path = log_dir / filename
        self.metrics: list[dict[str, float]] = []
        self.hparams: dict[str, Any] = {}
        self._header: list[str] = []
        self._written = 0
        self._rewrite_needed = False

    def log_metrics(self, metrics_dict: Mapping[str, float], step: int | None = None) -> None:
        """Buffer one row; ``step`` defaults to the number of rows so far."""
        row = {"step": float(len(self.metrics) if step is None else step), **metrics_dict}
        self.metrics.append(row)
        new = [k for k in row if k not in self._header]
        if new:
            self._header.extend(new)
            self._rewrite_needed = True

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        self.hparams.update(params)
        path = self.log_dir / "hparams.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.hparams, indent=2, default=repr) + "\n")

    def save(self) -> None:
        """Write the rows not yet on disk."""
        if self._rewrite_needed:
            self.metrics_file_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.metrics_file_path.with_name(f".{self.metrics_file_path.name}.tmp")
            tmp.write_text(self._format_header() + self._format(self.metrics))
            tmp.replace(self.metrics_file_path)
            self._rewrite_needed = False
        elif self._written < len(self.metrics):
            with self.metrics_file_path.open("a") as f:
                f.write(self._format(self.metrics[self._written :]))
        self._written = len(self.metrics)

    def _format_header(self) -> str:
        # Quoted as the rows are: a metric name may hold commas, quotes or newlines.
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(self._header)
        return buf.getvalue()

    def _format(self, rows: list[dict[str, float]]) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self._header, lineterminator="\n")
        for row in rows:
            writer.writerow({k: _cell(k, v) for k, v in row.items()})
        return buf.getvalue()


def _cell(key: str, value: float) -> float | int:
    return int(value) if key in ("step", "epoch") and math.isfinite(value) else value


class CSVLogger(Logger):
    """Rows of ``step, epoch, <metrics...>`` in ``<log_dir>/metrics.csv``;
    hyperparameters in ``<log_dir>/hparams.json``.

    Rows reach the file every ``flush_logs_every_n_steps`` steps and when the
    run ends (as in Lightning).
    """

    def __init__(
        self,
        save_dir: str | Path | None = None,
        name: str | None = DEFAULT_NAME,
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        filename: str = "metrics.csv",
    ) -> None:
        super().__init__(save_dir, name, version, prefix)
        if (
            isinstance(flush_logs_every_n_steps, bool)
            or not isinstance(flush_logs_every_n_steps, int)
            or flush_logs_every_n_steps < 1
        ):
            raise TrainerError(
                f"flush_logs_every_n_steps={flush_logs_every_n_steps!r} must be an int >= 1"
            )
        self.flush_logs_every_n_steps = flush_logs_every_n_steps
        self.filename = _plain_name("filename", filename)
        self._experiment: ExperimentWriter | None = None

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._experiment = ExperimentWriter(self.log_dir, self.filename)
        return self._experiment

    @property
    def path(self) -> Path:
        return self.log_dir / self.filename

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.experiment.log_metrics(self._prefixed(metrics), step)
        if (step + 1) % self.flush_logs_every_n_steps == 0:
            self.save()

    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        values = _params_dict(params)
        if values:
            self.experiment.log_hparams(values)

    def save(self) -> None:
        if self._experiment is not None:
            self._experiment.save()

    def finalize(self, status: str = "success") -> None:
        self.save()
        if self._experiment is not None and self.path.exists():
            _fsync_dir(self.path.parent)


class TensorBoardLogger(Logger):
    """Scalars and hyperparameters for TensorBoard (needs ``tensorboard``).

    With ``save_dir``: event files in ``save_dir/name/version_N[/sub_dir]``;
    without: in ``<run dir>/tensorboard``. ``experiment`` is torch's
    ``SummaryWriter``.
    """

    def __init__(
        self,
        save_dir: str | Path | None = None,
        name: str | None = DEFAULT_NAME,
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        if importlib.util.find_spec("tensorboard") is None:
            raise TrainerError(
                "TensorBoardLogger needs the tensorboard package, which is not "
                "installed; run `pip install tensorboard`, or use CSVLogger"
            )
        if log_graph:
            raise TrainerError(
                "TensorBoardLogger(log_graph=True) is not supported: GPUlayer does not "
                "trace the model; use log_graph=False and call "
                "logger.experiment.add_graph(model, example_input) yourself"
            )
        unknown = sorted(set(kwargs) - set(SUMMARY_WRITER_ARGS))
        if unknown:
            raise TrainerError(
                f"TensorBoardLogger({', '.join(f'{k}=...' for k in unknown)}) is not "
                f"supported; valid SummaryWriter arguments: {', '.join(SUMMARY_WRITER_ARGS)}"
            )
        super().__init__(save_dir, name, version, prefix)
        self.sub_dir = _plain_name("sub_dir", sub_dir) if sub_dir is not None else None
        self.default_hp_metric = default_hp_metric
        self._writer_kwargs = kwargs
        self._writer: Any = None

    @property
    def log_dir(self) -> Path:
        own = self.own_dir
        if own is None:
            if self._run_dir is None:
                return super().log_dir  # explains what is missing
            own = self._run_dir / "tensorboard"
        return own / self.sub_dir if self.sub_dir else own

    @property
    def experiment(self) -> Any:
        """torch's ``SummaryWriter`` for this run (created on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), **self._writer_kwargs)
        return self._writer

    writer = experiment

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in self._prefixed(metrics).items():
            if key != "epoch":
                self.experiment.add_scalar(key, value, global_step=step)

    def log_hyperparams(
        self,
        params: Mapping[str, Any] | argparse.Namespace,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Write ``params`` to TensorBoard's HPARAMS tab (with ``hp_metric=-1``
        when ``default_hp_metric`` and no ``metrics``, as Lightning does)."""
        values = _params_dict(params)
        if not values:
            return
        from torch.utils.tensorboard.summary import hparams

        plain = {
            k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in values.items()
        }
        if metrics is None and self.default_hp_metric:
            metrics = {"hp_metric": -1.0}
        summaries = hparams(plain, dict(metrics or {}))  # type: ignore[no-untyped-call]
        writer = self.experiment._get_file_writer()
        for summary in summaries:
            writer.add_summary(summary)
        if metrics:
            self.log_metrics(metrics, 0)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def __getattr__(name: str) -> Any:
    # `from gpulayer.train.loggers import WandbLogger` in a ported script fails
    # here, naming the logger, rather than with a bare ImportError.
    if name in NOT_PROVIDED:
        raise TrainerError(
            f"{name} ({NOT_PROVIDED[name]}) is a Lightning logger GPUlayer does not "
            f"provide; use CSVLogger or TensorBoardLogger, or subclass "
            f"gpulayer.train.loggers.Logger (log_metrics, log_hyperparams) to send "
            f"metrics to your tracker"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
