"""The Trainer: configuration, set-up, and the public ``fit``/``validate``/
``test``/``predict`` calls.

The training loop lives in :mod:`gpulayer.train.fit`, the evaluation loops in
:mod:`gpulayer.train.evaluate`; what a checkpoint holds and how it is put
back lives in :mod:`gpulayer.train.state`.

A call, step by step (``stage`` is "fit", "validate", "test" or "predict"):

1. refuse hooks the Trainer would not call; read the rank layout from the
   environment (``RANK``, ``WORLD_SIZE``...), pick the device, join the
   process group when there are several ranks;
2. seed (``seed=``), choose the run directory ``<default_root_dir>/<run>``
   (rank 0 decides, the others are told);
3. ``prepare_data`` on local rank 0 (datamodule's, then module's; the other
   ranks wait), then ``setup(stage)`` on every rank (datamodule, callbacks,
   module), ``configure_model``, and the module moves to the device;
4. fit: build the optimizers, restore a checkpoint if ``ckpt_path`` names
   one, wrap the module in DDP when distributed, ``on_fit_start``, the
   sanity check, then epochs until ``max_epochs``, ``max_steps`` or
   ``should_stop``; the other stages run their loop once;
5. ``teardown(stage)`` (datamodule, callbacks, module), the profiler's report
   (see :mod:`gpulayer.train.profilers`); the loggers close.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gpulayer.train import distributed, preemption
from gpulayer.train.accelerator import resolve_device, select_accelerator
from gpulayer.train.callbacks import Callback, EarlyStopping
from gpulayer.train.checkpoint import atomic_save, load_checkpoint
from gpulayer.train.config import (
    check_validation_step,
    count_setting,
    default_callbacks,
    default_loggers,
    defaults_from_env,
    fast_dev_run_setting,
    limit_setting,
    next_version,
    refuse_unsupported,
    resolve_ckpt_path,
    set_torch_flags,
    val_check_setting,
)
from gpulayer.train.data import check_reiterable, combine_loaders
from gpulayer.train.datamodule import LOADERS, LightningDataModule, check_datamodule, defines
from gpulayer.train.environment import ClusterEnvironment, detect_environment
from gpulayer.train.errors import CheckpointError, TrainerError, invalid_choice
from gpulayer.train.evaluate import call_callbacks, run_evaluation, run_prediction, sanity_check
from gpulayer.train.fit import (
    LoopPosition,
    ManualOptimizer,
    Run,
    backward,
    ensure_val_data,
    fit_loop,
    make_transfer,
)
from gpulayer.train.loggers import Logger
from gpulayer.train.logging import to_host
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import (
    LIGHTNING_CHECKPOINT_HOOKS,
    LIGHTNING_DATA_HOOKS,
    LIGHTNING_LOOP_METHODS,
    LIGHTNING_MODEL_HOOKS,
    Module,
    refuse_uncalled_hooks,
)
from gpulayer.train.optim import parse_optimizers
from gpulayer.train.precision import make_precision, parse_precision
from gpulayer.train.profilers import (
    Profiler,
    action_name,
    active,
    attach,
    make_profiler,
    timed,
    timed_hook,
    timed_step,
)
from gpulayer.train.progress import ProgressBar
from gpulayer.train.seed import seed_everything
from gpulayer.train.state import (
    check_resumable,
    dump_checkpoint,
    restore_modules,
    restore_training_state,
)

STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_true")
CLIP_ALGORITHMS = ("norm", "value")
#: Lightning's default when neither max_epochs nor max_steps is given.
DEFAULT_MAX_EPOCHS = 1000
DEFAULT_ROOT_DIR = "gpulayer_runs"
#: Lightning's default number of validation batches run before training.
DEFAULT_SANITY_STEPS = 2
#: prepare_data may download for hours: the other ranks wait this long for it.
PREPARE_DATA_TIMEOUT = timedelta(days=7)
_MODULE_HOOKS = (
    LIGHTNING_MODEL_HOOKS + LIGHTNING_DATA_HOOKS + LIGHTNING_CHECKPOINT_HOOKS
) + LIGHTNING_LOOP_METHODS

T = TypeVar("T")


def _wait_for_all_ranks(timeout: timedelta) -> None:
    """A barrier with its own gloo group, so that its timeout (not the job's
    collective timeout, nor NCCL's watchdog) bounds the wait, as Lightning's."""
    group = dist.new_group(backend="gloo", timeout=timeout)
    try:
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group(group)


@contextlib.contextmanager
def _not_this_run(guard: preemption.Preemption | None) -> Iterator[None]:
    """A preemption checkpoint that fit found (not one it was given) that
    does not fit this model or its optimizers (the script changed, or
    another run's file was found): an error naming the file and what to do,
    not a bare state_dict mismatch."""
    if guard is None:
        yield
        return
    try:
        yield
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"the preemption checkpoint {guard.path} does not fit this model or its "
            f"optimizers ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); it was "
            "written by another run: delete it to start over, or pass ckpt_path"
        ) from exc


class Trainer:
    """Runs a :class:`Module`'s training, validation, test and predict steps.

    Arguments follow Lightning's ``Trainer`` (see ``docs/trainer.md`` for
    what differs). Settings are checked here; the environment (ranks,
    devices) is read when a call starts. As in Lightning, a
    ``PL_TRAINER_<ARGUMENT>`` variable gives the default of an argument the
    code does not pass (see :func:`gpulayer.train.config.defaults_from_env`).
    """

    @defaults_from_env
    def __init__(
        self,
        *,
        accelerator: str = "auto",
        devices: int | str | Sequence[int] = "auto",
        strategy: str = "auto",
        num_nodes: int | None = None,
        precision: str | int | None = "32",
        max_epochs: int | None = None,
        max_steps: int = -1,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = "norm",
        log_every_n_steps: int | None = 50,
        check_val_every_n_epoch: int | None = 1,
        val_check_interval: int | float | None = None,
        num_sanity_val_steps: int | None = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        fast_dev_run: int | bool = False,
        callbacks: Iterable[Callback] | Callback | None = None,
        logger: bool | Logger | Iterable[Logger] = True,
        enable_checkpointing: bool | None = True,
        enable_progress_bar: bool | None = True,
        enable_model_summary: bool | None = None,
        default_root_dir: str | Path | None = DEFAULT_ROOT_DIR,
        run_name: str | None = None,
        seed: int | None = None,
        deterministic: bool | str | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        profiler: Profiler | str | None = None,
        **lightning_only: Any,
    ) -> None:
        refuse_unsupported(lightning_only, inspect.signature(Trainer.__init__).parameters)
        set_torch_flags(deterministic, benchmark)
        self._accelerator = select_accelerator(accelerator)
        self._devices = devices
        if strategy not in STRATEGIES:
            raise invalid_choice("strategy", strategy, STRATEGIES)
        self.strategy = strategy
        # None: as many as the launcher started (the environment says).
        self.num_nodes: int | None = count_setting("num_nodes", num_nodes, 1, optional=True)
        self.precision = parse_precision("32" if precision is None else precision)
        self.fast_dev_run = fast_dev_run_setting(fast_dev_run)
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
        # None, in each of these, is Lightning's way of saying "the default".
        if gradient_clip_algorithm is None:
            gradient_clip_algorithm = "norm"
        if log_every_n_steps is None:
            log_every_n_steps = 50
        if enable_checkpointing is None:
            enable_checkpointing = True
        if enable_progress_bar is None:
            enable_progress_bar = True
        if default_root_dir is None:
            default_root_dir = os.getcwd()
        if gradient_clip_algorithm not in CLIP_ALGORITHMS:
            raise invalid_choice(
                "gradient_clip_algorithm", gradient_clip_algorithm, CLIP_ALGORITHMS
            )
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.log_every_n_steps: int = count_setting("log_every_n_steps", log_every_n_steps, 1)
        self.check_val_every_n_epoch: int | None = count_setting(
            "check_val_every_n_epoch", check_val_every_n_epoch, 1, optional=True
        )
        self.val_check_interval = val_check_setting(val_check_interval)
        if self.check_val_every_n_epoch is None and not isinstance(self.val_check_interval, int):
            raise TrainerError(
                f"check_val_every_n_epoch=None counts training batches across epochs, so "
                f"val_check_interval must be an int; got {val_check_interval!r}"
            )
        self.num_sanity_val_steps: int = (
            DEFAULT_SANITY_STEPS
            if num_sanity_val_steps is None
            else count_setting("num_sanity_val_steps", num_sanity_val_steps, -1)
        )
        self.limit_train_batches = limit_setting("limit_train_batches", limit_train_batches)
        self.limit_val_batches = limit_setting("limit_val_batches", limit_val_batches)
        self.limit_test_batches = limit_setting("limit_test_batches", limit_test_batches)
        self.limit_predict_batches = limit_setting("limit_predict_batches", limit_predict_batches)
        if self.fast_dev_run:
            # As Lightning: n batches of each loop, one epoch, no sanity check,
            # and no checkpoints or logs.
            n = self.fast_dev_run
            self.limit_train_batches = self.limit_val_batches = n
            self.limit_test_batches = self.limit_predict_batches = n
            self.max_steps, self.max_epochs, self.num_sanity_val_steps = n, 1, 0
            self.val_check_interval, self.check_val_every_n_epoch = 1.0, 1
            logger = False
        self.callbacks = default_callbacks(
            callbacks, enable_checkpointing, add_default=not self.fast_dev_run
        )
        self.loggers = default_loggers(logger)
        self.enable_progress_bar = enable_progress_bar
        if enable_model_summary is not None and not isinstance(enable_model_summary, bool):
            raise TrainerError(
                f"enable_model_summary={enable_model_summary!r} must be True, False or None"
            )
        self.enable_model_summary = enable_model_summary is not False
        self.default_root_dir = Path(default_root_dir)
        if run_name is not None and (not run_name or "/" in run_name or run_name in (".", "..")):
            raise TrainerError(f"run_name={run_name!r} must be a plain directory name")
        self.run_name = run_name
        self.seed = seed
        #: ``with self.trainer.profiler.profile("name"):`` works in any case.
        self.profiler: Profiler = make_profiler(profiler)
        if not isinstance(inference_mode, bool):
            raise TrainerError(
                f"inference_mode={inference_mode!r} must be True (torch.inference_mode) or "
                f"False (torch.no_grad) for validate, test and predict"
            )
        self.inference_mode = inference_mode

        self.global_step = 0
        self.current_epoch = 0
        self.should_stop = False
        self.fitting = self.validating = self.testing = self.predicting = False
        self.sanity_checking = False
        self.validating_in_fit = False
        self.datamodule: LightningDataModule | None = None
        self.callback_metrics: dict[str, float] = {}
        self.logged_metrics: dict[str, float] = {}
        self.progress_bar_metrics: dict[str, float] = {}
        self._env: ClusterEnvironment | None = None
        self._run: Run | None = None
        self._log_dir: Path | None = None
        # Loop position, for checkpoints: see gpulayer.train.state.
        self._loop = LoopPosition()

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
        return list(self._run.optimizers) if self._run is not None else []

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
        return self._loop.stepped

    # ---- the calls ---------------------------------------------------------
    def fit(
        self,
        model: Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        """Train ``model``; resume from ``ckpt_path`` (a file, or ``"last"``)."""
        if isinstance(train_dataloaders, LightningDataModule):
            datamodule, train_dataloaders = train_dataloaders, None  # as Lightning
        if datamodule is not None and (
            train_dataloaders is not None or val_dataloaders is not None
        ):
            raise TrainerError(
                "fit() got both dataloaders and datamodule=...; pass one or the other"
            )
        self._check_call(model, datamodule)
        train = self._source("train", model, datamodule, train_dataloaders, "train_dataloaders")
        if train is None:
            raise TrainerError(
                "fit() needs training data: pass train_dataloaders=..., a datamodule, or "
                f"define {type(model).__name__}.train_dataloader()"
            )
        val = self._source("validate", model, datamodule, val_dataloaders, "val_dataloaders")
        if val is not None:
            check_validation_step(model)
        manual = not model.automatic_optimization
        if manual and self.accumulate_grad_batches != 1:
            raise TrainerError(
                f"accumulate_grad_batches={self.accumulate_grad_batches} does nothing under "
                f"manual optimization (automatic_optimization = False); leave it at 1 and "
                f"accumulate in training_step"
            )
        if manual and self.gradient_clip_val is not None:
            raise TrainerError(
                f"gradient_clip_val={self.gradient_clip_val} does nothing under manual "
                f"optimization; call torch.nn.utils.clip_grad_norm_ in training_step"
            )
        path = resolve_ckpt_path(
            ckpt_path, self.default_root_dir, self.checkpoint_callbacks, self.loggers
        )
        # A preemptible job: checkpoint on SIGTERM, resume on the next attempt.
        notice = preemption.notice_seconds(os.environ)
        guard = preemption.Preemption(self, notice, os.environ) if notice is not None else None

        def body(run: Run) -> None:
            run.train_source, run.val_source = train, val
            checkpoint = None
            found = False  # the preemption checkpoint, found rather than asked for
            if guard is not None:
                run.preempt = guard
                guard.attach(self, run)
            if path is not None:
                checkpoint = load_checkpoint(path, map_location="cpu")
            elif guard is not None and ckpt_path is None:
                # Any ckpt_path given wins, "last" finding nothing included.
                checkpoint = guard.find_checkpoint(self, run)
                found = checkpoint is not None
            if checkpoint is not None:
                # As Lightning: the module, datamodule and callbacks first, so that
                # on_load_checkpoint can reshape the model before the optimizers exist.
                check_resumable(checkpoint)
                with _not_this_run(guard if found else None):
                    restore_modules(self, run, checkpoint)
            run.optimizers, run.schedulers = parse_optimizers(
                timed_hook(run, "configure_optimizers")(), several=manual
            )
            run.manual = [ManualOptimizer(o, self, run) for o in run.optimizers]
            if checkpoint is not None:
                with _not_this_run(guard if found else None):
                    restore_training_state(self, run, checkpoint)
            if run.env.distributed:
                find_unused = self.strategy == "ddp_find_unused_parameters_true"
                run.ddp = distributed.wrap_ddp(model, run.device, find_unused)
            for optimizer in run.optimizers:
                optimizer.zero_grad(set_to_none=True)
            self.should_stop = False
            self.validating_in_fit = val is not None and self.limit_val_batches != 0
            call_callbacks(self, run, "on_fit_start")
            timed_hook(run, "on_fit_start")()
            self._start_loggers(model)
            self._print_summary(model)
            sanity = self.num_sanity_val_steps
            if sanity and checkpoint is None and self.validating_in_fit:
                sanity_check(self, run, sanity, lambda: ensure_val_data(self, run))
            fit_loop(self, run)
            if guard is not None:
                guard.after_loop(self, run)
            self._keep_last_step_values(run)
            call_callbacks(self, run, "on_fit_end")
            timed_hook(run, "on_fit_end")()

        if guard is None:
            self._call("fit", model, datamodule, body)
            return
        guard.install()
        normal = False
        try:
            self._call("fit", model, datamodule, body)
            guard.finished()
            normal = True
        finally:
            guard.close(normal=normal)

    def validate(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: LightningDataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run the validation data once; returns ``[metrics]`` as Lightning does."""
        return run_evaluation(self, "validate", model, dataloaders, ckpt_path, verbose, datamodule)

    def test(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: LightningDataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run the test data once; returns ``[metrics]`` (one dict per dataloader)."""
        return run_evaluation(self, "test", model, dataloaders, ckpt_path, verbose, datamodule)

    def predict(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        datamodule: LightningDataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: str | Path | None = None,
    ) -> list[Any] | None:
        """``predict_step`` over the data; the per-batch results (on the CPU)."""
        return run_prediction(self, model, dataloaders, datamodule, return_predictions, ckpt_path)

    def save_checkpoint(self, path: str | Path, weights_only: bool = False) -> None:
        """Write a checkpoint atomically (global rank 0 only; others return)."""
        if self._run is None:
            raise TrainerError("save_checkpoint() needs a model: call fit() first")
        if not self.is_global_zero:
            return
        with self.profiler.profile("save_checkpoint"):
            atomic_save(dump_checkpoint(self, self._run, weights_only=weights_only), path)

    def _keep_last_step_values(self, run: Run) -> None:
        """As Lightning's after fit: ``logged_metrics`` holds the last step values
        (``name_step``), not those of the last logging step (one read per fit)."""
        if not self.is_global_zero:
            return  # as publish_step_metrics: logged_metrics live on rank 0
        store = run.train_store
        logged = store.keys_where("logger")
        values = {k: v for k, v in store.step_values().items() if k in logged}
        if values:
            self.logged_metrics.update(to_host(values))

    def refresh_metrics(self) -> dict[str, float]:
        """Read the latest per-step values now (one host transfer) into callback_metrics."""
        if self._run is not None:
            self.callback_metrics.update(to_host(self._run.train_store.step_values()))
        return self.callback_metrics

    # ---- set-up ------------------------------------------------------------
    def _check_call(self, model: Any, datamodule: Any) -> None:
        """Refuse, before anything runs, what would not work or silently not run."""
        if not isinstance(model, Module):
            raise TrainerError(
                f"the model must be a gpulayer.train.Module; got {type(model).__name__}"
            )
        refuse_uncalled_hooks(model, Module, _MODULE_HOOKS)
        if datamodule is not None:
            check_datamodule(datamodule)

    def _source(
        self,
        fn: str,
        model: Module,
        datamodule: LightningDataModule | None,
        given: Any,
        argument: str,
    ) -> Callable[[], Any] | None:
        """Where ``fn``'s data comes from, asked for only when the loop needs it."""
        if given is not None:
            if fn != "train":
                given = combine_loaders(given)  # several val/test/predict dataloaders
            check_reiterable(given, argument)
            return lambda: given
        name = LOADERS[fn]
        owner: Any = datamodule if datamodule is not None else model
        if not defines(owner, LightningDataModule if datamodule is not None else Module, name):
            return None
        method = getattr(owner, name)
        return method if fn == "train" else lambda: combine_loaders(method())

    def _call(
        self,
        fn: str,
        model: Module,
        datamodule: LightningDataModule | None,
        body: Callable[[Run], T],
        loggers: bool = True,
    ) -> T:
        flag = {"fit": "fitting", "validate": "validating", "test": "testing"}.get(fn, "predicting")
        run = self._setup(model, datamodule, fn)
        distributed.finished_cleanly(False)
        setattr(self, flag, True)
        try:
            result = body(run)
            # As Lightning: teardown on success only (datamodule, callbacks, module).
            if datamodule is not None:
                timed_hook(run, "teardown", datamodule)(fn)
            call_callbacks(self, run, "teardown", fn)
            timed_hook(run, "teardown")(fn)
            self.profiler.describe()  # as Lightning: the report, on success only
            distributed.finished_cleanly(True)
            return result
        except Exception as exc:
            self.profiler.teardown(fn)
            # As Lightning: the callbacks' on_exception, then the datamodule's.
            call_callbacks(self, run, "on_exception", exc)
            if datamodule is not None:
                datamodule.on_exception(exc)
            raise
        finally:
            setattr(self, flag, False)
            self.validating_in_fit = False
            model._attach(self)
            if loggers:
                for logger in self.loggers:
                    logger.finalize()

    def _setup(self, model: Module, datamodule: LightningDataModule | None, fn: str) -> Run:
        env = self._env = detect_environment(os.environ)
        nodes = env.world_size // env.local_world_size
        if self.num_nodes is not None and self.num_nodes != nodes:
            raise TrainerError(
                f"num_nodes={self.num_nodes} but this job has {nodes} node(s) "
                f"(WORLD_SIZE={env.world_size}, LOCAL_WORLD_SIZE={env.local_world_size}); "
                f"the launcher decides the nodes: pass num_nodes={nodes} or leave it out"
            )
        device = resolve_device(self._accelerator, self._devices, env)
        self._accelerator.setup_device(device)
        if env.distributed:
            distributed.init_process_group(env, self._accelerator)
        if self.seed is not None:
            seed_everything(self.seed)
        self._log_dir = self._choose_log_dir(env)
        attach(self.profiler, fn, env.local_rank, env.global_rank, env.world_size, self._log_dir)
        model._attach(self)
        self.datamodule = datamodule
        if datamodule is not None:
            datamodule.trainer = self
        callbacks = self.callbacks
        if self.fast_dev_run:
            callbacks = [c for c in callbacks if not isinstance(c, EarlyStopping | ModelCheckpoint)]
        show = self.enable_progress_bar and env.global_rank == 0
        self._run = run = Run(
            module=model,
            device=device,
            precision=make_precision(self.precision, device),
            env=env,
            callbacks=callbacks,
            progress=ProgressBar() if show else None,
            transfer=make_transfer(model, datamodule),
            datamodule=datamodule,
            profiler=active(self.profiler),
        )
        run.transfer = timed_step(run, "batch_to_device", run.transfer)
        self._prepare_data(env, model, datamodule)
        if datamodule is not None:
            timed_hook(run, "setup", datamodule)(fn)
        call_callbacks(self, run, "setup", fn)
        timed_hook(run, "setup")(fn)
        timed_hook(run, "configure_model")()
        model.to(device)
        # As Lightning: each call starts with no metrics from the one before.
        self.callback_metrics.clear()
        self.logged_metrics.clear()
        self.progress_bar_metrics.clear()
        return run

    def _prepare_data(
        self, env: ClusterEnvironment, model: Module, datamodule: LightningDataModule | None
    ) -> None:
        """``prepare_data`` once per node (or once, if ``prepare_data_per_node`` is
        False) while the other ranks wait, as Lightning."""
        owners: list[tuple[Any, type]] = [(datamodule, LightningDataModule), (model, Module)]
        for owner, base in owners:
            if owner is None or not defines(owner, base, "prepare_data"):
                continue
            here = env.local_rank == 0 if owner.prepare_data_per_node else env.global_rank == 0
            if here:
                action = action_name(owner, "prepare_data")
                timed(active(self.profiler), action, owner.prepare_data)()
            if env.distributed:
                _wait_for_all_ranks(PREPARE_DATA_TIMEOUT)

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

    def _print_summary(self, model: Module) -> None:
        if not (self.enable_model_summary and self.is_global_zero):
            return
        if any(type(cb).__name__ == "ModelSummary" for cb in self.callbacks):
            return  # as Lightning: a ModelSummary callback replaces the Trainer's own
        try:
            from gpulayer.train.summary import model_summary
        except ImportError:  # the summary module lands separately
            return
        print(model_summary(model))

    # ---- what the module asks for during fit -------------------------------
    def _manual_optimizers(self) -> list[ManualOptimizer]:
        if self._run is None or not self._run.manual:
            raise TrainerError("self.optimizers() is available during fit() only")
        return self._run.manual

    def _backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self._run is None or not self.fitting:
            raise TrainerError("self.manual_backward(loss) is available during fit() only")
        if args or kwargs:
            raise TrainerError(
                "self.manual_backward(loss) takes no further arguments in GPUlayer "
                f"(got {len(args)} positional, {sorted(kwargs)}); call it with the loss only"
            )
        backward(self, self._run, loss)
