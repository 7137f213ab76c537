"""Tiny models, data and a raw PyTorch loop for the Trainer tests."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpulayer.train import Module

SRC = Path(__file__).resolve().parents[2] / "src"

Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(count: int, batch: int = 8, in_dim: int = 4, seed: int = 0) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(in_dim, 1, generator=gen)
    out = []
    for _ in range(count):
        x = torch.randn(batch, in_dim, generator=gen)
        out.append((x, x @ teacher + 0.1 * torch.randn(batch, 1, generator=gen)))
    return out


def make_net(in_dim: int = 4, hidden: int = 8, dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_dim, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, 1)
    )


def make_optimizer(params: Any, kind: str, lr: float) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class Regression(Module):
    """A two-layer regression net; logs its loss per step and per epoch."""

    def __init__(
        self,
        in_dim: int = 4,
        hidden: int = 8,
        dropout: float = 0.0,
        lr: float = 0.05,
        optimizer: str = "sgd",
        step_lr: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = make_net(in_dim, hidden, dropout)
        self.lr, self.optimizer_kind, self.step_lr = lr, optimizer, step_lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), prog_bar=True)

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.parameters(), self.optimizer_kind, self.lr)
        if not self.step_lr:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, self.step_lr, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def raw_fit(
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    epochs: Sequence[Sequence[Batch]],
    accumulate: int = 1,
    clip: float | None = None,
) -> int:
    """The loop every PyTorch user writes; returns the number of optimizer steps."""
    steps = 0
    for batches in epochs:
        for i, (x, y) in enumerate(batches):
            loss = F.mse_loss(net(x), y)
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(list(net.parameters()), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                steps += 1
    return steps


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"{key} differs"


def quiet(**overrides: Any) -> dict[str, Any]:
    """Trainer arguments for a test: CPU, no files or output unless asked."""
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
    }
    kwargs.update(overrides)
    return kwargs


def free_port() -> int:
    """A free port for MASTER_PORT, chosen below the kernel's ephemeral range.

    A port from bind(("", 0)) is ephemeral: between this check and rank 0
    binding it, any outgoing connection on the machine (parallel tests make
    thousands) may be given it, and the ranks then fail to meet. Ports below
    the range are never handed out that way.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # seeded from the OS: parallel workers pick apart
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def run_ranks(
    args: list[str], world: int, cwd: Path, timeout: float = 90, check: bool = True
) -> list[subprocess.CompletedProcess[str]]:
    """Start ``world`` real processes wired as one job (env vars), wait for all;
    with ``check``, every rank must exit 0."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            # CPU ranks, as a gpus=0 job's: on one GPU, two ranks would both take it.
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for rank, result in enumerate(results):
        assert not check or result.returncode == 0, f"rank {rank} failed:\n{result.stderr[-3000:]}"
    return results
