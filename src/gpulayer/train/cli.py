"""Where a port's ``from lightning.pytorch.cli import LightningCLI`` lands.

Lightning's command line (``lightning.pytorch.cli``, built on jsonargparse)
makes the model, the datamodule and the Trainer from command-line options
and config files. GPUlayer has none: each of its names is refused where it
is imported, saying what to write instead, rather than failing with a bare
ImportError. ``cli_lightning_logo``, the banner most of Lightning's example
scripts print first (Lightning keeps it in ``lightning.pytorch``), is here
and prints GPUlayer's name.
"""

from __future__ import annotations

from typing import Any

from gpulayer.train.errors import TrainerError

_BUILD_IT = (
    "build the model, the datamodule and the Trainer in the script, reading its options "
    "with argparse (Trainer(max_epochs=args.max_epochs)), or set Trainer arguments from "
    "outside with PL_TRAINER_<ARGUMENT> environment variables (PL_TRAINER_MAX_EPOCHS=10)"
)
#: lightning.pytorch.cli's own public names (Lightning 2.6.6), and what to do instead.
NOT_PROVIDED: dict[str, str] = {
    "LightningCLI": _BUILD_IT,
    "LightningArgumentParser": "read the script's options with argparse.ArgumentParser",
    "SaveConfigCallback": "keep the options with self.save_hyperparameters() in the module",
    "ReduceLROnPlateau": (
        "return torch.optim.lr_scheduler.ReduceLROnPlateau from configure_optimizers as "
        '{"scheduler": ..., "monitor": "val_loss"}'
    ),
    "instantiate_class": "import the class and call it",
    "instantiate_module": "import the class and call it",
}


def cli_lightning_logo() -> None:
    """Print the banner Lightning's example scripts start with: GPUlayer's name,
    not Lightning's logo."""
    print("\ngpulayer.train\n")


def __getattr__(name: str) -> Any:
    # `from gpulayer.train.cli import LightningCLI` in a ported script fails
    # here, naming what it asked for, rather than with a bare ImportError.
    if name in NOT_PROVIDED:
        raise TrainerError(
            f"{name} is part of Lightning's command line (lightning.pytorch.cli, built "
            f"on jsonargparse), which GPUlayer does not provide: {NOT_PROVIDED[name]}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
