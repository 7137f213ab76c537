"""The Trainer: configuration, set-up, and the public ``fit``/``validate`` calls.

The loops themselves live in :mod:`gpulayer.train.fit`; what a checkpoint holds
and how it is put back lives in :mod:`gpulayer.train.state`.

A ``fit`` call, step by step:

1. read the rank layout from the environment (``RANK``, ``WORLD_SIZE``...),
   pick the device, join the process group when there are several ranks;
2. seed (``seed=``), choose the run directory ``<default_root_dir>/<run>``
   (rank 0 decides, the others are told), move the module to the device;
3. build the optimizer, restore a checkpoint if ``ckpt_path`` names one,
   wrap the module in DDP when distributed, shard the data;
4. run epochs until ``max_epochs``, ``max_steps`` or ``should_stop``;
5. write ``last.ckpt`` (the default ModelCheckpoint) and close the loggers.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from gpulayer.train import distributed
from gpulayer.train.accelerator import resolve_device, select_accelerator
from gpulayer.train.callbacks import Callback, EarlyStopping
from gpulayer.train.checkpoint import atomic_save, load_checkpoint
from gpulayer.train.config import (
    check_validation_step,
    count_setting,
    default_callbacks,
    default_loggers,
    next_version,
    resolve_ckpt_path,
)
from gpulayer.train.data import check_reiterable, shard
from gpulayer.train.environment import ClusterEnvironment, detect_environment
from gpulayer.train.errors import TrainerError, invalid_choice
from gpulayer.train.fit import Run, fit_loop, validation_loop
from gpulayer.train.loggers import Logger
from gpulayer.train.logging import to_host
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module
from gpulayer.train.optim import parse_optimizers
from gpulayer.train.precision import make_precision, parse_precision
from gpulayer.train.progress import ProgressBar
from gpulayer.train.seed import seed_everything
from gpulayer.train.state import (
    dump_checkpoint,
    restore_callbacks,
    restore_checkpoint,
    weights_only_checkpoint,
)

STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_true")
CLIP_ALGORITHMS = ("norm", "value")
#: Lightning's default when neither max_epochs nor max_steps is given.
DEFAULT_MAX_EPOCHS = 1000
DEFAULT_ROOT_DIR = "gpulayer_runs"


class Trainer:
    """Runs a :class:`Module`'s training and validation steps.

    Arguments follow Lightning's ``Trainer`` (see ``docs/trainer.md`` for
    what differs). Settings are checked here; the environment (ranks,
    devices) is read when ``fit`` or ``validate`` starts.
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        devices: int | str | Sequence[int] = "auto",
        strategy: str = "auto",
        precision: str | int = "32",
        max_epochs: int | None = None,
        max_steps: int = -1,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        log_every_n_steps: int = 50,
        check_val_every_n_epoch: int = 1,
        limit_train_batches: int | None = None,
        limit_val_batches: int | None = None,
        callbacks: Iterable[Callback] | Callback | None = None,
        logger: bool | Logger | Iterable[Logger] = True,
        enable_checkpointing: bool = True,
        enable_progress_bar: bool = True,
        default_root_dir: str | Path = DEFAULT_ROOT_DIR,
        run_name: str | None = None,
        seed: int | None = None,
    ) -> None:
        self._accelerator = select_accelerator(accelerator)
        self._devices = devices
        if strategy not in STRATEGIES:
            raise invalid_choice("strategy", strategy, STRATEGIES)
        self.strategy = strategy
        self.precision = parse_precision(precision)
        if max_epochs is None and max_steps == -1:
            max_epochs = DEFAULT_MAX_EPOCHS
        self.max_epochs: int = (
            -1 if max_epochs is None else count_setting("max_epochs", max_epochs, -1)
        )
        self.max_steps: int = count_setting("max_steps", max_steps, -1)
        self.accumulate_grad_batches: int = count_setting(
            "accumulate_grad_batches", accumulate_grad_batches, 1
        )
        if gradient_clip_val is not None and not (
            isinstance(gradient_clip_val, int | float) and gradient_clip_val >= 0
        ):
            raise TrainerError(
                f"gradient_clip_val={gradient_clip_val!r} must be a number >= 0 or None"
            )
        self.gradient_clip_val = float(gradient_clip_val) if gradient_clip_val else None
        if gradient_clip_algorithm not in CLIP_ALGORITHMS:
            raise invalid_choice(
                "gradient_clip_algorithm", gradient_clip_algorithm, CLIP_ALGORITHMS
            )
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.log_every_n_steps: int = count_setting("log_every_n_steps", log_every_n_steps, 1)
        self.check_val_every_n_epoch: int = count_setting(
            "check_val_every_n_epoch", check_val_every_n_epoch, 1
        )
        self.limit_train_batches = count_setting(
            "limit_train_batches", limit_train_batches, 0, optional=True
        )
        self.limit_val_batches = count_setting(
            "limit_val_batches", limit_val_batches, 0, optional=True
        )
        self.callbacks = default_callbacks(callbacks, enable_checkpointing)
        self.loggers = default_loggers(logger)
        self.enable_progress_bar = enable_progress_bar
        self.default_root_dir = Path(default_root_dir)
        if run_name is not None and (not run_name or "/" in run_name or run_name in (".", "..")):
            raise TrainerError(f"run_name={run_name!r} must be a plain directory name")
        self.run_name = run_name
        self.seed = seed

        self.global_step = 0
        self.current_epoch = 0
        self.should_stop = False
        self.fitting = False
        self.validating_in_fit = False
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self._env: ClusterEnvironment | None = None
        self._run: Run | None = None
        self._log_dir: Path | None = None
        # Loop position, for checkpoints: see gpulayer.train.state.
        self._epoch_finished = False
        self._batches_done = 0
        self._epoch_rng: dict[str, Any] | None = None
        self._stepped = True

    # ---- where this process is -------------------------------------------
    @property
    def environment(self) -> ClusterEnvironment:
        if self._env is None:
            self._env = detect_environment(os.environ)
        return self._env

    @property
    def global_rank(self) -> int:
        return self.environment.global_rank

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank

    @property
    def world_size(self) -> int:
        return self.environment.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def device(self) -> torch.device | None:
        return self._run.device if self._run is not None else None

    @property
    def log_dir(self) -> Path:
        """``<default_root_dir>/<run_name or version_N>``: metrics and checkpoints."""
        if self._log_dir is None:
            return self.default_root_dir / (
                self.run_name or f"version_{next_version(self.default_root_dir)}"
            )
        return self._log_dir

    # ---- what is being trained ---------------------------------------------
    @property
    def lightning_module(self) -> Module | None:
        return self._run.module if self._run is not None else None

    module = lightning_module

    @property
    def model(self) -> torch.nn.Module | None:
        """The module as the loop calls it: the DDP wrapper when distributed."""
        if self._run is None:
            return None
        return self._run.ddp if self._run.ddp is not None else self._run.module

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        run = self._run
        return [run.optimizer] if run is not None and run.optimizer is not None else []

    @property
    def lr_schedulers(self) -> list[Any]:
        return [c.scheduler for c in self._run.schedulers] if self._run is not None else []

    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        found = self.checkpoint_callbacks
        return found[0] if found else None

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        return next((cb for cb in self.callbacks if isinstance(cb, EarlyStopping)), None)

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def max_steps_reached(self) -> bool:
        return 0 <= self.max_steps <= self.global_step

    @property
    def at_step_boundary(self) -> bool:
        """True when no gradients are waiting to be accumulated into a step."""
        return self._stepped

    # ---- the calls ---------------------------------------------------------
    def fit(
        self,
        model: Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        """Train ``model``; resume from ``ckpt_path`` (a file, or ``"last"``)."""
        run = self._setup(model)
        train = train_dataloaders if train_dataloaders is not None else model.train_dataloader()
        if train is None:
            raise TrainerError(
                "fit() needs training data: pass train_dataloaders=... or define "
                f"{type(model).__name__}.train_dataloader()"
            )
        val = val_dataloaders if val_dataloaders is not None else model.val_dataloader()
        check_reiterable(train, "train_dataloaders")
        check_reiterable(val, "val_dataloaders")
        if val is not None:
            check_validation_step(model)
        seed = self.seed or 0
        run.train_data = shard(train, run.env, shuffle=True, seed=seed)
        run.val_data = shard(val, run.env, shuffle=False, seed=seed) if val is not None else None
        run.optimizer, run.schedulers = parse_optimizers(model.configure_optimizers())
        path = resolve_ckpt_path(ckpt_path, self.default_root_dir, self.checkpoint_callbacks)
        checkpoint = load_checkpoint(path, map_location="cpu") if path is not None else None
        if checkpoint is not None:
            restore_checkpoint(self, run, checkpoint)
        if run.env.distributed:
            find_unused = self.strategy == "ddp_find_unused_parameters_true"
            run.ddp = distributed.wrap_ddp(model, run.device, find_unused)
        run.optimizer.zero_grad(set_to_none=True)
        self.should_stop = False
        self.fitting = True
        distributed.finished_cleanly(False)
        self.validating_in_fit = run.val_data is not None
        try:
            for cb in run.callbacks:
                cb.on_fit_start(self, model)
            model.on_fit_start()
            if checkpoint is not None:
                restore_callbacks(self, checkpoint)
            self._start_loggers(model)
            fit_loop(self, run)
            model.on_fit_end()
            for cb in run.callbacks:
                cb.on_fit_end(self, model)
            distributed.finished_cleanly(True)
        finally:
            self.fitting = self.validating_in_fit = False
            model._attach(self)
            for logger in self.loggers:
                logger.finalize()

    def validate(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
    ) -> list[dict[str, float]]:
        """Run the validation data once; returns ``[metrics]`` as Lightning does."""
        model = model if model is not None else self.lightning_module
        if model is None:
            raise TrainerError("validate() needs a model: validate(model, dataloaders)")
        data = dataloaders if dataloaders is not None else model.val_dataloader()
        if data is None:
            raise TrainerError(
                "validate() needs data: pass dataloaders=... or define "
                f"{type(model).__name__}.val_dataloader()"
            )
        check_reiterable(data, "dataloaders")
        check_validation_step(model)
        run = self._setup(model)
        run.val_data = shard(data, run.env, shuffle=False, seed=self.seed or 0)
        path = resolve_ckpt_path(ckpt_path, self.default_root_dir, self.checkpoint_callbacks)
        if path is not None:
            model.load_state_dict(load_checkpoint(path, map_location="cpu")["state_dict"])
        distributed.finished_cleanly(False)
        try:
            self._start_loggers(model)
            metrics = validation_loop(self, run)
            if self.is_global_zero:
                logged = {
                    k: v for k, v in metrics.items() if k in run.val_store.keys_where("logger")
                }
                for logger in self.loggers:
                    logger.log_metrics(logged, self.global_step)
                if verbose:
                    for key, value in metrics.items():
                        print(f"{key}: {value:.6g}")
            distributed.finished_cleanly(True)
        finally:
            model._attach(self)
            for logger in self.loggers:
                logger.finalize()
        return [metrics]

    def save_checkpoint(self, path: str | Path, weights_only: bool = False) -> None:
        """Write a checkpoint atomically (global rank 0 only; others return)."""
        if self._run is None:
            raise TrainerError("save_checkpoint() needs a model: call fit() first")
        if not self.is_global_zero:
            return
        if weights_only:
            atomic_save(weights_only_checkpoint(self, self._run), path)
        else:
            atomic_save(dump_checkpoint(self, self._run), path)

    def refresh_metrics(self) -> dict[str, float]:
        """Read the latest per-step values now (one host transfer) into callback_metrics."""
        if self._run is not None:
            self.callback_metrics.update(to_host(self._run.train_store.step_values()))
        return self.callback_metrics

    # ---- set-up ------------------------------------------------------------
    def _setup(self, model: Module) -> Run:
        if not isinstance(model, Module):
            raise TrainerError(
                f"the model must be a gpulayer.train.Module; got {type(model).__name__}"
            )
        env = self._env = detect_environment(os.environ)
        device = resolve_device(self._accelerator, self._devices, env)
        self._accelerator.setup_device(device)
        if env.distributed:
            distributed.init_process_group(env, self._accelerator)
        if self.seed is not None:
            seed_everything(self.seed)
        self._log_dir = self._choose_log_dir(env)
        model.to(device)
        model._attach(self)
        show = self.enable_progress_bar and env.global_rank == 0
        self._run = Run(
            module=model,
            device=device,
            precision=make_precision(self.precision, device),
            env=env,
            callbacks=self.callbacks,
            progress=ProgressBar() if show else None,
        )
        return self._run

    def _choose_log_dir(self, env: ClusterEnvironment) -> Path:
        if self._log_dir is not None:
            return self._log_dir
        name = self.run_name
        if name is None:
            name = f"version_{next_version(self.default_root_dir)}" if env.global_rank == 0 else ""
            if env.distributed:
                name = distributed.broadcast_object(name)
        return self.default_root_dir / name

    def _start_loggers(self, model: Module) -> None:
        if self.is_global_zero:
            for logger in self.loggers:
                logger.setup(self.log_dir)
                logger.log_hyperparams(model.hparams)
