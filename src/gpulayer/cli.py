"""The ``gpulayer`` command: a thin layer over :class:`gpulayer.Client`."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .client import Client, Job
from .errors import GPUlayerError, SpecError

if TYPE_CHECKING:
    from .transport.http import HttpTransport

# How `gpulayer run` exits for each final state (a failed job passes its own code on).
EXIT_CODES = {"succeeded": 0, "failed": 1, "cancelled": 130, "timed_out": 124, "lost": 1}

SUBMIT_KEYS = (
    "script",
    "args",
    "command",
    "source",
    "inputs",
    "outputs",
    "env",
    "gpus",
    "nodes",
    "procs_per_node",
    "launcher",
    "priority",
    "max_retries",
    "timeout",
    "name",
    "labels",
)


def _pairs(values: Sequence[str], option: str) -> dict[str, str]:
    found = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected NAME=VALUE, got {value!r}", param_hint=option)
        found[key] = rest
    return found


@contextmanager
def _progress_bar(total: int, label: str) -> Iterator[Callable[[int], None]]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def _client(ctx: click.Context) -> Client:
    opts = ctx.obj
    if "client" not in opts:
        client = Client(
            opts["server"],
            token=opts["token"],
            home=opts["home"],
            progress=_progress_bar,
            ca_file=opts["ca_file"],
        )
        ctx.call_on_close(client.close)
        opts["client"] = client
    return opts["client"]  # type: ignore[no-any-return]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--home",
    envvar="GPULAYER_HOME",
    type=click.Path(file_okay=False),
    help="GPUlayer home (embedded mode).",
)
@click.option("--server", envvar="GPULAYER_SERVER", help="Control-plane URL (server mode).")
@click.option(
    "--token",
    help="API token for the server; visible to local users in `ps`: prefer $GPULAYER_TOKEN "
    "or --token-file.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="A file holding the API token, readable by its owner only "
    "(default: $GPULAYER_TOKEN, else $GPULAYER_TOKEN_FILE).",
)
@click.option(
    "--ca-file",
    envvar="GPULAYER_CA_FILE",
    type=click.Path(dir_okay=False, exists=True),
    help="CA certificate(s) to trust for an https server (default: the system's).",
)
@click.option("-v", "--verbose", is_flag=True, help="Say more about what happens.")
@click.version_option(package_name="gpulayer")
@click.pass_context
def main(
    ctx: click.Context,
    home: str | None,
    server: str | None,
    token: str | None,
    token_file: str | None,
    ca_file: str | None,
    verbose: bool,
) -> None:
    """Run ML jobs on the GPU machines you already own."""
    from .credentials import ON_COMMAND_LINE, find_token, keep_memory_private

    # Before a token is read: no other process of this user (a job, also one
    # of the local workers `run --workers` starts) can read this one's
    # environment or memory from here on (credentials.py).
    keep_memory_private()
    if token is not None:
        click.echo(f"gpulayer: warning: {ON_COMMAND_LINE}", err=True)
    # A worker's jobs inherit its environment: its token leaves it.
    worker = ctx.invoked_subcommand == "worker"
    found = find_token(token=token, token_file=token_file, forget=worker)
    ctx.obj = {"home": home, "server": server, "token": found, "ca_file": ca_file}
    ctx.obj["token_on_command_line"] = token is not None or token_file is not None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("gpulayer: %(message)s"))
    root = logging.getLogger("gpulayer")
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def _load_yaml(path: str) -> dict[str, Any]:
    import yaml

    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SpecError("file", f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError("file", f"{path} must hold a mapping of job fields")
    unknown = sorted(set(data) - set(SUBMIT_KEYS))
    if unknown:
        raise SpecError(
            unknown[0], f"unknown field in {path}; known fields: {', '.join(SUBMIT_KEYS)}"
        )
    base = file.resolve().parent
    for key in ("script", "source"):
        if isinstance(data.get(key), str):
            data[key] = str(base / data[key])
    if isinstance(data.get("inputs"), dict):
        data["inputs"] = {k: str(base / str(v)) for k, v in data["inputs"].items()}
    return data


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@click.argument("target", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "-f",
    "--file",
    "job_file",
    type=click.Path(dir_okay=False, exists=True),
    help="A job described in YAML.",
)
@click.option("--gpus", type=int, help="Whole GPUs per node.")
@click.option("--nodes", type=int, help="Nodes (tasks) for a distributed job.")
@click.option("--procs-per-node", type=int, help="Ranks per node.")
@click.option(
    "--launcher", type=click.Choice(["direct", "torchrun"]), help="Launcher for distributed jobs."
)
@click.option(
    "--input", "inputs", multiple=True, metavar="NAME=PATH", help="A file or folder the job reads."
)
@click.option(
    "--output",
    "outputs",
    multiple=True,
    metavar="PATH",
    help="A path (or glob) to keep when it ends.",
)
@click.option(
    "--env", "env", multiple=True, metavar="K=V", help="An environment variable for the job."
)
@click.option(
    "--secret",
    "secrets",
    multiple=True,
    metavar="NAME[=VALUE]",
    help="An environment variable whose value is stored encrypted and never shown back; "
    "NAME alone passes this shell's $NAME.",
)
@click.option(
    "--env-file",
    "env_files",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True),
    help="A file of NAME=VALUE lines, each passed as a --secret.",
)
@click.option("--label", "labels", multiple=True, metavar="K=V", help="A label to find the job by.")
@click.option(
    "--source",
    type=click.Path(file_okay=False, exists=True),
    help="Folder to ship (default: the script's).",
)
@click.option("--priority", type=int, help="Higher runs first.")
@click.option("--retries", "max_retries", type=int, help="Times to retry a failed or lost job.")
@click.option("--timeout", type=float, help="Seconds before the job is terminated.")
@click.option("--name", help="A name for the job.")
@click.option(
    "--workers",
    type=int,
    help="Local workers to start (default: 1 embedded, none with a server).",
)
@click.option("--slots", type=int, help="Slots per local CPU worker (GPU workers: one per GPU).")
@click.option(
    "--follow/--detach", default=True, help="Stream logs and wait (default), or return at once."
)
@click.option(
    "--download/--no-download", default=True, help="Fetch outputs into gpulayer_runs/ at the end."
)
@click.pass_context
def run(
    ctx: click.Context,
    /,
    target: str | None,
    args: tuple[str, ...],
    job_file: str | None,
    workers: int | None,
    slots: int | None,
    follow: bool,
    download: bool,
    **flags: Any,
) -> None:
    """Run TARGET (a .py script, or any command) as a job.

    Logs stream to this terminal and the command exits with the job's exit
    code. GPUlayer's own options may come before or after TARGET; arguments
    it does not know go to the job. After `--`, everything goes to the job.
    """
    fields = _load_yaml(job_file) if job_file else {}
    if target is not None:
        if target.endswith(".py"):
            fields["script"], fields["args"] = target, list(args)
        else:
            fields["command"], fields["args"] = [target, *args], []
    if "script" not in fields and "command" not in fields:
        raise click.UsageError("give a script or command to run, or -f job.yaml")
    for key, option in (("inputs", "--input"), ("env", "--env"), ("labels", "--label")):
        if flags[key]:
            fields[key] = {**fields.get(key, {}), **_pairs(flags[key], option)}
    if flags["outputs"]:
        fields["outputs"] = [*fields.get("outputs", []), *flags["outputs"]]
    secrets = _secrets(flags["env_files"], flags["secrets"])
    if secrets:
        fields["secrets"] = secrets
    for key in _pairs(flags["env"], "--env"):
        if _CREDENTIAL_NAME.search(key):
            click.echo(
                f"gpulayer: warning: --env {key} is stored and shown in plain text; "
                f"a credential goes in --secret {key}",
                err=True,
            )
    for key in (
        "gpus",
        "nodes",
        "procs_per_node",
        "launcher",
        "source",
        "priority",
        "max_retries",
        "timeout",
        "name",
    ):
        if flags[key] is not None:
            fields[key] = flags[key]
    client = _client(ctx)
    if not follow and ctx.obj["server"] is None:
        raise click.UsageError(
            "--detach needs a server: an embedded job runs only while this command does"
        )
    if workers is None:  # embedded: enough local workers for every node
        workers = 0 if ctx.obj["server"] else max(1, int(fields.get("nodes", 1)))
    if workers:
        client.ensure_local_workers(workers, slots=slots)
    job = client.submit(**fields)
    click.echo(f"gpulayer: job {job.id} submitted", err=True)
    if not follow:
        click.echo(job.id)
        return
    try:
        _stream(job)
        state = job.wait()
    except KeyboardInterrupt:
        click.echo(f"\ngpulayer: cancelling job {job.id}", err=True)
        state = job.cancel()
        state = job.wait()
    info = job.info
    total = info.timings().get("total")
    took = f" in {total:.2f} s" if total is not None else ""
    click.echo(f"gpulayer: job {job.id} {state}{took}", err=True)
    if info.reason:  # why it failed; for a success, e.g. a declared output that is missing
        click.echo(f"gpulayer: {info.reason.splitlines()[0]}", err=True)
    if download and info.outputs:
        click.echo(f"gpulayer: outputs in {job.download_outputs()}", err=True)
    code = EXIT_CODES.get(state, 1)
    if state == "failed" and info.exit_code:
        code = info.exit_code if info.exit_code > 0 else 128 - info.exit_code
    ctx.exit(code)


# Names of variables that usually hold a credential (said of an --env).
_CREDENTIAL_NAME = re.compile(
    r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE
)


def _secrets(env_files: Sequence[str], given: Sequence[str]) -> dict[str, str]:
    """A job's secrets: each --env-file's lines, then each --secret. Errors
    name what is wrong, never a value."""
    from .secretbox import read_env_file

    found: dict[str, str] = {}
    for path in env_files:
        found.update(read_env_file(path))
    visible = False
    for item in given:
        name, sep, value = item.partition("=")
        if not name:
            raise click.BadParameter("expected NAME or NAME=VALUE", param_hint="--secret")
        if not sep:
            if name not in os.environ:
                raise click.BadParameter(
                    f"${name} is not set here; set it, or give {name}=VALUE",
                    param_hint="--secret",
                )
            value = os.environ[name]
        visible = visible or bool(sep)
        found[name] = value
    if visible:
        click.echo(
            "gpulayer: warning: a --secret NAME=VALUE is visible to every user of this "
            "machine (in `ps`) while this command runs; --secret NAME (from this shell's "
            "environment) and --env-file FILE are not",
            err=True,
        )
    return found


def _stream(job: Job) -> None:
    out, err = sys.stdout, sys.stderr
    for line in job.stream_logs(follow=True):
        stream = out if line.stream == "stdout" else err
        stream.write(line.render() + "\n")
        stream.flush()


@main.command()
@click.option("--state", "states", multiple=True, help="Only jobs in this state (repeatable).")
@click.option("--limit", type=int, default=50, show_default=True)
@click.pass_context
def jobs(ctx: click.Context, states: tuple[str, ...], limit: int) -> None:
    """List jobs, newest first."""
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None)
    for column in ("ID", "USER", "NAME", "STATE", "EXIT", "GPUS", "WORKER", "SUBMITTED", "TOOK"):
        table.add_column(column, no_wrap=True, max_width=28 if column == "NAME" else None)
    for job in _client(ctx).jobs(state=states or None, limit=limit):
        info = job.info
        took = info.timings().get("total")
        submitted = info.marks.get("submitted")
        table.add_row(
            info.id,
            info.user or "-",
            info.spec.name or _what(info.spec),
            _state(info.state),
            "" if info.exit_code is None else str(info.exit_code),
            str(info.spec.gpus),
            info.worker or "",
            time.strftime("%m-%d %H:%M:%S", time.localtime(submitted)) if submitted else "",
            "" if took is None else f"{took:.2f}s",
        )
    Console().print(table)


def _what(spec: Any) -> str:
    what = spec.script or " ".join(spec.command or [])
    return what if len(what) <= 40 else what[:37] + "..."


def _state(state: str) -> str:
    colour = {
        "succeeded": "green",
        "failed": "red",
        "running": "cyan",
        "queued": "yellow",
        "timed_out": "red",
        "lost": "red",
        "cancelled": "magenta",
    }.get(state, "white")
    return f"[{colour}]{state}[/]"


@main.command()
@click.argument("job_id")
@click.pass_context
def show(ctx: click.Context, job_id: str) -> None:
    """Everything about one job, with where its time went."""
    from rich.console import Console
    from rich.table import Table

    info = _client(ctx).job(job_id).info
    console = Console()
    spec = info.spec
    rows: Mapping[str, object] = {
        "id": info.id,
        "user": info.user or "- (submitted before jobs had users, or by an admin without one)",
        "name": spec.name,
        "state": _state(info.state),
        "exit code": info.exit_code,
        "run": _what(spec) + (" " + " ".join(spec.args) if spec.args and spec.script else ""),
        "gpus": spec.gpus,
        "priority": spec.priority,
        "attempt": (
            f"{info.attempt} ({info.given_back} given back unrun, not counted)"
            if info.given_back
            else info.attempt
        ),
        "retries allowed": spec.max_retries,
        "timeout": spec.timeout,
        "ranks": (
            f"{spec.world_size}: {spec.nodes} node(s) x {spec.procs_per_node}, "
            f"{spec.launcher or 'direct'} launcher"
            if spec.distributed
            else None
        ),
        "worker": info.worker
        if not info.tasks
        else ", ".join(f"node {t.node}: {t.worker}" for t in info.tasks),
        "gpu ids": ",".join(map(str, info.gpus)) or None,
        "labels": ", ".join(f"{k}={v}" for k, v in spec.labels.items()) or None,
        "secrets": ", ".join(sorted(spec.secrets)) or None,  # names only: values never show
        # What all its processes used (kept with its marks), where measured.
        "cpu seconds": f"{info.marks['cpu_s']:.3f}" if "cpu_s" in info.marks else None,
        "peak memory": _mib(info.marks["peak_memory"]) if "peak_memory" in info.marks else None,
    }
    table = Table(box=None, show_header=False)
    for key, value in rows.items():
        if value is not None:
            table.add_row(f"[bold]{key}", str(value))
    console.print(table)
    if info.reason:
        title = "why it waits" if info.state == "queued" else "reason"
        console.print(f"[bold]{title}:[/] {info.reason}")
    timings = info.timings()
    if timings:
        t = Table("stage", "seconds", box=None, title="timings")
        for stage, seconds in timings.items():
            t.add_row(stage, f"{seconds:.4f}")
        console.print(t)
    if info.outputs:
        t = Table("output", "kind", "bytes", "digest", box=None)
        for path, ref in info.outputs.items():
            t.add_row(path, ref.kind, str(ref.size), ref.digest[:16])
        console.print(t)


def _mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB (page cache included)"


@main.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the job ends.")
@click.pass_context
def logs(ctx: click.Context, job_id: str, follow: bool) -> None:
    """Print a job's output."""
    job = _client(ctx).job(job_id)
    for line in job.stream_logs(follow=follow):
        click.echo(line.text, err=line.stream != "stdout")


@main.command()
@click.argument("job_id")
@click.pass_context
def cancel(ctx: click.Context, job_id: str) -> None:
    """Cancel a job: queued ones never start, running ones are terminated."""
    job = _client(ctx).job(job_id)
    state = job.cancel()
    click.echo(f"job {job.id}: {state}{' (cancel requested)' if state == 'running' else ''}")


@main.command()
@click.pass_context
def workers(ctx: click.Context) -> None:
    """List the workers connected to the control plane."""
    from rich.console import Console
    from rich.table import Table

    table = Table("ID", "NAME", "HOST", "SLOTS", "GPUS", "CONTAINMENT", "RUNNING", box=None)
    for w in _client(ctx).workers():
        gpus = ", ".join(w.gpu_names) if w.gpu_names else "-"
        table.add_row(
            w.id,
            w.name,
            w.host,
            str(len(w.slot_gpus)),
            gpus,
            w.containment or "-",
            ", ".join(w.running) or "-",
        )
    Console().print(table)


def _main() -> None:
    try:
        main(standalone_mode=True)
    except GPUlayerError as exc:
        click.echo(f"gpulayer: error: {exc}", err=True)
        sys.exit(2)


@main.group()
def server() -> None:
    """Run the control plane as an HTTP server."""


@server.command("start")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8585, show_default=True)
@click.option("--no-auth", is_flag=True, help="No tokens (only allowed on a loopback address).")
@click.option(
    "--tls-cert", type=click.Path(dir_okay=False, exists=True), help="TLS certificate (PEM)."
)
@click.option(
    "--tls-key", type=click.Path(dir_okay=False, exists=True), help="TLS private key (PEM)."
)
@click.option(
    "--heartbeat-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds of silence before a worker is declared lost.",
)
@click.pass_context
def server_start(
    ctx: click.Context,
    host: str,
    port: int,
    no_auth: bool,
    tls_cert: str | None,
    tls_key: str | None,
    heartbeat_timeout: float,
) -> None:
    """Serve the API; state lives in the GPUlayer home."""
    from .home import resolve_home
    from .http.server import Server

    srv = Server(
        resolve_home(ctx.obj["home"]),
        host=host,
        port=port,
        auth_enabled=not no_auth,
        tls_cert=tls_cert,
        tls_key=tls_key,
        heartbeat_timeout=heartbeat_timeout,
    )
    sock = srv.bind()
    # Said once it listens: whoever started it may connect as soon as it reads this.
    click.echo(f"gpulayer: serving {srv.url} (home {srv.home.path})", err=True)
    if srv.admin_token:
        click.echo(
            f"gpulayer: admin token (shown once; also in {srv.home.path / 'admin-token'}):",
            err=True,
        )
        click.echo(srv.admin_token)
    srv.serve(sock)


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
) -> None:
    """Offer this machine's slots to a server until stopped (SIGTERM or Ctrl-C).

    Its token comes from --token-file, $GPULAYER_TOKEN or $GPULAYER_TOKEN_FILE
    (not --token, which every local user sees in `ps`); its jobs get no token.
    """
    import signal

    from . import defaults
    from .artifacts import ArtifactStore
    from .credentials import read_token_file
    from .home import resolve_home
    from .outputs import parse_size
    from .transport.http import HttpTransport
    from .worker.gpulocks import claim_gpus
    from .worker.gpus import detect_gpus, select_gpus
    from .worker.process import RunAs
    from .worker.worker import Worker

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


@main.group()
def token() -> None:
    """Manage API tokens (needs an admin token)."""


def _admin_transport(ctx: click.Context) -> HttpTransport:
    from .transport.http import HttpTransport

    if not ctx.obj["server"]:
        raise click.UsageError("tokens belong to a server: --server URL or GPULAYER_SERVER")
    transport = HttpTransport(ctx.obj["server"], token=ctx.obj["token"], ca_file=ctx.obj["ca_file"])
    ctx.call_on_close(transport.close)
    return transport


_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_TEN_YEARS_S = 10 * 365 * 86400  # as the server's limit


def _duration(value: str | None) -> float | None:
    """Seconds in ``90m``, ``12h``, ``30d``, ``2w`` or ``3600``."""
    if value is None:
        return None
    match = _DURATION.fullmatch(value)
    seconds = float(match[1]) * _UNIT_S[match[2]] if match else 0.0
    if not 0 < seconds <= _TEN_YEARS_S:  # also inf, from a number too long
        raise click.BadParameter(
            f"{value!r} is not a duration of at most ten years; give one such as 90m, 12h, "
            "30d or 2w",
            param_hint="--expires-in",
        )
    return seconds


@token.command("create")
@click.option("--role", type=click.Choice(["worker", "user", "admin"]), required=True)
@click.option("--name", help="What the token is for.")
@click.option(
    "--user",
    help="The user it acts as: whose jobs it submits and sees (needed for --role user; "
    "an admin token may have one; a worker token has none).",
)
@click.option(
    "--expires-in",
    metavar="DURATION",
    help="Refuse it after this long (90m, 12h, 30d, 2w; default: valid until revoked).",
)
@click.pass_context
def token_create(
    ctx: click.Context, role: str, name: str | None, user: str | None, expires_in: str | None
) -> None:
    """Make a token and print it (it is shown only this once)."""
    seconds = _duration(expires_in)
    if role == "user" and user is None:
        raise click.UsageError(
            "a user token needs --user NAME: the user whose jobs it submits and sees"
        )
    click.echo(_admin_transport(ctx).create_token(role, name, user=user, expires_in=seconds))


@token.command("list")
@click.pass_context
def token_list(ctx: click.Context) -> None:
    """List the server's tokens, oldest first: id, role, user, name, when
    made, when it expires."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    def when(at: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))

    table = Table("ID", "ROLE", "USER", "NAME", "CREATED", "EXPIRES", box=None)
    now = time.time()
    for made in _admin_transport(ctx).list_tokens():
        if made.expires is None:
            expires = "never"
        else:
            expires = when(made.expires) + (" (expired)" if made.expires <= now else "")
        name = escape(made.name) if made.name else "-"
        user = escape(made.user) if made.user else "-"
        table.add_row(made.id, made.role, user, name, when(made.created), expires)
    Console().print(table)


@token.command("revoke")
@click.argument("token_id", metavar="ID")
@click.pass_context
def token_revoke(ctx: click.Context, token_id: str) -> None:
    """Revoke the token with this ID (as `token list` shows it): the server
    refuses it from its next request on."""
    _admin_transport(ctx).revoke_token(token_id)
    click.echo(f"token {token_id} revoked")


if __name__ == "__main__":
    _main()
