"""Verbs on jobs: ``jobs``, ``show``, ``logs``, ``cancel``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import click

from .root import _client, main


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
