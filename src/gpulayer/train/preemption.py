"""Checkpoint on preemption, resume on the next attempt (ADR-0024).

GPUlayer gives a preemptible job ``GPULAYER_PREEMPT_NOTICE`` (the worker's
kill grace, in seconds) from its start; to stop it, the worker sends
``SIGTERM`` to every process of the task, waits the grace, then ``SIGKILL``.
When that variable is set, ``Trainer.fit``:

1. replaces the ``SIGTERM`` handler (main thread only) with one that only
   sets a flag, and puts the previous one back when ``fit`` returns;
2. looks for the preemption checkpoint (``$GPULAYER_SCRATCH/gpulayer-preempt.ckpt``,
   else ``<default_root_dir>/gpulayer-preempt.ckpt``) and, when
   ``ckpt_path`` is None, resumes from it;
3. at the next safe point after the signal (the end of a training batch that
   stepped the optimizer, the end of an epoch, the end of training) writes
   a full checkpoint there, atomically, and leaves ``fit`` with
   :class:`Preempted` (``SystemExit(143)``, 128 + SIGTERM);
4. after a ``fit`` that ends normally, removes the file.

Under DDP only global rank 0 decides, from its own flag: DDP replicas are
identical after each optimizer step, and rank 0 is the one that writes
checkpoints anyway. The other ranks keep training (their handler only notes
the signal) so that rank 0's collectives complete, and a thread on each of
them waits on a gloo group of its own for rank 0's word: "preempted" ends
the process (143) even if its main thread is stuck in a collective rank 0
will never join; "done" ends the thread. Nothing is added to a step but a
Python attribute read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gpulayer.train import distributed
from gpulayer.train.checkpoint import load_checkpoint
from gpulayer.train.errors import CheckpointError, TrainerError
from gpulayer.train.state import check_resumable

if TYPE_CHECKING:
    from gpulayer.train.fit import Run
    from gpulayer.train.trainer import Trainer

#: Set by GPUlayer's worker for a preemptible job: the kill grace, in seconds.
NOTICE_VAR = "GPULAYER_PREEMPT_NOTICE"
#: A per-job folder kept from one attempt to the next (node 0's).
SCRATCH_VAR = "GPULAYER_SCRATCH"
#: The attempt number, from 1.
ATTEMPT_VAR = "GPULAYER_ATTEMPT"
#: The preemption checkpoint's file name, in the scratch folder or default_root_dir.
FILENAME = "gpulayer-preempt.ckpt"
#: 128 + SIGTERM: what a shell reports for a process ended by SIGTERM.
EXIT_CODE = 128 + int(signal.SIGTERM)
#: Rank 0's word to the other ranks, over the side group.
_DONE, _PREEMPTED = 0, 1
#: How long rank 0 waits for the other ranks to take its word before it leaves.
_TELL_TIMEOUT = timedelta(seconds=5)
#: The side group's receive lasts the whole fit: as long as a fit may run.
_SIDE_TIMEOUT = timedelta(days=3650)
#: Where torch's DataLoader SIGCHLD handler is defined.
_TORCH_SIGCHLD = "torch.utils.data._utils.signal_handling"
# A fit that fails waits this long for its watcher to hear rank 0's word,
# so that its side group can be destroyed (else it is left, as on exit).
_WATCHER_JOIN_S = 5.0

_log = logging.getLogger("gpulayer.train")


class Preempted(SystemExit):
    """``fit`` saved a preemption checkpoint and stops the process (code 143).

    A ``SystemExit``, so that ``except Exception`` in user code lets it
    through and the interpreter exits with its code, after ``finally``
    blocks and ``atexit`` handlers (the loggers close) have run.
    """

    def __init__(self, step: int, path: Path) -> None:
        super().__init__(EXIT_CODE)
        self.step, self.path = step, path


def notice_seconds(env: Mapping[str, str]) -> float | None:
    """The notice in ``GPULAYER_PREEMPT_NOTICE``; None when it is not set."""
    raw = env.get(NOTICE_VAR)
    if raw is None or raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise TrainerError(
            f"{NOTICE_VAR}={raw!r} is not a number of seconds >= 0; GPUlayer sets it to "
            f"the worker's kill grace for a preemptible job: unset it, or give a number"
        )
    return value


def checkpoint_path(env: Mapping[str, str], default_root_dir: Path) -> Path:
    """Where the preemption checkpoint lives: the job's scratch folder if it has one."""
    scratch = env.get(SCRATCH_VAR)
    return (Path(scratch) if scratch else Path(default_root_dir)) / FILENAME


def looks_for_resume(env: Mapping[str, str]) -> bool:
    """A first attempt never resumes: under GPUlayer a file it finds (in a
    ``default_root_dir`` outside the scratch folder) is another job's."""
    raw = env.get(ATTEMPT_VAR)
    if raw is None:
        return True  # outside GPUlayer, whoever set the notice manages the file
    try:
        return int(raw) > 1
    except ValueError:
        return True


def _say(text: str) -> None:
    # On stderr, flushed: it is the job's log, and the process may end next.
    print(f"gpulayer: {text}", file=sys.stderr, flush=True)


class Preemption:
    """One ``fit``'s preemption handling: the handler, the file, the ranks' word."""

    def __init__(self, trainer: Trainer, notice: float, env: Mapping[str, str]) -> None:
        self.notice = notice
        self.path = checkpoint_path(env, trainer.default_root_dir)
        self.resumes = looks_for_resume(env)
        #: Rank 0 (or the only rank) got SIGTERM: save at the next safe point.
        self.requested = False
        #: This process got SIGTERM (any rank).
        self.received = False
        self._acted = False
        # -1 until attach() knows it: a signal before then is noted, not acted on.
        self._rank, self._world = -1, 1
        self._group: Any = None
        self._watcher: threading.Thread | None = None
        self._told = False
        self._previous: Any = None
        self._installed = False
        self._sigchld: Any = None

    # ---- the signal -----------------------------------------------------------
    def install(self) -> None:
        """Take SIGTERM over for the length of the fit (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            _log.warning(
                "%s is set but fit() runs outside the main thread, where no signal "
                "handler can be set: a preemption will not be checkpointed",
                NOTICE_VAR,
            )
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        # Only flags: the loop acts at its next safe point, never mid-step.
        self.received = True
        if self._rank == 0:
            self.requested = True
        # The DataLoader's workers got SIGTERM too, and torch's handler ends
        # them; its SIGCHLD handler would then raise in this thread wherever
        # it is, mid-step. Without it, the loader fails at its next read,
        # which the loop expects now.
        handler = signal.getsignal(signal.SIGCHLD)
        if getattr(handler, "__module__", None) == _TORCH_SIGCHLD:
            self._sigchld = handler
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    # ---- the ranks ------------------------------------------------------------
    def attach(self, trainer: Trainer, run: Run) -> None:
        """Once the process group exists: the side group, and the watchers."""
        env = run.env
        self._rank, self._world = env.global_rank, env.world_size
        if self.received and self._rank == 0:
            self.requested = True  # a signal that came during set-up
        if not env.distributed:
            return
        # Its own group, so that rank 0's word never meets a gradient
        # all-reduce of the default group; gloo, so that a thread can wait on it.
        self._group = dist.new_group(backend="gloo", timeout=_SIDE_TIMEOUT)
        if self._rank != 0:
            self._watcher = threading.Thread(
                target=self._watch, name="gpulayer-preempt-watch", daemon=True
            )
            self._watcher.start()

    def _watch(self) -> None:
        word = torch.zeros(2, dtype=torch.int64)
        try:
            dist.recv(word, src=0, group=self._group)
        except Exception:
            return  # rank 0 left without a word: this rank's own errors tell the story
        if int(word[0]) == _PREEMPTED:
            _say(
                f"preempted: rank {self._rank} stops; rank 0 saved the checkpoint at "
                f"step {int(word[1])}"
            )
            sys.stdout.flush()
            # From this thread: the main one may be blocked in a collective
            # that rank 0, gone, will never join.
            os._exit(EXIT_CODE)

    def _tell(self, word: int, step: int) -> None:
        """Rank 0: give every other rank its word (once)."""
        if self._told or self._group is None or self._rank != 0:
            return
        self._told = True
        message = torch.tensor([word, step], dtype=torch.int64)
        try:
            works = [dist.isend(message, dst=r, group=self._group) for r in range(1, self._world)]
            for work in works:
                if work is not None:
                    work.wait(timeout=_TELL_TIMEOUT)
        except Exception as exc:  # a rank already gone does not hold rank 0 back
            _log.warning("could not tell every rank about the preemption: %s", exc)

    # ---- resuming -------------------------------------------------------------
    def find_checkpoint(self, trainer: Trainer, run: Run) -> dict[str, Any] | None:
        """The preemption checkpoint to resume from, on every rank, or None.

        Rank 0 decides (only node 0's scratch folder is kept); a rank that
        cannot read the same file gets rank 0's copy, once, at the start.
        """
        if not self.resumes:
            return None
        checkpoint: dict[str, Any] | None = None
        step: int | None = None
        error: str | None = None
        if self._rank == 0 and self.path.is_file():
            try:
                checkpoint = load_checkpoint(self.path, map_location="cpu")
                check_resumable(checkpoint)
                step = int(checkpoint["global_step"])
            except (CheckpointError, KeyError, TypeError, ValueError) as exc:
                checkpoint, error = None, str(exc)
        if run.env.distributed:
            step, error = distributed.broadcast_object((step, error))
        if error is not None:
            raise CheckpointError(
                f"cannot resume from the preemption checkpoint {str(self.path)!r}: {error}. "
                f"An earlier attempt of this job wrote it; delete it to start afresh (or "
                f"resubmit the job: a new job's scratch folder is empty), or pass "
                f"fit(ckpt_path=...) to resume from another checkpoint"
            )
        if step is None:
            return None
        if run.env.distributed:
            if self._rank != 0:
                checkpoint = self._read_same(step)
            if distributed.any_rank(checkpoint is None, run.device):
                sent = distributed.broadcast_object(checkpoint if self._rank == 0 else None)
                checkpoint = checkpoint if checkpoint is not None else sent
        assert checkpoint is not None
        if self._rank == 0:
            _say(f"resumed from step {step}: preemption checkpoint {self.path}")
        return checkpoint

    def _read_same(self, step: int) -> dict[str, Any] | None:
        """This rank's copy of rank 0's file, if it can read the same one."""
        if not self.path.is_file():
            return None
        try:
            checkpoint = load_checkpoint(self.path, map_location="cpu")
        except CheckpointError:
            return None
        return checkpoint if checkpoint.get("global_step") == step else None

    # ---- stopping -------------------------------------------------------------
    def stop(self, trainer: Trainer, run: Run) -> None:
        """At a safe point, SIGTERM having come: save, tell the ranks, leave fit.

        Another rank gets here only when its loader has no next batch: it
        waits for rank 0's word, which ends it, up to the notice.
        """
        if self._rank != 0:
            if self._watcher is not None:
                self._watcher.join(timeout=self.notice or None)
            raise TrainerError(
                f"rank {self._rank} got SIGTERM and its training data ended (the "
                f"DataLoader's workers were stopped), but rank 0 did not save a "
                f"preemption checkpoint within the {self.notice:g} s notice"
            )
        dropped = (
            0
            if trainer.at_step_boundary
            else trainer._loop.batches % max(1, trainer.accumulate_grad_batches)
        )
        started = time.monotonic()
        trainer.save_checkpoint(self.path)
        took = time.monotonic() - started
        step = trainer.global_step
        self._acted = True
        self._tell(_PREEMPTED, step)
        _say(
            f"preempted: checkpoint saved at step {step} to {self.path} in {took:.2f} s; "
            f"resuming on the next attempt"
        )
        if dropped:
            _say(
                f"the data ended after SIGTERM inside an accumulation window: the "
                f"{dropped} batch(es) accumulated since step {step} are not in it"
            )
        if self.notice and took > self.notice / 2:
            _say(
                f"warning: saving the preemption checkpoint took {took:.1f} s of the "
                f"{self.notice:g} s notice; raise the worker's kill grace"
            )
        raise Preempted(step, self.path)

    def after_loop(self, trainer: Trainer, run: Run) -> None:
        """The fit loop is over: the last safe point, then rank 0's word."""
        if self.requested:
            self.stop(trainer, run)
        self._tell(_DONE, trainer.global_step)
        if self._watcher is not None:
            # Rank 0 says done right after its loop, before any hook that
            # might wait for this rank; so this wait is short.
            self._watcher.join()
            self._watcher = None

    def finished(self) -> None:
        """``fit`` ended normally: the file is spent (rank 0 removes it)."""
        if self._rank == 0:
            self.path.unlink(missing_ok=True)

    def close(self, *, normal: bool) -> None:
        """Put the previous SIGTERM handler back; re-deliver a signal not acted on."""
        self._tell(_DONE, 0)  # rank 0 leaving on an error: the watchers end
        if self._watcher is not None and not normal:
            # Leaving on an error: its watcher ends when rank 0's word comes
            # (rank 0 failing too sends it); a fit tried again in this
            # process must not keep one more group (threads, connections).
            self._watcher.join(timeout=_WATCHER_JOIN_S)
            if not self._watcher.is_alive():
                self._watcher = None
        if self._group is not None and self._watcher is None:
            with contextlib.suppress(Exception):  # (a group its peers already left)
                dist.destroy_process_group(self._group)
            self._group = None
        if not self._installed:
            return
        self._installed = False
        # None: the handler was set outside Python (an embedding host): the
        # default, rather than ours left to swallow every later SIGTERM.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)
        if self._sigchld is not None and signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL:
            signal.signal(signal.SIGCHLD, self._sigchld)
        if normal and self.received and not self._acted:
            # The signal came too late to act on (or to a rank that does not
            # decide): whoever sent it still gets what it asked for.
            signal.raise_signal(signal.SIGTERM)
