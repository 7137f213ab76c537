"""``gpulayer gc``: free what a home keeps of jobs that ended long ago."""

from __future__ import annotations

import click

from .. import defaults
from .root import _progress_bar, main


def _age(value: str | None) -> float:
    from ..durations import parse_duration

    if value is None:
        return defaults.HOME_GC_OLDER_THAN_S
    try:
        return parse_duration(value, zero=True)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from None


@main.command()
@click.option(
    "--older-than",
    "older_than",
    metavar="DURATION",
    help="Delete the jobs that ended longer ago than this (90m, 12h, 7d, 2w; 0: every "
    "job that ended; default 7d), with their logs; queued and running jobs are never "
    "deleted.",
)
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.pass_context
def gc(ctx: click.Context, older_than: str | None, dry_run: bool) -> None:
    """Free the home's old jobs, their logs, and the blobs no job left names.

    Then the blobs (bundles, inputs, outputs, the worker cache's) that no
    remaining job names and none used within a day, temp files older than a
    day, and the task folders no running worker uses. Prints what it freed.
    """
    import os

    from ..gc import collect
    from ..home import Home, resolve_home
    from ..store.sqlite import SqliteStore

    seconds = _age(older_than)
    if ctx.obj["server"]:
        raise click.UsageError(
            "gpulayer gc cleans an embedded home; cleaning a server's home is not "
            "supported yet: leave out --server (and GPULAYER_SERVER); nothing was removed"
        )
    path = resolve_home(ctx.obj["home"])
    if not (path / defaults.HOME_MARKER).is_file():
        click.echo(f"no GPUlayer home at {path}: nothing to clean")
        return
    home = Home(path)
    home.check_not_server()
    lock = home.claim_gc()
    try:
        store = SqliteStore(home.db)
        try:
            report = collect(
                home.path, store, older_than=seconds, dry_run=dry_run, progress=_progress_bar
            )
        finally:
            store.close()
    finally:
        os.close(lock)
    for note in report.notes:
        click.echo(f"gpulayer: {note}", err=True)
    click.echo(report.summary())
