"""One rank of the 2-rank gloo tests; test_train_ddp.py starts two of these.

Each rank trains the same small model with accumulate_grad_batches 1, 2 and
3, counting the gradient all-reduces DDP makes through a communication hook,
and writes what it saw to <out>/rank<R>.json and rank<R>-acc<N>.pt.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from trainer_testkit import Regression, make_batches

import gpulayer.train.trainer as trainer_module
from gpulayer.train import Callback, Trainer


class CountAllReduces(Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer: Any, module: Any) -> None:
        # Unannotated: DDP rejects a hook whose annotations are not its own types.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            self.calls += 1
            return default_hooks.allreduce_hook(state, bucket)

        trainer.model.register_comm_hook(None, hook)


class Recording(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch[0].detach().clone())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("val_local", loss)
        self.log("val_synced", loss, sync_dist=True)


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    saves: list[str] = []
    real_save = trainer_module.atomic_save
    trainer_module.atomic_save = lambda obj, path: saves.append(str(path)) or real_save(obj, path)  # type: ignore[assignment, func-returns-value]

    data = make_batches(12)
    results: dict[int, dict[str, Any]] = {}
    for accumulate in (1, 2, 3):
        torch.manual_seed(0)
        module = Recording()
        counter = CountAllReduces()
        trainer = Trainer(
            accelerator="cpu",
            max_epochs=1,
            accumulate_grad_batches=accumulate,
            callbacks=[counter],
            default_root_dir=out / "runs",
            enable_progress_bar=False,
        )
        trainer.fit(module, data, val_dataloaders=make_batches(4, seed=1))
        results[accumulate] = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "ddp": type(trainer.model).__name__,
            "allreduces": counter.calls,
            "global_step": trainer.global_step,
            "val_local": trainer.callback_metrics["val_local"],
            "val_synced": trainer.callback_metrics["val_synced"],
            "log_dir": str(trainer.log_dir),
        }
        torch.save(
            {"weights": module.state_dict(), "seen": module.seen},
            out / f"rank{rank}-acc{accumulate}.pt",
        )
    results[0] = {"saves": saves}  # type: ignore[dict-item]
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    # No destroy_process_group here: the Trainer's exit teardown meets the
    # other rank first, then destroys the group, as in a user's script. Rank 1
    # ending right after its last collective used to abort at exit without it.


if __name__ == "__main__":
    main()
