"""``gpulayer worker start``, and how it stops on a signal."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import click

from .root import main


@main.group()
def worker() -> None:
    """Run a worker that takes tasks from a server."""


@worker.command("start")
@click.option(
    "--gpus",
    "gpu_choice",
    default="all",
    show_default=True,
    metavar="all|none|VENDOR|LIST",
    help="GPUs to offer: all, none (a CPU worker), a vendor (nvidia, amd), or indexes such "
    "as 0,2 (nvidia:0,2 on a machine with both vendors).",
)
@click.option(
    "--slots", type=int, help="Slots of a worker without GPUs (default 1; else one per GPU)."
)
@click.option("--name", help="A name for this worker (default: host-pid).")
@click.option("--cache", type=click.Path(file_okay=False), help="Where fetched blobs are cached.")
@click.option(
    "--advertise",
    metavar="ADDR",
    help="Address other machines reach this worker at (default: the one it reaches the server from).",
)
@click.option(
    "--kill-grace",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL when a task is cancelled or times out.",
)
@click.option(
    "--max-output-bytes",
    "max_output",
    metavar="SIZE",
    help="The most one job's outputs may total, as 10G, 512M or bytes (default 10G); "
    "a job over it fails, and nothing of its outputs is stored.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="A file holding the worker's token, readable by its owner only "
    "(default: $GPULAYER_TOKEN, else $GPULAYER_TOKEN_FILE).",
)
@click.option(
    "--run-as",
    metavar="USER[,USER...]",
    help="Run jobs as this Unix user, not the worker's (the worker must run as root): "
    "they cannot read the worker's memory, token or files, nor write its cache. "
    "A comma-separated list names one user per slot, so that jobs running at the same "
    "time never share a user (nor can read each other's environment or files).",
)
@click.option(
    "--preload",
    metavar="MOD[,MOD...]",
    help="Modules the worker's ready interpreter imports, so that script jobs and their "
    "ranks start as its forks, with them imported (default: torch,numpy, those installed; "
    "an empty value: nothing).",
)
@click.option(
    "--no-warm",
    is_flag=True,
    help="Start every job in a new interpreter, never forked from a ready one.",
)
@click.pass_context
def worker_start(
    ctx: click.Context,
    gpu_choice: str,
    slots: int | None,
    name: str | None,
    cache: str | None,
    advertise: str | None,
    kill_grace: float,
    max_output: str | None,
    token_file: str | None,
    run_as: str | None,
    preload: str | None,
    no_warm: bool,
) -> None:
    """Offer this machine's slots to a server until stopped (SIGTERM or Ctrl-C).

    Its token comes from --token-file, $GPULAYER_TOKEN or $GPULAYER_TOKEN_FILE
    (not --token, which every local user sees in `ps`); its jobs get no token.
    """
    import signal

    from .. import defaults
    from ..artifacts import ArtifactStore
    from ..credentials import read_token_file
    from ..home import resolve_home
    from ..outputs import parse_size
    from ..transport.http import HttpTransport
    from ..worker.gpulocks import claim_gpus
    from ..worker.gpus import detect_gpus, select_gpus
    from ..worker.process import RunAs
    from ..worker.worker import Worker

    url = ctx.obj["server"]
    if not url:
        raise click.UsageError("a worker needs a server: --server URL or GPULAYER_SERVER")
    if token_file is not None and ctx.obj["token_on_command_line"]:
        raise click.UsageError(
            "the worker's token is given twice: with --token-file after `start`, give no "
            "--token or --token-file before `worker`"
        )
    token = read_token_file(token_file) if token_file is not None else ctx.obj["token"]
    try:
        max_output_bytes = (
            defaults.MAX_OUTPUT_BYTES if max_output is None else parse_size(max_output)
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-output-bytes") from None
    try:
        gpus = select_gpus(detect_gpus() if gpu_choice != "none" else [], gpu_choice)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpus") from None
    if run_as is not None:  # a worker that cannot, says so before it claims anything
        RunAs.for_slots(run_as, len(gpus) if gpus else (slots or 1))
    if no_warm and preload is not None:
        raise click.UsageError("--preload is for the ready interpreter, which --no-warm turns off")
    preloaded = None if preload is None else _module_list(preload)
    # Those another worker on this machine offers are left to it (all, or a
    # vendor's); GPUs named one by one are claimed all, or refused.
    claim = claim_gpus(gpus, all_of_them=gpu_choice.strip().lower() not in ("all", "nvidia", "amd"))
    for left_out in claim.taken:
        click.echo(f"gpulayer: not offering {left_out}", err=True)
    home = resolve_home(ctx.obj["home"])
    transport = HttpTransport(url, token=token, ca_file=ctx.obj["ca_file"])
    stop = _StopRequest()
    node: Worker | None = None
    # Before the worker is made (its GPUs detected, its warden forked): a
    # signal meanwhile exits as one before it serves does.
    on_signal = _stop_on_signal(stop, lambda: node is not None and node.serving)
    stop.wake_on_signals()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    def goodbye(worker_id: str, generation: str | None) -> None:
        # In the worker's warden, another process: a connection of its own, one try.
        farewell = HttpTransport(
            url,
            token=token,
            ca_file=ctx.obj["ca_file"],
            timeout=defaults.WARDEN_GOODBYE_TIMEOUT_S,
            retries=1,
        )
        farewell.unregister_worker(worker_id, died=True, generation=generation)

    node = Worker(
        transport,
        cache=ArtifactStore(Path(cache) if cache else home / "worker-cache"),
        work_dir=home / "workers",
        name=name,
        slots=slots,
        gpus=claim.gpus,
        gpu_claim=claim,
        kill_grace=kill_grace,
        max_output_bytes=max_output_bytes,
        heartbeat_interval=defaults.HEARTBEAT_INTERVAL_S,
        address=advertise or transport.local_address(),
        ledger=True,
        warden=True,
        warden_goodbye=goodbye,
        on_give_up=stop.set,
        run_as=run_as,
        warm=False if no_warm else None,
        preload=preloaded,
    )
    node.start()
    click.echo(
        f"gpulayer: worker {node.id} ({len(node.info.slot_gpus)} slots) serving {url}", err=True
    )
    stop.wait()
    # Its stop may take a while (a server that stopped answering): a second
    # signal ends it at once, and the warden ends the tasks left.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _exit_now)
    why = f": {node.gave_up}" if node.gave_up else ""
    click.echo(f"gpulayer: worker {node.id} stopping{why}", err=True)
    node.stop(timeout=30)
    if node.gave_up:
        ctx.exit(1)


def _module_list(text: str) -> list[str]:
    """``--preload``'s modules, each a dotted name of identifiers."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise click.BadParameter(
                f"{name!r} is not a module name (as torch or numpy.linalg)",
                param_hint="--preload",
            )
    return names


class _StopRequest:
    """Asks a worker's main thread to stop it: from a signal handler, or
    from the worker's own thread when it gives up.

    A handler runs between two bytecodes of the main thread, wherever it
    is, so it must take no lock: one the main thread holds there (a
    ``threading.Event``'s, inside its ``wait()`` or ``set()``) would be
    waited on for ever. A byte written to a pipe takes none."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a storm of signals never blocks

    def wake_on_signals(self) -> int:
        """Have any signal with a Python handler write to the pipe as it
        arrives; the previous such descriptor. A Python handler runs in the
        main thread only once its read returns, or is interrupted: a signal
        that comes just before the read starts would interrupt nothing, and
        its handler would wait for ever (a lost wake-up). In C it cannot."""
        import signal

        return signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: a byte waits already
            os.write(self._write, b"x")

    def wait(self) -> None:
        os.read(self._read, 1)


def _exit_now(signum: int, _frame: object) -> None:
    """A second stop signal: exit now (no Python lock taken, as any handler)."""
    with contextlib.suppress(OSError):
        os.write(2, b"gpulayer: stopping at once; the warden ends the tasks left\n")
    os._exit(128 + signum)


def _stop_on_signal(
    stop: _StopRequest, serving: Callable[[], bool]
) -> Callable[[int, object], None]:
    """A worker's SIGTERM and SIGINT handler: exit at once while it takes
    no task (its start says goodbye), else ask the main thread to stop it."""

    def on_signal(signum: int, _frame: object) -> None:
        if not serving():
            raise SystemExit(128 + signum)
        stop.set()

    return on_signal
