"""One rank of the exit tests: joins the group as the Trainer does, takes part
in one collective, then the rank named by argv[1] dies without any teardown
while the others end normally, through the Trainer's exit teardown."""

from __future__ import annotations

import os
import sys

import torch

from gpulayer.train import distributed
from gpulayer.train.accelerator import CPUAccelerator
from gpulayer.train.environment import detect_environment


def main() -> None:
    env = detect_environment(os.environ)
    distributed.init_process_group(env, CPUAccelerator())
    distributed.any_rank(False, torch.device("cpu"))
    if env.global_rank == int(sys.argv[1]):
        os._exit(3)  # no atexit; the kernel closes its sockets


if __name__ == "__main__":
    main()
