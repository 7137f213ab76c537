"""Per-step time of the GPUlayer Trainer against a raw PyTorch loop.

A three-layer MLP (width W -> W -> W -> 10), batch 64, Adam, data already in
memory on the device. Variants, measured in the same run:

* ``raw``        the plain loop: zero_grad, forward, backward, step;
* ``raw_item``   the same loop reading ``loss.item()`` every step (what a
                 loop that prints or accumulates Python floats does);
* ``gpulayer``   ``gpulayer.train.Trainer`` with ``self.log("loss", loss)``
                 every step;
* ``lightning``  Lightning's Trainer with ``self.log`` every step, when
                 ``lightning`` is importable.

Both trainers run with their progress bar, loggers and checkpointing off, so
that the loop is measured rather than file or terminal output. Each
measurement builds a fresh model, runs warm-up steps, then times the next
steps (synchronising the device at both ends); one untimed round first pays
for one-off costs (allocations, lazy initialisation). The variants take turns
within each repeat, in a rotating order, so drift hits them alike. The table
reports each variant's median ms/step and the median over repeats of its
ratio to the raw loop's time in the same repeat.

    python benchmarks/trainer_step.py --device cpu
    python benchmarks/trainer_step.py --device cuda --widths 256 2048

Writes ``benchmarks/results/trainer_step.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 64
CLASSES = 10
LR = 1e-3
RESULTS = Path(__file__).resolve().parent / "results" / "trainer_step.json"


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def mlp(width: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, CLASSES),
    )


class Batches:
    """``count`` batches cycling over a few distinct ones, all on the device."""

    def __init__(self, width: int, count: int, device: torch.device, distinct: int = 8) -> None:
        gen = torch.Generator().manual_seed(0)
        self.items = [
            (
                torch.randn(BATCH, width, generator=gen).to(device),
                torch.randint(0, CLASSES, (BATCH,), generator=gen).to(device),
            )
            for _ in range(distinct)
        ]
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        items = self.items
        for i in range(self.count):
            yield items[i % len(items)]


class Window:
    """Times the steps after ``warmup`` ones; ``mark(i)`` is called after step i."""

    def __init__(self, device: torch.device, warmup: int, total: int) -> None:
        self.device, self.warmup, self.total = device, warmup, total
        self.start = self.end = 0.0

    def mark(self, step: int) -> None:
        if step == self.warmup - 1:
            synchronize(self.device)
            self.start = time.perf_counter()
        elif step == self.total - 1:
            synchronize(self.device)
            self.end = time.perf_counter()

    def ms_per_step(self) -> float:
        return (self.end - self.start) * 1000 / (self.total - self.warmup)


def run_raw(width: int, device: torch.device, warmup: int, steps: int, read: bool) -> float:
    torch.manual_seed(0)
    model = mlp(width).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    window = Window(device, warmup, warmup + steps)
    losses = []
    for i, (x, y) in enumerate(Batches(width, warmup + steps, device)):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if read:
            losses.append(loss.item())
        window.mark(i)
    return window.ms_per_step()


def run_gpulayer(width: int, device: torch.device, warmup: int, steps: int) -> float:
    from gpulayer.train import Callback, Module, Trainer

    class MLP(Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(width)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=LR)

    window = Window(device, warmup, warmup + steps)

    class Timer(Callback):
        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            window.mark(batch_idx)

    torch.manual_seed(0)
    trainer = Trainer(
        accelerator=device.type,
        max_steps=warmup + steps,
        callbacks=[Timer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(MLP(), Batches(width, warmup + steps, device))
    return window.ms_per_step()


def run_lightning(width: int, device: torch.device, warmup: int, steps: int) -> float:
    import lightning as L

    # Lightning's per-fit banners ("GPU available", tips) would flood the table's output.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(width)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=LR)

    window = Window(device, warmup, warmup + steps)

    class Timer(L.Callback):
        def on_train_batch_end(
            self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            window.mark(batch_idx)

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator={"cuda": "gpu"}.get(device.type, device.type),
        devices=1,
        max_steps=warmup + steps,
        callbacks=[Timer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MLP(), Batches(width, warmup + steps, device))
    return window.ms_per_step()


def lightning_available() -> bool:
    try:
        import lightning  # noqa: F401
    except Exception:
        return False
    return True


def calibrate(width: int, device: torch.device, target_s: float) -> int:
    """Steps per measurement so that one takes about ``target_s`` seconds."""
    # The fastest of three short runs: a burst of other load must not shrink the sample.
    ms = min(run_raw(width, device, warmup=5, steps=20, read=False) for _ in range(3))
    return max(20, min(2000, int(target_s * 1000 / ms)))


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device": device.type,
    }
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except Exception:
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=0, help="timed steps (0: about --seconds)")
    parser.add_argument("--seconds", type=float, default=0.25, help="target time per measurement")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--no-lightning", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants: dict[str, Callable[[int, int, int], float]] = {
        "raw": lambda w, wu, n: run_raw(w, device, wu, n, read=False),
        "raw_item": lambda w, wu, n: run_raw(w, device, wu, n, read=True),
        "gpulayer": lambda w, wu, n: run_gpulayer(w, device, wu, n),
    }
    if not args.no_lightning and lightning_available():
        variants["lightning"] = lambda w, wu, n: run_lightning(w, device, wu, n)
    names = list(variants)

    results = []
    for width in args.widths:
        steps = args.steps or calibrate(width, device, args.seconds)
        samples: dict[str, list[float]] = {name: [] for name in names}
        for name in names:  # untimed round
            variants[name](width, args.warmup, min(steps, 20))
        for repeat in range(args.repeats):
            # Rotate the order each repeat so no variant always runs first.
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                samples[name].append(variants[name](width, args.warmup, steps))
            print(f"width {width}: repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
        for name in names:
            ratios = [v / r for v, r in zip(samples[name], samples["raw"], strict=True)]
            results.append(
                {
                    "width": width,
                    "variant": name,
                    "ms_per_step": statistics.median(samples[name]),
                    "ratio_to_raw": statistics.median(ratios),
                    "samples_ms": samples[name],
                    "steps_per_sample": steps,
                }
            )

    report = {
        "benchmark": "trainer_step",
        "command": " ".join(
            [Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine(device),
        "config": {
            "batch": BATCH,
            "optimizer": "Adam",
            "repeats": args.repeats,
            "warmup": args.warmup,
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print(
        f"\ndevice: {device.type}  torch {torch.__version__}  batch {BATCH}  Adam  "
        f"median of {args.repeats} repeats, {torch.get_num_threads()} threads"
    )
    print(f"{'width':>6} {'variant':<10} {'ms/step':>9} {'x raw':>7}")
    for row in results:
        print(
            f"{row['width']:>6} {row['variant']:<10} {row['ms_per_step']:>9.3f} {row['ratio_to_raw']:>7.2f}"
        )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    with warnings.catch_warnings():
        # Lightning suggests DataLoader workers for the in-memory batches; not relevant here.
        warnings.filterwarnings("ignore", module="lightning")
        sys.exit(main())
