"""Verbs that act on jobs already submitted: ``cancel``, ``download``, ``rerun``."""

from __future__ import annotations

import signal

import click

from ..client import Client, Job
from ..errors import GPUlayerError, InvalidStateError
from ..transport import label_pairs
from .root import _client, main
from .run import EXIT_CODES, _interrupt, _secrets, _stream


def _said(job: Job, state: str) -> str:
    return f"job {job.id}: {state}{' (cancel requested)' if state == 'running' else ''}"


@main.command()
@click.argument("job_ids", nargs=-1, metavar="[JOB]...")
@click.option(
    "--label",
    "labels",
    multiple=True,
    metavar="K=V",
    help="Cancel each of your queued or running jobs with this label "
    "(repeatable: a job must have them all).",
)
@click.pass_context
def cancel(ctx: click.Context, job_ids: tuple[str, ...], labels: tuple[str, ...]) -> None:
    """Cancel jobs: queued ones never start, running ones are terminated.

    Give the jobs (ids, or unique prefixes), or --label K=V for every queued
    or running job with those labels, or both. Each job that cannot be
    cancelled (no such job, already ended) is named; the others are still
    cancelled, and the command then exits with 1.
    """
    if not job_ids and not labels:
        raise click.UsageError("say which jobs to cancel: JOB... or --label K=V")
    wanted = label_pairs(labels)  # checked before anything is cancelled
    client = _client(ctx)
    failed = 0
    for job_id in job_ids:
        try:
            job = client.job(job_id)
            click.echo(_said(job, job.cancel()))
        except GPUlayerError as exc:
            click.echo(f"gpulayer: error: {exc}", err=True)
            failed += 1
    if wanted:
        cancelled = client.cancel_jobs(labels=wanted)
        for job in cancelled:
            click.echo(_said(job, job.info.state))
        which = " ".join(f"{key}={value}" for key, value in wanted.items())
        click.echo(f"gpulayer: cancelled {len(cancelled)} job(s) labelled {which}", err=True)
    if failed:
        ctx.exit(1)


@main.command()
@click.argument("job_id")
@click.option(
    "--to",
    "dest",
    type=click.Path(file_okay=False),
    help="The folder to write into (default: gpulayer_runs/JOB here).",
)
@click.pass_context
def download(ctx: click.Context, job_id: str, dest: str | None) -> None:
    """Fetch the outputs of a job that has ended, with its log (logs.txt).

    Prints the folder they are in. Nothing is written through a symbolic
    link, nor outside that folder.
    """
    job = _client(ctx).job(job_id)
    info = job.info
    if info.done and not info.outputs:
        why = (
            "it declared none (run it with --output PATH)"
            if not info.spec.outputs
            else f"none of its declared outputs ({', '.join(info.spec.outputs)}) was there"
        )
        raise InvalidStateError(
            f"job {job.id} ({info.state}) has no outputs to download: {why}; "
            f"its log: gpulayer logs {job.id}"
        )
    folder = job.download_outputs(dest)  # refuses a job that has not ended
    click.echo(f"gpulayer: {len(info.outputs)} output(s) of job {job.id}, and logs.txt", err=True)
    click.echo(str(folder))


@main.command()
@click.argument("job_id")
@click.option(
    "--secret",
    "secrets",
    multiple=True,
    metavar="NAME[=VALUE]",
    help="A secret of the job, given again (its value is never handed back); "
    "NAME alone passes this shell's $NAME.",
)
@click.option(
    "--follow/--detach",
    default=None,
    help="Stream its logs and exit with its code, or print its id and return "
    "(default: detach with a server; embedded, a job runs only while this command does).",
)
@click.pass_context
def rerun(ctx: click.Context, job_id: str, secrets: tuple[str, ...], follow: bool | None) -> None:
    """Submit a new job with the spec of JOB: the same bundle, inputs and env."""
    embedded = ctx.obj["server"] is None
    if follow is False and embedded:
        raise click.UsageError(
            "--detach needs a server: an embedded job runs only while this command does"
        )
    client = _client(ctx)
    given = _secrets((), secrets) if secrets else None
    old = client.job(job_id)
    job = client.rerun(old.id, secrets=given)
    click.echo(f"gpulayer: job {job.id} submitted, a rerun of {old.id}", err=True)
    click.echo(job.id)
    if follow or (follow is None and embedded):
        ctx.exit(_follow(client, job))


def _follow(client: Client, job: Job) -> int:
    """Stream the job to its end as ``run`` does (a signal cancels it);
    the exit code ``run`` would give."""
    for signum in (signal.SIGTERM, signal.SIGHUP):  # the job belongs to this command
        signal.signal(signum, _interrupt)
    try:
        _stream(job, client)
        state = job.wait()
    except KeyboardInterrupt:
        click.echo(f"\ngpulayer: cancelling job {job.id}", err=True)
        job.cancel()
        state = job.wait()
    click.echo(f"gpulayer: job {job.id} {state}", err=True)
    code = EXIT_CODES.get(state, 1)
    exit_code = job.info.exit_code
    if state == "failed" and exit_code:
        code = exit_code if exit_code > 0 else 128 - exit_code
    return code
