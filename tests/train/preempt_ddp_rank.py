"""One rank of test_train_preemption_ddp_faults (found by review): fits that raise, caught, with the notice set."""

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

import torch.distributed as dist
from trainer_testkit import Regression, make_batches, quiet

from gpulayer.train import Callback, Trainer


class Boom(Callback):
    def on_train_batch_end(self, *a):  # type: ignore[no-untyped-def]
        raise ValueError("boom")


out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
os.environ["GPULAYER_SCRATCH"] = str(out / f"s{rank}")
Path(os.environ["GPULAYER_SCRATCH"]).mkdir(parents=True, exist_ok=True)
os.environ["GPULAYER_ATTEMPT"] = "1"
groups = []
for _ in range(3):
    trainer = Trainer(
        **quiet(max_epochs=1, strategy="ddp", default_root_dir=out / "runs", callbacks=[Boom()])
    )
    with contextlib.suppress(ValueError):
        trainer.fit(Regression(), make_batches(4))
    dist.barrier()
    groups.append(len(dist.distributed_c10d._world.pg_map))
time.sleep(6)  # rank 0's word, 5 s at most
threads = [t.name for t in threading.enumerate() if "preempt" in t.name]
(out / f"rank{rank}.json").write_text(json.dumps({"groups": groups, "threads": threads}))
