"""Trainer settings: checking them and filling in defaults."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from gpulayer.train.callbacks import LIGHTNING_CALLBACK_HOOKS, Callback
from gpulayer.train.data import SequentialLoaders
from gpulayer.train.errors import TrainerError, invalid_choice
from gpulayer.train.loggers import CSVLogger, Logger
from gpulayer.train.model_checkpoint import ModelCheckpoint
from gpulayer.train.module import Module, refuse_uncalled_hooks

_log = logging.getLogger("gpulayer.train")


def count_setting(name: str, value: Any, minimum: int, *, optional: bool = False) -> Any:
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        extra = " or None" if optional else ""
        raise TrainerError(f"{name}={value!r} must be an int >= {minimum}{extra}")
    return value


def limit_setting(name: str, value: Any) -> int | float | None:
    """``limit_*_batches``: None (all), an int (that many batches) or a fraction in [0, 1].

    As in Lightning, ``1`` is one batch and ``1.0`` all of them.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TrainerError(
            f"{name}={value!r} must be an int >= 0 (batches), a float in [0.0, 1.0] "
            f"(a fraction of the batches) or None"
        )
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return None if value == 1.0 else value
    raise TrainerError(
        f"{name}={value!r} must be an int >= 0 (batches) or a float in [0.0, 1.0] "
        f"(a fraction of the batches)"
    )


def resolve_limit(name: str, limit: int | float | None, data: Any) -> int | None:
    """The number of batches ``limit`` allows from ``data`` (None: all of them).

    For several dataloaders, a fraction is resolved for each one in the loop
    (checked here): None, or 0 for 0.0.
    """
    if limit is None or isinstance(limit, int):
        return limit
    if isinstance(data, SequentialLoaders):
        counts = [resolve_limit(name, limit, loader) for loader in data.loaders]
        return 0 if not any(counts) else None
    try:
        length = len(data)
    except TypeError:
        raise TrainerError(
            f"{name}={limit!r} is a fraction, but the data has no len(); give an int "
            f"(a number of batches) or 1.0"
        ) from None
    count = int(length * limit)
    if count == 0 and limit > 0 and length > 0:
        raise TrainerError(
            f"{name}={limit!r} of {length} batches is less than one batch; give at "
            f"least {name}={1 / length!r}"
        )
    return count


def val_check_setting(value: Any) -> int | float:
    """``val_check_interval``: an int (every N training batches) or a fraction of an epoch."""
    if value is None:
        return 1.0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    raise TrainerError(
        f"val_check_interval={value!r} must be an int >= 1 (training batches) or a float "
        f"in (0.0, 1.0] (a fraction of an epoch); time-based intervals are not supported"
    )


def fast_dev_run_setting(value: Any) -> int:
    """``fast_dev_run``: False/0 (off), True (1 batch) or a number of batches."""
    if value is True:
        return 1
    if value is False:
        return 0
    if isinstance(value, int) and value >= 0:
        return value
    raise TrainerError(f"fast_dev_run={value!r} must be a bool or an int >= 0 (batches)")


def next_version(root: Path) -> int:
    """One more than the highest ``version_N`` under ``root`` (0 if none)."""
    taken = [
        int(m.group(1))
        for p in root.glob("version_*")
        if (m := re.fullmatch(r"version_(\d+)", p.name))
    ]
    return max(taken, default=-1) + 1


def default_callbacks(
    callbacks: Iterable[Callback] | Callback | None, checkpointing: bool, add_default: bool = True
) -> list[Callback]:
    if callbacks is None:
        found: list[Callback] = []
    elif isinstance(callbacks, Callback):
        found = [callbacks]
    else:
        found = list(callbacks)
    for cb in found:
        if not isinstance(cb, Callback):
            raise TrainerError(
                f"callbacks must be gpulayer.train.Callback instances; got {type(cb).__name__}"
            )
        # A Lightning hook the Trainer would not call must not be silently dropped.
        refuse_uncalled_hooks(cb, Callback, LIGHTNING_CALLBACK_HOOKS)
    if add_default and checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in found):
        found.append(ModelCheckpoint(save_top_k=0, save_last=True))
    if not checkpointing and any(isinstance(cb, ModelCheckpoint) for cb in found):
        raise TrainerError("enable_checkpointing=False but callbacks include a ModelCheckpoint")
    return found


def default_loggers(logger: bool | Logger | Iterable[Logger]) -> list[Logger]:
    if logger is True or logger is None:  # None: Lightning's default logger
        return [CSVLogger()]
    if logger is False:
        return []
    found = [logger] if isinstance(logger, Logger) else list(logger)
    for item in found:
        if not isinstance(item, Logger):
            raise TrainerError(
                f"logger must be True, False, a Logger or a list of them; got {type(item).__name__}"
            )
    return found


def check_validation_step(model: Module, step: str = "validation_step") -> None:
    """Refuse evaluation data for a module without the step, before anything runs."""
    if getattr(type(model), step) is getattr(Module, step):
        data = "validation" if step == "validation_step" else "test"
        raise TrainerError(
            f"{type(model).__name__} was given {data} data but defines no {step}(batch, batch_idx)"
        )


def resolve_ckpt_path(
    ckpt_path: str | Path | None,
    root: Path,
    checkpoints: list[ModelCheckpoint],
    loggers: Iterable[Logger] = (),
) -> Path | None:
    """The file ``ckpt_path`` means. ``"last"``: the newest ``last.ckpt`` in the
    ModelCheckpoint directories, under ``root/*/checkpoints``, or under
    ``<save_dir>/<name>/*/checkpoints`` of a logger given a ``save_dir`` (where
    ModelCheckpoint writes then, as in Lightning); None if there is none."""
    if ckpt_path is None:
        return None
    if ckpt_path == "best":
        best = next((cb.best_model_path for cb in checkpoints if cb.best_model_path), None)
        if not best:
            raise TrainerError(
                "ckpt_path='best' but no ModelCheckpoint has saved a best model; monitor "
                "a metric with ModelCheckpoint(monitor=...) or give a file"
            )
        return Path(best)
    if ckpt_path != "last":
        return Path(ckpt_path)
    places = [cb.dirpath / "last.ckpt" for cb in checkpoints if cb.dirpath]
    places += root.glob("*/checkpoints/last.ckpt")
    for logger in loggers:
        if logger.root_dir is not None:
            places += logger.root_dir.glob("*/checkpoints/last.ckpt")
    found = [p for p in places if p.is_file()]
    if not found:
        _log.info("ckpt_path='last': no last.ckpt under %s; starting fresh", root)
        return None
    return max(found, key=lambda p: p.stat().st_mtime_ns)


# Lightning 2.6's Trainer arguments that GPUlayer's Trainer does not take,
# with Lightning's default (inspect.signature(lightning.pytorch.Trainer)):
# given its default, one changes nothing and is accepted; given anything
# else, it is refused, saying what to do instead, never ignored.
LIGHTNING_ONLY: dict[str, tuple[object, str]] = {
    "min_epochs": (None, "stop with max_epochs, max_steps or EarlyStopping"),
    "min_steps": (None, "stop with max_epochs, max_steps or EarlyStopping"),
    "max_time": (None, "give the job a timeout (gpulayer run --timeout), or use max_steps"),
    "overfit_batches": (0.0, "use limit_train_batches=N and limit_val_batches=N on the same data"),
    "use_distributed_sampler": (True, "GPUlayer always shards the data across ranks"),
    "detect_anomaly": (False, "wrap fit() in torch.autograd.detect_anomaly()"),
    "barebones": (False, "disable what you do not need: logger=False, enable_checkpointing=False"),
    "plugins": (None, "precision= covers GPUlayer's precision plugins"),
    "sync_batchnorm": (
        False,
        "convert the model with torch.nn.SyncBatchNorm.convert_sync_batchnorm() first",
    ),
    "reload_dataloaders_every_n_epochs": (0, "build a fresh loader in train_dataloader()"),
    "enable_autolog_hparams": (True, "call logger.log_hyperparams() yourself"),
    "model_registry": (None, "keep checkpoints with ModelCheckpoint"),
}


def refuse_unsupported(given: Mapping[str, Any], known: Iterable[str]) -> None:
    """Trainer arguments beyond GPUlayer's: Lightning's at their default
    pass; any other value of one, or a name Lightning does not have either,
    is refused naming it."""
    import difflib

    for name, value in given.items():
        if name in LIGHTNING_ONLY:
            default, instead = LIGHTNING_ONLY[name]
            if value == default and type(value) is type(default):
                continue
            raise TrainerError(
                f"Trainer({name}={value!r}) is Lightning's, and GPUlayer's Trainer does not "
                f"support it: {instead}"
            )
        guess = difflib.get_close_matches(name, [*known, *LIGHTNING_ONLY], n=1)
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        raise TrainerError(f"Trainer() got an unknown argument {name!r}{hint}")


#: As Lightning's Trainer reads them: ``PL_TRAINER_<ARGUMENT>`` in the
#: environment is that argument's default, so that an unedited script's
#: Trainer can be set from outside (``PL_TRAINER_MAX_STEPS=10``).
ENV_PREFIX = "PL_TRAINER_"

_Init = TypeVar("_Init", bound=Callable[..., None])


def env_defaults(names: Iterable[str], environ: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """The Trainer arguments that ``PL_TRAINER_<NAME>`` variables set, each
    as (the variable's text, its value). As Lightning, a value is read as a
    Python literal (``ast.literal_eval``, which never runs code: ``10``,
    ``0.5``, ``False``, ``None``, ``[0, 1]``), else it is the text itself
    (``cpu``); an unset or empty variable sets nothing."""
    import ast

    found: dict[str, tuple[str, Any]] = {}
    for name in names:
        text = environ.get(ENV_PREFIX + name.upper())
        if not text:
            continue
        try:
            value: Any = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            value = text
        found[name] = (text, value)
    return found


def defaults_from_env(init: _Init) -> _Init:
    """Wrap ``Trainer.__init__`` so that ``PL_TRAINER_*`` variables give the
    defaults of the arguments the call does not pass (an argument in the code
    wins, as in Lightning). Lightning's arguments that GPUlayer refuses are
    read too, so that one set from outside is refused, never ignored; a
    refused value names the variable it came from."""
    import functools
    import inspect
    import os

    params = inspect.signature(init).parameters.values()
    names = [p.name for p in params if p.kind is p.KEYWORD_ONLY] + list(LIGHTNING_ONLY)

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        found = {
            name: read
            for name, read in env_defaults(names, os.environ).items()
            if name not in kwargs
        }
        try:
            init(self, *args, **{name: value for name, (_, value) in found.items()}, **kwargs)
        except TrainerError as e:
            if not found:
                raise
            read = ", ".join(f"{ENV_PREFIX}{n.upper()}={text!r}" for n, (text, _) in found.items())
            raise TrainerError(f"{e} (read from the environment: {read})") from e

    return cast(_Init, wrapper)


def set_torch_flags(deterministic: bool | str | None, benchmark: bool | None) -> None:
    """``Trainer(deterministic=..., benchmark=...)`` as Lightning applies them
    (when the Trainer is made, for the whole process): ``True`` or ``"warn"``
    makes PyTorch use deterministic algorithms (``"warn"``: warn, not fail,
    where there is none), turns cuDNN's benchmark off unless it was asked
    for, and sets cuBLAS's workspace for reproducible results; ``None``
    leaves every flag as it is."""
    import os

    if not (deterministic is None or isinstance(deterministic, bool) or deterministic == "warn"):
        raise invalid_choice("deterministic", deterministic, (None, True, False, "warn"))
    if not (benchmark is None or isinstance(benchmark, bool)):
        raise invalid_choice("benchmark", benchmark, (None, True, False))
    if deterministic and benchmark is None:
        benchmark = False  # cuDNN's benchmark picks algorithms by timing them
    if benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark
    if deterministic == "warn":
        torch.use_deterministic_algorithms(True, warn_only=True)
    elif isinstance(deterministic, bool):
        torch.use_deterministic_algorithms(deterministic)
    if deterministic:
        # cuBLAS's reproducibility needs a fixed workspace (NVIDIA's cuBLAS docs).
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
