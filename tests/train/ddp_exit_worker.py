"""One rank of the exit tests: joins the group as the Trainer does, takes part
in one collective, then the rank named by argv[1]

- ``die``: dies without any teardown while the others end normally (as
  after a fit() that returned), through the Trainer's exit teardown;
- ``quit``: calls ``sys.exit(1)`` in the middle of its work (no fit()
  returned) while the others wait for it in a collective."""

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
    chosen = env.global_rank == int(sys.argv[1])
    if sys.argv[2] == "die":
        distributed.finished_cleanly(True)  # as when fit() has returned
        if chosen:
            os._exit(3)  # no atexit; the kernel closes its sockets
    elif chosen:
        sys.exit(1)  # an error mid-work: the exit teardown must not wait
    else:
        distributed.any_rank(False, torch.device("cpu"))  # waits for the one that quit


if __name__ == "__main__":
    main()
