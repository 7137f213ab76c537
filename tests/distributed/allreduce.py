"""A 2x2 (or any) gloo job: every rank all-reduces rank+1, rank 0 writes the sum.

Run by the distributed tests under each launcher; prints one line per rank.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(f"rank {rank}/{world} sum {value.item():g} port {os.environ['MASTER_PORT']}", flush=True)
if rank == 0:
    with open(sys.argv[1] if len(sys.argv) > 1 else "sum.json", "w") as out:
        json.dump({"sum": value.item(), "world": world, "env_rank": os.environ["RANK"]}, out)
dist.barrier()
dist.destroy_process_group()
