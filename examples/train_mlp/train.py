"""Train a small MLP classifier on synthetic data with ``gpulayer.train``.

Alone, or as a GPUlayer job on one or several machines::

    python train.py
    gpulayer run train.py --follow
    gpulayer run train.py --nodes 2 --procs-per-node 2 --follow   # DDP, gloo on CPU

Under a distributed job each rank reads RANK, WORLD_SIZE, MASTER_ADDR...
from its environment; the Trainer joins the process group, wraps the model
in DDP and gives each rank its share of the data. Rank 0 writes metrics and
checkpoints under ``gpulayer_runs/<run>/`` in the working directory. A few
seconds on a laptop CPU.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpulayer.train import EarlyStopping, ModelCheckpoint, Module, Trainer


class Classifier(Module):
    def __init__(
        self, in_dim: int = 16, hidden: int = 64, classes: int = 4, lr: float = 3e-3
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )
        self.lr = lr

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        # Logged values stay on the device; nothing here waits for it.
        self.log("loss", loss, prog_bar=True)
        self.log("train_acc", (logits.argmax(1) == y).float().mean(), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def synthetic(samples: int, in_dim: int, classes: int, seed: int) -> TensorDataset:
    """Points labelled by one fixed random linear teacher: learnable, the same on every rank."""
    teacher = torch.randn(in_dim, classes, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(samples, in_dim, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ teacher).argmax(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--precision", default="32", help='"32", "bf16-mixed" or "16-mixed"')
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    args = parser.parse_args()

    train = DataLoader(
        synthetic(args.samples, 16, 4, seed=0), batch_size=args.batch_size, shuffle=True
    )
    val = DataLoader(synthetic(args.samples // 4, 16, 4, seed=1), batch_size=256)
    trainer = Trainer(
        max_epochs=args.epochs,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        log_every_n_steps=20,
        seed=0,
        callbacks=[
            ModelCheckpoint(monitor="val_loss", save_top_k=1, save_last=True),
            EarlyStopping(monitor="val_loss", patience=3),
        ],
    )
    model = Classifier()
    trainer.fit(model, train, val, ckpt_path="last" if args.resume else None)

    if trainer.is_global_zero:
        best = trainer.checkpoint_callback
        summary = {
            "world_size": trainer.world_size,
            "epochs": trainer.current_epoch,
            "global_step": trainer.global_step,
            "metrics": trainer.callback_metrics,
            "best_checkpoint": best.best_model_path if best else None,
            "run_dir": str(trainer.log_dir),
        }
        (trainer.log_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
