"""Verbs on jobs: ``jobs``, ``show``, ``logs`` (``cancel`` is in actions.py).

How each prints (terminal, pipe, ``--json``) is output.py's business.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import click

from .. import defaults
from ..arrays import span, tally
from ..client import Job
from ..jobs import QUEUED, STATES, WARM, JobInfo, LogLine
from ..projects import DEFAULT_PROJECT
from . import output
from .output import Column, Styled
from .root import _client, main

_JSON_HELP = "Print JSON for scripts (see docs/json-output.md)."

# The columns of `gpulayer jobs`. On a terminal the wide ones are cut to fit;
# piped, nothing is.
JOB_COLUMNS = (
    Column("ID"),
    Column("USER"),
    Column("PROJECT"),
    Column("NAME", max_width=28),
    Column("STATE"),
    Column("EXIT"),
    Column("GPUS"),
    Column("WORKER"),
    Column("SUBMITTED"),
    Column("TOOK"),
    Column("REASON", max_width=40),  # why a queued job waits, as squeue's NODELIST(REASON)
    Column("TASKS", max_width=40),  # an array's tasks by state
)


@main.command()
@click.option(
    "--state",
    "states",
    multiple=True,
    help=f"Only jobs in this state (repeatable): {', '.join(STATES)}.",
)
@click.option(
    "--label",
    "labels",
    multiple=True,
    metavar="K=V",
    help="Only jobs with this label (repeatable: all must match).",
)
@click.option(
    "--array", "array", metavar="JOB", help="The tasks of this array, by index, not the jobs."
)
@click.option("--limit", type=int, default=defaults.JOBS_LISTED, show_default=True)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@click.pass_context
def jobs(
    ctx: click.Context,
    states: tuple[str, ...],
    labels: tuple[str, ...],
    array: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List jobs, newest first, an array as one row with its tasks by state.
    Piped, one tab-separated line each, nothing cut."""
    listed = _client(ctx).jobs(
        state=states or None, limit=limit, labels=_labels(labels), array=array
    )
    found = [job.info for job in listed]  # a queued one's says why it waits
    if as_json:
        output.print_json([output.job_object(info) for info in found])
    else:
        output.table(JOB_COLUMNS, [_job_row(info) for info in found])


def _labels(values: tuple[str, ...]) -> dict[str, str]:
    found = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected K=V, got {value!r}", param_hint="--label")
        found[key] = rest
    return found


def _job_row(info: JobInfo) -> list[output.Cell]:
    took = info.timings().get("total")
    submitted = info.marks.get("submitted")
    # A person reads month and time; a program gets the whole date, which sorts.
    when = "%m-%d %H:%M:%S" if output.to_terminal() else "%Y-%m-%dT%H:%M:%S%z"
    return [
        info.id,
        info.user,
        info.spec.project or DEFAULT_PROJECT,
        info.spec.name or _what(info.spec),
        _state(info.state),
        None if info.exit_code is None else str(info.exit_code),
        str(info.spec.gpus),
        info.worker,
        time.strftime(when, time.localtime(submitted)) if submitted else None,
        None if took is None else f"{took:.2f}s",
        info.reason if info.state == QUEUED and not info.spec.array else None,
        tally(info.array_states) if info.spec.array else None,
    ]


def _what(spec: Any) -> str:
    what = str(spec.script or " ".join(spec.command or []))
    if spec.array_task is not None:
        return f"{what} [{spec.array_task.index}]"
    return f"{what} [{len(spec.array)} tasks]" if spec.array else what


_STATE_COLOURS = {
    "succeeded": "green",
    "failed": "red",
    "running": "cyan",
    "queued": "yellow",
    "timed_out": "red",
    "lost": "red",
    "cancelled": "magenta",
}


def _state(state: str) -> Styled:
    return Styled(state, _STATE_COLOURS.get(state, "white"))


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@click.pass_context
def show(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Everything about one job, with where its time went."""
    info = _client(ctx).job(job_id).info
    if as_json:
        output.print_json(output.job_object(info))
        return
    spec = info.spec
    rows: dict[str, output.Cell | int | float | None] = {
        "id": info.id,
        "user": info.user or "- (submitted before jobs had users, or by an admin without one)",
        "project": spec.project or DEFAULT_PROJECT,
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
        "start": _start(info),
        "labels": ", ".join(f"{k}={v}" for k, v in spec.labels.items()) or None,
        "secrets": ", ".join(sorted(spec.secrets)) or None,  # names only: values never show
        # What all its processes used (kept with its marks), where measured.
        "cpu seconds": f"{info.marks['cpu_s']:.3f}" if "cpu_s" in info.marks else None,
        "peak memory": _mib(info.marks["peak_memory"]) if "peak_memory" in info.marks else None,
        "array": (
            f"{len(spec.array)} tasks ({span(spec.array)})"
            + (f", at most {spec.max_parallel} at once" if spec.max_parallel else "")
            if spec.array
            else None
        ),
        "tasks": tally(info.array_states) or None if spec.array else None,
        "array task": (
            f"{spec.array_task.array}:{spec.array_task.index}" if spec.array_task else None
        ),
    }
    output.fields(
        {
            key: value if isinstance(value, Styled) else str(value)
            for key, value in rows.items()
            if value is not None
        }
    )
    if info.reason and not (spec.array and not info.done):  # (its tasks, above)
        output.paragraph("why it waits" if info.state == QUEUED else "reason", info.reason)
    timings = info.timings()
    if timings:
        output.table(
            (Column("stage"), Column("seconds")),
            [(stage, f"{seconds:.4f}") for stage, seconds in timings.items()],
            title="timings",
        )
    if info.outputs:
        output.table(
            (Column("output"), Column("kind"), Column("bytes"), Column("digest", max_width=17)),
            [(path, ref.kind, str(ref.size), ref.digest) for path, ref in info.outputs.items()],
            title="outputs",
        )


def _start(info: JobInfo) -> str | None:
    """Which start the job had, for people: ``warm``, or ``cold (why)``, with
    the node that started cold in a job of several. The text is its worker's:
    output.fields escapes it like every cell."""
    start = info.start
    if start is None:
        return None
    if start == WARM:
        return WARM
    kind, sep, why = start.partition(": ")
    shown = f"cold ({why})" if kind == "cold" and sep else start
    cold = [t.node for t in info.tasks if t.start == start]
    return f"{shown} on node {cold[0]}" if len(info.tasks) > 1 and cold else shown


def _mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB (page cache included)"


@main.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the job ends.")
@click.option(
    "--tail",
    type=click.IntRange(min=0),
    metavar="N",
    help="Only the last N lines (with -f: the last N, then what follows).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object per line (see docs/json-output.md)."
)
@click.pass_context
def logs(ctx: click.Context, job_id: str, follow: bool, tail: int | None, as_json: bool) -> None:
    """Print a job's output (a distributed job's lines tagged with their rank;
    an array's, each task's in turn, tagged with its index: JOB:7 for one)."""
    client = _client(ctx)
    job = client.job(job_id)
    per_node = job.info.spec.procs_per_node
    if job.info.spec.array:
        if follow:
            first = job.info.spec.array[0]
            raise click.UsageError(
                f"job {job.id} is an array: follow one of its tasks ({job.id}:{first}), "
                "or leave out --follow for every task's lines so far"
            )
        tasks = client.jobs(array=job)  # every one
        pieces = [(t, f"[{t.info.spec.array_task.index}] ") for t in tasks if t.info.attempt]  # type: ignore[union-attr]
    else:
        pieces = [(job, "")]
    for part, tag in pieces:
        for line in _lines(part, follow=follow, tail=tail):
            if as_json:
                shown = output.log_object(line, per_node)
                if tag:
                    shown["array_index"] = part.info.spec.array_task.index  # type: ignore[union-attr]
                output.print_json_line(shown)
            else:
                click.echo(tag + line.render(), err=line.stream != "stdout")


def _lines(job: Job, *, follow: bool, tail: int | None) -> Iterator[LogLine]:
    if tail is None:
        yield from job.stream_logs(follow=follow)
        return
    # The client has no tail: read to the end keeping only the last N lines
    # (memory bounded by N, not by the log), then, to follow, read again
    # from the start, passing over the lines already read.
    ended = job.info.done  # then the first read has every line
    last: deque[LogLine] = deque(maxlen=tail)
    read = 0
    for line in job.stream_logs(follow=False):
        last.append(line)
        read += 1
    yield from last
    if follow and not ended:
        for index, line in enumerate(job.stream_logs(follow=True)):
            if index >= read:
                yield line
